"""A differentiated call's forward on a tier of its own (`Plan.vjp_forward_tier`): where a
tuned forward entry says a forward+backward measured faster with the backward's tier's
forward ("tier_differentiated"), the custom_vjp's forward rule runs that tier and the
undifferentiated call keeps the faster forward."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ffpa_jax import info, vjp
from pallas_kernels import compat
from pallas_kernels.tiers import CHUNKED_KERNEL
from pallas_kernels.problem import Inputs, Problem
from tuning import dispatch
from tuning.lookup import PACKAGED_CONFIG_DIR, clear_cache

sd = jax.ShapeDtypeStruct
H200 = "NVIDIA H200"


def _qkv(seed=3, b=2, t=113, s=203, hq=4, hkv=2, d=40):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, t, hq, d), jnp.float32)
    k = jax.random.normal(keys[1], (b, s, hkv, d), jnp.float32)
    v = jax.random.normal(keys[2], (b, s, hkv, d), jnp.float32)
    w = jax.random.normal(keys[3], (b, t, hq, d), jnp.float32)
    return q, k, v, w


def test_a_differentiated_call_runs_its_forward_on_the_vjp_tier():
    """Under `jax.value_and_grad` the plan's forward runs on its vjp tier (the chunked one
    here): the primal output is bitwise the chunked pair's, and so are the gradients (the
    backward takes that forward's out and lse); the same plan undifferentiated runs its
    own forward tier (the interpreted Triton kernels), whose output differs in the last
    bits. Causal with T != S, GQA, odd head dim."""
    q, k, v, w = _qkv()
    problem = Problem.of(q, k, v, causal=True)
    per_use = dispatch.plan_for_tiers(problem, "pallas", "chunked", interpret=True,
                                      vjp_forward="chunked")
    fused = dispatch.plan_for_tiers(problem, "pallas", "chunked", interpret=True)
    chunked = dispatch.plan_for_tiers(problem, "chunked", "chunked", interpret=True)
    assert (per_use.forward_tier, per_use.vjp_forward_tier) == ("pallas", "chunked")

    def loss(plan):
        def f(q, k, v):
            out, _ = vjp.attention(plan, Inputs(q, k, v))
            return jnp.sum(out * w), out
        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)

    (_, out_per_use), grads_per_use = loss(per_use)(q, k, v)
    (_, out_chunked), grads_chunked = loss(chunked)(q, k, v)
    np.testing.assert_array_equal(out_per_use, out_chunked)
    for got, want in zip(grads_per_use, grads_chunked):
        np.testing.assert_array_equal(got, want)

    plain_per_use = vjp.attention(per_use, Inputs(q, k, v))[0]
    plain_fused = vjp.attention(fused, Inputs(q, k, v))[0]
    np.testing.assert_array_equal(plain_per_use, plain_fused)
    # Otherwise the checks above could not tell the two forwards apart.
    assert np.any(np.asarray(plain_fused) != np.asarray(out_chunked))
    np.testing.assert_allclose(plain_fused, out_chunked, rtol=1e-4, atol=1e-5)


def _h200(monkeypatch, tmp_path, edit=None) -> dispatch.Device:
    """An H200 reading the packaged file, or a copy of it changed by `edit`."""
    monkeypatch.setattr(compat, "mosaic_gpu_runs", lambda: True)
    monkeypatch.delenv("FFPA_SKIP_PERSIST_TUNED_CONFIG", raising=False)
    if edit is not None:
        doc = json.loads((PACKAGED_CONFIG_DIR / "NVIDIA_H200.json").read_text())
        for entry in doc["entries"]:
            edit(entry)
        (tmp_path / "NVIDIA_H200.json").write_text(json.dumps(doc))
    monkeypatch.setenv("FFPA_TUNED_CONFIG_DIR", str(tmp_path))
    clear_cache()
    return dispatch.Device(nvidia_gpu=True, name=H200, compute_capability="9.0")


def _d512(n=1024, causal=False):
    q = sd((1, n, 32, 512), jnp.bfloat16)
    return Problem.of(q, q, q, causal=causal)


def test_the_packaged_h200_file_gives_d512_n1024_a_chunked_forward_when_differentiated(
        monkeypatch, tmp_path):
    """The H200 file at D=512 N=1024: the forward on the Mosaic tier, the backward and the
    differentiated call's forward on the chunked tier, its configs in the plan; `info` says
    so. A tier named by the caller runs both ways."""
    device = _h200(monkeypatch, tmp_path)
    explained = dispatch.explain(_d512(), device=device)
    assert (explained.forward.tier, explained.backward.tier) == ("mosaic", "chunked")
    assert explained.vjp_forward.tier == "chunked"
    assert "forward+backward measured faster" in explained.vjp_forward.why
    plan = explained.plan
    assert plan.vjp_forward_tier == "chunked"
    assert plan.for_vjp().forward_tier == "chunked" and plan.for_vjp().float32_out
    assert {k.direction for k in plan.kernels if k.kernel == CHUNKED_KERNEL} == {"forward",
                                                                            "backward"}
    text = "\n".join(info.call_lines(_d512(), None, H200, "9.0"))
    assert "forward when differentiated: chunked" in text
    named = dispatch.explain(_d512(), "mosaic", device=device)
    assert named.vjp_forward is None and named.plan.vjp_forward_tier is None
    assert dispatch.explain(_d512(4096), device=device).vjp_forward is None


@pytest.mark.parametrize("field,why", [
    ("pallas", "a tier other than the backward's: not the measured pair"),
    ("mosaic", "the forward's own tier"), ("no-such-tier", "not a tier"),
    (["chunked"], "not a name")])
def test_the_vjp_tier_is_taken_only_as_the_backwards_tier(field, why, monkeypatch, tmp_path):
    def edit(entry):
        if entry.get("tier_differentiated"):
            entry["tier_differentiated"] = field
    device = _h200(monkeypatch, tmp_path, edit)
    explained = dispatch.explain(_d512(), device=device)
    # The edited file was read (its entries decide both directions), and its field ignored.
    assert explained.forward.why.startswith("tuned entry"), explained.forward.why
    assert (explained.forward.tier, explained.backward.tier) == ("mosaic", "chunked")
    assert explained.vjp_forward is None, why
    assert explained.plan.vjp_forward_tier is None


def test_a_training_step_at_d512_n1024_lowers_without_the_mosaic_forward(monkeypatch,
                                                                         tmp_path):
    """On an H200 (pretended; lowered for CUDA, nothing runs) a call at D=512 N=1024 lowers
    the Mosaic forward undifferentiated, and no Mosaic kernel under `jax.vjp` (the chunked
    forward and backward); at N=4096 the differentiated call keeps the Mosaic forward."""
    import ffpa_jax

    device = _h200(monkeypatch, tmp_path)
    monkeypatch.setattr(dispatch.Device, "current", classmethod(lambda cls: device))

    def lowered(n, differentiate):
        q = sd((1, n, 32, 512), jnp.bfloat16)
        attn = ffpa_jax.attention

        def step(q, k, v):
            if not differentiate:
                return attn(q, k, v)
            out, pullback = jax.vjp(attn, q, k, v)
            return out, pullback(out)
        return jax.jit(step).trace(q, q, q).lower(lowering_platforms=("cuda",)).as_text()

    assert "mosaic_gpu" in lowered(1024, differentiate=False)
    assert "mosaic_gpu" not in lowered(1024, differentiate=True)
    assert "mosaic_gpu" in lowered(4096, differentiate=True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_the_per_use_forward_meets_the_tolerance_rule_gpu(causal, monkeypatch, tmp_path):
    """On an sm90 GPU reading the H200 file (whatever the card: the lookup goes by the
    device's name): D=512, N=1024, GQA 4/2, bf16. The undifferentiated call (the Mosaic
    forward) and the differentiated one (the chunked forward and backward) each meet the
    tolerance rule against the float64 reference, out, lse and gradients."""
    import ffpa_jax
    from attn_testing import (Case, assert_forward_matches, assert_matches_reference,
                              cotangents, make_inputs, reference_vjp)
    from conftest import skip_unless_sm90

    skip_unless_sm90()
    device = dataclasses.replace(_h200(monkeypatch, tmp_path),
                                 multiprocessors=dispatch.Device.current().multiprocessors)
    monkeypatch.setattr(dispatch.Device, "current", classmethod(lambda cls: device))
    case = Case(b=1, t=1024, s=1024, hq=4, hkv=2, d=512, causal=causal)
    q, k, v, _, _ = make_inputs(case)
    explained = dispatch.explain(Problem.of(q, k, v, causal=causal), device=device)
    assert (explained.forward.tier, explained.plan.vjp_forward_tier) == ("mosaic", "chunked")
    d_out, d_lse = cotangents(case)
    d_out = d_out.astype(q.dtype).astype(jnp.float32)

    def f(q, k, v):
        return ffpa_jax.attention(q, k, v, is_causal=causal, return_lse=True)

    def differentiated(q, k, v):
        primal, pullback = jax.vjp(f, q, k, v)
        return primal, pullback((d_out.astype(q.dtype), d_lse))

    plain = jax.jit(f)(q, k, v)
    (out, lse), grads = jax.jit(differentiated)(q, k, v)
    *ref_forward, ref = reference_vjp(case, q, k, v, None, None, d_out, d_lse, float64=True)
    *xla_forward, xla = reference_vjp(case, q, k, v, None, None, d_out, d_lse, float64=False)
    assert_forward_matches(*plain, ref_forward, xla_forward, q.dtype)
    assert_forward_matches(out, lse, ref_forward, xla_forward, q.dtype)
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, ref, xla):
        assert_matches_reference(name, g, r, x, q.dtype, factor=3.0)
