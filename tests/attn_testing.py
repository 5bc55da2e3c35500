"""Shared test machinery: random inputs, the float64 reference, and the tolerance rule.

Tolerance rule (docs/design.md): the error of a fp16/bf16 result against the float64
reference is at most 2x (forward) or 3x (gradients) the error of the
same-precision XLA computation against that reference, plus a floor of a few
ulps of the output's magnitude; float32 results within 1e-5 relative (or, where XLA's
own float32 result misses that, within the same factor of its error).
"""

from __future__ import annotations

import dataclasses
import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from ffpa_jax.reference import mha_reference
from ffpa_jax.validation import as_4d

ULP_FLOOR = 4  # "a few ulps" of the output's magnitude


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem. bias/mask shapes are as the caller passes them."""

    b: int = 1
    t: int = 64
    s: int = 64
    hq: int = 2
    hkv: int = 2
    d: int = 64
    dv: int | None = None
    causal: bool = False
    bias_shape: tuple[int, ...] | None = None
    mask_shape: tuple[int, ...] | None = None
    dtype: str = "bfloat16"
    mask_density: float = 0.6
    scale: float | None = None
    # The LLM features (issue 24). Out of repr: the inputs of a case without them (drawn
    # from the seed of its repr) stay what they were; `make_features` seeds from them.
    window: tuple[int, int] | None = dataclasses.field(default=None, repr=False)
    softcap: float | None = dataclasses.field(default=None, repr=False)
    segments: int = dataclasses.field(default=0, repr=False)  # packed sequences per row
    q_lengths: tuple[int, ...] | None = dataclasses.field(default=None, repr=False)
    kv_lengths: tuple[int, ...] | None = dataclasses.field(default=None, repr=False)
    sinks: bool = dataclasses.field(default=False, repr=False)
    sorted_ids: bool = dataclasses.field(default=True, repr=False)  # contiguous segments

    @property
    def head_dim_v(self) -> int:
        return self.d if self.dv is None else self.dv

    def seed(self) -> int:
        return zlib.crc32(repr(self).encode())


def normal(rng: np.random.Generator, shape, dtype=jnp.float32) -> jax.Array:
    """Standard normal draws (float32, then rounded to `dtype`) as a jax array. NumPy draws
    them: jax.random compiles a program for every new shape, a cost paid many times over in a
    suite of odd shapes."""
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(jnp.dtype(dtype)))


def make_inputs(case: Case, seed: int | None = None):
    """Fresh random normal q, k, v (never zeros), bias and mask for `case`, in case.dtype.

    bias is float32 (any float dtype is allowed); mask draws True with `mask_density`.
    """
    rng = np.random.default_rng(case.seed() if seed is None else seed)
    q = normal(rng, (case.b, case.t, case.hq, case.d), case.dtype)
    k = normal(rng, (case.b, case.s, case.hkv, case.d), case.dtype)
    v = normal(rng, (case.b, case.s, case.hkv, case.head_dim_v), case.dtype)
    bias = None if case.bias_shape is None else normal(rng, case.bias_shape)
    mask = None
    if case.mask_shape is not None:
        mask = jnp.asarray(rng.random(case.mask_shape) < case.mask_density)
    return q, k, v, bias, mask


def cotangents(case: Case, seed: int = 99):
    """Random float32 cotangents (never zeros) for out [B, T, Hq, Dv] and lse [B, Hq, T]."""
    rng = np.random.default_rng(case.seed() + seed)
    return (normal(rng, (case.b, case.t, case.hq, case.head_dim_v)),
            normal(rng, (case.b, case.hq, case.t)))


def feature_seed(case: Case) -> int:
    extra = (case.window, case.softcap, case.segments, case.q_lengths, case.kv_lengths,
             case.sinks, case.sorted_ids)
    return zlib.crc32(repr((case, extra)).encode())


def make_features(case: Case) -> dict:
    """`attention`'s feature arguments for `case` (an empty dict without features): random
    segment ids (contiguous runs when `sorted_ids`; the queries' ids take one value more than
    the keys', so some rows meet no key of their segment), lengths, sinks ~ N(0, 1)."""
    kw: dict = {}
    rng = np.random.default_rng(feature_seed(case))
    if case.segments:
        q_ids = rng.integers(0, case.segments + 1, (case.b, case.t), dtype=np.int32)
        kv_ids = rng.integers(0, case.segments, (case.b, case.s), dtype=np.int32)
        if case.sorted_ids:
            q_ids, kv_ids = np.sort(q_ids, axis=1), np.sort(kv_ids, axis=1)
        kw["q_segment_ids"] = jnp.asarray(q_ids)
        kw["kv_segment_ids"] = jnp.asarray(kv_ids)
    if case.q_lengths is not None:
        kw["query_seq_lengths"] = jnp.asarray(case.q_lengths, jnp.int32)
    if case.kv_lengths is not None:
        kw["key_value_seq_lengths"] = jnp.asarray(case.kv_lengths, jnp.int32)
    if case.sinks:
        kw["sinks"] = normal(rng, (case.hq,))
    if case.window is not None:
        kw["local_window_size"] = case.window
    if case.softcap is not None:
        kw["logits_soft_cap"] = case.softcap
    return kw


def feature_arrays(features: dict):
    """The kernels' `FeatureArrays` of `make_features`' arguments."""
    from pallas_kernels.problem import FeatureArrays
    return FeatureArrays(features.get("q_segment_ids"), features.get("kv_segment_ids"),
                         features.get("query_seq_lengths"),
                         features.get("key_value_seq_lengths"), features.get("sinks"))


def reference_features(features: dict | None, float64: bool = False) -> dict:
    """`mha_reference`'s keyword arguments for `attention`'s feature arguments."""
    f = features or {}
    sinks = f.get("sinks")
    if sinks is not None and float64:
        sinks = jnp.asarray(np.asarray(sinks, np.float64))
    return dict(window=f.get("local_window_size"), softcap=f.get("logits_soft_cap"),
                q_segment_ids=f.get("q_segment_ids"), kv_segment_ids=f.get("kv_segment_ids"),
                q_lengths=f.get("query_seq_lengths"), kv_lengths=f.get("key_value_seq_lengths"),
                sinks=sinks)


def scale_of(case: Case) -> float:
    return case.scale if case.scale is not None else 1.0 / np.sqrt(case.d)


_STATIC = ("scale", "is_causal", "rate", "window", "softcap")


def _reference(q, k, v, bias, sinks, mask, keep, features, *, scale, is_causal, rate, window,
               softcap):
    """`mha_reference`; `features`: segment ids and lengths (`reference_features`)."""
    return mha_reference(q, k, v, as_4d(bias, True), as_4d(mask, True), scale=scale,
                         is_causal=is_causal, keep_mask=keep, dropout_rate=rate, window=window,
                         softcap=softcap, sinks=sinks, **features)


# The reference runs jitted: eagerly, each of its few dozen operations compiles on its own at
# every new shape, which cost the suite more than the kernels under test.
_reference_forward = jax.jit(_reference, static_argnames=_STATIC)


@functools.partial(jax.jit, static_argnames=_STATIC)
def _reference_vjp(q, k, v, bias, sinks, mask, keep, features, d_out, d_lse, **statics):
    (out, lse), vjp = jax.vjp(
        lambda q, k, v, bias, sinks: _reference(q, k, v, bias, sinks, mask, keep, features,
                                                **statics),
        q, k, v, bias, sinks)
    # Rows with lse = -inf get no lse cotangent (as in attention's vjp).
    d_lse = jnp.where(jnp.isfinite(lse), d_lse.astype(lse.dtype), 0)
    return out, lse, vjp((d_out.astype(out.dtype), d_lse))


def _run_reference(fn, case: Case, q, k, v, bias, mask, *, keep, rate, features, float64,
                   cotangents=()):
    """`fn` on the inputs, converted to float64 (exactly: they are already rounded) when
    `float64`; statics from `case` and `features`."""
    def run(conv):
        ref = reference_features(features, float64=float64)
        statics = dict(scale=scale_of(case), is_causal=case.causal, rate=float(rate),
                       window=ref.pop("window"), softcap=ref.pop("softcap"))
        sinks = ref.pop("sinks")
        return fn(conv(q), conv(k), conv(v), conv(bias), sinks, mask,
                  keep if rate > 0.0 else None, ref, *map(conv, cotangents), **statics)
    if not float64:
        return run(lambda x: x)
    with jax.enable_x64(True):
        return run(lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64)))


