"""The LLM features of `ffpa_jax.attention` (issue 24): packed sequences (segment ids),
the sliding window, the logit soft cap, attention sinks and jax.nn's padding lengths.

Each is checked on every tier that runs it (the `feature_tier` fixture) against the float64
reference with the tolerance rule (forward 2x, gradients 3x the same-precision XLA error):
odd head dims, T != S both ways, GQA and MQA, combined with causality, masks and biases,
rows that see no key; then against what it must equal: packed ids the dense mask of their
equality, the window the dense band mask, the lengths jax.nn.dot_product_attention, the
sinks one more key of zero value. Every fused kernel takes them: the forward, backward and
decode kernels in many small tiles or splits (their block ranges) against float64 too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from attn_testing import (Case, assert_forward_matches, assert_matches_reference, cotangents,
                          feature_arrays, make_features, make_inputs, normal, reference64,
                          reference_vjp, scale_of, xla_same_precision)
from conftest import call_kwargs
from ffpa_jax.validation import as_4d
from pallas_kernels import fused, tiers
from pallas_kernels.problem import Problem


def _ids(c: Case) -> str:
    parts = [f"T{c.t}-S{c.s}-H{c.hq}.{c.hkv}-D{c.d}"]
    if c.causal:
        parts.append("causal")
    if c.window is not None:
        parts.append(f"win{c.window[0]}.{c.window[1]}")
    if c.softcap is not None:
        parts.append(f"cap{c.softcap}")
    if c.segments:
        parts.append(f"seg{c.segments}" + ("" if c.sorted_ids else "u"))
    if c.q_lengths is not None or c.kv_lengths is not None:
        parts.append("len")
    if c.sinks:
        parts.append("sinks")
    if c.bias_shape is not None:
        parts.append("bias" + "x".join(map(str, c.bias_shape)))
    if c.mask_shape is not None:
        parts.append("mask" + "x".join(map(str, c.mask_shape)))
    if c.dtype != "bfloat16":
        parts.append(c.dtype)
    return "-".join(parts)


# Feature arguments that are Python values (static: they change the code), not arrays.
STATIC_FEATURES = ("local_window_size", "logits_soft_cap")


def _attention(case: Case, tier: str, mode: str, features: dict):
    """`attention` of `case` on `tier` as f(q, k, v, bias, mask, arrays) -> (out, lse), the
    feature arrays (ids, lengths, sinks) a dict argument and the static features bound.
    The matrix calls it under jax.jit, as a training step does (eagerly, the XLA path and
    the chunked tier's XLA steps compile each operation apart: `test_eager_call` once)."""
    statics = {k: v for k, v in features.items() if k in STATIC_FEATURES}

    def f(q, k, v, bias, mask, arrays):
        return ffpa_jax.attention(q, k, v, bias, mask, scale=case.scale, is_causal=case.causal,
                                  return_lse=True, **statics, **arrays,
                                  **call_kwargs(tier, mode))
    return f, {k: v for k, v in features.items() if k not in STATIC_FEATURES}


def _check_forward(case: Case, inputs, features: dict, out, lse, references=None):
    """out and lse against float64; `references`: ((out, lse) in float64, (out, lse) of the
    same-precision XLA computation) where the caller has them already."""
    q, k, v, bias, mask = inputs
    if references is None:
        references = (reference64(case, q, k, v, bias, mask, features=features),
                      xla_same_precision(case, q, k, v, bias, mask, features=features))
    (ref_out, ref_lse), xla = references
    assert out.dtype == q.dtype and out.shape == ref_out.shape
    assert lse.dtype == jnp.float32 and lse.shape == ref_lse.shape
    assert_forward_matches(out, lse, (ref_out, ref_lse), xla, q.dtype)


def run_case(case: Case, tier: str, mode: str = "interpret", *, eager: bool = False):
    """Forward (out and lse) of `case` on `tier` against float64, under jax.jit or, with
    `eager`, eagerly; returns (out, lse)."""
    inputs = make_inputs(case)
    features = make_features(case)
    f, arrays = _attention(case, tier, mode, features)
    out, lse = (f if eager else jax.jit(f))(*inputs, arrays)
    _check_forward(case, inputs, features, out, lse)
    return out, lse


def _forward_and_vjp(case: Case, tier: str, mode: str, inputs, features):
    """(out, lse, [dq, dk, dv, dbias, dsinks], sinks, d_out, d_lse) of `case` on `tier`:
    one jitted forward and backward with the case's cotangents (d_out in the inputs'
    dtype)."""
    q, k, v, bias, mask = inputs
    f, arrays = _attention(case, tier, mode, features)
    sinks = arrays.pop("sinks", None)
    d_out, d_lse = cotangents(case)
    d_out = d_out.astype(q.dtype)

    @jax.jit
    def forward_and_vjp(q, k, v, bias, sinks, d_out, d_lse):
        (out, lse), vjp = jax.vjp(
            lambda q, k, v, bias, sinks: f(q, k, v, bias, mask, dict(arrays, sinks=sinks)),
            q, k, v, bias, sinks)
        return out, lse, vjp((d_out, d_lse))
    return (*forward_and_vjp(q, k, v, bias, sinks, d_out, d_lse), sinks, d_out, d_lse)


def check_grads(case: Case, tier: str, mode: str = "interpret"):
    """out and lse, then dq, dk, dv, dbias and dsinks (factor 3) of `case` on `tier`, one
    jitted forward and backward, against float64; returns (out, lse, gradients)."""
    inputs = make_inputs(case)
    q, k, v, bias, mask = inputs
    features = make_features(case)
    out, lse, got, sinks, d_out, d_lse = _forward_and_vjp(case, tier, mode, inputs, features)
    d_out32 = d_out.astype(jnp.float32)
    *ref_forward, ref = reference_vjp(case, q, k, v, bias, mask, d_out32, d_lse, float64=True,
                                      features=features)
    *xla_forward, xla = reference_vjp(case, q, k, v, bias, mask, d_out32, d_lse,
                                      float64=False, features=features)
    _check_forward(case, inputs, features, out, lse, (ref_forward, xla_forward))
    for name, g, r, x, primal in zip(["dq", "dk", "dv", "dbias", "dsinks"], got, ref, xla,
                                     (q, k, v, bias, sinks)):
        if primal is None:
            assert g is None
            continue
        assert g.shape == primal.shape and g.dtype == primal.dtype, (name, g.shape, g.dtype)
        assert_matches_reference(name, g, r, x, q.dtype, factor=3.0)
    return out, lse, got


# ---------------------------------------------------------------- the matrix

CASES = [
    Case(b=2, t=113, s=203, hq=2, hkv=2, d=40, segments=3),
    Case(b=2, t=203, s=113, hq=6, hkv=2, d=59, window=(17, 5)),
    Case(b=1, t=113, s=113, hq=3, hkv=1, d=111, causal=True, softcap=1.0),
    Case(b=2, t=1, s=113, hq=6, hkv=2, d=59, sinks=True),
    Case(b=2, t=113, s=1, hq=2, hkv=1, d=40, sinks=True, segments=2),
    Case(b=2, t=113, s=203, hq=4, hkv=2, d=40, q_lengths=(100, 113), kv_lengths=(203, 57)),
    Case(b=2, t=203, s=113, hq=6, hkv=2, d=59, causal=True, window=(30, 0), segments=2,
         softcap=1.5, sinks=True, q_lengths=(150, 203), kv_lengths=(113, 90),
         bias_shape=(1, 6, 203, 113), mask_shape=(2, 1, 1, 113)),
    Case(b=2, t=70, s=37, hq=4, hkv=4, d=40, segments=4, sorted_ids=False, window=(3, 9)),
]
OTHER_DTYPES = [dataclasses.replace(CASES[6], dtype="float16"),
                dataclasses.replace(CASES[1], dtype="float32", softcap=0.7, sinks=True)]


def _skip_the_reference(tier: str) -> None:
    """The XLA path is the plain-JAX reference the tolerance rule measures against: its error
    is XLA's by construction, so the rule cannot fail there (`test_the_xla_path_is_the_
    reference` checks its plumbing bitwise instead; the reference's own semantics are checked
    against jax.nn and written-out rules in this file and tests/test_reference.py)."""
    if tier == "xla":
        pytest.skip("the XLA path is the reference itself: checked bitwise by "
                    "test_the_xla_path_is_the_reference")


# The float16 twin of a bfloat16 case with `-m slow` (float16's own tests stay in
# test_forward, test_backward and test_dropout; the XLA reference's check below keeps it).
@pytest.mark.parametrize("case", CASES + [
    pytest.param(c, marks=pytest.mark.slow) if c.dtype == "float16" else c
    for c in OTHER_DTYPES], ids=_ids)
def test_forward_and_gradients(case, feature_tier, kernel_mode):
    _skip_the_reference(feature_tier)
    check_grads(case, feature_tier, kernel_mode)


@pytest.mark.parametrize("case", CASES + OTHER_DTYPES, ids=_ids)
def test_the_xla_path_is_the_reference(case):
    """`implementation="xla"` through the public API (every feature as jax.nn-style
    arguments) is the same-precision reference the matrix measures the tiers against: out,
    lse and every gradient bitwise equal."""
    inputs = make_inputs(case)
    q, k, v, bias, mask = inputs
    features = make_features(case)
    out, lse, got, _, d_out, d_lse = _forward_and_vjp(case, "xla", "interpret", inputs,
                                                      features)
    *want_forward, want = reference_vjp(case, q, k, v, bias, mask, d_out.astype(jnp.float32),
                                        d_lse, float64=False, features=features)
    for name, g, w in zip(["out", "lse", "dq", "dk", "dv", "dbias", "dsinks"],
                          (out, lse, *got), (*want_forward, *want)):
        if w is None:
            assert g is None, name
            continue
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


def test_eager_call(feature_tier, kernel_mode):
    _skip_the_reference(feature_tier)
    run_case(CASES[6], feature_tier, kernel_mode, eager=True)


# Every broadcast shape of a bias and of a mask, for B=2, Hq=4, T=37, S=70, under the soft
# cap (which bends the bias's gradient) with packed segments.
BROADCASTS = [(70,), (37, 1), (4, 1, 70), (1, 1, 1, 1), (2, 1, 37, 70), (2, 4, 37, 1)]


@pytest.mark.parametrize("shape", BROADCASTS, ids=str)
def test_bias_broadcast_under_the_soft_cap(shape, feature_tier, kernel_mode):
    _skip_the_reference(feature_tier)
    case = Case(b=2, t=37, s=70, hq=4, hkv=2, d=40, bias_shape=shape, softcap=1.2,
                segments=2, sinks=len(shape) == 4)
    check_grads(case, feature_tier, kernel_mode)


@pytest.mark.parametrize("shape", [(70,), (37, 70), (2, 1, 1, 70), (1, 4, 37, 70)], ids=str)
def test_mask_broadcast_with_window_and_lengths(shape, feature_tier, kernel_mode):
    _skip_the_reference(feature_tier)
    case = Case(b=2, t=37, s=70, hq=4, hkv=1, d=59, mask_shape=shape, window=(20, 4),
                q_lengths=(37, 30), kv_lengths=(60, 70), causal=True)
    check_grads(case, feature_tier, kernel_mode)


# ---------------------------------------------------------------- rows that see no key


def _assert_empty_rows(out, lse, grads, rows, sinks=None):
    """Rows `rows` ([B, T] bool) output 0 and have lse -inf (the sink with sinks); nothing
    is NaN and their dq is 0."""
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert rows.any(), "the case must have rows without keys"
    assert np.all(out[rows] == 0.0)
    lse_rows = np.transpose(lse, (0, 2, 1))[rows]  # [n, Hq]
    if sinks is None:
        assert np.all(lse_rows == -np.inf)
    else:
        np.testing.assert_allclose(lse_rows, np.broadcast_to(sinks, lse_rows.shape),
                                   rtol=1e-6)
    for g in grads:
        if g is not None:
            assert not np.isnan(np.asarray(g, np.float32)).any()
    assert np.all(np.asarray(grads[0], np.float32)[rows] == 0.0)


@pytest.mark.parametrize("with_sinks", [False, True])
def test_rows_that_see_no_key(with_sinks, feature_tier, kernel_mode):
    """A window that excludes every key (T > S, causal, left 5: the first T - S rows), a
    segment with no keys (the ids' extra value), a batch row with no keys (length 0) and
    padding queries: out 0, lse -inf (the sink), dq 0, no NaN."""
    case = Case(b=2, t=120, s=50, hq=4, hkv=2, d=40, causal=True, window=(5, 0),
                segments=2, kv_lengths=(50, 0), q_lengths=(110, 120), sinks=with_sinks,
                dtype="float32")
    out, lse, grads = check_grads(case, feature_tier, kernel_mode)
    features = make_features(case)
    sinks = features.get("sinks")
    ids_q = np.asarray(features["q_segment_ids"])
    ids_k = np.asarray(features["kv_segment_ids"])
    i = np.arange(case.t)[:, None]
    j = np.arange(case.s)[None, :]
    sees = np.zeros((case.b, case.t), bool)
    for b in range(case.b):
        vis = ((j <= i + case.s - case.t) & (j >= i + case.s - case.t - 5)
               & (ids_q[b][:, None] == ids_k[b][None, :]) & (j < case.kv_lengths[b])
               & (i < case.q_lengths[b]))
        sees[b] = vis.any(axis=1)
    _assert_empty_rows(out, lse, grads, ~sees,
                       None if sinks is None else np.asarray(sinks)[None, :])


# ---------------------------------------------------------------- equivalences


def _f32_inputs(b=2, t=45, s=45, hq=4, hkv=2, d=24, seed=3):
    rng = np.random.default_rng(seed)
    return (normal(rng, (b, t, hq, d)), normal(rng, (b, s, hkv, d)),
            normal(rng, (b, s, hkv, d)))


def _assert_close(got, want, atol=2e-6):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        finite = np.isfinite(w)
        np.testing.assert_array_equal(np.isfinite(g), finite)
        np.testing.assert_allclose(g[finite], w[finite], rtol=2e-5, atol=atol)


def _value_and_grads(fn, q, k, v):
    def loss(q, k, v):
        out, lse = fn(q, k, v)
        return jnp.sum(out * jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0)), (
            out, lse)
    (_, aux), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        q, k, v)
    return aux, grads


