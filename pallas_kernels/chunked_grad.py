"""The chunked tier's backward (`chunked` holds the forward and the blocks both share).

Each block recomputes P from the saved lse (no row max or sum): dV += Pᵀ·dO, dP = dO·Vᵀ,
dS = P·(dP − δ)·cap', dQ = dS·K, dK += dSᵀ·Q, with cap' the soft cap's derivative
1 − tanh²(logits / c). Query blocks run in a loop that carries dK and dV; each query block
runs its key blocks in order and sums their dQ.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import compat
from pallas_kernels.blocked import (MAX_ROW_KEYS, GradBlock, LogitOperands, own_normalised,
                                    softmax_grad, softmax_grad_of_operands)
from pallas_kernels.chunked import (Block, Call, Operands, block_rows, call_record, gemm_operands,
                                    in_row_order, keep_of, key_segments, low_precision, mm,
                                    over_starts, rows_of, runtime_shift, scores_xla, ungrouped,
                                    visible_of)
from pallas_kernels.chunked_plan import (STEP_KERNEL, ChunkConfig, few_key_bands, groups,
                                         key_start)
from pallas_kernels.problem import Cotangents, Inputs, Problem, Saved


def _probs_xla(call: Call, block: GradBlock, blk: Block, *, normalise: bool = False):
    """(scores, P, dropped P, dropped dP), float32 [B, Hq, rows, keys], as XLA ops."""
    logits = block.logits
    b, hq = logits.shape[:2]
    lse = block.lse[..., None]
    s = scores_xla(call, logits, blk)
    ok = jnp.isfinite(lse)
    visible = visible_of(call, blk)
    if visible is not None:
        ok = ok & visible
    probs = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)
    if normalise:
        probs = own_normalised(probs, axis=-1)
    dp = block.dp.astype(jnp.float32)
    dropped = probs
    rate = call.problem.dropout_rate
    if rate > 0.0:
        keep = keep_of(call, blk, batch=b, heads_q=hq)
        inv = 1.0 - rate
        dropped = jnp.where(keep, probs / inv, 0.0)
        dp = jnp.where(keep, dp / inv, 0.0)
    return s, probs, dropped, dp


def _softmax_grad_xla(call: Call, block: GradBlock, blk: Block, *, out_dtype, split: bool,
                      own_delta: bool, normalise: bool = False):
    """`softmax_grad` as XLA ops: (dropped P, (dS[, dS's low word]), dS float32), each
    [B, Hq, rows, keys]; dS is the gradient of the logits before the soft cap."""
    s, probs, dropped, dp = _probs_xla(call, block, blk, normalise=normalise)
    delta = block.delta[..., None]
    if own_delta:
        delta = jnp.sum(probs * dp, axis=-1, keepdims=True) + delta
    ds = probs * (dp - delta)
    if call.problem.softcap is not None:  # through c·tanh(x / c): times 1 - tanh²
        t = s / jnp.asarray(call.problem.softcap, jnp.float32)
        ds = ds * (1.0 - t * t)
    hi = ds.astype(out_dtype)
    parts = (hi, (ds - hi.astype(jnp.float32)).astype(out_dtype)) if split else (hi,)
    return dropped.astype(out_dtype), parts, ds


class _Rows(NamedTuple):
    """The backward's row inputs: lse and the two forms of δ (rowsum(dO·O) - dlse, -dlse)."""

    lse: Any
    delta: Any
    minus_dlse: Any


class _RowBlock(NamedTuple):
    """One query block's rows of the backward's operands, sliced once for all of its key
    blocks (in the key blocks' loop XLA copied them again for every block): q and dO as
    [B, Hkv, G·rows, D], and its `_Rows` [B, Hq, rows]."""

    q: Any
    do: Any
    rows: _Rows


def _row_block(ops: Operands, rows_in: _Rows, r0, rows: int) -> _RowBlock:
    blk = Block(r0, rows, 0, 0)
    return _RowBlock(block_rows(ops.qg, blk), block_rows(ops.dog, blk),
                     _Rows(*(rows_of(x, 2, r0, rows) for x in rows_in)))


class _KeyBlock(NamedTuple):
    """A key block's k and v, [B, Hkv, keys, D]."""

    k: Any
    v: Any


def _key_block(ops: Operands, c0, keys: int) -> _KeyBlock:
    return _KeyBlock(rows_of(ops.kk, 2, c0, keys), rows_of(ops.vv, 2, c0, keys))


def _dp(ops: Operands, row_block: _RowBlock, key_block: _KeyBlock):
    """dP of a block, [B, Hq, rows, keys], in the inputs' dtype: rounded as XLA's own
    gradient rounds it (the cotangent of 16-bit P)."""
    b, hkv, g, _, _ = ops.qg.shape
    shape4 = (b, hkv * g, row_block.q.shape[2] // g, key_block.k.shape[2])
    in_dtype = ops.qg.dtype if low_precision(ops.qg.dtype) else jnp.float32
    return mm("bkmd,bksd->bkms", row_block.do, key_block.v, in_dtype).reshape(shape4)


def _logits(row_block: _RowBlock, key_block: _KeyBlock, shape):
    """A block's logits, float32 `shape` [B, Hq, rows, keys]."""
    return mm("bkmd,bksd->bkms", row_block.q, key_block.k, jnp.float32).reshape(shape)


def _forms_own_delta(call: Call, c0, keys: int) -> bool:
    """Whether a block of `keys` keys from key `c0` takes δ from its own P and dP: it holds
    all S keys (at most `MAX_ROW_KEYS` for the kernel step, whose rows it holds whole). A
    block of a longer sequence holds only some of its rows' keys: never."""
    return (isinstance(c0, int) and c0 == 0 and keys == call.problem.seq_k
            and (not call.kernel_step or keys <= MAX_ROW_KEYS) and call.positions is None)


def _visible_count(call: Call, blk: Block, like):
    """How many of the block's keys each of its rows sees, broadcast like `like`
    [B, Hq, rows]."""
    visible = visible_of(call, blk)
    if visible is None:
        return jnp.full(like.shape, blk.keys, jnp.int32)
    return jnp.broadcast_to(jnp.sum(visible, axis=-1, dtype=jnp.int32), like.shape)


def _few_key_rows_delta(call: Call, ops: Operands, rows_in: _Rows, planned) -> _Rows:
    """`rows_in` with the δ of the rows that see few keys taken from their own P and dP, as
    XLA's softmax gradient takes it (`chunked_plan.few_key_bands`): a row whose visible keys
    all lie in its band. Only for 16-bit inputs (a float32 dP is not rounded), where some
    key block of the `planned` groups holds only part of the keys (one that holds all S
    forms its own δ), and not for blocks of a longer sequence (their rows see keys of other
    blocks too)."""
    seq_k = call.problem.seq_k
    whole = all(_forms_own_delta(call, 0, min(call.config.block_k, g.keys)) for g in planned)
    bands = (few_key_bands(call.problem) if low_precision(ops.qg.dtype) and
             call.positions is None and not whole else None)
    if bands is None:
        return rows_in
    rows, keys, row_starts, key_starts = bands

    def band(starts):
        r0, c0 = starts
        row_block, key_block = _row_block(ops, rows_in, r0, rows), _key_block(ops, c0, keys)
        blk = Block(r0, rows, c0, keys)
        # dP kept on its 16-bit grid, as the blocks' steps read it: where only float32
        # arithmetic reads a GEMM's 16-bit output, XLA may fold the rounding away (its
        # excess precision), and δ would then miss what it is here to cancel.
        dp = _dp(ops, row_block, key_block)
        info = jnp.finfo(dp.dtype)
        dp = jax.lax.reduce_precision(dp.astype(jnp.float32), exponent_bits=info.nexp,
                                      mantissa_bits=info.nmant)
        logits = _logits(row_block, key_block, dp.shape)
        _, probs, _, dp = _probs_xla(
            call, GradBlock(logits, dp, row_block.rows.lse, None, blk.offsets()), blk)
        own = jnp.sum(probs * dp, axis=-1) + row_block.rows.minus_dlse
        holds_all = (_visible_count(call, blk, own)
                     == _visible_count(call, Block(r0, rows, 0, seq_k), own))
        return jnp.where(holds_all, own, row_block.rows.delta)

    # Bands a few at a time: each holds float32 [B, Hq, rows, keys] temporaries.
    per_band = 16 * call.problem.batch * call.problem.heads_q * rows * keys
    per_step = max(1, min(len(row_starts), call.config.budget_bytes // (4 * per_band)))
    deltas = jax.lax.map(band, (jnp.asarray(row_starts, jnp.int32),
                                jnp.asarray(key_starts, jnp.int32)), batch_size=per_step)
    # [bands, B, Hq, rows] into their rows; where the last band overlaps the one before it,
    # the earlier band's rows stand (one value per row: the scatter's order cannot matter).
    index, first = np.unique((np.asarray(row_starts)[:, None] + np.arange(rows)).ravel(),
                             return_index=True)
    values = jnp.moveaxis(deltas, 0, -2).reshape(deltas.shape[1:3] + (-1,))[..., first]
    return rows_in._replace(delta=rows_in.delta.at[:, :, index].set(values))


# The widest head dim whose backward blocks compute their logits in the step's kernel
# (faster than the library GEMM's logits at D = 512 on the H200, slower at 1024:
# docs/history.md, session 44).
LOGITS_IN_STEP_MAX_HEAD_DIM = 512


def logits_in_step(problem: Problem, step: str) -> bool:
    """Whether this problem's backward blocks that hold part of their rows' keys compute
    their logits inside the step's kernel (`softmax_grad_of_operands`) rather than as a GEMM
    whose float32 [R, K] result goes through memory: with the Pallas step, 16-bit operands
    and head dims up to `LOGITS_IN_STEP_MAX_HEAD_DIM`. dP stays a library GEMM: computed in
    the kernel too, both products ran slower there than the library's (docs/history.md,
    session 44)."""
    return (step == STEP_KERNEL and low_precision(problem.dtype)
            and problem.head_dim <= LOGITS_IN_STEP_MAX_HEAD_DIM)


def computes_logits_in_step(call: Call, *, own_delta: bool) -> bool:
    """`logits_in_step` for one block: not where it forms its own δ (that needs its rows
    whole in one program)."""
    return logits_in_step(call.problem, call.config.step) and not own_delta


def _mosaic_step_serves(call: Call, *, split: bool, want_ds: bool) -> bool:
    """Whether the call's blocks may run the Mosaic GPU step (`ChunkConfig.mosaic_step`),
    which wants neither dS's low word (`split`) nor dS in float32 (a bias's gradient)."""
    return call.config.mosaic_step and not split and not want_ds


def _runs_mosaic_step(call: Call, blk, *, own_delta: bool, split: bool,
                      want_ds: bool) -> bool:
    """Whether a block that computes its logits in the step runs the Mosaic GPU step: the
    call's blocks may (`_mosaic_step_serves`) and this one is whole tiles of it."""
    from pallas_kernels.mosaic import grad_step
    return (_mosaic_step_serves(call, split=split, want_ds=want_ds)
            and computes_logits_in_step(call, own_delta=own_delta)
            and not grad_step.unsupported(blk.rows, blk.keys, call.problem.head_dim))


def _backward_block(call: Call, ops: Operands, row_block: _RowBlock, key_block: _KeyBlock,
                    blk: Block, *, lse_cotangent: bool, want_ds: bool, float32_rows: bool):
    """(dq [B, Hkv, G, rows, D], dk [B, Hkv, keys, D], dv [B, Hkv, keys, Dv], ds) of one
    block, float32; ds [B, Hq, rows, keys] float32 only when `want_ds` (a bias's gradient).

    A block that holds all of its rows' keys takes δ = Σ P·dP from its own P and dP (XLA's
    softmax gradient) plus -dlse: then dS sums to dlse·P over a row as it must, and a row
    with a single key gets dq = 0 exactly (with δ from O, dP's 16-bit rounding does not
    cancel; rows that see few keys have theirs from `_few_key_rows_delta`). With
    `float32_rows` (a float32 problem without sinks, whose rows' P sums to 1 over the
    keys) such a block also divides P by its own row sums (`blocked.own_normalised`)."""
    b, hkv, g, _, d = ops.qg.shape
    rows, keys = blk.rows, blk.keys
    q_blk, do_blk = row_block.q, row_block.do
    k_blk = key_block.k
    own_delta = _forms_own_delta(call, blk.c0, keys)
    lse_blk = row_block.rows.lse
    delta_blk = row_block.rows.minus_dlse if own_delta else row_block.rows.delta
    low = low_precision(ops.qg.dtype)
    in_dtype = ops.qg.dtype if low else jnp.float32
    split = low and lse_cotangent
    normalise = own_delta and float32_rows
    dp = _dp(ops, row_block, key_block)
    if _runs_mosaic_step(call, blk, own_delta=own_delta, split=split, want_ds=want_ds):
        # (Imported here: the Mosaic package's forward imports this module.)
        from pallas_kernels.mosaic import grad_step
        dropped, ds = grad_step.block_step(call.problem, q_blk.reshape(b, hkv, g, rows, d),
                                           k_blk, dp, lse_blk, delta_blk, blk.offsets())
        parts, ds32 = (ds,), None
    elif computes_logits_in_step(call, own_delta=own_delta):
        outs = softmax_grad_of_operands(
            call.problem, LogitOperands(ops.qg, ops.kk),
            GradBlock(None, dp, lse_blk, delta_blk, blk.offsets()), call.inputs,
            out_dtype=in_dtype, split=split, with_ds32=want_ds, interpret=call.interpret)
        dropped, parts, ds32 = outs[0], outs[1:2 + split], outs[-1] if want_ds else None
    else:
        logits = _logits(row_block, key_block, dp.shape)
        block = GradBlock(logits, dp, lse_blk, delta_blk, blk.offsets())
        if call.kernel_step:
            outs = softmax_grad(call.problem, block, call.inputs, out_dtype=in_dtype,
                                split=split, with_ds32=want_ds, own_delta=own_delta,
                                normalise=normalise, interpret=call.interpret)
            dropped, parts, ds32 = outs[0], outs[1:2 + split], outs[-1] if want_ds else None
        else:
            dropped, parts, ds32 = _softmax_grad_xla(call, block, blk, out_dtype=in_dtype,
                                                     split=split, own_delta=own_delta,
                                                     normalise=normalise)
    as3 = lambda x: x.reshape(b, hkv, g * rows, keys)  # noqa: E731
    scale = jnp.asarray(call.problem.scale, jnp.float32)
    dv = mm("bkms,bkmd->bksd", as3(dropped), do_blk, jnp.float32)
    dq = sum(mm("bkms,bksd->bkmd", as3(p), k_blk, jnp.float32) for p in parts) * scale
    dk = sum(mm("bkms,bkmd->bksd", as3(p), q_blk, jnp.float32) for p in parts) * scale
    return dq.reshape(b, hkv, g, rows, d), dk, dv, (ds32 if want_ds else None)


def _dbias_block(ds, bias_shape):
    """The block's ds [B, Hq, rows, keys] summed over the bias's broadcast dims."""
    axes = tuple(i for i, n in enumerate(bias_shape) if n == 1 and ds.shape[i] != 1)
    return jnp.sum(ds, axis=axes, keepdims=True) if axes else ds


def _add_at(acc, part, starts):
    """acc with `part` added at `starts` (each may be traced)."""
    if part.shape == acc.shape:  # the whole array: a plain add, which XLA folds into a GEMM
        return acc + part
    # One index type for all starts (python ints are int64 under jax_enable_x64).
    starts = tuple(jnp.asarray(x, jnp.int32) for x in starts)
    current = jax.lax.dynamic_slice(acc, starts, part.shape)
    return jax.lax.dynamic_update_slice(acc, current + part, starts)


# dK and dV accumulate per key block where a call's unrolled blocks (its query groups'
# key blocks, summed) are at most this many and their float32 parts fit the budget
# (`_unrolled_part_bytes`). A block's gradient then adds to its whole accumulator, which
# XLA folds into the GEMM that makes it on the GPU; added into a slice of one
# [B, Hkv, S, D] array, it costs a pass of its own that reads and writes the slice.
# The key blocks' loop is unrolled, so the bound caps the program's size and compile
# time: measured up to 20 blocks (D = 512, N = 16384, causal); larger calls keep the loop.
MAX_UNROLLED_BLOCKS = 24


@dataclasses.dataclass(frozen=True)
class _KeyBlocks:
    """How the backward holds its key blocks. With a `grid` (the blocks' starts, static
    multiples of the key block) dK and dV accumulate per key block, the key blocks' loop
    is unrolled and `once` holds each block's k and v, sliced once for the call; without
    one, a single accumulator per gradient takes each block at its traced offset."""

    grid: tuple[int, ...] | None
    widths: tuple[int, ...]  # each accumulator's keys
    once: dict

    def zeros(self, fresh, like) -> tuple:
        """Zero accumulators for a gradient shaped like `like` [B, Hkv, S, D]."""
        return tuple(fresh(like.shape[:2] + (w,) + like.shape[3:]) for w in self.widths)

    def key_block(self, ops: Operands, c0, keys: int) -> _KeyBlock:
        if isinstance(c0, int) and c0 in self.once:
            return _KeyBlock(*(rows_of(x, 2, 0, keys) for x in self.once[c0]))
        return _key_block(ops, c0, keys)

    def add(self, accs: tuple, part, c0) -> tuple:
        """`accs` with a key block's gradient `part` [B, Hkv, keys, D] added at key `c0`."""
        if self.grid is None:
            return (_add_at(accs[0], part, (0, 0, c0, 0)),)
        j = self.grid.index(c0)
        return accs[:j] + (_add_at(accs[j], part, (0, 0, 0, 0)),) + accs[j + 1:]


def _unrolled_part_bytes(problem: Problem, planned, block_k: int) -> int:
    """The float32 gradient parts of unrolled key blocks that XLA may hold at once: the
    unrolled blocks' dQ parts are summed by one fusion after the last (XLA's GEMM fusion
    does not take an add of two GEMMs' outputs into either GEMM; only an accumulator that
    a loop carries), and outside a loop so are dK's and dV's. A group that loops over its
    query blocks holds one query block's dQ parts; the groups of a single query block run
    outside any loop, side by side, and hold every block's dQ, dK and dV parts (D = 512,
    N = 16384, causal, 20 such blocks: a peak of 17.0 GB, against 9.5 with the loop)."""
    dq = problem.batch * problem.heads_q * problem.head_dim * 4  # a dQ part's bytes a row
    dkv = problem.batch * problem.heads_kv * (problem.head_dim + problem.head_dim_v) * 4
    looped, loose = 0, 0
    for grp in planned:
        blocks = -(-grp.keys // block_k)
        if grp.count > 1:
            looped = max(looped, blocks * dq * grp.rows)
        else:
            loose += blocks * (dq * grp.rows + dkv * block_k)
    return looped + loose


def _key_blocks(call: Call, planned, inputs: Inputs, seq_k: int, *,
                operands_whole: bool) -> _KeyBlocks:
    """The key blocks' record: a grid where every query block's key blocks start at
    static multiples of the key block (no band of keys moves with the rows), the unrolled
    blocks are at most `MAX_UNROLLED_BLOCKS`, their float32 parts fit the workspace budget
    and the step is the Pallas kernels' (where it is XLA fusions, XLA's CPU compiler
    schedules the unrolled blocks side by side, in twice the workspace). The key blocks
    are sliced once from k and v (no whole transposed copy of them is made) unless the
    step reads its logits' operands whole (`operands_whole`): those are in memory anyway,
    and slicing in the loop holds one block at a time."""
    size = call.config.block_k
    grid = tuple(range(0, seq_k, size))
    unrolled = sum(-(-grp.keys // size) for grp in planned)
    if (call.config.step != STEP_KERNEL or any(grp.band for grp in planned)
            or unrolled > MAX_UNROLLED_BLOCKS
            or _unrolled_part_bytes(call.problem, planned, size) > call.config.budget_bytes):
        return _KeyBlocks(grid=None, widths=(seq_k,), once={})
    widths = tuple(min(size, seq_k - c0) for c0 in grid)
    once = {} if operands_whole else {
        c0: _KeyBlock(*(x[:, c0:c0 + w].transpose(0, 2, 1, 3) for x in (inputs.k, inputs.v)))
        for c0, w in zip(grid, widths)}
    return _KeyBlocks(grid=grid, widths=widths, once=once)


def backward(problem: Problem, config: ChunkConfig, inputs: Inputs, saved: Saved,
             cotangents: Cotangents, *, interpret: bool = False, lse_cotangent: bool = False):
    """(dq, dk, dv, dbias) in the inputs' dtypes (dbias in the bias's, None without one),
    on the backward's blocks (`ChunkConfig.for_backward`). `lse_cotangent`: the caller
    differentiates through lse (16-bit dS then enters its products as two words). lse
    counts the sinks already: they only decide how a bias constant over the keys gets its
    gradient."""
    config = config.for_backward()
    q, k, v, bias = inputs.q, inputs.k, inputs.v, inputs.bias
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    lse, d_out = saved.lse, cotangents.d_out
    # A row without keys has lse = -inf and no gradient path; drop its lse cotangent.
    d_lse = jnp.where(lse == -jnp.inf, 0.0, cotangents.d_lse.astype(jnp.float32))
    rows_in = _Rows(lse, jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), saved.out,
                                    precision=jax.lax.Precision.HIGHEST) - d_lse, -d_lse)
    ops = gemm_operands(inputs, d_out)
    call = call_record(problem, config, inputs, interpret)
    # A bias constant over the keys has a closed-form gradient (`row_constant_dbias`) unless
    # the soft cap bends the logits, a sink does not move with them, or the keys are a
    # block of a longer sequence (its share is its own keys' dS): then it takes dS's sum
    # over the keys like any other bias.
    full_bias = bias is not None and (bias.shape[-1] != 1 or problem.softcap is not None
                                      or problem.sinks or problem.positions)
    # Zero carries of the scans below vary over a shard_map's axes as q does (a carry keeps
    # its type).
    def fresh(shape):
        return compat.vary_like(jnp.zeros(shape, jnp.float32), q)

    planned = groups(call.problem, config.block_q)
    rows_in = _few_key_rows_delta(call, ops, rows_in, planned)
    # The Triton step reads its logits' operands whole; the Mosaic one takes the blocks.
    split = low_precision(q.dtype) and lse_cotangent
    operands_whole = logits_in_step(call.problem, config.step) and not _mosaic_step_serves(
        call, split=split, want_ds=full_bias)
    kb = _key_blocks(call, planned, inputs, ops.kk.shape[2], operands_whole=operands_whole)
    carry = (kb.zeros(fresh, ops.kk), kb.zeros(fresh, ops.vv),
             fresh(bias.shape) if full_bias else None)
    run = functools.partial(_backward_block, call, ops, lse_cotangent=lse_cotangent,
                            want_ds=full_bias, float32_rows=problem.natural and not problem.sinks)
    dqs = []
    for grp in planned:
        def rows_body(carry, r0, grp=grp):
            dk, dv, dbias = carry
            first = key_start(call.problem, grp, r0, runtime_shift(call))
            row_block = _row_block(ops, rows_in, r0, grp.rows)

            def block_body(inner, c0, keys: int):
                dq, dk, dv, dbias = inner
                c0 = first + c0
                dq_b, dk_b, dv_b, ds = run(row_block, kb.key_block(ops, c0, keys),
                                           Block(r0, grp.rows, c0, keys))
                dk, dv = kb.add(dk, dk_b, c0), kb.add(dv, dv_b, c0)
                if full_bias:
                    starts = (0, 0, r0 if bias.shape[2] != 1 else 0,
                              c0 if bias.shape[3] != 1 else 0)
                    dbias = _add_at(dbias, _dbias_block(ds, bias.shape), starts)
                return dq + dq_b, dk, dv, dbias

            inner = (fresh((b, hkv, hq // hkv, grp.rows, d)), dk, dv, dbias)
            for keys, starts in key_segments(grp.keys, config.block_k):
                if kb.grid is None:  # a loop over traced starts
                    inner, _ = over_starts(
                        starts, lambda inner, c0, keys=keys: (block_body(inner, c0, keys), None),
                        inner)
                else:
                    for c0 in starts:
                        inner = block_body(inner, c0, keys)
            dq, dk, dv, dbias = inner
            return (dk, dv, dbias), dq.astype(q.dtype)  # final: its key blocks are summed
        carry, dq_rows = over_starts(grp.starts, rows_body, carry)
        dqs.append(dq_rows)
    (dk, dv), dbias = (jnp.concatenate(x, axis=2) for x in carry[:2]), carry[2]
    dq = (ungrouped(in_row_order(dqs, planned, seq_q=t, axis=3, fill=0.0)) if planned
          else jnp.zeros(q.shape, q.dtype))
    if bias is None:
        db = None
    elif full_bias:
        db = dbias.astype(bias.dtype)
    else:
        db = row_constant_dbias(d_lse, bias)
    return (dq.astype(q.dtype), dk.transpose(0, 2, 1, 3).astype(k.dtype),
            dv.transpose(0, 2, 1, 3).astype(v.dtype), db)


def row_constant_dbias(d_lse, bias):
    """dbias of a bias broadcast over the keys (last dim 1), in closed form: adding c to
    every logit of a row leaves P unchanged and adds c to lse, so dbias is d_lse summed over
    the bias's broadcast dims (rows without keys already carry d_lse = 0)."""
    per_row = d_lse[..., None]  # [B, Hq, T, 1]
    axes = tuple(i for i in range(3) if bias.shape[i] == 1 and per_row.shape[i] != 1)
    return jnp.sum(per_row, axis=axes, keepdims=True).astype(bias.dtype)
