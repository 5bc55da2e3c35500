"""`ffpa_jax.flax_attention_fn` as the attention of Flax's modules.

Flax linen and nnx attention modules with our `attention_fn` are compared with the
same modules (same parameters, same inputs) using Flax's own attention: both are
measured against the float64 run of Flax's attention, and ours must be within the
tolerance rule (attn_testing.py) of it, for outputs and gradients. Dropout (with
broadcast_dropout's shared mask or one per batch row and head), sown weights, extra batch
dims and rectangular causal masks are checked against plain-JAX constructions.
"""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from attn_testing import assert_matches_reference
from conftest import interpret_flag
from flax import linen as nn
from flax import nnx

import ffpa_jax
from ffpa_jax.flax_attention import flax_attention_fn
from ffpa_jax.reference import mha_reference


@pytest.fixture(autouse=True)
def _full_precision_matmuls():
    """Flax's dense layers and einsums at full float32 precision: on GPUs the default (TF32)
    error of the surrounding model would swamp the comparison of the attention."""
    with jax.default_matmul_precision("highest"):
        yield


def ours(kernel_mode, **kw):
    """Our attention_fn on the Pallas kernels (interpreted on CPU)."""
    return functools.partial(flax_attention_fn, implementation="pallas",
                             interpret=interpret_flag(kernel_mode), **kw)


def ours_mapping(kernel_mode, **kw):
    """For tests of the argument mapping: the Pallas kernels on a GPU; on CPU the XLA path,
    whose semantics are the kernels' (tested elsewhere), to keep the CPU suite short."""
    if interpret_flag(kernel_mode):
        return functools.partial(flax_attention_fn, implementation="xla", **kw)
    return ours(kernel_mode, **kw)


def to64(tree):
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x, np.float64)), tree)


def check_tree(name, got, ref64, flax_same_precision, dtype, factor):
    for (path, g), r, x in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref64),
                               jax.tree.leaves(flax_same_precision), strict=True):
        assert_matches_reference(f"{name}{jax.tree_util.keystr(path)}", g, r, x, dtype,
                                 factor=factor)


def padding_mask(key, batch, length):
    """Flax-style float padding mask [B, 1, T, T]: every row keeps at least one key."""
    lengths = jax.random.randint(key, (batch,), 2, length + 1)
    valid = jnp.arange(length)[None, :] < lengths[:, None]
    return nn.make_attention_mask(jnp.ones((batch, length)), valid)  # float32 0/1


# --------------------------------------------------------------------------- linen
@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.gpu)])
def test_linen_mha_matches_flax_attention(kernel_mode, dtype):
    kx, kc, km, kp = jax.random.split(jax.random.key(11), 4)
    x = jax.random.normal(kx, (2, 13, 24))
    ct = jax.random.normal(kc, (2, 13, 24))
    mask = padding_mask(km, 2, 13)

    def build(attention_fn, dt, param_dt=jnp.float32):
        return nn.MultiHeadDotProductAttention(num_heads=3, qkv_features=48, dtype=dt,
                                               param_dtype=param_dt, attention_fn=attention_fn)

    params = build(nn.dot_product_attention, jnp.float32).init(kp, x)

    def run(module, params, x, mask):
        def loss(params, x):
            out = module.apply(params, x, mask=mask)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(out.dtype)), out
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            params, x)
        return out, grads

    got, got_g = run(build(ours(kernel_mode), jnp.dtype(dtype)), params, x, mask)
    flx, flx_g = run(build(nn.dot_product_attention, jnp.dtype(dtype)), params, x, mask)
    with jax.enable_x64(True):
        ref, ref_g = run(build(nn.dot_product_attention, jnp.float64, jnp.float64),
                         to64(params), to64(x), to64(mask))
        ref, ref_g = np.asarray(ref), jax.tree.map(np.asarray, ref_g)
    assert got.dtype == jnp.dtype(dtype) and got.shape == (2, 13, 24)
    assert_matches_reference("out", got, ref, flx, dtype)
    check_tree("grad", got_g, ref_g, flx_g, dtype, factor=3.0)


