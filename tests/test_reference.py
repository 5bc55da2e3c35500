"""pallas_kernels.reference: the one plain-JAX reference (the XLA path, the tests', the
bench's and the autotuner's), its sampled variants, and the XLA path under jax.debug_infs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from ffpa_jax.reference import mha_reference
from pallas_kernels import reference
from pallas_kernels.problem import Inputs
from pallas_kernels.problem import Problem

B, T, S, HQ, HKV, D = 2, 24, 40, 4, 2, 16


def inputs(seed: int = 0, *, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (B, T, HQ, D), dtype)
    k = jax.random.normal(keys[1], (B, S, HKV, D), dtype)
    v = jax.random.normal(keys[2], (B, S, HKV, D), dtype)
    do = jax.random.normal(keys[3], (B, T, HQ, D), dtype)
    bias = jax.random.normal(keys[4], (1, HQ, T, S), jnp.float32)
    # Every row keeps at least its first key visible.
    mask = jax.random.bernoulli(keys[5], 0.6, (B, 1, T, S)).at[..., 0].set(True)
    return q, k, v, do, bias, mask


# ---------------------------------------------------------------- jax.debug_infs


@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"mask": True},
                                {"mask": True, "is_causal": True}, {"bias": True}],
                         ids=["plain", "causal", "mask", "mask-causal", "bias"])
def test_xla_path_runs_eagerly_under_debug_infs(kw):
    """Attention that masks nothing, or masks while leaving every row a key, forms no
    infinity: the debug-infs check stays quiet on the forward and the gradient."""
    q, k, v, _, bias, mask = inputs()
    call = dict(implementation="xla", is_causal=kw.get("is_causal", False),
                mask=mask if kw.get("mask") else None, bias=bias if kw.get("bias") else None)
    want = ffpa_jax.attention(q, k, v, **call)
    with jax.debug_infs(True):
        out, lse = ffpa_jax.attention(q, k, v, return_lse=True, **call)
        grad = jax.grad(lambda q: ffpa_jax.attention(q, k, v, **call).sum())(q)
    assert np.isfinite(np.asarray(lse)).all() and np.isfinite(np.asarray(grad)).all()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_rows_without_keys_still_give_zero_and_minus_inf():
    q, k, v, _, _, mask = inputs()
    mask = mask.at[:, :, 3].set(False)  # row 3 sees no key
    out, lse = mha_reference(q, k, v, None, mask, scale=0.25, is_causal=True)
    assert np.all(np.asarray(out)[:, 3] == 0.0) and np.all(np.asarray(lse)[:, :, 3] == -np.inf)
    # Causal with more queries (S of them) than keys (T): the first S - T rows see no key.
    short = q[:, :, :HKV]
    out, lse = mha_reference(k, short, short, scale=0.25, is_causal=True)
    assert np.all(np.asarray(out)[:, :S - T] == 0.0)
    assert np.all(np.asarray(lse)[:, :, :S - T] == -np.inf)
    assert np.isfinite(np.asarray(lse)[:, :, S - T:]).all()
    g = jax.grad(lambda q: mha_reference(q, k, v, None, mask, scale=0.25)[0].sum())(q)
    assert np.all(np.asarray(g)[:, 3] == 0.0)


def test_softmax_matches_a_written_out_softmax():
    scores = jnp.array([[1.0, 2.0, 3.0], [0.5, -1.0, 4.0], [1.0, 1.0, 1.0]])
    visible = jnp.array([[True, False, True], [False, False, False], [True, True, True]])
    probs, lse = reference.softmax(scores, visible)
    e = np.exp([1.0, 3.0])
    np.testing.assert_allclose(np.asarray(probs[0]), [e[0] / e.sum(), 0.0, e[1] / e.sum()],
                               rtol=1e-6)
    np.testing.assert_allclose(float(lse[0]), np.log(e.sum()), rtol=1e-6)
    assert np.all(np.asarray(probs[1]) == 0.0) and float(lse[1]) == -np.inf
    np.testing.assert_allclose(np.asarray(probs[2]), [1 / 3] * 3, rtol=1e-6)
    np.testing.assert_allclose(float(lse[2]), 1.0 + np.log(3.0), rtol=1e-6)


# ---------------------------------------------------------------- sampled variants


def problem(*, causal: bool, bias, mask) -> Problem:
    return Problem(batch=B, seq_q=T, seq_k=S, heads_q=HQ, heads_kv=HKV, head_dim=D,
                   head_dim_v=D, dtype=jnp.float32, scale=D ** -0.5, causal=causal,
                   bias_shape=None if bias is None else bias.shape,
                   mask_shape=None if mask is None else mask.shape)


@pytest.mark.parametrize("causal", [False, True])
def test_sampled_references_match_the_dense_reference_and_its_autodiff(causal):
    """The autotuner's sampled checks against the dense reference: the forward at sampled
    rows, and dq, dk/dv, dbias (from the forward's lse and δ) against jax.vjp of the
    dense reference."""
    q, k, v, do, bias, mask = inputs(1)
    s = problem(causal=causal, bias=bias, mask=mask)

    def dense(q, k, v, bias):
        return mha_reference(q, k, v, bias, mask, scale=s.scale, is_causal=causal)

    (out, lse), vjp = jax.vjp(dense, q, k, v, bias)
    dq, dk, dv, dbias = vjp((do, jnp.zeros_like(lse)))
    delta = jnp.einsum("bthd,bthd->bht", out, do)
    pairs, rows, cols = ((0, 0), (1, 3)), (0, 5, 17, 23), (1, 8, 39)

    o_s, lse_s = reference.sampled_forward(Inputs(q, k, v, bias, mask), s=s, pairs=pairs, rows=rows)
    r = np.array(rows)
    for p, (b, h) in enumerate(pairs):
        np.testing.assert_allclose(o_s[p], out[b, r, h], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse_s[p], lse[b, h, r], rtol=1e-6)
    dq_s = reference.sampled_dq(Inputs(q, k, v, bias, mask),
                                reference.Upstream(do, lse, delta), s=s, pairs=pairs,
                                rows=rows)
    for p, (b, h) in enumerate(pairs):
        np.testing.assert_allclose(dq_s[p], dq[b, r, h], rtol=1e-4, atol=1e-5)
    kv_pairs, c = ((0, 0), (1, 1)), np.array(cols)
    dk_s, dv_s = reference.sampled_dkdv(Inputs(q, k, v, bias, mask),
                                        reference.Upstream(do, lse, delta), s=s,
                                        pairs=kv_pairs, cols=cols)
    for p, (b, hk) in enumerate(kv_pairs):
        np.testing.assert_allclose(dk_s[p], dk[b, c, hk], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(dv_s[p], dv[b, c, hk], rtol=1e-4, atol=1e-5)
    dbias_s = reference.sampled_dbias(Inputs(q, k, v, bias, mask),
                                      reference.Upstream(do, lse, delta), s=s, rows=rows,
                                      cols=cols)
    np.testing.assert_allclose(dbias_s, dbias[:, :, r][:, :, :, c], rtol=1e-4, atol=1e-5)


def test_sampled_dbias_sums_over_broadcast_dims():
    q, k, v, do, _, _ = inputs(2)
    bias = jax.random.normal(jax.random.key(7), (1, 1, 1, S), jnp.float32)  # one row of keys
    s = problem(causal=True, bias=bias, mask=None)

    def dense(bias):
        return mha_reference(q, k, v, bias, None, scale=s.scale, is_causal=True)

    (out, lse), vjp = jax.vjp(dense, bias)
    (dbias,) = vjp((do, jnp.zeros_like(lse)))
    delta = jnp.einsum("bthd,bthd->bht", out, do)
    got = reference.sampled_dbias(Inputs(q, k, v, bias), reference.Upstream(do, lse, delta),
                                  s=s, rows=(0, 3), cols=(2, 30))
    np.testing.assert_allclose(got, dbias[:, :, :, np.array([2, 30])], rtol=1e-4, atol=1e-5)


def test_rows_reference_is_the_dense_reference_at_those_rows():
    q, k, v, _, bias, mask = inputs(3)
    out, lse = mha_reference(q, k, v, bias, mask, scale=0.3, is_causal=True)
    rows = np.array([2, 9, 20])
    visible = np.asarray(mask[1, 0][rows]) & np.asarray(reference.causal_keep(T, S, rows=rows))
    o, l = reference.rows_reference(q[1, rows, 2], k[1, :, 1], v[1, :, 1], bias[0, 2, rows],
                                    jnp.asarray(visible), scale=0.3)
    np.testing.assert_allclose(o, out[1, rows, 2], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(l, lse[1, 2, rows], rtol=1e-6)
