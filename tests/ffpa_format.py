"""A tuned-config file in FFPA's format, written by us: tests/data/ffpa_format_NVIDIA_L20.json.

FFPA (the PyTorch + Triton library whose schema we share) persists its autotuned configs as
one JSON document per device. The lookup and schema tests read such a file to check that a
file FFPA writes loads entry for entry, round-trips, and is looked up by FFPA's rules. FFPA's
own file for an NVIDIA L20 is not ours to ship, so this module builds one with the same
structure instead:

- FFPA's header fields (`ffpa_version`, `torch_version`, `triton_version`, `hardware_desc`,
  `tune_grid`, `full_tasks`, ...; every one we do not read must survive a round trip), the
  device "NVIDIA L20" (compute capability 8.9) and `autotune_mode` "max" in the header
  only, as FFPA writes it;
- FFPA's entries: each kernel with FFPA's field set (the forward kernels' `enable_tma` and
  `enable_ws`, decode's `use_gemv`, the backward's `bias_grad` and `grad_kv_storage_dtype`,
  `bwd_preproc`'s `preprocess_d_chunk` and `D_CHUNK`, the FFPA-only `bwd_generic` and
  `decode_bwd_stage1`), keys sorted as FFPA's `json.dump` writes them;
- FFPA's grid: head dims 320, 512, 640, 768 and 1024, square seqlens 1024 to 8192 (queries
  of 1 for decode), and a few variants (case names, dtypes, causal, GQA/MQA, bias,
  dropout). The variants are those the lookup tests query, each on the whole grid.

The configs are not measured. Each is made unique in the file (the variant sets BLOCK_M and
num_warps, the head dim BLOCK_N or BLOCK_HEADDIM, the seqlen num_stages), so a lookup that
picks any other entry than the rules say returns a different config and fails its test.

`python tests/ffpa_format.py` rewrites the JSON file; test_tuning_schema checks that the
committed file is exactly what `document()` builds.
"""

from __future__ import annotations

import json
import pathlib

PATH = pathlib.Path(__file__).resolve().parent / "data" / "ffpa_format_NVIDIA_L20.json"
# FFPA's own file (an NVIDIA L20, max mode, 3100 entries), where a checkout keeps it beside
# the repository (../shared/fixtures, not shipped): the same tests read it too when present.
FFPA_OWN = PATH.parents[2].parent / "shared" / "fixtures" / "ffpa_NVIDIA_L20.json"
HEADDIMS = (320, 512, 640, 768, 1024)
SEQLENS = (1024, 2048, 4096, 8192)
CROSS = ((512, 8192), (8192, 512))  # the forward's T != S entries (common fp16 causal)

HEADER = {
    "schema_version": 1,
    "device_name": "NVIDIA L20",
    "device_name_sanitized": "NVIDIA_L20",
    "compute_capability": "8.9",
    "autotune_mode": "max",
    "B": 1,
    "H": 32,
    "full_tasks": True,
    "tune_grid": {"headdims": list(HEADDIMS), "seqlens": [1, *SEQLENS]},
    "hardware_desc": {"enable_backward_split_launch": True, "enable_backward_tma": False,
                      "enable_backward_ws": False, "enable_forward_tma": False,
                      "enable_forward_ws": False},
    "generated_at": "2026-11-26T00:00:00+00:00",
    # FFPA's version fields, which our reader does not know and must keep as written.
    "ffpa_version": "none: written by ffpa_jax's tests/ffpa_format.py",
    "torch_version": "none",
    "triton_version": "none",
}

# (kernel, case_name, dtype, causal, extra fields): each variant on the whole grid.
VARIANTS = (
    ("fwd_generic", "common", "bf16", False, {}),
    ("fwd_generic", "common", "fp16", True, {}),
    ("fwd_generic", "gqa", "bf16", False, {"nheads_kv": 8}),
    ("fwd_generic", "mqa", "fp16", False, {"nheads_kv": 1}),
    ("fwd_generic", "dropout", "bf16", False, {"has_dropout": True}),
    ("fwd_generic", "attn-mask", "bf16", False, {"has_attn_bias": True}),
    ("decode_fwd_stage1", "decode-attn", "bf16", True, {}),
    ("decode_fwd_stage1", "decode-attn", "fp16", False, {}),
    ("bwd_generic", "common", "bf16", False, {}),
    ("bwd_generic", "attn-mask", "bf16", False, {"has_attn_bias": True, "bias_grad": True}),
    ("bwd_generic_dkdv", "common", "fp16", True, {}),
    ("bwd_generic_dkdv", "common", "bf16", False, {}),
    ("bwd_generic_dq", "common", "bf16", False, {}),
    ("bwd_generic_dq", "common", "fp16", True, {}),
    ("bwd_preproc", "common", "bf16", False, {}),
    ("bwd_preproc", "common", "fp16", False, {}),
    ("decode_bwd_stage1", "decode-attn", "bf16", False, {}),
)
_DECODE = ("decode_fwd_stage1", "decode_bwd_stage1")
_WARPS = (1, 2, 4, 8, 16)