def test_flax_attention_fn_bias_mask_and_two_batch_dims(kernel_mode):
    """Direct call as Flax calls it: two batch dims, a partly broadcast bias, a float mask."""
    ks = jax.random.split(jax.random.key(5), 6)
    q = jax.random.normal(ks[0], (2, 3, 11, 2, 16))
    k = jax.random.normal(ks[1], (2, 3, 17, 2, 16))
    v = jax.random.normal(ks[2], (2, 3, 17, 2, 8))
    bias = jax.random.normal(ks[3], (3, 1, 11, 17))           # broadcast over the first batch dim
    mask = (jax.random.uniform(ks[4], (2, 1, 1, 1, 17)) < 0.7).astype(jnp.float32)
    mask = mask.at[..., 0].set(1.0)                         # every row keeps a key

    def loss(fn, q, k, v, bias):
        out = fn(q, k, v, bias, mask)
        return jnp.sum(out * jnp.cos(out)), out

    grad = jax.jit(jax.value_and_grad(loss, argnums=(1, 2, 3, 4), has_aux=True), static_argnums=0)
    (_, got), got_g = grad(ours_mapping(kernel_mode), q, k, v, bias)
    (_, flx), flx_g = grad(nn.dot_product_attention, q, k, v, bias)
    with jax.enable_x64(True):
        (_, ref), ref_g = grad(nn.dot_product_attention, *to64((q, k, v, bias)))
        ref, ref_g = np.asarray(ref), jax.tree.map(np.asarray, ref_g)
    assert got.shape == (2, 3, 11, 2, 8)
    assert_matches_reference("out", got, ref, flx, "float32")
    check_tree("grad", got_g, ref_g, flx_g, "float32", factor=3.0)

    # Without batch dims ([T, H, D]) the call goes straight through.
    one = ours_mapping(kernel_mode)(q[0, 0], k[0, 0], v[0, 0], bias[0], mask[0, 0])
    np.testing.assert_allclose(np.asarray(one), np.asarray(got[0, 0]), rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- nnx
def _nnx_mha(attention_fn, dtype, param_dtype=jnp.float32):
    return nnx.MultiHeadAttention(num_heads=4, in_features=20, qkv_features=32, num_kv_heads=2,
                                  dtype=dtype, param_dtype=param_dtype, decode=False,
                                  keep_rngs=False, attention_fn=attention_fn, rngs=nnx.Rngs(3))


@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.gpu), "bfloat16"])
def test_nnx_mha_gqa_causal_matches_flax_attention(kernel_mode, dtype):
    kx, kc, km = jax.random.split(jax.random.key(21), 3)
    x = jax.random.normal(kx, (2, 12, 20))
    ct = jax.random.normal(kc, (2, 12, 20))
    mask = padding_mask(km, 2, 12).astype(bool)
    mask = mask.at[..., 0].set(True)  # with causality, key 0 keeps every row alive
    _, params = nnx.split(_nnx_mha(nnx.dot_product_attention, jnp.float32))

    def run(attention_fn, dt, params, x, mask, param_dt=jnp.float32):
        graphdef, _ = nnx.split(_nnx_mha(attention_fn, dt, param_dt))

        def loss(params, x):
            out = nnx.merge(graphdef, params)(x, mask=mask, is_causal=True)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(out.dtype)), out
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            params, x)
        return out, grads

    got, got_g = run(ours(kernel_mode), jnp.dtype(dtype), params, x, mask)
    flx, flx_g = run(nnx.dot_product_attention, jnp.dtype(dtype), params, x, mask)
    with jax.enable_x64(True):
        ref, ref_g = run(nnx.dot_product_attention, jnp.float64, to64(params), to64(x), mask,
                         jnp.float64)
        ref, ref_g = np.asarray(ref), jax.tree.map(np.asarray, ref_g)
    assert_matches_reference("out", got, ref, flx, dtype)
    check_tree("grad", got_g, ref_g, flx_g, dtype, factor=3.0)


