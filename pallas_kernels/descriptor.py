"""`KernelDescriptor`: everything the rest of the project knows about one tunable kernel, kept
beside the kernel (fwd.py, decode.py; the backward kernels' in bwd_descriptors.py) and listed
once in `pallas_kernels.KERNEL_DESCRIPTORS`.

`tuning` derives from that list: the kernel names and config keys a tuned-config file may
carry (`tuning.registry`), the built-in launch configs (`tuning.defaults`), the autotuner's
candidates (`tuning.autotune.search_space`) and which runner measures each kernel
(`tuning.autotune.runners`). Adding a kernel means its module (the kernel, its config class,
its descriptor) and one entry in that list. The Mosaic tier's kernels have no descriptor:
their configs are built in (`pallas_kernels.mosaic.config`), so nothing tuned reaches them.
Nothing here reads files or the environment.

A config is a dict in FFPA's keys (`BLOCK_M`, `BLOCK_N`, `BLOCK_HEADDIM_QK`, ...,
`num_warps`, `num_stages`, `num_ctas`), as a tuned-config entry stores it; the kernel's
config class reads it with `from_tuned`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from pallas_kernels.tiles import MIN_TILE, next_pow2

# (largest head dim the row applies to, config), scanned in order: the first row whose
# head dim is >= the problem's applies (the last row beyond it). An override table
# holds the keys that change, at the head dims of the rows they change.
Table = tuple[tuple[int, dict], ...]
# One step of the fast search: a config to its neighbour.
Move = Callable[[dict], dict]


@dataclasses.dataclass(frozen=True)
class KernelDescriptor:
    """One kernel that takes tuned launch parameters.

    - `name`, `direction`: its name in the tuned-config files (FFPA's) and "forward" or
      "backward".
    - `config`: its config class (`from_tuned` maps FFPA's keys to it); `block_keys`, the
      power-of-two block sizes every config holds; `optional_keys`, the keys it may hold.
    - `defaults`: the built-in configs per head dim; `fp32_overrides` and
      `dropout_overrides` change keys of a row for float32 inputs or with dropout.
    - `moves(headdim)`: the fast search's one-knob moves from the default, best guess first;
      `grid(headdim)`: the max search's product grid.
    - `role`: what the kernel computes, which says how the autotuner launches and checks
      it (a runner of `tuning.autotune.runners` per role); `function`, its entry point.
    """

    name: str
    direction: str
    config: type
    block_keys: tuple[str, ...]
    role: str
    function: Callable
    defaults: Table
    moves: Callable[[int], list[Move]]
    grid: Callable[[int], Iterable[dict]]
    optional_keys: tuple[str, ...] = ()
    fp32_overrides: Table = ()
    dropout_overrides: Table = ()


def tile_width(headdim: int) -> int:
    """The widest head-dim tile a kernel computes `headdim` in: a power of two, >= MIN_TILE."""
    return max(MIN_TILE, next_pow2(headdim))


# ------------------------------------------------------------------ one-knob moves


def scaled(key: str, factor: float) -> Move:
    """Multiply `key` by `factor` (a config without the key is left as it is)."""
    return lambda c: {**c, key: int(c[key] * factor)} if key in c else c


def set_to(key: str, value) -> Move:
    return lambda c: {**c, key: value}


def toggle_warps(c: dict) -> dict:
    return {**c, "num_warps": 4 if c["num_warps"] == 8 else 8}


def add_stages(delta: int) -> Move:
    return lambda c: {**c, "num_stages": c["num_stages"] + delta}


def toggle(key: str) -> Move:
    """Flip a boolean key (absent counts as False)."""
    return lambda c: {**c, key: not c.get(key, False)}
