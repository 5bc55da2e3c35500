"""Built-in launch parameters, used whenever no tuned entry matches.

The tables live beside each kernel, in its descriptor (`pallas_kernels.KERNEL_DESCRIPTORS`):
per head dim, from measurements on an H100/H200 (docs/fwd_variants.md and
docs/bwd_variants.md have the variant tables they come from), with float32 and dropout
overrides. Keys are FFPA's config keys.
"""

from __future__ import annotations

from pallas_kernels import KERNEL_DESCRIPTORS
from pallas_kernels.descriptor import Table

_DESCRIPTORS = {d.name: d for d in KERNEL_DESCRIPTORS}
DESCRIBED = frozenset(_DESCRIPTORS)  # the kernels whose built-in configs are here


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
