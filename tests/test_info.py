"""`python -m ffpa_jax.info` on a CPU machine: the machine's part, and what a call would run
(on this CPU, and for a named GPU whose tuned file the test writes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jaxlib
import pytest

from conftest import HAS_GPU

REPO = Path(__file__).resolve().parents[1]
DEVICE = "Info Test GPU"
TUNED_FWD = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_HEADDIM_QK": 64, "BLOCK_HEADDIM_V": 64,
             "num_warps": 2, "num_stages": 1, "num_ctas": 1}

pytestmark = pytest.mark.skipif(HAS_GPU, reason="checks the output on a machine without a GPU")


def info(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ffpa_jax.info", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=300, env=env)


def unfolded(text: str) -> str:
    """The output as one line: folds undone (a path folded after a slash joins up again)."""
    return " ".join(text.split()).replace("/ ", "/")


@pytest.fixture
def env(tmp_path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), XDG_CACHE_HOME=str(tmp_path / "cache"),
               FFPA_TUNED_CONFIG_DIR=str(tmp_path / "tuned"))
    env.pop("FFPA_SKIP_PERSIST_TUNED_CONFIG", None)
    return env


def write_tuned_file(folder: Path) -> Path:
    """A file for DEVICE: one forward entry (D=64, 1024 x 1024, 4/4 heads) that names the
    pallas tier and a launch config no built-in default has."""
    entry = {"direction": "forward", "kernel": "fwd_generic", "case_name": "common",
             "causal": False, "dtype": "bf16", "headdim": 64, "seqlen_q": 1024,
             "seqlen_k": 1024, "nheads_q": 4, "nheads_kv": 4, "has_attn_bias": False,
             "has_dropout": False, "config": TUNED_FWD, "tier": "pallas"}
    folder.mkdir(parents=True)
    path = folder / "Info_Test_GPU.json"
    path.write_text(json.dumps({"schema_version": 1, "device_name": DEVICE,
                                "compute_capability": "42.7", "autotune_mode": "fast",
                                "entries": [entry]}))
    return path


def test_machine_part_on_a_cpu(env, tmp_path):
    run = info(env=env)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert "device: cpu (platform cpu" in out and "no NVIDIA GPU" in out
    assert f"versions: jax {jax.__version__}, jaxlib {jaxlib.__version__}, triton " in out
    # The lookup's folders, in order: the env's, the user's (under XDG_CACHE_HOME), packaged.
    order = [str(tmp_path / "tuned"), str(tmp_path / "cache" / "ffpa_jax" / "tuned_configs"),
             str(REPO / "tuning" / "configs")]
    flat = unfolded(out)
    positions = [flat.index(folder) for folder in order]
    assert positions == sorted(positions)
    assert "for this device: none (no GPU" in out
    assert all(len(line) <= 100 for line in out.splitlines()), out


def test_a_call_on_this_cpu_runs_xla_unless_told_otherwise(env):
    run = info("--shape", "2,300,8,96", "--kv-heads", "2", "--causal", env=env)
    assert run.returncode == 0, run.stderr
    flat = unfolded(run.stdout)
    assert "problem: B=2 T=300 S=300 Hq=8 Hkv=2 D=96 Dv=96 bf16, causal" in flat
    assert "implementation=None without an NVIDIA GPU" in flat
    assert "forward: xla <- no NVIDIA GPU: the dense plain-JAX path" in flat
    assert "backward: xla <- no NVIDIA GPU: the dense plain-JAX path" in flat
    chunked = info("--shape", "2,300,8,96", "--implementation", "chunked", env=env)
    assert chunked.returncode == 0, chunked.stderr
    flat = unfolded(chunked.stdout)
    assert "forward: chunked <- implementation='chunked'" in flat
    assert "backward: chunked <- implementation='chunked'" in flat
    assert "the step between the GEMMs: XLA fusions" in flat


def test_the_chunked_backward_says_where_its_logits_are_computed(env):
    """On a named GPU the chunked tier runs its Pallas step; at D = 512 in 16 bits the
    backward's blocks compute their logits in it (`chunked_grad.computes_logits_in_step`), which
    `info` says; at D = 1024 it does not."""
    said = "compute their logits in the step's kernel"
    for d, expected in ((512, True), (1024, False)):
        run = info("--shape", f"1,16384,8,{d}", "--implementation", "chunked",
                   "--device-name", DEVICE, env=env)
        assert run.returncode == 0, run.stderr
        flat = unfolded(run.stdout)
        assert "the step between the GEMMs: Pallas kernels" in flat
        assert (said in flat) == expected, flat


def test_a_call_on_a_named_gpu_says_which_config_and_why(env, tmp_path):
    path = write_tuned_file(tmp_path / "tuned")
    run = info("--shape", "1,1000,4,64", "--device-name", DEVICE, env=env)
    assert run.returncode == 0, run.stderr
    out = run.stdout
    assert all(len(line) <= 100 for line in out.splitlines())
    flat = unfolded(out)
    assert f"for {DEVICE}: {path} (1 entries, autotune mode fast)" in flat
    assert f"implementation=None on an NVIDIA GPU ({DEVICE})" in flat
    # The forward: the tier and the launch config of the tuned entry (T=1000 -> 1024 stored).
    matched = "tuned entry (the tuned file: headdim=64 seqlen_q=1024 seqlen_k=1024 heads=4/4)"
    assert f"forward: pallas <- {matched}" in flat
    assert (f"fwd_generic: BLOCK_M=32 BLOCK_N=16 BLOCK_HEADDIM_QK=64 BLOCK_HEADDIM_V=64 "
            f"num_warps=2 num_stages=1 <- {matched}") in flat
    # The backward: no entry, so the built-in rule (D=64: the Mosaic kernels, which need an
    # sm90 GPU: this one's capability is unknown, so the fused kernels) and defaults.
    assert ("backward: pallas <- built-in rule: pallas up to D = 256 in the backward (no "
            "compatible entry in the tuned file); mosaic passed over") in flat
    assert ("bwd_generic_dq: BLOCK_M=128 BLOCK_N=64 BLOCK_HEADDIM=64 BLOCK_HEADDIM_QK=64 "
            "num_warps=8 num_stages=3 <- built-in default (no compatible entry in the tuned "
            "file)") in flat
    assert "bwd_preproc: BLOCK_M=64 BLOCK_HEADDIM=128 num_warps=4 num_stages=1" in flat
    assert "bwd_dbias" not in flat  # no bias


def test_bad_arguments_are_refused(env):
    bad = info("--shape", "1,64,6,64", "--kv-heads", "4", env=env)
    assert bad.returncode == 2
    assert "must be a multiple of key/value heads Hkv=4" in bad.stderr
    assert info("--kv-heads", "4", env=env).returncode == 2  # a call needs its --shape
    # A tier this machine cannot run: the dispatcher's reason, as a usage error.
    gpu_only = info("--shape", "1,64,4,64", "--implementation", "pallas", env=env)
    assert gpu_only.returncode == 2 and "Traceback" not in gpu_only.stderr
    assert "implementation='pallas' needs an NVIDIA GPU" in gpu_only.stderr


def test_a_context_parallel_call_says_its_strategy_blocks_and_rounds(env):
    """--context-parallel: 4096 tokens over 4 devices in zigzag order are pieces of 512;
    GQA 8/2 at D=64 gathers 2 MiB of K and V, but causal blocks on the chunked tier cannot
    skip by their runtime place, so the ring; its diagonal blocks know their shift; a
    shard's float32 dK, dV (1024 keys x 2 heads x 128 x 4 bytes = 1 MiB) fit one round of
    the default budget, and FFPA_RING_ROUNDS=2 halves the backward's blocks' keys."""
    args = ("--shape", "1,4096,8,64", "--kv-heads", "2", "--causal", "--implementation",
            "chunked", "--context-parallel", "4", "--context-layout", "zigzag")
    run = info(*args, env=env)
    assert run.returncode == 0, run.stderr
    assert all(len(line) <= 100 for line in run.stdout.splitlines()), run.stdout
    flat = unfolded(run.stdout)
    assert "context parallelism: the sequence over 4 devices, zigzag layout" in flat
    assert ("strategy: ring <- 4 query heads per KV head and K and V 2 MiB, but the "
            "all-gather's blocks would run on a tier that computes what causality") in flat
    for direction in ("forward", "backward"):
        assert f"{direction} block 512 x 512, fully visible: chunked" in flat
        assert (f"{direction} block 512 x 512, partly visible (its shift 0 known when "
                "traced): chunked") in flat
    assert ("backward rounds: 1 <- a shard's float32 dK, dV are 1 MiB, a round holds at most "
            "2048 MiB") in flat
    halves = info(*args, env=dict(env, FFPA_RING_ROUNDS="2"))
    assert halves.returncode == 0, halves.stderr
    flat = unfolded(halves.stdout)
    assert "backward rounds: 2 <- $FFPA_RING_ROUNDS=2" in flat
    assert "backward block 512 x 256, fully visible: chunked" in flat
    for shift in (0, -256):
        assert (f"backward block 512 x 256, partly visible (its shift {shift} known when "
                "traced): chunked") in flat
    gather = info("--shape", "1,4096,8,64", "--kv-heads", "2", "--context-parallel", "4",
                  env=env)
    assert gather.returncode == 0, gather.stderr
    flat = unfolded(gather.stdout)
    assert ("strategy: all_gather <- 4 query heads per KV head and K and V 2 MiB: few KV "
            "heads, little to gather") in flat
    assert "forward block 1024 x 4096, fully visible: xla" in flat
    assert "backward rounds" not in flat
    uneven = info("--shape", "1,4095,8,64", "--context-parallel", "4", env=env)
    assert uneven.returncode == 2
    assert "T = 4095 and S = 4095 must split evenly over 4 devices" in uneven.stderr
    named = info("--shape", "1,4096,8,64", "--context-parallel", "4", "--device-name", DEVICE,
                 env=env)
    assert named.returncode == 2 and "answers for JAX's device" in named.stderr
    assert info("--context-parallel", "4", env=env).returncode == 2


def test_a_windowed_context_parallel_call_says_what_its_halo_fetches(env):
    """--window: the Gemma-shaped model's local layer at 32K over 4 devices (shards of
    8192; zigzag chunks of 4096): the halo fetches the last 1024 keys of the shard before
    (contiguous), or of a chunk on each neighbour (zigzag)."""
    base = ("--shape", "1,32768,8,256", "--kv-heads", "4", "--causal", "--window", "1023,0",
            "--implementation", "xla", "--context-parallel", "4")
    contiguous = info(*base, env=env)
    assert contiguous.returncode == 0, contiguous.stderr
    flat = unfolded(contiguous.stdout)
    assert "window (1023, 0)" in flat
    assert ("strategy: halo <- the window shows a shard 1024 keys of the others (at most its "
            "own 8192): fetched from their owners alone") in flat
    assert ("halo: 1024 keys fetched; 1024 of key piece 0 of shard i - 1 (from its key "
            "7168)") in flat
    assert "forward block 8192 x 1024, partly visible (its place given at run time)" in flat
    assert "backward rounds" not in flat
    zigzag = info(*base, "--context-layout", "zigzag", env=env)
    assert zigzag.returncode == 0, zigzag.stderr
    assert ("halo: 2048 keys fetched; 1024 of key piece 0 of shard i - 1 (from its key 3072); "
            "1024 of key piece 1 of shard i - 3 (from its key 3072)") in unfolded(zigzag.stdout)
    ring = info(*base, "--context-strategy", "ring", env=env)
    assert ring.returncode == 0 and "strategy: ring <- context_strategy='ring' given" in (
        unfolded(ring.stdout))


def test_a_path_longer_than_a_line_folds_after_a_slash():
    from ffpa_jax import info as info_module
    path = "/tmp/" + "/".join(f"folder{i:02d}" for i in range(14))
    lines = info_module._wrap(f"  lookup order: {path}, /repo/tuning/configs")
    assert len(lines) > 1 and all(len(line) <= 100 for line in lines), lines
    assert unfolded("\n".join(lines)) == f"lookup order: {path}, /repo/tuning/configs"
