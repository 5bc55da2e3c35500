"""Built-in launch parameters, used whenever no tuned entry matches.

Chosen per head dim from measurements on an H100/H200 (docs/fwd_variants.md and
docs/bwd_variants.md have the variant tables they come from). Keys are FFPA's config keys.
"""

from __future__ import annotations

from pallas_kernels.tiers import TIERS

# (largest head dim the row applies to, config). Rows are scanned in order.
_FWD_GENERIC: tuple[tuple[int, dict], ...] = (
    # H200, bf16, N=4096 (docs/fwd_variants.md): 353, 460, 426, 259, 180 TF/s.
    (64, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=64,
              num_warps=8, num_stages=3)),
    (128, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_HEADDIM_QK=128, BLOCK_HEADDIM_V=128,
               num_warps=8, num_stages=3)),
    (256, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_HEADDIM_QK=256, BLOCK_HEADDIM_V=256,
               num_warps=8, num_stages=2)),
    # Above 256 a static unroll over D chunks overflows shared memory (Triton's
    # pipeliner buffers every chunk); the dynamic chunk loop keeps one live.
    (512, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=256,
               num_warps=8, num_stages=4, Q_MODE="dynamic")),
    (1024, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=256,
                num_warps=8, num_stages=4, Q_MODE="dynamic")),
)

# Backward: BLOCK_HEADDIM is the accumulated head-dim slice, BLOCK_HEADDIM_QK the
# chunk of the S/dP reductions. H200, bf16, N=4096 (docs/bwd_variants.md): dq
# 1.68 / 3.06 / 2.98 / 6.78 / 20.8 ms and dkdv 2.53 / 4.24 / 4.58 / 8.86 / 27.7 ms
# at D = 64 / 128 / 256 / 512 / 1024.
_BWD_DQ: tuple[tuple[int, dict], ...] = (
    (64, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_HEADDIM=64, BLOCK_HEADDIM_QK=64,
              num_warps=8, num_stages=3)),
    (128, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_HEADDIM=128, BLOCK_HEADDIM_QK=128,
               num_warps=8, num_stages=2)),
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_HEADDIM=256, BLOCK_HEADDIM_QK=64,
               DYNAMIC_D=True, num_warps=8, num_stages=3)),
    # A 512-wide slice halves the S/dP recomputation against 256 and still fits;
    # BLOCK_N = 128 doubles the work per reloaded Q/dO chunk.
    (1024, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_HEADDIM=512, BLOCK_HEADDIM_QK=64,
                DYNAMIC_D=True, num_warps=8, num_stages=3)),
)
# dbias recomputes S and dP like dq, but no operand is resident: Q, dO, K and V are
# all reloaded per tile and pipelined, so dq's D=128 tiles (4 x 32 KiB x 2 stages)
# overflow shared memory (272 KiB asked at T=S=1000 on the H200); half-size tiles.
_BWD_DBIAS: tuple[tuple[int, dict], ...] = tuple(
    (dim, dict(cfg, BLOCK_M=64, BLOCK_N=64, num_warps=4) if dim == 128 else cfg)
    for dim, cfg in _BWD_DQ)
_BWD_DKDV: tuple[tuple[int, dict], ...] = (
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_HEADDIM=64, BLOCK_HEADDIM_QK=64,
              num_warps=4, num_stages=3)),
    (128, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_HEADDIM=128, BLOCK_HEADDIM_QK=128,
               num_warps=4, num_stages=2)),
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_HEADDIM=256, BLOCK_HEADDIM_QK=64,
               DYNAMIC_D=True, SPLIT_DKDV=True, num_warps=8, num_stages=3)),
    # BLOCK_M (the query tile walked by each KV program) = 128 likewise.
    (1024, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_HEADDIM=512, BLOCK_HEADDIM_QK=64,
                DYNAMIC_D=True, SPLIT_DKDV=True, num_warps=8, num_stages=3)),
)
_BWD_PREPROC: tuple[tuple[int, dict], ...] = (
    (1024, dict(BLOCK_M=64, BLOCK_HEADDIM=128, num_warps=4, num_stages=1)),
)

# float32 tiles take twice the shared memory of 16-bit ones: where a 16-bit
# default is sized to the limit, float32 gets the smaller tile it was measured
# with first (dq with BLOCK_N=128 at D=320 requested 288 KiB of the 227 KiB).
# Decode (T <= 16 against long S): memory-bound, so each program keeps the whole
# output head dim (V is read once) and only 16 packed query rows; the D chunks of
# QKᵀ walk in a loop above 256 to keep one K chunk live.
# H200, bf16, B8 Hq32 Hkv8 T1 S32768 (the decode launch sweep, docs/history.md): D=128 4.17 TB/s
# (3 stages: 3.95); D=512 3.44 TB/s with the whole D chunk static (dynamic BD=64: 2.26).
_DECODE_STAGE1: tuple[tuple[int, dict], ...] = (
    (128, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_HEADDIM_QK=128, BLOCK_HEADDIM_V=128,
               num_warps=4, num_stages=4)),
    (256, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=256,
               num_warps=4, num_stages=3, DYNAMIC_D=True)),
    (512, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_HEADDIM_QK=512, BLOCK_HEADDIM_V=512,
               num_warps=8, num_stages=2)),
    # The H200 autotune run (its record is named in docs/history.md,
    # B1 H32 T1): BLOCK_N=64 takes 0.087 / 0.316 / 1.16 ms at S=1K/4K/16K against
    # 0.136 / 0.500 / 2.05 ms with 32.
    (1024, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=1024,
                num_warps=8, num_stages=2, DYNAMIC_D=True)),
)
_DECODE_STAGE2: tuple[tuple[int, dict], ...] = (
    (1024, dict(BLOCK_HEADDIM_V=128, num_warps=4, num_stages=1)),
)

