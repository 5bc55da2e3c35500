"""Tuned-config files: parsing, validation, atomic writing, round trips (tuning.schema)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

import ffpa_format
from tuning.device import sanitize_device_name
from tuning.schema import load_config_file, write_config_file

# Files in FFPA's format: ours (tests/data, always), and FFPA's own where the checkout has it.
FFPA_FORMAT_FILES = [pytest.param(ffpa_format.PATH, id="ours")] + (
    [pytest.param(ffpa_format.FFPA_OWN, id="ffpa-own")] if ffpa_format.FFPA_OWN.is_file()
    else [])


def fwd_entry(**overrides):
    """A valid forward entry; keyword arguments replace or add fields."""
    entry = {
        "direction": "forward", "kernel": "fwd_generic", "case_name": "common",
        "causal": False, "dtype": "bf16", "headdim": 512,
        "seqlen_q": 4096, "seqlen_k": 4096, "seqlen_q_bucket": 4096, "seqlen_k_bucket": 4096,
        "nheads_q": 32, "nheads_kv": 32, "has_attn_bias": False, "has_dropout": False,
        "enable_tma": False, "enable_ws": False,
        "config": {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_HEADDIM_QK": 64,
                   "BLOCK_HEADDIM_V": 64, "num_warps": 4, "num_stages": 2, "num_ctas": 1},
    }
    entry.update(overrides)
    return entry


def bwd_entry(**overrides):
    entry = fwd_entry(direction="backward", kernel="bwd_generic_dq", bias_grad=False,
                      grad_kv_storage_dtype=None,
                      config={"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_HEADDIM": 64,
                              "num_warps": 4, "num_stages": 2, "num_ctas": 1})
    entry.update(overrides)
    return entry


def document(entries, **header):
    doc = {"schema_version": 1, "device_name": "Test GPU", "device_name_sanitized": "Test_GPU",
           "compute_capability": "9.0", "autotune_mode": "fast", "B": 1, "H": 32,
           "full_tasks": False, "tune_grid": {"headdims": [512], "seqlens": [4096]},
           "hardware_desc": {}, "generated_at": "2026-01-01T00:00:00+00:00",
           "entries": entries}
    doc.update(header)
    return doc


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


# ---------------------------------------------------------------- device names


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA H100 80GB HBM3", "NVIDIA_H100_80GB_HBM3"),
    ("NVIDIA L20", "NVIDIA_L20"),
    ("a.b-c_D9", "a.b-c_D9"),
    ("GPU (rev/2) é*", "GPU__rev_2____"),
])
def test_sanitize_device_name(name, expected):
    assert sanitize_device_name(name) == expected


# ---------------------------------------------------------------- unusable files


def test_missing_file_is_none(tmp_path):
    assert load_config_file(tmp_path / "absent.json") is None


def test_directory_is_none(tmp_path):
    assert load_config_file(tmp_path) is None


@pytest.mark.parametrize("text", [
    "",
    "   \n",
    "{not json",
    '{"schema_version": 1, "entries": [',
    "\xff\xfe\x00garbage",
])
def test_empty_or_malformed_json_is_none(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="latin-1")
    assert load_config_file(path) is None


@pytest.mark.parametrize("obj", [[], [document([fwd_entry()])], "text", 3, None, True])
def test_non_object_is_none(tmp_path, obj):
    assert load_config_file(write_json(tmp_path / "x.json", obj)) is None


@pytest.mark.parametrize("version", [0, 2, "1", 1.5, True, None])
def test_wrong_schema_version_is_none(tmp_path, version):
    path = write_json(tmp_path / "x.json", document([fwd_entry()], schema_version=version))
    assert load_config_file(path) is None


def test_missing_schema_version_is_none(tmp_path):
    doc = document([fwd_entry()])
    del doc["schema_version"]
    assert load_config_file(write_json(tmp_path / "x.json", doc)) is None


@pytest.mark.parametrize("entries", [None, {"0": fwd_entry()}, "[]"])
def test_entries_not_a_list_is_none(tmp_path, entries):
    doc = document([])
    if entries is None:
        del doc["entries"]
    else:
        doc["entries"] = entries
    assert load_config_file(write_json(tmp_path / "x.json", doc)) is None


def test_valid_file_loads(tmp_path):
    loaded = load_config_file(write_json(tmp_path / "x.json", document([fwd_entry(), bwd_entry()])))
    assert loaded is not None
    assert [dict(e) for e in loaded.entries] == [fwd_entry(), bwd_entry()]
    assert loaded.skipped == 0
    assert loaded.header["device_name"] == "Test GPU"
    assert "entries" not in loaded.header


def test_empty_entry_list_is_a_valid_file(tmp_path):
    loaded = load_config_file(write_json(tmp_path / "x.json", document([])))
    assert loaded is not None and loaded.entries == ()


# ---------------------------------------------------------------- invalid entries


def _without(entry, key):
    entry = copy.deepcopy(entry)
    del entry[key]
    return entry


def _with_config(entry, **config):
    entry = copy.deepcopy(entry)
    entry["config"].update(config)
    return entry


INVALID_ENTRIES = {
    "not an object": ["forward"],
    "non power-of-two block": _with_config(fwd_entry(), BLOCK_M=48),
    "zero block": _with_config(fwd_entry(), BLOCK_N=0),
    "block too large": _with_config(fwd_entry(), BLOCK_M=512),
    "bool block": _with_config(fwd_entry(), BLOCK_M=True),
    "bad num_warps": _with_config(fwd_entry(), num_warps=3),
    "num_ctas 2": _with_config(fwd_entry(), num_ctas=2),
    "backward keys on a forward kernel": fwd_entry(config=bwd_entry()["config"]),
    "config not a dict": fwd_entry(config=[64, 64]),
    "missing config": _without(fwd_entry(), "config"),
    "unknown kernel": fwd_entry(kernel="fwd_fancy"),
    "kernel not a string": fwd_entry(kernel=7),
    "direction mismatch": fwd_entry(direction="backward"),
    "unknown direction": fwd_entry(direction="sideways"),
    "string headdim": fwd_entry(headdim="512"),
    "float headdim": fwd_entry(headdim=512.0),
    "bool headdim": fwd_entry(headdim=True),
    "negative seqlen": fwd_entry(seqlen_q=-1),
    "zero heads": fwd_entry(nheads_kv=0),
    "string bucket": fwd_entry(seqlen_k_bucket="4096"),
    "string causal": fwd_entry(causal="false"),
    "int has_dropout": fwd_entry(has_dropout=0),
    "null has_attn_bias": fwd_entry(has_attn_bias=None),
    "string enable_tma": fwd_entry(enable_tma="no"),
    "unknown dtype": fwd_entry(dtype="fp8"),
    "unknown case_name": fwd_entry(case_name="sliding-window"),
    "int bias_grad": bwd_entry(bias_grad=1),
    "int grad_kv_storage_dtype": bwd_entry(grad_kv_storage_dtype=16),
    "string preprocess_d_chunk": bwd_entry(kernel="bwd_preproc", preprocess_d_chunk="yes",
                                           config={"BLOCK_M": 64, "BLOCK_HEADDIM": 64,
                                                   "num_warps": 4, "num_stages": 1}),
    "string use_gemv": fwd_entry(use_gemv="true"),
    "int autotune_mode": fwd_entry(autotune_mode=1),
    **{f"missing {key}": _without(fwd_entry(), key)
       for key in ("direction", "kernel", "case_name", "causal", "dtype", "headdim",
                   "seqlen_q", "seqlen_k", "nheads_q", "nheads_kv", "has_attn_bias",
                   "has_dropout")},
}


@pytest.mark.parametrize("name", sorted(INVALID_ENTRIES))
def test_invalid_entry_is_skipped_and_valid_ones_kept(tmp_path, name):
    good_before, good_after = fwd_entry(headdim=320), bwd_entry(headdim=1024)
    doc = document([good_before, INVALID_ENTRIES[name], good_after])
    loaded = load_config_file(write_json(tmp_path / "x.json", doc))
    assert loaded is not None
    assert [dict(e) for e in loaded.entries] == [good_before, good_after]
    assert loaded.skipped == 1


def test_optional_fields_may_be_absent_or_null(tmp_path):
    minimal = fwd_entry()
    for key in ("seqlen_q_bucket", "seqlen_k_bucket", "enable_tma", "enable_ws"):
        del minimal[key]
    with_nulls = bwd_entry(bias_grad=None, use_gemv=None, preprocess_d_chunk=None)
    decode = fwd_entry(kernel="decode_fwd_stage1", case_name="decode-attn", seqlen_q=1,
                       use_gemv=True)
    preproc = bwd_entry(kernel="bwd_preproc", preprocess_d_chunk=False,
                        config={"BLOCK_M": 64, "BLOCK_HEADDIM": 64, "D_CHUNK": 64,
                                "num_warps": 4, "num_stages": 1})
    doc = document([minimal, with_nulls, decode, preproc])
    loaded = load_config_file(write_json(tmp_path / "x.json", doc))
    assert loaded is not None and loaded.skipped == 0 and len(loaded.entries) == 4


def test_entry_without_any_autotune_mode_is_skipped(tmp_path):
    doc = document([fwd_entry(), fwd_entry(autotune_mode="max")])
    del doc["autotune_mode"]
    loaded = load_config_file(write_json(tmp_path / "x.json", doc))
    assert [dict(e) for e in loaded.entries] == [fwd_entry(autotune_mode="max")]


def test_skipped_entries_are_debug_logged(tmp_path, caplog):
    doc = document([fwd_entry(kernel="fwd_fancy")])
    with caplog.at_level("DEBUG", logger="ffpa_jax.tuning"):
        loaded = load_config_file(write_json(tmp_path / "x.json", doc))
    assert loaded.entries == ()
    assert any("fwd_fancy" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- writing


def test_round_trip_keeps_entries_and_unknown_keys(tmp_path):
    entries = [
        fwd_entry(future_field={"nested": [1, 2]}),
        bwd_entry(bias_grad=True, grad_kv_storage_dtype="fp32", note="hand-tuned"),
    ]
    header = document([], ffpa_version="0.1.12", torch_version="2.12",
                      triton_version="3.7", our_extra=[1, "two"])
    del header["entries"]
    path = write_config_file(tmp_path / "Test_GPU.json", header, entries)

    loaded = load_config_file(path)
    assert loaded is not None and loaded.skipped == 0
    assert [dict(e) for e in loaded.entries] == entries
    for key, value in header.items():
        assert loaded.header[key] == value, key

    # Writing what was loaded gives the same file content again.
    again = write_config_file(tmp_path / "again.json", loaded.header, loaded.entries)
    assert json.loads(again.read_text()) == json.loads(path.read_text())


def test_write_fills_required_header_fields(tmp_path):
    path = write_config_file(tmp_path / "f.json",
                             {"device_name": "NVIDIA H100 80GB HBM3", "schema_version": 7,
                              "device_name_sanitized": "stale", "entries": ["ignored"]},
                             [fwd_entry()])
    written = json.loads(path.read_text())
    assert written["schema_version"] == 1
    assert written["device_name_sanitized"] == "NVIDIA_H100_80GB_HBM3"
    for key in ("ffpa_jax_version", "jax_version", "jaxlib_version", "generated_at"):
        assert isinstance(written[key], str) and written[key], key
    assert written["entries"] == [fwd_entry()]
    assert load_config_file(path) is not None


def test_write_keeps_given_versions_and_timestamp(tmp_path):
    given = {"ffpa_jax_version": "9.9", "jax_version": "1.0", "jaxlib_version": "1.1",
             "generated_at": "yesterday", "device_name": "X"}
    written = json.loads(write_config_file(tmp_path / "f.json", given, []).read_text())
    for key, value in given.items():
        assert written[key] == value


def test_write_records_installed_jax_version(tmp_path):
    import jax

    written = json.loads(write_config_file(tmp_path / "f.json", {}, []).read_text())
    assert written["jax_version"] == jax.__version__


def test_write_leaves_no_temp_files_and_replaces(tmp_path):
    target = tmp_path / "Test_GPU.json"
    header = {"device_name": "Test GPU", "autotune_mode": "fast"}
    write_config_file(target, header, [fwd_entry(headdim=320)])
    write_config_file(target, header, [fwd_entry(headdim=640)])
    assert sorted(os.listdir(tmp_path)) == ["Test_GPU.json"]
    assert [e["headdim"] for e in load_config_file(target).entries] == [640]


def test_failed_write_keeps_old_file_and_no_temp_files(tmp_path):
    target = tmp_path / "Test_GPU.json"
    write_config_file(target, {"device_name": "Test GPU"}, [fwd_entry()])
    before = target.read_bytes()
    with pytest.raises((TypeError, ValueError)):
        write_config_file(target, {"device_name": "Test GPU", "bad": float("nan")}, [])
    with pytest.raises(TypeError):
        write_config_file(target, {"device_name": "Test GPU", "bad": object()}, [])
    assert target.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["Test_GPU.json"]


def test_write_creates_missing_directory(tmp_path):
    path = write_config_file(tmp_path / "a" / "b" / "f.json", {"autotune_mode": "max"},
                             [fwd_entry()])
    assert load_config_file(path).entries[0]["headdim"] == 512


# ---------------------------------------------------------------- files in FFPA's format


@pytest.fixture(scope="module", params=FFPA_FORMAT_FILES)
def ffpa_file(request):
    """(path, parsed JSON) of a file in FFPA's format (an NVIDIA L20, max mode)."""
    return request.param, json.loads(request.param.read_text())


