"""The chunked tier: attention as large matrix products over blocks of queries (and keys),
with a workspace bounded by a budget.

Each block of queries (rows [r0, r1)) against a range of keys (columns [c0, c1)) is three
steps that XLA compiles to library GEMMs and fusions:
  1. logits = q·kᵀ for all heads of the block at once, in float32 (one batched GEMM; GQA by
     reshaping the query heads of a group into the rows, never by repeating K/V);
  2. one elementwise/row step: scale, bias, the soft cap, mask, causality, window, segment
     ids and lengths (each from the block's own rows and keys: O(block), never [T, S]),
     softmax, lse, dropout (the same Philox keep decisions as the kernels:
     `pallas_kernels.dropout.keep_block`);
  3. P·V by GEMM, accumulated in float32.
Key blocks of one query block merge by their lse; the sinks join last, as one more "block"
with lse = the sink and no value. Blocks that causality or the window hide entirely are
never built: with a window, each query block reads only the band of keys its rows can see.
The backward recomputes each block from the saved lse (no row max or sum):
dV += Pᵀ·dO, dP = dO·Vᵀ, dS = P·(dP − δ)·cap', dQ = dS·K, dK += dSᵀ·Q, with cap' the soft
cap's derivative 1 − tanh²(logits / c).

The blocks' sizes and which of them run come from `chunked_plan`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import compat, visibility
from pallas_kernels.blocked import (MAX_ROW_KEYS, GradBlock, LogitOperands, own_normalised,
                                    softmax_grad, softmax_grad_of_operands, softmax_rows)
from pallas_kernels.chunked_plan import STEP_KERNEL, ChunkConfig, groups, key_start
from pallas_kernels.dropout import keep_block
from pallas_kernels.problem import Cotangents, Inputs, Problem, Saved
from pallas_kernels.reference import soft_cap, softmax


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call on the chunked tier: its problem (fitted to the arrays), its blocks, whether
    the Pallas step runs in the interpreter, and the arrays the step between the GEMMs
    reads (bias, mask, seed and the visibility arrays; the sinks join the merged rows)."""

    problem: Problem
    config: ChunkConfig
    interpret: bool
    inputs: Inputs

    @property
    def kernel_step(self) -> bool:
        return self.config.step == STEP_KERNEL

    @property
    def positions(self):
        """int32[3] (row0, col0, shift) where the arrays are a block of a longer sequence,
        else None (`FeatureArrays.positions`)."""
        return self.inputs.features.positions


def _segments(limit: int, size: int) -> list[tuple[int, list[int]]]:
    """Key blocks covering [0, limit): (block size, starts) for the full blocks, then the tail."""
    full, tail = divmod(limit, size)
    out = [(size, [i * size for i in range(full)])] if full else []
    return out + ([(tail, [full * size])] if tail else [])


def _over(starts: list[int], body, carry):
    """`body(carry, start)` for each of the evenly spaced `starts` in order: (carry, outputs
    stacked on a new leading axis). One start runs once with a static start; more run in a
    `lax.scan`."""
    if len(starts) == 1:
        carry, out = body(carry, starts[0])
        return carry, jax.tree.map(lambda x: x[None], out)
    # An iota, not a constant array: the shard-local wrapper (custom_partitioning) takes no
    # closed-over constants.
    step = starts[1] - starts[0]
    return jax.lax.scan(body, carry, starts[0] + step * jax.lax.iota(jnp.int32, len(starts)))


def _rows_of(x, axis: int, start, size: int):
    """x[start:start + size] along `axis` (start may be traced), unless that dim broadcasts."""
    if x is None or x.shape[axis] == 1 or (isinstance(start, int) and start == 0
                                           and size == x.shape[axis]):
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


@dataclasses.dataclass(frozen=True)
class _Block:
    """Rows [r0, r0 + rows) against keys [c0, c0 + keys); r0 and c0 may be traced."""

    r0: object
    rows: int
    c0: object
    keys: int

    def offsets(self):
        return jnp.stack([jnp.asarray(self.r0, jnp.int32), jnp.asarray(self.c0, jnp.int32)])


