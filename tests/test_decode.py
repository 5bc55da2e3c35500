"""The decode path (split-KV stage 1 + lse merge stage 2) against the float64 reference:
T in {1, 2, 5, 16}, S from 1 to 20000, GQA ratios 1/4/8 and MQA, bias and mask
broadcasts, causal, fully masked rows, head dims up to 1024, every dtype; the public
API's choice of the path; gradients for small T; the split heuristic."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from attn_testing import (Case, assert_forward_matches, assert_matches_reference, cotangents,
                          make_inputs, reference64, reference_vjp, scale_of,
                          xla_same_precision)
from conftest import interpret_flag
from pallas_kernels.fused import uses_decode
from ffpa_jax.validation import as_4d
from pallas_kernels import (DecodeConfig, FwdConfig, Inputs, Problem, decode_attention,
                            decode_num_splits,
                            fwd_generic)
from tuning import default_config


def _config(case: Case) -> DecodeConfig:
    dtype = {"float32": "fp32", "float16": "fp16"}.get(case.dtype, "bf16")
    return DecodeConfig.from_tuned(
        default_config("decode_fwd_stage1", headdim=max(case.d, case.head_dim_v), dtype=dtype),
        default_config("decode_fwd_stage2", headdim=case.head_dim_v, dtype=dtype))


def run_decode(case: Case, mode: str, inputs=None, *, num_splits: int | None = None,
               config: DecodeConfig | None = None):
    q, k, v, bias, mask = make_inputs(case) if inputs is None else inputs
    config = config or _config(case)
    if num_splits is None:
        num_splits = decode_num_splits(batch=case.b, heads_kv=case.hkv,
                                       packed_rows=case.t * case.hq // case.hkv, seq_k=case.s,
                                       head_dim_v=case.head_dim_v, config=config,
                                       multiprocessors=132)
    def decode(q, k, v, bias, mask):
        inputs = Inputs(q, k, v, as_4d(bias, True), as_4d(mask, True))
        problem = Problem.of(*inputs[:5], scale=scale_of(case), causal=case.causal)
        return decode_attention(problem, config, inputs, num_splits=num_splits,
                                interpret=interpret_flag(mode))
    fn = jax.jit(decode)
    return fn(q, k, v, bias, mask), (q, k, v, bias, mask)


def check_decode(case: Case, mode: str, inputs=None, **kw):
    (out, lse), inputs = run_decode(case, mode, inputs, **kw)
    assert out.dtype == jnp.dtype(case.dtype)
    assert_forward_matches(out, lse, reference64(case, *inputs),
                           xla_same_precision(case, *inputs), case.dtype)
    return out, lse


# Every T, S, GQA ratio and head dim of the issue appears; bias and mask broadcasts
# ride along. (The full cross product would take an hour in the interpreter.)
CASES = [
    Case(b=2, t=1, s=1, hq=4, hkv=4, d=64),
    Case(b=1, t=2, s=17, hq=8, hkv=2, d=64, bias_shape=(1, 8, 1, 17)),
    Case(b=2, t=5, s=339, hq=8, hkv=1, d=128, mask_shape=(2, 1, 5, 339)),
    Case(b=1, t=16, s=800, hq=8, hkv=1, d=64, causal=True),
    Case(b=1, t=1, s=20000, hq=8, hkv=1, d=128, bias_shape=(20000,)),
    Case(b=1, t=2, s=339, hq=16, hkv=2, d=512, mask_shape=(1, 16, 2, 339),
         bias_shape=(1, 1, 2, 339)),
    Case(b=2, t=5, s=800, hq=4, hkv=1, d=512, causal=True),
    Case(b=1, t=16, s=17, hq=2, hkv=2, d=128, bias_shape=(1, 2, 16, 1)),
    Case(b=1, t=1, s=339, hq=4, hkv=4, d=1000, dv=77),
    Case(b=2, t=5, s=339, hq=4, hkv=2, d=40, dv=59, bias_shape=(2, 1, 5, 1), causal=True),
]


# With `-m slow`: a bias on 17 keys, causal 16 x 800 and a key-constant bias of 16 rows (the
# bias, causal and 16-row cases of the other shapes stay).
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if i in (1, 3, 7)
                                  else c for i, c in enumerate(CASES)], ids=lambda c: (
    f"T{c.t}-S{c.s}-H{c.hq}.{c.hkv}-D{c.d}.{c.head_dim_v}" + ("-causal" if c.causal else "")
    + ("-bias" if c.bias_shape else "") + ("-mask" if c.mask_shape else "")))
def test_decode_matches_reference(case, kernel_mode):
    check_decode(case, kernel_mode)


# float32 at D = 512 with `-m slow` (float32 at D = 64 and float16 at both stay).
@pytest.mark.parametrize(("d", "dtype"), [
    pytest.param(d, dtype, marks=pytest.mark.slow) if (d, dtype) == (512, "float32")
    else (d, dtype) for d in (64, 512) for dtype in ("float16", "float32")])
def test_decode_dtypes(dtype, d, kernel_mode):
    check_decode(Case(b=1, t=3, s=339, hq=8, hkv=2, d=d, dtype=dtype,
                      bias_shape=(1, 8, 3, 339)), kernel_mode)


@pytest.mark.parametrize("splits", [1, 3, 64])
def test_decode_any_split_count(splits, kernel_mode):
    """Splits change the partition of the keys, never the result (beyond rounding)."""
    check_decode(Case(b=1, t=2, s=800, hq=4, hkv=1, d=64, causal=True), kernel_mode,
                 num_splits=splits)


def test_decode_fully_masked_rows(kernel_mode):
    """All-False mask rows and causal rows with no key (T > S) give 0 and lse -inf."""
    case = Case(b=1, t=16, s=5, hq=4, hkv=2, d=64, causal=True, mask_shape=(1, 4, 16, 5))
    q, k, v, bias, mask = make_inputs(case)
    mask = mask.at[0, 1, 13, :].set(False)
    out, lse = check_decode(case, kernel_mode, inputs=(q, k, v, bias, mask))
    out, lse = np.asarray(out, np.float32), np.asarray(lse)
    assert np.all(out[0, :11] == 0.0) and np.all(np.isneginf(lse[0, :, :11]))
    assert np.all(out[0, 13, 1] == 0.0) and np.isneginf(lse[0, 1, 13])


def test_decode_rows_masked_in_every_split(kernel_mode):
    """A row whose visible keys all sit in one split: the other splits' -inf partials
    must drop out of the merge."""
    case = Case(b=1, t=1, s=2000, hq=2, hkv=1, d=64, mask_shape=(1, 2, 1, 2000))
    q, k, v, _, _ = make_inputs(case)
    mask = jnp.zeros((1, 2, 1, 2000), bool).at[0, 0, 0, 1500:1510].set(True)
    out, lse = check_decode(case, kernel_mode, inputs=(q, k, v, None, mask), num_splits=8)
    assert np.all(np.asarray(out, np.float32)[0, 0, 1] == 0.0)


def test_decode_equals_generic_forward(kernel_mode):
    case = Case(b=2, t=4, s=500, hq=8, hkv=2, d=96, causal=True, bias_shape=(1, 8, 4, 500),
                dtype="float32")
    (out, lse), (q, k, v, bias, mask) = run_decode(case, kernel_mode)
    inputs = Inputs(q, k, v, as_4d(bias, True))
    problem = Problem.of(*inputs[:5], scale=scale_of(case), causal=True)
    out_g, lse_g = fwd_generic(problem, FwdConfig(), inputs,
                               interpret=interpret_flag(kernel_mode))[:2]
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_g), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_g), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- public API
def _kernel_names(fn, *args) -> str:
    return jax.make_jaxpr(fn)(*args).pretty_print()


@pytest.mark.parametrize("t,s,expected", [(1, 128, True), (16, 4096, True), (17, 4096, False),
                                          (1, 127, False)])
def test_api_picks_decode_for_short_queries(t, s, expected):
    q = jax.ShapeDtypeStruct((1, t, 4, 32), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, s, 2, 32), jnp.bfloat16)
    text = _kernel_names(lambda q, k, v: ffpa_jax.attention(
        q, k, v, implementation="pallas", interpret=True), q, kv, kv)
    assert ("decode_fwd_stage1" in text) == expected
    assert ("fwd_generic" in text) == (not expected)
    from ffpa_jax.validation import validate
    problem = validate(q, kv, kv, None, None, scale=None, is_causal=False, dropout_rate=0.0,
                       dropout_rng=None, return_lse=False, implementation=None,
                       interpret=True).problem
    assert uses_decode(problem) == expected


def test_api_decode_with_lse_and_gradients(kernel_mode):
    """Through `attention`: decode forward, generic backward, GQA + bias + causal."""
    case = Case(b=2, t=3, s=300, hq=8, hkv=2, d=64, causal=True, bias_shape=(8, 1, 300))
    q, k, v, bias, mask = make_inputs(case)
    interpret = interpret_flag(kernel_mode)

    def f(q, k, v, bias, impl):
        out, lse = ffpa_jax.attention(q, k, v, bias, is_causal=True, return_lse=True,
                                      implementation=impl, interpret=interpret and impl == "pallas")
        return out, lse

    out, lse = f(q, k, v, bias, "pallas")
    d_out, _ = cotangents(case)
    d_out = d_out.astype(q.dtype).astype(jnp.float32)  # the cotangent as the kernel sees it
    d_lse = jnp.full(lse.shape, 0.1, jnp.float32)
    (*ref_forward, ref), (*xla_forward, xla) = (
        reference_vjp(case, q, k, v, bias, mask, d_out, d_lse, float64=float64)
        for float64 in (True, False))
    assert_forward_matches(out, lse, ref_forward, xla_forward, case.dtype)

    @jax.jit
    def grads(q, k, v, bias):
        _, vjp = jax.vjp(lambda *a: f(*a, "pallas"), q, k, v, bias)
        return vjp((d_out.astype(q.dtype), d_lse))
    got = grads(q, k, v, bias)
    for name, g, r, x in zip(["dq", "dk", "dv", "dbias"], got, ref, xla):
        assert_matches_reference(name, g, r, x, q.dtype, factor=3.0)


# ----------------------------------------------------------------------------- heuristic
@pytest.mark.parametrize("batch,heads_kv,seq_k", [(8, 8, 8192), (1, 1, 131072), (1, 8, 300),
                                                  (64, 32, 4096), (1, 1, 1)])
def test_split_heuristic(batch, heads_kv, seq_k):
    config = DecodeConfig()
    splits = decode_num_splits(batch=batch, heads_kv=heads_kv, packed_rows=4, seq_k=seq_k,
                               head_dim_v=128, config=config, multiprocessors=132)
    cfg = config.fitted(4, seq_k, 128, 128)
    n_blocks = -(-seq_k // cfg.block_n)
    programs = batch * heads_kv * splits
    assert 1 <= splits <= max(1, n_blocks // 2)  # every split at least two key blocks
    # Enough programs for four waves when the keys allow (at most 128 splits).
    if n_blocks // 2 >= 4 * 132 // (batch * heads_kv):
        assert programs >= min(4 * 132, 128 * batch * heads_kv)
    if batch * heads_kv >= 4 * 132:
        assert splits == 1  # a full grid needs no split


# ----------------------------------------------------------------------------- lowering
@pytest.mark.parametrize("d", [64, 128, 256, 512, 1024, 1000])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_decode_lowers_for_cuda(d, dtype):
    sd = jax.ShapeDtypeStruct
    case = Case(d=d, dtype=jnp.dtype(dtype).name)
    config = _config(case)
    args = [sd((2, 3, 8, d), dtype), sd((2, 5000, 2, d), dtype), sd((2, 5000, 2, d), dtype),
            sd((1, 8, 3, 5000), jnp.float32), sd((2, 1, 1, 5000), jnp.bool_), sd((2,), jnp.uint32)]
    f = lambda q, k, v, b, m, seed: decode_attention(  # noqa: E731
        Problem.of(q, k, v, b, m, scale=0.1, causal=True, dropout_rate=0.1), config,
        Inputs(q, k, v, b, m, seed), num_splits=7)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


# ----------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
def test_decode_131072_keys_gpu():
    case = Case(b=1, t=1, s=131072, hq=8, hkv=2, d=128, bias_shape=(1, 8, 1, 131072))
    q, k, v, bias, mask = make_inputs(case)
    out = ffpa_jax.attention(q, k, v, bias, implementation="pallas")
    ref_out, _ = reference64(case, q, k, v, bias, mask)
    xla_out, _ = xla_same_precision(case, q, k, v, bias, mask)
    assert_matches_reference("out", out, ref_out, xla_out, case.dtype)


@pytest.mark.gpu
def test_decode_131072_keys_d512_gpu():
    case = Case(b=1, t=1, s=131072, hq=8, hkv=1, d=512)
    check_decode(case, "gpu")


def test_dataclass_replace_keeps_config_valid():
    """fitted() never produces a tile below Triton's 16 or above the problem's pow2."""
    cfg = dataclasses.replace(DecodeConfig(), block_n=256).fitted(3, 20, 40, 1000)
    assert (cfg.block_m, cfg.block_n, cfg.block_d, cfg.block_dv) == (16, 32, 64, 128)
