"""`bwd_fused_atomic`: the backward in one pass over the tiles, dQ accumulated with float32
atomic adds. The fast backward (`deterministic=False`); `bwd.py` holds the deterministic one.

The deterministic backward recomputes S and dP twice per tile pair: once in `bwd_generic_dq`
(S, dP, dQ: 3 matmuls) and once in `bwd_generic_dkdv` (S, dP, dV, dK: 4). Here one program
per (KV block, batch·KV head, head-dim slice) runs `bwd_generic_dkdv`'s own program
(`bwd._dkdv_program`: the walk over its GQA group's query heads and query blocks, with the
causal limits and the mask's block lists, dropout replayed, dK and dV in registers) and
adds dS·K of each tile to a float32 dQ buffer with atomic adds: 5 matmuls per tile pair.
The order of those adds varies from run to run, so dQ is not bitwise reproducible; dK,
dV and dbias are (dbias keeps its own kernel, `bwd_dbias`).

- dQ's slices follow dK's: the program that accumulates dK's head-dim slice `sl` (every
  program with a dK task, see `bwd.dkdv_tasks`) adds dQ's slice `sl`, since dQ's head dim
  is K's, in blocks of at most DQ_COLUMNS columns. So any D runs, split as the dK/dV kernel
  splits it; a program of a dV-only task computes no dS and adds nothing.
- The buffer is padded to whole [BLOCK_M, BLOCK_HEADDIM] tiles, [B, ⌈T⌉, Hq, ⌈D⌉]: every
  atomic add is unmasked (padded rows and columns receive zeros: dS is 0 past T, K is 0
  past D), which Pallas' interpreter requires and which spares the GPU the bound checks.
  It arrives zeroed (aliased to the output), and a plain XLA pass scales it, crops it and
  converts it to q's dtype.
- A row that sees no key is never visited (or has P = 0 in every tile it is visited in):
  its dQ stays exactly 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import bwd, common, compat
from pallas_kernels.bwd import BwdConfig
from pallas_kernels.common import cdiv, i32
from pallas_kernels.descriptor import KernelDescriptor, Table


# The widest column block of dQ that one atomic add takes. The float32 product leaves the
# MMA's register layout through shared memory on its way to the atomics: a whole 512-wide
# slice at BLOCK_M = 128 would need 256 KiB there (offline, sm_90: the D = 512 default
# overflowed), a 128-wide block 64 KiB.
DQ_COLUMNS = 128


def _dq_adder(st: common.KernelStatic, r: dict, dq_ref, b, hk, kv_start, sl: int, k_chunk):
    """`visit(h, q_start, ds)` for one program: dQ[b, q rows, h, slice sl] += dS·K[kv rows,
    slice sl] (unscaled: the conversion pass applies the scale once), in column blocks of
    at most DQ_COLUMNS; blocks wholly past D are skipped (the buffer is 0 there)."""
    cfg = st.cfg
    bm, bn, width = cfg.block_m, cfg.block_n, cfg.block_slice
    cols = min(width, DQ_COLUMNS)
    starts = [start for start in range(sl * width, (sl + 1) * width, cols)
              if start < st.head_dim]

    def load_columns(start):
        return common.load_tile(r["k"], b, kv_start, bn, hk, start, cols,
                                n_rows=st.seq_k, n_cols=st.head_dim)

    # K's chunks of the S reduction are resident when unrolled; where a chunk is the whole
    # block (the 16-bit defaults up to D = 128) it serves dQ as well, else K's columns are
    # reloaded per tile, as the dK/dV program reloads its Q and dO slices.
    resident = (k_chunk(sl) if not cfg.dynamic and cfg.block_d == width == cols else None)

    def visit(h, q_start, ds):
        for start in starts:
            k_cols = load_columns(start) if resident is None else resident
            part = common.accumulate_ds(jnp.zeros((bm, cols), jnp.float32), ds, k_cols,
                                        split=st.split_ds)
            compat.atomic_add(dq_ref, (i32(b), common.ds(q_start, bm), i32(h),
                                       common.ds(start, cols)), part)
    return visit


def _fused_kernel(*refs, st: common.KernelStatic, tasks: tuple[tuple[str, int], ...]):
    names = bwd._input_names(st, with_lists=True)
    r = dict(zip(names, refs[:len(names)]))
    # refs[len(names)] is the zeroed dQ buffer as an input; the third output is that buffer.
    dk_ref, dv_ref, dq_ref = refs[len(names) + 1:]
    bn = st.cfg.block_n
    pid, bhk = pl.program_id(0), pl.program_id(1)
    kv_block, task = pid // len(tasks), pid % len(tasks)
    b, hk = bhk // st.heads_kv, bhk % st.heads_kv
    kv_start = kv_block * bn

    def run(kind: str, sl: int):
        adder = functools.partial(_dq_adder, st, r, dq_ref, b, hk, kv_start, sl)
        bwd._dkdv_program(st, r, dk_ref, dv_ref, b, hk, kv_block, kv_start,
                          with_dk=kind in ("dkdv", "dk"), with_dv=kind in ("dkdv", "dv"), sl=sl,
                          on_ds=adder)

    if len(tasks) == 1:
        run(*tasks[0])
        return
    for task_id, (kind, sl) in enumerate(tasks):  # each task its own branch
        pl.when(task == task_id)(functools.partial(run, kind, sl))


def dq_buffer_shape(q_shape, *, block_m: int, block_slice: int) -> tuple[int, int, int, int]:
    """The float32 dQ buffer's shape: q's, with T and D rounded up to whole tiles."""
    batch, seq_q, heads_q, head_dim = q_shape
    return (batch, cdiv(seq_q, block_m) * block_m, heads_q,
            cdiv(head_dim, block_slice) * block_slice)


def bwd_fused_atomic(q, k, v, do, lse, delta, bias=None, mask=None, *, scale: float,
                     causal: bool, config: BwdConfig, interpret: bool = False,
                     dropout_rate: float = 0.0, seed: jax.Array | None = None,
                     lse_lo: jax.Array | None = None, split_ds: bool = False,
                     own_delta: bool = False):
    """(dQ [B, T, Hq, D] in q's dtype, dK [B, S, Hkv, D], dV [B, S, Hkv, Dv]) in one pass.
    The arguments are `bwd.bwd_generic_dkdv`'s (`split_ds`, `own_delta` as in
    `bwd.bwd_generic_dq`); dQ's float32 sums are not bitwise reproducible."""
    inputs, st = bwd._prepare(q, k, v, do, lse, delta, bias, mask, seed, config=config,
                              scale=scale, causal=causal, over_kv=False,
                              dropout_rate=dropout_rate, interpret=interpret, lse_lo=lse_lo,
                              split_ds=split_ds, own_delta=own_delta)
    cfg = st.cfg
    tasks = bwd.dkdv_tasks(st.head_dim, st.head_dim_v, cfg.block_slice, cfg.split_dkdv)
    shape = dq_buffer_shape(q.shape, block_m=cfg.block_m, block_slice=cfg.block_slice)
    # Like q's, so that inside a user's shard_map the buffer (and the output it becomes)
    # varies over q's manual axes, as `compat.output_struct` declares the outputs.
    zeros = jnp.zeros_like(q, dtype=jnp.float32, shape=shape)
    compat.silence_triton_deprecation()
    dk, dv, dq = pl.pallas_call(
        functools.partial(_fused_kernel, st=st, tasks=tasks),
        out_shape=(compat.output_struct(k.shape, k.dtype, q),
                   compat.output_struct(v.shape, v.dtype, q),
                   compat.output_struct(shape, jnp.float32, q)),
        grid=(cdiv(st.seq_k, cfg.block_n) * len(tasks), st.batch * st.heads_kv),
        input_output_aliases={len(inputs): 2},
        compiler_params=compat.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret, name="bwd_fused_atomic")(*inputs, zeros)
    dq = (dq[:, :st.seq_q, :, :st.head_dim] * st.scale).astype(q.dtype)
    return dq, dk, dv


