"""Built-in launch parameters, used whenever no tuned entry matches.

Chosen per head dim from measurements on an H100/H200 (docs/benchmarks.md has
the variant tables they come from). Keys are FFPA's config keys.
"""

from __future__ import annotations

# (largest head dim the row applies to, config). Rows are scanned in order.
_FWD_GENERIC: tuple[tuple[int, dict], ...] = (
    (64, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=64,
              num_warps=4, num_stages=3)),
    (128, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_HEADDIM_QK=128, BLOCK_HEADDIM_V=128,
               num_warps=8, num_stages=3)),
    (256, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=256,
               num_warps=4, num_stages=2)),
    (512, dict(BLOCK_M=128, BLOCK_N=32, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=256,
               num_warps=8, num_stages=2)),
    (1024, dict(BLOCK_M=64, BLOCK_N=32, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=256,
                num_warps=4, num_stages=2)),
)

_TABLES = {
    "fwd_generic": _FWD_GENERIC,
}


def default_config(kernel: str, *, headdim: int) -> dict:
    """The built-in config of `kernel` for head dim `headdim` (a fresh dict)."""
    table = _TABLES[kernel]
    for max_dim, config in table:
        if headdim <= max_dim:
            return dict(config, num_ctas=1)
    return dict(table[-1][1], num_ctas=1)
