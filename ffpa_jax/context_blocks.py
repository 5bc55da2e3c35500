"""The blocks of a context-parallel call: the static record of the call (`ContextCall`), one
block's forward and backward on the tier its plan names, and the merge of blocks by lse.

A block is rows of this shard's queries against a piece of keys, both contiguous in the
whole sequence: a problem of its own with `Problem.positions` (its place in the whole, so
that causality, the window, the lengths and the dropout draws are the whole call's). Its
plan comes from the dispatcher (`tuning.dispatch`), like any call's: the tier of the local
computation is the plan's. A block that causality and the window leave fully visible runs
without them (no mask); a partly visible one with them; a hidden one not at all (the
callers skip it).

The blocks' results merge by their lse (`merge`): out = Σ_b e^(lse_b − L)·out_b with
L = log Σ_b e^(lse_b); in float32 lse travels as an exact pair (hi, lo) as between the tiers'
own directions (`Problem.lse_pair`). The sinks join once, after the blocks (`join_sinks`).
The backward of a block takes the merged out and L (`Saved`): its probabilities
e^(logits − L) are the whole row's, so its dq, dk, dv are exact contributions
(`block_backward`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import tuning
from ffpa_jax.layout import Pieces
from pallas_kernels import tiers, visibility
from pallas_kernels.plan import Plan
from pallas_kernels.problem import Cotangents, Inputs, Problem, Saved

HIDDEN, FULL, PARTIAL = visibility.BLOCK_HIDDEN, visibility.BLOCK_FULL, visibility.BLOCK_PARTIAL
RING = "ring"
ALL_GATHER = "all_gather"
HALO = "halo"
STRATEGIES = (RING, ALL_GATHER, HALO)
# The fused kernels draw dropout in tiles of 128 keys: a block's first key must be a
# multiple of it (each ring block starts at a key piece, or a round's part of one; the
# all-gather's at key 0).
DROPOUT_KEY_ALIGNMENT = 128


@dataclasses.dataclass(frozen=True)
class ContextCall:
    """Everything static about one context-parallel call (hashable).

    `problem`: the whole call's (global sequence lengths). `axis`: the mesh axis the sequence
    is split over, `parts` shards (None and 1: one shard, no collectives). `layout`
    ("contiguous" or "zigzag") and `strategy` ("ring", "all_gather" or "halo"; None until the
    split is known, under jit). The blocks' tiers:
    `tiers` (forward, backward) when the call's plan named them (a sequence-sharded jit of a
    planned call), else the dispatcher's choice under `implementation` and `interpret`.
    `lse_cotangent`: the backward's lse cotangent is not a symbolic zero (`Plan`'s).
    `deterministic`: `attention`'s (the blocks' backward tiers add in one order if True)."""

    problem: Problem
    axis: str | None
    parts: int
    layout: str
    strategy: str | None
    implementation: str | None = None
    interpret: bool = False
    tiers: tuple[str, str] | None = None
    lse_cotangent: bool = False
    deterministic: bool | None = None

    @property
    def q_pieces(self) -> Pieces:
        return Pieces(self.layout, self.parts, self.problem.seq_q // self.parts)

    @property
    def k_pieces(self) -> Pieces:
        return Pieces(self.layout, self.parts, self.problem.seq_k // self.parts)

    @property
    def shift(self) -> int:
        """Where global row 0 sits among the keys (S − T of the whole sequence)."""
        return visibility.default_shift(self.problem.seq_q, self.problem.seq_k)

    def relation(self, r0, rows: int, c0, keys: int):
        """The causal/window relation of a block (`visibility.block_relation`)."""
        return visibility.block_relation(r0, rows, c0, keys, shift=self.shift,
                                         causal=self.problem.causal,
                                         window=self.problem.window)

    def plan(self, block: "Block") -> Plan:
        return _plan(self, block)


class Block(NamedTuple):
    """A block's static shape: `rows` queries against `keys` keys, fully visible (FULL) or
    partly (PARTIAL); a partly visible block's shift where it is the same wherever the block
    runs (its tier may plan by it: `Problem.positions_shift`), else None."""

    rows: int
    keys: int
    relation: int
    shift: int | None = None


def block_problem(problem: Problem, block: Block) -> Problem:
    """The problem of one block: its shapes, its place given at run time (positions), the
    causal and window masks (and a shift known at trace time) only where the block is partly
    visible. Every tier returns lse, by which blocks merge; `return_lse` stays the caller's,
    since only a returned lse needs the precise (slower) forward of large head dims."""
    partial = block.relation == PARTIAL
    return dataclasses.replace(
        problem, seq_q=block.rows, seq_k=block.keys, positions=True,
        causal=problem.causal and partial, window=problem.window if partial else None,
        positions_shift=block.shift if partial else None, sinks=False)


@functools.lru_cache(maxsize=256)
def _plan(call: ContextCall, block: Block) -> Plan:
    problem = block_problem(call.problem, block)
    if call.tiers is not None:
        return tuning.plan_for_tiers(problem, *call.tiers, interpret=call.interpret)
    return tuning.plan(problem, call.implementation, interpret=call.interpret,
                       deterministic=call.deterministic)


def unsupported(call: ContextCall, block: Block) -> list[str]:
    """Why the block's tiers cannot compute it ("tier: feature" lines; empty: they can)."""
    plan = call.plan(block)
    problem = block_problem(call.problem, block)
    out = []
    for direction in ("forward", "backward"):
        name = plan.tier(direction)
        out += [f"{name}: {m}" for m in tiers.BY_NAME[name].unsupported(problem, direction)]
    return out


