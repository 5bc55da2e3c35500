"""Trace-time lookup of tuned configs (tuning.lookup) and device detection (tuning.device)."""

from __future__ import annotations

import json
import logging
import shutil
import types
from pathlib import Path

import pytest

from test_tuning_schema import FFPA_FORMAT_FILES
from tuning import device as device_mod
from tuning import lookup as lookup_mod
from tuning.lookup import clear_cache, lookup_config
from tuning.lookup import user_config_dir as real_user_config_dir

DEVICE = "Test GPU 80GB"  # file name: Test_GPU_80GB.json
CC = "42.7"  # a capability no real packaged file will ever claim
ENV_VARS = ("FFPA_TUNED_CONFIG_DIR", "FFPA_SKIP_PERSIST_TUNED_CONFIG",
            "FFPA_SKIP_PERSISIT_TUNED_CONFIG", "FFPA_LOGGER_LEVEL")


def fwd_config(block_m=64, block_n=64, warps=4):
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_HEADDIM_QK": 64,
            "BLOCK_HEADDIM_V": 64, "num_warps": warps, "num_stages": 2, "num_ctas": 1}


def bwd_config(block_m=64, block_n=64, warps=4):
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_HEADDIM": 64,
            "num_warps": warps, "num_stages": 2, "num_ctas": 1}


def entry(config=None, **fields):
    """A forward fwd_generic entry (bf16, D=512, 4096x4096, 32/32 heads) with overrides."""
    e = {"direction": "forward", "kernel": "fwd_generic", "case_name": "common",
         "causal": False, "dtype": "bf16", "headdim": 512,
         "seqlen_q": 4096, "seqlen_k": 4096, "seqlen_q_bucket": 4096, "seqlen_k_bucket": 4096,
         "nheads_q": 32, "nheads_kv": 32, "has_attn_bias": False, "has_dropout": False,
         "config": config or fwd_config()}
    for key in ("seqlen_q", "seqlen_k"):  # keep buckets in step unless given
        if key in fields and f"{key}_bucket" not in fields:
            fields[f"{key}_bucket"] = fields[key]
    e.update(fields)
    return e


def bwd(config=None, **fields):
    fields.setdefault("kernel", "bwd_generic_dq")
    return entry(config or bwd_config(), direction="backward", **fields)


def write_file(directory: Path, entries, name=None, **header) -> Path:
    doc = {"schema_version": 1, "device_name": DEVICE, "compute_capability": CC,
           "autotune_mode": "fast", "entries": entries}
    doc.update(header)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / (name or "Test_GPU_80GB.json")
    path.write_text(json.dumps(doc))
    return path