# Operands in the GEMMs' layout: q-like [B, T, Hq, D] as [B, Hkv, G, T, D] (a query head's
# rows contiguous, the heads of a group stacked), k-like [B, S, Hkv, D] as [B, Hkv, S, D].
# Then every product is one batched GEMM over (B, Hkv) of [G·rows, D] by [keys, D], with a
# single contracting dim; with any other layout XLA transposes [rows, keys]-sized operands.


class _Operands(NamedTuple):
    qg: Any  # [B, Hkv, G, T, D]
    kk: Any  # [B, Hkv, S, D]
    vv: Any  # [B, Hkv, S, Dv]
    dog: Any = None  # the output's cotangent, like qg (backward)


def _grouped(x, heads_kv: int):
    b, t, hq, d = x.shape
    return x.reshape(b, t, heads_kv, hq // heads_kv, d).transpose(0, 2, 3, 1, 4)


def _ungrouped(x):
    """[B, Hkv, G, T, D] -> [B, T, Hq, D]."""
    b, hkv, g, t, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, hkv * g, d)


def _operands(inputs: Inputs, d_out=None) -> _Operands:
    hkv = inputs.k.shape[2]
    return _Operands(_grouped(inputs.q, hkv), inputs.k.transpose(0, 2, 1, 3),
                     inputs.v.transpose(0, 2, 1, 3),
                     None if d_out is None else _grouped(d_out, hkv))


def _block_rows(x5, blk: _Block):
    """[B, Hkv, G, T, D] -> the block's rows as [B, Hkv, G·rows, D]."""
    b, hkv, g, _, d = x5.shape
    return _rows_of(x5, 3, blk.r0, blk.rows).reshape(b, hkv, g * blk.rows, d)


def _mm(spec: str, a, b, out_dtype):
    """One batched GEMM. 16-bit operands multiply exactly with float32 accumulation at any
    precision setting; float32 ones need HIGHEST (else TF32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype, precision=precision)


def _low_precision(dtype) -> bool:
    return jnp.dtype(dtype).itemsize < 4


# ---------------------------------------------------------------- the step as XLA ops


def _as_4d(keep):
    """A visibility [R, C] or [B, R, C] as [1|B, 1, R, C]."""
    return keep[None, None] if keep.ndim == 2 else keep[:, None]


def _visible(call: _Call, blk: _Block):
    """bool [B|1, Hq|1, rows, keys], or None when every key is visible. The segment ids
    are sliced to the block's rows and keys: O(block), never [T, S]."""
    problem, f = call.problem, call.inputs.features
    mask = call.inputs.mask
    visible = None if mask is None else _rows_of(_rows_of(mask, 2, blk.r0, blk.rows), 3,
                                                 blk.c0, blk.keys)
    rows = blk.r0 + jnp.arange(blk.rows, dtype=jnp.int32)
    cols = blk.c0 + jnp.arange(blk.keys, dtype=jnp.int32)
    shift = visibility.shift_of(problem.seq_q, problem.seq_k, call.positions)

    def both(keep):
        return keep if visible is None else visible & keep
    if problem.causal:
        visible = both(_as_4d(visibility.causal_visible(rows, cols, shift)))
    segments = None
    if f.q_segment_ids is not None:
        segments = (_rows_of(f.q_segment_ids, 1, blk.r0, blk.rows),
                    _rows_of(f.kv_segment_ids, 1, blk.c0, blk.keys))
    keep = visibility.feature_visible(
        rows, cols, shift=shift, window=problem.window, segments=segments,
        q_len=None if f.q_lengths is None else f.q_lengths[:, None],
        kv_len=None if f.kv_lengths is None else f.kv_lengths[:, None])
    if keep is not None:
        visible = both(_as_4d(keep))
    return visible


