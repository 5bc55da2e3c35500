"""Shared test machinery: random inputs, the float64 reference, and the tolerance rule.

Tolerance rule (docs/design.md): the error of a fp16/bf16 result against the float64
reference is at most 2x (forward) or 3x (gradients) the error of the
same-precision XLA computation against that reference, plus a floor of a few
ulps of the output's magnitude; float32 results within 1e-5 relative (or, where XLA's
own float32 result misses that, within the same factor of its error).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.reference import mha_reference
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


def make_inputs(case: Case, seed: int | None = None):
    """Fresh random normal q, k, v (never zeros), bias and mask for `case`, in case.dtype.

    bias is float32 (any float dtype is allowed); mask draws True with `mask_density`.
    """
    key = jax.random.key(case.seed() if seed is None else seed)
    kq, kk, kv, kb, km = jax.random.split(key, 5)
    dtype = jnp.dtype(case.dtype)
    q = jax.random.normal(kq, (case.b, case.t, case.hq, case.d), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (case.b, case.s, case.hkv, case.d), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (case.b, case.s, case.hkv, case.head_dim_v), jnp.float32).astype(dtype)
    bias = None if case.bias_shape is None else jax.random.normal(kb, case.bias_shape, jnp.float32)
    mask = None
    if case.mask_shape is not None:
        mask = jax.random.bernoulli(km, case.mask_density, case.mask_shape)
    return q, k, v, bias, mask


def feature_seed(case: Case) -> int:
    extra = (case.window, case.softcap, case.segments, case.q_lengths, case.kv_lengths,
             case.sinks, case.sorted_ids)
    return zlib.crc32(repr((case, extra)).encode())


def make_features(case: Case) -> dict:
    """`attention`'s feature arguments for `case` (an empty dict without features): random
    segment ids (contiguous runs when `sorted_ids`; the queries' ids take one value more than
    the keys', so some rows meet no key of their segment), lengths, sinks ~ N(0, 1)."""
    kw: dict = {}
    ks = jax.random.split(jax.random.key(feature_seed(case)), 3)
    if case.segments:
        q_ids = jax.random.randint(ks[0], (case.b, case.t), 0, case.segments + 1)
        kv_ids = jax.random.randint(ks[1], (case.b, case.s), 0, case.segments)
        if case.sorted_ids:
            q_ids, kv_ids = jnp.sort(q_ids, axis=1), jnp.sort(kv_ids, axis=1)
        kw["q_segment_ids"] = q_ids.astype(jnp.int32)
        kw["kv_segment_ids"] = kv_ids.astype(jnp.int32)
    if case.q_lengths is not None:
        kw["query_seq_lengths"] = jnp.asarray(case.q_lengths, jnp.int32)
    if case.kv_lengths is not None:
        kw["key_value_seq_lengths"] = jnp.asarray(case.kv_lengths, jnp.int32)
    if case.sinks:
        kw["sinks"] = jax.random.normal(ks[2], (case.hq,), jnp.float32)
    if case.window is not None:
        kw["local_window_size"] = case.window
    if case.softcap is not None:
        kw["logits_soft_cap"] = case.softcap
    return kw


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


def reference64(case: Case, q, k, v, bias, mask, *, keep=None, rate: float = 0.0,
                features: dict | None = None):
    """(out, lse) of the float64 reference on exactly the inputs given (already rounded);
    `keep`/`rate`: a dropout keep-mask [B, Hq, T, S] and its rate; `features`: attention's
    feature arguments (`make_features`)."""
    with jax.enable_x64(True):
        to64 = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))
        out, lse = mha_reference(to64(q), to64(k), to64(v), to64(as_4d(bias, True)),
                                 as_4d(mask, True), scale=scale_of(case), is_causal=case.causal,
                                 keep_mask=keep, dropout_rate=rate,
                                 **reference_features(features, float64=True))
        return np.asarray(out), np.asarray(lse)


def xla_same_precision(case: Case, q, k, v, bias, mask, *, keep=None, rate: float = 0.0,
                       features: dict | None = None):
    """(out, lse) of the XLA path at the inputs' own precision."""
    out, lse = mha_reference(q, k, v, as_4d(bias, True), as_4d(mask, True), scale=scale_of(case),
                             is_causal=case.causal, keep_mask=keep, dropout_rate=rate,
                             **reference_features(features))
    return np.asarray(out.astype(jnp.float32)), np.asarray(lse)


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
        # in the hundreds (inputs of magnitude 2, scale 1.5, D=149) the float32 rounding
        # of the logits alone costs XLA's own gradients 2-3.5e-5 (H100, 2026-11-21,
        # docs/history.md, session 6); there the rule of the 16-bit dtypes applies,
        # `factor` x XLA's float32 error.
        err_xla = _max_err(xla, ref64)
        bound = max(1e-5 * max(magnitude, 1.0), factor * err_xla)
        rule = f"1e-5 relative (float32), or {factor}x XLA's float32 error {err_xla:.3e}"
    else:
        err_xla = _max_err(xla, ref64)
        floor = ULP_FLOOR * float(jnp.finfo(dtype).eps) * magnitude
        bound = factor * err_xla + floor
        rule = f"{factor}x XLA error {err_xla:.3e} + floor {floor:.3e}"
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} ({rule})"


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