def find(**kw):
    """lookup_config for DEVICE with the defaults of `entry()`; kw overrides."""
    args = dict(direction="forward", kernel="fwd_generic", dtype="bf16", headdim=512,
                seqlen_q=4096, seqlen_k=4096, device_name=DEVICE, compute_capability=CC)
    args.update(kw)
    return lookup_config(args.pop("direction"), args.pop("kernel"), **args)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """Env dir = tmp_path/env, packaged dir = tmp_path/packaged, fresh caches."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FFPA_TUNED_CONFIG_DIR", str(tmp_path / "env"))
    monkeypatch.setattr(lookup_mod, "PACKAGED_CONFIG_DIR", tmp_path / "packaged")
    tuning_logger = logging.getLogger("ffpa_jax.tuning")
    level, handlers = tuning_logger.level, list(tuning_logger.handlers)
    clear_cache()
    yield
    clear_cache()
    tuning_logger.setLevel(level)
    tuning_logger.handlers[:] = handlers


@pytest.fixture
def env_dir(tmp_path):
    return tmp_path / "env"


@pytest.fixture
def packaged_dir(tmp_path):
    return tmp_path / "packaged"


# ---------------------------------------------------------------- head dim


HEADDIM_BLOCK_M = {320: 8, 512: 16, 640: 32, 768: 64, 1024: 128}


@pytest.mark.parametrize("runtime, stored", [
    (384, 320), (448, 512), (900, 1024),
    (416, 512),  # equidistant from 320 and 512: ties go to the larger
    (576, 640),  # equidistant from 512 and 640
    (320, 320), (512, 512), (1024, 1024), (40, 320), (2048, 1024), (700, 640), (704, 768),
])
def test_nearest_headdim_ties_to_larger(env_dir, runtime, stored):
    write_file(env_dir, [entry(fwd_config(block_m=m), headdim=d)
                         for d, m in HEADDIM_BLOCK_M.items()])
    assert find(headdim=runtime) == fwd_config(block_m=HEADDIM_BLOCK_M[stored])


def test_headdim_chosen_among_matching_variant_only(env_dir):
    # The causal entry at D=384 is nearer, but only non-causal entries count.
    write_file(env_dir, [entry(fwd_config(block_m=8), headdim=384, causal=True),
                         entry(fwd_config(block_m=16), headdim=1024)])
    assert find(headdim=384) == fwd_config(block_m=16)


# ---------------------------------------------------------------- seqlens


SEQ_BLOCK = {512: 8, 1024: 16, 4096: 32}


@pytest.fixture
def seq_grid(env_dir):
    write_file(env_dir, [entry(fwd_config(block_m=SEQ_BLOCK[q], block_n=SEQ_BLOCK[k]),
                               seqlen_q=q, seqlen_k=k)
                         for q in SEQ_BLOCK for k in SEQ_BLOCK])


@pytest.mark.parametrize("runtime, stored", [
    (1, 512), (512, 512), (513, 1024), (1000, 1024), (1024, 1024), (1025, 4096),
    (4096, 4096), (4097, 4096), (100_000, 4096),
])
def test_seqlen_smallest_at_least_else_largest(seq_grid, runtime, stored):
    assert find(seqlen_q=runtime, seqlen_k=700) == fwd_config(SEQ_BLOCK[stored], SEQ_BLOCK[1024])
    assert find(seqlen_q=700, seqlen_k=runtime) == fwd_config(SEQ_BLOCK[1024], SEQ_BLOCK[stored])


def test_seqlen_q_chosen_before_seqlen_k(env_dir):
    write_file(env_dir, [entry(fwd_config(block_m=8), seqlen_q=1024, seqlen_k=512),
                         entry(fwd_config(block_m=16), seqlen_q=2048, seqlen_k=4096)])
    # q=1000 -> bucket 1024; the only k stored with it is 512 (largest), although
    # 4096 would be the best k on its own.
    assert find(seqlen_q=1000, seqlen_k=4000) == fwd_config(block_m=8)


def test_seqlen_buckets_are_used_when_present(env_dir):
    write_file(env_dir, [
        entry(fwd_config(block_m=8), seqlen_q=700, seqlen_q_bucket=1024),
        entry(fwd_config(block_m=16), seqlen_q=2048),
    ])
    # By bucket, 1024 is the smallest >= 900; by raw seqlen_q it would be 2048.
    assert find(seqlen_q=900) == fwd_config(block_m=8)


def test_seqlen_fields_used_when_buckets_absent(env_dir):
    a, b = entry(fwd_config(block_m=8), seqlen_q=1024), entry(fwd_config(block_m=16), seqlen_q=2048)
    for e in (a, b):
        del e["seqlen_q_bucket"], e["seqlen_k_bucket"]
    write_file(env_dir, [a, b])
    assert find(seqlen_q=1500) == fwd_config(block_m=16)
    assert find(seqlen_q=1000) == fwd_config(block_m=8)


# ---------------------------------------------------------------- variant filters


VARIANTS = {
    "causal": ({"causal": True}, {"causal": True}),
    "bias": ({"has_attn_bias": True}, {"has_attn_bias": True}),
    "dropout": ({"has_dropout": True}, {"has_dropout": True}),
    "fp16": ({"dtype": "fp16"}, {"dtype": "fp16"}),
    "fp32": ({"dtype": "fp32"}, {"dtype": "fp32"}),
    "direction+kernel": ({"direction": "backward", "kernel": "bwd_generic_dq"},
                         {"direction": "backward", "kernel": "bwd_generic_dq",
                          "config": bwd_config(block_m=128)}),
    "kernel": ({"kernel": "decode_fwd_stage1"}, {"kernel": "decode_fwd_stage1"}),
    "autotune mode": ({"autotune_mode": "max"}, {"autotune_mode": "max"}),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_filters(env_dir, name):
    query, fields = VARIANTS[name]
    fields = dict(fields)
    variant_config = fields.pop("config", fwd_config(block_m=128))
    base = entry(fwd_config(block_m=16))
    variant = entry(variant_config, **fields)

    write_file(env_dir, [base, variant])
    assert find() == fwd_config(block_m=16)
    assert find(**query) == variant_config

    clear_cache()
    write_file(env_dir, [base])
    assert find(**query) is None

    clear_cache()
    write_file(env_dir, [variant])
    assert find() is None
    assert find(**query) == variant_config


def test_header_autotune_mode_applies_to_entries_without_one(env_dir):
    write_file(env_dir, [entry(fwd_config(block_m=16))], autotune_mode="max")
    assert find(autotune_mode="max") == fwd_config(block_m=16)
    assert find(autotune_mode="fast") is None
    assert find() is None  # the default mode is "fast"


def test_entry_autotune_mode_overrides_header(env_dir):
    write_file(env_dir, [entry(fwd_config(block_m=16), autotune_mode="fast")],
               autotune_mode="max")
    assert find(autotune_mode="fast") == fwd_config(block_m=16)
    assert find(autotune_mode="max") is None


def test_fp16_does_not_fall_back_to_bf16(env_dir):
    write_file(env_dir, [entry(fwd_config(block_m=16), dtype="bf16")])
    assert find(dtype="fp16") is None
    assert find(dtype="bf16") == fwd_config(block_m=16)


@pytest.mark.parametrize("spelling", ["bf16", "bfloat16", "BF16"])
def test_dtype_spellings(env_dir, spelling):
    write_file(env_dir, [entry(fwd_config(block_m=16), dtype="bf16"),
                         entry(fwd_config(block_m=32), dtype="fp16")])
    assert find(dtype=spelling) == fwd_config(block_m=16)


def test_dtype_objects(env_dir):
    import jax.numpy as jnp

    write_file(env_dir, [entry(fwd_config(block_m=16), dtype="bf16"),
                         entry(fwd_config(block_m=32), dtype="fp16")])
    assert find(dtype=jnp.bfloat16) == fwd_config(block_m=16)
    assert find(dtype=jnp.dtype("float16")) == fwd_config(block_m=32)


def test_bias_grad_filter_for_backward(env_dir):
    write_file(env_dir, [
        bwd(bwd_config(block_m=16), has_attn_bias=True, bias_grad=True),
        bwd(bwd_config(block_m=32), has_attn_bias=True, bias_grad=False),
    ])
    q = dict(direction="backward", kernel="bwd_generic_dq", has_attn_bias=True)
    assert find(**q, bias_grad=True) == bwd_config(block_m=16)
    assert find(**q, bias_grad=False) == bwd_config(block_m=32)
    assert find(**q) == bwd_config(block_m=16)  # None: not filtered, first in file


@pytest.mark.parametrize("stored", ["absent", None])
def test_backward_entry_without_bias_grad_counts_as_false(env_dir, stored):
    e = bwd(bwd_config(block_m=16))
    if stored == "absent":
        e.pop("bias_grad", None)
    else:
        e["bias_grad"] = stored
    write_file(env_dir, [e])
    q = dict(direction="backward", kernel="bwd_generic_dq")
    assert find(**q, bias_grad=False) == bwd_config(block_m=16)
    assert find(**q, bias_grad=True) is None


def test_bias_grad_ignored_for_forward(env_dir):
    write_file(env_dir, [entry(fwd_config(block_m=16), has_attn_bias=True)])
    assert find(has_attn_bias=True, bias_grad=True) == fwd_config(block_m=16)


# ---------------------------------------------------------------- head layout


def heads_file(env_dir, order):
    configs = {(32, 32): fwd_config(block_m=16), (32, 8): fwd_config(block_m=32),
               (32, 1): fwd_config(block_m=64)}
    write_file(env_dir, [entry(configs[h], nheads_q=h[0], nheads_kv=h[1]) for h in order])
    return configs


@pytest.mark.parametrize("order", [
    [(32, 32), (32, 8), (32, 1)],
    [(32, 1), (32, 8), (32, 32)],
])
def test_exact_head_layout_preferred(env_dir, order):
    configs = heads_file(env_dir, order)
    for heads, config in configs.items():
        assert find(nheads_q=heads[0], nheads_kv=heads[1]) == config


@pytest.mark.parametrize("order", [
    [(32, 32), (32, 8), (32, 1)],
    [(32, 8), (32, 1), (32, 32)],
])
def test_head_layout_not_required_first_in_file_wins(env_dir, order):
    configs = heads_file(env_dir, order)
    first = configs[order[0]]
    assert find(nheads_q=16, nheads_kv=4) == first
    assert find() == first  # heads not given


def test_head_preference_comes_after_seqlen(env_dir):
    write_file(env_dir, [entry(fwd_config(block_m=16), seqlen_q=1024),
                         entry(fwd_config(block_m=32), seqlen_q=4096, nheads_kv=8)])
    assert find(seqlen_q=1000, nheads_q=32, nheads_kv=8) == fwd_config(block_m=16)


# ---------------------------------------------------------------- files


@pytest.mark.parametrize("content", [
    None,  # missing
    "",
    "{oops",
    "[1, 2]",
    '"a string"',
    json.dumps({"schema_version": 2, "autotune_mode": "fast", "entries": [entry()]}),
    json.dumps({"schema_version": "1", "autotune_mode": "fast", "entries": [entry()]}),
    json.dumps({"autotune_mode": "fast", "entries": [entry()]}),
])
def test_unusable_file_gives_none(env_dir, content):
    env_dir.mkdir()
    if content is not None:
        (env_dir / "Test_GPU_80GB.json").write_text(content)
    assert find() is None


def test_malformed_exact_file_does_not_fall_back(env_dir, packaged_dir):
    env_dir.mkdir()
    (env_dir / "Test_GPU_80GB.json").write_text("{oops")
    write_file(packaged_dir, [entry()])
    write_file(env_dir, [entry()], name="other.json")  # same capability
    assert find() is None


def test_invalid_entries_skipped_valid_ones_still_hit(env_dir):
    bad_block = entry(fwd_config(block_m=48))
    bad_types = entry(fwd_config(block_m=128), headdim="512")
    bad_flag = entry(fwd_config(block_m=128), causal="no")
    write_file(env_dir, [bad_block, bad_types, bad_flag,
                         entry(fwd_config(block_m=16)),
                         entry(fwd_config(block_m=16), kernel="fwd_fancy")])
    # The invalid entries come first, so they would win on file order if kept.
    assert find() == fwd_config(block_m=16)
    assert find(kernel="fwd_fancy") is None


def test_unknown_kernel_and_direction_give_none(env_dir):
    write_file(env_dir, [entry(fwd_config(block_m=16))])
    assert find(kernel="no_such_kernel") is None
    assert find(direction="backward") is None


# ---------------------------------------------------------------- file location and env


def test_env_dir_wins_over_packaged(env_dir, packaged_dir):
    write_file(env_dir, [entry(fwd_config(block_m=16))])
    write_file(packaged_dir, [entry(fwd_config(block_m=32))])
    assert find() == fwd_config(block_m=16)


def test_packaged_used_when_env_unset_or_lacking_file(env_dir, packaged_dir, monkeypatch):
    write_file(packaged_dir, [entry(fwd_config(block_m=32))])
    assert find() == fwd_config(block_m=32)  # env dir does not even exist

    env_dir.mkdir()
    write_file(env_dir, [entry(fwd_config(block_m=16))], name="Another_GPU.json",
               compute_capability="1.0")
    assert find() == fwd_config(block_m=32)

    monkeypatch.delenv("FFPA_TUNED_CONFIG_DIR")
    write_file(env_dir, [entry(fwd_config(block_m=16))])
    assert find() == fwd_config(block_m=32)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """The user's directory, as the lookup derives it from $XDG_CACHE_HOME (or ~/.cache)."""
    monkeypatch.setattr(lookup_mod, "user_config_dir", real_user_config_dir)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "ffpa_jax" / "tuned_configs"


