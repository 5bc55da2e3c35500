"""The halo strategy of context parallelism: each shard fetches from the other shards only
the keys its queries can see, straight from their owners, and computes its rows against
its own keys and those.

Under a sliding window a shard's queries see few keys of other shards: with contiguous
shards of L ≥ W positions, the last W keys of the shard before; in the zigzag layout the
last W of a chunk on each neighbour. The ring moves every shard's K and V around the whole
axis (and their float32 gradients back in the backward) to compute those few blocks; the
halo moves the visible part alone. Which keys those are is static (the layout, causality
and the window; `fetches`): for each step s of the ring (the keys of shard i − s) and key
piece, the smallest range, in whole tiles of HALO_ALIGNMENT keys, outside which every
shard's blocks are hidden. Each step with such a range is one `ppermute` from shard i − s
to shard i, issued before the shard's own blocks, which do not wait for it. The backward
fetches them again, and sends each fetched range's dK, dV (float32) back to its owner the
same way, where they add into the owner's own.

The blocks are the ring's (`context_ring.Pair`: their relation, static shapes and skipping
by data), at the step of their keys.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ffpa_jax import context_blocks as cb
from ffpa_jax import context_ring
from ffpa_jax.context_blocks import HIDDEN, Block, ContextCall, Rows
from ffpa_jax.context_ring import (Keys, Pair, backward_block, empty_pieces, forward_block,
                                   joined_pieces, send_on, shard_index, zero_query_grads,
                                   zeros_varying)
from pallas_kernels.problem import Cotangents, Inputs, Saved

# A fetched range starts and ends on whole tiles of keys (where its piece allows): the
# kernels walk keys in tiles, and dropout draws its keep decisions in tiles of this many keys
# at global positions, so a fetched block must start on one.
HALO_ALIGNMENT = cb.DROPOUT_KEY_ALIGNMENT


class Fetch(NamedTuple):
    """The part `keys` of key piece `piece` of shard i − `step`, which shard i fetches."""

    step: int
    piece: int
    keys: Keys


def _hidden(call: ContextCall, step: int, piece: int, start: int, size: int) -> bool:
    """Whether keys [start, start + size) of key piece `piece` of shard i − step are hidden
    from every query piece of every shard i."""
    qp, kp = call.q_pieces, call.k_pieces
    return all(call.relation(qp.start(i, a), qp.size,
                             kp.start((i - step) % call.parts, piece) + start, size) == HIDDEN
               for i in range(call.parts) for a in range(qp.count))


def _visible_range(call: ContextCall, step: int, piece: int) -> tuple[int, int]:
    """[lo, hi) within key piece `piece` at `step`: outside it every block is hidden; lo a
    multiple of HALO_ALIGNMENT, hi one or the piece's end (empty: lo == hi)."""
    size = call.k_pieces.size
    if _hidden(call, step, piece, 0, size):
        return 0, 0
    # The hidden prefix [0, lo) and suffix [hi, size) only shrink as they grow: bisect
    # their tile counts.
    tiles = -(-size // HALO_ALIGNMENT)
    low, high = 0, tiles  # largest count of tiles whose prefix is hidden
    while low < high:
        mid = (low + high + 1) // 2
        if _hidden(call, step, piece, 0, mid * HALO_ALIGNMENT):
            low = mid
        else:
            high = mid - 1
    lo = low * HALO_ALIGNMENT
    low, high = lo // HALO_ALIGNMENT + 1, tiles  # smallest end tile whose suffix is hidden
    while low < high:
        mid = (low + high) // 2
        end = min(mid * HALO_ALIGNMENT, size)
        if end == size or _hidden(call, step, piece, end, size - end):
            high = mid
        else:
            low = mid + 1
    return lo, min(low * HALO_ALIGNMENT, size)


@functools.lru_cache(maxsize=256)
def fetches(call: ContextCall) -> tuple[Fetch, ...]:
    """What every shard fetches: for each step s ≥ 1 and key piece, its visible range."""
    found = []
    for step in range(1, call.parts):
        for piece in range(call.k_pieces.count):
            lo, hi = _visible_range(call, step, piece)
            if hi > lo:
                found.append(Fetch(step, piece, Keys(lo, hi - lo)))
    return tuple(found)


def fetched_keys(call: ContextCall) -> int:
    """How many keys a shard fetches from the others."""
    return sum(f.keys.size for f in fetches(call))


def _local(call: ContextCall) -> tuple[Fetch, ...]:
    """A shard's own key pieces, as step 0."""
    return tuple(Fetch(0, b, Keys(0, call.k_pieces.size)) for b in range(call.k_pieces.count))


def _held(call: ContextCall, inputs: Inputs) -> list[tuple[Fetch, tuple]]:
    """(fetch, (k, v, kv segment ids) of its keys) for the shard's own pieces and for every
    fetch, the latter moved from their owners, one collective per step."""
    kp = call.k_pieces
    arrays = (inputs.k, inputs.v, inputs.features.kv_segment_ids)

    def own(f: Fetch):
        return tuple(f.keys.of(x, kp, f.piece) for x in arrays)
    held = [(f, own(f)) for f in _local(call)]
    remote = fetches(call)
    for step in sorted({f.step for f in remote}):
        at_step = [f for f in remote if f.step == step]
        moved = send_on([own(f) for f in at_step], call, step)
        held += list(zip(at_step, moved))
    return held


def _pair(call: ContextCall, inputs: Inputs, fetch: Fetch, held, a: int, me,
          direction: str) -> Pair:
    return Pair(call, inputs, held, a, fetch.piece, me, fetch.step, fetch.keys, direction,
                steps=(fetch.step,))


def forward(call: ContextCall, inputs: Inputs) -> Rows:
    """This shard's rows of the whole call: out (float32), lse (hi, lo), sinks joined."""
    accs = empty_pieces(call, inputs)
    me = shard_index(call)
    for fetch, held in _held(call, inputs):
        for a in range(call.q_pieces.count):
            accs[a] = forward_block(call, _pair(call, inputs, fetch, held, a, me, "forward"),
                                    accs[a])
    return joined_pieces(accs, inputs)


def backward(call: ContextCall, inputs: Inputs, saved: Saved, cotangents: Cotangents,
             lse_cotangent: bool):
    """(dq, dk, dv, dbias) of this shard's inputs (dbias: this shard's rows' part of it,
    float32) from the merged out and lse of its rows (`saved`)."""
    qp, kp = call.q_pieces, call.k_pieces
    q, k, v = inputs.q, inputs.k, inputs.v
    dqs, dbias = zero_query_grads(call, inputs)
    dqs = list(dqs)
    rows = [cb.piece_rows(qp, a, saved, cotangents) for a in range(qp.count)]
    me = shard_index(call)
    own, sent = {}, {}
    for fetch, (k_f, v_f, ids_f) in _held(call, inputs):
        dk_f, dv_f = zeros_varying(k_f, q), zeros_varying(v_f, q)
        for a in range(qp.count):
            pair = _pair(call, inputs, fetch, (k_f, v_f, ids_f), a, me, "backward")
            dqs[a], dk_f, dv_f, dbias = backward_block(call, pair, (dqs[a], dk_f, dv_f, dbias),
                                                       rows[a], lse_cotangent)
        (own if fetch.step == 0 else sent.setdefault(fetch.step, {}))[fetch] = (dk_f, dv_f)
    pieces = {f.piece: grads for f, grads in own.items()}
    for step, grads in sent.items():  # each fetched range's dK, dV back to its owner
        back = send_on(list(grads.values()), call, -step)
        for fetch, (dk_f, dv_f) in zip(grads, back):
            pieces[fetch.piece] = tuple(_added(x, g, fetch.keys.offset)
                                        for x, g in zip(pieces[fetch.piece], (dk_f, dv_f)))
    dk = jnp.concatenate([pieces[p][0] for p in range(kp.count)], axis=1)
    dv = jnp.concatenate([pieces[p][1] for p in range(kp.count)], axis=1)
    dq = jnp.concatenate(dqs, axis=1)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias


def _added(x, part, offset: int):
    """x with `part` added to its keys [offset, offset + part's length) (axis 1)."""
    size = part.shape[1]
    region = jax.lax.slice_in_dim(x, offset, offset + size, axis=1) + part
    return jax.lax.dynamic_update_slice_in_dim(x, region, offset, axis=1)


def blocks(call: ContextCall, directions=("forward", "backward")) -> set[Block]:
    """The static blocks the halo runs in either of `directions`."""
    return {block for fetch in _local(call) + fetches(call)
            for a in range(call.q_pieces.count)
            for block in context_ring.blocks(call, a, fetch.piece, fetch.keys, (fetch.step,),
                                             directions)}