@pytest.mark.parametrize("t,s", [(45, 45), (31, 60), (60, 31)])
def test_packed_ids_equal_their_dense_mask(t, s, feature_tier, kernel_mode):
    q, k, v = _f32_inputs(t=t, s=s)
    case = Case(b=2, t=t, s=s, hq=4, hkv=2, d=24, segments=3, sorted_ids=False)
    f = make_features(case)
    dense = (f["q_segment_ids"][:, None, :, None] == f["kv_segment_ids"][:, None, None, :])
    kw = dict(return_lse=True, is_causal=True, **call_kwargs(feature_tier, kernel_mode))
    got = _value_and_grads(lambda q, k, v: ffpa_jax.attention(
        q, k, v, q_segment_ids=f["q_segment_ids"], kv_segment_ids=f["kv_segment_ids"], **kw),
        q, k, v)
    want = _value_and_grads(lambda q, k, v: ffpa_jax.attention(
        q, k, v, mask=dense, **dict(kw, implementation="xla")), q, k, v)
    _assert_close(got, want)


@pytest.mark.parametrize("t,s,window,causal", [(45, 45, (4, 2), False), (31, 60, (7, 0), True),
                                               (60, 31, (0, 9), False), (45, 45, 3, True)])
def test_window_equals_its_dense_band(t, s, window, causal, feature_tier, kernel_mode):
    q, k, v = _f32_inputs(t=t, s=s)
    left, right = (window, window) if isinstance(window, int) else window
    # The band written out (not the library's rule): bottom-right aligned, as jax.nn's,
    # query i sees keys j with i + S - T - left <= j <= i + S - T + right.
    i, j = np.arange(t)[:, None], np.arange(s)[None, :]
    band = jnp.asarray((j >= i + s - t - left) & (j <= i + s - t + right))
    kw = dict(return_lse=True, is_causal=causal, **call_kwargs(feature_tier, kernel_mode))
    got = _value_and_grads(lambda q, k, v: ffpa_jax.attention(
        q, k, v, local_window_size=window, **kw), q, k, v)
    want = _value_and_grads(lambda q, k, v: ffpa_jax.attention(
        q, k, v, mask=band, **dict(kw, implementation="xla")), q, k, v)
    _assert_close(got, want)