def skips_by_runtime_shift(call: ContextCall, block: Block,
                           directions=("forward", "backward")) -> bool:
    """Whether the block's tiers skip, in each of `directions`, what causality and the window
    hide by its runtime shift (`Tier.skips_by_runtime_shift`); else a partly visible block
    is computed whole unless its shift is known at trace time (`Block.shift`)."""
    plan = call.plan(block)
    return all(tiers.BY_NAME[plan.tier(direction)].skips_by_runtime_shift
               for direction in directions)


def positions(r0, c0, shift: int):
    """FeatureArrays.positions of a block whose rows start at global row r0 and keys at c0."""
    r0, c0 = jnp.asarray(r0, jnp.int32), jnp.asarray(c0, jnp.int32)
    return jnp.stack([r0, c0, r0 - c0 + shift])


# ---------------------------------------------------------------- one block, both directions


class Rows(NamedTuple):
    """Per-row results of a block or of the merge: out float32 [B, T, Hq, Dv] and lse as
    (hi, lo) [B, Hq, T], lo None where lse is not a pair."""

    out: Any
    hi: Any
    lo: Any = None


# Both directions of a block run under jit, so that the blocks of one static shape in a
# program (a ring's steps and pieces, a model's layers) share one traced and lowered
# function instead of lowering their kernels at every call.
@functools.partial(jax.jit, static_argnums=(0, 1))
def block_forward(call: ContextCall, block: Block, inputs: Inputs) -> Rows:
    """The block's out (float32) and lse, on its plan's forward tier. `inputs` are the
    block's (their features carry its positions)."""
    plan = dataclasses.replace(call.plan(block), float32_out=True)
    out, hi, *lo = tiers.forward(plan, inputs)
    lo = (lo[0] if lo else jnp.zeros_like(hi)) if call.problem.lse_pair else None
    return Rows(out.astype(jnp.float32), hi, lo)


@functools.partial(jax.jit, static_argnums=(0, 1, 5))
def block_backward(call: ContextCall, block: Block, inputs: Inputs, saved: Saved,
                   cotangents: Cotangents, lse_cotangent: bool):
    """(dq, dk, dv, dbias) of the block given the merged out and lse of its rows (`saved`):
    the tier's backward, or for a tier that JAX differentiates (the dense one), the vjp of
    its forward with the cotangents carried to the block's own out and lse."""
    plan = dataclasses.replace(call.plan(block), float32_out=True, lse_cotangent=lse_cotangent)
    if call.problem.lse_pair and saved.lse_lo is None:
        saved = saved._replace(lse_lo=jnp.zeros_like(saved.lse))
    if tiers.BY_NAME[plan.backward_tier].differentiated_by_jax:
        return _vjp_backward(plan, inputs, saved, cotangents)
    return tiers.backward(plan, inputs, saved, cotangents)


def _vjp_backward(plan: Plan, inputs: Inputs, saved: Saved, cotangents: Cotangents):
    """A block's gradients through JAX's vjp of its forward. With L the merged lse and w =
    e^(lse_b − L) the block's weight in its rows, out = Σ w·out_b gives the block's own
    cotangents d out_b = w·dO and d lse_b = w·(rowsum(dO·out_b) − δ), δ = rowsum(dO·out) −
    dL: the gradient of the whole row's softmax restricted to the block's keys."""
    def forward(q, k, v, bias):
        out, lse, *_ = tiers.forward(plan, inputs._replace(q=q, k=k, v=v, bias=bias))
        return out, lse
    (out_b, lse_b), vjp = jax.vjp(forward, inputs.q, inputs.k, inputs.v, inputs.bias)
    total, lo = saved.lse, saved.lse_lo
    finite = (lse_b > -jnp.inf) & (total > -jnp.inf)
    diff = lse_b - jnp.where(finite, total, 0.0)
    if lo is not None:
        diff = diff - lo
    weight = jnp.where(finite, jnp.exp(jnp.where(finite, diff, 0.0)), 0.0)
    d_out = cotangents.d_out.astype(jnp.float32)
    d_lse = jnp.where(total == -jnp.inf, 0.0, cotangents.d_lse.astype(jnp.float32))
    delta = _rowsum(d_out, saved.out) - d_lse
    d_out_b = d_out * _per_row(weight)
    d_lse_b = weight * (_rowsum(d_out, out_b) - delta)
    return vjp((d_out_b.astype(out_b.dtype), d_lse_b))