def _config(kernel: str, variant: int, d_index: int, seq_index: int) -> dict:
    """A valid config, unique to (variant, head dim, seqlen) within the file."""
    block_m, warps = 16 << (variant % 5), _WARPS[variant // 5]
    stages = 1 + seq_index
    if kernel in ("fwd_generic", "decode_fwd_stage1"):
        return {"BLOCK_HEADDIM_QK": 64, "BLOCK_HEADDIM_V": 64, "BLOCK_M": block_m,
                "BLOCK_N": 16 << d_index, "num_ctas": 1, "num_stages": stages,
                "num_warps": warps}
    if kernel == "bwd_preproc":
        return {"BLOCK_HEADDIM": 16 << d_index, "BLOCK_M": block_m, "D_CHUNK": 64,
                "num_ctas": 1, "num_stages": stages, "num_warps": warps}
    return {"BLOCK_HEADDIM": 64, "BLOCK_M": block_m, "BLOCK_N": 16 << d_index, "num_ctas": 1,
            "num_stages": stages, "num_warps": warps}


def _entry(kernel: str, case: str, dtype: str, causal: bool, extra: dict, headdim: int,
           seqlen_q: int, seqlen_k: int, config: dict) -> dict:
    direction = "forward" if kernel in ("fwd_generic", "decode_fwd_stage1") else "backward"
    e = {"direction": direction, "kernel": kernel, "case_name": case, "causal": causal,
         "dtype": dtype, "headdim": headdim, "seqlen_q": seqlen_q, "seqlen_k": seqlen_k,
         "seqlen_q_bucket": seqlen_q, "seqlen_k_bucket": seqlen_k, "nheads_q": 32,
         "nheads_kv": 32, "has_attn_bias": False, "has_dropout": False, "config": config}
    if kernel != "bwd_preproc" and kernel != "decode_bwd_stage1":
        e.update(enable_tma=False, enable_ws=False)
    if direction == "backward" and kernel != "bwd_preproc":
        e.update(bias_grad=False, grad_kv_storage_dtype=None)
    if kernel in _DECODE:
        e["use_gemv"] = True
    if kernel == "bwd_preproc":
        e["preprocess_d_chunk"] = False
    e.update(extra)
    return dict(sorted(e.items()))


def document() -> dict:
    """The whole file, header and entries, as FFPA lays it out."""
    entries = []
    for v, (kernel, case, dtype, causal, extra) in enumerate(VARIANTS):
        pairs = [(1 if kernel in _DECODE else n, n) for n in SEQLENS]
        if (kernel, case, dtype, causal) == ("fwd_generic", "common", "fp16", True):
            pairs += list(CROSS)
        for d_index, headdim in enumerate(HEADDIMS):
            for seq_index, (t, s) in enumerate(pairs):
                config = _config(kernel, v, d_index, seq_index)
                entries.append(_entry(kernel, case, dtype, causal, extra, headdim, t, s,
                                      config))
    return {**dict(sorted(HEADER.items())), "entries": entries}


def text() -> str:
    """The file's text: the header's fields, then one entry per line."""
    doc = document()
    header = {k: v for k, v in doc.items() if k != "entries"}
    head = json.dumps(header, indent=1)[:-2]  # without the closing brace
    rows = ",\n".join("  " + json.dumps(e) for e in doc["entries"])
    return f'{head},\n "entries": [\n{rows}\n ]\n}}\n'


if __name__ == "__main__":
    PATH.write_text(text())
    print(f"wrote {PATH} ({len(document()['entries'])} entries)")