@pytest.mark.parametrize("window,causal", [((4, 2), False), ((6, 0), True), (3, False)])
def test_window_is_jax_nn_window_when_t_equals_s(window, causal, feature_tier, kernel_mode):
    q, k, v = _f32_inputs(b=1, t=40, s=40, hq=4, hkv=4)
    got = ffpa_jax.attention(q, k, v, local_window_size=window, is_causal=causal,
                             **call_kwargs(feature_tier, kernel_mode))
    with jax.default_matmul_precision("highest"):  # float32 products, not TF32, on a GPU
        want = jax.nn.dot_product_attention(q, k, v, local_window_size=window,
                                            is_causal=causal, implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("t,s,causal", [(40, 40, False), (40, 40, True), (29, 53, False)])
def test_seq_lengths_match_jax_nn(t, s, causal, feature_tier, kernel_mode):
    """jax.nn.dot_product_attention's query_seq_lengths / key_value_seq_lengths, compared on
    every row jax.nn gives a meaning to: the padding query rows are 0 in both; a row whose
    keys are all padding (length 0 here) averages all values in jax.nn and is 0 here."""
    q, k, v = _f32_inputs(b=3, t=t, s=s, hq=4, hkv=2)
    q_len = jnp.asarray([t, t - 7, 5], jnp.int32)
    kv_len = jnp.asarray([s - 3, 11, 0], jnp.int32)
    kw = dict(query_seq_lengths=q_len, key_value_seq_lengths=kv_len, is_causal=causal)
    # The rows that jax.nn and we agree on are weighted in the loss whose gradients compare.
    weights = np.random.default_rng(0).normal(size=q.shape[:3] + v.shape[3:])
    weights[2] = 0.0
    weights = jnp.asarray(weights, jnp.float32)

    def out_and_grads(attention):
        """attention's output and the gradients of sum(weights * output), jitted: eagerly,
        jax.nn's operations compile one by one."""
        def loss(q, k, v):
            out = attention(q, k, v, **kw)
            return jnp.sum(weights * out), out
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    ours, got = out_and_grads(functools.partial(ffpa_jax.attention,
                                                **call_kwargs(feature_tier, kernel_mode)))
    with jax.default_matmul_precision("highest"):  # float32 products, not TF32, on a GPU
        theirs, want = out_and_grads(functools.partial(jax.nn.dot_product_attention,
                                                       implementation="xla"))
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-5, atol=2e-6)
    assert np.all(got[2] == 0.0)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(np.asarray(a)[:2], np.asarray(b)[:2], rtol=1e-5, atol=2e-6)


