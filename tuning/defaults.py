"""Built-in launch parameters, used whenever no tuned entry matches, and the built-in tier rule.

The tables live beside each kernel, in its descriptor (`pallas_kernels.KERNEL_DESCRIPTORS`):
per head dim, from measurements on an H100/H200 (docs/fwd_variants.md and
docs/bwd_variants.md have the variant tables they come from), with float32 and dropout
overrides. Keys are FFPA's config keys.
"""

from __future__ import annotations

from pallas_kernels import KERNEL_DESCRIPTORS
from pallas_kernels.descriptor import Table
from pallas_kernels.problem import Problem

_DESCRIPTORS = {d.name: d for d in KERNEL_DESCRIPTORS}


def _row(table: Table, headdim: int) -> tuple[int, dict]:
    for max_dim, config in table:
        if headdim <= max_dim:
            return max_dim, config
    return table[-1]


def default_config(kernel: str, *, headdim: int, dtype: str = "bf16",
                   has_dropout: bool = False) -> dict:
    """The built-in config of `kernel` for head dim `headdim`, dtype and dropout (a
    fresh dict). KeyError for a kernel without a descriptor."""
    descriptor = _DESCRIPTORS[kernel]
    max_dim, config = _row(descriptor.defaults, headdim)
    config = dict(config, num_ctas=1)
    overrides = [descriptor.fp32_overrides] if dtype == "fp32" else []
    if has_dropout:
        overrides.append(descriptor.dropout_overrides)
    for table in overrides:
        for override_dim, changes in table:
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


# A sliding window whose band is at most 1/NARROW_WINDOW_RATIO of the keys runs both
# directions on the fused kernels, up to NARROW_WINDOW_MAX_HEADDIM: they skip hidden tiles at
# their own tile width, where the chunked tier's query blocks read their rows' whole band
# (the tuned tiers were measured without windows; docs/benchmarks.md has the A/B).
NARROW_WINDOW_RATIO = 8
NARROW_WINDOW_MAX_HEADDIM = 512


def narrow_window_tier(problem: Problem) -> str | None:
    """"pallas" for a window narrow enough for the fused kernels' tile skipping to win (see
    NARROW_WINDOW_RATIO), else None (the usual rules decide)."""
    band = problem.window_band
    if band is None or problem.headdim > NARROW_WINDOW_MAX_HEADDIM:
        return None
    return "pallas" if band * NARROW_WINDOW_RATIO <= problem.seq_k else None