def test_rectangular_causal_keeps_flax_top_left_alignment(kernel_mode):
    """nnx passes is_causal; with T != S Flax's mask is tril(ones(T, S)) (top-left)."""
    ks = jax.random.split(jax.random.key(8), 3)
    q = jax.random.normal(ks[0], (2, 9, 2, 16))
    k = jax.random.normal(ks[1], (2, 14, 2, 16))
    v = jax.random.normal(ks[2], (2, 14, 2, 16))
    got = jax.jit(ours_mapping(kernel_mode, is_causal=True))(q, k, v)
    flax_causal = jax.jit(lambda q, k, v: nnx.dot_product_attention(q, k, v, is_causal=True))
    with jax.enable_x64(True):
        ref = np.asarray(flax_causal(*to64((q, k, v))))
    flx = flax_causal(q, k, v)
    assert_matches_reference("out", got, ref, flx, "float32")
    # ffpa_jax's own (bottom-right) convention differs here, so the test can tell them apart.
    bottom_right = ffpa_jax.attention(q, k, v, is_causal=True, implementation="xla")
    assert np.max(np.abs(np.asarray(bottom_right) - ref)) > 1e-2


# ------------------------------------------------------------------ sown weights
def test_sow_weights_linen_and_nnx(kernel_mode):
    kx, km = jax.random.split(jax.random.key(4))
    x = jax.random.normal(kx, (2, 10, 16))
    mask = padding_mask(km, 2, 10)
    mods = [nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=fn)
            for fn in (nn.dot_product_attention, ours_mapping(kernel_mode))]
    params = mods[0].init(jax.random.key(0), x)
    sow = lambda m: jax.jit(lambda p, x: m.apply(
        p, x, mask=mask, sow_weights=True, mutable=["intermediates"])[1])
    sown = [sow(m)(params, x)["intermediates"]["attention_weights"][0] for m in mods]
    assert sown[1].shape == (2, 2, 10, 10)
    np.testing.assert_allclose(np.asarray(sown[1]), np.asarray(sown[0]), rtol=1e-5, atol=1e-6)

    m = _nnx_mha(ours_mapping(kernel_mode), jnp.float32)
    x = jax.random.normal(kx, (2, 10, 20))
    _, captured = nnx.capture(m, nnx.Intermediate)(x, is_causal=True, sow_weights=True)
    weights = captured["attention_weights"][0]
    assert weights.shape == (2, 4, 10, 10)
    np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-5)
    assert float(jnp.max(jnp.triu(weights, k=1))) == 0.0  # causal


@pytest.mark.parametrize("force_fp32", [True, False])
def test_sown_weights_dtype_follows_force_fp32_for_softmax(kernel_mode, force_fp32):
    """bf16 modules: Flax sows float32 weights with force_fp32_for_softmax=True, bf16 without;
    ours must sow the same dtype and values."""
    kx, km = jax.random.split(jax.random.key(5))
    x = jax.random.normal(kx, (2, 12, 16))
    mask = padding_mask(km, 2, 12)
    kw = dict(num_heads=2, dtype=jnp.bfloat16, force_fp32_for_softmax=force_fp32)
    mods = [nn.MultiHeadDotProductAttention(attention_fn=fn, **kw)
            for fn in (nn.dot_product_attention, ours_mapping(kernel_mode))]
    params = mods[0].init(jax.random.key(0), x)
    sown = [m.apply(params, x, mask=mask, sow_weights=True, mutable=["intermediates"])[1]
            ["intermediates"]["attention_weights"][0] for m in mods]
    assert sown[0].dtype == (jnp.float32 if force_fp32 else jnp.bfloat16)  # Flax's rule
    assert sown[1].dtype == sown[0].dtype and sown[1].shape == sown[0].shape == (2, 2, 12, 12)
    # Flax rounds its logits to bf16 before the softmax (2^-9 of each, on logits of a few
    # units here), ours stay float32: each weight within a few percent of Flax's, relative
    # (2.4% measured on the CPU), small weights included.
    np.testing.assert_allclose(np.asarray(sown[1], np.float32),
                               np.asarray(sown[0], np.float32), rtol=4e-2, atol=0)