def _scores_xla(call: _Call, logits, blk: _Block):
    """scale·logits + bias, soft-capped, float32 [B, Hq, rows, keys] (natural-log units)."""
    s = logits * jnp.asarray(call.problem.scale, jnp.float32)
    bias = call.inputs.bias
    if bias is not None:
        s = s + _rows_of(_rows_of(bias, 2, blk.r0, blk.rows), 3, blk.c0, blk.keys).astype(
            jnp.float32)
    return soft_cap(s, call.problem.softcap)


def _keep(call: _Call, blk: _Block, *, batch: int, heads_q: int):
    """The dropout keep-mask of the block, [B, Hq, rows, keys] ([1, 1, rows, keys] where
    one mask is shared: `dropout.keep_block`, which reads a shard's offsets from the seed);
    a block of a longer sequence draws at its global rows and keys (the positions' row0 and
    col0 added)."""
    r0, c0 = blk.r0, blk.c0
    if call.positions is not None:
        r0, c0 = r0 + call.positions[0], c0 + call.positions[1]
    return keep_block(call.inputs.seed, (batch, heads_q, blk.rows, blk.keys),
                      call.problem.dropout_rate, broadcast=call.problem.dropout_broadcast,
                      rows=r0, cols=c0)


def _shift(call: _Call):
    """The positions' runtime shift, or None (S - T)."""
    return None if call.positions is None else call.positions[2]


def _softmax_xla(call: _Call, logits, blk: _Block, p_dtype):
    """`softmax_rows` as XLA ops: (P [B, Hq, rows, keys] in `p_dtype`, lse [B, Hq, rows])."""
    b, hq = logits.shape[:2]
    probs, lse = softmax(_scores_xla(call, logits, blk), _visible(call, blk))
    rate = call.problem.dropout_rate
    if rate > 0.0:
        keep = _keep(call, blk, batch=b, heads_q=hq)
        probs = jnp.where(keep, probs / (1.0 - rate), jnp.zeros_like(probs))
    return probs.astype(p_dtype), lse


# ---------------------------------------------------------------- forward


def _forward_block(call: _Call, ops: _Operands, blk: _Block):
    """(out [B, Hkv, G, rows, Dv] float32, lse [B, Hq, rows]) of one block, each normalised
    over the block's own keys (lse -inf and out 0 where a row sees none of them)."""
    b, hkv, g, _, _ = ops.qg.shape
    q_blk = _block_rows(ops.qg, blk)
    k_blk = _rows_of(ops.kk, 2, blk.c0, blk.keys)
    v_blk = _rows_of(ops.vv, 2, blk.c0, blk.keys)
    logits = _mm("bkmd,bksd->bkms", q_blk, k_blk, jnp.float32).reshape(
        b, hkv * g, blk.rows, blk.keys)
    p_dtype = ops.vv.dtype if _low_precision(ops.vv.dtype) else jnp.float32
    if call.kernel_step:
        probs, lse = softmax_rows(call.problem, logits, blk.offsets(), call.inputs,
                                  out_dtype=p_dtype, interpret=call.interpret)
    else:
        probs, lse = _softmax_xla(call, logits, blk, p_dtype)
    out = _mm("bkms,bksd->bkmd", probs.reshape(b, hkv, g * blk.rows, blk.keys), v_blk,
              jnp.float32)
    return out.reshape(b, hkv, g, blk.rows, -1), lse


def _merge(acc, part):
    """Two (out [B, Hkv, G, rows, Dv], lse [B, Hq, rows]) over disjoint keys -> the pair
    over their union."""
    (o1, l1), (o2, l2) = acc, part
    lse = jnp.logaddexp(l1, l2)
    safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    w1 = jnp.where(l1 == -jnp.inf, 0.0, jnp.exp(l1 - safe))
    w2 = jnp.where(l2 == -jnp.inf, 0.0, jnp.exp(l2 - safe))
    as_rows = lambda w: w.reshape(o1.shape[:4] + (1,))  # noqa: E731
    return o1 * as_rows(w1) + o2 * as_rows(w2), lse


