"""A call's `Plan`, and its two directions on the tiers the plan names.

`forward` and `backward` are what a differentiable attention call runs (ffpa_jax wraps them
in a custom_vjp and a shard-local partitioning): "pallas", the fused kernels of fwd.py,
bwd.py and decode.py; "chunked", the blocked GEMMs of chunked.py. Both directions of every
tier agree on the residuals (the output in float32, lse), so any pairing is exact.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import chunked
from pallas_kernels.bwd import (BwdConfig, bwd_dbias, bwd_exact_rows, bwd_generic_dkdv,
                                bwd_generic_dq, bwd_preproc, rows_in_one_tile)
from pallas_kernels.chunked import ChunkPlan
from pallas_kernels.decode import DecodeConfig, decode_attention
from pallas_kernels.fwd import FwdConfig, fwd_generic
from pallas_kernels.problem import FeatureArrays, Problem

TIERS = ("pallas", "chunked")


def fused_unsupported(problem: Problem, direction: str | None = None) -> tuple[str, ...]:
    """The features `problem` uses that the fused kernels of `direction` ("forward",
    "backward"; None: either) do not implement, by their argument names: that direction
    runs on the chunked tier (the plan's rule, `tuning.plan.explain_tiers`), and an explicit
    implementation="pallas" is refused. Every fused kernel (fwd_generic, decode, backward)
    takes every feature today: nothing is routed."""
    del problem, direction
    return ()


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one attention call (hashable): the tier of each direction and
    the launch parameters of the kernels it runs."""

    scale: float
    causal: bool
    interpret: bool
    dropout_rate: float
    fwd: FwdConfig
    preproc: BwdConfig
    dq: BwdConfig
    dkdv: BwdConfig
    dbias: BwdConfig
    decode: DecodeConfig | None = None  # the forward runs the decode kernels when set
    decode_splits: int = 1
    # The forward writes its output in float32 (the vjp's forward: a 16-bit backward's
    # δ = rowsum(dO·O) must not see O rounded to 16 bits, or gradients that cancel
    # lose the precision XLA's own gradient keeps; float32 does not read O).
    float32_out: bool = False
    # The caller returns lse: the forward rounds q·kᵀ per head-dim chunk, which keeps lse
    # within XLA's error at large D and costs speed (pallas_kernels.common.contract_chunks).
    precise_lse: bool = False
    # float32: the forward returns lse as a pair, hi + lo = m + fl(log l) exactly (the
    # decode path: lo = 0); the backward takes that pair as its residual, corrects lo so
    # that its own P sums to 1 and computes
    # δ = Σ P·dP from its own P and dP (`bwd_exact_rows`), as XLA's softmax gradient
    # does. From one float32 lse, every P of a row was off by up to an ulp of |lse|,
    # ~1e-5 relative at logits ~ 300, which gave float32 gradients several times XLA's
    # error. (16-bit P is rounded to 16 bits anyway.)
    lse_pair: bool = False
    # The backward's lse cotangent is not a symbolic zero (the caller differentiates
    # through lse): dS then carries d_lse·P, whose sums over heads and keys XLA keeps in
    # float32, so 16-bit kernels feed dS to dQ's and dK's matmuls as two words
    # (`common.accumulate_ds`: two more of the backward's 7 matmuls). Without it, no cost.
    lse_cotangent: bool = False
    # Which tier runs each direction: "pallas" (the fused kernels above) or "chunked"
    # (pallas_kernels.chunked, planned by `chunk`). Both directions agree on the residuals
    # (out in float32, lse), so any pairing is exact.
    forward_tier: str = "pallas"
    backward_tier: str = "pallas"
    chunk: ChunkPlan | None = None
    # The static LLM features (their runtime arrays come as `FeatureArrays`): the sliding
    # window (left, right) and the logit soft cap.
    window: tuple[int, int] | None = None
    softcap: float | None = None


def forward(plan: Plan, q, k, v, bias, mask, seed, features: FeatureArrays | None = None):
    """(out, lse) from the forward kernel, or (out, hi, lo) with hi = lse and lo its low
    word when `plan.lse_pair` (see Plan). `seed` is the dropout seed (uint32[2]) or None;
    `features` the feature arrays (segment ids, lengths, sinks) or None.

    Every argument array has batch as dim 0 and heads as dim 2 (q/k/v) or dim 1
    (bias/mask), so this function is what a sharding wrapper partitions."""
    out_dtype = jnp.float32 if plan.float32_out else None
    if plan.forward_tier == "chunked":
        out, lse = chunked.forward(plan.chunk, q, k, v, bias, mask, seed, features)
        out = out if plan.float32_out else out.astype(q.dtype)
        return (out, lse, jnp.zeros_like(lse)) if plan.lse_pair else (out, lse)
    if plan.decode is not None:
        out, lse = decode_attention(q, k, v, bias, mask, scale=plan.scale, causal=plan.causal,
                                    config=plan.decode, num_splits=plan.decode_splits,
                                    interpret=plan.interpret, dropout_rate=plan.dropout_rate,
                                    seed=seed, out_dtype=out_dtype,
                                    precise_lse=plan.precise_lse, window=plan.window,
                                    softcap=plan.softcap, features=_given(features))
        if not plan.lse_pair:
            return out, lse
        # The decode kernels merge their splits' lse: no exact pair here.
        return out, lse, jnp.zeros_like(lse)
    return fwd_generic(q, k, v, bias, mask, scale=plan.scale, causal=plan.causal,
                       config=plan.fwd, interpret=plan.interpret,
                       dropout_rate=plan.dropout_rate, seed=seed, out_dtype=out_dtype,
                       precise_lse=plan.precise_lse, lse_pair=plan.lse_pair,
                       window=plan.window, softcap=plan.softcap,
                       features=_given(features))


def _given(features):
    """`features` when it holds an array, else None (the kernels' inputs stay as before)."""
    return features if features is not None and any(x is not None for x in features) else None


def backward(plan: Plan, q, k, v, bias, mask, seed, out, *rows_and_cotangents,
             features: FeatureArrays | None = None):
    """(dq, dk, dv, dbias) from the backward kernels (dbias None without a bias).
    `rows_and_cotangents`: the forward's row statistics (lse, or hi and lo with
    `plan.lse_pair`), then d_out and d_lse; `features` the feature arrays or None. The
    probabilities need no sink (lse counts them); their own gradient is the caller's
    (closed form: ffpa_jax.vjp.sinks_grad)."""
    if plan.lse_pair:
        lse, lse_lo, d_out, d_lse = rows_and_cotangents
    else:
        (lse, d_out, d_lse), lse_lo = rows_and_cotangents, None
    if plan.backward_tier == "chunked":
        chunk = dataclasses.replace(plan.chunk.for_backward(), lse_cotangent=plan.lse_cotangent)
        return chunked.backward(chunk, q, k, v, bias, mask, seed, out, lse, d_out, d_lse,
                                features)
    features = _given(features)
    feature_kw = dict(window=plan.window, softcap=plan.softcap, features=features)
    # A row without keys has lse = -inf and no gradient path; drop its lse cotangent.
    d_lse = jnp.where(lse == -jnp.inf, 0.0, d_lse.astype(jnp.float32))
    own_delta = False
    if plan.lse_pair:
        delta, lse_lo = bwd_exact_rows(q, k, v, d_out, lse, d_lse, bias, mask, config=plan.dq,
                                       scale=plan.scale, causal=plan.causal,
                                       interpret=plan.interpret, dropout_rate=plan.dropout_rate,
                                       seed=seed, lse_lo=lse_lo, **feature_kw)
    elif rows_in_one_tile(k.shape[1], plan.dq, plan.dkdv, plan.dbias):
        # Each kernel sees a row's keys in one tile and forms δ from its own P and dP.
        delta, own_delta = d_lse, True
    else:
        delta = bwd_preproc(out, d_out, d_lse, config=plan.preproc, interpret=plan.interpret)
    common = dict(scale=plan.scale, causal=plan.causal, interpret=plan.interpret,
                  dropout_rate=plan.dropout_rate, seed=seed, lse_lo=lse_lo, own_delta=own_delta,
                  **feature_kw)
    split = dict(split_ds=plan.lse_cotangent)
    dq = bwd_generic_dq(q, k, v, d_out, lse, delta, bias, mask, config=plan.dq, **common,
                        **split)
    dk, dv = bwd_generic_dkdv(q, k, v, d_out, lse, delta, bias, mask, config=plan.dkdv,
                              **common, **split)
    dbias = None
    # A bias constant over the keys only shifts lse, unless the soft cap bends it or a
    # sink (which it does not shift) shares the denominator: then the kernel's dS sum.
    if (bias is not None and bias.shape[-1] == 1 and plan.softcap is None
            and (features is None or features.sinks is None)):
        dbias = chunked.row_constant_dbias(d_lse, bias)
    elif bias is not None:
        dbias = bwd_dbias(q, k, v, d_out, lse, delta, bias, mask, config=plan.dbias,
                          **common).astype(bias.dtype)
    return dq, dk, dv, dbias


def row_outputs(plan: Plan) -> int:
    """How many row statistics [B, Hq, T] `forward` returns after out."""
    return 2 if plan.lse_pair else 1