def test_user_dir_after_env_dir_before_packaged(env_dir, packaged_dir, user_dir, monkeypatch):
    write_file(packaged_dir, [entry(fwd_config(block_m=32))])
    assert find() == fwd_config(block_m=32)
    write_file(user_dir, [entry(fwd_config(block_m=64))])
    clear_cache()  # (lookups are cached per environment, not per file on disk)
    assert find() == fwd_config(block_m=64)   # the user's file shadows the packaged one
    write_file(env_dir, [entry(fwd_config(block_m=16))])
    clear_cache()
    assert find() == fwd_config(block_m=16)   # $FFPA_TUNED_CONFIG_DIR comes first
    monkeypatch.delenv("FFPA_TUNED_CONFIG_DIR")
    assert find() == fwd_config(block_m=64)
    assert lookup_mod.config_dirs() == [user_dir, packaged_dir]
    assert lookup_mod.find_config_file(DEVICE).path == user_dir / "Test_GPU_80GB.json"
    # Without XDG_CACHE_HOME: ~/.cache.
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(env_dir.parent / "home"))
    assert lookup_mod.config_dirs()[0] == env_dir.parent / "home" / ".cache" / "ffpa_jax" / \
        "tuned_configs"
    assert find() == fwd_config(block_m=32)


def test_capability_fallback_reads_the_user_dir_before_packaged(packaged_dir, user_dir):
    write_file(packaged_dir, [entry(fwd_config(block_m=8))], name="a.json")
    write_file(user_dir, [entry(fwd_config(block_m=16))], name="z.json")
    assert find(device_name="Unlisted GPU") == fwd_config(block_m=16)


