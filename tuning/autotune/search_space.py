"""Candidate launch configs for the autotuner, per kernel and head dim, in FFPA's keys.

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

A kernel without a row in `tuning.defaults` (the decode kernels in older
checkouts) starts from `_DECODE_BASE` instead.
"""

from __future__ import annotations

import itertools
from typing import Callable, Iterable

from tuning.defaults import default_config
from tuning.registry import config_problem

MODES = ("fast", "max")
FAST_LIMIT = 8
MAX_MIN = 24
MAX_CANDIDATES = 64

_WARPS = (1, 2, 4, 8)
_MIN_BLOCK = 16
_MAX_ROWS = 256
_MAX_STAGES = 5


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _clamped(cfg: dict, headdim: int) -> dict:
    """`cfg` with head-dim tiles no wider than the head dim needs (as the kernels fit them)."""
    widest = max(_MIN_BLOCK, _pow2_ceil(headdim))
    return {key: min(value, widest) if key.startswith("BLOCK_HEADDIM") else value
            for key, value in cfg.items()}


def _valid(kernel: str, cfg: dict) -> bool:
    if config_problem(kernel, cfg) is not None:
        return False
    for key, value in cfg.items():
        if key in ("BLOCK_M", "BLOCK_N") and not _MIN_BLOCK <= value <= _MAX_ROWS:
            return False
        if key.startswith("BLOCK_HEADDIM") and value < _MIN_BLOCK:
            return False
    return cfg["num_warps"] in _WARPS and 1 <= cfg["num_stages"] <= _MAX_STAGES


# ------------------------------------------------------------------ one-knob moves

Move = Callable[[dict], dict]


def _scale(key: str, factor: float) -> Move:
    return lambda c: {**c, key: int(c[key] * factor)} if key in c else c


def _set(key: str, value) -> Move:
    return lambda c: {**c, key: value}


def _toggle_warps(c: dict) -> dict:
    return {**c, "num_warps": 4 if c["num_warps"] == 8 else 8}


def _stages(delta: int) -> Move:
    return lambda c: {**c, "num_stages": c["num_stages"] + delta}


def _fwd_moves(headdim: int) -> list[Move]:
    if headdim <= 128:
        return [_scale("BLOCK_N", 2), _scale("BLOCK_N", 0.5), _scale("BLOCK_M", 0.5),
                _toggle_warps, _stages(1), _stages(-1), _scale("BLOCK_M", 2),
                _scale("BLOCK_HEADDIM_QK", 0.5)]
    if headdim <= 256:
        return [_scale("BLOCK_N", 2), _set("Q_MODE", "dynamic"), _scale("BLOCK_HEADDIM_QK", 0.25),
                _scale("BLOCK_N", 0.5), _stages(1), _scale("BLOCK_M", 0.5), _toggle_warps,
                _set("Q_MODE", "reload")]
    return [_scale("BLOCK_HEADDIM_V", 0.5), _scale("BLOCK_N", 0.5), _stages(-1),
            _scale("BLOCK_HEADDIM_QK", 2), _scale("BLOCK_M", 0.5), _scale("BLOCK_HEADDIM_V", 2),
            _toggle_warps, _stages(-2)]


def _bwd_moves(headdim: int, kernel: str) -> list[Move]:
    if headdim <= 128:
        return [_scale("BLOCK_N", 0.5), _scale("BLOCK_M", 0.5), _stages(1), _toggle_warps,
                _scale("BLOCK_N", 2), _scale("BLOCK_M", 2), _stages(-1)]
    moves = [_scale("BLOCK_HEADDIM", 0.5), _scale("BLOCK_N", 0.5), _scale("BLOCK_M", 0.5),
             _scale("BLOCK_HEADDIM_QK", 2), _stages(1), _stages(-1), _toggle_warps]
    if kernel == "bwd_generic_dkdv":
        moves.insert(2, lambda c: {**c, "SPLIT_DKDV": not c.get("SPLIT_DKDV", False)})
    return moves


def _preproc_moves(headdim: int) -> list[Move]:
    del headdim
    return [_scale("BLOCK_M", 2), _scale("BLOCK_M", 0.5), _scale("BLOCK_HEADDIM", 2),
            _scale("BLOCK_HEADDIM", 0.5), _set("num_warps", 8), _set("num_warps", 2),
            _stages(1)]


# ------------------------------------------------------------------ product grids


def _fwd_grid(headdim: int) -> Iterable[dict]:
    d = max(_MIN_BLOCK, _pow2_ceil(headdim))
    if headdim <= 128:
        for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
            yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_HEADDIM_QK=d, BLOCK_HEADDIM_V=d,
                       num_warps=w, num_stages=st)
    elif headdim <= 256:
        for bm, bn, st, (bd, mode) in itertools.product(
                (64, 128), (32, 64, 128), (2, 3), ((d, "resident"), (64, "dynamic"))):
            yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_HEADDIM_QK=bd, BLOCK_HEADDIM_V=d,
                       num_warps=8, num_stages=st, Q_MODE=mode)
    else:
        for bm, bn, bd, bdv, st in itertools.product((64, 128), (64, 128, 32), (64, 128),
                                                      (256, 128), (3, 2, 4)):
            yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_HEADDIM_QK=bd, BLOCK_HEADDIM_V=bdv,
                       num_warps=8, num_stages=st, Q_MODE="dynamic")