def reference64(case: Case, q, k, v, bias, mask, *, keep=None, rate: float = 0.0,
                features: dict | None = None):
    """(out, lse) of the float64 reference on exactly the inputs given (already rounded);
    `keep`/`rate`: a dropout keep-mask [B, Hq, T, S] and its rate; `features`: attention's
    feature arguments (`make_features`)."""
    out, lse = _run_reference(_reference_forward, case, q, k, v, bias, mask, keep=keep,
                              rate=rate, features=features, float64=True)
    return np.asarray(out), np.asarray(lse)


def xla_same_precision(case: Case, q, k, v, bias, mask, *, keep=None, rate: float = 0.0,
                       features: dict | None = None):
    """(out, lse) of the XLA path at the inputs' own precision."""
    out, lse = _run_reference(_reference_forward, case, q, k, v, bias, mask, keep=keep,
                              rate=rate, features=features, float64=False)
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


def reference_vjp(case: Case, q, k, v, bias, mask, d_out, d_lse, *, float64: bool,
                  keep=None, rate: float = 0.0, features: dict | None = None):
    """(out, lse, [dq, dk, dv, dbias, dsinks]) of the reference, in float64 or at the
    inputs' own precision (then out and the gradients as float32), one compiled program:
    the gradients are of <out, d_out> + <lse, d_lse>; None where the operand is None."""
    out, lse, grads = _run_reference(_reference_vjp, case, q, k, v, bias, mask, keep=keep,
                                     rate=rate, features=features, float64=float64,
                                     cotangents=(d_out, d_lse))
    as_np = (lambda x: np.asarray(x)) if float64 else (
        lambda x: np.asarray(x.astype(jnp.float32)))
    return as_np(out), np.asarray(lse), [None if g is None else as_np(g) for g in grads]