_FP32_OVERRIDES: dict[str, tuple[tuple[int, dict], ...]] = {
    # float32 V tiles are twice the bytes: fewer buffered stages / keys per step.
    "decode_fwd_stage1": ((512, dict(BLOCK_N=16)), (1024, dict(BLOCK_N=16))),
    # D <= 256: a float32 call (D=256, Dv=26, T=68, S=42, with a mask) asked 238080 of
    # 232448 bytes in the GPU fuzz, and still did with dq/dbias at BLOCK_N=64, so the
    # forward and dkdv tiles shrink too (not yet re-run on a GPU; float32 is the
    # accuracy path, not the speed one).
    # D <= 128: a float32 call (D=44, Dv=107, T=57, S=358, causal, with a mask) asked
    # 245760 bytes in the GPU fuzz of 2026-11-21; the 128-wide KV (and query) tiles
    # of the forward and dq halve.
    "fwd_generic": ((128, dict(BLOCK_N=64)), (256, dict(BLOCK_M=64, BLOCK_N=32))),
    "bwd_generic_dq": ((128, dict(BLOCK_M=64, BLOCK_N=64)), (256, dict(BLOCK_N=64)),
                       (1024, dict(BLOCK_N=64))),
    "bwd_dbias": ((256, dict(BLOCK_N=64)), (1024, dict(BLOCK_N=64))),
    "bwd_generic_dkdv": ((256, dict(BLOCK_N=64)), (1024, dict(BLOCK_M=64))),
}

# With dropout each tile also generates its keep-mask, which changes the best tiles.
# Dropout is for training, so the forward that counts is the vjp's, which writes a
# float32 output. H200, bf16, rate 0.1, N=4096, the generator of 2026-11-22
# (the dropout launch sweep, docs/history.md, session 9): D=128 fwd
# 3.32 ms with a bf16 output (BN=128 with 2 stages: 4.01), dq 3.87 (BN=128: 4.00); D=512
# fwd, float32 output, 6.24 with the plain default (BN=64 with 3 stages, the override for
# the earlier generator: 6.57; BM=64 with 4 warps: 6.06 with a bf16 output but 9.64 with
# float32), dq 6.55 with 128-wide QK chunks (64: 7.34; D=1024: 20.77 against 21.83), dkdv
# 10.91 with BM=64 (11.20).
_DROPOUT_OVERRIDES: dict[str, tuple[tuple[int, dict], ...]] = {
    "fwd_generic": ((128, dict(BLOCK_N=64, num_stages=3)),),
    "bwd_generic_dq": ((128, dict(BLOCK_N=64, num_stages=3)),
                       (1024, dict(BLOCK_HEADDIM_QK=128))),
    "bwd_generic_dkdv": ((1024, dict(BLOCK_M=64)),),
}

_TABLES = {
    "fwd_generic": _FWD_GENERIC,
    "bwd_preproc": _BWD_PREPROC,
    "bwd_generic_dq": _BWD_DQ,
    "bwd_generic_dkdv": _BWD_DKDV,
    "bwd_dbias": _BWD_DBIAS,
    "decode_fwd_stage1": _DECODE_STAGE1,
    "decode_fwd_stage2": _DECODE_STAGE2,
}


def _row(table: tuple[tuple[int, dict], ...], headdim: int) -> tuple[int, dict]:
    for max_dim, config in table:
        if headdim <= max_dim:
            return max_dim, config
    return table[-1]


def default_config(kernel: str, *, headdim: int, dtype: str = "bf16",
                   has_dropout: bool = False) -> dict:
    """The built-in config of `kernel` for head dim `headdim`, dtype and dropout (a
    fresh dict)."""
    max_dim, config = _row(_TABLES[kernel], headdim)
    config = dict(config, num_ctas=1)
    overrides = [_FP32_OVERRIDES] if dtype == "fp32" else []
    if has_dropout:
        overrides.append(_DROPOUT_OVERRIDES)
    for table in overrides:
        for override_dim, changes in table.get(kernel, ()):
            if override_dim == max_dim:
                config.update(changes)
    return config


# ---------------------------------------------------------------- tiers

# The kernel whose tuned entry carries a direction's "tier" field.
TIER_KERNELS = {"forward": "fwd_generic", "backward": "bwd_generic_dkdv"}


def default_tier(direction: str, *, headdim: int, dtype: str = "bf16") -> str:
    """The tier a direction runs on without a tuned entry: the chunked tier's GEMMs beat the
    fused kernels' register-bound head-dim slices above D = 256 in the forward and from
    D = 256 in the backward (H200, bf16, docs/benchmarks.md); float32 keeps the fused kernels,
    whose backward recomputes its own normalised P exactly."""
    if dtype == "fp32":
        return "pallas"
    if direction == "forward":
        return "chunked" if headdim > 256 else "pallas"
    return "chunked" if headdim >= 256 else "pallas"
