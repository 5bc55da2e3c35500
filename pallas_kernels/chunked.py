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
The backward (`chunked_grad`) recomputes each block from the saved lse.

The blocks' sizes and which of them run come from `chunked_plan`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import compat, visibility
from pallas_kernels.blocked import softmax_rows
from pallas_kernels.chunked_plan import STEP_KERNEL, ChunkConfig, groups, key_start
from pallas_kernels.dropout import keep_block
from pallas_kernels.problem import Inputs, Problem
from pallas_kernels.reference import soft_cap, softmax


@dataclasses.dataclass(frozen=True)
class Call:
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


def key_segments(limit: int, size: int) -> list[tuple[int, list[int]]]:
    """Key blocks covering [0, limit): (block size, starts) for the full blocks, then the tail."""
    full, tail = divmod(limit, size)
    out = [(size, [i * size for i in range(full)])] if full else []
    return out + ([(tail, [full * size])] if tail else [])


def over_starts(starts: list[int], body, carry):
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


def rows_of(x, axis: int, start, size: int):
    """x[start:start + size] along `axis` (start may be traced), unless that dim broadcasts."""
    if x is None or x.shape[axis] == 1 or (isinstance(start, int) and start == 0
                                           and size == x.shape[axis]):
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


@dataclasses.dataclass(frozen=True)
class Block:
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


class Operands(NamedTuple):
    qg: Any  # [B, Hkv, G, T, D]
    kk: Any  # [B, Hkv, S, D]
    vv: Any  # [B, Hkv, S, Dv]
    dog: Any = None  # the output's cotangent, like qg (backward)


def _grouped(x, heads_kv: int):
    b, t, hq, d = x.shape
    return x.reshape(b, t, heads_kv, hq // heads_kv, d).transpose(0, 2, 3, 1, 4)


def ungrouped(x):
    """[B, Hkv, G, T, D] -> [B, T, Hq, D]."""
    b, hkv, g, t, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, hkv * g, d)


def gemm_operands(inputs: Inputs, d_out=None) -> Operands:
    hkv = inputs.k.shape[2]
    return Operands(_grouped(inputs.q, hkv), inputs.k.transpose(0, 2, 1, 3),
                     inputs.v.transpose(0, 2, 1, 3),
                     None if d_out is None else _grouped(d_out, hkv))


def block_rows(x5, blk: Block):
    """[B, Hkv, G, T, D] -> the block's rows as [B, Hkv, G·rows, D]."""
    b, hkv, g, _, d = x5.shape
    return rows_of(x5, 3, blk.r0, blk.rows).reshape(b, hkv, g * blk.rows, d)


