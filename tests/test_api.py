"""The public function's behaviour beyond numerics: layouts, choice of implementation,
jit/vmap, return_lse, and the warnings it gives (once, at the caller's line)."""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from attn_testing import Case, assert_matches_reference, make_inputs, reference64
from conftest import interpret_flag


def test_unbatched_matches_batched(kernel_mode):
    q, k, v, bias, mask = make_inputs(Case(b=1, t=21, s=34, hq=4, hkv=2, d=40,
                                           bias_shape=(4, 21, 34), mask_shape=(21, 34)))
    kw = dict(implementation="pallas", interpret=interpret_flag(kernel_mode), return_lse=True)
    out3, lse3 = ffpa_jax.attention(q[0], k[0], v[0], bias, mask, **kw)
    out4, lse4 = ffpa_jax.attention(q, k, v, bias[None], mask, **kw)
    assert out3.shape == (21, 4, 40) and lse3.shape == (4, 21)
    np.testing.assert_array_equal(np.asarray(out3, np.float32), np.asarray(out4[0], np.float32))
    np.testing.assert_array_equal(np.asarray(lse3), np.asarray(lse4[0]))


def test_return_lse_shapes_and_dtype():
    q, k, v, _, _ = make_inputs(Case(b=2, t=9, s=13, hq=6, hkv=3, d=16, dv=24, dtype="float16"))
    out = ffpa_jax.attention(q, k, v)
    out2, lse = ffpa_jax.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 9, 6, 24) and out.dtype == jnp.float16
    assert lse.shape == (2, 6, 9) and lse.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))


@pytest.mark.parametrize("tier", ["xla", "pallas"])
def test_return_residual_is_jax_nns(tier, kernel_mode):
    """return_residual as jax.nn's: (out, lse as [B, T, Hq] in the query's dtype), within the
    rule of jax.nn's own residual against float64, its gradient stopped; -inf where a row
    sees no key (jax.nn: a large finite negative)."""
    if tier == "xla" and kernel_mode == "gpu":
        pytest.skip("the dense tier runs once, with the CPU parametrisation")
    case = Case(b=2, t=13, s=21, hq=4, hkv=2, d=40, mask_shape=(2, 1, 13, 21))
    q, k, v, _, mask = make_inputs(case)
    mask = mask.at[1, :, 5].set(False)  # a row with no visible key
    kw = dict(implementation=tier, interpret=tier == "pallas" and interpret_flag(kernel_mode))
    out, residual = ffpa_jax.attention(q, k, v, mask=mask, return_residual=True, **kw)
    _, theirs = jax.nn.dot_product_attention(q, k, v, mask=mask, return_residual=True)
    assert residual.shape == theirs.shape == (2, 13, 4) and residual.dtype == theirs.dtype
    ref_out, ref_lse = reference64(case, q, k, v, None, mask)
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(ffpa_jax.attention(q, k, v, mask=mask, **kw),
                                             np.float32))
    assert_matches_reference("residual", residual, np.swapaxes(ref_lse, -1, -2), theirs,
                             q.dtype)
    assert np.isneginf(np.asarray(residual, np.float32)[1, 5]).all()
    # Unbatched: [T, Hq].
    assert ffpa_jax.attention(q[0], k[0], v[0], return_residual=True, **kw)[1].shape == (13, 4)

    def loss(q, with_residual):
        out, residual = ffpa_jax.attention(q, k, v, return_residual=True, **kw)
        total = jnp.sum(out.astype(jnp.float32) * ref_out[0, 0, 0, 0].astype(np.float32))
        return total + (jnp.sum(residual.astype(jnp.float32)) if with_residual else 0.0)

    g_with, g_without = (jax.grad(loss)(q, flag) for flag in (True, False))
    assert np.abs(np.asarray(g_without, np.float32)).max() > 0
    np.testing.assert_array_equal(np.asarray(g_with, np.float32),
                                  np.asarray(g_without, np.float32))


def test_default_implementation_on_cpu_is_xla():
    if jax.devices()[0].platform == "gpu":
        pytest.skip("CPU-only behaviour")
    q, k, v, _, _ = make_inputs(Case(t=17, s=29, d=32))
    np.testing.assert_array_equal(np.asarray(ffpa_jax.attention(q, k, v), np.float32),
                                  np.asarray(ffpa_jax.attention(q, k, v, implementation="xla"),
                                             np.float32))


