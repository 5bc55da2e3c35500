"""The plain-JAX attention reference: the semantics of docs/design.md in `jax.numpy` only.

logits = scale · q·kᵀ + bias, then the logit soft cap c·tanh(logits / c), then the mask,
causality (bottom-right aligned), the sliding window (bottom-right aligned), the packed
segments and the padding lengths, softmax over keys (with the head's sink logit in the
denominator), dropout on the probabilities, then · v. One implementation, several uses:
- `attention`, dense: the dense tier's computation (`dense.py`), and the tests' reference
  (in float64: any float dtype works here; `ffpa_jax.reference.mha_reference` takes it
  with keyword arguments).
- `rows_reference`: the same at some query rows of one head, with the visibility written
  out ([rows, S] at most): the bench's float64 check and the autotuner's forward check.
- `sampled_forward`, `sampled_dq`, `sampled_dkdv`, `sampled_dbias`: the autotuner's float32
  checks at a few query rows or key columns, the gradients from the forward's row
  statistics (lse, δ). They never form a [T, S] matrix, only [rows, S] or [T, columns]
  slices, so they are cheap at any problem size.
- `softmax`: the masked softmax of all of them, also the chunked tier's XLA step.

Inputs of `attention` are batched ([B, T, Hq, D] etc.) with bias/mask broadcastable to
[B, Hq, T, S]; `ffpa_jax.attention` does that normalisation. No infinity is formed unless a
row has no visible key (its lse is -inf), so `jax.debug_infs` does not trip on attention
that masks nothing, nor on a mask that leaves every row a key.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import visibility
from pallas_kernels.problem import FeatureArrays, Inputs, Problem


def accumulation_dtype(dtype) -> jnp.dtype:
    """float32 for 16/32-bit inputs, float64 for float64 inputs."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.float32)


def causal_keep(t: int, s: int, rows=None, cols=None, shift=None) -> jax.Array:
    """bool [T, S]: query i sees key j iff j <= i + (S - T) (bottom-right aligned); at the
    query rows `rows` and key columns `cols` only when given ([R, C]); `shift` (may be
    traced) replaces S - T for a block of a longer sequence (`FeatureArrays.positions`)."""
    rows = jnp.arange(t) if rows is None else jnp.asarray(rows)
    cols = jnp.arange(s) if cols is None else jnp.asarray(cols)
    return visibility.causal_visible(rows, cols, visibility.shift_or_default(shift, t, s))


def window_keep(t: int, s: int, window: tuple[int, int], rows=None, cols=None,
                shift=None) -> jax.Array:
    """bool [T, S] (or [R, C] at `rows`, `cols`): query i sees key j iff
    i' - left <= j <= i' + right, i' = i + (S - T) (bottom-right aligned, as causality; the
    same as jax.nn's window when T == S); `shift` as in `causal_keep`."""
    rows = jnp.arange(t) if rows is None else jnp.asarray(rows)
    cols = jnp.arange(s) if cols is None else jnp.asarray(cols)
    return visibility.window_visible(rows, cols, window, visibility.shift_or_default(shift, t, s))


def feature_keep(t: int, s: int, rows, cols, *, window=None, q_segment_ids=None,
                 kv_segment_ids=None, q_lengths=None, kv_lengths=None, shift=None):
    """bool [B|1, 1, R, C], or None: which of the query rows `rows` (global positions, [R])
    see which keys `cols` ([C]) by the window, the segments and the padding lengths. The
    ids are the rows' and columns' own ([B, R] and [B, C]: a block's slice, never [T, S]);
    lengths [B]; `shift` as in `causal_keep`."""
    segments = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
    keep = visibility.feature_visible(
        jnp.asarray(rows), jnp.asarray(cols), shift=visibility.shift_or_default(shift, t, s),
        window=window, segments=segments,
        q_len=None if q_lengths is None else q_lengths[:, None],
        kv_len=None if kv_lengths is None else kv_lengths[:, None])
    if keep is None:
        return None
    return keep[None, None] if keep.ndim == 2 else keep[:, None]


def soft_cap(logits, cap: float | None):
    """c·tanh(logits / c): the logit soft cap (identity without a cap)."""
    if cap is None:
        return logits
    c = jnp.asarray(cap, logits.dtype)
    return c * jnp.tanh(logits / c)


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


