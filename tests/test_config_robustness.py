"""A tuned-config file that is missing, empty, malformed, of another schema version, or that
holds invalid block sizes never breaks a call: the built-in defaults apply, the result is
correct, and with FFPA_LOGGER_LEVEL=DEBUG the log says why the file was not used.

The device is faked: `tuning.lookup.current_device` is patched to report a GPU whose
tuned-config file lives in a temporary FFPA_TUNED_CONFIG_DIR (on CPU the Pallas path in
interpret mode still looks its launch configs up). A positive control proves the
plumbing: a valid file with a matching entry is used (the lookup hits, and the launch
config is the file's, not the default), so each negative case could fail.
"""

from __future__ import annotations

import json
import logging

import jax
import jax.numpy as jnp
import pytest

import ffpa_jax
import tuning
from ffpa_jax import validation
from pallas_kernels import FwdConfig
from test_numerics import compare_all, random_inputs, run_reference
from tuning import lookup as lookup_mod
from pallas_kernels.problem import Problem
from tuning.defaults import default_config
from tuning.device import sanitize_device_name

FAKE_DEVICE = "NVIDIA Robustness-Test GPU (fake)"
FILE_NAME = sanitize_device_name(FAKE_DEVICE) + ".json"
B, T, S, HQ, HKV, D = 1, 24, 40, 2, 1, 32

# The tuned config of the positive control: valid, and unlike any built-in default.
TUNED_FWD = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_HEADDIM_QK": 16, "BLOCK_HEADDIM_V": 32,
             "num_warps": 2, "num_stages": 1, "num_ctas": 1}


def _entry(kernel="fwd_generic", direction="forward", config=None, **fields):
    """An entry that matches exactly the lookups of this file's attention call."""
    entry = {"direction": direction, "kernel": kernel, "case_name": "gqa", "causal": False,
             "dtype": "bf16", "headdim": D, "seqlen_q": T, "seqlen_k": S,
             "seqlen_q_bucket": T, "seqlen_k_bucket": S, "nheads_q": HQ, "nheads_kv": HKV,
             "has_attn_bias": False, "has_dropout": False,
             "config": dict(TUNED_FWD) if config is None else config}
    if direction == "backward":
        entry["bias_grad"] = False
    entry.update(fields)
    return entry


def _document(entries, **header):
    doc = {"schema_version": 1, "device_name": FAKE_DEVICE,
           "device_name_sanitized": sanitize_device_name(FAKE_DEVICE),
           "compute_capability": "9.0", "autotune_mode": "fast", "B": 1, "H": 32,
           "full_tasks": False, "tune_grid": {"headdims": [D], "seqlens": [T, S]},
           "hardware_desc": {}, "generated_at": "2026-01-01T00:00:00+00:00", "entries": entries}
    doc.update(header)
    return json.dumps(doc)


def _bwd_bad(key, value):
    config = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_HEADDIM": 32, "num_warps": 4,
              "num_stages": 1}
    config[key] = value
    return config


def _fwd_bad(key, value):
    config = dict(TUNED_FWD)
    if value is None:
        del config[key]
    else:
        config[key] = value
    return config