def _forward_rows(call: _Call, ops: _Operands, r0, rows: int, start, limit: int):
    """(out, lse) of rows [r0, r0 + rows) over keys [start, start + limit), key blocks
    merged by lse."""
    segments = _segments(limit, call.config.block_k)
    run = functools.partial(_forward_block, call, ops)
    if len(segments) == 1 and len(segments[0][1]) == 1:
        return run(_Block(r0, rows, start, limit))
    b, hkv, g, _, _ = ops.qg.shape
    acc = (jnp.zeros((b, hkv, g, rows, ops.vv.shape[3]), jnp.float32),
           jnp.full((b, hkv * g, rows), -jnp.inf, jnp.float32))
    acc = jax.tree.map(lambda x: compat.vary_like(x, ops.qg), acc)  # a scan's carry
    for keys, starts in segments:
        def body(acc, c0, keys=keys):
            return _merge(acc, run(_Block(r0, rows, start + c0, keys))), None
        acc, _ = _over(starts, body, acc)
    return acc


def with_sinks(out, lse, sinks):
    """(out, lse) of rows [B, T, Hq, Dv] / [B, Hq, T] with each head's sink joined to the
    row's denominator: the sink is one more block of keys with lse = sink and no value."""
    if sinks is None:
        return out, lse
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], lse.shape)
    total = jnp.logaddexp(lse, sink)
    weight = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse - total))  # the keys' share
    return out * jnp.swapaxes(weight, 1, 2)[..., None], total


def _stacked_rows(x, axis: int):
    """[count, ..., rows (at axis + 1), ...] -> [..., count·rows, ...]."""
    x = jnp.moveaxis(x, 0, axis)
    shape = x.shape
    return x.reshape(shape[:axis] + (shape[axis] * shape[axis + 1],) + shape[axis + 2:])


def _in_row_order(pieces, planned, *, seq_q: int, axis: int, fill):
    """Each group's stacked rows, with `fill` rows where no block ran, concatenated along
    `axis` into all seq_q rows."""
    out, covered = [], 0
    for piece, g in zip(pieces, planned):
        piece = _stacked_rows(piece, axis)
        if g.first > covered:
            shape = list(piece.shape)
            shape[axis] = g.first - covered
            out.append(jnp.full(shape, fill, piece.dtype))
        out.append(piece)
        covered = g.first + g.rows * g.count
    if covered < seq_q or not out:
        shape = list(pieces[0].shape[1:]) if pieces else None
        if shape is None:
            return None
        shape[axis] = seq_q - covered
        out.append(jnp.full(shape, fill, pieces[0].dtype))
    return jnp.concatenate(out, axis=axis)


def _call(problem: Problem, config: ChunkConfig, inputs: Inputs, interpret: bool) -> _Call:
    """The call's record, with the arrays the step reads (no sinks: they join the merged
    rows)."""
    step_inputs = inputs._replace(features=inputs.features.without_sinks())
    return _Call(problem=dataclasses.replace(problem.sized(inputs), sinks=False), config=config,
                 interpret=interpret, inputs=step_inputs)