def _bwd_grid(headdim: int, kernel: str) -> Iterable[dict]:
    d = max(_MIN_BLOCK, _pow2_ceil(headdim))
    if headdim <= 128:
        for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
            yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_HEADDIM=d, BLOCK_HEADDIM_QK=d,
                       num_warps=w, num_stages=st)
        return
    splits = (True, False) if kernel == "bwd_generic_dkdv" else (False,)
    slices = (256, 128) if headdim <= 256 else (512, 256)
    for bm, bn, sl, bd, st, split in itertools.product((64, 128), (64, 128, 32), slices,
                                                        (64, 128), (3, 2), splits):
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_HEADDIM=sl, BLOCK_HEADDIM_QK=bd,
                   DYNAMIC_D=True, num_warps=8, num_stages=st)
        if kernel == "bwd_generic_dkdv":
            cfg["SPLIT_DKDV"] = split
        yield cfg


def _preproc_grid(headdim: int) -> Iterable[dict]:
    del headdim
    for st, bm, bh, w in itertools.product((1, 2), (64, 32, 128, 256), (128, 64, 256),
                                           (4, 2, 8, 1)):
        yield dict(BLOCK_M=bm, BLOCK_HEADDIM=bh, num_warps=w, num_stages=st)


# Decode: used when tuning.defaults has no row for a decode kernel (older checkouts).
_DECODE_BASE = {
    "decode_fwd_stage1": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=128,
                              num_warps=4, num_stages=2),
    "decode_fwd_stage2": dict(BLOCK_HEADDIM_V=128, num_warps=4, num_stages=1),
}


def _decode_moves(kernel: str) -> list[Move]:
    if kernel == "decode_fwd_stage2":
        return [_scale("BLOCK_HEADDIM_V", 2), _scale("BLOCK_HEADDIM_V", 0.5), _set("num_warps", 8),
                _set("num_warps", 2), _scale("BLOCK_HEADDIM_V", 4)]
    # Without NUM_SPLITS the kernel's heuristic picks the split count (about four
    # waves of programs); explicit counts around it come first.
    return [_set("NUM_SPLITS", 32), _set("NUM_SPLITS", 8), _scale("BLOCK_N", 2),
            _scale("BLOCK_N", 0.5), _toggle_warps, _stages(1), _set("NUM_SPLITS", 64)]


def _decode_grid(kernel: str, headdim: int) -> Iterable[dict]:
    d = max(_MIN_BLOCK, _pow2_ceil(headdim))
    if kernel == "decode_fwd_stage2":
        for st, bdv, w in itertools.product((1, 2, 3), (64, 128, 256, 512, 1024), (1, 2, 4, 8)):
            yield dict(BLOCK_HEADDIM_V=bdv, num_warps=w, num_stages=st)
        return
    dynamic = headdim > 256
    for splits, bn, w, st in itertools.product((16, 32, 8, 64), (32, 64, 16), (4, 8), (3, 2)):
        yield dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_HEADDIM_QK=min(d, 64 if dynamic else 128),
                   BLOCK_HEADDIM_V=d, NUM_SPLITS=splits, num_warps=w, num_stages=st,
                   **({"DYNAMIC_D": True} if dynamic else {}))


# ------------------------------------------------------------------ public


def _base(kernel: str, headdim: int, dtype: str) -> dict:
    try:
        return default_config(kernel, headdim=headdim, dtype=dtype)
    except KeyError:  # no built-in default for this kernel
        return dict(_DECODE_BASE[kernel], num_ctas=1)


def _moves_and_grid(kernel: str, headdim: int) -> tuple[list[Move], Iterable[dict]]:
    if kernel == "fwd_generic":
        return _fwd_moves(headdim), _fwd_grid(headdim)
    if kernel == "bwd_preproc":
        return _preproc_moves(headdim), _preproc_grid(headdim)
    if kernel in ("bwd_generic_dq", "bwd_generic_dkdv", "bwd_dbias"):
        return _bwd_moves(headdim, kernel), _bwd_grid(headdim, kernel)
    if kernel in _DECODE_BASE:
        return _decode_moves(kernel), _decode_grid(kernel, headdim)
    raise KeyError(f"no search space for kernel {kernel!r}")


def _key(cfg: dict) -> tuple:
    return tuple(sorted(cfg.items()))


def candidates(kernel: str, *, headdim: int, dtype: str = "bf16", mode: str = "fast") -> list[dict]:
    """The candidate configs of `kernel` for head dim `headdim`, best guess first.

    The first candidate is always the built-in default (what runs without a
    tuned entry), so a tuned winner is never slower than it on the measured shape.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
    base = _base(kernel, headdim, dtype)
    moves, grid = _moves_and_grid(kernel, headdim)
    out: list[dict] = []
    seen: set[tuple] = set()

    def add(cfg: dict) -> None:
        cfg = _clamped(dict(cfg, num_ctas=1), headdim)
        if _key(cfg) not in seen and _valid(kernel, cfg):
            seen.add(_key(cfg))
            out.append(cfg)

    add(base)
    for move in moves:
        add(move(base))
    if mode == "fast":
        return out[:FAST_LIMIT]
    for cfg in grid:
        if len(out) >= MAX_CANDIDATES:
            break
        add(cfg)
    return out