def test_sinks_equal_one_more_key_of_zero_value(feature_tier, kernel_mode):
    """A sink is a key whose logit is the sink and whose value is 0: append such a key (k =
    0, so its logit is its bias, set to the sink) and compare out, lse and every gradient,
    the sinks' with the extra bias column's summed over batch and rows."""
    b, t, s, hq, hkv, d = 2, 33, 47, 6, 2, 24
    q, k, v = _f32_inputs(b=b, t=t, s=s, hq=hq, hkv=hkv, d=d)
    sinks = jax.random.normal(jax.random.key(5), (hq,), jnp.float32)
    kw = call_kwargs(feature_tier, kernel_mode)

    def ours(q, k, v, sinks):
        return ffpa_jax.attention(q, k, v, is_causal=True, sinks=sinks, return_lse=True, **kw)

    def extra_key(q, k, v, sinks):
        k1 = jnp.concatenate([jnp.zeros((b, 1, hkv, d)), k], axis=1)
        v1 = jnp.concatenate([jnp.zeros((b, 1, hkv, d)), v], axis=1)
        bias = jnp.zeros((1, hq, 1, s + 1)).at[0, :, 0, 0].set(sinks)
        # causal over the real keys only: key 0 (the sink) is visible to every row
        mask = jnp.concatenate([jnp.ones((t, 1), bool),
                                jnp.arange(s)[None, :] <= jnp.arange(t)[:, None] + s - t], 1)
        return ffpa_jax.attention(q, k1, v1, bias, mask, return_lse=True, implementation="xla")

    def loss(fn):
        def f(q, k, v, sinks):
            out, lse = fn(q, k, v, sinks)
            return jnp.sum(out * jnp.sin(out)) + 0.3 * jnp.sum(lse), (out, lse)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v,
                                                                                   sinks)

    (_, got), got_grads = loss(ours)
    (_, want), want_grads = loss(extra_key)
    _assert_close((got, got_grads), (want, want_grads), atol=5e-6)


