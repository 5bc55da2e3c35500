"""`jax.vmap` over extra leading dims of `ffpa_jax.attention` equals a Python loop.

Covers what the partitioning wrapper (a `custom_vmap` around `custom_partitioning`)
has to get right: some arguments batched and others not (bias batched, mask
shared), non-leading `in_axes`, nested vmap, gradients under vmap, and dropout
(one key shared by every element, or one key per element).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import interpret_flag, skip_unless_sm90

import ffpa_jax
import tuning
from ffpa_jax import partitioning, validation
from pallas_kernels import Inputs, tiers
from pallas_kernels.plan import row_outputs

N = 3  # the vmapped axis


def rand(key, shape, dtype=jnp.float32):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def inputs(seed=0, *, b=1, t=16, s=24, hq=4, hkv=2, d=16, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = rand(ks[0], (N, b, t, hq, d), dtype)
    k = rand(ks[1], (N, b, s, hkv, d), dtype)
    v = rand(ks[2], (N, b, s, hkv, d), dtype)
    bias = rand(ks[3], (N, 1, hq, t, s))                  # batched with q
    mask = jax.random.bernoulli(ks[4], 0.8, (b, 1, t, s))  # shared by every element
    return q, k, v, bias, mask


def assert_same(a, b, exact: bool):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if exact:
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)


def test_vmap_forward_and_grad_with_batched_bias_and_shared_mask(kernel_mode):
    q, k, v, bias, mask = inputs()
    kw = dict(implementation="pallas", interpret=interpret_flag(kernel_mode), is_causal=True)

    def loss(q, k, v, bias):
        out, lse = ffpa_jax.attention(q, k, v, bias, mask, return_lse=True, **kw)
        return jnp.sum(out * jnp.sin(out)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), out

    step = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)))
    (_, out), grads = step(q, k, v, bias)
    one = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))
    for i in range(N):
        (_, out_i), grads_i = one(q[i], k[i], v[i], bias[i])
        assert_same(out[i], out_i, exact=True)
        for g, g_i in zip(grads, grads_i, strict=True):
            assert_same(g[i], g_i, exact=True)


def test_vmap_in_axes_nested_and_xla_path(kernel_mode):
    """q vmapped over its dim 1, k/v over dim 0; then a second vmap level; both paths."""
    q, k, v, _, _ = inputs(1, dtype=jnp.bfloat16)
    q_t = jnp.swapaxes(q, 0, 1)  # [b, N, t, hq, d]
    for impl in ("pallas", "xla"):
        fn = functools.partial(ffpa_jax.attention, implementation=impl,
                               interpret=impl == "pallas" and interpret_flag(kernel_mode))
        got = jax.vmap(fn, in_axes=(1, 0, 0))(q_t, k, v)
        fn_jit = jax.jit(fn)
        loop = jnp.stack([fn_jit(q[i], k[i], v[i]) for i in range(N)])
        assert_same(got, loop, exact=impl == "pallas")
    # Two vmapped levels: [2, N, ...] over a 3-D (unbatched) call.
    q2 = jnp.stack([q[:, 0], q[:, 0] * 0.5])     # [2, N, t, hq, d]
    fn3 = lambda q, k, v: ffpa_jax.attention(
        q, k, v, is_causal=True, implementation="pallas", interpret=interpret_flag(kernel_mode))
    got = jax.vmap(jax.vmap(fn3, in_axes=(0, 0, 0)), in_axes=(0, None, None))(
        q2, k[:, 0], v[:, 0])
    fn3_jit = jax.jit(fn3)
    for j in range(2):
        for i in range(N):
            assert_same(got[j, i], fn3_jit(q2[j, i], k[i, 0], v[i, 0]), exact=True)


def test_vmap_dropout_shared_key_and_per_element_keys(kernel_mode):
    q, k, v, _, _ = inputs(2, t=16, s=16)
    kw = dict(implementation="pallas", interpret=interpret_flag(kernel_mode), dropout_rate=0.3)
    fn = lambda q, k, v, rng: ffpa_jax.attention(q, k, v, dropout_rng=rng, **kw)
    key = jax.random.key(5)
    shared = jax.vmap(fn, in_axes=(0, 0, 0, None))(q, k, v, key)
    keys = jax.random.split(key, N)
    per_element = jax.vmap(fn)(q, k, v, keys)
    fn = jax.jit(fn)
    for i in range(N):
        assert_same(shared[i], fn(q[i], k[i], v[i], key), exact=True)
        assert_same(per_element[i], fn(q[i], k[i], v[i], keys[i]), exact=True)
    # Different keys give different masks (so the comparison above means something).
    assert np.max(np.abs(np.asarray(shared[1]) - np.asarray(per_element[1]))) > 1e-2


def test_vmap_of_the_partitioning_wrapper_directly(kernel_mode):
    """The shard-local wrapper around a plan's forward, vmapped, equals the plain kernels
    looped (independent of whether ffpa_jax.vjp already routes through it)."""
    q, k, v, bias, mask = inputs(3)
    problem = validation.validate(q[0], k[0], v[0], bias[0], mask, scale=None, is_causal=False,
                                  dropout_rate=0.0, dropout_rng=None, return_lse=False,
                                  implementation="pallas",
                                  interpret=interpret_flag(kernel_mode)).problem
    plan = tuning.plan(problem, "pallas", interpret=interpret_flag(kernel_mode))
    wrapped = partitioning.ShardLocal(tiers.forward, "forward", row_outputs=row_outputs)
    # float32 inputs: the forward returns lse with its rounding error, (out, lse, lo).
    outputs = jax.vmap(lambda q, k, v, b: wrapped(plan, Inputs(q, k, v, b, mask)))(q, k, v, bias)
    assert len(outputs) == 3
    for i in range(N):
        expected = tiers.forward(plan, Inputs(q[i], k[i], v[i], bias[i], mask))
        for got, want in zip(outputs, expected, strict=True):
            assert_same(got[i], want, exact=True)


def _mosaic_grads(plan, q, k, v, d_out):
    """dq, dk, dv of the plan's directions through the shard-local wrappers (what
    ffpa_jax.vjp runs), for one element."""
    from pallas_kernels.problem import Cotangents, Saved
    forward = partitioning.ShardLocal(tiers.forward, "forward", row_outputs=row_outputs)
    backward = partitioning.ShardLocal(tiers.backward, "backward")
    float32_out = dataclasses.replace(plan, float32_out=True)
    out, lse = forward(float32_out, Inputs(q, k, v))
    d_lse = jnp.zeros_like(lse)
    return backward(float32_out, Inputs(q, k, v), Saved(out, lse),
                    Cotangents(d_out, d_lse))[:3]


def test_vmap_folds_the_mapped_axis_into_the_batch_for_the_mosaic_tier():
    """`pl.kernel` (the Mosaic backward's launch) has no batching rule; with every array per
    batch row the wrapper folds the mapped axis into the batch instead, so a vmapped call on
    the Mosaic tier lowers (for CUDA, here on the CPU) as one launch."""
    from tuning import dispatch
    sd = jax.ShapeDtypeStruct
    one = sd((2, 200, 4, 64), jnp.bfloat16), sd((2, 200, 2, 64), jnp.bfloat16)
    problem = validation.validate(one[0], one[1], one[1], None, None, scale=None,
                                  is_causal=True, dropout_rate=0.0, dropout_rng=None,
                                  return_lse=False, implementation=None,
                                  interpret=False).problem
    plan = dispatch.plan_for_tiers(problem, "mosaic", "mosaic")
    q, kv = sd((N,) + one[0].shape, jnp.bfloat16), sd((N,) + one[1].shape, jnp.bfloat16)
    d_out = sd((N,) + one[0].shape, jnp.float32)
    fn = jax.vmap(functools.partial(_mosaic_grads, plan))
    lowered = jax.jit(fn).trace(q, kv, kv, d_out).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("mosaic_gpu") >= 2  # the forward's and the backward's


@pytest.mark.gpu
def test_vmap_on_the_mosaic_tier_equals_a_loop_gpu():
    """The folded call on the real kernels: forward and gradients of each element equal the
    element alone. The forward and dV bitwise (the same kernels over the same tiles); dK
    and dQ within a few ulps of the gradient's magnitude: both go through δ = rowsum(dO·O),
    an XLA reduction whose order XLA may choose per shape (the folded batch is N times
    larger), and dQ's reduce-adds may also add in another order."""
    skip_unless_sm90()
    q, k, v, _, _ = inputs(5, b=2, t=300, s=300, hq=4, hkv=2, d=64, dtype=jnp.bfloat16)
    fn = functools.partial(ffpa_jax.attention, is_causal=True, implementation="mosaic")

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * jnp.cos(jnp.arange(64.0)))
    value_and_grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    out = jax.jit(jax.vmap(fn))(q, k, v)
    grads = jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1, 2))))(q, k, v)
    for i in range(N):
        assert_same(out[i], jax.jit(fn)(q[i], k[i], v[i]), exact=True)
        _, alone = value_and_grads(q[i], k[i], v[i])
        assert_same(grads[2][i], alone[2], exact=True)
        for g, g_alone in ((grads[0][i], alone[0]), (grads[1][i], alone[1])):
            scale = float(jnp.abs(g_alone.astype(jnp.float32)).max())
            np.testing.assert_allclose(np.asarray(g, np.float32),
                                       np.asarray(g_alone, np.float32), rtol=0,
                                       atol=4 * scale * float(jnp.finfo(jnp.bfloat16).eps))