def test_env_dir_change_takes_effect_without_clearing(env_dir, tmp_path, monkeypatch):
    write_file(env_dir, [entry(fwd_config(block_m=16))])
    write_file(tmp_path / "other", [entry(fwd_config(block_m=64))])
    assert find() == fwd_config(block_m=16)
    monkeypatch.setenv("FFPA_TUNED_CONFIG_DIR", str(tmp_path / "other"))
    assert find() == fwd_config(block_m=64)


def test_device_name_is_sanitized_for_the_file_name(env_dir):
    write_file(env_dir, [entry(fwd_config(block_m=16))], name="NVIDIA_H100_80GB_HBM3.json")
    assert find(device_name="NVIDIA H100 80GB HBM3", compute_capability=None) == \
        fwd_config(block_m=16)
    assert find(device_name="NVIDIA H200", compute_capability=None) is None


@pytest.mark.parametrize("var", ["FFPA_SKIP_PERSIST_TUNED_CONFIG",
                                 "FFPA_SKIP_PERSISIT_TUNED_CONFIG"])
@pytest.mark.parametrize("value, skipped", [
    ("1", True), ("true", True), ("YES", True), ("On", True),
    ("0", False), ("", False), ("false", False), ("no", False),
])
def test_skip_env_vars(env_dir, monkeypatch, var, value, skipped):
    write_file(env_dir, [entry(fwd_config(block_m=16))])
    assert find() == fwd_config(block_m=16)  # cached before the variable is set
    monkeypatch.setenv(var, value)
    assert find() == (None if skipped else fwd_config(block_m=16))
    monkeypatch.delenv(var)
    assert find() == fwd_config(block_m=16)


