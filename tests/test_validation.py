"""Bad input raises ValueError/TypeError at trace time, before any kernel runs, with a
message naming the argument, what it got (value or shape) and what was expected.

Every bad call goes through the public `attention` on the Pallas path (interpret
mode unless the case says otherwise) under `jax.eval_shape`, with every kernel
and reference entry point of `ffpa_jax.api` replaced by a function that fails
the test: a bad call must be stopped by validation, never by a kernel.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
import ffpa_jax.api as api_module
from conftest import HAS_GPU
from ffpa_jax import validation

B, T, S, HQ, HKV, D = 2, 5, 7, 4, 2, 8


def arr(shape, dtype=jnp.bfloat16):
    # Shape/dtype carriers: validation must reject these before reading a value.
    return jax.ShapeDtypeStruct(shape, dtype)


def _attention_takes_autotune() -> bool:
    return "autotune" in inspect.signature(ffpa_jax.attention).parameters


@pytest.fixture
def no_kernels(monkeypatch):
    """Every kernel / reference entry point that ffpa_jax.api can reach fails the test (the
    dispatcher's plan may run: it is where a tier that cannot run here is refused)."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("a kernel or the reference was reached before validation failed")

    patched = []
    for name, obj in vars(api_module).items():
        module = getattr(obj, "__module__", "") or ""
        if callable(obj) and name != "plan_for" and (name == "_compute" or module.startswith((
                "ffpa_jax.vjp", "ffpa_jax.reference", "ffpa_jax.dropout", "pallas_kernels",
                "ffpa_jax.partitioning"))):
            monkeypatch.setattr(api_module, name, must_not_run)
            patched.append(name)
    assert "_compute" in patched, patched
    return patched


def call(q=None, k=None, v=None, bias=None, mask=None, **kw):
    q = arr((B, T, HQ, D)) if q is None else q
    k = arr((B, S, HKV, D)) if k is None else k
    v = arr((B, S, HKV, D)) if v is None else v
    kw.setdefault("implementation", "pallas")
    kw.setdefault("interpret", True)
    args = [q, k, v, bias, mask]
    traced = [i for i, x in enumerate(args) if isinstance(x, jax.ShapeDtypeStruct)]

    def f(*leaves):
        full = list(args)
        for i, leaf in zip(traced, leaves):
            full[i] = leaf
        return ffpa_jax.attention(*full, **kw)

    # eval_shape traces without running anything: an error here comes from
    # validation at trace time. Non-array arguments are passed as they are.
    return jax.eval_shape(f, *[args[i] for i in traced])


_KEY2 = jax.random.split(jax.random.key(0), 2)
_QKV_SHAPES = "(query (2, 5, 4, 8), key"  # how the size errors list the shapes

BAD_CALLS = [
    # (id, kwargs for call(), exception, words the message must contain: the argument,
    #  what it got, what was expected)
    # -- ranks
    ("query-rank-2", dict(q=arr((T, D))), ValueError, ["query", "(5, 8)", "[B, T, Hq, D]"]),
    ("query-rank-5", dict(q=arr((1, B, T, HQ, D))), ValueError,
     ["query", "(1, 2, 5, 4, 8)", "[B, T, Hq, D]"]),
    ("key-rank", dict(k=arr((S, HKV, D))), ValueError, ["key", "rank 4", "(7, 2, 8)"]),
    ("value-rank", dict(v=arr((B, S, HKV, D, 1))), ValueError,
     ["value", "rank 4", "(2, 7, 2, 8, 1)"]),
    ("unbatched-query-batched-key", dict(q=arr((T, HQ, D))), ValueError,
     ["key", "rank 3", "(2, 7, 2, 8)"]),
    # -- not arrays
    ("query-not-array", dict(q=[[1.0]]), TypeError, ["query", "list", "array"]),
    ("key-none", dict(k="keys"), TypeError, ["key", "str", "array"]),
    ("mask-list", dict(mask=[[True]]), TypeError, ["mask", "list", "array"]),
    # -- batch / sequence / heads / head dim mismatches
    ("batch-mismatch", dict(k=arr((3, S, HKV, D)), v=arr((3, S, HKV, D))), ValueError,
     ["key batch size 3", "query batch size 2"]),
    ("value-batch-mismatch", dict(v=arr((1, S, HKV, D))), ValueError,
     ["key and value", "(2, 7, 2, 8)", "(1, 7, 2, 8)"]),
    ("kv-seq-mismatch", dict(v=arr((B, S + 1, HKV, D))), ValueError,
     ["key and value", "sequence", "(2, 8, 2, 8)"]),
    ("kv-heads-mismatch", dict(v=arr((B, S, HKV + 1, D))), ValueError,
     ["key and value", "heads", "(2, 7, 3, 8)"]),
    ("head-dim-mismatch", dict(k=arr((B, S, HKV, D + 1)), v=arr((B, S, HKV, D + 1))), ValueError,
     ["key head dim 9", "query head dim 8", "(2, 7, 2, 9)"]),
    ("gqa-not-divisible", dict(k=arr((B, S, 3, D)), v=arr((B, S, 3, D))), ValueError,
     ["Hq=4", "Hkv=3", "multiple", _QKV_SHAPES]),
    ("kv-heads-above-q-heads", dict(k=arr((B, S, 8, D)), v=arr((B, S, 8, D))), ValueError,
     ["Hq=4", "Hkv=8", "multiple"]),
    ("kv-heads-zero", dict(k=arr((B, S, 0, D)), v=arr((B, S, 0, D))), ValueError,
     ["Hkv", ">= 1", "got 0", "(2, 7, 0, 8)"]),
    ("batch-zero", dict(q=arr((0, T, HQ, D)), k=arr((0, S, HKV, D)), v=arr((0, S, HKV, D))),
     ValueError, ["batch B", ">= 1", "got 0", "(0, 5, 4, 8)"]),
    # -- dtypes
    ("mixed-dtypes-key", dict(k=arr((B, S, HKV, D), jnp.float16)), TypeError,
     ["same dtype", "bfloat16, float16, bfloat16"]),
    ("mixed-dtypes-value", dict(v=arr((B, S, HKV, D), jnp.float32)), TypeError,
     ["same dtype", "bfloat16, bfloat16, float32"]),
    ("integer-dtype", dict(q=arr((B, T, HQ, D), jnp.int32), k=arr((B, S, HKV, D), jnp.int32),
                           v=arr((B, S, HKV, D), jnp.int32)), TypeError,
     ["query/key/value dtype", "int32", "float16, bfloat16, float32"]),
    ("bool-dtype", dict(q=arr((B, T, HQ, D), jnp.bool_), k=arr((B, S, HKV, D), jnp.bool_),
                        v=arr((B, S, HKV, D), jnp.bool_)), TypeError,
     ["query/key/value dtype", "bool", "float16, bfloat16, float32"]),
    ("mask-int", dict(mask=arr((T, S), jnp.int32)), TypeError,
     ["mask", "bool", "int32", "(5, 7)"]),
    ("mask-float", dict(mask=arr((T, S), jnp.float32)), TypeError, ["mask", "bool", "float32"]),
    ("bias-int", dict(bias=arr((T, S), jnp.int32)), TypeError,
     ["bias", "float", "int32", "(5, 7)"]),
    ("bias-bool", dict(bias=arr((T, S), jnp.bool_)), TypeError, ["bias", "float", "bool"]),
    # -- bias / mask broadcasting: each of the four dims, and too many dims
    ("bias-bad-S", dict(bias=arr((T, S + 1), jnp.float32)), ValueError,
     ["bias", "(5, 8)", "S", "expected 1 or 7"]),
    ("bias-bad-T", dict(bias=arr((T + 2, S), jnp.float32)), ValueError,
     ["bias", "(7, 7)", "T", "expected 1 or 5"]),
    ("bias-bad-H", dict(bias=arr((3, T, S), jnp.float32)), ValueError,
     ["bias", "(3, 5, 7)", "Hq", "expected 1 or 4"]),
    ("bias-bad-B", dict(bias=arr((5, 1, T, S), jnp.float32)), ValueError,
     ["bias", "(5, 1, 5, 7)", "B", "expected 1 or 2"]),
    ("bias-too-many-dims", dict(bias=arr((1, 1, 1, T, S), jnp.float32)), ValueError,
     ["bias", "5 dims", "at most 4", "(1, 1, 1, 5, 7)"]),
    ("mask-bad-S", dict(mask=arr((T, 3), jnp.bool_)), ValueError,
     ["mask", "(5, 3)", "S", "expected 1 or 7"]),
    ("mask-bad-T", dict(mask=arr((2, S), jnp.bool_)), ValueError,
     ["mask", "(2, 7)", "T", "expected 1 or 5"]),
    ("mask-bad-H", dict(mask=arr((2, 1, S), jnp.bool_)), ValueError,
     ["mask", "(2, 1, 7)", "Hq", "expected 1 or 4"]),
    ("mask-bad-B", dict(mask=arr((3, HQ, T, S), jnp.bool_)), ValueError,
     ["mask", "(3, 4, 5, 7)", "B", "expected 1 or 2"]),
    ("mask-too-many-dims", dict(mask=arr((1, B, HQ, T, S), jnp.bool_)), ValueError,
     ["mask", "5 dims", "at most 4"]),
    ("mask-4d-for-unbatched", dict(q=arr((T, HQ, D)), k=arr((S, HKV, D)), v=arr((S, HKV, D)),
                                   mask=arr((1, 1, T, S), jnp.bool_)), ValueError,
     ["mask", "4 dims", "at most 3", "[Hq, T, S]"]),
    ("mask-zero-dim", dict(mask=arr((T, 0), jnp.bool_)), ValueError,
     ["mask", "(5, 0)", "expected 1 or 7"]),
    # -- head dims and sequence lengths
    ("head-dim-0", dict(q=arr((B, T, HQ, 0)), k=arr((B, S, HKV, 0))), ValueError,
     ["head dim D", "1..1024", "got 0", "(2, 5, 4, 0)"]),
    ("head-dim-1025", dict(q=arr((B, T, HQ, 1025)), k=arr((B, S, HKV, 1025))), ValueError,
     ["head dim D", "1..1024", "got 1025"]),
    ("value-dim-0", dict(v=arr((B, S, HKV, 0))), ValueError,
     ["Dv", "1..1024", "got 0", "(2, 7, 2, 0)"]),
    ("value-dim-2048", dict(v=arr((B, S, HKV, 2048))), ValueError, ["Dv", "1..1024", "got 2048"]),
    ("T-zero", dict(q=arr((B, 0, HQ, D))), ValueError,
     ["query sequence length T", ">= 1", "got 0", "(2, 0, 4, 8)"]),
    ("S-zero", dict(k=arr((B, 0, HKV, D)), v=arr((B, 0, HKV, D))), ValueError,
     ["key/value sequence length S", ">= 1", "got 0", "(2, 0, 2, 8)"]),
    # -- dropout
    ("dropout-negative", dict(dropout_rate=-0.1), ValueError, ["dropout_rate", "[0, 1)", "-0.1"]),
    ("dropout-one", dict(dropout_rate=1.0), ValueError, ["dropout_rate", "[0, 1)", "1.0"]),
    ("dropout-above-one", dict(dropout_rate=1.5), ValueError, ["dropout_rate", "[0, 1)", "1.5"]),
    ("dropout-nan", dict(dropout_rate=float("nan")), ValueError, ["dropout_rate", "[0, 1)", "nan"]),
    ("dropout-not-number", dict(dropout_rate="0.1x"), TypeError,
     ["dropout_rate", "'0.1x'", "float in [0, 1)"]),
    ("dropout-no-key", dict(dropout_rate=0.1), ValueError,
     ["dropout_rate=0.1", "dropout_rng", "PRNG key", "None"]),
    ("dropout-float-key", dict(dropout_rate=0.1, dropout_rng=np.ones((3,), np.float32)),
     TypeError, ["dropout_rng", "PRNG key", "(3,)", "float32"]),
    ("dropout-int-key", dict(dropout_rate=0.1, dropout_rng=7), TypeError,
     ["dropout_rng", "PRNG key", "int"]),
    ("dropout-raw-key-wrong-shape", dict(dropout_rate=0.1, dropout_rng=np.ones((4,), np.uint32)),
     TypeError, ["dropout_rng", "PRNG key", "(4,)", "uint32"]),
    ("dropout-key-batch", dict(dropout_rate=0.1, dropout_rng=_KEY2), ValueError,
     ["dropout_rng", "single", "(2,)"]),
    ("dropout-garbage-key-at-rate-0", dict(dropout_rng="seed"), TypeError,
     ["dropout_rng", "PRNG key", "str"]),
    # -- scale
    ("scale-inf", dict(scale=float("inf")), ValueError, ["scale", "finite", "inf"]),
    ("scale-neg-inf", dict(scale=float("-inf")), ValueError, ["scale", "finite", "-inf"]),
    ("scale-nan", dict(scale=float("nan")), ValueError, ["scale", "finite", "nan"]),
    ("scale-string", dict(scale="big"), TypeError, ["scale", "'big'", "real number"]),
    ("scale-complex", dict(scale=1j), TypeError, ["scale", "1j", "real number"]),
    # -- implementation, flags
    ("implementation-unknown", dict(implementation="cuda"), ValueError,
     ["implementation", "'cuda'", "'pallas'", "'xla'"]),
    ("implementation-wrong-case", dict(implementation="XLA"), ValueError,
     ["implementation", "'XLA'", "'pallas'", "'xla'"]),
    ("pallas-without-gpu", dict(interpret=False), ValueError,
     ["implementation='pallas'", "NVIDIA GPU", "'cpu'", "interpret=True", "implementation='xla'"],
     pytest.mark.skipif(HAS_GPU, reason="this machine has a GPU")),
    ("is-causal-not-bool", dict(is_causal="yes"), TypeError, ["is_causal", "'yes'", "bool"]),
    ("return-lse-not-bool", dict(return_lse=1), TypeError, ["return_lse", "1", "bool"]),
    ("return-residual-not-bool", dict(return_residual="yes"), TypeError,
     ["return_residual", "'yes'", "bool"]),
    ("return-lse-and-residual", dict(return_lse=True, return_residual=True), ValueError,
     ["return_lse", "return_residual", "both True", "one"]),
    ("interpret-not-bool", dict(interpret="yes"), TypeError, ["interpret", "'yes'", "bool"]),
    # -- autotune (needs api.py to pass `autotune` to validation.validate)
    ("autotune-unknown", dict(autotune="slow"), ValueError,
     ["autotune", "'slow'", "'fast'", "'max'"]),
    ("autotune-wrong-case", dict(autotune="FAST"), ValueError, ["autotune", "'FAST'", "'fast'"]),
    ("autotune-not-str", dict(autotune=1), TypeError, ["autotune", "1", "int", "'fast'"]),
    ("autotune-bool", dict(autotune=True), TypeError, ["autotune", "True", "'max'"]),
    # -- the LLM features (issue 24)
    ("segment-ids-alone", dict(q_segment_ids=arr((B, T), jnp.int32)), ValueError,
     ["q_segment_ids", "without kv_segment_ids", "both"]),
    ("kv-segment-ids-alone", dict(kv_segment_ids=arr((B, S), jnp.int32)), ValueError,
     ["kv_segment_ids", "without q_segment_ids"]),
    ("segment-ids-shape", dict(q_segment_ids=arr((B, S), jnp.int32),
                               kv_segment_ids=arr((B, S), jnp.int32)), ValueError,
     ["q_segment_ids", "[B, T] = (2, 5)", "(2, 7)"]),
    ("kv-segment-ids-shape", dict(q_segment_ids=arr((B, T), jnp.int32),
                                  kv_segment_ids=arr((1, S), jnp.int32)), ValueError,
     ["kv_segment_ids", "[B, S] = (2, 7)", "(1, 7)"]),
    ("segment-ids-float", dict(q_segment_ids=arr((B, T), jnp.float32),
                               kv_segment_ids=arr((B, S), jnp.int32)), TypeError,
     ["q_segment_ids", "int32", "float32"]),
    ("segment-ids-int64", dict(q_segment_ids=np.zeros((B, T), np.int64),
                               kv_segment_ids=np.zeros((B, S), np.int64)), TypeError,
     ["q_segment_ids", "int32", "int64", "astype"]),
    ("segment-ids-list", dict(q_segment_ids=[[0] * T] * B, kv_segment_ids=arr((B, S), jnp.int32)),
     TypeError, ["q_segment_ids", "list", "array"]),
    ("query-lengths-shape", dict(query_seq_lengths=arr((B, 1), jnp.int32)), ValueError,
     ["query_seq_lengths", "[B] = (2,)", "(2, 1)"]),
    ("kv-lengths-dtype", dict(key_value_seq_lengths=arr((B,), jnp.float32)), TypeError,
     ["key_value_seq_lengths", "int32", "float32"]),
    ("kv-lengths-bool", dict(key_value_seq_lengths=arr((B,), jnp.bool_)), TypeError,
     ["key_value_seq_lengths", "int32", "bool"]),
    ("window-negative", dict(local_window_size=-1), ValueError,
     ["local_window_size", ">= 0", "-1"]),
    ("window-negative-right", dict(local_window_size=(4, -2)), ValueError,
     ["local_window_size", "(4, -2)", "right", "-2"]),
    ("window-three", dict(local_window_size=(1, 2, 3)), ValueError,
     ["local_window_size", "(1, 2, 3)", "pair"]),
    ("window-float", dict(local_window_size=2.5), TypeError,
     ["local_window_size", "2.5", "float", "int"]),
    ("window-bool", dict(local_window_size=True), TypeError, ["local_window_size", "True"]),
    ("cap-zero", dict(logits_soft_cap=0.0), ValueError, ["logits_soft_cap", "> 0", "0.0"]),
    ("cap-negative", dict(logits_soft_cap=-5), ValueError, ["logits_soft_cap", "> 0", "-5"]),
    ("cap-inf", dict(logits_soft_cap=float("inf")), ValueError,
     ["logits_soft_cap", "finite", "inf"]),
    ("cap-string", dict(logits_soft_cap="50"), TypeError, ["logits_soft_cap", "'50'", "str"]),
    ("sinks-shape", dict(sinks=arr((HKV,), jnp.float32)), ValueError,
     ["sinks", "[Hq] = (4,)", "(2,)"]),
    ("sinks-2d", dict(sinks=arr((1, HQ), jnp.float32)), ValueError, ["sinks", "(1, 4)"]),
    ("sinks-int", dict(sinks=arr((HQ,), jnp.int32)), TypeError, ["sinks", "float", "int32"]),
]


def _as_param(case):
    """(id, kwargs, exc, words[, mark]) -> pytest.param."""
    return pytest.param(*case[1:4], id=case[0], marks=case[4:])


def test_enough_distinct_bad_calls():
    assert len(BAD_CALLS) >= 40
    ids = [c[0] for c in BAD_CALLS]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("kwargs,exc,words", [_as_param(c) for c in BAD_CALLS])
def test_bad_input(kwargs, exc, words, no_kernels):
    if "autotune" in kwargs and not _attention_takes_autotune():
        pytest.fail("ffpa_jax.attention has no `autotune` keyword yet: api.py must accept it "
                    "and pass it to validation.validate")
    with pytest.raises(exc) as info:
        call(**kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


AUTOTUNE_BAD = [("slow", ValueError), ("", ValueError), ("Max", ValueError),
                (1, TypeError), (True, TypeError), (b"fast", TypeError)]


@pytest.mark.parametrize("mode,exc", AUTOTUNE_BAD, ids=repr)
def test_validate_rejects_unknown_autotune(mode, exc):
    q = arr((B, T, HQ, D))
    kv = arr((B, S, HKV, D))
    with pytest.raises(exc, match="autotune must be None, 'fast' or 'max'; got"):
        validation.validate(q, kv, kv, None, None, scale=None, is_causal=False, dropout_rate=0.0,
                            dropout_rng=None, return_lse=False, implementation=None,
                            interpret=False, autotune=mode)


@pytest.mark.parametrize("mode", [None, "fast", "max"])
def test_validate_accepts_autotune_modes(mode):
    q = arr((B, T, HQ, D))
    kv = arr((B, S, HKV, D))
    call = validation.validate(q, kv, kv, None, None, scale=None, is_causal=False,
                               dropout_rate=0.0, dropout_rng=None, return_lse=False,
                               implementation=None, interpret=False, autotune=mode)
    assert call.autotune == mode
    # The default is off.
    default = validation.validate(q, kv, kv, None, None, scale=None, is_causal=False,
                                  dropout_rate=0.0, dropout_rng=None, return_lse=False,
                                  implementation=None, interpret=False)
    assert default.autotune is None


def test_valid_calls_pass_validation(no_kernels):
    """The carriers above are valid when nothing is wrong: every bad call differs from a good
    one only in what its id names (the fixture makes the call stop at the first kernel)."""
    with pytest.raises(AssertionError, match="kernel or the reference was reached"):
        call(bias=arr((1, HQ, 1, S), jnp.float32), mask=arr((T, 1), jnp.bool_), is_causal=True,
             dropout_rate=0.1, dropout_rng=jax.random.key(1), scale=0.3)
    with pytest.raises(AssertionError, match="kernel or the reference was reached"):
        call(q=arr((T, HQ, D)), k=arr((S, HKV, D)), v=arr((S, HKV, 3)),
             dropout_rng=jax.random.PRNGKey(2))


def test_float64_inputs_are_rejected():
    """numpy float64 arrays keep their dtype (JAX would silently truncate them without x64)."""
    q = np.ones((B, T, HQ, D), np.float64)
    with pytest.raises(TypeError, match="float64"):
        ffpa_jax.attention(q, q[:, :, :HKV], q[:, :, :HKV])


def test_traced_scale_is_rejected():
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(TypeError, match="scale must be a static Python float"):
        jax.jit(lambda s: ffpa_jax.attention(q, q, q, scale=s, implementation="xla"))(0.5)


def test_traced_dropout_rate_is_rejected():
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(TypeError, match="dropout_rate must be a static Python float"):
        jax.jit(lambda r: ffpa_jax.attention(q, q, q, dropout_rate=r, dropout_rng=jax.random.key(0),
                                             implementation="xla"))(0.5)


def test_valid_feature_calls_pass_validation(no_kernels):
    """The features' carriers are valid when nothing is wrong (implementation=None: the
    fused kernels do not take them, and the call stops at the first kernel)."""
    z = lambda shape, dtype: jnp.zeros(shape, dtype)  # keyword arguments are not traced
    with pytest.raises(AssertionError, match="kernel or the reference was reached"):
        call(q_segment_ids=z((B, T), jnp.int32), kv_segment_ids=z((B, S), jnp.int16),
             query_seq_lengths=z((B,), jnp.int32), key_value_seq_lengths=z((B,), jnp.uint8),
             local_window_size=(3, 0), logits_soft_cap=np.float32(30.0),
             sinks=z((HQ,), jnp.bfloat16), implementation=None)
    with pytest.raises(AssertionError, match="kernel or the reference was reached"):
        call(q=arr((T, HQ, D)), k=arr((S, HKV, D)), v=arr((S, HKV, 3)),
             q_segment_ids=z((T,), jnp.int32), kv_segment_ids=z((S,), jnp.int32),
             query_seq_lengths=z((), jnp.int32), key_value_seq_lengths=z((1,), jnp.int32),
             local_window_size=4, implementation="chunked")


def test_traced_window_and_cap_are_rejected():
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(TypeError, match="logits_soft_cap must be a static Python float"):
        jax.jit(lambda c: ffpa_jax.attention(q, q, q, logits_soft_cap=c,
                                             implementation="xla"))(30.0)
    with pytest.raises(TypeError, match="local_window_size must be a static Python int"):
        jax.jit(lambda w: ffpa_jax.attention(q, q, q, local_window_size=(w, 0),
                                             implementation="xla"))(3)


def test_validation_runs_before_any_kernel_on_real_arrays(no_kernels):
    """Outside eval_shape, with concrete arrays, a bad call still never reaches a kernel."""
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="key head dim"):
        ffpa_jax.attention(q, jnp.ones((1, 4, 2, 9), jnp.bfloat16), q, interpret=True)