# ------------------------------------------------------------------------ dropout
def _dropout_reference(query, key, value, bias=None, mask=None, *, dropout_rng, dropout_rate,
                       broadcast_dropout, deterministic, **_):
    """The plain-JAX reference (`mha_reference`) with ffpa_jax's keep-mask for the same key:
    what the adapter must compute. With `broadcast_dropout` the one mask shared by batch and
    heads (Flax's meaning), built here by broadcasting `dropout_mask(broadcast=True)`."""
    b, t, h, d = query.shape
    keep, rate = None, 0.0
    if not deterministic and dropout_rate > 0:
        shape = (b, h, t, key.shape[1])
        keep = jnp.broadcast_to(ffpa_jax.dropout_mask(dropout_rng, shape, dropout_rate,
                                                      broadcast=bool(broadcast_dropout)), shape)
        rate = dropout_rate
    if mask is not None:
        mask = mask.astype(bool)
    return mha_reference(query, key, value, bias, mask, scale=1 / np.sqrt(d), keep_mask=keep,
                         dropout_rate=rate)[0]


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast", "per-head"])
def test_linen_dropout_passes_rng_rate_and_broadcast(kernel_mode, broadcast):
    """Flax's default broadcast_dropout=True shares one mask over batch and heads."""
    kx, km = jax.random.split(jax.random.key(9))
    x = jax.random.normal(kx, (2, 16, 16))
    mask = padding_mask(km, 2, 16)
    kw = dict(num_heads=2, dropout_rate=0.25, broadcast_dropout=broadcast)
    mod = nn.MultiHeadDotProductAttention(attention_fn=ours_mapping(kernel_mode), **kw)
    ref_mod = nn.MultiHeadDotProductAttention(attention_fn=_dropout_reference, **kw)
    params = mod.init(jax.random.key(0), x, deterministic=True)
    rngs = {"dropout": jax.random.key(123)}
    got = mod.apply(params, x, mask=mask, deterministic=False, rngs=rngs)
    ref = ref_mod.apply(params, x, mask=mask, deterministic=False, rngs=rngs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-5)
    # The other mode draws other masks: the flag reached the call.
    other = nn.MultiHeadDotProductAttention(
        attention_fn=ours_mapping(kernel_mode), **dict(kw, broadcast_dropout=not broadcast))
    assert np.max(np.abs(np.asarray(other.apply(params, x, mask=mask, deterministic=False,
                                                rngs=rngs)) - np.asarray(got))) > 1e-2
    # Deterministic: no dropout at all, so it differs from the dropped run.
    det = mod.apply(params, x, mask=mask, deterministic=True)
    det_ref = nn.MultiHeadDotProductAttention(**kw).apply(params, x, mask=mask,
                                                          deterministic=True)
    np.testing.assert_allclose(np.asarray(det), np.asarray(det_ref), rtol=1e-4, atol=1e-5)
    assert np.max(np.abs(np.asarray(det) - np.asarray(got))) > 1e-2