def test_compute_capability_fallback(env_dir):
    write_file(env_dir, [entry(fwd_config(block_m=16))], name="Some_Other_GPU.json",
               device_name="Some Other GPU")
    assert find(device_name="Unlisted GPU", compute_capability=CC) == fwd_config(block_m=16)
    assert find(device_name="Unlisted GPU", compute_capability="1.0") is None
    assert find(device_name="Unlisted GPU", compute_capability=None) is None


def test_compute_capability_fallback_is_deterministic(env_dir, packaged_dir):
    write_file(packaged_dir, [entry(fwd_config(block_m=8))], name="a.json")
    write_file(env_dir, [entry(fwd_config(block_m=64))], name="z.json")
    write_file(env_dir, [entry(fwd_config(block_m=32))], name="m.json")
    write_file(env_dir, [entry(fwd_config(block_m=16))], name="b.json", compute_capability="1.0")
    env_dir.joinpath("c.json").write_text("{broken")  # unusable files are passed over
    # Env dir first, then by file name: m.json.
    assert find(device_name="Unlisted GPU") == fwd_config(block_m=32)


def test_compute_capability_fallback_in_packaged_dir(packaged_dir):
    write_file(packaged_dir, [entry(fwd_config(block_m=8))], name="x.json")
    assert find(device_name="Unlisted GPU") == fwd_config(block_m=8)