def _rowsum(d_out, out):
    """rowsum(dO·O) [B, Hq, T] in float32."""
    return jnp.einsum("bthd,bthd->bht", d_out, out.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def _per_row(x):
    """[B, Hq, T] row values as [B, T, Hq, 1], to scale an out-like array."""
    return jnp.swapaxes(x, 1, 2)[..., None]


def piece_rows(pieces: Pieces, piece: int, saved: Saved, cotangents: Cotangents, after=None):
    """(saved, cotangents) of the rows of query piece `piece` of this shard; with `after`
    (a traced int32 zero), slices made no earlier than that value."""
    def rows(x, axis):
        return None if x is None else pieces.local_slice(x, piece, axis, after)
    return (Saved(rows(saved.out, 1), rows(saved.lse, 2), rows(saved.lse_lo, 2)),
            Cotangents(rows(cotangents.d_out, 1), rows(cotangents.d_lse, 2)))


def joined_rows(pieces: list[Rows]) -> Rows:
    """The rows of a shard's query pieces, in the shard's order."""
    return Rows(*(None if parts[0] is None else jnp.concatenate(parts, axis=axis)
                  for parts, axis in zip(zip(*pieces), (1, 2, 2))))


# ---------------------------------------------------------------- merging by lse


def empty_rows(batch: int, rows: int, heads: int, head_dim_v: int, pair: bool) -> Rows:
    """The merge's start: no keys seen (out 0, lse −inf)."""
    hi = jnp.full((batch, heads, rows), -jnp.inf, jnp.float32)
    return Rows(jnp.zeros((batch, rows, heads, head_dim_v), jnp.float32), hi,
                jnp.zeros_like(hi) if pair else None)


def _lse_join(a_hi, a_lo, b_hi, b_lo):
    """log(e^a + e^b) of two lse (pairs where lo is given) as (hi, lo), and the shares
    e^(a − new), e^(b − new). −inf on both sides gives −inf and shares 0; lo is the rounding
    error of hi = m + log(s), kept so that float32 lse stays an exact pair."""
    m = jnp.maximum(a_hi, b_hi)
    m = jnp.where(m == -jnp.inf, 0.0, m)

    def share(hi, lo):
        exponent = hi - m if lo is None else (hi - m) + lo
        return jnp.where(hi == -jnp.inf, 0.0, jnp.exp(jnp.where(hi == -jnp.inf, 0.0, exponent)))
    ea, eb = share(a_hi, a_lo), share(b_hi, b_lo)
    total = ea + eb
    some = total > 0.0
    total = jnp.where(some, total, 1.0)
    log_total = jnp.log(total)
    hi = jnp.where(some, m + log_total, -jnp.inf)
    lo = None
    if a_lo is not None:
        lo = jnp.where(some, (m - jnp.where(some, hi, 0.0)) + log_total, 0.0)
    return hi, lo, ea / total, eb / total


def merge(acc: Rows, part: Rows) -> Rows:
    """Two results over disjoint keys of the same rows, merged by their lse."""
    hi, lo, wa, wb = _lse_join(acc.hi, acc.lo, part.hi, part.lo)
    return Rows(acc.out * _per_row(wa) + part.out * _per_row(wb), hi, lo)


def join_sinks(rows: Rows, sinks) -> Rows:
    """The sinks joined to merged rows: one more block with lse = the head's sink and no
    value (as the chunked tier joins them, `chunked.with_sinks`)."""
    if sinks is None:
        return rows
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], rows.hi.shape)
    hi, lo, wa, _ = _lse_join(rows.hi, rows.lo, sink, None if rows.lo is None else
                              jnp.zeros_like(sink))
    return Rows(rows.out * _per_row(wa), hi, lo)


# ---------------------------------------------------------------- skipping by data


def hidden_by_data(r0, c0, rows: int, keys: int, features):
    """bool scalar: the block's segments and lengths hide it for every batch row (None when
    the call has neither). Segment ids are compared by their ranges: exact for sorted
    (packed) ids, and never claims a visible block hidden."""
    per_batch = None

    def either(x):
        return x if per_batch is None else per_batch | x
    if features.q_segment_ids is not None:
        q_ids, kv_ids = features.q_segment_ids, features.kv_segment_ids
        apart = ((kv_ids.max(axis=1) < q_ids.min(axis=1))
                 | (kv_ids.min(axis=1) > q_ids.max(axis=1)))
        per_batch = either(apart)
    if features.q_lengths is not None:
        per_batch = either(r0 >= features.q_lengths)
    if features.kv_lengths is not None:
        per_batch = either(c0 >= features.kv_lengths)
    return None if per_batch is None else jnp.all(per_batch)