def test_interpret_without_implementation_runs_pallas(monkeypatch):
    """interpret=True alone selects the Pallas kernels (in the interpreter), both ways."""
    import ffpa_jax.api as api

    plans = []
    real = api.plan_for

    def spy(*args, **kwargs):
        plans.append(real(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(api, "plan_for", spy)
    q, k, v, _, _ = make_inputs(Case(t=8, s=8, d=16))
    ffpa_jax.attention(q, k, v, interpret=True)
    assert plans and plans[0].interpret is True
    assert (plans[0].forward_tier, plans[0].backward_tier) == ("pallas", "pallas")


def test_jit_and_scale(kernel_mode):
    q, k, v, _, _ = make_inputs(Case(b=2, t=33, s=47, hq=2, hkv=1, d=64))
    kw = dict(implementation="pallas", interpret=interpret_flag(kernel_mode), scale=0.3,
              is_causal=True)
    eager = ffpa_jax.attention(q, k, v, **kw)
    jitted = jax.jit(lambda q, k, v: ffpa_jax.attention(q, k, v, **kw))(q, k, v)
    np.testing.assert_array_equal(np.asarray(eager, np.float32), np.asarray(jitted, np.float32))
    # A different scale is a different function: the result must change.
    other = ffpa_jax.attention(q, k, v, **dict(kw, scale=0.1))
    assert not np.allclose(np.asarray(other, np.float32), np.asarray(eager, np.float32))


def test_vmap_over_extra_leading_dim(kernel_mode):
    """vmap over a leading axis gives the same as a Python loop over it."""
    cases = [make_inputs(Case(b=2, t=19, s=23, hq=2, hkv=2, d=32), seed=i) for i in range(3)]
    q, k, v = (jnp.stack([c[i] for c in cases]) for i in range(3))
    fn = lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=True, implementation="pallas",
                                            interpret=interpret_flag(kernel_mode))
    batched = jax.vmap(fn)(q, k, v)
    looped = jnp.stack([fn(q[i], k[i], v[i]) for i in range(3)])
    np.testing.assert_array_equal(np.asarray(batched, np.float32), np.asarray(looped, np.float32))


# ------------------------------------------------------------------------- warnings
@pytest.fixture
def fresh_warnings():
    from ffpa_jax import runtime_autotune
    runtime_autotune.clear_cache()  # forgets the warnings given, so each test sees its own
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught
    runtime_autotune.clear_cache()


def _line_after() -> int:
    """The line number of the caller's next line."""
    return inspect.currentframe().f_back.f_lineno + 1


def test_autotune_on_the_xla_path_warns_once_at_the_callers_line(fresh_warnings):
    q, k, v, _, _ = make_inputs(Case(t=8, s=8, d=16))
    line = _line_after()
    out = ffpa_jax.attention(q, k, v, implementation="xla", autotune="fast")
    jax.jit(lambda q: ffpa_jax.attention(q, k, v, implementation="xla", autotune="max"))(q)
    assert len(fresh_warnings) == 1  # once per process
    w = fresh_warnings[0]
    assert (w.filename, w.lineno, w.category) == (__file__, line, RuntimeWarning)
    assert ("autotune='fast' is ignored: the call runs the XLA path (implementation='xla')"
            in str(w.message))
    np.testing.assert_array_equal(  # and the result is the XLA path's
        np.asarray(out, np.float32),
        np.asarray(ffpa_jax.attention(q, k, v, implementation="xla"), np.float32))


def test_autotune_without_gpu_warns_at_the_callers_line_through_jit(fresh_warnings):
    q, k, v, _, _ = make_inputs(Case(t=8, s=8, d=16))
    if jax.devices()[0].platform != "gpu":  # implementation=None is the XLA path here
        line = _line_after()
        jax.jit(lambda q: ffpa_jax.attention(q, k, v, autotune="fast")).lower(q)
        (w,) = fresh_warnings
        assert (w.filename, w.lineno) == (__file__, line)
        assert "implementation=None runs the XLA path here" in str(w.message)
        assert "'cpu'" in str(w.message)
        fresh_warnings.clear()
    # interpreted kernels: nothing worth timing, through jit and vmap
    line = _line_after()
    fn = jax.vmap(lambda q: ffpa_jax.attention(q, k, v, interpret=True, autotune="max"))
    jax.jit(fn).lower(q[None])  # traced only: the warning comes at trace time
    (w,) = fresh_warnings
    assert (w.filename, w.lineno) == (__file__, line)
    assert "autotune needs an NVIDIA GPU" in str(w.message)
