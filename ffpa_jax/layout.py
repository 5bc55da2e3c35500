"""Sequence layouts of context parallelism: which global positions each shard holds.

- "contiguous": shard i of P holds positions [i·L, (i+1)·L), L = N / P.
- "zigzag": the sequence is cut into 2P equal chunks and shard i holds chunks i and
  2P − 1 − i, in that order. Under causality every shard then holds one early and one late
  chunk, so each does the same share of the visible work (contiguous shards leave shard 0
  one block and shard P − 1 all P of them).

`zigzag` / `unzigzag` reorder a whole sequence into (out of) the zigzag order, so that a
plain split of the reordered axis into P shards gives the zigzag shards. `Pieces` says where
a shard's contiguous pieces lie in the global sequence: the context-parallel blocks are
(query piece, key piece) pairs, each a contiguous block of the whole problem.

Everything here is slices and concatenations (no gathers with constant index arrays: the
shard-local code under `custom_partitioning` may not close over constants).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

CONTIGUOUS = "contiguous"
ZIGZAG = "zigzag"
LAYOUTS = (CONTIGUOUS, ZIGZAG)


def _chunks(x, count: int, axis: int) -> list:
    size = x.shape[axis]
    if size % count:
        raise ValueError(f"the sequence axis {axis} of length {size} does not split into "
                         f"{count} equal chunks")
    n = size // count
    return [jax.lax.slice_in_dim(x, c * n, (c + 1) * n, axis=axis) for c in range(count)]


def zigzag_order(parts: int) -> list[int]:
    """The chunks in zigzag order: 0, 2P−1, 1, 2P−2, ... (shard i: chunks i, 2P − 1 − i)."""
    return [c for i in range(parts) for c in (i, 2 * parts - 1 - i)]


def zigzag(x, parts: int, axis: int = 1):
    """`x` with its `axis` (the sequence) reordered so that splitting it into `parts` equal
    shards gives shard i the chunks i and 2·parts − 1 − i of the original 2·parts chunks.
    The length must be a multiple of 2·parts."""
    _check_parts(parts)
    pieces = _chunks(jnp.asarray(x), 2 * parts, axis)
    return jnp.concatenate([pieces[c] for c in zigzag_order(parts)], axis=axis)


def unzigzag(x, parts: int, axis: int = 1):
    """The inverse of `zigzag`: the sequence back in its natural order."""
    _check_parts(parts)
    order = zigzag_order(parts)
    pieces = _chunks(jnp.asarray(x), 2 * parts, axis)
    inverse = [order.index(c) for c in range(2 * parts)]
    return jnp.concatenate([pieces[i] for i in inverse], axis=axis)


def _check_parts(parts) -> None:
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a positive int (the number of shards); got {parts!r}")


def slice_after(x, start: int, size: int, axis: int, after=None):
    """x[start : start + size] along `axis`; with `after`, a traced int32 zero added to the
    start, a slice XLA can make only once that value is known (a static slice without it)."""
    if after is None:
        return jax.lax.slice_in_dim(x, start, start + size, axis=axis)
    return jax.lax.dynamic_slice_in_dim(x, after + start, size, axis=axis)


@dataclasses.dataclass(frozen=True)
class Pieces:
    """The contiguous pieces of one shard of a sequence of `parts` shards of `local`
    positions each, in `layout`: `count` pieces of `size` positions, in the shard's order."""

    layout: str
    parts: int
    local: int

    @property
    def count(self) -> int:
        return 2 if self.layout == ZIGZAG else 1

    @property
    def size(self) -> int:
        return self.local // self.count

    def start(self, shard, piece: int):
        """The global position of piece `piece` of shard `shard` (an int, or traced)."""
        if self.layout == CONTIGUOUS:
            return shard * self.local
        chunk = shard if piece == 0 else 2 * self.parts - 1 - shard
        return chunk * self.size

    def local_slice(self, x, piece: int, axis: int, after=None):
        """Piece `piece` of a shard's array `x` along `axis` (static); with `after`, a traced
        int32 zero added to the start, a slice XLA makes no earlier than that value."""
        if self.count == 1:
            return x
        return slice_after(x, piece * self.size, self.size, axis, after)

    def natural(self, x, axis: int):
        """All shards' arrays gathered in shard order (`x`, the sequence along `axis`) put
        in natural order."""
        return x if self.layout == CONTIGUOUS else unzigzag(x, self.parts, axis)

    def sharded(self, x, axis: int):
        """The inverse of `natural`: a natural-order sequence in shard order."""
        return x if self.layout == CONTIGUOUS else zigzag(x, self.parts, axis)