def forward(problem: Problem, config: ChunkConfig, inputs: Inputs, *,
            interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(out [B, T, Hq, Dv] float32, lse [B, Hq, T] float32)."""
    call = _call(problem, config, inputs, interpret)
    b, t, hq, _ = inputs.q.shape
    dv = inputs.v.shape[3]
    sinks = inputs.features.sinks
    ops = _operands(inputs)
    planned = groups(call.problem, config.block_q)
    if not planned:  # no row sees a key
        return with_sinks(jnp.zeros((b, t, hq, dv), jnp.float32),
                          jnp.full((b, hq, t), -jnp.inf, jnp.float32), sinks)
    outs, lses = [], []
    for g in planned:
        def body(carry, r0, g=g):
            start = key_start(call.problem, g, r0, _shift(call))
            return carry, _forward_rows(call, ops, r0, g.rows, start, g.keys)
        _, (out, lse) = _over(g.starts, body, None)
        outs.append(out)
        lses.append(lse)
    out = _in_row_order(outs, planned, seq_q=t, axis=3, fill=0.0)
    lse = _in_row_order(lses, planned, seq_q=t, axis=2, fill=-jnp.inf)
    return with_sinks(_ungrouped(out), lse, sinks)


# ---------------------------------------------------------------- backward


def _softmax_grad_xla(call: _Call, block: GradBlock, blk: _Block, *, out_dtype, split: bool,
                      own_delta: bool, normalise: bool = False):
    """`softmax_grad` as XLA ops: (dropped P, (dS[, dS's low word]), dS float32), each
    [B, Hq, rows, keys]; dS is the gradient of the logits before the soft cap."""
    logits = block.logits
    b, hq = logits.shape[:2]
    lse, delta = block.lse[..., None], block.delta[..., None]
    s = _scores_xla(call, logits, blk)
    ok = jnp.isfinite(lse)
    visible = _visible(call, blk)
    if visible is not None:
        ok = ok & visible
    probs = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)
    if normalise:
        probs = own_normalised(probs, axis=-1)
    dp = block.dp.astype(jnp.float32)
    dropped = probs
    rate = call.problem.dropout_rate
    if rate > 0.0:
        keep = _keep(call, blk, batch=b, heads_q=hq)
        inv = 1.0 - rate
        dropped = jnp.where(keep, probs / inv, 0.0)
        dp = jnp.where(keep, dp / inv, 0.0)
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
    return (step == STEP_KERNEL and _low_precision(problem.dtype)
            and problem.head_dim <= LOGITS_IN_STEP_MAX_HEAD_DIM)


def computes_logits_in_step(call: _Call, *, own_delta: bool) -> bool:
    """`logits_in_step` for one block: not where it forms its own δ (that needs its rows
    whole in one program)."""
    return logits_in_step(call.problem, call.config.step) and not own_delta


def _runs_mosaic_step(call: _Call, blk, *, own_delta: bool, split: bool,
                      want_ds: bool) -> bool:
    """Whether a block that computes its logits in the step runs the Mosaic GPU step
    (`ChunkConfig.mosaic_step`): it must be whole tiles of it and want neither dS's low word
    nor dS in float32 (a bias's gradient)."""
    from pallas_kernels.mosaic import grad_step
    return (call.config.mosaic_step and computes_logits_in_step(call, own_delta=own_delta)
            and not grad_step.unsupported(blk.rows, blk.keys, call.problem.head_dim)
            and not split and not want_ds)


def _backward_block(call: _Call, ops: _Operands, rows_in: _Rows, blk: _Block, *,
                    lse_cotangent: bool, want_ds: bool, float32_rows: bool):
    """(dq [B, Hkv, G, rows, D], dk [B, Hkv, keys, D], dv [B, Hkv, keys, Dv], ds) of one
    block, float32; ds [B, Hq, rows, keys] float32 only when `want_ds` (a bias's gradient).

    A block that holds all of its rows' keys takes δ = Σ P·dP from its own P and dP (XLA's
    softmax gradient) plus -dlse: then dS sums to dlse·P over a row as it must, and a row
    with a single key gets dq = 0 exactly (with δ from O, dP's 16-bit rounding does not
    cancel). With `float32_rows` (a float32 problem without sinks, whose rows' P sums to 1
    over the keys) such a block also divides P by its own row sums
    (`blocked.own_normalised`)."""
    b, hkv, g, _, d = ops.qg.shape
    seq_k = ops.kk.shape[2]
    rows, keys = blk.rows, blk.keys
    q_blk, do_blk = _block_rows(ops.qg, blk), _block_rows(ops.dog, blk)
    k_blk, v_blk = _rows_of(ops.kk, 2, blk.c0, keys), _rows_of(ops.vv, 2, blk.c0, keys)
    # (A block of a longer sequence holds only some of its rows' keys: never its own δ.)
    own_delta = (isinstance(blk.c0, int) and blk.c0 == 0 and keys == seq_k
                 and (not call.kernel_step or keys <= MAX_ROW_KEYS)
                 and call.positions is None)
    lse_blk = _rows_of(rows_in.lse, 2, blk.r0, rows)
    delta_blk = _rows_of(rows_in.minus_dlse if own_delta else rows_in.delta, 2, blk.r0, rows)
    low = _low_precision(ops.qg.dtype)
    in_dtype = ops.qg.dtype if low else jnp.float32
    split = low and lse_cotangent
    shape4 = (b, hkv * g, rows, keys)
    normalise = own_delta and float32_rows
    # dP in the input dtype, as XLA's own gradient rounds it (the cotangent of 16-bit P).
    dp = _mm("bkmd,bksd->bkms", do_blk, v_blk, in_dtype).reshape(shape4)
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
        logits = _mm("bkmd,bksd->bkms", q_blk, k_blk, jnp.float32).reshape(shape4)
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
    dv = _mm("bkms,bkmd->bksd", as3(dropped), do_blk, jnp.float32)
    dq = sum(_mm("bkms,bksd->bkmd", as3(p), k_blk, jnp.float32) for p in parts) * scale
    dk = sum(_mm("bkms,bkmd->bksd", as3(p), q_blk, jnp.float32) for p in parts) * scale
    return dq.reshape(b, hkv, g, rows, d), dk, dv, (ds32 if want_ds else None)


def _dbias_block(ds, bias_shape):
    """The block's ds [B, Hq, rows, keys] summed over the bias's broadcast dims."""
    axes = tuple(i for i, n in enumerate(bias_shape) if n == 1 and ds.shape[i] != 1)
    return jnp.sum(ds, axis=axes, keepdims=True) if axes else ds


def _add_at(acc, part, starts):
    """acc with `part` added at `starts` (each may be traced)."""
    if part.shape == acc.shape:  # the whole array: a plain add, which XLA folds into a GEMM
        return acc + part
    current = jax.lax.dynamic_slice(acc, starts, part.shape)
    return jax.lax.dynamic_update_slice(acc, current + part, starts)


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
    ops = _operands(inputs, d_out)
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

    carry = (fresh(ops.kk.shape), fresh(ops.vv.shape), fresh(bias.shape) if full_bias else None)
    call = _call(problem, config, inputs, interpret)
    planned = groups(call.problem, config.block_q)
    run = functools.partial(_backward_block, call, ops, rows_in, lse_cotangent=lse_cotangent,
                            want_ds=full_bias, float32_rows=problem.natural and not problem.sinks)
    dqs = []
    for grp in planned:
        def rows_body(carry, r0, grp=grp):
            dk, dv, dbias = carry
            dq = fresh((b, hkv, hq // hkv, grp.rows, d))
            first = key_start(call.problem, grp, r0, _shift(call))
            for keys, starts in _segments(grp.keys, config.block_k):
                def keys_body(inner, c0, keys=keys):
                    c0 = first + c0
                    dq, dk, dv, dbias = inner
                    dq_b, dk_b, dv_b, ds = run(_Block(r0, grp.rows, c0, keys))
                    dk = _add_at(dk, dk_b, (0, 0, c0, 0))
                    dv = _add_at(dv, dv_b, (0, 0, c0, 0))
                    if full_bias:
                        starts = (0, 0, r0 if bias.shape[2] != 1 else 0,
                                  c0 if bias.shape[3] != 1 else 0)
                        dbias = _add_at(dbias, _dbias_block(ds, bias.shape), starts)
                    return (dq + dq_b, dk, dv, dbias), None
                (dq, dk, dv, dbias), _ = _over(starts, keys_body, (dq, dk, dv, dbias))
            return (dk, dv, dbias), dq.astype(q.dtype)  # final: its key blocks are summed
        carry, dq_rows = _over(grp.starts, rows_body, carry)
        dqs.append(dq_rows)
    dk, dv, dbias = carry
    dq = (_ungrouped(_in_row_order(dqs, planned, seq_q=t, axis=3, fill=0.0)) if planned
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
