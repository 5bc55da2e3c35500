"""The backward kernels' descriptors (`descriptor.KernelDescriptor`): their names in the tuned
files, config keys, built-in launch configs per head dim, and the autotuner's candidates.
"""

from __future__ import annotations

import functools
import itertools
from typing import Iterable

from pallas_kernels.bwd import bwd_dbias, bwd_generic_dkdv, bwd_generic_dq, bwd_preproc
from pallas_kernels.bwd_tile import BwdConfig
from pallas_kernels.descriptor import (KernelDescriptor, Move, Table, add_stages, scaled, set_to,
                                       tile_width, toggle, toggle_warps)

# Built-in launch configs per head dim, chosen by the launch-variant sweeps on the H200
# (docs/bwd_variants.md; the figures are in docs/history.md, "Numbers behind choices in
# the code").
# BLOCK_HEADDIM is the accumulated head-dim slice, BLOCK_HEADDIM_QK the chunk of the S/dP
# reductions.

_DQ_DEFAULTS: Table = (
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
# overflow shared memory; half-size tiles.
_DBIAS_DEFAULTS: Table = tuple(
    (dim, dict(cfg, BLOCK_M=64, BLOCK_N=64, num_warps=4) if dim == 128 else cfg)
    for dim, cfg in _DQ_DEFAULTS)
_DKDV_DEFAULTS: Table = (
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
_PREPROC_DEFAULTS: Table = (
    (1024, dict(BLOCK_M=64, BLOCK_HEADDIM=128, num_warps=4, num_stages=1)),
)

# float32 tiles take twice the shared memory of 16-bit ones: where a 16-bit
# default is sized to the limit, float32 gets the smaller tile it was measured
# with first; float32 calls of the GPU fuzz overflowed shared memory at D <= 128 (dq's
# tiles halve) and D <= 256 (dq, dbias and dkdv shrink).
_DQ_FP32: Table = ((128, dict(BLOCK_M=64, BLOCK_N=64)), (256, dict(BLOCK_N=64)),
                   (1024, dict(BLOCK_N=64)))
_DBIAS_FP32: Table = ((256, dict(BLOCK_N=64)), (1024, dict(BLOCK_N=64)))
_DKDV_FP32: Table = ((256, dict(BLOCK_N=64)), (1024, dict(BLOCK_M=64)))

# With dropout each tile also generates its keep-mask, which changes the best tiles (the
# dropout launch sweep).
_DQ_DROPOUT: Table = ((128, dict(BLOCK_N=64, num_stages=3)), (1024, dict(BLOCK_HEADDIM_QK=128)))
_DKDV_DROPOUT: Table = ((1024, dict(BLOCK_M=64)),)


def _moves(headdim: int, *, split_dkdv: bool = False) -> list[Move]:
    if headdim <= 128:
        return [scaled("BLOCK_N", 0.5), scaled("BLOCK_M", 0.5), add_stages(1), toggle_warps,
                scaled("BLOCK_N", 2), scaled("BLOCK_M", 2), add_stages(-1)]
    moves = [scaled("BLOCK_HEADDIM", 0.5), scaled("BLOCK_N", 0.5), scaled("BLOCK_M", 0.5),
             scaled("BLOCK_HEADDIM_QK", 2), add_stages(1), add_stages(-1), toggle_warps]
    if split_dkdv:
        moves.insert(2, toggle("SPLIT_DKDV"))
    return moves


def _grid(headdim: int, *, split_dkdv: bool = False) -> Iterable[dict]:
    d = tile_width(headdim)
    if headdim <= 128:
        for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
            yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_HEADDIM=d, BLOCK_HEADDIM_QK=d,
                       num_warps=w, num_stages=st)
        return
    splits = (True, False) if split_dkdv else (False,)
    slices = (256, 128) if headdim <= 256 else (512, 256)
    for bm, bn, sl, bd, st, split in itertools.product((64, 128), (64, 128, 32), slices,
                                                       (64, 128), (3, 2), splits):
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_HEADDIM=sl, BLOCK_HEADDIM_QK=bd,
                   DYNAMIC_D=True, num_warps=8, num_stages=st)
        if split_dkdv:
            cfg["SPLIT_DKDV"] = split
        yield cfg


def _preproc_moves(headdim: int) -> list[Move]:
    del headdim
    return [scaled("BLOCK_M", 2), scaled("BLOCK_M", 0.5), scaled("BLOCK_HEADDIM", 2),
            scaled("BLOCK_HEADDIM", 0.5), set_to("num_warps", 8), set_to("num_warps", 2),
            add_stages(1)]


def _preproc_grid(headdim: int) -> Iterable[dict]:
    del headdim
    for st, bm, bh, w in itertools.product((1, 2), (64, 32, 128, 256), (128, 64, 256),
                                           (4, 2, 8, 1)):
        yield dict(BLOCK_M=bm, BLOCK_HEADDIM=bh, num_warps=w, num_stages=st)


# Our extensions of FFPA's backward keys (absent = the kernel's default):
# BLOCK_HEADDIM_QK, the head-dim chunk of the S and dP reductions; DYNAMIC_D, walk
# those chunks with a dynamic loop; SPLIT_DKDV, dK and dV in separate programs.
_OPTIONAL = ("BLOCK_HEADDIM_QK", "DYNAMIC_D")
_BLOCKS = ("BLOCK_M", "BLOCK_N", "BLOCK_HEADDIM")

BWD_PREPROC = KernelDescriptor(
    name=bwd_preproc.__name__, direction="backward", config=BwdConfig, role="delta",
    function=bwd_preproc, block_keys=("BLOCK_M", "BLOCK_HEADDIM"),
    optional_keys=("D_CHUNK",), defaults=_PREPROC_DEFAULTS, moves=_preproc_moves,
    grid=_preproc_grid)
BWD_GENERIC_DKDV = KernelDescriptor(
    name=bwd_generic_dkdv.__name__, direction="backward", config=BwdConfig, role="dkdv",
    function=bwd_generic_dkdv, block_keys=_BLOCKS, optional_keys=_OPTIONAL + ("SPLIT_DKDV",),
    defaults=_DKDV_DEFAULTS, fp32_overrides=_DKDV_FP32, dropout_overrides=_DKDV_DROPOUT,
    moves=functools.partial(_moves, split_dkdv=True),
    grid=functools.partial(_grid, split_dkdv=True))
BWD_GENERIC_DQ = KernelDescriptor(
    name=bwd_generic_dq.__name__, direction="backward", config=BwdConfig, role="dq",
    function=bwd_generic_dq, block_keys=_BLOCKS, optional_keys=_OPTIONAL,
    defaults=_DQ_DEFAULTS, fp32_overrides=_DQ_FP32, dropout_overrides=_DQ_DROPOUT,
    moves=_moves, grid=_grid)
# Ours: the bias gradient, summed over the bias's broadcast dims in-kernel.
BWD_DBIAS = KernelDescriptor(
    name=bwd_dbias.__name__, direction="backward", config=BwdConfig, role="dbias",
    function=bwd_dbias, block_keys=_BLOCKS, optional_keys=_OPTIONAL,
    defaults=_DBIAS_DEFAULTS, fp32_overrides=_DBIAS_FP32, moves=_moves, grid=_grid)
