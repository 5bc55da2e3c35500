"""The ring strategy of context parallelism: K and V pass around the mesh axis, one shard per
step, while each shard computes its queries against the keys it holds.

Forward: at step s (0 <= s < P) shard i holds the keys of shard (i − s) mod P. It sends them
on to shard i + 1 (`ppermute`, issued before the step's compute, which does not depend on
it, so the transfer overlaps the compute) and computes its (query piece, key piece) blocks,
merged into its rows by lse. Backward: K and V go around again with their gradient
accumulators: at step s shard i adds its blocks' dK, dV to the accumulator of shard
(i − s) mod P, received from shard i − 1 while it computed them; after P steps one more
send brings each accumulator home.

Every block's relation (hidden, fully or partly visible by causality and the window) is a
function of the step and the shard; where it differs between shards or steps it is taken at
run time and the block runs under `lax.switch` (a hidden block is skipped, not computed and
masked); segments and lengths can hide a block at run time too. The steps are a `lax.scan`:
the program holds each kind of block once, whatever the number of shards. Collectives stay
outside the branches (a shard skipping a block never skips a transfer).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ffpa_jax import context_blocks as cb
from ffpa_jax.context_blocks import FULL, HIDDEN, PARTIAL, Block, ContextCall, Rows
from pallas_kernels import compat
from pallas_kernels.problem import Cotangents, Inputs, Saved


def _send_on(x, call: ContextCall):
    """`x` (a pytree) from every shard to the next one around the axis."""
    if call.parts == 1:
        return x
    perm = [(i, (i + 1) % call.parts) for i in range(call.parts)]
    return jax.lax.ppermute(x, call.axis, perm)


def _shard(call: ContextCall):
    return 0 if call.parts == 1 else jax.lax.axis_index(call.axis)


def relations(call: ContextCall, a: int, b: int) -> set[int]:
    """The relations block (query piece a, key piece b) takes over every step and shard."""
    qp, kp = call.q_pieces, call.k_pieces
    return {call.relation(qp.start(i, a), qp.size, kp.start((i - s) % call.parts, b), kp.size)
            for i in range(call.parts) for s in range(call.parts)}


def _dispatch(relation, present: set[int], branches: dict, *operands):
    """The branch of `relation` (HIDDEN, FULL, PARTIAL; traced or static) over `operands`;
    only the relations in `present` get code of their own."""
    if len(present) == 1:
        return branches[next(iter(present))](*operands)
    table = [branches[r] if r in present else branches[HIDDEN] for r in (HIDDEN, FULL, PARTIAL)]
    return jax.lax.switch(relation, table, *operands)


class _Pair:
    """Block (query piece a, key piece b) at step `step` of the ring on shard `me`: its
    relation, its static shapes and its inputs."""

    def __init__(self, call: ContextCall, inputs: Inputs, kv, a: int, b: int, me, step):
        self.call, self.a, self.b = call, a, b
        qp, kp = call.q_pieces, call.k_pieces
        source = (me - step) % call.parts
        self.r0, self.c0 = qp.start(me, a), kp.start(source, b)
        k, v, kv_ids = kv
        f = inputs.features
        features = f._replace(
            q_segment_ids=(None if f.q_segment_ids is None
                           else qp.local_slice(f.q_segment_ids, a, 1)),
            kv_segment_ids=None if kv_ids is None else kp.local_slice(kv_ids, b, 1),
            sinks=None, positions=cb.positions(self.r0, self.c0, call.shift))
        self.inputs = inputs._replace(q=qp.local_slice(inputs.q, a, 1),
                                      k=kp.local_slice(k, b, 1), v=kp.local_slice(v, b, 1),
                                      features=features)
        self.present = relations(call, a, b)
        relation = call.relation(self.r0, qp.size, self.c0, kp.size)
        hidden = cb.hidden_by_data(self.r0, self.c0, qp.size, kp.size, features)
        if hidden is not None:
            relation = jnp.where(hidden, HIDDEN, relation)
            self.present = self.present | {HIDDEN}
        self.relation = relation

    def block(self, relation: int) -> Block:
        return Block(self.call.q_pieces.size, self.call.k_pieces.size, relation)


def forward(call: ContextCall, inputs: Inputs) -> Rows:
    """This shard's rows of the whole call: out (float32), lse (hi, lo), sinks joined."""
    qp = call.q_pieces
    b, _, hq, _ = inputs.q.shape
    dv = inputs.v.shape[3]
    start = [cb.empty_rows(b, qp.size, hq, dv, call.problem.lse_pair) for _ in range(qp.count)]
    start = jax.tree.map(lambda x: compat.vary_like(x, inputs.q), start)
    kv = (inputs.k, inputs.v, inputs.features.kv_segment_ids)
    me = _shard(call)

    def step(carry, s):
        kv, accs = carry
        following = _send_on(kv, call)
        accs = list(accs)
        for a in range(qp.count):
            for b_ in range(call.k_pieces.count):
                pair = _Pair(call, inputs, kv, a, b_, me, s)
                branches = {HIDDEN: lambda acc: acc}
                for rel in (FULL, PARTIAL):
                    branches[rel] = (lambda acc, rel=rel, pair=pair: cb.merge(
                        acc, cb.block_forward(call, pair.block(rel), pair.inputs)))
                accs[a] = _dispatch(pair.relation, pair.present, branches, accs[a])
        return (following, tuple(accs)), None

    (_, accs), _ = jax.lax.scan(step, (kv, tuple(start)), jax.lax.iota(jnp.int32, call.parts))
    sinks = inputs.features.sinks
    accs = [cb.join_sinks(acc, sinks) for acc in accs]
    return cb.joined_rows(accs)