# ---------------------------------------------------------------- device


def test_no_device_on_cpu(env_dir):
    import jax

    if jax.devices()[0].platform == "gpu":
        pytest.skip("runs on a GPU")
    assert device_mod.current_device() == (None, None)
    write_file(env_dir, [entry(fwd_config(block_m=16))])
    assert find(device_name=None) is None
    assert find(device_name=None, compute_capability=CC) is None


def test_current_device_used_when_no_name_given(env_dir, monkeypatch):
    monkeypatch.setattr(lookup_mod, "current_device", lambda: (DEVICE, "1.0"))
    write_file(env_dir, [entry(fwd_config(block_m=16))])
    assert find(device_name=None, compute_capability=None) == fwd_config(block_m=16)


def test_current_device_capability_fallback(env_dir, monkeypatch):
    monkeypatch.setattr(lookup_mod, "current_device", lambda: ("Unlisted GPU", CC))
    write_file(env_dir, [entry(fwd_config(block_m=16))], name="whatever.json")
    assert find(device_name=None, compute_capability=None) == fwd_config(block_m=16)


def _fake_devices(monkeypatch, *devices):
    import jax

    monkeypatch.setattr(jax, "devices", lambda *a, **k: list(devices))


def test_current_device_reads_gpu_fields(monkeypatch):
    gpu = types.SimpleNamespace(platform="gpu", device_kind="NVIDIA H100 80GB HBM3",
                                compute_capability="9.0")
    _fake_devices(monkeypatch, gpu)
    assert device_mod.current_device() == ("NVIDIA H100 80GB HBM3", "9.0")


def test_current_device_without_capability(monkeypatch):
    _fake_devices(monkeypatch, types.SimpleNamespace(platform="gpu", device_kind="Some GPU"))
    assert device_mod.current_device() == ("Some GPU", None)


def test_current_device_non_gpu_platform(monkeypatch):
    _fake_devices(monkeypatch, types.SimpleNamespace(platform="tpu", device_kind="TPU v5"))
    assert device_mod.current_device() == (None, None)


def test_current_device_survives_backend_errors(monkeypatch):
    import jax

    def broken(*args, **kwargs):
        raise RuntimeError("no backend")

    monkeypatch.setattr(jax, "devices", broken)
    assert device_mod.current_device() == (None, None)


# ---------------------------------------------------------------- caching, copies, logging


def test_result_is_a_copy(env_dir):
    write_file(env_dir, [entry(fwd_config(block_m=16))])
    first = find()
    first["BLOCK_M"] = 999
    assert find() == fwd_config(block_m=16)


def test_clear_cache_rereads_files(env_dir):
    path = write_file(env_dir, [entry(fwd_config(block_m=16))])
    assert find() == fwd_config(block_m=16)
    path.write_text(json.dumps({"schema_version": 1, "autotune_mode": "fast",
                                "entries": [entry(fwd_config(block_m=32))]}))
    clear_cache()
    assert find() == fwd_config(block_m=32)


def _lookup_records(caplog, kind):
    return [r for r in caplog.records
            if r.name == "ffpa_jax.tuning" and r.getMessage().startswith(f"tuned config {kind}")]