def test_soft_cap_is_c_tanh_of_the_biased_logits(feature_tier, kernel_mode):
    """logits_soft_cap=c equals, on the XLA path, c·tanh((scale·q·kᵀ + bias) / c) passed as
    the only logits: q·kᵀ's share set to 0 (q = 0) and the capped logits as the bias."""
    q, k, v = _f32_inputs(b=1, t=20, s=30, hq=2, hkv=2, d=16)
    bias = 3.0 * jax.random.normal(jax.random.key(9), (1, 2, 20, 30), jnp.float32)
    c, scale = 1.7, 0.4
    got = ffpa_jax.attention(q, k, v, bias, scale=scale, logits_soft_cap=c,
                             **call_kwargs(feature_tier, kernel_mode))
    logits = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") * scale + bias
    want = ffpa_jax.attention(jnp.zeros_like(q), k, v, c * jnp.tanh(logits / c),
                              implementation="xla")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)


# ---------------------------------------------------------------- under transformations


def test_features_under_jit_and_vmap(feature_tier, kernel_mode):
    """vmap over a leading axis with the ids batched and the sinks shared equals a loop."""
    n, b, t, s, hq, hkv, d = 3, 1, 24, 40, 4, 2, 16
    ks = jax.random.split(jax.random.key(2), 6)
    q = jax.random.normal(ks[0], (n, b, t, hq, d), jnp.float32)
    k = jax.random.normal(ks[1], (n, b, s, hkv, d), jnp.float32)
    v = jax.random.normal(ks[2], (n, b, s, hkv, d), jnp.float32)
    q_ids = jnp.sort(jax.random.randint(ks[3], (n, b, t), 0, 3), axis=-1)
    kv_ids = jnp.sort(jax.random.randint(ks[4], (n, b, s), 0, 3), axis=-1)
    sinks = jax.random.normal(ks[5], (hq,), jnp.float32)
    kw = dict(local_window_size=(9, 2), logits_soft_cap=2.0,
              **call_kwargs(feature_tier, kernel_mode))

    def loss(q, k, v, q_ids, kv_ids, sinks):
        out = ffpa_jax.attention(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids,
                                 sinks=sinks, **kw)
        return jnp.sum(out * jnp.sin(out)), out

    step = jax.value_and_grad(loss, argnums=(0, 1, 2, 5), has_aux=True)
    batched = jax.jit(jax.vmap(step, in_axes=(0, 0, 0, 0, 0, None)))(q, k, v, q_ids, kv_ids,
                                                                       sinks)
    for i in range(n):
        one = jax.jit(step)(q[i], k[i], v[i], q_ids[i], kv_ids[i], sinks)
        got = jax.tree.map(lambda x: x[i], batched)
        _assert_close(got, one, atol=5e-6)


def test_unbatched_inputs_take_unbatched_ids(feature_tier, kernel_mode):
    q, k, v = _f32_inputs(b=1, t=20, s=30)
    q_ids = jnp.arange(20, dtype=jnp.int32) // 7
    kv_ids = jnp.arange(30, dtype=jnp.int32) // 10
    kw = dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids, local_window_size=(6, 6),
              query_seq_lengths=jnp.asarray(17, jnp.int32), **call_kwargs(feature_tier,
                                                                          kernel_mode))
    got = ffpa_jax.attention(q[0], k[0], v[0], **kw)
    want = ffpa_jax.attention(q, k, v, **dict(kw, q_segment_ids=q_ids[None],
                                              kv_segment_ids=kv_ids[None],
                                              query_seq_lengths=jnp.asarray([17], jnp.int32)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want[0]))


# ---------------------------------------------------------------- which tier runs them

FEATURE_CALLS = {
    "q_segment_ids": lambda b, t, s, h: dict(q_segment_ids=jnp.zeros((b, t), jnp.int32),
                                             kv_segment_ids=jnp.zeros((b, s), jnp.int32)),
    "local_window_size": lambda b, t, s, h: dict(local_window_size=(4, 0)),
    "logits_soft_cap": lambda b, t, s, h: dict(logits_soft_cap=30.0),
    "sinks": lambda b, t, s, h: dict(sinks=jnp.zeros((h,), jnp.float32)),
    "query_seq_lengths": lambda b, t, s, h: dict(query_seq_lengths=jnp.full((b,), t,
                                                                            jnp.int32)),
    "key_value_seq_lengths": lambda b, t, s, h: dict(
        key_value_seq_lengths=jnp.full((b,), s, jnp.int32)),
}


@pytest.mark.parametrize("name", sorted(FEATURE_CALLS))
def test_auto_plans_a_feature_like_any_call(name, monkeypatch):
    """On a (simulated) GPU, implementation=None plans a feature's call like any other: the
    fused kernels at D = 64, and a decode shape's forward on the decode kernels."""
    from test_chunked import _plan_of
    monkeypatch.setenv("FFPA_SKIP_PERSIST_TUNED_CONFIG", "1")
    for q_shape, kv_shape, decode in (((1, 512, 4, 64), (1, 512, 4, 64), False),
                                      ((2, 1, 8, 64), (2, 4096, 2, 64), True)):
        b, t, h = q_shape[0], q_shape[1], q_shape[2]
        plan = _plan_of(monkeypatch, q_shape, kv_shape,
                        **FEATURE_CALLS[name](b, t, kv_shape[1], h))
        assert (plan.forward_tier, plan.backward_tier) == ("pallas", "pallas")
        launched = tiers.PALLAS.runs(plan, "forward")
        assert (fused.DECODE_FWD_STAGE1.name in launched) == decode, launched