def backward(call: ContextCall, inputs: Inputs, saved: Saved, cotangents: Cotangents,
             lse_cotangent: bool):
    """(dq, dk, dv, dbias) of this shard's inputs (dbias: this shard's rows' part of it,
    float32) from the merged out and lse of its rows (`saved`)."""
    qp, kp = call.q_pieces, call.k_pieces
    q, k, v, bias = inputs.q, inputs.k, inputs.v, inputs.bias
    zeros = lambda x: compat.vary_like(jnp.zeros(x.shape, jnp.float32), q)
    dqs = tuple(zeros(qp.local_slice(q, a, 1)) for a in range(qp.count))
    dkv = (zeros(k), zeros(v))
    dbias = None if bias is None else zeros(bias)
    kv = (k, v, inputs.features.kv_segment_ids)
    me = _shard(call)

    def step(carry, s):
        kv, dkv, dqs, dbias = carry
        following = _send_on(kv, call)
        received = _send_on(dkv, call)  # the accumulators of the keys held now
        parts_k = [zeros(kp.local_slice(k, b_, 1)) for b_ in range(kp.count)]
        parts_v = [zeros(kp.local_slice(v, b_, 1)) for b_ in range(kp.count)]
        dqs = list(dqs)
        for a in range(qp.count):
            rows_saved, rows_cot = cb.piece_rows(qp, a, saved, cotangents)
            for b_ in range(kp.count):
                pair = _Pair(call, inputs, kv, a, b_, me, s)

                def run(acc, rel, pair=pair, rows_saved=rows_saved, rows_cot=rows_cot):
                    grads = cb.block_backward(call, pair.block(rel), pair.inputs, rows_saved,
                                              rows_cot, lse_cotangent)
                    return _accumulate(acc, grads)
                branches = {HIDDEN: lambda acc: acc,
                            FULL: lambda acc, run=run: run(acc, FULL),
                            PARTIAL: lambda acc, run=run: run(acc, PARTIAL)}
                dqs[a], parts_k[b_], parts_v[b_], dbias = _dispatch(
                    pair.relation, pair.present, branches,
                    (dqs[a], parts_k[b_], parts_v[b_], dbias))
        part = (jnp.concatenate(parts_k, axis=1), jnp.concatenate(parts_v, axis=1))
        dkv = jax.tree.map(jnp.add, received, part)
        return (following, dkv, tuple(dqs), dbias), None

    carry = (kv, dkv, dqs, dbias)
    (_, dkv, dqs, dbias), _ = jax.lax.scan(step, carry, jax.lax.iota(jnp.int32, call.parts))
    dk, dv = _send_on(dkv, call)  # each accumulator home
    dq = jnp.concatenate(dqs, axis=1)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias


def _accumulate(acc, grads):
    dq, dk, dv, dbias = acc
    g_dq, g_dk, g_dv, g_dbias = grads
    add = lambda x, g: x + g.astype(jnp.float32)
    return (add(dq, g_dq), add(dk, g_dk), add(dv, g_dv),
            None if dbias is None else add(dbias, g_dbias))