def test_debug_logging_logs_hit_and_miss_once(env_dir, monkeypatch, caplog):
    monkeypatch.setenv("FFPA_LOGGER_LEVEL", "DEBUG")
    write_file(env_dir, [entry(fwd_config(block_m=16))])
    for _ in range(3):
        assert find() == fwd_config(block_m=16)
        assert find(dtype="fp16") is None
    assert len(_lookup_records(caplog, "hit")) == 1
    assert len(_lookup_records(caplog, "miss")) == 1
    assert logging.getLogger("ffpa_jax.tuning").handlers  # a handler was attached

    find(headdim=1000)  # another lookup: logged once more
    assert len(_lookup_records(caplog, "hit")) == 2


def test_no_lookup_logs_without_debug_level(env_dir, caplog):
    logging.getLogger("ffpa_jax.tuning").setLevel(logging.INFO)
    write_file(env_dir, [entry(fwd_config(block_m=16))])
    assert find() == fwd_config(block_m=16)
    assert _lookup_records(caplog, "hit") == []


# ------------------------------------------------------------ a file in FFPA's format (NVIDIA L20)
# Ours (tests/ffpa_format.py) and, where the checkout has it, FFPA's own: the expected
# configs are read from the file by hand (`by_hand`), so the same cases hold for both.


@pytest.fixture(scope="module", params=FFPA_FORMAT_FILES)
def l20_file(request) -> Path:
    return request.param


@pytest.fixture(scope="module")
def l20_entries(l20_file):
    return json.loads(l20_file.read_text())["entries"]


@pytest.fixture
def l20_dir(l20_file, env_dir):
    env_dir.mkdir()
    shutil.copyfile(l20_file, env_dir / "NVIDIA_L20.json")
    return env_dir


def by_hand(entries, **fields):
    """Configs of the raw entries whose fields equal `fields` (missing counts as absent)."""
    return [e["config"] for e in entries if all(e.get(k, "absent") == v for k, v in fields.items())]


def find_l20(direction, kernel, **kw):
    kw.setdefault("causal", False)
    return lookup_config(direction, kernel, device_name="NVIDIA L20", autotune_mode="max", **kw)


L20_EXACT_CASES = [
    # (lookup kwargs, extra raw fields that identify the entry)
    (dict(direction="forward", kernel="fwd_generic", dtype="bf16", headdim=512,
          seqlen_q=2048, seqlen_k=2048, nheads_q=32, nheads_kv=32), {"case_name": "common"}),
    (dict(direction="forward", kernel="fwd_generic", dtype="fp16", headdim=1024,
          seqlen_q=512, seqlen_k=8192, causal=True), {}),
    (dict(direction="forward", kernel="fwd_generic", dtype="bf16", headdim=640,
          seqlen_q=4096, seqlen_k=4096, nheads_q=32, nheads_kv=8), {"case_name": "gqa"}),
    (dict(direction="forward", kernel="fwd_generic", dtype="fp16", headdim=768,
          seqlen_q=1024, seqlen_k=1024, nheads_q=32, nheads_kv=1), {"case_name": "mqa"}),
    (dict(direction="forward", kernel="fwd_generic", dtype="bf16", headdim=320,
          seqlen_q=8192, seqlen_k=8192, has_dropout=True), {}),
    (dict(direction="forward", kernel="decode_fwd_stage1", dtype="bf16", headdim=512,
          seqlen_q=1, seqlen_k=4096, causal=True), {}),
    (dict(direction="backward", kernel="bwd_generic", dtype="bf16", headdim=320,
          seqlen_q=1024, seqlen_k=1024, has_attn_bias=True, bias_grad=True), {}),
    (dict(direction="backward", kernel="bwd_generic_dkdv", dtype="fp16", headdim=640,
          seqlen_q=2048, seqlen_k=2048, causal=True, bias_grad=False), {}),
    (dict(direction="backward", kernel="bwd_generic_dq", dtype="bf16", headdim=1024,
          seqlen_q=4096, seqlen_k=4096), {"case_name": "common"}),
    (dict(direction="backward", kernel="bwd_preproc", dtype="bf16", headdim=768,
          seqlen_q=8192, seqlen_k=8192), {}),
]


