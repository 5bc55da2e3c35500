"""`ffpa_jax.attention`: the public entry point.

One call is: `validation.validate` (every argument checked; the call's `Problem`), then
`tuning.dispatch.plan` (each direction's tier and every kernel's config), then the plan's
tiers (`vjp.attention`, a custom_vjp over `pallas_kernels.tiers`, run shard-locally under
sharded jit; or the dense tier, which JAX differentiates itself). A context-parallel call
(`context_axis`, or `context_strategy` under jit) runs `context_parallel` instead, whose
blocks take their plans from the dispatcher themselves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

import tuning
from ffpa_jax import context_parallel, partitioning, runtime_autotune, validation, vjp
from ffpa_jax.context_blocks import ContextCall
from ffpa_jax.context_local import whole_problem
from ffpa_jax.layout import CONTIGUOUS
from ffpa_jax.dropout import seed_from_key
from pallas_kernels import tiers
from pallas_kernels.problem import Inputs


def plan_for(problem, implementation: str | None, *, interpret: bool,
             autotune: str | None = None, deterministic: bool | None = None):
    """The `Plan` of a call: the dispatcher's, with the runtime autotune's configs when
    `autotune` asks for them and the plan has kernels to tune (the dense tier has none:
    one warning says so)."""
    plan = tuning.plan(problem, implementation, interpret=interpret,
                       deterministic=deterministic)
    if autotune is None:
        return plan
    if tiers.BY_NAME[plan.forward_tier].differentiated_by_jax:
        runtime_autotune.warn_ignored_on_xla(autotune, implementation)
        return plan
    plan = tuning.plan(problem, implementation, interpret=interpret,
                       override=runtime_autotune.override(autotune, interpret),
                       deterministic=deterministic)
    runtime_autotune.release_inputs()  # the benchmark's own inputs
    return plan


def attention(query: jax.Array, key: jax.Array, value: jax.Array,
              bias: jax.Array | None = None, mask: jax.Array | None = None, *,
              scale: float | None = None, is_causal: bool = False,
              query_seq_lengths: jax.Array | None = None,
              key_value_seq_lengths: jax.Array | None = None,
              local_window_size: int | tuple[int, int] | None = None,
              q_segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
              logits_soft_cap: float | None = None, sinks: jax.Array | None = None,
              dropout_rate: float = 0.0,
              dropout_rng: jax.Array | None = None, dropout_broadcast: bool = False,
              return_lse: bool = False, return_residual: bool = False,
              implementation: str | None = None, interpret: bool = False,
              autotune: str | None = None, context_axis: str | None = None,
              context_layout: str = CONTIGUOUS, context_strategy: str | None = None,
              deterministic: bool | None = None):
    """Exact scaled dot-product attention, memory-efficient on NVIDIA GPUs.

    Args:
      query: [B, T, Hq, D] (or [T, Hq, D] without batch).
      key: [B, S, Hkv, D]; Hq must be a multiple of Hkv (GQA/MQA).
      value: [B, S, Hkv, Dv].
      bias: float, numpy-broadcastable to [B, Hq, T, S]; added to the scaled logits.
      mask: bool, numpy-broadcastable to [B, Hq, T, S]; True = attend.
      scale: logit scale, default 1/sqrt(D).
      is_causal: bottom-right aligned causal mask: query i sees key j iff j <= i + (S - T).
      query_seq_lengths: int32 [B], as jax.nn: query rows i >= query_seq_lengths[b] are
        padding; they see no key (output 0, lse -inf, no gradient).
      key_value_seq_lengths: int32 [B], as jax.nn: keys j >= key_value_seq_lengths[b] are
        padding, seen by no query.
      local_window_size: an int w (= (w, w)) or (left, right), as jax.nn: query i sees keys
        [i' - left, i' + right] with i' = i + (S - T), bottom-right aligned like is_causal
        (jax.nn's window is aligned top-left: the same when T == S). Combines with
        is_causal ((w, 0) with is_causal is the usual causal sliding window).
      q_segment_ids, kv_segment_ids: int32 [B, T] and [B, S], given together: packed
        sequences; query i sees key j only where q_segment_ids[b, i] == kv_segment_ids[b, j]
        (combined with every other mask). No [T, S] mask is built from them.
      logits_soft_cap: c > 0: logits = c * tanh(logits / c), after scale and bias, before
        the masks (Gemma 2's soft cap); its gradient is exact, into dbias too.
      sinks: float [Hq]: attention sinks, one logit per query head that joins every row's
        softmax denominator with no value (it only takes probability away from the keys).
        Not soft-capped. Differentiable. lse includes it.
      dropout_rate: dropout on the attention probabilities (needs dropout_rng).
      dropout_rng: a JAX PRNG key.
      dropout_broadcast: one keep-mask shared by every batch row and head, as Flax's
        broadcast_dropout: element (b, h, i, j) is kept iff element (0, 0, i, j) of the
        unshared mask is (`ffpa_jax.dropout_mask(..., broadcast=True)` gives it). No effect
        without dropout.
      return_lse: also return the log-sum-exp of the logits, [B, Hq, T] float32. On
        the Pallas path the forward then sums q·kᵀ over head-dim chunks in float32,
        which keeps lse as accurate as XLA's at large D and is slower there (up to
        1.6x the forward time at D >= 512; see docs/benchmarks.md).
      return_residual: jax.nn's form of the same: also return lse as jax.nn's residual,
        [B, T, Hq] in the query's dtype with its gradient stopped (a loss through it
        differentiates as if it were a constant, as in jax.nn). Not with return_lse.
      implementation: None, or the name of a tier to force. None on an NVIDIA GPU runs
        each direction on the tier measured fastest for this device and shape (the tuned
        configs' "tier" field, else a built-in rule: `tuning.dispatch`); without one, XLA's
        dense path (the chunked tier where the dense logits would pass its workspace
        budget, $FFPA_CHUNKED_BUDGET_MIB, 4096 MiB by default). `python -m ffpa_jax.info`
        says which tier runs and why. The tiers: {tiers}.
      interpret: run the Pallas kernels in Pallas' interpreter (CPU testing).
      autotune: None (default: tuned-config files, else built-in configs), "fast" or
        "max": when the call is traced, benchmark each kernel's candidate configs for
        this exact shape on the current GPU and use the fastest correct one (cached
        per process; needs a GPU, else a one-time warning). On the dense tier there is
        nothing to tune: it is ignored with a one-time warning. See docs/tuning.md. Not
        applied to context-parallel calls (their blocks take the tuned or built-in configs).
        It tunes the fused kernels (the Triton ones, and on sm90 the Mosaic ones' tuned
        fields); the chunked tier sizes its blocks from its workspace budget.
      context_axis: inside a `jax.shard_map`, the mesh axis the sequence dim of query,
        key, value (and of the segment ids) is split over: each device passes its shard
        and gets its shard of out (and of lse, [B, Hq, T_local]); the result is exact
        attention over the whole sequence, with global positions (causality, windows,
        lengths and dropout's keep decisions are the whole call's). Sequence lengths are
        the global ones. A bias or mask must be broadcast over both sequence dims (use
        segment ids or windows). See docs/context_parallel.md.
      context_layout: "contiguous" (shard i holds positions [i·T/P, (i+1)·T/P)) or
        "zigzag" (the sequence was reordered with `ffpa_jax.zigzag(x, P, axis=1)`: shard i
        holds chunks i and 2P−1−i of 2P, which balances causal work).
      context_strategy: None (a rule: the halo where a sliding window shows a shard at
        most one shard's keys of the others, else the all-gather of K/V for few KV heads,
        else the ring), "ring" (K/V passed around the axis, overlapped with the compute),
        "all_gather", or "halo" (each shard fetches from their owners only the keys its
        queries can see, by the layout, causality and the window). Without context_axis,
        under jax.jit, inputs sharded along the
        sequence then run that strategy over their mesh axis on any tier (planned calls
        on the pallas and chunked tiers do so by the rule without it).
      deterministic: True: a bitwise-reproducible backward (the same gradients on every
        rerun: no floating-point atomics or reduce-adds whose order varies); False: the
        fastest backward, which may add in a varying order; None (default): True when
        XLA_FLAGS sets --xla_gpu_deterministic_ops, else False. The Mosaic tier's
        backward adds dQ by TMA reduce-adds in a varying order: True passes over it, named
        or picked, and another tier runs the backward (`python -m ffpa_jax.info` says
        which ran and why); every other backward tier adds in one order. The chunked
        tier's GEMMs and the dense tier are XLA's operations, as deterministic as XLA
        makes them.

    Returns:
      out [B, T, Hq, Dv] in query's dtype, or (out, lse) when return_lse is True, or
      (out, residual) when return_residual is True.
      A query row with no visible key gives out = 0 and lse = -inf (with sinks: out 0 and
      lse = the head's sink). jax.nn.dot_product_attention differs there for a row that is
      not padding (query_seq_lengths) but sees no key: it averages all values; padding rows
      are 0 in both (its residual there is a large finite negative, lse here -inf). jax.nn's
      argument not taken here: implementation's "cudnn".
    """
    call = validation.validate(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        dropout_broadcast=dropout_broadcast, return_lse=return_lse,
        return_residual=return_residual, implementation=implementation, interpret=interpret,
        autotune=autotune,
        local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        sinks=sinks, context_axis=context_axis, context_layout=context_layout,
        context_strategy=context_strategy, deterministic=deterministic)
    problem, batched, context = call.problem, call.batched, call.context
    # A context-parallel call plans its blocks itself (ffpa_jax.context_parallel).
    plan = (None if context is not None else
            plan_for(problem, implementation, interpret=interpret, autotune=call.autotune,
                     deterministic=deterministic))
    features = validation.feature_arrays(
        batched, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        sinks=sinks)
    q, k, v = (x if batched else x[None] for x in (query, key, value))
    seed = seed_from_key(dropout_rng) if problem.dropout_rate > 0.0 else None
    inputs = Inputs(q, k, v, validation.as_4d(bias, batched), validation.as_4d(mask, batched),
                    seed, features)
    if context is None and tiers.BY_NAME[plan.forward_tier].differentiated_by_jax and (
            partitioning.explicit_sequence(q)):
        # Sharded along the sequence over an Explicit axis (sharding in types), the dense
        # tier would shard its logits twice over one axis: split the sequence instead. (The
        # other tiers' shard-local wrapper splits it itself.)
        context = validation.Context(None, 1, CONTIGUOUS, None)
    if context is not None:
        whole = whole_problem(problem, context.parts)
        out, lse = _compute_context(inputs, call=ContextCall(
            problem=whole, axis=context.axis, parts=context.parts, layout=context.layout,
            strategy=context.strategy, implementation=implementation, interpret=interpret,
            deterministic=deterministic))
    else:
        out, lse = _compute(inputs, plan=plan)
    if not batched:
        out, lse = out[0], lse[0]
    if return_residual:
        return out, lax.stop_gradient(jnp.swapaxes(lse, -1, -2)).astype(out.dtype)
    return (out, lse) if return_lse else out


attention.__doc__ = attention.__doc__.replace("{tiers}", ", ".join(
    f"{tier.name!r} ({tier.summary})" for tier in tiers.TIERS))


# One jitted program per call signature: an eager call (a notebook's) compiles the whole
# attention once and reuses it at the same shapes, rather than compiling each XLA operation,
# and each Pallas kernel at every call, apart. Inside a caller's trace it is inlined, so a
# jitted step is traced exactly as without it.
@functools.partial(jax.jit, static_argnames=("plan",), inline=True)
def _compute(inputs: Inputs, *, plan):
    """(out, lse) of batched inputs on the plan's tiers."""
    if tiers.BY_NAME[plan.forward_tier].differentiated_by_jax:
        return tiers.forward(plan, inputs)
    return vjp.attention(plan, inputs)


@functools.partial(jax.jit, static_argnames=("call",), inline=True)
def _compute_context(inputs: Inputs, *, call: ContextCall):
    """(out, lse) of a context-parallel call: this shard's rows inside a shard_map over
    `call.axis`, or the whole call under jit (split where the sequence is sharded)."""
    if call.axis is not None:
        return context_parallel.attention(call, inputs)
    return context_parallel.jit_attention(call, inputs)
