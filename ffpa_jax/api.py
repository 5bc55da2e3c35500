"""`ffpa_jax.attention`: the public entry point."""

from __future__ import annotations

import jax

import tuning
from ffpa_jax import determinism, runtime_autotune, validation, vjp
from ffpa_jax.backend import default_backend_is_nvidia_gpu as _default_backend_is_nvidia_gpu
from ffpa_jax.dropout import seed_from_key
from ffpa_jax.reference import mha_reference
from pallas_kernels.dropout import keep_mask_reference


def resolve_implementation(implementation: str | None, interpret: bool) -> str:
    """Which implementation runs: the explicit choice, else "auto" on an NVIDIA GPU (each
    direction on the tier the tuned data or the built-in rule picks: `tuning.tiers`), the
    Pallas kernels when interpreting, and XLA elsewhere."""
    if implementation in ("xla", "chunked"):
        return implementation
    if implementation == "pallas":
        if not interpret and not _default_backend_is_nvidia_gpu():
            raise ValueError(
                "implementation='pallas' needs an NVIDIA GPU, and the default JAX backend is "
                f"{jax.default_backend()!r}. Pass interpret=True to run the Pallas kernels in "
                "Pallas' interpreter (slow; for tests), or implementation='xla' (or None) to use "
                "the plain-JAX path.")
        return "pallas"
    if interpret:
        return "pallas"
    return "auto" if _default_backend_is_nvidia_gpu() else "xla"


def plan_for(problem, implementation: str, *, interpret: bool, precise_lse: bool = False,
             autotune: str | None = None, deterministic: bool = True):
    """The `Plan` of a call resolved to `implementation` ("pallas", "chunked" or "auto");
    `deterministic` (resolved: a bool) picks the Pallas backward's kernels."""
    step = "pallas" if interpret or _default_backend_is_nvidia_gpu() else "xla"
    plan = tuning.make_plan(problem, interpret=interpret, precise_lse=precise_lse,
                            tiers=tuning.tiers(problem, implementation), step=step,
                            override=runtime_autotune.override(autotune, interpret),
                            deterministic=deterministic)
    if autotune is not None:
        runtime_autotune.release_inputs()  # the benchmark's own inputs
    return plan


def attention(query: jax.Array, key: jax.Array, value: jax.Array,
              bias: jax.Array | None = None, mask: jax.Array | None = None, *,
              scale: float | None = None, is_causal: bool = False, dropout_rate: float = 0.0,
              dropout_rng: jax.Array | None = None, return_lse: bool = False,
              deterministic: bool | None = None, implementation: str | None = None,
              interpret: bool = False, autotune: str | None = None):
    """Exact scaled dot-product attention, memory-efficient on NVIDIA GPUs.

    Args:
      query: [B, T, Hq, D] (or [T, Hq, D] without batch).
      key: [B, S, Hkv, D]; Hq must be a multiple of Hkv (GQA/MQA).
      value: [B, S, Hkv, Dv].
      bias: float, numpy-broadcastable to [B, Hq, T, S]; added to the scaled logits.
      mask: bool, numpy-broadcastable to [B, Hq, T, S]; True = attend.
      scale: logit scale, default 1/sqrt(D).
      is_causal: bottom-right aligned causal mask: query i sees key j iff j <= i + (S - T).
      dropout_rate: dropout on the attention probabilities (needs dropout_rng).
      dropout_rng: a JAX PRNG key.
      return_lse: also return the log-sum-exp of the logits, [B, Hq, T] float32. On
        the Pallas path the forward then sums q·kᵀ over head-dim chunks in float32,
        which keeps lse as accurate as XLA's at large D and is slower there (up to
        1.6x the forward time at D >= 512; see docs/benchmarks.md).
      deterministic: whether the gradients must be bitwise reproducible. True: the Pallas
        backward's deterministic kernels (no atomics). False: its one-pass backward, which
        sums dQ with float32 atomic adds (faster; dQ may differ in its last bits from run
        to run; dK, dV and dbias stay reproducible). None (default): True exactly when
        XLA_FLAGS turns on --xla_gpu_deterministic_ops (read when the call is traced).
        Both meet the same accuracy rule. It chooses between the Pallas backward's
        kernels only: the forward uses no atomics, and the chunked and XLA tiers are XLA
        computations, reproducible as far as XLA (and its flag) makes them.
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
      A query row with no visible key gives out = 0 and lse = -inf.
    """
    call = validation.validate(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        dropout_rate=dropout_rate, dropout_rng=dropout_rng, return_lse=return_lse,
        implementation=implementation, interpret=interpret, autotune=autotune,
        deterministic=deterministic)
    problem, batched = call.problem, call.batched
    impl = resolve_implementation(implementation, interpret)

    q, k, v = (x if batched else x[None] for x in (query, key, value))
    bias4 = validation.as_4d(bias, batched)
    mask4 = validation.as_4d(mask, batched)
    seed = seed_from_key(dropout_rng) if problem.dropout_rate > 0.0 else None
    if impl == "xla":
        runtime_autotune.warn_ignored_on_xla(call.autotune, implementation)
        keep = None
        if seed is not None:
            shape = (q.shape[0], problem.heads_q, problem.seq_q, problem.seq_k)
            keep = keep_mask_reference(seed, shape, problem.dropout_rate)
        out, lse = mha_reference(q, k, v, bias4, mask4, scale=problem.scale,
                                 is_causal=problem.causal, keep_mask=keep,
                                 dropout_rate=problem.dropout_rate)
    else:
        # lse is computed either way (the backward needs it); its precise, slower
        # form only when the caller sees it.
        plan = plan_for(problem, impl, interpret=interpret, precise_lse=return_lse,
                        autotune=call.autotune,
                        deterministic=determinism.resolve(deterministic))
        out, lse = vjp.attention(q, k, v, bias4, mask4, plan, seed)
    if not batched:
        out, lse = out[0], lse[0]
    return (out, lse) if return_lse else out
