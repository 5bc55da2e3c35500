"""The plain-JAX attention: the `"xla"` implementation and the tests' reference.

It implements the semantics of docs/design.md exactly, in `jax.numpy` only:
logits = scale * q·kᵀ + bias, then mask, then causal (bottom-right aligned),
softmax over keys, dropout on the probabilities, then · v.

Inputs must already be batched ([B, T, Hq, D] etc.) with bias/mask broadcastable
to [B, Hq, T, S]; `ffpa_jax.attention` does that normalisation. Any float dtype
works here, float64 included, which is how the tests build their reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accumulation_dtype(dtype) -> jnp.dtype:
    """float32 for 16/32-bit inputs, float64 for float64 inputs."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def causal_keep(t: int, s: int) -> jax.Array:
    """[T, S] bool: query i sees key j iff j <= i + (S - T) (bottom-right aligned)."""
    rows = jnp.arange(t)[:, None]
    cols = jnp.arange(s)[None, :]
    return cols <= rows + (s - t)


def attention_logits(q, k, bias, *, scale: float) -> jax.Array:
    """scale·q·kᵀ + bias as [B, Hq, T, S] in the accumulation dtype; GQA by reshape, no repeat."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    acc = accumulation_dtype(q.dtype)
    qg = q.reshape(b, t, hkv, hq // hkv, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=acc,
                        precision=jax.lax.Precision.HIGHEST)
    logits = logits.reshape(b, hq, t, k.shape[1]) * jnp.asarray(scale, acc)
    if bias is not None:
        logits = logits + bias.astype(acc)
    return logits


def mha_reference(q, k, v, bias=None, mask=None, *, scale: float, is_causal: bool = False,
                  keep_mask=None, dropout_rate: float = 0.0):
    """Attention output [B, T, Hq, Dv] (dtype of q) and lse [B, Hq, T] (accumulation dtype).

    `keep_mask` (bool, broadcastable to [B, Hq, T, S]) applies dropout with rate
    `dropout_rate` to the normalised probabilities; lse stays undropped.
    Rows with no key left give output 0 and lse -inf.
    """
    b, t, hq, _ = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    acc = accumulation_dtype(q.dtype)
    logits = attention_logits(q, k, bias, scale=scale)
    neg_inf = jnp.asarray(-jnp.inf, acc)
    if mask is not None:
        logits = jnp.where(mask, logits, neg_inf)
    if is_causal:
        logits = jnp.where(causal_keep(t, s), logits, neg_inf)

    # The max only stabilises exp(); it cancels in the result, so no gradient
    # flows through it (and a row of -inf cannot produce NaN through it).
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))
    row_max = jnp.where(row_max == -jnp.inf, jnp.zeros_like(row_max), row_max)
    unnorm = jnp.exp(logits - row_max)
    denom = jnp.sum(unnorm, axis=-1, keepdims=True)
    has_keys = denom > 0
    safe_denom = jnp.where(has_keys, denom, jnp.ones_like(denom))
    probs = unnorm / safe_denom
    lse = jnp.where(has_keys, row_max + jnp.log(safe_denom), neg_inf)[..., 0]

    if keep_mask is not None and dropout_rate > 0.0:
        probs = jnp.where(keep_mask, probs / (1.0 - dropout_rate), jnp.zeros_like(probs))

    # Like every mixed-precision attention (and jax.nn's), the probabilities
    # meet V in V's dtype with a float32 accumulator.
    probs = probs.astype(v.dtype) if jnp.dtype(v.dtype).itemsize < 4 else probs.astype(acc)
    pg = probs.reshape(b, hkv, hq // hkv, t, s)
    out = jnp.einsum("bkgts,bskd->btkgd", pg, v, preferred_element_type=acc,
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, t, hq, dv).astype(q.dtype), lse