# (id, file content or None for no file, words the debug log must contain)
BAD_FILES = [
    ("missing", None, ["no usable tuned-config file", FAKE_DEVICE]),
    ("empty", "", ["is not valid JSON", FILE_NAME]),
    ("whitespace", "  \n", ["is not valid JSON", FILE_NAME]),
    ("truncated-json", _document([_entry()])[:-40], ["is not valid JSON", FILE_NAME]),
    ("not-json", "schema_version = 1\n", ["is not valid JSON", FILE_NAME]),
    ("binary", "\x00\xff\xfe garbage", ["is not valid JSON", FILE_NAME]),
    ("json-list", json.dumps([_entry()]), ["holds a list, expected an object", FILE_NAME]),
    ("schema-version-2", _document([_entry()], schema_version=2),
     ["schema_version=2, expected 1", FILE_NAME]),
    ("schema-version-string", _document([_entry()], schema_version="1"),
     ["schema_version='1', expected 1", FILE_NAME]),
    ("schema-version-missing", json.dumps({"device_name": FAKE_DEVICE, "entries": [_entry()]}),
     ["schema_version=None, expected 1", FILE_NAME]),
    ("entries-not-a-list", _document({"0": _entry()}), ["no 'entries' list", FILE_NAME]),
    ("block-not-power-of-two", _document([_entry(config=_fwd_bad("BLOCK_M", 48))]),
     ["skipping entry 0", "BLOCK_M=48 is not a positive power of two", "no compatible entry"]),
    ("block-zero", _document([_entry(config=_fwd_bad("BLOCK_N", 0))]),
     ["skipping entry 0", "BLOCK_N=0 is not a positive power of two"]),
    ("block-negative", _document([_entry(config=_fwd_bad("BLOCK_HEADDIM_QK", -16))]),
     ["skipping entry 0", "BLOCK_HEADDIM_QK=-16 is not a positive power of two"]),
    ("block-too-large", _document([_entry(config=_fwd_bad("BLOCK_M", 4096))]),
     ["skipping entry 0", "BLOCK_M=4096 exceeds 256"]),
    ("block-headdim-too-large", _document([_entry(config=_fwd_bad("BLOCK_HEADDIM_V", 2048))]),
     ["skipping entry 0", "BLOCK_HEADDIM_V=2048 exceeds 1024"]),
    ("block-float", _document([_entry(config=_fwd_bad("BLOCK_N", 32.0))]),
     ["skipping entry 0", "BLOCK_N=32.0 is not a positive power of two"]),
    ("block-string", _document([_entry(config=_fwd_bad("BLOCK_M", "64"))]),
     ["skipping entry 0", "BLOCK_M='64' is not a positive power of two"]),
    ("block-missing", _document([_entry(config=_fwd_bad("BLOCK_HEADDIM_V", None))]),
     ["skipping entry 0", "BLOCK_HEADDIM_V=None is not a positive power of two"]),
    ("bad-warps", _document([_entry(config=_fwd_bad("num_warps", 3))]),
     ["skipping entry 0", "num_warps=3"]),
    ("bad-stages", _document([_entry(config=_fwd_bad("num_stages", 0))]),
     ["skipping entry 0", "num_stages=0"]),
    ("config-not-a-dict", _document([_entry(config=[16, 32])]),
     ["skipping entry 0", "config is list, expected a dict"]),
    ("backward-bad-blocks", _document([
        _entry(config=_fwd_bad("BLOCK_M", 48)),
        _entry("bwd_generic_dq", "backward", config=_bwd_bad("BLOCK_M", 24)),
        _entry("bwd_generic_dkdv", "backward", config=_bwd_bad("BLOCK_HEADDIM", 100)),
        _entry("bwd_preproc", "backward", config=_bwd_bad("BLOCK_M", 0))]),
     ["skipping entry 1", "BLOCK_M=24", "skipping entry 2", "BLOCK_HEADDIM=100",
      "skipping entry 3"]),
    ("entry-bad-fields", _document([_entry(headdim="32"), _entry(dtype="bfloat16"),
                                    _entry(kernel="fwd_unknown"), "not an entry"]),
     ["skipping entry 0", "headdim='32'", "skipping entry 1", "skipping entry 2",
      "unknown kernel", "skipping entry 3"]),
]