def mm(spec: str, a, b, out_dtype):
    """One batched GEMM. 16-bit operands multiply exactly with float32 accumulation at any
    precision setting; float32 ones need HIGHEST (else TF32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype, precision=precision)


def low_precision(dtype) -> bool:
    return jnp.dtype(dtype).itemsize < 4


# ---------------------------------------------------------------- the step as XLA ops


def _as_4d(keep):
    """A visibility [R, C] or [B, R, C] as [1|B, 1, R, C]."""
    return keep[None, None] if keep.ndim == 2 else keep[:, None]


def visible_of(call: Call, blk: Block):
    """bool [B|1, Hq|1, rows, keys], or None when every key is visible. The segment ids
    are sliced to the block's rows and keys: O(block), never [T, S]."""
    problem, f = call.problem, call.inputs.features
    mask = call.inputs.mask
    visible = None if mask is None else rows_of(rows_of(mask, 2, blk.r0, blk.rows), 3,
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
        segments = (rows_of(f.q_segment_ids, 1, blk.r0, blk.rows),
                    rows_of(f.kv_segment_ids, 1, blk.c0, blk.keys))
    keep = visibility.feature_visible(
        rows, cols, shift=shift, window=problem.window, segments=segments,
        q_len=None if f.q_lengths is None else f.q_lengths[:, None],
        kv_len=None if f.kv_lengths is None else f.kv_lengths[:, None])
    if keep is not None:
        visible = both(_as_4d(keep))
    return visible


def scores_xla(call: Call, logits, blk: Block):
    """scale·logits + bias, soft-capped, float32 [B, Hq, rows, keys] (natural-log units)."""
    s = logits * jnp.asarray(call.problem.scale, jnp.float32)
    bias = call.inputs.bias
    if bias is not None:
        s = s + rows_of(rows_of(bias, 2, blk.r0, blk.rows), 3, blk.c0, blk.keys).astype(
            jnp.float32)
    return soft_cap(s, call.problem.softcap)


def keep_of(call: Call, blk: Block, *, batch: int, heads_q: int):
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


def runtime_shift(call: Call):
    """The positions' runtime shift, or None (S - T)."""
    return None if call.positions is None else call.positions[2]


def _softmax_xla(call: Call, logits, blk: Block, p_dtype):
    """`softmax_rows` as XLA ops: (P [B, Hq, rows, keys] in `p_dtype`, lse [B, Hq, rows])."""
    b, hq = logits.shape[:2]
    probs, lse = softmax(scores_xla(call, logits, blk), visible_of(call, blk))
    rate = call.problem.dropout_rate
    if rate > 0.0:
        keep = keep_of(call, blk, batch=b, heads_q=hq)
        probs = jnp.where(keep, probs / (1.0 - rate), jnp.zeros_like(probs))
    return probs.astype(p_dtype), lse


# ---------------------------------------------------------------- forward


def _forward_block(call: Call, ops: Operands, blk: Block):
    """(out [B, Hkv, G, rows, Dv] float32, lse [B, Hq, rows]) of one block, each normalised
    over the block's own keys (lse -inf and out 0 where a row sees none of them)."""
    b, hkv, g, _, _ = ops.qg.shape
    q_blk = block_rows(ops.qg, blk)
    k_blk = rows_of(ops.kk, 2, blk.c0, blk.keys)
    v_blk = rows_of(ops.vv, 2, blk.c0, blk.keys)
    logits = mm("bkmd,bksd->bkms", q_blk, k_blk, jnp.float32).reshape(
        b, hkv * g, blk.rows, blk.keys)
    p_dtype = ops.vv.dtype if low_precision(ops.vv.dtype) else jnp.float32
    if call.kernel_step:
        probs, lse = softmax_rows(call.problem, logits, blk.offsets(), call.inputs,
                                  out_dtype=p_dtype, interpret=call.interpret)
    else:
        probs, lse = _softmax_xla(call, logits, blk, p_dtype)
    out = mm("bkms,bksd->bkmd", probs.reshape(b, hkv, g * blk.rows, blk.keys), v_blk,
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


def _forward_rows(call: Call, ops: Operands, r0, rows: int, start, limit: int):
    """(out, lse) of rows [r0, r0 + rows) over keys [start, start + limit), key blocks
    merged by lse."""
    segments = key_segments(limit, call.config.block_k)
    run = functools.partial(_forward_block, call, ops)
    if len(segments) == 1 and len(segments[0][1]) == 1:
        return run(Block(r0, rows, start, limit))
    b, hkv, g, _, _ = ops.qg.shape
    acc = (jnp.zeros((b, hkv, g, rows, ops.vv.shape[3]), jnp.float32),
           jnp.full((b, hkv * g, rows), -jnp.inf, jnp.float32))
    acc = jax.tree.map(lambda x: compat.vary_like(x, ops.qg), acc)  # a scan's carry
    for keys, starts in segments:
        def body(acc, c0, keys=keys):
            return _merge(acc, run(Block(r0, rows, start + c0, keys))), None
        acc, _ = over_starts(starts, body, acc)
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


def in_row_order(pieces, planned, *, seq_q: int, axis: int, fill):
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


def call_record(problem: Problem, config: ChunkConfig, inputs: Inputs, interpret: bool) -> Call:
    """The call's record, with the arrays the step reads (no sinks: they join the merged
    rows)."""
    step_inputs = inputs._replace(features=inputs.features.without_sinks())
    return Call(problem=dataclasses.replace(problem.sized(inputs), sinks=False), config=config,
                 interpret=interpret, inputs=step_inputs)


def forward(problem: Problem, config: ChunkConfig, inputs: Inputs, *,
            interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(out [B, T, Hq, Dv] float32, lse [B, Hq, T] float32)."""
    call = call_record(problem, config, inputs, interpret)
    b, t, hq, _ = inputs.q.shape
    dv = inputs.v.shape[3]
    sinks = inputs.features.sinks
    ops = gemm_operands(inputs)
    planned = groups(call.problem, config.block_q)
    if not planned:  # no row sees a key
        return with_sinks(jnp.zeros((b, t, hq, dv), jnp.float32),
                          jnp.full((b, hq, t), -jnp.inf, jnp.float32), sinks)
    outs, lses = [], []
    for g in planned:
        def body(carry, r0, g=g):
            start = key_start(call.problem, g, r0, runtime_shift(call))
            return carry, _forward_rows(call, ops, r0, g.rows, start, g.keys)
        _, (out, lse) = over_starts(g.starts, body, None)
        outs.append(out)
        lses.append(lse)
    out = in_row_order(outs, planned, seq_q=t, axis=3, fill=0.0)
    lse = in_row_order(lses, planned, seq_q=t, axis=2, fill=-jnp.inf)
    return with_sinks(ungrouped(out), lse, sinks)