def test_committed_ffpa_format_file_is_what_its_module_builds():
    assert ffpa_format.PATH.read_text() == ffpa_format.text()
    assert json.loads(ffpa_format.text()) == ffpa_format.document()


def test_ffpa_format_file_loads_every_entry(ffpa_file):
    path, raw = ffpa_file
    loaded = load_config_file(path)
    assert loaded is not None
    if path == ffpa_format.FFPA_OWN:
        assert len(raw["entries"]) == 3100
    assert loaded.skipped == 0
    assert [dict(e) for e in loaded.entries] == raw["entries"]
    # FFPA's own version fields are unknown to us and must be kept.
    for key in ("ffpa_version", "torch_version", "triton_version", "hardware_desc", "tune_grid"):
        assert loaded.header[key] == raw[key]
    # every kernel FFPA persists, its decode and FFPA-only backward kernels included
    assert {e["kernel"] for e in raw["entries"]} == {
        "fwd_generic", "decode_fwd_stage1", "bwd_preproc", "bwd_generic_dq",
        "bwd_generic_dkdv", "bwd_generic", "decode_bwd_stage1"}


def test_ffpa_format_file_round_trips(ffpa_file, tmp_path):
    source, raw = ffpa_file
    loaded = load_config_file(source)
    path = write_config_file(tmp_path / "NVIDIA_L20.json", loaded.header, loaded.entries)
    written = json.loads(path.read_text())
    assert written["entries"] == raw["entries"]
    for key, value in raw.items():
        assert written[key] == value, key