# ------------------------------------------------------------------ descriptor
# Built-in launch configs: `bwd_generic_dkdv`'s, whose program this kernel runs, where the
# dQ product and its atomic adds still fit beside dK's and dV's accumulators; its own tuned
# entries replace them per device. Compiled offline for sm_90 (scripts/kernel_resources.py):
# at D = 128, 4 warps spill and 8 do not; from D = 512, BLOCK_M = 128 (dK/dV's) spills
# several times more than 64 once the [BLOCK_M, 128] dQ blocks are live too.
_DEFAULTS: Table = (
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_HEADDIM=64, BLOCK_HEADDIM_QK=64,
              num_warps=4, num_stages=3)),
    (128, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_HEADDIM=128, BLOCK_HEADDIM_QK=128,
               num_warps=8, num_stages=2)),
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_HEADDIM=256, BLOCK_HEADDIM_QK=64,
               DYNAMIC_D=True, SPLIT_DKDV=True, num_warps=8, num_stages=3)),
    (1024, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_HEADDIM=512, BLOCK_HEADDIM_QK=64,
                DYNAMIC_D=True, SPLIT_DKDV=True, num_warps=8, num_stages=3)),
)
# float32 tiles take twice the shared memory: dK/dV's smaller float32 tile at D = 256.
_FP32: Table = ((256, dict(BLOCK_N=64)),)

BWD_FUSED_ATOMIC = KernelDescriptor(
    name="bwd_fused_atomic", direction="backward", config=BwdConfig, role="dqdkdv",
    function=bwd_fused_atomic, block_keys=("BLOCK_M", "BLOCK_N", "BLOCK_HEADDIM"),
    optional_keys=("BLOCK_HEADDIM_QK", "DYNAMIC_D", "SPLIT_DKDV"), defaults=_DEFAULTS,
    fp32_overrides=_FP32,
    moves=functools.partial(bwd._moves, split_dkdv=True),
    grid=functools.partial(bwd._grid, split_dkdv=True))
