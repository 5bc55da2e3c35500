"""Numerical edge cases, on the Pallas path (interpret mode on CPU, the real kernels under
the `gpu` marker) and on the XLA path, against the float64 reference:

- fully masked rows (all-False mask rows, causal with T > S, bias rows of -inf, every
  key masked) give output 0, lse -inf and zero gradients, never NaN;
- logits up to about ±1e4 in fp16/bf16 (a large scale, or a large bias) stay finite and
  match the reference;
- NaN and ±inf in q, k or v propagate exactly as in the reference (see README,
  "Semantics and limits");
- a float32 (or other float) bias with 16-bit inputs.

The helpers at the top (`run_attention`, `run_reference`, `compare_all`) are shared
with tests/test_fuzz.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from attn_testing import assert_lse_matches, assert_matches_reference
from conftest import interpret_flag
from ffpa_jax.reference import mha_reference

# ----------------------------------------------------------------------------- helpers


def _batched(x, batched: bool):
    return x if (x is None or batched) else x[None]


def _as_4d(x, batched: bool):
    """bias/mask/keep of any broadcastable rank as 4-D [B, Hq, T, S] (a reshape)."""
    if x is None:
        return None
    rank = 4 if batched else 3
    x = jnp.reshape(x, (1,) * (rank - x.ndim) + tuple(x.shape))
    return x if batched else x[None]


@functools.partial(jax.jit, static_argnames=("scale", "causal", "impl", "interpret",
                                             "dropout_rate", "with_grads"))
def run_attention(q, k, v, bias, mask, rng, d_out, d_lse, *, scale, causal, impl, interpret,
                  dropout_rate=0.0, with_grads=True):
    """(out, lse, (dq, dk, dv, dbias)) through the public `attention`; the gradients are
    those of <out, d_out> + <lse, d_lse> (None without `with_grads`)."""
    def f(q, k, v, bias):
        return ffpa_jax.attention(q, k, v, bias, mask, scale=scale, is_causal=causal,
                                  dropout_rate=dropout_rate, dropout_rng=rng, return_lse=True,
                                  implementation=impl, interpret=interpret)
    if not with_grads:
        out, lse = f(q, k, v, bias)
        return out, lse, None
    (out, lse), vjp = jax.vjp(f, q, k, v, bias)
    return out, lse, vjp((d_out.astype(out.dtype), d_lse.astype(lse.dtype)))


@functools.partial(jax.jit, static_argnames=("scale", "causal", "batched", "dropout_rate",
                                             "with_grads"))
def _reference_jit(q, k, v, bias, mask, keep, d_out, d_lse, *, scale, causal, batched,
                   dropout_rate, with_grads):
    def f(q, k, v, bias):
        out, lse = mha_reference(_batched(q, batched), _batched(k, batched), _batched(v, batched),
                                 _as_4d(bias, batched), _as_4d(mask, batched), scale=scale,
                                 is_causal=causal, keep_mask=_as_4d(keep, batched),
                                 dropout_rate=dropout_rate)
        return (out, lse) if batched else (out[0], lse[0])
    if not with_grads:
        out, lse = f(q, k, v, bias)
        return out, lse, None
    (out, lse), vjp = jax.vjp(f, q, k, v, bias)
    return out, lse, vjp((d_out.astype(out.dtype), d_lse.astype(lse.dtype)))


def run_reference(q, k, v, bias, mask, d_out, d_lse, *, scale, causal, float64, keep=None,
                  dropout_rate=0.0, with_grads=True):
    """The reference (out, lse, grads) as numpy: in float64 on exactly the given (already
    rounded) inputs, or at the inputs' own precision (the "same-precision XLA" baseline).
    `keep` is the dropout keep-mask (ffpa_jax.dropout_mask) when dropout_rate > 0."""
    batched = q.ndim == 4
    if scale is None:
        scale = 1.0 / float(np.sqrt(q.shape[-1]))
    kw = dict(scale=scale, causal=causal, batched=batched, dropout_rate=dropout_rate,
              with_grads=with_grads)

    def to_np(tree):
        return jax.tree.map(lambda x: np.asarray(x), tree)

    if not float64:
        return to_np(_reference_jit(q, k, v, bias, mask, keep, d_out, d_lse, **kw))
    with jax.enable_x64(True):
        c = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))
        return to_np(_reference_jit(c(q), c(k), c(v), c(bias), mask, keep, c(d_out), c(d_lse),
                                    **kw))


def compare_all(got, ref, xla, q, bias, *, with_grads=True):
    """The tolerance rule of docs/design.md on out, lse and every gradient; shapes and dtypes of
    the gradients are those of the primals."""
    out, lse, grads = got
    assert out.dtype == q.dtype and lse.dtype == jnp.float32, (out.dtype, lse.dtype)
    assert_matches_reference("out", out, ref[0], xla[0], q.dtype)
    assert_lse_matches(lse, ref[1], xla[1])
    if not with_grads:
        return
    for name, g, r, x in zip(("dq", "dk", "dv", "dbias"), grads, ref[2], xla[2]):
        if name == "dbias" and bias is None:
            assert g is None
            continue
        primal_dtype = jnp.dtype(bias.dtype if name == "dbias" else q.dtype)
        assert g.dtype == primal_dtype, (name, g.dtype, primal_dtype)
        # The rule applies at the coarser of the computation's precision (q/k/v's) and the
        # result's own dtype (a bf16 bias gets a bf16 gradient even from float32 inputs).
        rule_dtype = min(jnp.dtype(q.dtype), primal_dtype, key=lambda t: t.itemsize)
        assert_matches_reference(name, g, r, x, rule_dtype, factor=3.0)


def random_inputs(seed, *, b, t, s, hq, hkv, d, dv, dtype, magnitude=1.0):
    """Fresh random normal q, k, v (never zeros) and cotangents."""
    keys = jax.random.split(jax.random.key(seed), 5)
    dtype = jnp.dtype(dtype)
    q = (magnitude * jax.random.normal(keys[0], (b, t, hq, d), jnp.float32)).astype(dtype)
    k = (magnitude * jax.random.normal(keys[1], (b, s, hkv, d), jnp.float32)).astype(dtype)
    v = jax.random.normal(keys[2], (b, s, hkv, dv), jnp.float32).astype(dtype)
    # The output cotangent as the kernel sees it: rounded to the output's dtype.
    d_out = jax.random.normal(keys[3], (b, t, hq, dv), jnp.float32).astype(dtype)
    d_lse = jax.random.normal(keys[4], (b, hq, t), jnp.float32)
    return q, k, v, d_out.astype(jnp.float32), d_lse


def _check_path(impl, mode, q, k, v, bias, mask, d_out, d_lse, *, scale, causal):
    """Run one path, compare it with the float64 reference, return its results as numpy."""
    interpret = impl == "pallas" and interpret_flag(mode)
    got = run_attention(q, k, v, bias, mask, None, d_out, d_lse, scale=scale, causal=causal,
                        impl=impl, interpret=interpret)
    ref = run_reference(q, k, v, bias, mask, d_out, d_lse, scale=scale, causal=causal,
                        float64=True)
    xla = run_reference(q, k, v, bias, mask, d_out, d_lse, scale=scale, causal=causal,
                        float64=False)
    compare_all(got, ref, xla, q, bias)
    out, lse, grads = got
    return (np.asarray(out, np.float32), np.asarray(lse),
            [None if g is None else np.asarray(g, np.float32) for g in grads])


PATHS = [pytest.param("pallas", id="pallas"), pytest.param("xla", id="xla")]


@pytest.fixture(params=PATHS)
def path(request, kernel_mode):
    """(implementation, kernel mode): the Pallas kernels in this test's mode, and the XLA
    path once (on CPU only: on a GPU it is the same code as on CPU)."""
    if request.param == "xla" and kernel_mode == "gpu":
        pytest.skip("the XLA path is checked on CPU")
    return request.param, kernel_mode


# Interpret mode pays a compile per distinct static configuration (shapes, dtypes, bias
# and mask shapes, scale, causal), so the tests below share a few: config A is bf16 with a
# float32 bias [1, Hq, T, S], a mask [B, 1, T, S], causal with T > S (GQA 4/2); B is the
# same shapes without bias or mask; C is B without causality.
B_, T_, S_, HQ_, HKV_, D_ = 2, 40, 29, 4, 2, 24
SCALE_A = 0.3


def _inputs_a(seed, *, dtype="bfloat16"):
    q, k, v, d_out, d_lse = random_inputs(seed, b=B_, t=T_, s=S_, hq=HQ_, hkv=HKV_, d=D_, dv=D_,
                                          dtype=dtype)
    rng = np.random.default_rng(seed)
    mask = rng.random((B_, 1, T_, S_)) < 0.7
    bias = rng.standard_normal((1, HQ_, T_, S_)).astype(np.float32)
    return q, k, v, d_out, d_lse, mask, bias


# ----------------------------------------------------------------------------- masked rows


def test_fully_masked_rows_from_mask_bias_and_causal(path):
    """One call with three sources of empty rows: all-False mask rows, bias rows of -inf,
    and causality with T > S (the first T - S rows see no key). Out 0, lse -inf, dq 0 and
    dbias 0 on those rows, exactly; everything matches the float64 reference; no NaN even
    with a nonzero lse cotangent on the empty rows."""
    impl, mode = path
    q, k, v, d_out, d_lse, mask, bias = _inputs_a(1)
    mask[0, 0, 20, :] = False  # row 20 of batch 0, every head
    mask[1, 0, 33, :] = False
    bias[0, 3, 25, :] = -np.inf  # row 25 of head 3, both batches
    bias[0, 1, 30, ::2] = -np.inf  # a partly -inf row stays a normal row
    mask, bias = jnp.asarray(mask), jnp.asarray(bias)
    out, lse, (dq, dk, dv, dbias) = _check_path(impl, mode, q, k, v, bias, mask, d_out, d_lse,
                                                scale=SCALE_A, causal=True)

    empty = np.zeros((B_, HQ_, T_), bool)  # [B, Hq, T]
    empty[:, :, : T_ - S_] = True  # causal, T > S
    empty[0, :, 20] = True
    empty[1, :, 33] = True
    empty[:, 3, 25] = True
    out_bhtd = out.transpose(0, 2, 1, 3)
    dq_bhtd = dq.transpose(0, 2, 1, 3)
    assert np.all(out_bhtd[empty] == 0.0)
    assert np.all(lse[empty] == -np.inf)
    assert np.all(np.isfinite(lse[~empty]))
    assert np.all(dq_bhtd[empty] == 0.0)
    # dbias [1, Hq, T, S] is summed over the batch: a row is zero where it is empty in both.
    empty_both = empty.all(axis=0)
    assert np.all(dbias[0][empty_both] == 0.0)
    assert np.any(dbias[0][~empty_both] != 0.0)
    for g in (out, dq, dk, dv, dbias):
        assert not np.isnan(g).any()


def test_every_key_masked(path):
    """A mask with no True at all: out 0, lse -inf, and zero gradient into q, k, v and bias."""
    impl, mode = path
    q, k, v, d_out, d_lse, _, bias = _inputs_a(2)
    mask = jnp.zeros((B_, 1, T_, S_), bool)
    out, lse, grads = _check_path(impl, mode, q, k, v, jnp.asarray(bias), mask, d_out, d_lse,
                                  scale=SCALE_A, causal=True)
    assert np.all(out == 0.0) and np.all(lse == -np.inf)
    for g in grads:
        assert np.all(g == 0.0)


def test_causal_more_queries_than_keys(path):
    """Causal, no mask or bias, T > S: rows 0 .. T-S-1 are empty (bottom-right alignment)."""
    impl, mode = path
    q, k, v, d_out, d_lse, _, _ = _inputs_a(4)
    out, lse, (dq, dk, dv, _) = _check_path(impl, mode, q, k, v, None, None, d_out, d_lse,
                                            scale=None, causal=True)
    cut = T_ - S_
    assert np.all(out[:, :cut] == 0.0) and np.all(lse[:, :, :cut] == -np.inf)
    assert np.all(dq[:, :cut] == 0.0)
    assert np.any(out[:, cut:] != 0.0) and np.all(np.isfinite(lse[:, :, cut:]))


@pytest.mark.parametrize("scale", [-0.3, 0.0])
def test_negative_and_zero_scale(path, scale):
    """scale is any finite float. A negative one turns the row max into the min of the
    unscaled scores, and a zero one makes every visible logit 0, where -inf · 0 would be
    NaN: the kernels that fold the scale into the softmax (16-bit on the GPU) must not
    fold then. Causal with T > S gives empty rows and -inf scores."""
    impl, mode = path
    q, k, v, d_out, d_lse, _, _ = _inputs_a(5)
    out, lse, grads = _check_path(impl, mode, q, k, v, None, None, d_out, d_lse,
                                  scale=scale, causal=True)
    cut = T_ - S_
    assert np.all(out[:, :cut] == 0.0) and np.all(np.isfinite(lse[:, :, cut:]))
    for g in (out, *grads[:3]):
        assert not np.isnan(g).any()


# ----------------------------------------------------------------------------- large logits


@pytest.mark.parametrize("dtype,source", [("float16", "scale"), ("bfloat16", "scale"),
                                          ("float16", "bias-16bit"), ("bfloat16", "bias")])
def test_large_logits(path, dtype, source):
    """Logits of magnitude up to ~1e4 (from a large scale, or a large bias in float32 or in
    the inputs' dtype) with 16-bit inputs: finite, and within the tolerance rule of the
    float64 reference, forward and gradients."""
    impl, mode = path
    q, k, v, d_out, d_lse, mask, _ = _inputs_a(5, dtype=dtype)
    bias, scale, causal = None, None, False
    if source == "scale":
        raw = np.einsum("bthgd,bsgd->bhgts",
                        np.asarray(q, np.float64).reshape(B_, T_, HKV_, HQ_ // HKV_, D_),
                        np.asarray(k, np.float64))
        scale = float(1e4 / np.max(np.abs(raw)))  # the largest logit is exactly ±1e4
        mask = None
    elif source == "bias":  # config A's statics: float32 bias, a mask (all True), causal
        bias = jax.random.uniform(jax.random.key(6), (1, HQ_, T_, S_), jnp.float32, -1e4, 1e4)
        mask, scale, causal = jnp.ones((B_, 1, T_, S_), bool), SCALE_A, True
    else:
        bias = jax.random.uniform(jax.random.key(6), (HQ_, T_, S_), jnp.float32, -1e4, 1e4)
        bias, mask = bias.astype(dtype), None
    out, lse, grads = _check_path(impl, mode, q, k, v, bias, mask, d_out, d_lse, scale=scale,
                                  causal=causal)
    finite = np.isfinite(lse)
    assert np.max(np.abs(lse[finite])) > 5e3  # the logits really are that large
    for x in (out, *[g for g in grads if g is not None]):
        assert np.all(np.isfinite(x))


# ----------------------------------------------------------------------------- NaN / inf


def _assert_same_nonfinite(name, got, ref):
    got = np.asarray(np.asarray(got, np.float32), np.float64)
    ref = np.asarray(ref, np.float64)
    for what, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        np.testing.assert_array_equal(test(got), test(ref),
                                      err_msg=f"{name}: {what} positions differ from the reference")


# (operand, index of the non-finite entry, value). q [B,T,Hq,D], k [B,S,Hkv,D], v [B,S,Hkv,Dv].
NONFINITE = [
    ("q", (0, 3, 1, 5), np.nan),    # one query row of one head
    ("q", (1, 7, 2, 0), np.inf),    # +inf in q: ±inf logits in that row -> NaN row
    ("k", (0, 11, 0, 2), np.nan),   # one key: every row of the heads of its group
    ("k", (1, 4, 1, 9), -np.inf),   # -inf in k: logits ±inf in rows of its group
    ("v", (0, 13, 1, 3), np.nan),   # one value entry: that column of the group's heads
    ("v", (1, 2, 0, 7), np.inf),    # +inf in v: +inf in that column
    ("v", (0, 5, 0, 1), -np.inf),
]


@pytest.mark.parametrize("operand,index,value", NONFINITE,
                         ids=[f"{o}{i}={v}" for o, i, v in NONFINITE])
def test_nonfinite_inputs_propagate_like_the_reference(path, operand, index, value):
    """NaN/±inf in q, k or v (no mask, no causal).

    Forward: out and lse have NaN and ±inf exactly where the float64 reference has them,
    and their finite entries match it. Gradients: outside the (batch, KV head group) that
    holds the non-finite entry they match the reference as usual; inside it, dq is
    non-finite wherever the reference's is (dk/dv there are unspecified: see README)."""
    impl, mode = path
    q, k, v, d_out, d_lse, _, _ = _inputs_a(7)
    arrays = {"q": q, "k": k, "v": v}
    arrays[operand] = arrays[operand].at[index].set(value)
    q, k, v = arrays["q"], arrays["k"], arrays["v"]
    interpret = impl == "pallas" and interpret_flag(mode)
    kw = dict(scale=0.25, causal=False)
    got = run_attention(q, k, v, None, None, None, d_out, d_lse, impl=impl, interpret=interpret,
                        **kw)
    ref = run_reference(q, k, v, None, None, d_out, d_lse, float64=True, **kw)
    xla = run_reference(q, k, v, None, None, d_out, d_lse, float64=False, **kw)
    assert not np.isfinite(np.asarray(ref[0], np.float64)).all()  # the case is not vacuous

    # Forward: the exact non-finite pattern, and the finite entries within tolerance.
    for name, g, r, x in (("out", got[0], ref[0], xla[0]), ("lse", got[1], ref[1], xla[1])):
        _assert_same_nonfinite(name, g, r)
        finite = np.isfinite(np.asarray(r, np.float64))
        g32, x32 = np.asarray(g, np.float32)[finite], np.asarray(x, np.float32)[finite]
        r64 = np.asarray(r, np.float64)[finite]
        if name == "lse":
            assert_lse_matches(g32, r64, x32)
        else:
            assert_matches_reference(name, g32, r64, x32, q.dtype)

    # Gradients: the poisoned (batch, kv head) slice, and everything else.
    batch = index[0]
    kv_head = index[2] // (HQ_ // HKV_) if operand == "q" else index[2]
    q_heads = slice(kv_head * (HQ_ // HKV_), (kv_head + 1) * (HQ_ // HKV_))
    slices = {"dq": (batch, slice(None), q_heads), "dk": (batch, slice(None), kv_head),
              "dv": (batch, slice(None), kv_head)}
    for name, g, r, x in zip(("dq", "dk", "dv"), got[2], ref[2], xla[2]):
        g, r, x = np.asarray(g, np.float32), np.asarray(r, np.float64), np.asarray(x, np.float32)
        poisoned = np.zeros(g.shape, bool)
        poisoned[slices[name]] = True
        assert np.isfinite(r[~poisoned]).all()
        assert_matches_reference(f"{name} outside the poisoned group", g[~poisoned],
                                 r[~poisoned], x[~poisoned], q.dtype, factor=3.0)
        if name == "dq":
            nonfinite_ref = ~np.isfinite(r)
            assert (~np.isfinite(g[nonfinite_ref])).all(), "dq lost a NaN/inf of the reference"


def test_nan_key_hidden_by_causality_does_not_leak(path):
    """A NaN key that causality hides from a row leaves that row finite (and exact), as in
    the reference: masking happens on the logits, before the softmax."""
    impl, mode = path
    q, k, v, d_out, d_lse, _, _ = _inputs_a(8)
    j = 17  # seen by query rows i >= j + T - S
    k = k.at[1, j, 0, 3].set(np.nan)
    interpret = impl == "pallas" and interpret_flag(mode)
    kw = dict(scale=None, causal=True)
    out, lse, _ = run_attention(q, k, v, None, None, None, d_out, d_lse, impl=impl,
                                interpret=interpret, **kw)
    ref_out, ref_lse, _ = run_reference(q, k, v, None, None, d_out, d_lse, float64=True, **kw)
    xla_out, _, _ = run_reference(q, k, v, None, None, d_out, d_lse, float64=False, **kw)
    _assert_same_nonfinite("out", out, ref_out)
    _assert_same_nonfinite("lse", lse, ref_lse)
    out = np.asarray(out, np.float32)
    first = j + T_ - S_
    heads = slice(0, HQ_ // HKV_)  # the query heads of kv head 0
    assert np.isnan(out[1, first:, heads]).all()
    assert np.isfinite(out[1, :first]).all() and np.isfinite(out[0]).all()
    assert_matches_reference("rows before the NaN key", out[1, :first], ref_out[1, :first],
                             xla_out[1, :first], q.dtype)


# ----------------------------------------------------------------------------- bias dtypes


@pytest.mark.parametrize("dtype,bias_dtype", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_bias_dtype_differs_from_inputs(path, dtype, bias_dtype):
    """A bias of another float dtype than q/k/v: the forward and gradients match the
    reference, and the bias gradient comes back in the bias's own dtype and shape."""
    impl, mode = path
    q, k, v, d_out, d_lse, mask, bias = _inputs_a(9, dtype=dtype)
    bias = jnp.asarray(2.0 * bias, bias_dtype)
    _, _, grads = _check_path(impl, mode, q, k, v, bias, jnp.asarray(mask), d_out, d_lse,
                              scale=SCALE_A, causal=True)
    assert grads[3].shape == bias.shape