def test_nnx_default_broadcast_dropout_shares_one_mask(kernel_mode):
    """nnx.MultiHeadAttention (GQA 4/2) with dropout and its default broadcast_dropout=True:
    the output and the gradients are the reference's with the shared mask."""
    kx, km = jax.random.split(jax.random.key(12))
    x = jax.random.normal(kx, (2, 12, 20))
    mask = padding_mask(km, 2, 12).astype(bool)

    def build(attention_fn):
        return nnx.MultiHeadAttention(num_heads=4, in_features=20, qkv_features=32,
                                      num_kv_heads=2, dropout_rate=0.3, decode=False,
                                      keep_rngs=False, attention_fn=attention_fn,
                                      rngs=nnx.Rngs(3))

    def run(attention_fn):
        module = build(attention_fn)
        assert module.broadcast_dropout  # Flax's default
        graphdef, params = nnx.split(module)

        def loss(params, x):
            out = nnx.merge(graphdef, params)(x, mask=mask, deterministic=False,
                                              rngs=nnx.Rngs(77))
            return jnp.sum(out * jnp.cos(out)), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    (_, got), got_g = run(ours_mapping(kernel_mode))
    (_, ref), ref_g = run(_dropout_reference)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-4, atol=1e-5)
    for g, r in zip(jax.tree.leaves(got_g), jax.tree.leaves(ref_g), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_broadcast_dropout_without_dropout_changes_nothing():
    q = jax.random.normal(jax.random.key(0), (1, 8, 2, 16))
    fn = functools.partial(flax_attention_fn, implementation="xla")
    with pytest.raises(ValueError, match="dropout_rng"):
        fn(q, q, q, dropout_rate=0.1, broadcast_dropout=True)
    plain = ffpa_jax.attention(q, q, q, implementation="xla")
    for kw in (dict(dropout_rate=0.1, deterministic=True), dict(dropout_rate=0.0)):
        np.testing.assert_array_equal(np.asarray(fn(q, q, q, broadcast_dropout=True, **kw)),
                                      np.asarray(plain))


@pytest.mark.parametrize("bad, match", [
    (dict(key=(1, 8, 2, 12)), "key head dim 12 does not match query head dim 16"),
    (dict(value=(1, 7, 2, 16)), "key and value must agree"),
    (dict(key=(1, 8, 3, 16), value=(1, 8, 3, 16)), "multiple of key/value heads Hkv=3"),
    (dict(mask=(3, 8, 8)), "mask with shape"),
    (dict(bias=(1, 2, 8, 5)), "bias with shape"),
    (dict(query=(8, 2, 16, 1, 1)), "key must have the same batch dims as query"),
])
def test_shape_errors_come_before_the_dropout_mode_error(bad, match):
    """A call with wrong shapes is told about its shapes, not about its dropout settings
    (which Flax's modules pass on every call)."""
    shapes = {"query": (1, 8, 2, 16), "key": (1, 8, 2, 16), "value": (1, 8, 2, 16),
              "bias": None, "mask": None, **bad}
    keys = iter(jax.random.split(jax.random.key(0), 5))
    args = {name: None if shape is None else jax.random.normal(next(keys), shape)
            for name, shape in shapes.items()}
    if args["mask"] is not None:
        args["mask"] = args["mask"] > 0
    fn = functools.partial(flax_attention_fn, implementation="xla")
    good = {name: jax.random.normal(jax.random.key(2), (1, 8, 2, 16))
            for name in ("query", "key", "value")}
    for dropout, its_error in [(dict(dropout_rate=0.1, broadcast_dropout=True),
                                "needs dropout_rng"),
                               (dict(dropout_rate=0.1, broadcast_dropout=False),
                                "needs dropout_rng")]:
        with pytest.raises(ValueError, match=match):
            fn(**args, **dropout)
        # right shapes get the dropout mode's error
        with pytest.raises(ValueError, match=its_error):
            fn(**good, **dropout)
    with pytest.raises(ValueError, match=match):  # and wrong shapes fail alike without dropout
        fn(**args)


def test_custom_einsums_are_rejected():
    x = jax.random.normal(jax.random.key(0), (1, 6, 8))
    mod = nn.MultiHeadDotProductAttention(
        num_heads=2, attention_fn=functools.partial(flax_attention_fn, implementation="xla"),
        qk_attn_weights_einsum_cls=lambda: jnp.einsum,
        attn_weights_value_einsum_cls=lambda: jnp.einsum)
    with pytest.raises(ValueError, match="qk_attn_weights_einsum"):
        mod.init(jax.random.key(0), x)


def test_importing_ffpa_jax_does_not_import_flax():
    code = ("import sys, ffpa_jax, jax.numpy as jnp\n"
            "from ffpa_jax.flax_attention import flax_attention_fn\n"
            "q = jnp.ones((4, 2, 8))\n"
            "flax_attention_fn(q, q, q, implementation='xla')\n"
            "assert 'flax' not in sys.modules, 'flax was imported'\n")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=root, env=env)