def reference_grads(case: Case, q, k, v, bias, mask, d_out, d_lse, *, float64: bool,
                    keep=None, rate: float = 0.0, features: dict | None = None):
    """The gradients of `reference_vjp`."""
    return reference_vjp(case, q, k, v, bias, mask, d_out, d_lse, float64=float64, keep=keep,
                         rate=rate, features=features)[2]


def _max_err(x, ref) -> float:
    x = np.asarray(np.asarray(x, np.float32), np.float64)
    finite = np.isfinite(ref)
    diff = np.where(finite, x, 0.0) - np.where(finite, ref, 0.0)
    return float(np.max(np.abs(diff), initial=0.0))


def assert_matches_reference(name: str, got, ref64, xla, dtype, *, factor: float = 2.0):
    """The tolerance rule of docs/design.md, with a readable failure message.

    Non-finite reference entries (lse = -inf of fully masked rows) must be
    matched exactly; the rest is compared by max abs error.
    """
    got = np.asarray(np.asarray(got, np.float32), np.float64)
    ref64 = np.asarray(ref64, np.float64)
    assert got.shape == ref64.shape, f"{name}: shape {got.shape} != reference {ref64.shape}"
    assert not np.isnan(got).any(), f"{name}: NaN in result"
    nonfinite = ~np.isfinite(ref64)
    if nonfinite.any():
        np.testing.assert_array_equal(got[nonfinite], ref64[nonfinite],
                                      err_msg=f"{name}: non-finite entries differ")
    magnitude = float(np.max(np.abs(np.where(nonfinite, 0.0, ref64)), initial=0.0))
    err = _max_err(got, ref64)
    if jnp.dtype(dtype) == jnp.float32:
        # 1e-5 relative, unless float32 itself cannot reach it on these inputs: at logits
        # in the hundreds the float32 rounding of the logits alone costs XLA's own
        # gradients more than that (docs/history.md, sessions 6 and 17); there the rule of
        # the 16-bit dtypes applies, `factor` x XLA's float32 error.
        err_xla = _max_err(xla, ref64)
        bound = max(1e-5 * max(magnitude, 1.0), factor * err_xla)
        rule = f"1e-5 relative (float32), or {factor}x XLA's float32 error {err_xla:.3e}"
    else:
        err_xla = _max_err(xla, ref64)
        floor = ULP_FLOOR * float(jnp.finfo(dtype).eps) * magnitude
        bound = factor * err_xla + floor
        rule = f"{factor}x XLA error {err_xla:.3e} + floor {floor:.3e}"
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} ({rule})"


def assert_forward_matches(out, lse, reference, xla, dtype):
    """out by the rule of `dtype` (factor 2) and lse by `assert_lse_matches`; `reference`
    and `xla`: (out, lse) of the float64 reference and of the same-precision XLA computation.
    An output given as None is not checked (a loss of the other output alone)."""
    if out is not None:
        assert_matches_reference("out", out, reference[0], xla[0], dtype)
    if lse is not None:
        assert_lse_matches(lse, reference[1], xla[1])


def assert_lse_matches(got, ref64, xla):
    """lse is float32 in every path: 2x the XLA path's error, plus a few float32 ulps."""
    ref64 = np.asarray(ref64, np.float64)
    magnitude = float(np.max(np.abs(np.where(np.isfinite(ref64), ref64, 0.0)), initial=1.0))
    got = np.asarray(got, np.float64)
    nonfinite = ~np.isfinite(ref64)
    np.testing.assert_array_equal(got[nonfinite], ref64[nonfinite], err_msg="lse: -inf rows differ")
    assert np.isfinite(got[~nonfinite]).all(), "lse: non-finite where the reference is finite"
    bound = 2.0 * _max_err(xla, ref64) + ULP_FLOOR * float(np.finfo(np.float32).eps) * magnitude
    err = _max_err(got, ref64)
    assert err <= bound, f"lse: max error {err:.3e} > bound {bound:.3e}"