def softmax(scores, visible=None, sink=None) -> tuple[jax.Array, jax.Array]:
    """(P, lse) of float `scores` over the last axis, counting only the keys where `visible`
    (bool, broadcastable; None: all) is True. A row with no visible key (or only -inf
    scores) gets P = 0 and lse = -inf, never NaN; lse has the scores' shape without the
    last axis. `sink` (broadcastable to that shape) is one more logit in each row's
    denominator, with no probability returned for it: then lse counts it, and a row
    without visible keys has P = 0 and lse = sink.

    Hidden keys are filled with the dtype's lowest finite value, not -inf: exp() takes them
    to exactly 0 all the same, and no infinity exists unless a row has no visible key."""
    lowest = jnp.finfo(scores.dtype).min
    if visible is not None:
        scores = jnp.where(visible, scores, jnp.asarray(lowest, scores.dtype))
    # The max only stabilises exp(); it cancels in the result, so no gradient flows through
    # it. A row without a visible finite score (max <= lowest) uses 0.
    row_max = jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
    if sink is not None:
        sink = jnp.broadcast_to(jnp.asarray(sink, scores.dtype), scores.shape[:-1])[..., None]
        row_max = jnp.maximum(row_max, jax.lax.stop_gradient(sink))
    row_max = jnp.where(row_max <= lowest, jnp.zeros_like(row_max), row_max)
    unnorm = jnp.exp(scores - row_max)
    denom = jnp.sum(unnorm, axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + jnp.exp(sink - row_max)
    has_keys = denom > 0
    probs = unnorm / jnp.where(has_keys, denom, jnp.ones_like(denom))
    # log(0) = -inf exactly for the rows without keys (or with a NaN: the reference's lse
    # of such a row is -inf too).
    zeros = jnp.zeros_like(denom)
    lse = jnp.where(has_keys, row_max, zeros) + jnp.log(jnp.where(has_keys, denom, zeros))
    return probs, lse[..., 0]


def attention(problem: Problem, inputs: Inputs, keep_mask=None, *, out_dtype=None):
    """Attention output [B, T, Hq, Dv] (dtype of q, or `out_dtype`) and lse [B, Hq, T]
    (accumulation dtype) of `inputs` under `problem`'s options (scale, causal, dropout
    rate, window, soft cap; its shapes are not read: any float dtype works, float64 for the
    tests' reference).

    `keep_mask` (bool, broadcastable to [B, Hq, T, S]) applies dropout with the problem's
    rate to the normalised probabilities; lse stays undropped. The feature arrays
    (`inputs.features`: segment ids, lengths, sinks) are those of `ffpa_jax.attention`
    (docs/design.md); lse counts the sink. With `positions`, its shift places row i's
    diagonal at key i + shift instead of i + S - T: the rows and keys are a block of a
    longer sequence (the lengths are then the block's own).
    Rows with no key left give output 0 and lse -inf (lse = the sink with sinks).
    `ffpa_jax.reference.mha_reference` is this with keyword arguments.
    """
    q, k, v, bias, mask, _, f = inputs
    scale, softcap, window = problem.scale, problem.softcap, problem.window
    shift = None if f.positions is None else f.positions[2]
    b, t, hq, _ = q.shape
    s, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    acc = accumulation_dtype(q.dtype)
    logits = soft_cap(attention_logits(q, k, bias, scale=scale), softcap)
    visible = None if mask is None else jnp.reshape(mask, (1,) * (4 - mask.ndim) + mask.shape)
    if problem.causal:
        # explicit ranks: rank promotion may raise
        causal = causal_keep(t, s, shift=shift)[None, None]
        visible = causal if visible is None else visible & causal
    keep = feature_keep(t, s, jnp.arange(t), jnp.arange(s), window=window,
                        q_segment_ids=f.q_segment_ids, kv_segment_ids=f.kv_segment_ids,
                        q_lengths=f.q_lengths, kv_lengths=f.kv_lengths, shift=shift)
    if keep is not None:
        visible = keep if visible is None else visible & keep
    sink = None if f.sinks is None else jnp.asarray(f.sinks).astype(acc)[None, :, None]
    probs, lse = softmax(logits, visible, sink)

    rate = problem.dropout_rate
    if keep_mask is not None and rate > 0.0:
        probs = jnp.where(keep_mask, probs / (1.0 - rate), jnp.zeros_like(probs))

    # Like every mixed-precision attention (and jax.nn's), the probabilities
    # meet V in V's dtype with a float32 accumulator.
    probs = probs.astype(v.dtype) if jnp.dtype(v.dtype).itemsize < 4 else probs.astype(acc)
    pg = probs.reshape(b, hkv, hq // hkv, t, s)
    out = jnp.einsum("bkgts,bskd->btkgd", pg, v, preferred_element_type=acc,
                     precision=jax.lax.Precision.HIGHEST)
    return out.reshape(b, t, hq, dv).astype(q.dtype if out_dtype is None else out_dtype), lse


# ------------------------------------------------------------------ sampled rows and columns


def rows_reference(q, k, v, bias=None, visible=None, keep=None, *, scale: float,
                   dropout_rate: float = 0.0, softcap: float | None = None,
                   sink=None) -> tuple[jax.Array, jax.Array]:
    """(out [R, Dv], lse [R]) of one head at R of its query rows: `attention` of those rows.

    q [R, D] (the rows), k [S, D], v [S, Dv]; bias, visible (the mask, causality, window,
    segments and lengths of those rows, written out) and keep (the dropout keep-mask)
    [R, S] or None; `softcap` and the head's `sink` (a scalar) as in `attention`."""
    def as4(x):
        return None if x is None else x[None, None]
    arrays = Inputs(q[None, :, None], k[None, :, None], v[None, :, None], as4(bias),
                    as4(visible), features=FeatureArrays(
                        sinks=None if sink is None else jnp.reshape(sink, (1,))))
    problem = Problem.of(*arrays[:5], features=arrays.features, scale=scale,
                         dropout_rate=dropout_rate, softcap=softcap)
    out, lse = attention(problem, arrays, as4(keep))
    return out[0, :, 0], lse[0, 0]


def _f32(x):
    return x.astype(jnp.float32)


def _dot(a, b, spec: str):
    return jnp.einsum(spec, _f32(a), _f32(b), precision=jax.lax.Precision.HIGHEST)


def _at(x, b, h, rows, cols):
    """x[b, h][rows, cols] of a 4-D bias or mask whose size-1 dims broadcast."""
    ib, ih = (b if x.shape[0] > 1 else 0), (h if x.shape[1] > 1 else 0)
    r = rows if x.shape[2] > 1 else jnp.zeros_like(rows)
    c = cols if x.shape[3] > 1 else jnp.zeros_like(cols)
    return x[ib, ih][r[:, None], c[None, :]]


def _visible_at(s: Problem, mask, b: int, h: int, rows, cols):
    """bool [R, C]: which keys of (b, h) rows `rows` see at columns `cols`, or None (all)."""
    visible = None if mask is None else _at(mask, b, h, rows, cols)
    if s.causal:
        keep = causal_keep(s.seq_q, s.seq_k, rows, cols)
        visible = keep if visible is None else visible & keep
    return visible


def _sampled_logits(s: Problem, q, k, bias, b: int, h: int, rows, cols):
    """float32 scale·q·kᵀ + bias of (b, h) at [rows, cols]."""
    bias_at = None if bias is None else _f32(_at(bias, b, h, rows, cols))[None, None]
    return attention_logits(_f32(q[b, rows, h])[None, :, None],
                            _f32(k[b, cols, h // s.group])[None, :, None], bias_at,
                            scale=s.scale)[0, 0]


def _probs_given_lse(logits, visible, lse):
    """P = exp(logits - lse) from the rows' lse: 0 where the key is hidden, its logit not
    finite, or the row has no visible key (lse = -inf)."""
    ok = jnp.isfinite(logits) & jnp.isfinite(lse)[:, None]
    if visible is not None:
        ok &= visible
    return jnp.where(ok, jnp.exp(logits - lse[:, None]), 0.0)


def _indices(ix):
    return jnp.asarray(np.asarray(ix), jnp.int32)


class Upstream(NamedTuple):
    """What the sampled gradients are given: dO [B, T, Hq, Dv] and the forward's row
    statistics lse and δ = rowsum(dO · O) [B, Hq, T]."""

    d_out: Any
    lse: Any
    delta: Any


@functools.partial(jax.jit, static_argnames=("s", "pairs", "rows"))
def sampled_forward(inputs: Inputs, *, s: Problem, pairs, rows):
    """(o [P, R, Dv], lse [P, R]) in float32 at query rows `rows` of the (batch, head)
    `pairs`: `rows_reference` of each pair."""
    q, k, v, bias, mask = inputs[:5]
    outs, lses = [], []
    r, cols = _indices(rows), _indices(np.arange(s.seq_k))
    for b, h in pairs:
        hk = h // s.group
        o, lse = rows_reference(_f32(q[b, r, h]), _f32(k[b, :, hk]), _f32(v[b, :, hk]),
                                None if bias is None else _f32(_at(bias, b, h, r, cols)),
                                _visible_at(s, mask, b, h, r, cols), scale=s.scale)
        outs.append(o)
        lses.append(lse)
    return jnp.stack(outs), jnp.stack(lses)


@functools.partial(jax.jit, static_argnames=("s", "pairs", "rows"))
def sampled_dq(inputs: Inputs, given: "Upstream", *, s: Problem, pairs, rows):
    """dQ [P, R, D] in float32 at query rows `rows` of the (batch, head) `pairs`, given the
    forward's lse and δ [B, Hq, T]."""
    q, k, v, bias, mask = inputs[:5]
    do, lse, delta = given
    out = []
    r, cols = _indices(rows), _indices(np.arange(s.seq_k))
    for b, h in pairs:
        hk = h // s.group
        p = _probs_given_lse(_sampled_logits(s, q, k, bias, b, h, r, cols),
                             _visible_at(s, mask, b, h, r, cols), lse[b, h, r])
        dp = _dot(do[b, r, h], v[b, :, hk], "rd,cd->rc")
        ds = p * (dp - delta[b, h, r][:, None])
        out.append(_dot(ds, k[b, :, hk], "rc,cd->rd") * s.scale)
    return jnp.stack(out)


@functools.partial(jax.jit, static_argnames=("s", "pairs", "cols"))
def sampled_dkdv(inputs: Inputs, given: "Upstream", *, s: Problem, pairs, cols):
    """(dK [P, C, D], dV [P, C, Dv]) in float32 at key columns `cols` of the (batch, KV head)
    `pairs`, summed over the KV head's query heads, given the forward's lse and δ."""
    q, k, v, bias, mask = inputs[:5]
    do, lse, delta = given
    dks, dvs = [], []
    rows, c = _indices(np.arange(s.seq_q)), _indices(cols)
    for b, hk in pairs:
        dk = dv = 0.0
        for h in range(hk * s.group, (hk + 1) * s.group):
            p = _probs_given_lse(_sampled_logits(s, q, k, bias, b, h, rows, c),
                                 _visible_at(s, mask, b, h, rows, c), lse[b, h])  # [T, C]
            dp = _dot(do[b, :, h], v[b, c, hk], "td,cd->tc")
            ds = p * (dp - delta[b, h][:, None])
            dv = dv + _dot(p, do[b, :, h], "tc,td->cd")
            dk = dk + _dot(ds, q[b, :, h], "tc,td->cd") * s.scale
        dks.append(dk)
        dvs.append(dv)
    return jnp.stack(dks), jnp.stack(dvs)


@functools.partial(jax.jit, static_argnames=("s", "rows", "cols"))
def sampled_dbias(inputs: Inputs, given: "Upstream", *, s: Problem, rows, cols):
    """dbias [Bb, Bh, R', C'] in float32 of a bias [Bb, Bh, T|1, S|1]: at rows `rows`
    (columns `cols`) where the bias has a full T (S) dim, else summed over all of them,
    like the kernel's broadcast sum; given the forward's lse and δ."""
    q, k, v, bias, mask = inputs[:5]
    do, lse, delta = given
    bshape = bias.shape
    rows_full, cols_full = bshape[2] > 1, bshape[3] > 1
    r = _indices(rows if rows_full else np.arange(s.seq_q))
    c = _indices(cols if cols_full else np.arange(s.seq_k))
    sums = [[0.0] * bshape[1] for _ in range(bshape[0])]
    for b in range(s.batch):
        for h in range(s.heads_q):
            hk = h // s.group
            p = _probs_given_lse(_sampled_logits(s, q, k, bias, b, h, r, c),
                                 _visible_at(s, mask, b, h, r, c), lse[b, h, r])
            dp = _dot(do[b, r, h], v[b, c, hk], "rd,cd->rc")
            ds = p * (dp - delta[b, h, r][:, None])
            ds = ds if rows_full else jnp.sum(ds, axis=0, keepdims=True)
            ds = ds if cols_full else jnp.sum(ds, axis=1, keepdims=True)
            ib, ih = (b if bshape[0] > 1 else 0), (h if bshape[1] > 1 else 0)
            sums[ib][ih] = sums[ib][ih] + ds
    return jnp.stack([jnp.stack(row) for row in sums])