# Decode shapes (T <= 16 against S >= 128): the split-KV kernels with the features; the
# query heads of a GQA group packed into one tile, the sinks merged in stage 2.
DECODE_CASES = [
    Case(b=2, t=1, s=300, hq=6, hkv=2, d=59, causal=True, window=(100, 0), segments=3,
         sinks=True, softcap=1.5, q_lengths=(1, 1), kv_lengths=(280, 130)),
    Case(b=2, t=5, s=200, hq=4, hkv=1, d=40, segments=2, sorted_ids=False, sinks=True,
         q_lengths=(5, 3), window=(40, 10), dtype="float32"),
    Case(b=1, t=16, s=129, hq=2, hkv=2, d=111, causal=True, softcap=0.8,
         bias_shape=(1, 2, 16, 129), mask_shape=(1, 1, 16, 129), kv_lengths=(0,), sinks=True,
         dtype="float16"),
]


@pytest.mark.parametrize("case", DECODE_CASES, ids=_ids)
def test_decode_shapes(case, kernel_mode):
    """Through the public API (the decode kernels for the forward, the fused backward) and
    through decode_attention in many splits of 16 keys, against float64."""
    from pallas_kernels import DecodeConfig, Inputs, Problem, decode_attention
    run_case(case, "pallas", kernel_mode)
    check_grads(case, "pallas", kernel_mode)
    if kernel_mode != "interpret":  # the many small splits below: the interpreter's check
        return
    q, k, v, bias, mask = make_inputs(case)
    features = make_features(case)
    arrays = feature_arrays(features)
    inputs = Inputs(q, k, v, as_4d(bias, True), as_4d(mask, True), features=arrays)
    problem = Problem.of(*inputs[:5], scale=scale_of(case), causal=case.causal,
                         window=case.window, softcap=case.softcap, features=arrays)
    out, lse = decode_attention(problem, DecodeConfig(block_m=16, block_n=16, block_d=32,
                                                      block_dv=32),
                                inputs, num_splits=5, interpret=True)
    assert_forward_matches(out, lse, reference64(case, q, k, v, bias, mask, features=features),
                           xla_same_precision(case, q, k, v, bias, mask, features=features),
                           q.dtype)


def test_decode_plan_uses_the_decode_kernels(monkeypatch):
    from ffpa_jax import api
    plans = []
    real = api.plan_for
    monkeypatch.setattr(api, "plan_for", lambda *a, **k: plans.append(real(*a, **k))
                        or plans[-1])
    q, k, v = _f32_inputs(b=2, t=1, s=200)
    kw = dict(local_window_size=(30, 0), logits_soft_cap=2.0)
    got = ffpa_jax.attention(q, k, v, implementation="pallas", interpret=True, **kw)
    want = ffpa_jax.attention(q, k, v, implementation="xla", **kw)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=2e-6)
    plan = plans[0]  # the pallas call's (the second is the dense tier's)
    assert plan.forward_tier == "pallas"
    assert plan.config("decode_fwd_stage1").num_splits >= 1
    assert plan.problem.window == (30, 0) and plan.problem.softcap == 2.0


# ---------------------------------------------------------------- the fused forward kernel

# Small tiles (16 x 16) split these into many query and key blocks: the window's band, the
# segments' block ranges and the lengths bound each query block's walk over key blocks.
KERNEL_CASES = [
    Case(b=2, t=113, s=203, hq=6, hkv=2, d=40, causal=True, window=(20, 0), segments=3,
         sinks=True, q_lengths=(100, 113), kv_lengths=(203, 150)),
    Case(b=2, t=203, s=113, hq=4, hkv=1, d=59, window=(9, 30), softcap=1.3,
         bias_shape=(1, 4, 203, 113), dtype="float16"),
    Case(b=1, t=150, s=150, hq=2, hkv=2, d=111, segments=4, sorted_ids=False, softcap=2.0,
         mask_shape=(1, 1, 150, 150), kv_lengths=(120,), dtype="float32"),
    Case(b=2, t=77, s=90, hq=2, hkv=1, d=40, segments=5, causal=True, q_lengths=(0, 50)),
]


@pytest.mark.parametrize("case", KERNEL_CASES, ids=_ids)
def test_forward_kernel_in_small_tiles(case):
    from pallas_kernels import FwdConfig, Inputs, Problem, fwd_generic
    q, k, v, bias, mask = make_inputs(case)
    features = make_features(case)
    arrays = feature_arrays(features)
    inputs = Inputs(q, k, v, as_4d(bias, True), as_4d(mask, True), features=arrays)
    problem = Problem.of(*inputs[:5], scale=scale_of(case), causal=case.causal,
                         window=case.window, softcap=case.softcap, features=arrays)
    out, lse = fwd_generic(problem, FwdConfig(block_m=16, block_n=16, block_d=32, block_dv=32),
                           inputs, interpret=True)[:2]
    assert_forward_matches(out, lse, reference64(case, q, k, v, bias, mask, features=features),
                           xla_same_precision(case, q, k, v, bias, mask, features=features),
                           q.dtype)


