"""The all-gather strategy of context parallelism: every shard gathers the whole K and V
(one `all_gather` along the axis) and computes its own query rows against all keys, one
block per query piece; the backward reduce-scatters dK and dV back to their owners.

It moves the same K/V bytes as the ring, in one collective that the compute waits for, and
holds all of K and V on every shard: cheap where the KV heads are few (GQA/MQA), where K/V
are a small part of what a shard holds. Each block sees every key, so it is a call of its
own, with positions: its tier applies causality and the window itself. The sinks join
once, after the pieces' rows (`context_blocks.join_sinks`), as in the ring: a tier takes
no sinks together with positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ffpa_jax import context_blocks as cb
from ffpa_jax.context_blocks import FULL, PARTIAL, Block, ContextCall, Rows
from pallas_kernels.problem import Cotangents, Inputs, Saved


def _gathered(call: ContextCall, x):
    """The whole sequence of a shard's [B, L, ...] array, in natural order."""
    if x is None or call.parts == 1:
        return x
    return call.k_pieces.natural(jax.lax.all_gather(x, call.axis, axis=1, tiled=True), 1)


def _scattered(call: ContextCall, x):
    """The inverse of `_gathered` for a gradient: every shard's whole-sequence partial sums,
    reduced, and this shard's part of them."""
    if call.parts == 1:
        return x
    x = call.k_pieces.sharded(x, 1)
    return jax.lax.psum_scatter(x, call.axis, scatter_dimension=1, tiled=True)


def whole_block(call: ContextCall, a: int) -> Block:
    """Query piece a against every key: fully visible when it is on every shard, else it
    takes the causal/window mask (its tier skips what is hidden)."""
    qp, s = call.q_pieces, call.problem.seq_k
    relations = {call.relation(qp.start(i, a), qp.size, 0, s) for i in range(call.parts)}
    return Block(qp.size, s, FULL if relations == {FULL} else PARTIAL)


def _piece_inputs(call: ContextCall, inputs: Inputs, k, v, kv_ids, a: int) -> Inputs:
    qp = call.q_pieces
    me = 0 if call.parts == 1 else jax.lax.axis_index(call.axis)
    f = inputs.features
    q_ids = None if f.q_segment_ids is None else qp.local_slice(f.q_segment_ids, a, 1)
    features = f._replace(q_segment_ids=q_ids, kv_segment_ids=kv_ids, sinks=None,
                          positions=cb.positions(qp.start(me, a), 0, call.shift))
    return inputs._replace(q=qp.local_slice(inputs.q, a, 1), k=k, v=v, features=features)


def _whole_kv(call: ContextCall, inputs: Inputs):
    return (_gathered(call, inputs.k), _gathered(call, inputs.v),
            _gathered(call, inputs.features.kv_segment_ids))


def forward(call: ContextCall, inputs: Inputs) -> Rows:
    """This shard's rows of the whole call: out (float32), lse (hi, lo), sinks joined."""
    kv = _whole_kv(call, inputs)
    rows = [cb.block_forward(call, whole_block(call, a), _piece_inputs(call, inputs, *kv, a))
            for a in range(call.q_pieces.count)]
    return cb.join_sinks(cb.joined_rows(rows), inputs.features.sinks)


def backward(call: ContextCall, inputs: Inputs, saved: Saved, cotangents: Cotangents,
             lse_cotangent: bool):
    """(dq, dk, dv, dbias) of this shard's inputs (dbias: this shard's rows' part, float32)."""
    qp = call.q_pieces
    kv = _whole_kv(call, inputs)
    dqs, dk, dv, dbias = [], 0.0, 0.0, None
    for a in range(qp.count):
        g_dq, g_dk, g_dv, g_dbias = cb.block_backward(
            call, whole_block(call, a), _piece_inputs(call, inputs, *kv, a),
            *cb.piece_rows(qp, a, saved, cotangents), lse_cotangent)
        dqs.append(g_dq)
        dk = dk + g_dk.astype(jnp.float32)
        dv = dv + g_dv.astype(jnp.float32)
        if g_dbias is not None:
            g_dbias = g_dbias.astype(jnp.float32)
            dbias = g_dbias if dbias is None else dbias + g_dbias
    dq = jnp.concatenate(dqs, axis=1)
    dk, dv = _scattered(call, dk), _scattered(call, dv)
    return (dq.astype(inputs.q.dtype), dk.astype(inputs.k.dtype), dv.astype(inputs.v.dtype),
            dbias)
