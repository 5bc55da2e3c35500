"""Names of the kernels that take tuned launch parameters, and what a valid config is.

The kernels and their config keys come from their descriptors
(`pallas_kernels.KERNEL_DESCRIPTORS`); here are the names used in the tuned-config files
(FFPA's), the keys each kernel's `config` dict carries, and the limits a config must
respect for the kernel to run it. The Mosaic tier's two kernels are ours: their configs
carry fields of its `Config` and check themselves (`pallas_kernels.mosaic.tuned`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from pallas_kernels import KERNEL_DESCRIPTORS
from pallas_kernels.fwd import Q_MODES
from pallas_kernels.mosaic import tuned as mosaic_tuned

# Block sizes must be powers of two (Triton tiles); these are the bounds we
# accept from a file. Anything outside is an invalid entry, skipped at lookup.
_MAX_BLOCK_ROWS = 256
_MAX_BLOCK_HEADDIM = 1024
_VALID_WARPS = (1, 2, 4, 8, 16)
_MAX_STAGES = 8
# Only our own keys are type-checked: FFPA's D_CHUNK (unused here) is left as written.
_BOOL_KEYS = ("DYNAMIC_D", "SPLIT_DKDV")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """What one kernel's `config` dict holds."""

    name: str
    direction: str  # "forward" | "backward"
    block_keys: tuple[str, ...]  # power-of-two block sizes
    optional_keys: tuple[str, ...] = ()
    # A kernel whose config is not in FFPA's keys checks it itself (the Mosaic kernels').
    check: Callable[[Any], str | None] | None = None


# FFPA also persists fused-backward and decode-backward entries; we do not run those
# kernels, but their entries are valid and simply never looked up.
_FFPA_ONLY = (
    KernelSpec("bwd_generic", "backward", ("BLOCK_M", "BLOCK_N", "BLOCK_HEADDIM")),
    KernelSpec("decode_bwd_stage1", "backward", ("BLOCK_M", "BLOCK_N", "BLOCK_HEADDIM")),
)

# The Mosaic tier's kernels: entries of our own (under kernel names FFPA does not use), their
# configs in `pallas_kernels.mosaic.config.Config`'s field names.
_MOSAIC = tuple(
    KernelSpec(kernel, direction, (),
               check=lambda config, kernel=kernel: mosaic_tuned.config_problem(kernel, config))
    for kernel, direction in ((mosaic_tuned.FORWARD_KERNEL, "forward"),
                              (mosaic_tuned.BACKWARD_KERNEL, "backward")))

KERNELS: dict[str, KernelSpec] = {
    spec.name: spec
    for spec in (*(KernelSpec(d.name, d.direction, d.block_keys, d.optional_keys)
                   for d in KERNEL_DESCRIPTORS), *_FFPA_ONLY, *_MOSAIC)
}


def is_power_of_two(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x > 0 and (x & (x - 1)) == 0


def config_problem(kernel: str, config: Any) -> str | None:
    """Why `config` cannot launch `kernel`, or None when it can.

    Used to skip invalid entries of a tuned-config file (never to raise): a
    file written by another version or by hand must not crash a user's step.
    """
    spec = KERNELS.get(kernel)
    if spec is None:
        return f"unknown kernel {kernel!r}"
    if spec.check is not None:
        return spec.check(config)
    if not isinstance(config, Mapping):
        return f"config is {type(config).__name__}, expected a dict"
    for key in spec.block_keys:
        value = config.get(key)
        if not is_power_of_two(value):
            return f"{key}={value!r} is not a positive power of two"
        limit = _MAX_BLOCK_HEADDIM if "HEADDIM" in key else _MAX_BLOCK_ROWS
        if value > limit:
            return f"{key}={value} exceeds {limit}"
    warps = config.get("num_warps")
    if warps not in _VALID_WARPS or isinstance(warps, bool):
        return f"num_warps={warps!r} not in {_VALID_WARPS}"
    stages = config.get("num_stages")
    if not (isinstance(stages, int) and not isinstance(stages, bool)
            and 1 <= stages <= _MAX_STAGES):
        return f"num_stages={stages!r} not in 1..{_MAX_STAGES}"
    ctas = config.get("num_ctas", 1)
    if ctas != 1:
        return f"num_ctas={ctas!r}: only 1 is supported by the Pallas Triton lowering"
    if "BLOCK_HEADDIM_QK" in spec.optional_keys and "BLOCK_HEADDIM_QK" in config:
        value = config["BLOCK_HEADDIM_QK"]
        if not is_power_of_two(value) or value > _MAX_BLOCK_HEADDIM:
            return f"BLOCK_HEADDIM_QK={value!r} is not a power of two <= {_MAX_BLOCK_HEADDIM}"
    for key in _BOOL_KEYS:
        if key in config and not isinstance(config[key], bool):
            return f"{key}={config[key]!r} is not a bool"
    if "Q_MODE" in config and config["Q_MODE"] not in Q_MODES:
        return f"Q_MODE={config['Q_MODE']!r} not in {Q_MODES}"
    if "NUM_SPLITS" in config and not (isinstance(config["NUM_SPLITS"], int)
                                       and not isinstance(config["NUM_SPLITS"], bool)
                                       and config["NUM_SPLITS"] >= 1):
        return f"NUM_SPLITS={config['NUM_SPLITS']!r} is not a positive int"
    return None
