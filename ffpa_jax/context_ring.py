"""The ring strategy of context parallelism: K and V pass around the mesh axis, one shard per
step, while each shard computes its queries against the keys it holds.

Forward: at step s (0 <= s < P) shard i holds the keys of shard (i − s) mod P. It sends them
on to shard i + 1 (`ppermute`, issued before the step's compute, which does not depend on
it, so the transfer overlaps the compute) and computes its (query piece, key piece) blocks,
merged into its rows by lse. Backward: K and V go around again with their gradient
accumulators: at step s shard i adds its blocks' dK, dV to the accumulator of shard
(i − s) mod P, received from shard i − 1 while it computed them; after P steps one more
send brings each accumulator home. Where those float32 accumulators are large, the keys go
around in several rounds (`rounds`), each a ring of one part of every key piece, so that a
shard holds the accumulators of that part only.

Every block's relation (hidden, fully or partly visible by causality and the window) is a
function of the step and the shard; where it differs between shards or steps it is taken at
run time. On tiers that skip by a block's runtime shift (the fused kernels), one partly
visible block serves every relation: its kernels walk no tile of a hidden block and every
tile of a fully visible one unmasked. On the others the block runs under `lax.switch` (a
hidden block is skipped, not computed and masked). Segments and lengths can hide a block at
run time too, under `lax.switch` on every tier. A switch is a cost of its own on GPUs: XLA's
runtime copies its index to the host and waits for the device there, so the host cannot
queue the work after it while the device runs what comes before (docs/context_parallel.md).
The steps are a `lax.scan`: the program holds each kind of block once, whatever the number
of shards. Collectives stay outside the branches (a shard skipping a block never skips a
transfer).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ffpa_jax import context_blocks as cb
from ffpa_jax.context_blocks import FULL, HIDDEN, PARTIAL, Block, ContextCall, Rows
from ffpa_jax.layout import slice_after
from pallas_kernels import chunked_plan, compat
from pallas_kernels.problem import Cotangents, Inputs, Saved

# The backward holds the float32 dK and dV of the keys in flight three times over (the
# accumulators received, the ones sent on, this step's part): the keys go around in as
# many rounds (a power of two) as keep one round's accumulators within a share of the
# workspace budget (`round_bytes`), the one memory knob of the blocks' temporaries. Each
# round halves the blocks' keys, which costs time where they are already short.
# $FFPA_RING_ROUNDS (a power of two) asks for a number of rounds instead, to trade the
# accumulators' memory for time apart from the blocks' budget; a malformed value leaves the
# rule in charge.
ROUND_SHARE = 2  # the accumulators of a round: at most 1 / ROUND_SHARE of the budget
ROUNDS_ENV = "FFPA_RING_ROUNDS"

# At step 0 every shard holds its own keys. A block partly visible there whose shift is the
# same on every shard (a causal ring's diagonal blocks, where T = S) runs as a branch of its
# own that passes the shift to its tier at trace time (`Block.shift`): the chunked tier then
# skips what causality hides, as in an unsplit call, where a runtime shift makes it compute
# the whole block and mask it. Blocks whose tiers skip by the runtime shift anyway (the
# Mosaic and Triton kernels) keep one partly visible branch: one kernel fewer to compile.
PARTIAL_AT_HOME = 3


def send_on(x, call: ContextCall, step: int = 1):
    """`x` (a pytree) from every shard i to shard i + step around the axis (a negative step:
    back)."""
    if call.parts == 1:
        return x
    perm = [(i, (i + step) % call.parts) for i in range(call.parts)]
    return jax.lax.ppermute(x, call.axis, perm)


def shard_index(call: ContextCall):
    return 0 if call.parts == 1 else jax.lax.axis_index(call.axis)


class Keys(NamedTuple):
    """The part of every key piece one round of the ring moves: `size` keys from `offset`."""

    offset: int
    size: int

    def of(self, x, kp, b: int, zero=None):
        """This part of key piece b of a shard's array x (sequence axis 1; None stays);
        with `zero` (see `_zero_after`), a slice made no earlier than that value."""
        if x is None:
            return None
        start = b * kp.size + self.offset
        if start == 0 and self.size == x.shape[1]:
            return x
        return slice_after(x, start, self.size, 1, zero)


def _relations_at(call: ContextCall, a: int, b: int, keys: Keys, steps) -> set[int]:
    qp, kp = call.q_pieces, call.k_pieces
    return {call.relation(qp.start(i, a), qp.size,
                          kp.start((i - s) % call.parts, b) + keys.offset, keys.size)
            for i in range(call.parts) for s in steps}


def home_shift(call: ContextCall, a: int, b: int, keys: Keys | None = None) -> int | None:
    """The shift of block (query piece a, key piece b, or the part `keys` of it) at step 0
    where it is partly visible there, the same on every shard, and of use to its tiers
    (`PARTIAL_AT_HOME`), else None."""
    qp, kp = call.q_pieces, call.k_pieces
    keys = keys or Keys(0, kp.size)
    shifts = {qp.start(i, a) - kp.start(i, b) - keys.offset + call.shift
              for i in range(call.parts)}
    if (len(shifts) > 1 or _relations_at(call, a, b, keys, [0]) != {PARTIAL}
            or cb.skips_by_runtime_shift(call, Block(qp.size, keys.size, PARTIAL))):
        return None
    return shifts.pop()


def relations(call: ContextCall, a: int, b: int, keys: Keys, home: int | None,
              steps=None) -> set[int]:
    """The relations block (query piece a, key piece b, or the part `keys` of it) takes over
    every shard and the `steps` (None: every step of the ring), given its `home_shift`
    (PARTIAL_AT_HOME: PARTIAL at step 0 with that shift)."""
    steps = range(call.parts) if steps is None else steps
    if home is None or 0 not in steps:
        return _relations_at(call, a, b, keys, steps)
    return _relations_at(call, a, b, keys, [s for s in steps if s]) | {PARTIAL_AT_HOME}


def coded_relations(call: ContextCall, keys: Keys, present: set[int], direction: str) -> set[int]:
    """The relations that get code of their own in `direction` among those a block takes
    (`present`): where it takes several and its tier there skips by a runtime shift, the
    partly visible block alone (its place given at run time), which serves them all without
    a switch."""
    if len(present) > 1 and cb.skips_by_runtime_shift(
            call, Block(call.q_pieces.size, keys.size, PARTIAL), (direction,)):
        return {PARTIAL}
    return present


def blocks(call: ContextCall, a: int, b: int, keys: Keys | None = None,
           steps=None, directions=("forward", "backward")) -> list[Block]:
    """The static blocks that block (query piece a, key piece b; or the part `keys` of the
    key piece, a round of the backward) runs as (hidden: none) over the `steps` (None: every
    step of the ring), in either of `directions`."""
    keys = Keys(0, call.k_pieces.size) if keys is None else keys
    shift = home_shift(call, a, b, keys)
    present = relations(call, a, b, keys, shift, steps)
    taken = set().union(*(coded_relations(call, keys, present, d) for d in directions))
    return [Block(call.q_pieces.size, keys.size, PARTIAL, shift) if r == PARTIAL_AT_HOME
            else Block(call.q_pieces.size, keys.size, r)
            for r in sorted(taken) if r != HIDDEN]


def round_bytes() -> int:
    """The most bytes of float32 dK and dV one round of the backward holds (ROUND_SHARE)."""
    return chunked_plan.budget_from_env() // ROUND_SHARE


def rounds_from_env() -> int | None:
    """$FFPA_RING_ROUNDS when it is a power of two (1, 2, 4, ...), else None. Read when a
    call is traced."""
    raw = os.environ.get(ROUNDS_ENV, "").strip()
    if not raw.isdigit() or int(raw) < 1 or int(raw) & (int(raw) - 1):
        return None
    return int(raw)


def rounds(call: ContextCall) -> int:
    """The backward's rounds (see ROUND_SHARE), or as many as $FFPA_RING_ROUNDS asks for:
    each a whole number of keys, starting at a multiple of the dropout tiles where the call
    draws dropout (so at most as many as the key pieces can be split into)."""
    return explain_rounds(call)[0]


def explain_rounds(call: ContextCall) -> tuple[int, str]:
    """(`rounds(call)`, why)."""
    problem, kp = call.problem, call.k_pieces
    accumulators = (4 * problem.batch * kp.local * problem.heads_kv
                    * (problem.head_dim + problem.head_dim_v))
    requested, limit = rounds_from_env(), round_bytes()
    wanted = ((lambda count: count < requested) if requested is not None
              else (lambda count: accumulators > count * limit))
    count = 1
    while wanted(count) and kp.size % (2 * count) == 0:
        size = kp.size // (2 * count)
        if problem.has_dropout and size % cb.DROPOUT_KEY_ALIGNMENT:
            break
        count *= 2
    if requested is not None:
        why = f"${ROUNDS_ENV}={requested}"
    else:
        why = (f"a shard's float32 dK, dV are {accumulators / 2**20:g} MiB, a round holds at "
               f"most {limit / 2**20:g} MiB (1/{ROUND_SHARE} of the workspace budget, "
               f"${chunked_plan.BUDGET_ENV})")
    if wanted(count):
        why += (f"; each key piece ({kp.size} keys) splits into {count} at most"
                + (f" (whole tiles of {cb.DROPOUT_KEY_ALIGNMENT} keys under dropout)"
                   if problem.has_dropout else ""))
    return count, why


def backward_blocks(call: ContextCall) -> set[Block]:
    """Every static block the backward runs, over its rounds."""
    count = rounds(call)
    size = call.k_pieces.size // count
    return {block for r in range(count) for a in range(call.q_pieces.count)
            for b in range(call.k_pieces.count)
            for block in blocks(call, a, b, Keys(r * size, size), directions=("backward",))}


def dispatch(relation, present: set[int], branches: dict, *operands):
    """The branch of `relation` (HIDDEN, FULL, PARTIAL, PARTIAL_AT_HOME; traced or static)
    over `operands`; only the relations in `present` get code of their own."""
    if len(present) == 1:
        return branches[next(iter(present))](*operands)
    table = [branches[r] if r in present else branches[HIDDEN]
             for r in (HIDDEN, FULL, PARTIAL, PARTIAL_AT_HOME)]
    return jax.lax.switch(relation, table, *operands)


class Pair:
    """Block (query piece a, key piece b) at step `step` of the ring on shard `me`, in
    `direction`: its relation, its static shapes and its inputs."""

    def __init__(self, call: ContextCall, inputs: Inputs, held, a: int, b: int, me, step,
                 keys: Keys, direction: str, steps: tuple[int, ...] | None = None):
        """`held`: (k, v, kv segment ids) of the part `keys` of key piece b held now;
        `steps`: the steps the block runs at (static; None: every step of the ring)."""
        self.call, self.a, self.b, self.keys = call, a, b, keys
        qp, kp = call.q_pieces, call.k_pieces
        source = (me - step) % call.parts
        self.r0, self.c0 = qp.start(me, a), kp.start(source, b) + keys.offset
        k, v, kv_ids = held
        f = inputs.features
        features = f._replace(
            q_segment_ids=(None if f.q_segment_ids is None
                           else qp.local_slice(f.q_segment_ids, a, 1)),
            kv_segment_ids=kv_ids, sinks=None,
            positions=cb.positions(self.r0, self.c0, call.shift))
        self.inputs = inputs._replace(q=qp.local_slice(inputs.q, a, 1), k=k, v=v,
                                      features=features)
        self.home_shift = (home_shift(call, a, b, keys) if steps is None or 0 in steps
                           else None)
        self.present = coded_relations(
            call, keys, relations(call, a, b, keys, self.home_shift, steps), direction)
        if self.present == {PARTIAL}:
            relation = PARTIAL
        else:
            relation = call.relation(self.r0, qp.size, self.c0, keys.size)
            if self.home_shift is not None:
                relation = jnp.where(step == 0, PARTIAL_AT_HOME, relation)
        hidden = cb.hidden_by_data(self.r0, self.c0, qp.size, keys.size, features)
        if hidden is not None:
            relation = jnp.where(hidden, HIDDEN, relation)
            self.present = self.present | {HIDDEN}
        self.relation = relation

    def block(self, relation: int) -> Block:
        """The static block of a branch (`relation`: FULL, PARTIAL or PARTIAL_AT_HOME)."""
        if relation == PARTIAL_AT_HOME:
            return Block(self.call.q_pieces.size, self.keys.size, PARTIAL, self.home_shift)
        return Block(self.call.q_pieces.size, self.keys.size, relation)


def forward_block(call: ContextCall, pair: Pair, acc: Rows) -> Rows:
    """`acc` (rows of the pair's query piece) with the pair's block merged in (its branch by
    relation; a hidden block leaves it)."""
    branches = {HIDDEN: lambda acc: acc}
    for rel in (FULL, PARTIAL, PARTIAL_AT_HOME):
        branches[rel] = (lambda acc, rel=rel: cb.merge(
            acc, cb.block_forward(call, pair.block(rel), pair.inputs)))
    return dispatch(pair.relation, pair.present, branches, acc)


def backward_block(call: ContextCall, pair: Pair, acc, rows, lse_cotangent: bool):
    """(dq, dk, dv, dbias) `acc` (float32; dq of the pair's query piece, dk and dv of its
    keys) with the pair's block's gradients added; `rows`: (saved, cotangents) of its query
    piece (`context_blocks.piece_rows`)."""
    rows_saved, rows_cot = rows

    def run(acc, rel):
        grads = cb.block_backward(call, pair.block(rel), pair.inputs, rows_saved, rows_cot,
                                  lse_cotangent)
        return accumulate(acc, grads)
    branches = {HIDDEN: lambda acc: acc}
    for rel in (FULL, PARTIAL, PARTIAL_AT_HOME):
        branches[rel] = lambda acc, rel=rel: run(acc, rel)
    return dispatch(pair.relation, pair.present, branches, acc)


def empty_pieces(call: ContextCall, inputs: Inputs) -> list[Rows]:
    """The merge's start for each query piece of this shard (no keys seen), varying like q."""
    b, _, hq, _ = inputs.q.shape
    rows = [cb.empty_rows(b, call.q_pieces.size, hq, inputs.v.shape[3], call.problem.lse_pair)
            for _ in range(call.q_pieces.count)]
    return jax.tree.map(lambda x: compat.vary_like(x, inputs.q), rows)


def joined_pieces(accs, inputs: Inputs) -> Rows:
    """This shard's rows from its query pieces' merged rows, the sinks joined."""
    return cb.joined_rows([cb.join_sinks(acc, inputs.features.sinks) for acc in accs])


def forward(call: ContextCall, inputs: Inputs) -> Rows:
    """This shard's rows of the whole call: out (float32), lse (hi, lo), sinks joined."""
    qp = call.q_pieces
    start = empty_pieces(call, inputs)
    kv = (inputs.k, inputs.v, inputs.features.kv_segment_ids)
    me = shard_index(call)
    kp = call.k_pieces
    keys = Keys(0, kp.size)

    def step(carry, s):
        kv, accs = carry
        following = send_on(kv, call)
        accs = list(accs)
        held = [tuple(keys.of(x, kp, b_) for x in kv) for b_ in range(kp.count)]
        for a in range(qp.count):
            for b_ in range(kp.count):
                pair = Pair(call, inputs, held[b_], a, b_, me, s, keys, "forward")
                accs[a] = forward_block(call, pair, accs[a])
        return (following, tuple(accs)), None

    (_, accs), _ = jax.lax.scan(step, (kv, tuple(start)), jax.lax.iota(jnp.int32, call.parts))
    return joined_pieces(accs, inputs)


def backward(call: ContextCall, inputs: Inputs, saved: Saved, cotangents: Cotangents,
             lse_cotangent: bool):
    """(dq, dk, dv, dbias) of this shard's inputs (dbias: this shard's rows' part of it,
    float32) from the merged out and lse of its rows (`saved`)."""
    kp = call.k_pieces
    q, k, v = inputs.q, inputs.k, inputs.v
    zero = _zero_after(saved.lse)
    dqs, dbias = zero_query_grads(call, inputs, zero)
    count = rounds(call)
    size = kp.size // count
    dks = [[None] * count for _ in range(kp.count)]
    dvs = [[None] * count for _ in range(kp.count)]
    for r in range(count):
        keys = Keys(r * size, size)
        if r:
            zero = _zero_after(dqs[0])
        dqs, dbias, home = _backward_round(call, inputs, saved, cotangents, lse_cotangent,
                                           keys, (dqs, dbias), zero)
        for b_, (dk_b, dv_b) in enumerate(home):  # final: in the inputs' dtypes already
            dks[b_][r], dvs[b_][r] = dk_b.astype(k.dtype), dv_b.astype(v.dtype)
    dq = jnp.concatenate(dqs, axis=1)
    return dq.astype(q.dtype), _whole(dks), _whole(dvs), dbias


# What a round of the backward starts from (its key slices, its zero accumulators, its
# query pieces' rows of out and its cotangent) depends on the inputs alone, so XLA's
# scheduler is free to make it anywhere, and made every round's up front and held them all
# through the forward, which defeats the rounds (docs/context_parallel.md). They are made
# from `_zero_after` a value of the round before (of the forward, for the first), a
# dependence no simplification removes (an optimization barrier does not order the
# schedule: XLA expands it away before scheduling).


def _zero_after(x):
    """An int32 zero that XLA can compute only once x is: min(isnan(x's first element), 0)."""
    first = jax.lax.slice(x.reshape(-1), (0,), (1,))
    return jnp.minimum(jnp.isnan(first).astype(jnp.int32), 0)[0]


def zeros_varying(x, q, zero=None):
    """float32 zeros of x's shape, varying like q; made no earlier than `zero`."""
    value = jnp.zeros((), jnp.float32) if zero is None else zero.astype(jnp.float32)
    return compat.vary_like(jnp.broadcast_to(value, x.shape), q)


def zero_query_grads(call: ContextCall, inputs: Inputs, zero=None):
    """(dq of each query piece, dbias or None): float32 zeros varying like q, made no earlier
    than `zero`."""
    q, bias = inputs.q, inputs.bias
    dqs = tuple(zeros_varying(call.q_pieces.local_slice(q, a, 1), q, zero)
                for a in range(call.q_pieces.count))
    return dqs, None if bias is None else zeros_varying(bias, q, zero)


def _whole(parts):
    """A shard's array from its [key piece][round] parts."""
    return jnp.concatenate([x for piece in parts for x in piece], axis=1)


def _backward_round(call: ContextCall, inputs: Inputs, saved: Saved, cotangents: Cotangents,
                    lse_cotangent: bool, keys: Keys, acc, zero):
    """One ring of the part `keys` of every key piece: (dqs, dbias) `acc` with its blocks
    added, and the part's (dk, dv) per key piece, home. What it starts from is made no
    earlier than `zero`."""
    qp, kp = call.q_pieces, call.k_pieces
    ids = inputs.features.kv_segment_ids
    held = tuple(tuple(keys.of(x, kp, b_, zero) for x in (inputs.k, inputs.v, ids))
                 for b_ in range(kp.count))
    dkv = tuple((zeros_varying(k_b, inputs.q, zero), zeros_varying(v_b, inputs.q, zero))
                for k_b, v_b, _ in held)
    rows = [cb.piece_rows(qp, a, saved, cotangents, zero) for a in range(qp.count)]
    me = shard_index(call)

    def step(carry, s):
        held, dkv, dqs, dbias = carry
        following = send_on(held, call)
        received = send_on(dkv, call)  # the accumulators of the keys held now
        parts = [[zeros_varying(k_b, inputs.q), zeros_varying(v_b, inputs.q)]
                 for k_b, v_b, _ in held]
        dqs = list(dqs)
        for a in range(qp.count):
            for b_ in range(kp.count):
                pair = Pair(call, inputs, held[b_], a, b_, me, s, keys, "backward")
                dqs[a], parts[b_][0], parts[b_][1], dbias = backward_block(
                    call, pair, (dqs[a], parts[b_][0], parts[b_][1], dbias), rows[a],
                    lse_cotangent)
        dkv = jax.tree.map(jnp.add, received, tuple(map(tuple, parts)))
        return (following, dkv, tuple(dqs), dbias), None

    dqs, dbias = acc
    carry = (held, dkv, dqs, dbias)
    (_, dkv, dqs, dbias), _ = jax.lax.scan(step, carry, jax.lax.iota(jnp.int32, call.parts))
    return dqs, dbias, send_on(dkv, call)  # each accumulator home


def accumulate(acc, grads):
    dq, dk, dv, dbias = acc
    g_dq, g_dk, g_dv, g_dbias = grads
    add = lambda x, g: x + g.astype(jnp.float32)
    return (add(dq, g_dq), add(dk, g_dk), add(dv, g_dv),
            None if dbias is None else add(dbias, g_dbias))
