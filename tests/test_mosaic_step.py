"""The chunked backward's Mosaic GPU step (`pallas_kernels.mosaic.grad_step`): which calls
take it (lowered for CUDA on a CPU, the GPU pretended), and on an sm90 GPU its P and dS
against the Triton step's on one block and its gradients end to end against float64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from attn_testing import (Case, assert_forward_matches, assert_matches_reference, cotangents,
                          make_features, make_inputs, reference_vjp)
from conftest import skip_unless_sm90
from pallas_kernels import blocked, chunked_plan, compat
from pallas_kernels.blocked import GradBlock, LogitOperands
from pallas_kernels.mosaic import grad_step
from pallas_kernels.problem import Inputs, Problem
from tuning import dispatch

sd = jax.ShapeDtypeStruct
MOSAIC_CALL = "mosaic_gpu"  # the Mosaic GPU kernels' custom call target, in lowered text


def _lowered_grads(n: int, d: int, monkeypatch, *, lse_grad: bool = False,
                   budget_mib: int = 64, **kw) -> str:
    """The lowered text (CUDA) of the chunked tier's q/k/v gradients at [1, n, 8, d] bf16
    on a pretended sm90 GPU in blocks of a `budget_mib` budget, `kw` to `attention`."""
    monkeypatch.setenv(chunked_plan.BUDGET_ENV, str(budget_mib))
    monkeypatch.setattr(dispatch.Device, "current", classmethod(
        lambda cls: cls(nvidia_gpu=True, name="Lowering H100", compute_capability="9.0")))
    monkeypatch.setattr(compat, "mosaic_gpu_runs", lambda: True)
    arg = sd((1, n, 8, d), jnp.bfloat16)

    def grads(q, k, v):
        def loss(q, k, v):
            out = ffpa_jax.attention(q, k, v, implementation="chunked", return_lse=lse_grad,
                                     **kw)
            return (out[0].sum() + out[1].sum()) if lse_grad else out.astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return jax.jit(grads).trace(arg, arg, arg).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(("d", "kw", "mosaic"), [
    (512, dict(is_causal=True, logits_soft_cap=30.0), True),
    (128, dict(local_window_size=(700, 0)), True),
    pytest.param(512, dict(lse_grad=True), False, marks=pytest.mark.slow),
    (320, dict(dropout_rate=0.1, dropout_rng=jax.random.key(0)), False),
    pytest.param(40, {}, False, marks=pytest.mark.slow)], ids=lambda x: str(x)[:40])
def test_backward_blocks_take_the_mosaic_step_where_it_serves_them(d, kw, mosaic, monkeypatch):
    """A 16-bit backward whose blocks hold part of their rows' keys runs the Mosaic step on an
    sm90 GPU (causal, soft cap, window); with dropout, an lse gradient (dS's low word) or a
    head dim that is no multiple of 64, the Triton step computes the logits instead."""
    text = _lowered_grads(4096, d, monkeypatch, **kw)
    assert (MOSAIC_CALL in text) == mosaic
    if not mosaic:  # (with it, a block that is no whole tiles of the step may take Triton's)
        assert "softmax_grad_of_operands" in text


def test_a_calls_blocks_share_one_lowered_step(monkeypatch):
    """The blocks of one call (unrolled where dK and dV accumulate per key block: here two
    key blocks, whose float32 parts fit the 1 GiB budget) call one lowered Mosaic step, not
    a kernel each: lowering each again cost compile time."""
    import re
    text = _lowered_grads(4096, 512, monkeypatch, budget_mib=1024)
    calls = re.findall(r"call @logits_grad_step\b", text)
    assert len(calls) > 1 and text.count(f"custom_call @{MOSAIC_CALL}") == 1, len(calls)


def test_the_mosaic_step_names_what_it_does_not_serve():
    q = sd((1, 256, 4, 96), jnp.bfloat16)
    plain = Problem.of(q, q, q, causal=True, window=(10, 0), softcap=5.0)
    assert grad_step.unserved(plain) == ("head dims that are not multiples of 64",)
    q = sd((1, 256, 4, 128), jnp.bfloat16)
    bias = sd((1, 4, 256, 256), jnp.float32)
    assert grad_step.unserved(Problem.of(q, q, q, bias, dropout_rate=0.1)) == (
        "bias", "dropout_rate")
    assert grad_step.unserved(Problem.of(q, q, q, causal=True, softcap=5.0)) == ()


# ---------------------------------------------------------------- on an sm90 GPU


def _block_inputs(b, hkv, g, t, s, d, rows, keys, seed):
    ks = jax.random.split(jax.random.key(seed), 4)
    q5 = jax.random.normal(ks[0], (b, hkv, g, t, d), jnp.bfloat16)
    k4 = jax.random.normal(ks[1], (b, hkv, s, d), jnp.bfloat16)
    dp = jax.random.normal(ks[2], (b, hkv * g, rows, keys), jnp.bfloat16)
    delta = jax.random.normal(ks[3], (b, hkv * g, rows), jnp.float32)
    return q5, k4, dp, delta


@pytest.mark.gpu
@pytest.mark.parametrize(("kw", "offsets"), [
    (dict(), (128, 256)), (dict(causal=True), (256, 384)),
    (dict(causal=True, window=(100, 0), softcap=2.0), (256, 256)),
    (dict(window=(200, 30)), (256, 282))], ids=str)  # a place of no whole 8-row tiles
def test_the_mosaic_step_equals_the_triton_step_on_a_block(kw, offsets):
    """P and dS of one block (2 batch rows, GQA 3 query heads per KV head, D = 192) by the
    Mosaic step and by the Triton step on the same operands: the two sum the head dim in
    other orders, so the logits differ by float32 roundings and the 16-bit P and dS by at
    most about an ulp of theirs."""
    skip_unless_sm90()
    b, hkv, g, t, s, d, rows, keys = 2, 2, 3, 640, 896, 192, 256, 384
    q5, k4, dp, delta = _block_inputs(b, hkv, g, t, s, d, rows, keys, seed=5)
    qs, kvs = sd((b, t, hkv * g, d), jnp.bfloat16), sd((b, s, hkv, d), jnp.bfloat16)
    problem = Problem.of(qs, kvs, kvs, scale=0.09, **kw)
    r0, c0 = offsets
    logits = jnp.einsum("bkgmd,bksd->bkgms", q5[:, :, :, r0:r0 + rows].astype(jnp.float32),
                        k4[:, :, c0:c0 + keys].astype(jnp.float32)).reshape(
                            b, hkv * g, rows, keys)
    lse = jax.nn.logsumexp(logits * 0.09, axis=-1)  # the rows' lse over this block's keys
    offs = jnp.asarray(offsets, jnp.int32)
    want = blocked.softmax_grad_of_operands(
        problem, LogitOperands(q5, k4), GradBlock(None, dp, lse, delta, offs),
        Inputs(qs, kvs, kvs), out_dtype=jnp.bfloat16)
    q_blk, k_blk = q5[:, :, :, r0:r0 + rows], k4[:, :, c0:c0 + keys]
    got = jax.jit(lambda *a: grad_step.block_step(problem, *a))(q_blk, k_blk, dp, lse, delta,
                                                                offs)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(got[0]), f32(want[0]), rtol=2.0 ** -7, atol=1e-6)
    scale = np.abs(f32(want[1])).max()
    np.testing.assert_allclose(f32(got[1]), f32(want[1]), rtol=2.0 ** -7, atol=2.0 ** -8 * scale)
    assert scale > 0 and (f32(want[0]) > 0).mean() > 0.05  # a real test
    if kw.get("causal"):  # the masked keys' P is 0 in both
        assert (f32(got[0]) == 0).mean() > 0.05


STEP_CASES = [
    Case(b=1, t=1024, s=1024, hq=4, hkv=2, d=512),
    Case(b=2, t=640, s=1024, hq=4, hkv=1, d=128, causal=True, softcap=1.5),
    Case(b=1, t=768, s=768, hq=4, hkv=4, d=320, window=(200, 30), sinks=True),
    Case(b=1, t=1024, s=1000, hq=2, hkv=2, d=64, causal=True),  # a tail block of 232 keys
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", STEP_CASES, ids=lambda c: f"T{c.t}-S{c.s}-D{c.d}")
def test_chunked_gradients_with_the_mosaic_step_match_float64(case, monkeypatch):
    """out and dq, dk, dv (and the sinks' gradient) of the chunked tier in blocks of a few
    hundred rows and keys, which run the Mosaic step (checked in the program), against
    float64 by the tolerance rule."""
    skip_unless_sm90()
    monkeypatch.setenv(chunked_plan.BUDGET_ENV, "4")
    q, k, v, _, _ = make_inputs(case)
    features = make_features(case)  # the window, the soft cap, the sinks where the case has them
    sinks = features.get("sinks")
    others = {name: x for name, x in features.items() if name != "sinks"}

    def f(q, k, v, sinks):
        return ffpa_jax.attention(q, k, v, is_causal=case.causal, sinks=sinks,
                                  implementation="chunked", **others)

    @jax.jit
    def forward_and_vjp(q, k, v, sinks, d_out):
        out, vjp = jax.vjp(f, q, k, v, sinks)
        return out, vjp(d_out)

    d_out = cotangents(case)[0].astype(q.dtype)
    assert MOSAIC_CALL in forward_and_vjp.lower(q, k, v, sinks, d_out).as_text()
    out, grads = forward_and_vjp(q, k, v, sinks, d_out)
    d_lse = jnp.zeros((case.b, case.hq, case.t), jnp.float32)  # the call returns no lse
    (*ref_forward, ref), (*xla_forward, xla) = (
        reference_vjp(case, q, k, v, None, None, d_out.astype(jnp.float32), d_lse,
                      float64=float64, features=features) for float64 in (True, False))
    assert_forward_matches(out, None, ref_forward, xla_forward, q.dtype)
    for name, g, r, x, primal in zip(["dq", "dk", "dv", "dbias", "dsinks"],
                                     (*grads[:3], None, grads[3]), ref, xla,
                                     (q, k, v, None, sinks), strict=True):
        if primal is not None:
            assert_matches_reference(name, g, r, x, q.dtype, factor=3.0)


@pytest.mark.parametrize(("sm90", "bias", "mosaic"), [(True, False, True), (True, True, False),
                                                      (False, False, False)])
def test_the_plan_sets_the_mosaic_step_on_sm90_only(sm90, bias, mosaic, monkeypatch):
    """The chunked tier's config takes the Mosaic step on an sm90 GPU for a problem it serves
    (not with a bias, not on another GPU), and its reason says so (`info` prints it)."""
    monkeypatch.setattr(compat, "mosaic_gpu_runs", lambda: True)
    device = dispatch.Device(nvidia_gpu=True, name="Planning GPU",
                             compute_capability="9.0" if sm90 else "8.0")
    q = sd((1, 16384, 8, 512), jnp.bfloat16)
    problem = Problem.of(q, q, q, sd((1, 8, 16384, 16384), jnp.float32) if bias else None)
    plan = dispatch.explain(problem, "chunked", device=device).plan
    choice = next(c for c in plan.kernels if c.direction == "backward")
    assert choice.config.mosaic_step == mosaic
    assert ("(Mosaic GPU where they are whole tiles of it)" in choice.why) == mosaic
    assert "compute their logits in the step's kernel" in choice.why
