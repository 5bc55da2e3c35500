"""`ffpa_jax.attention`: the public entry point."""

from __future__ import annotations

import functools

import jax

import tuning
from ffpa_jax import runtime_autotune, validation, vjp
from ffpa_jax.backend import default_backend_is_nvidia_gpu as _default_backend_is_nvidia_gpu
from ffpa_jax.dropout import seed_from_key
from ffpa_jax.reference import mha_reference
from pallas_kernels.dropout import keep_mask_reference
from pallas_kernels.tiers import fused_unsupported


def resolve_implementation(implementation: str | None, interpret: bool,
                           problem=None) -> str:
    """Which implementation runs: the explicit choice, else "auto" on an NVIDIA GPU (each
    direction on the tier the tuned data or the built-in rule picks: `tuning.tiers`), the
    Pallas kernels when interpreting (a direction whose fused kernels lacked a feature
    `problem` uses would run on the chunked tier: `tuning.tiers`), and XLA elsewhere. An
    explicit "pallas" with such a feature is refused, naming it: the caller asked for
    kernels that cannot run it."""
    if implementation in ("xla", "chunked"):
        return implementation
    if implementation == "pallas":
        if not interpret and not _default_backend_is_nvidia_gpu():
            raise ValueError(
                "implementation='pallas' needs an NVIDIA GPU, and the default JAX backend is "
                f"{jax.default_backend()!r}. Pass interpret=True to run the Pallas kernels in "
                "Pallas' interpreter (slow; for tests), or implementation='xla' (or None) to use "
                "the plain-JAX path.")
        missing = () if problem is None else fused_unsupported(problem)
        if missing:
            raise ValueError(
                f"implementation='pallas' does not support {', '.join(missing)}: the fused "
                "Pallas kernels do not implement it. Pass implementation=None (which runs "
                "such a direction on the chunked tier) or implementation='chunked' (same "
                "results, bounded memory), or 'xla'.")
        return "pallas"
    if interpret:
        return "pallas"
    return "auto" if _default_backend_is_nvidia_gpu() else "xla"


def plan_for(problem, implementation: str, *, interpret: bool, precise_lse: bool = False,
             autotune: str | None = None):
    """The `Plan` of a call resolved to `implementation` ("pallas", "chunked" or "auto")."""
    step = "pallas" if interpret or _default_backend_is_nvidia_gpu() else "xla"
    plan = tuning.make_plan(problem, interpret=interpret, precise_lse=precise_lse,
                            tiers=tuning.tiers(problem, implementation), step=step,
                            override=runtime_autotune.override(autotune, interpret))
    if autotune is not None:
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
              dropout_rng: jax.Array | None = None, return_lse: bool = False,
              implementation: str | None = None, interpret: bool = False,
              autotune: str | None = None):
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
      return_lse: also return the log-sum-exp of the logits, [B, Hq, T] float32. On
        the Pallas path the forward then sums q·kᵀ over head-dim chunks in float32,
        which keeps lse as accurate as XLA's at large D and is slower there (up to
        1.6x the forward time at D >= 512; see docs/benchmarks.md).
      implementation: None, "pallas", "chunked" or "xla". None on an NVIDIA GPU runs each
        direction on the tier measured fastest for this device and shape (the tuned
        configs' "tier" field, else a built-in rule: see `tiers`), and XLA elsewhere.
        "pallas": the fused Pallas kernels. "chunked": large GEMMs over blocks of queries
        and keys, with a bounded workspace ($FFPA_CHUNKED_BUDGET_MIB, 4096 by default); it
        runs anywhere (plain XLA without a GPU, same blocks). "xla": the dense plain-JAX path.
      interpret: run the Pallas kernels in Pallas' interpreter (CPU testing).
      autotune: None (default: tuned-config files, else built-in configs), "fast" or
        "max": when the call is traced, benchmark each kernel's candidate configs for
        this exact shape on the current GPU and use the fastest correct one (cached
        per process; needs a GPU, else a one-time warning). On the XLA path
        (implementation="xla", or None without an NVIDIA GPU) there is nothing to tune:
        it is ignored with a one-time warning. See docs/tuning.md.

    Returns:
      out [B, T, Hq, Dv] in query's dtype, or (out, lse) when return_lse is True.
      A query row with no visible key gives out = 0 and lse = -inf (with sinks: out 0 and
      lse = the head's sink). jax.nn.dot_product_attention differs there for a row that is
      not padding (query_seq_lengths) but sees no key: it averages all values; padding rows
      are 0 in both. jax.nn's arguments not taken here: return_residual (use return_lse;
      lse is [B, Hq, T], not [B, T, Hq]) and implementation's "cudnn".
    """
    call = validation.validate(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng, return_lse=return_lse,
        implementation=implementation, interpret=interpret, autotune=autotune,
        local_window_size=local_window_size, logits_soft_cap=logits_soft_cap,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        sinks=sinks)
    problem, batched = call.problem, call.batched
    impl = resolve_implementation(implementation, interpret, problem)
    features = validation.feature_arrays(
        batched, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        sinks=sinks)

    q, k, v = (x if batched else x[None] for x in (query, key, value))
    bias4 = validation.as_4d(bias, batched)
    mask4 = validation.as_4d(mask, batched)
    seed = seed_from_key(dropout_rng) if problem.dropout_rate > 0.0 else None
    if impl == "xla":
        runtime_autotune.warn_ignored_on_xla(call.autotune, implementation)
        plan = None
    else:
        # lse is computed either way (the backward needs it); its precise, slower
        # form only when the caller sees it.
        plan = plan_for(problem, impl, interpret=interpret, precise_lse=return_lse,
                        autotune=call.autotune)
    out, lse = _compute(q, k, v, bias4, mask4, seed, features, problem=problem, plan=plan)
    if not batched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out


# One jitted program per call signature: an eager call (a notebook's) compiles the whole
# attention once and reuses it at the same shapes, rather than compiling each XLA operation,
# and each Pallas kernel at every call, apart. Inside a caller's trace it is inlined, so a
# jitted step is traced exactly as without it.
@functools.partial(jax.jit, static_argnames=("problem", "plan"), inline=True)
def _compute(q, k, v, bias4, mask4, seed, features, *, problem, plan):
    """(out, lse) of batched inputs: the XLA path (`plan` None) or the plan's tiers."""
    if plan is not None:
        return vjp.attention(q, k, v, bias4, mask4, plan, seed, features)
    keep = None
    if seed is not None:
        shape = (q.shape[0], problem.heads_q, problem.seq_q, problem.seq_k)
        keep = keep_mask_reference(seed, shape, problem.dropout_rate)
    return mha_reference(q, k, v, bias4, mask4, scale=problem.scale, is_causal=problem.causal,
                         keep_mask=keep, dropout_rate=problem.dropout_rate,
                         window=problem.window, softcap=problem.softcap,
                         q_segment_ids=features.q_segment_ids,
                         kv_segment_ids=features.kv_segment_ids, q_lengths=features.q_lengths,
                         kv_lengths=features.kv_lengths, sinks=features.sinks)
