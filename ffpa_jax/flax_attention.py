"""`flax_attention_fn`: ffpa_jax attention as the `attention_fn` of Flax's attention modules.

    import functools, ffpa_jax
    from flax import linen as nn, nnx

    nn.MultiHeadDotProductAttention(num_heads=8, attention_fn=ffpa_jax.flax_attention_fn)
    nnx.MultiHeadAttention(num_heads=8, in_features=512, rngs=rngs,
                           attention_fn=ffpa_jax.flax_attention_fn)
    # options of ffpa_jax.attention ride along with functools.partial:
    causal = functools.partial(ffpa_jax.flax_attention_fn, is_causal=True)

It takes every argument `flax.linen.dot_product_attention` and
`flax.nnx.dot_product_attention` take, and maps them onto `ffpa_jax.attention`:

- `bias`, `mask`: broadcastable to [batch..., heads, q_length, kv_length] as in
  Flax. A non-bool mask counts its non-zero entries as True (like Flax).
- `dropout_rate`, `dropout_rng`, `deterministic`: dropout runs only when
  `deterministic` is False and `dropout_rate > 0`, with `dropout_rng` (required then).
- `broadcast_dropout=True` (Flax's default) shares one dropout mask across every
  batch dim and head, as Flax does: it is `ffpa_jax.attention`'s
  `dropout_broadcast=True`, drawn inside the kernels and replayed in the backward
  (`ffpa_jax.dropout_mask(..., broadcast=True)` gives the mask). With
  `broadcast_dropout=False` each (batch, head) draws its own. The masks are
  ffpa_jax's Philox draws, not the ones Flax's `jax.random.bernoulli` would make.
- `dtype`: q, k and v are promoted to it (or to their common dtype), as Flax does.
- `is_causal` (nnx passes it; for linen set it with functools.partial): with
  q_length == kv_length it is the kernels' causal mode (fully masked key blocks
  are skipped). With q_length != kv_length Flax's mask is top-left aligned
  (`tril(ones(T, S))`), unlike ffpa_jax's bottom-right convention, so it is passed
  as an explicit [T, S] mask to keep Flax's meaning.
- `precision`: accepted and ignored; ffpa_jax always runs the softmax and
  accumulates in float32.
- `force_fp32_for_softmax`: the softmax runs in float32 either way; the flag sets the
  dtype of the sown weights (below) as in Flax: float32 with it, else the computation
  dtype.
- `module` (Flax's `sow_weights=True`): the attention weights are computed
  separately in plain JAX (O(T·S) memory, only when asked) and sown under
  'attention_weights' ('intermediates' for linen, `nnx.Intermediate` for nnx),
  before dropout, as Flax does.
- `einsum_dot_general`, `qk_attn_weights_einsum`, `attn_weights_value_einsum`
  (custom einsums, e.g. quantised): cannot run inside the fused kernel; a value
  other than None raises `ValueError`.
- `promote_dtype` (nnx): used to promote q, k, v when given.
- More than one batch dim: flattened into one for the call, and restored.

One difference remains: a query row whose keys are all masked out gets output 0
here (ffpa_jax's rule), while Flax fills masked logits with the dtype's minimum
and returns the mean of the values for such a row.

Keyword-only extras, forwarded to `ffpa_jax.attention`: `scale`,
`implementation` (None or a tier's name, as in `ffpa_jax.attention`) and `interpret`, and the
language-model features Flax's attention_fn interface has no argument for (set them with
functools.partial, or a lambda for per-batch data): `local_window_size`,
`logits_soft_cap`, `sinks`, `q_segment_ids` / `kv_segment_ids` ([batch..., T] /
[batch..., S]) and `query_seq_lengths` / `key_value_seq_lengths` ([batch...]), with
ffpa_jax's meaning (the window is aligned bottom-right when q_length != kv_length, as
causality is in ffpa_jax; Flax has no window of its own). Sown weights include them.
`deterministic_backward` is `ffpa_jax.attention`'s `deterministic` (a bitwise-reproducible
backward; None follows XLA_FLAGS): Flax's own `deterministic` means "no dropout", and keeps
that meaning here.

Flax itself is imported only when `module` is given (to sow weights), so this
file does not make Flax a dependency of `ffpa_jax`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ffpa_jax import validation
from ffpa_jax.api import attention
from ffpa_jax.reference import attention_logits, causal_keep, feature_keep, soft_cap, softmax


def _flatten_batch(x, lead: tuple[int, ...], rank: int):
    """Reshape x (broadcastable to lead + 3 trailing dims) to one batch dim (1 or prod(lead))."""
    if x is None:
        return None
    x = jnp.reshape(x, (1,) * (rank - x.ndim) + tuple(x.shape))
    n = len(lead)
    x_lead, rest = tuple(x.shape[:n]), tuple(x.shape[n:])
    if all(d == 1 for d in x_lead):
        return jnp.reshape(x, (1, *rest))
    if x_lead != lead:  # partly broadcast batch dims: materialise those dims only
        x = jnp.broadcast_to(x, lead + rest)
    return jnp.reshape(x, (math.prod(lead), *rest))


def _attention_weights(q, k, bias, mask, *, scale: float, is_causal: bool,
                       features: dict | None = None) -> jax.Array:
    """softmax probabilities [B, Hq, T, S] (float32) with ffpa_jax's semantics, for sowing;
    `features`: attention's feature arguments, batched."""
    f = features or {}
    logits = soft_cap(attention_logits(q, k, bias, scale=scale), f.get("logits_soft_cap"))
    keep = jnp.ones(logits.shape, bool)
    if mask is not None:
        keep = keep & mask
    if is_causal:
        keep = keep & causal_keep(q.shape[1], k.shape[1])[None, None]
    window = f.get("local_window_size")
    visible = feature_keep(q.shape[1], k.shape[1], jnp.arange(q.shape[1]),
                           jnp.arange(k.shape[1]),
                           window=(window, window) if isinstance(window, int) else window,
                           q_segment_ids=f.get("q_segment_ids"),
                           kv_segment_ids=f.get("kv_segment_ids"),
                           q_lengths=f.get("query_seq_lengths"),
                           kv_lengths=f.get("key_value_seq_lengths"))
    if visible is not None:
        keep = keep & visible
    if f.get("sinks") is not None:
        sink = jnp.asarray(f["sinks"], jnp.float32)[None, :, None]
        return softmax(logits, keep, sink)[0]
    logits = jnp.where(keep, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    unnorm = jnp.where(keep, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(unnorm, axis=-1, keepdims=True)
    return jnp.where(denom > 0, unnorm / jnp.where(denom > 0, denom, 1.0), 0.0)


def _sow(module, weights) -> None:
    from flax import linen  # Flax is installed if a Flax module reached us.
    if isinstance(module, linen.Module):
        module.sow("intermediates", "attention_weights", weights)
    else:
        from flax import nnx
        module.sow(nnx.Intermediate, "attention_weights", weights)


def flax_attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout: bool = True,
                      dropout_rng=None, dropout_rate: float = 0.0, deterministic: bool = False,
                      dtype=None, precision=None, module=None, *,
                      force_fp32_for_softmax: bool = False, einsum_dot_general=None,
                      qk_attn_weights_einsum=None, attn_weights_value_einsum=None,
                      promote_dtype=None, is_causal: bool = False,
                      scale: float | None = None, implementation: str | None = None,
                      interpret: bool = False, local_window_size=None,
                      logits_soft_cap: float | None = None, sinks=None, q_segment_ids=None,
                      kv_segment_ids=None, query_seq_lengths=None,
                      key_value_seq_lengths=None,
                      deterministic_backward: bool | None = None) -> jax.Array:
    """Drop-in `attention_fn` for `flax.linen.MultiHeadDotProductAttention` and
    `flax.nnx.MultiHeadAttention`, computed by `ffpa_jax.attention`.

    Shapes follow Flax: query [batch..., T, Hq, D], key [batch..., S, Hkv, D],
    value [batch..., S, Hkv, Dv] (Hq a multiple of Hkv); returns
    [batch..., T, Hq, Dv]. See the module docstring for how each Flax argument maps.
    """
    del precision  # float32 softmax and accumulation, always
    for name, fn in (("einsum_dot_general", einsum_dot_general),
                     ("qk_attn_weights_einsum", qk_attn_weights_einsum),
                     ("attn_weights_value_einsum", attn_weights_value_einsum)):
        if fn is not None:
            raise ValueError(
                f"ffpa_jax.flax_attention_fn cannot use a custom {name} ({fn!r}): the "
                "products run inside the fused attention kernel. Leave it unset, or use "
                "Flax's own dot_product_attention for custom (e.g. quantised) einsums.")

    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    else:
        target = jnp.dtype(dtype) if dtype is not None else jnp.result_type(query, key, value)
        query, key, value = (jnp.asarray(x, target) for x in (query, key, value))

    if query.ndim < 3:
        raise ValueError(f"query must be [batch..., T, Hq, D]; got shape {tuple(query.shape)}.")
    for name, x in (("key", key), ("value", value)):
        if x.ndim != query.ndim or x.shape[:-3] != query.shape[:-3]:
            raise ValueError(f"{name} must have the same batch dims as query: query "
                             f"{tuple(query.shape)}, {name} {tuple(x.shape)}.")
    t, s = query.shape[-3], key.shape[-3]

    if mask is not None and jnp.dtype(mask.dtype) != jnp.bool_:
        mask = mask != 0
    kernel_causal = bool(is_causal)
    if kernel_causal and t != s:
        # Flax (like jax.nn) aligns a rectangular causal mask top-left: tril(ones(T, S)).
        top_left = jnp.tril(jnp.ones((t, s), bool))
        mask = top_left if mask is None else jnp.logical_and(mask, top_left)
        kernel_causal = False

    lead = tuple(query.shape[:-3])
    per_batch = dict(q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                     query_seq_lengths=query_seq_lengths,
                     key_value_seq_lengths=key_value_seq_lengths)
    if len(lead) > 1:
        rank = query.ndim
        q4, k4, v4 = (jnp.reshape(x, (math.prod(lead), *x.shape[-3:])) for x in (query, key, value))
        bias4, mask4 = _flatten_batch(bias, lead, rank), _flatten_batch(mask, lead, rank)
        # ids [batch..., L] and lengths [batch...] take the same single batch dim
        per_batch = {name: None if x is None else
                     jnp.reshape(x, (math.prod(lead),) + tuple(jnp.shape(x)[len(lead):]))
                     for name, x in per_batch.items()}
    else:
        q4, k4, v4, bias4, mask4 = query, key, value, bias, mask
    features = dict(per_batch, local_window_size=local_window_size,
                    logits_soft_cap=logits_soft_cap, sinks=sinks)

    # Every shape (and the other arguments) is checked before the dropout mode, so that a
    # call with wrong shapes is told about its shapes first, whatever its dropout settings.
    validation.validate(q4, k4, v4, bias4, mask4, scale=scale, is_causal=kernel_causal,
                        dropout_rate=0.0, dropout_rng=None, return_lse=False,
                        implementation=implementation, interpret=interpret,
                        deterministic=deterministic_backward, **features)
    dropping = (not bool(deterministic)) and float(dropout_rate) > 0.0
    if dropping and dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} with deterministic=False needs "
                         "dropout_rng (Flax passes the module's 'dropout' rng); got None.")

    # One batch dim (the flattened lead dims) and the heads share the mask: Flax's mask
    # [1, ..., 1, T, S] is shared over all of them too.
    out = attention(q4, k4, v4, bias4, mask4, scale=scale, is_causal=kernel_causal,
                    dropout_rate=float(dropout_rate) if dropping else 0.0,
                    dropout_rng=dropout_rng if dropping else None,
                    dropout_broadcast=bool(broadcast_dropout) and dropping,
                    implementation=implementation, interpret=interpret,
                    deterministic=deterministic_backward, **features)

    if module is not None:
        # Flax sows float32 weights under force_fp32_for_softmax, else the computation dtype.
        sown_dtype = jnp.float32 if force_fp32_for_softmax else query.dtype
        _sow(module, _sown_weights(q4, k4, bias4, mask4, scale, kernel_causal, lead,
                                   sown_dtype, features))
    if len(lead) > 1:
        out = jnp.reshape(out, (*lead, *out.shape[1:]))
    return out


def _sown_weights(q, k, bias, mask, scale, is_causal, lead, dtype,
                  features: dict | None = None) -> jax.Array:
    """The weights Flax would sow, [batch..., Hq, T, S] in `dtype`."""
    batched = q.ndim == 4
    features = dict(features or {})
    if not batched:
        q, k = q[None], k[None]
        for name, rank in (("q_segment_ids", 2), ("kv_segment_ids", 2),
                           ("query_seq_lengths", 1), ("key_value_seq_lengths", 1)):
            x = features.get(name)
            if x is not None:
                features[name] = jnp.reshape(x, (1,) * (rank - jnp.ndim(x)) + jnp.shape(x))
    as4 = lambda x: None if x is None else jnp.reshape(x, (1,) * (4 - x.ndim) + tuple(x.shape))
    d = q.shape[-1]
    w = _attention_weights(q, k, as4(bias), as4(mask),
                           scale=1.0 / math.sqrt(d) if scale is None else float(scale),
                           is_causal=is_causal, features=features)
    w = w.astype(dtype)
    if not batched:
        return w[0]
    return jnp.reshape(w, (*lead, *w.shape[1:])) if len(lead) > 1 else w


__all__ = ["flax_attention_fn"]