# ------------------------------------------------------------ LLM features (issue 24)
def test_features_pass_through_with_two_batch_dims_and_sown_weights():
    """The window, soft cap, sinks, segment ids and lengths ride along (functools.partial
    for the static ones): two batch dims are flattened with the ids and lengths, and the
    result is ffpa_jax.attention's on the flattened call; linen sows weights that include
    them (their rows sum to 1 minus the sink's share)."""
    ks = jax.random.split(jax.random.key(8), 6)
    q = jax.random.normal(ks[0], (2, 3, 11, 2, 16))
    k = jax.random.normal(ks[1], (2, 3, 17, 2, 16))
    v = jax.random.normal(ks[2], (2, 3, 17, 2, 8))
    q_ids = jnp.sort(jax.random.randint(ks[3], (2, 3, 11), 0, 2), axis=-1)
    kv_ids = jnp.sort(jax.random.randint(ks[4], (2, 3, 17), 0, 2), axis=-1)
    kv_len = jnp.asarray([[17, 12, 9], [5, 17, 17]], jnp.int32)
    sinks = jax.random.normal(ks[5], (2,))
    static = dict(local_window_size=(6, 2), logits_soft_cap=2.0, implementation="xla")
    fn = functools.partial(flax_attention_fn, sinks=sinks, **static)
    got = fn(q, k, v, q_segment_ids=q_ids, kv_segment_ids=kv_ids, key_value_seq_lengths=kv_len)
    flat = lambda x: x.reshape((6,) + x.shape[2:])
    want = ffpa_jax.attention(flat(q), flat(k), flat(v), q_segment_ids=flat(q_ids),
                              kv_segment_ids=flat(kv_ids), key_value_seq_lengths=flat(kv_len),
                              sinks=sinks, **static)
    np.testing.assert_allclose(np.asarray(got).reshape(want.shape), np.asarray(want),
                               rtol=1e-6, atol=1e-6)

    x = jax.random.normal(ks[0], (2, 10, 16))
    ids = jnp.asarray([[0] * 4 + [1] * 6, [0] * 10], jnp.int32)
    module_fn = functools.partial(flax_attention_fn, q_segment_ids=ids, kv_segment_ids=ids,
                                  sinks=sinks, **static)
    mod = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=module_fn)
    params = mod.init(jax.random.key(0), x)
    out, state = mod.apply(params, x, sow_weights=True, mutable=["intermediates"])
    weights = state["intermediates"]["attention_weights"][0]
    assert weights.shape == (2, 2, 10, 10)
    assert float(weights[0, :, :4, 4:].max()) == 0.0  # segment 0 does not see segment 1
    assert np.all(np.asarray(weights.sum(-1)) < 1.0)  # the sink takes a share


def test_deterministic_backward_reaches_attention(monkeypatch):
    """The adapter's `deterministic_backward` is attention()'s `deterministic` (Flax's own
    `deterministic` keeps its meaning, no dropout): a bad value is attention()'s error, and
    the dispatcher sees True where XLA_FLAGS would say False."""
    from tuning import dispatch
    x = jnp.ones((1, 8, 2, 16), jnp.float32)
    with pytest.raises(TypeError, match="deterministic must be None, True or False"):
        flax_attention_fn(x, x, x, deterministic_backward="yes")
    monkeypatch.setenv("XLA_FLAGS", "")
    seen = []
    real = dispatch.explain

    def spy(*args, **kwargs):
        seen.append(kwargs.get("deterministic"))
        return real(*args, **kwargs)
    monkeypatch.setattr(dispatch, "explain", spy)
    flax_attention_fn(x, x, x, deterministic=True, deterministic_backward=True)
    assert seen == [True]