@pytest.fixture
def fake_device(tmp_path, monkeypatch, caplog):
    """A fake GPU whose tuned-config file is tmp_path/FILE_NAME; debug logging on."""
    for name in ("FFPA_SKIP_PERSIST_TUNED_CONFIG", "FFPA_SKIP_PERSISIT_TUNED_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("FFPA_TUNED_CONFIG_DIR", str(tmp_path))
    monkeypatch.setenv("FFPA_LOGGER_LEVEL", "DEBUG")
    # No compute capability: the same-capability fallback (which could pick up a packaged
    # file) stays out of the picture.
    monkeypatch.setattr(lookup_mod, "current_device", lambda: (FAKE_DEVICE, None))
    caplog.set_level(logging.DEBUG, logger="ffpa_jax.tuning")
    lookup_mod.clear_cache()
    yield tmp_path
    lookup_mod.clear_cache()


def _problem():
    q = jax.ShapeDtypeStruct((B, T, HQ, D), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((B, S, HKV, D), jnp.bfloat16)
    return validation.validate(q, kv, kv, None, None, scale=None, is_causal=False,
                               dropout_rate=0.0, dropout_rng=None, return_lse=False,
                               implementation="pallas", interpret=True).problem


def _config(kernel, *, batch=B, headdim=D, seqlen_q=T, seqlen_k=S, heads_q=HQ, heads_kv=HKV):
    """The launch config `tuning.kernel_config` gives `kernel` for a bf16 problem."""
    problem = Problem(batch=batch, seq_q=seqlen_q, seq_k=seqlen_k, heads_q=heads_q,
                      heads_kv=heads_kv, head_dim=headdim, head_dim_v=headdim,
                      dtype=jnp.bfloat16, scale=headdim ** -0.5)
    return tuning.kernel_config(kernel, problem)[0]


def _launch(kernel, direction):
    del direction  # the kernel's own (`select.kernel_direction`)
    return _config(kernel)


def _check_attention_against_reference():
    """Forward and gradients of the Pallas path (eager: every call looks its configs up)
    against the float64 reference."""
    q, k, v, d_out, d_lse = random_inputs(11, b=B, t=T, s=S, hq=HQ, hkv=HKV, d=D, dv=D,
                                          dtype="bfloat16")

    def f(q, k, v):
        return ffpa_jax.attention(q, k, v, return_lse=True, implementation="pallas",
                                  interpret=True)
    (out, lse), vjp = jax.vjp(f, q, k, v)
    grads = (*vjp((d_out.astype(out.dtype), d_lse)), None)
    ref = run_reference(q, k, v, None, None, d_out, d_lse, scale=None, causal=False,
                        float64=True)
    xla = run_reference(q, k, v, None, None, d_out, d_lse, scale=None, causal=False,
                        float64=False)
    compare_all((out, lse, grads), ref, xla, q, None)


def test_positive_control_valid_file_is_used(fake_device, caplog):
    """Without this, the negative cases below could pass for the wrong reason."""
    (fake_device / FILE_NAME).write_text(_document([_entry()]))
    assert _launch("fwd_generic", "forward") == TUNED_FWD
    plan = tuning.plan(_problem(), "pallas", interpret=True)
    assert plan.config("fwd_generic") == FwdConfig.from_tuned(TUNED_FWD)
    assert "tuned config hit" in caplog.text and FILE_NAME in caplog.text
    lookup_mod.clear_cache()  # log each lookup again
    caplog.clear()
    _check_attention_against_reference()
    assert "tuned config hit for forward" in caplog.text  # the Pallas path asked too


# The attention call itself is checked against the reference for one file of each kind
# (each eager interpret-mode call costs over a second); every file gets the lookup checks.
RUN_ATTENTION = {"missing", "empty", "schema-version-2", "backward-bad-blocks"}


@pytest.mark.parametrize("content,words,run_attention",
                         [pytest.param(c, w, i in RUN_ATTENTION, id=i) for i, c, w in BAD_FILES])
def test_bad_file_falls_back_to_defaults(fake_device, caplog, content, words, run_attention):
    if content is not None:
        (fake_device / FILE_NAME).write_text(content, encoding="utf-8", errors="surrogateescape")
    for kernel, direction in (("fwd_generic", "forward"), ("bwd_generic_dq", "backward"),
                              ("bwd_generic_dkdv", "backward"), ("bwd_preproc", "backward")):
        assert _launch(kernel, direction) == default_config(kernel, headdim=D, dtype="bf16"), \
            kernel
    assert "tuned config miss" in caplog.text and "tuned config hit" not in caplog.text
    for word in words:
        assert word in caplog.text, f"{word!r} missing from the debug log:\n{caplog.text}"
    if run_attention:
        lookup_mod.clear_cache()
        caplog.clear()
        _check_attention_against_reference()
        assert "tuned config miss for forward" in caplog.text
        assert "tuned config miss for backward" in caplog.text
        assert "tuned config hit" not in caplog.text


def test_file_fixed_later_is_read_again(fake_device):
    """A file rewritten in place (same path) is read again, not served from the cache."""
    path = fake_device / FILE_NAME
    path.write_text("{")
    assert _launch("fwd_generic", "forward") == default_config("fwd_generic", headdim=D,
                                                                 dtype="bf16")
    path.write_text(_document([_entry()]))
    lookup_mod.clear_cache()
    assert _launch("fwd_generic", "forward") == TUNED_FWD


def test_unreadable_path_is_a_directory(fake_device, caplog):
    """A directory where the file should be: defaults, no exception."""
    (fake_device / FILE_NAME).mkdir()
    assert _launch("fwd_generic", "forward") == default_config("fwd_generic", headdim=D,
                                                                 dtype="bf16")
    assert "tuned config miss" in caplog.text


# ------------------------------------------------- guards on top of the lookup rules
def test_entry_tuned_at_a_narrower_head_dim_is_not_used(fake_device):
    """Nearest-head-dim matching picks 256 for 320, but 320 pads to 512-wide tiles that a
    256-tuned config was never compiled at (shared memory): the default is used."""
    narrow = dict(TUNED_FWD, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=256)
    wide = dict(TUNED_FWD, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=512)
    (fake_device / FILE_NAME).write_text(_document([
        _entry(headdim=256, config=narrow), _entry(headdim=1024, config=wide)]))

    def launch(d):
        return _config("fwd_generic", headdim=d)
    # The lookup itself still follows the design's rule (320 -> 256; 700 -> 1024) ...
    assert lookup_mod.lookup_config("forward", "fwd_generic", dtype="bf16", headdim=320,
                                    seqlen_q=T, seqlen_k=S, nheads_q=HQ, nheads_kv=HKV) == narrow
    # ... but the call does not launch a 256-wide config at 320 (padded to 512).
    assert launch(320) == default_config("fwd_generic", headdim=320, dtype="bf16")
    assert launch(200) == narrow  # 200 pads to 256: the same tiles
    assert launch(700) == wide  # 700 pads to 1024: tuned at that width


def test_tuned_split_count_is_used_only_on_its_own_problem(fake_device):
    """NUM_SPLITS was measured for one (batch, KV heads, keys); elsewhere the heuristic
    chooses the split count and the entry's block sizes still apply (same group size)."""
    config = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_HEADDIM_QK": 32, "BLOCK_HEADDIM_V": 32,
              "NUM_SPLITS": 8, "num_warps": 4, "num_stages": 2, "num_ctas": 1}
    (fake_device / FILE_NAME).write_text(_document(
        [_entry(kernel="decode_fwd_stage1", case_name="decode-attn", seqlen_q=1, seqlen_k=4096,
                seqlen_q_bucket=1, seqlen_k_bucket=4096, nheads_q=32, nheads_kv=32,
                config=config)], B=1))

    def launch(batch, heads_q, heads_kv, seqlen_k):
        return _config("decode_fwd_stage1", batch=batch, seqlen_q=1, seqlen_k=seqlen_k,
                       heads_q=heads_q, heads_kv=heads_kv)
    assert launch(1, 32, 32, 4096) == config
    without_splits = {k: v for k, v in config.items() if k != "NUM_SPLITS"}
    assert launch(8, 32, 32, 4096) == without_splits  # another batch
    assert launch(1, 16, 16, 4096) == without_splits  # another KV-head count
    assert launch(1, 32, 32, 3000) == without_splits  # fewer keys, same bucket
    # Another GQA group size packs the tile differently: the entry is not used at all.
    assert launch(1, 32, 8, 4096) == default_config("decode_fwd_stage1", headdim=D)
