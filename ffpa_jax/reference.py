"""The plain-JAX attention, the dense tier's computation: `pallas_kernels.reference`, the one
reference of the project (the tests', the bench's and the autotuner's too), under the name
the XLA path and the Flax adapter import it by, and `mha_reference`, the same with keyword
arguments."""

import jax.numpy as jnp

from pallas_kernels.problem import FeatureArrays, Inputs, Problem
from pallas_kernels.reference import (accumulation_dtype, attention, attention_logits,
                                      causal_keep, feature_keep, soft_cap, softmax)

__all__ = ["accumulation_dtype", "attention", "attention_logits", "causal_keep",
           "feature_keep", "mha_reference", "soft_cap", "softmax"]


def mha_reference(q, k, v, bias=None, mask=None, *, scale: float, is_causal: bool = False,
                  keep_mask=None, dropout_rate: float = 0.0, window=None, softcap=None,
                  q_segment_ids=None, kv_segment_ids=None, q_lengths=None, kv_lengths=None,
                  sinks=None, shift=None, out_dtype=None):
    """`pallas_kernels.reference.attention` with keyword arguments: (out [B, T, Hq, Dv] in
    q's dtype or `out_dtype`, lse [B, Hq, T]) of batched q, k, v with bias/mask broadcastable
    to [B, Hq, T, S]. `keep_mask` applies dropout at `dropout_rate`; `window` (left, right),
    `softcap`, the segment ids, lengths and `sinks` are `ffpa_jax.attention`'s; `shift` (may
    be traced) places row i's diagonal at key i + shift instead of i + S - T (the rows and
    keys are a block of a longer sequence)."""
    positions = None if shift is None else jnp.stack(
        [jnp.int32(0), jnp.int32(0), jnp.asarray(shift, jnp.int32)])
    features = FeatureArrays(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                             q_lengths=q_lengths, kv_lengths=kv_lengths, sinks=sinks,
                             positions=positions)
    problem = Problem.of(q, k, v, bias, mask, features=features, scale=scale,
                         causal=is_causal, dropout_rate=dropout_rate, window=window,
                         softcap=softcap)
    return attention(problem, Inputs(q, k, v, bias, mask, features=features), keep_mask,
                     out_dtype=out_dtype)