@pytest.mark.parametrize("query, extra", L20_EXACT_CASES)
def test_l20_exact_matches(l20_entries, l20_dir, query, extra):
    query = dict(query)
    raw = {k: query[k] for k in ("direction", "kernel", "dtype", "headdim", "seqlen_q",
                                 "seqlen_k")}
    raw.update(causal=query.get("causal", False),
               has_attn_bias=query.get("has_attn_bias", False),
               has_dropout=query.get("has_dropout", False), **extra)
    if "bias_grad" in query:
        raw["bias_grad"] = query["bias_grad"]
    if "nheads_kv" in query:
        raw.update(nheads_q=query["nheads_q"], nheads_kv=query["nheads_kv"])
    expected = by_hand(l20_entries, **raw)
    assert expected, f"fixture has no entry for {raw}"
    direction, kernel = query.pop("direction"), query.pop("kernel")
    assert find_l20(direction, kernel, **query) == expected[0]


# Between grid points: the expected stored point is worked out from the rules
# by hand (nearest head dim, ties up; smallest seqlen >= runtime, else largest),
# and each case is checked to differ from the wrong neighbours, so a wrong
# rounding cannot pass.
L20_BETWEEN_CASES = [
    # runtime (D, Tq, Tk), stored (D, Tq, Tk), wrong neighbours
    ((900, 3000, 3000), (1024, 4096, 4096), [(768, 4096, 4096), (1024, 2048, 2048)]),
    ((1000, 20000, 20000), (1024, 8192, 8192), [(1024, 4096, 4096), (768, 8192, 8192)]),
    ((416, 1500, 1500), (512, 2048, 2048), [(320, 2048, 2048), (512, 1024, 1024)]),
]


@pytest.mark.parametrize("runtime, stored, wrong", L20_BETWEEN_CASES)
def test_l20_between_grid_points(l20_entries, l20_dir, runtime, stored, wrong):
    common = dict(direction="forward", kernel="fwd_generic", dtype="bf16", causal=False,
                  has_attn_bias=False, has_dropout=False, nheads_q=32, nheads_kv=32)

    def at(point):
        d, q, k = point
        configs = by_hand(l20_entries, **common, headdim=d, seqlen_q=q, seqlen_k=k)
        assert configs, point
        return configs[0]

    expected = at(stored)
    assert all(at(w) != expected for w in wrong)  # the case discriminates
    d, q, k = runtime
    got = find_l20("forward", "fwd_generic", dtype="bf16", headdim=d, seqlen_q=q, seqlen_k=k,
                   nheads_q=32, nheads_kv=32)
    assert got == expected


def test_l20_decode_seqlen_k_bucket(l20_entries, l20_dir):
    expected = by_hand(l20_entries, kernel="decode_fwd_stage1", dtype="fp16", causal=False,
                       headdim=640, seqlen_q=1, seqlen_k=8192)
    assert expected
    got = find_l20("forward", "decode_fwd_stage1", dtype="fp16", headdim=640, seqlen_q=1,
                   seqlen_k=5000)
    assert got == expected[0]


def test_l20_fast_mode_and_other_devices_miss(l20_dir):
    kw = dict(dtype="bf16", headdim=512, seqlen_q=2048, seqlen_k=2048)
    assert find_l20("forward", "fwd_generic", **kw) is not None
    assert lookup_config("forward", "fwd_generic", device_name="NVIDIA L20",
                         autotune_mode="fast", **kw) is None
    assert lookup_config("forward", "fwd_generic", device_name="NVIDIA L40S",
                         autotune_mode="max", **kw) is None
    # Same compute capability as the L20 (8.9): the L20 file is the fallback.
    assert lookup_config("forward", "fwd_generic", device_name="NVIDIA L40S",
                         compute_capability="8.9", autotune_mode="max", **kw) == \
        find_l20("forward", "fwd_generic", **kw)