@pytest.mark.parametrize("sorted_ids", [True, False])
@pytest.mark.parametrize("t,s,bm,bn", [(113, 203, 16, 32), (203, 113, 64, 16), (1, 70, 16, 16)])
def test_segment_block_ranges_hold_every_meeting_block(sorted_ids, t, s, bm, bn):
    """Every (query block, key block) pair with a query and a key of one segment lies in the
    query block's range; with contiguous segments each block in the range meets it."""
    from pallas_kernels.visibility import segment_block_ranges
    ka, kb = jax.random.split(jax.random.key(t + s + bm))
    q_ids = jax.random.randint(ka, (3, t), 0, 6)
    kv_ids = jax.random.randint(kb, (3, s), 0, 5)
    if sorted_ids:
        q_ids, kv_ids = jnp.sort(q_ids, axis=1), jnp.sort(kv_ids, axis=1)
    ranges = np.asarray(segment_block_ranges(q_ids, kv_ids, block_m=bm, block_n=bn))
    q_ids, kv_ids = np.asarray(q_ids), np.asarray(kv_ids)
    for b in range(3):
        for i in range(-(-t // bm)):
            lo, hi = ranges[b, i]
            rows = q_ids[b, i * bm:(i + 1) * bm]
            for j in range(-(-s // bn)):
                cols = kv_ids[b, j * bn:(j + 1) * bn]
                meets = np.isin(rows, cols).any()
                if meets:
                    assert lo <= j < hi, (b, i, j, lo, hi)
                elif sorted_ids and lo <= j < hi:
                    assert rows.min() <= cols.max() and cols.min() <= rows.max()


# ---------------------------------------------------------------- the chunked tier in blocks

# With a 64 KiB budget these split into many query and key blocks: a window's band of keys
# per query block (traced starts in the scans), key blocks merged by lse before the sinks
# join, the backward's accumulation at traced key offsets, a key-constant bias whose
# gradient the soft cap and the sinks take out of closed form.
BLOCKED_CASES = [
    Case(b=2, t=203, s=113, hq=6, hkv=2, d=40, causal=True, window=(20, 0), segments=2,
         sinks=True, bias_shape=(1, 6, 203, 113)),
    Case(b=1, t=113, s=203, hq=4, hkv=1, d=59, window=(9, 30), softcap=1.3, q_lengths=(100,),
         kv_lengths=(150,), mask_shape=(1, 1, 113, 203), dtype="float16"),
    Case(b=2, t=150, s=150, hq=2, hkv=2, d=111, segments=3, sinks=True, softcap=2.0,
         bias_shape=(2, 1, 150, 1), dtype="float32"),
]
SMALL_BUDGET_MIB = "0.0625"


@pytest.mark.parametrize("case", BLOCKED_CASES, ids=_ids)
def test_chunked_tier_in_many_blocks(case, monkeypatch):
    from pallas_kernels import chunked_plan
    monkeypatch.setenv(chunked_plan.BUDGET_ENV, SMALL_BUDGET_MIB)
    check_grads(case, "chunked")


def test_chunked_pallas_steps_in_many_blocks(monkeypatch):
    from pallas_kernels import chunked_plan
    monkeypatch.setenv(chunked_plan.BUDGET_ENV, SMALL_BUDGET_MIB)
    case = dataclasses.replace(BLOCKED_CASES[0], t=90, s=57, bias_shape=(1, 6, 90, 57))
    check_grads(case, "chunked-step")


@pytest.mark.parametrize("t,s", [(113, 203), (203, 113), (1, 113), (113, 1), (300, 300)])
@pytest.mark.parametrize("block_q", [1, 16, 100])
@pytest.mark.parametrize("window,causal", [((5, 3), False), ((20, 0), True), ((0, 0), False),
                                           ((40, 2), True), ((1000, 7), False)])
def test_window_blocks_read_every_key_their_rows_see(t, s, block_q, window, causal):
    """Each query block reads a band of keys (or keys [0, limit)) that holds every key its
    rows' windows show; rows that see no key are left out only when they see none."""
    from pallas_kernels import chunked_plan
    problem = Problem(batch=1, seq_q=t, seq_k=s, heads_q=1, heads_kv=1, head_dim=8,
                      head_dim_v=8, dtype=jnp.float32, scale=1.0, causal=causal, window=window)
    i = np.arange(t)[:, None]
    j = np.arange(s)[None, :]
    visible = ((j >= i + s - t - window[0]) & (j <= i + s - t + window[1])
               & ((j <= i + s - t) if causal else True))
    covered = np.zeros(t, int)
    for g in chunked_plan.groups(problem, block_q):
        for r0 in g.starts:
            start = chunked_plan.key_start(problem, g, r0)
            assert 0 <= start and start + g.keys <= s
            rows = visible[r0:r0 + g.rows]
            cols = np.nonzero(rows.any(axis=0))[0]
            if cols.size:
                assert start <= cols[0] and cols[-1] < start + g.keys, (r0, start, g)
            covered[r0:r0 + g.rows] += 1
        if g.band:
            assert g.keys <= min(s, g.rows + window[0] + (0 if causal else window[1]))
    assert covered.max() <= 1
    assert covered[visible.any(axis=1)].min(initial=1) == 1


def _shapes_in(jaxpr) -> list[tuple[int, ...]]:
    """Every intermediate's shape, in nested jaxprs (scans, custom rules, pallas) too."""
    def inner(param):
        if hasattr(param, "eqns"):
            return [param]
        if hasattr(getattr(param, "jaxpr", None), "eqns"):
            return [param.jaxpr]
        if isinstance(param, (tuple, list)):
            return [j for p in param for j in inner(p)]
        return []
    shapes = []
    for eqn in jaxpr.eqns:
        shapes += [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
        for param in eqn.params.values():
            for sub in inner(param):
                shapes += _shapes_in(sub)
    return shapes


@pytest.mark.parametrize("features", ["ids", "window", "lengths"])
def test_chunked_tier_builds_no_t_by_s_array(features, monkeypatch):
    """The chunked forward and backward with the features, in blocks: no intermediate has
    both a T-sized and an S-sized dim (the ids become per-block masks only)."""
    from pallas_kernels import chunked_plan
    monkeypatch.setenv(chunked_plan.BUDGET_ENV, "1")
    b, t, s, h, d = 1, 2053, 2063, 2, 16
    q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((b, s, h, d), jnp.bfloat16)
    kw = {"ids": dict(q_segment_ids=jnp.zeros((b, t), jnp.int32),
                      kv_segment_ids=jnp.zeros((b, s), jnp.int32)),
          "window": dict(local_window_size=(64, 0), is_causal=True),
          "lengths": dict(query_seq_lengths=jnp.asarray([t], jnp.int32),
                          key_value_seq_lengths=jnp.asarray([s], jnp.int32))}[features]

    def loss(q, k, v):
        return jnp.sum(ffpa_jax.attention(q, k, v, implementation="chunked",
                                          logits_soft_cap=5.0, **kw).astype(jnp.float32))
    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, kv, kv)
    big = [shape for shape in _shapes_in(jaxpr.jaxpr) if t in shape and s in shape]
    assert not big, big[:3]


def _small_tiles(monkeypatch):
    """Every fused kernel's launch config at 16 x 16 tiles (32-wide head-dim chunks): the
    shapes below then split into many query and key blocks in each direction."""
    from tuning import dispatch
    small = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_HEADDIM_QK=32, BLOCK_HEADDIM_V=32,
                 BLOCK_HEADDIM=32, num_warps=4, num_stages=2)
    monkeypatch.setattr(dispatch, "kernel_config", lambda kernel, problem, **kw: (dict(small),
                                                                                   "test"))


BACKWARD_KERNEL_CASES = KERNEL_CASES + [
    # S within one 16-wide tile: δ and the normalisation from the tile itself, with the sink
    Case(b=2, t=40, s=13, hq=4, hkv=2, d=40, sinks=True, softcap=1.5, segments=2,
         bias_shape=(2, 1, 40, 1)),
]


# float16 with `-m slow` (its window, soft cap and bias run in bfloat16 elsewhere here).
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow)
                                  if c.dtype == "float16" else c
                                  for c in BACKWARD_KERNEL_CASES], ids=_ids)
