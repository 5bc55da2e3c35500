"""Built-in defaults and `launch_config`: every default is launchable, float32 gets the
smaller tiles, and a tuned entry (when one matches) reaches the kernels."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

import tuning
from pallas_kernels.problem import DTYPES, Problem
from tuning import lookup as lookup_mod

KERNELS_WITH_DEFAULTS = ["fwd_generic", "bwd_preproc", "bwd_generic_dq", "bwd_generic_dkdv",
                         "bwd_dbias"]
HEAD_DIMS = [1, 40, 64, 65, 128, 200, 256, 320, 512, 640, 1000, 1024]


@pytest.mark.parametrize("kernel", KERNELS_WITH_DEFAULTS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_every_default_is_launchable(kernel, dtype):
    for d in HEAD_DIMS:
        config = tuning.default_config(kernel, headdim=d, dtype=dtype)
        assert tuning.config_problem(kernel, config) is None, (kernel, d, config)


def test_fp32_keeps_the_smaller_backward_tiles():
    """16-bit dq/dkdv tiles at D > 256 are sized to the shared-memory limit; float32's
    elements are twice as wide, so its tiles must be smaller."""
    for kernel, key in (("bwd_generic_dq", "BLOCK_N"), ("bwd_generic_dkdv", "BLOCK_M"),
                        ("bwd_dbias", "BLOCK_N")):
        wide = tuning.default_config(kernel, headdim=512, dtype="bf16")[key]
        narrow = tuning.default_config(kernel, headdim=512, dtype="fp32")[key]
        assert narrow < wide, (kernel, narrow, wide)
    # D <= 128: the float32 call of the GPU fuzz that asked 240 KiB of shared memory.
    for kernel, key in (("fwd_generic", "BLOCK_N"), ("bwd_generic_dq", "BLOCK_N"),
                        ("bwd_generic_dq", "BLOCK_M")):
        wide = tuning.default_config(kernel, headdim=128, dtype="bf16")[key]
        narrow = tuning.default_config(kernel, headdim=128, dtype="fp32")[key]
        assert narrow < wide, (kernel, key, narrow, wide)
    assert (tuning.default_config("bwd_generic_dkdv", headdim=128, dtype="fp32")
            == tuning.default_config("bwd_generic_dkdv", headdim=128, dtype="bf16"))


@pytest.fixture
def tuned_dir(tmp_path, monkeypatch):
    """A tuned file for a made-up device, found through FFPA_TUNED_CONFIG_DIR."""
    for var in ("FFPA_SKIP_PERSIST_TUNED_CONFIG", "FFPA_SKIP_PERSISIT_TUNED_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FFPA_TUNED_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(lookup_mod, "PACKAGED_CONFIG_DIR", tmp_path / "none")
    config = {"BLOCK_M": 32, "BLOCK_N": 16, "BLOCK_HEADDIM_QK": 32, "BLOCK_HEADDIM_V": 32,
              "num_warps": 2, "num_stages": 1, "num_ctas": 1}
    entry = {"direction": "forward", "kernel": "fwd_generic", "case_name": "common",
             "causal": False, "dtype": "bf16", "headdim": 64, "seqlen_q": 128, "seqlen_k": 128,
             "nheads_q": 2, "nheads_kv": 2, "has_attn_bias": False, "has_dropout": False,
             "config": config}
    doc = {"schema_version": 1, "device_name": "Tuned GPU", "compute_capability": "9.0",
           "autotune_mode": "fast", "entries": [entry]}
    (tmp_path / "Tuned_GPU.json").write_text(json.dumps(doc))
    lookup_mod.clear_cache()
    yield config
    lookup_mod.clear_cache()


def _launch(dtype="bf16", device_name="Tuned GPU"):
    q = jnp.zeros((1, 100, 2, 64), DTYPES[dtype])  # a shape carrier
    problem = Problem.of(q, q, q)
    return tuning.kernel_config("fwd_generic", problem, device_name=device_name)[0]


def test_launch_config_prefers_a_tuned_entry(tuned_dir):
    assert _launch() == tuned_dir


def test_launch_config_falls_back_to_defaults(tuned_dir, monkeypatch):
    default = tuning.default_config("fwd_generic", headdim=64)
    assert _launch(dtype="fp16") == default  # no fp16 entry in the file
    assert _launch(device_name="Other GPU") == default  # no file for that device
    monkeypatch.setenv("FFPA_SKIP_PERSIST_TUNED_CONFIG", "1")
    lookup_mod.clear_cache()
    assert _launch() == default


def test_tuned_entry_reaches_the_kernel_config(tuned_dir, monkeypatch):
    """The public path asks `tuning` for the current device's configs at trace time."""
    from ffpa_jax.validation import validate

    monkeypatch.setattr(lookup_mod, "current_device", lambda: ("Tuned GPU", "9.0"))
    q = jnp.zeros((1, 100, 2, 64), jnp.bfloat16)  # a shape carrier
    problem = validate(q, q, q, None, None, scale=None, is_causal=False, dropout_rate=0.0,
                       dropout_rng=None, return_lse=False, implementation="xla",
                       interpret=False).problem
    plan = tuning.plan(problem, "pallas", interpret=True)
    fwd = plan.config("fwd_generic")
    assert (fwd.block_m, fwd.block_n, fwd.num_warps) == (32, 16, 2)
