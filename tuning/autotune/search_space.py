"""Candidate launch configs for the autotuner, per kernel and head dim, in FFPA's keys.

Each kernel's moves and grid are in its descriptor (`pallas_kernels.KERNEL_DESCRIPTORS`).
Two modes, named like FFPA's:
- "fast" (at most 8 candidates per kernel): the built-in default, then its
  one-knob neighbours in a fixed priority order (the knobs the variant sweeps in
  docs/ showed to matter most for that head dim come first). A coordinate
  search around a measured starting point: cheap, and it never ranks below the
  default, since the default is always measured.
- "max" (at least 24): the fast set, then a product grid over block sizes,
  warps, stages and the head-dim chunking, capped at `MAX_CANDIDATES`.

Candidates are plain dicts (the `config` of a tuned-config entry). They are not
fitted to the problem here: the kernels shrink oversized tiles themselves, and
the measurement step drops candidates that fit to the same launch. Every
candidate passes `registry.config_problem`; whether it compiles (shared memory)
and computes the right thing is for the measurement to find out.
"""

from __future__ import annotations

from pallas_kernels import KERNEL_DESCRIPTORS
from pallas_kernels.descriptor import tile_width
from pallas_kernels.mosaic import tuned as mosaic_tuned
from pallas_kernels.tiles import MIN_TILE
from tuning.defaults import default_config
from tuning.registry import config_problem

MODES = ("fast", "max")
FAST_LIMIT = 8
MAX_MIN = 24
MAX_CANDIDATES = 64

_WARPS = (1, 2, 4, 8)
_MAX_ROWS = 256
_MAX_STAGES = 5
_DESCRIPTORS = {d.name: d for d in KERNEL_DESCRIPTORS}


def _clamped(cfg: dict, headdim: int) -> dict:
    """`cfg` with head-dim tiles no wider than the head dim needs (as the kernels fit them)."""
    widest = tile_width(headdim)
    return {key: min(value, widest) if key.startswith("BLOCK_HEADDIM") else value
            for key, value in cfg.items()}


def _valid(kernel: str, cfg: dict) -> bool:
    if config_problem(kernel, cfg) is not None:
        return False
    for key, value in cfg.items():
        if key in ("BLOCK_M", "BLOCK_N") and not MIN_TILE <= value <= _MAX_ROWS:
            return False
        if key.startswith("BLOCK_HEADDIM") and value < MIN_TILE:
            return False
    return cfg["num_warps"] in _WARPS and 1 <= cfg["num_stages"] <= _MAX_STAGES


def _key(cfg: dict) -> tuple:
    return tuple(sorted(cfg.items()))


def candidates(kernel: str, *, headdim: int, dtype: str = "bf16", mode: str = "fast",
               group: int = 1) -> list[dict]:
    """The candidate configs of `kernel` for head dim `headdim` (and, for the Mosaic
    kernels, whose defaults and clusters depend on it, GQA group `group`), best guess first.

    The first candidate is always the built-in default (what runs without a
    tuned entry), so a tuned winner is never slower than it on the measured shape.
    KeyError for a kernel without a descriptor.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
    if kernel in mosaic_tuned.FIELDS:
        return _mosaic_candidates(kernel, headdim=headdim, mode=mode, group=group)
    descriptor = _DESCRIPTORS[kernel]
    base = default_config(kernel, headdim=headdim, dtype=dtype)
    out: list[dict] = []
    seen: set[tuple] = set()

    def add(cfg: dict) -> None:
        cfg = _clamped(dict(cfg, num_ctas=1), headdim)
        if _key(cfg) not in seen and _valid(kernel, cfg):
            seen.add(_key(cfg))
            out.append(cfg)

    add(base)
    for move in descriptor.moves(headdim):
        add(move(base))
    if mode == "fast":
        return out[:FAST_LIMIT]
    for cfg in descriptor.grid(headdim):
        if len(out) >= MAX_CANDIDATES:
            break
        add(cfg)
    return out


def _mosaic_candidates(kernel: str, *, headdim: int, mode: str, group: int) -> list[dict]:
    """The Mosaic kernels' candidates (`pallas_kernels.mosaic.tuned.candidate_fields`) for
    D = Dv = `headdim`, as the autotuner's tasks are: one-knob moves in "fast" mode, the
    knobs' grid in "max"."""
    default = mosaic_tuned.default_for(kernel, headdim, headdim, group=group)
    fast = mode == "fast"
    return mosaic_tuned.candidate_fields(kernel, default, head_dim=headdim, head_dim_v=headdim,
                                         group=group, limit=FAST_LIMIT if fast else MAX_CANDIDATES,
                                         grid=not fast)