def test_fused_kernels_in_small_tiles(case, monkeypatch):
    """The fused forward and backward (dq, dkdv, dbias; float32: exact rows) with the
    features' block ranges over many blocks, against float64."""
    _small_tiles(monkeypatch)
    check_grads(case, "pallas")


def test_a_feature_a_kernel_lacks_is_routed_or_refused(monkeypatch):
    """The mechanism for a feature a tier lacks (`Tier.unsupported`; the fused tier lacks
    none today): declared for its backward, the dispatcher runs that direction on the next
    tier (also with interpret=True); an explicit "pallas" runs its forward and says why its
    backward went elsewhere (lacking it in the forward, it is refused: the Mosaic tests)."""
    from pallas_kernels import tiers
    from test_chunked import _plan_of
    from tuning import dispatch

    def lacks(problem, direction):
        return ("logits_soft_cap",) if direction == "backward" and problem.softcap else ()
    lacking = dataclasses.replace(tiers.PALLAS, unsupported=lacks)
    monkeypatch.setattr(tiers, "PALLAS", lacking)
    monkeypatch.setattr(tiers, "TIERS", tuple(lacking if t.name == lacking.name else t
                                              for t in tiers.TIERS))
    monkeypatch.setattr(tiers, "BY_NAME", {**tiers.BY_NAME, lacking.name: lacking})
    monkeypatch.setattr(dispatch, "TIERS", tiers.TIERS)
    monkeypatch.setenv("FFPA_SKIP_PERSIST_TUNED_CONFIG", "1")
    q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    plan = _plan_of(monkeypatch, (1, 512, 4, 64), (1, 512, 4, 64), logits_soft_cap=5.0)
    assert (plan.forward_tier, plan.backward_tier) == ("pallas", "chunked")
    problem = ffpa_jax.validation.validate(q, q, q, None, None, scale=None, is_causal=False,
                                           dropout_rate=0.0, dropout_rng=None,
                                           return_lse=False, implementation=None,
                                           interpret=True, logits_soft_cap=5.0).problem
    explained = dispatch.explain(problem, interpret=True)
    assert (explained.forward.tier, explained.backward.tier) == ("pallas", "chunked")
    assert explained.passed_over == (("pallas", "does not implement logits_soft_cap in the "
                                                "backward"),)
    named = dispatch.explain(problem, "pallas", interpret=True)
    assert (named.forward.tier, named.backward.tier) == ("pallas", "chunked")
    assert "'pallas' does not implement logits_soft_cap in the backward" in named.backward.why
    out = ffpa_jax.attention(q, q, q, logits_soft_cap=5.0, implementation="pallas",
                             interpret=True)
    assert out.shape == q.shape
