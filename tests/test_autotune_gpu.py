"""The autotuner on a real GPU (marker `gpu`): a smoke run of the CLI end to end, the
same on two GPUs, and runtime autotune. Skipped on machines without an NVIDIA GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from tuning.autotune.tiers import measured_tiers
from tuning.autotune.workers import visible_gpus
from tuning.device import current_device, sanitize_device_name
from tuning.lookup import clear_cache, lookup_config
from tuning.schema import load_config_file

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, FFPA_AUTOTUNE_MAX_CONFIGS="4", PYTHONPATH=str(REPO),
               # This test process already holds JAX's default share of GPU memory.
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    return subprocess.run([sys.executable, "-m", "tuning.autotune", "--mode", "fast",
                           "--directions", "both", "--overwrite", "--output-dir", str(tmp_path),
                           *args], capture_output=True, text=True, cwd=REPO, env=env,
                          timeout=900)


def check_file(tmp_path: Path, entries: int) -> Path:
    name, _ = current_device()
    path = tmp_path / f"{sanitize_device_name(name)}.json"
    loaded = load_config_file(path)
    assert loaded is not None and loaded.skipped == 0
    assert len(loaded.entries) == entries
    assert loaded.header["autotune_status"]["failed"] == []
    return path


def test_smoke_autotune_end_to_end(tmp_path):
    done = run_cli(tmp_path, "--headdims", "64", "--seqlens", "1,512")
    assert done.returncode == 0, done.stderr[-4000:]
    # The first 4 tasks: decode stage 1 and 2 at Nkv = 512 (each also written as its
    # causal twin), then fwd_generic and bwd_preproc at T = S = 512: 6 entries. The tier
    # measurement then records each direction's tier at T = S = 512, causal and not, in
    # fwd_generic's and bwd_generic_dkdv's entries, adding the 3 that are absent.
    path = check_file(tmp_path, 9)
    tiered = [e for e in load_config_file(path).entries
              if e["kernel"] in ("fwd_generic", "bwd_generic_dkdv")]
    assert sorted((e["kernel"], e["causal"]) for e in tiered) == [
        ("bwd_generic_dkdv", False), ("bwd_generic_dkdv", True),
        ("fwd_generic", False), ("fwd_generic", True)]
    for entry in tiered:
        # Each direction's own tiers (those of the registry that run on this GPU).
        timed = measured_tiers("forward" if entry["kernel"] == "fwd_generic" else "backward")
        assert entry["tier"] in timed and entry["seqlen_q"] == 512
        assert set(entry["tier_ms"]) == set(timed)
        assert entry["tier_ms"][entry["tier"]] == min(entry["tier_ms"].values())
    # Where the directions' winners differ the pairs were timed in one program, and a
    # differentiated forward is named only where the backward's own pair was faster.
    by_causal = {(e["kernel"], e["causal"]): e for e in tiered}
    for causal in (False, True):
        forward, backward = by_causal[("fwd_generic", causal)], by_causal[
            ("bwd_generic_dkdv", causal)]
        pairs = forward.get("tier_pair_ms")
        assert (pairs is not None) == (forward["tier"] != backward["tier"])
        if pairs:
            own = pairs[f"{backward['tier']}/{backward['tier']}"]
            winners = pairs[f"{forward['tier']}/{backward['tier']}"]
            assert (forward.get("tier_differentiated") == backward["tier"]) == (own < winners)
    os.environ["FFPA_TUNED_CONFIG_DIR"] = str(tmp_path)
    clear_cache()
    try:
        for direction, kernel, seqlen_q in (("forward", "decode_fwd_stage1", 1),
                                            ("forward", "fwd_generic", 500),
                                            ("backward", "bwd_preproc", 500)):
            found = lookup_config(direction, kernel, dtype="bf16", headdim=64,
                                  seqlen_q=seqlen_q, seqlen_k=500, causal=seqlen_q == 1,
                                  bias_grad=False if direction == "backward" else None)
            assert found is not None, kernel
    finally:
        del os.environ["FFPA_TUNED_CONFIG_DIR"]
        clear_cache()


def test_smoke_autotune_two_gpus(tmp_path):
    if len(visible_gpus()) < 2:
        pytest.skip("needs 2 GPUs")
    done = run_cli(tmp_path, "--num-gpus", "2", "--seqlens", "512,1024", "--headdims", "64,128")
    assert done.returncode == 0, done.stderr[-4000:]
    # The first 4 tasks: fwd_generic, bwd_preproc, bwd_generic_dq and bwd_generic_dkdv at
    # D = 64, T = S = 512 (4 entries). The tier measurement then records each direction's
    # tier on the whole grid (2 head dims x 2 lengths x causal or not) in fwd_generic's and
    # bwd_generic_dkdv's entries: 16, of which 2 exist: 18.
    path = check_file(tmp_path, 18)
    tiered = [e for e in load_config_file(path).entries
              if e["kernel"] in ("fwd_generic", "bwd_generic_dkdv")]
    assert len(tiered) == 16 and all("tier" in e for e in tiered)


def test_the_mosaic_kernels_tune_where_they_run():
    """Both Mosaic kernels through the autotuner's measurement (sm90): the built-in config
    is measured first, every candidate compiles or says why, the winner is correct and no
    slower than the default."""
    from tuning.autotune import measure, search_space
    from tuning.autotune.runners import RUNNERS
    from tuning.autotune.tasks import MOSAIC_BACKWARD_KERNEL, MOSAIC_FORWARD_KERNEL, Task

    if RUNNERS[MOSAIC_FORWARD_KERNEL].missing():
        pytest.skip(RUNNERS[MOSAIC_FORWARD_KERNEL].missing())
    for kernel, direction in ((MOSAIC_FORWARD_KERNEL, "forward"),
                              (MOSAIC_BACKWARD_KERNEL, "backward")):
        task = Task(direction=direction, kernel=kernel, case_name="common", dtype="bf16",
                    headdim=64, seqlen_q=1000, seqlen_k=1000, causal=True, batch=2,
                    nheads_q=8, nheads_kv=2)
        candidates = search_space.candidates(kernel, headdim=64, group=4)
        result = measure.tune(kernel, task.problem(), mode="fast")
        ok = [r for r in result.records if r.status == "ok"]
        assert result.records[0].config == candidates[0]
        assert result.records[0].status == "ok", result.records[0].detail
        # Each candidate measured, or dropped saying why (a ring too deep for shared
        # memory fails to compile; one much slower than the best is pruned).
        assert sorted(map(str, (r.config for r in result.records))) == sorted(
            map(str, candidates))
        assert all(r.status in ("ok", "pruned", "compile failed") for r in result.records)
        assert len(ok) >= (2 if direction == "forward" else 1) and result.best is not None
        assert result.best_ms <= result.default_ms
        assert all(r.error is not None and r.error < 3e-2 for r in ok)


def test_runtime_autotune_on_gpu():
    from ffpa_jax import runtime_autotune as rt
    from pallas_kernels import FwdConfig, Inputs, fwd_generic
    from pallas_kernels.problem import Problem

    rt.clear_cache()
    problem = Problem(batch=2, seq_q=1000, seq_k=1000, heads_q=8, heads_kv=2, head_dim=192,
                      head_dim_v=192, dtype=jnp.bfloat16, scale=192 ** -0.5, causal=True)
    cfg = {}

    @jax.jit
    def traced(q, k, v):
        cfg["fwd"] = rt.autotuned_config("fwd_generic", problem, mode="fast")
        return fwd_generic(problem, FwdConfig.from_tuned(cfg["fwd"]), Inputs(q, k, v))[0]

    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 1000, 8, 192), jnp.bfloat16)
    k = jax.random.normal(keys[1], (2, 1000, 2, 192), jnp.bfloat16)
    v = jax.random.normal(keys[2], (2, 1000, 2, 192), jnp.bfloat16)
    out = traced(q, k, v)
    ref = jax.nn.dot_product_attention(q, jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2),
                                       is_causal=True, implementation="xla")
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    assert cfg["fwd"] is not None and err < 3e-2 * float(jnp.max(jnp.abs(ref)))
    tuned = rt._stats["tuned"]
    assert rt.autotuned_config("fwd_generic", problem, mode="fast") == cfg["fwd"]
    assert rt._stats["tuned"] == tuned  # cached
    rt.release_inputs()
