"""What one shard runs in a context-parallel call: the strategy (`choose_strategy`), the
checks that the call can be split (`check_split`), and the shard's forward and backward
(`forward`, `backward`) by the ring (`context_ring`), the all-gather (`context_gather`) or
the halo (`context_halo`).

`SequenceSplit` offers the same to the shard-local wrapper (`partitioning.ShardLocal`) of a
planned call: under `jax.jit`, inputs sharded along the sequence run context-parallel over
that mesh axis instead of being gathered.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp

from ffpa_jax import context_blocks as cb
from ffpa_jax import context_gather, context_halo, context_ring
from ffpa_jax.context_blocks import ALL_GATHER, HALO, RING, ContextCall
from ffpa_jax.layout import CONTIGUOUS, ZIGZAG
from pallas_kernels import compat
from pallas_kernels.plan import Plan, row_outputs
from pallas_kernels.problem import Cotangents, Inputs, Problem, Saved

# The all-gather holds the whole K and V on every shard and moves them in one collective that
# the compute waits for; the ring holds two shards of them and overlaps their transfer with
# the compute. The all-gather is chosen where K/V are a small part of a shard's work and
# memory: at least ALL_GATHER_MIN_GROUP query heads per KV head, and all of K and V within
# ALL_GATHER_MAX_BYTES; under causality or a window only where its blocks' tiers skip what
# those hide by a runtime shift (`gather_blocks_skip`): each of its blocks is a query piece
# against every key, whose place differs by shard, and a tier that cannot skip by it
# computes the whole block (the ring's blocks are fully visible or, on the diagonal, know
# their shift; the measurement is in docs/benchmarks.md).
ALL_GATHER_MIN_GROUP = 4
ALL_GATHER_MAX_BYTES = 2 << 30


def whole_problem(problem: Problem, parts: int) -> Problem:
    """The whole call's problem from a shard's (the sequence lengths times `parts`)."""
    return dataclasses.replace(problem, seq_q=problem.seq_q * parts,
                               seq_k=problem.seq_k * parts)


def ring_dropout_ok(problem: Problem, parts: int, layout: str) -> bool:
    """Whether the ring's (and the halo's) key pieces start at multiples of
    cb.DROPOUT_KEY_ALIGNMENT."""
    pieces = 2 if layout == ZIGZAG else 1
    return (not problem.has_dropout
            or (problem.seq_k // parts // pieces) % cb.DROPOUT_KEY_ALIGNMENT == 0)


def choose_strategy(problem: Problem, parts: int, layout: str,
                    strategy: str | None = None, gather_skips=True) -> str:
    """The strategy of a call over `parts` shards (`problem`: the whole call's): `strategy`
    when given (a ValueError where the ring cannot keep dropout's keep decisions), else the
    halo where a window shows each shard at most one shard's keys of the others, the
    all-gather for few KV heads and K/V within ALL_GATHER_MAX_BYTES (under causality or a
    window only where `gather_skips`, a bool or a function giving it: `gather_blocks_skip`),
    or where dropout needs it, else the ring."""
    return explain_strategy(problem, parts, layout, strategy, gather_skips)[0]


def explain_strategy(problem: Problem, parts: int, layout: str,
                     strategy: str | None = None, gather_skips=True) -> tuple[str, str]:
    """(`choose_strategy`'s strategy, why)."""
    if strategy is not None:
        if strategy in (RING, HALO) and not ring_dropout_ok(problem, parts, layout):
            raise ValueError(_dropout_message(problem, parts, layout, strategy))
        return strategy, f"context_strategy={strategy!r} given"
    if problem.window is not None and ring_dropout_ok(problem, parts, layout):
        # Under a window the halo fetches only the keys of other shards that a shard's
        # queries see. Where those are at most one shard's keys (a sliding window no wider
        # than a shard, or than a zigzag chunk) it moves at most what one ring step moves,
        # in one collective per step it needs, where the ring moves every shard's K and V
        # (and their float32 gradients) around the whole axis.
        call = ContextCall(problem=problem, axis=None, parts=parts, layout=layout,
                           strategy=HALO)
        fetched, local = context_halo.fetched_keys(call), problem.seq_k // parts
        if fetched <= local:
            return HALO, (f"the window shows a shard {fetched} keys of the others (at most "
                          f"its own {local}): fetched from their owners alone")
    kv_bytes = (problem.batch * problem.seq_k * problem.heads_kv
                * (problem.head_dim + problem.head_dim_v) * jnp.dtype(problem.dtype).itemsize)
    group = f"{problem.group} query head{'' if problem.group == 1 else 's'} per KV head"
    kv = f"K and V {kv_bytes / 2**20:g} MiB"
    if problem.group < ALL_GATHER_MIN_GROUP:
        why = f"{group} (the all-gather takes at least {ALL_GATHER_MIN_GROUP})"
    elif kv_bytes > ALL_GATHER_MAX_BYTES:
        why = f"{kv} (the all-gather takes at most {ALL_GATHER_MAX_BYTES / 2**20:g})"
    elif not (problem.causal or problem.window is not None):
        return ALL_GATHER, f"{group} and {kv}: few KV heads, little to gather"
    elif gather_skips() if callable(gather_skips) else gather_skips:
        return ALL_GATHER, (f"{group} and {kv}: few KV heads, little to gather; its blocks' "
                            "tiers skip what causality and the window hide by a runtime shift")
    else:
        why = (f"{group} and {kv}, but the all-gather's blocks would run on a tier that "
               "computes what causality and the window hide (it cannot skip by a runtime "
               "shift)")
    if ring_dropout_ok(problem, parts, layout):
        return RING, why
    return ALL_GATHER, (f"{why}; but the ring's key pieces would not start at multiples of "
                        f"{cb.DROPOUT_KEY_ALIGNMENT} keys, which dropout needs")


def explain(problem: Problem, parts: int, layout: str, strategy: str | None = None, *,
            implementation: str | None = None, deterministic: bool | None = None) -> list[str]:
    """What a context-parallel call of the whole call `problem` over `parts` devices runs on
    JAX's device, in lines: the strategy and why, each kind of block with its tier, and the
    ring backward's rounds and why (`python -m ffpa_jax.info --context-parallel`). A
    ValueError where the call cannot be split so."""
    if problem.seq_q % parts or problem.seq_k % parts:
        raise ValueError(f"T = {problem.seq_q} and S = {problem.seq_k} must split evenly over "
                         f"{parts} devices")
    check_split(dataclasses.replace(problem, seq_q=problem.seq_q // parts,
                                    seq_k=problem.seq_k // parts), parts, layout)
    skips = functools.partial(gather_blocks_skip, problem, parts, layout,
                              implementation=implementation, deterministic=deterministic)
    chosen, why = explain_strategy(problem, parts, layout, strategy, gather_skips=skips)
    call = ContextCall(problem=problem, axis=None, parts=parts, layout=layout,
                       strategy=chosen, implementation=implementation,
                       deterministic=deterministic)
    lines = [f"context parallelism: the sequence over {parts} devices, {layout} layout",
             f"  strategy: {chosen} <- {why}"]
    qp, kp = call.q_pieces, call.k_pieces
    if chosen == ALL_GATHER:
        forward = backward = {context_gather.whole_block(call, a) for a in range(qp.count)}
    elif chosen == HALO:
        forward = context_halo.blocks(call, ("forward",))
        backward = context_halo.blocks(call, ("backward",))
        fetched = context_halo.fetches(call)
        lines.append(f"  halo: {context_halo.fetched_keys(call)} keys fetched"
                     + "".join(f"; {f.keys.size} of key piece {f.piece} of shard i - {f.step}"
                               f" (from its key {f.keys.offset})" for f in fetched))
    else:
        forward = {block for a in range(qp.count) for b in range(kp.count)
                   for block in context_ring.blocks(call, a, b, directions=("forward",))}
        backward = context_ring.backward_blocks(call)
    for direction, kinds in (("forward", forward), ("backward", backward)):
        for block in sorted(kinds, key=lambda b: (b.rows, b.keys, b.relation,
                                                  b.shift is not None, b.shift or 0)):
            lines.append(f"  {direction} block {block.rows} x {block.keys}, "
                         f"{_visibility(block)}: {call.plan(block).tier(direction)}")
    if chosen == RING:
        count, why = context_ring.explain_rounds(call)
        lines.append(f"  backward rounds: {count} <- {why}")
    return lines


def _visibility(block: cb.Block) -> str:
    if block.relation == cb.FULL:
        return "fully visible"
    if block.shift is not None:
        return f"partly visible (its shift {block.shift} known when traced)"
    return "partly visible (its place given at run time)"


def gather_blocks_skip(problem: Problem, parts: int, layout: str, *,
                       implementation: str | None = None, interpret: bool = False,
                       deterministic: bool | None = None,
                       tiers: tuple[str, str] | None = None) -> bool:
    """Whether the all-gather's blocks of the whole call `problem` (a query piece against
    every key) run on tiers that skip, in both directions, what causality and the window
    hide by the block's runtime shift (`Tier.skips_by_runtime_shift`); `tiers` (forward,
    backward) where a plan names them, else the dispatcher's under `implementation`."""
    call = ContextCall(problem=problem, axis=None, parts=parts, layout=layout,
                       strategy=ALL_GATHER, implementation=implementation,
                       interpret=interpret, tiers=tiers, deterministic=deterministic)
    return cb.skips_by_runtime_shift(call, context_gather.whole_block(call, 0))


def _dropout_message(problem: Problem, parts: int, layout: str, strategy: str = RING) -> str:
    pieces = 2 if layout == ZIGZAG else 1
    piece = problem.seq_k // parts // pieces
    what = "half" if pieces == 2 else "block"
    return (f"context_strategy={strategy!r} with dropout needs each shard's key {what} to be a "
            f"multiple of {cb.DROPOUT_KEY_ALIGNMENT} keys (the kernels draw the keep "
            f"decisions in tiles of {cb.DROPOUT_KEY_ALIGNMENT} keys at global positions); it is "
            f"{piece} (S = {problem.seq_k} over {parts} shards, {layout} layout). Make the "
            f"sequence a multiple of {cb.DROPOUT_KEY_ALIGNMENT * parts * pieces}, or pass "
            "context_strategy='all_gather' (or None).")


def sequence_dims_message(name: str, shape) -> str:
    return (f"{name} with shape {tuple(shape)} has a query or key dim of its own; under "
            "context_axis the sequence is split over devices and a dense [T, S] mask or bias "
            "is not. Express it with q_segment_ids/kv_segment_ids, local_window_size, "
            "is_causal or the sequence lengths, or pass one broadcast over both sequence "
            "dims ([B|1, Hq|1, 1, 1]).")


def check_split(problem: Problem, parts: int, layout: str) -> None:
    """ValueError unless a shard's `problem` splits as context parallelism needs."""
    for name, shape in (("bias", problem.bias_shape), ("mask", problem.mask_shape)):
        if shape is not None and (shape[2] != 1 or shape[3] != 1):
            raise ValueError(sequence_dims_message(name, shape))
    if layout == ZIGZAG and (problem.seq_q % 2 or problem.seq_k % 2):
        raise ValueError(
            f"context_layout='zigzag' holds two chunks of the sequence per shard: each "
            f"shard's query and key length must be even; got T = {problem.seq_q} and "
            f"S = {problem.seq_k} per shard.")


# ---------------------------------------------------------------- one shard's two directions


def _strategy_module(call: ContextCall):
    return {ALL_GATHER: context_gather, HALO: context_halo}.get(call.strategy, context_ring)


def _invariants_varying(call: ContextCall, inputs: Inputs) -> Inputs:
    """The arrays every shard holds alike, typed varying like q where the types track it
    (see `compat.vary_like`)."""
    if not compat.varying_axes(inputs.q):
        return inputs
    vary = lambda x: compat.vary_like(x, inputs.q)
    f = inputs.features
    return inputs._replace(
        bias=vary(inputs.bias), mask=vary(inputs.mask), seed=vary(inputs.seed),
        features=f._replace(q_lengths=vary(f.q_lengths), kv_lengths=vary(f.kv_lengths),
                            sinks=vary(f.sinks)))


def forward(call: ContextCall, inputs: Inputs) -> cb.Rows:
    """This shard's rows of the whole call: out (float32), lse (hi, lo: lo None unless
    `Problem.lse_pair`), the sinks counted."""
    return _strategy_module(call).forward(call, _invariants_varying(call, inputs))


def backward(call: ContextCall, inputs: Inputs, saved: Saved, cotangents: Cotangents,
             lse_cotangent: bool):
    """(dq, dk, dv, dbias) of this shard's inputs; dbias is this shard's part of the sum
    (float32; the caller reduces it over the axis). The sinks' gradient is the caller's
    (closed form from out and lse)."""
    inputs = _invariants_varying(call, inputs)
    if call.problem.lse_pair and saved.lse_lo is None:
        saved = saved._replace(lse_lo=jnp.zeros_like(saved.lse))
    return _strategy_module(call).backward(call, inputs, saved, cotangents, lse_cotangent)


# ---------------------------------------------------------------- planned calls under jit


class SequenceSplit:
    """The shard-local wrapper's sequence split (`partitioning.ShardLocal(context=...)`) of
    a planned call (`Plan`; its problem the whole call's): contiguous layout, the
    strategy by `choose_strategy`, every block on the plan's tiers. `supports` says whether
    a split over `parts` shards can run (else the wrapper gathers the sequence, as before)."""

    def __init__(self, kind: str):
        self.kind = kind

    @staticmethod
    def call(plan: Plan, axis: str | None, parts: int) -> ContextCall:
        problem = plan.problem
        tiers = (plan.forward_tier, plan.backward_tier)
        skips = functools.partial(gather_blocks_skip, problem, parts, CONTIGUOUS,
                                  interpret=plan.interpret, tiers=tiers)
        return ContextCall(problem=problem, axis=axis, parts=parts, layout=CONTIGUOUS,
                           strategy=choose_strategy(problem, parts, CONTIGUOUS,
                                                    gather_skips=skips),
                           interpret=plan.interpret, deterministic=plan.deterministic,
                           tiers=tiers)

    def supports(self, plan: Plan, parts: int) -> bool:
        problem = plan.problem
        if parts < 2 or problem.seq_q % parts or problem.seq_k % parts or problem.positions:
            return False
        try:
            check_split(problem, parts, CONTIGUOUS)
        except ValueError:
            return False
        call = self.call(plan, None, parts)
        blocks = ([context_gather.whole_block(call, 0)] if call.strategy == ALL_GATHER else
                  context_halo.blocks(call) if call.strategy == HALO else
                  context_ring.blocks(call, 0, 0))
        return all(not cb.unsupported(call, block) for block in blocks)

    def __call__(self, plan: Plan, axis: str, parts: int, inputs: Inputs,
                 saved: Saved | None = None, cotangents: Cotangents | None = None):
        call = self.call(plan, axis, parts)
        if self.kind == "backward":
            return backward(call, inputs, saved, cotangents, plan.lse_cotangent)
        rows = forward(call, inputs)
        out = rows.out if plan.float32_out else rows.out.astype(inputs.q.dtype)
        if row_outputs(plan) == 2:
            return out, rows.hi, jnp.zeros_like(rows.hi) if rows.lo is None else rows.lo
        return out, rows.hi
