"""Bad input raises ValueError/TypeError at trace time, before any kernel runs, with a
message naming the argument, what it got and what was expected."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax

B, T, S, HQ, HKV, D = 2, 5, 7, 4, 2, 8


def arr(shape, dtype=jnp.bfloat16):
    # Shape/dtype carriers: validation must reject these before reading a value.
    return jax.ShapeDtypeStruct(shape, dtype)


def call(q=None, k=None, v=None, bias=None, mask=None, **kw):
    q = arr((B, T, HQ, D)) if q is None else q
    k = arr((B, S, HKV, D)) if k is None else k
    v = arr((B, S, HKV, D)) if v is None else v
    # eval_shape traces without running anything: an error here comes from
    # validation at trace time, not from a kernel.
    return jax.eval_shape(lambda q, k, v, bias, mask: ffpa_jax.attention(
        q, k, v, bias, mask, implementation="xla", **kw), q, k, v, bias, mask)


BAD_CALLS = [
    # (id, kwargs for call(), exception, words the message must contain)
    ("query-rank-2", dict(q=arr((T, D))), ValueError, ["query", "(5, 8)", "[B, T, Hq, D]"]),
    ("query-rank-5", dict(q=arr((1, B, T, HQ, D))), ValueError, ["query", "[B, T, Hq, D]"]),
    ("key-rank", dict(k=arr((S, HKV, D))), ValueError, ["key", "rank 4", "(7, 2, 8)"]),
    ("value-rank", dict(v=arr((B, S, HKV, D, 1))), ValueError, ["value", "rank 4"]),
    ("batch-mismatch", dict(k=arr((3, S, HKV, D)), v=arr((3, S, HKV, D))), ValueError,
     ["key batch size 3", "query batch size 2"]),
    ("kv-seq-mismatch", dict(v=arr((B, S + 1, HKV, D))), ValueError, ["key and value", "(2, 8, 2, 8)"]),
    ("kv-heads-mismatch", dict(v=arr((B, S, HKV + 1, D))), ValueError, ["key and value"]),
    ("head-dim-mismatch", dict(k=arr((B, S, HKV, D + 1)), v=arr((B, S, HKV, D + 1))), ValueError,
     ["key head dim 9", "query head dim 8"]),
    ("gqa-not-divisible", dict(k=arr((B, S, 3, D)), v=arr((B, S, 3, D))), ValueError,
     ["Hq=4", "Hkv=3", "multiple"]),
    ("mixed-dtypes", dict(k=arr((B, S, HKV, D), jnp.float16)), TypeError,
     ["same dtype", "bfloat16", "float16"]),
    ("integer-dtype", dict(q=arr((B, T, HQ, D), jnp.int32), k=arr((B, S, HKV, D), jnp.int32),
                           v=arr((B, S, HKV, D), jnp.int32)), TypeError, ["int32", "float16, bfloat16, float32"]),
    ("mask-not-bool", dict(mask=arr((T, S), jnp.int32)), TypeError, ["mask", "bool", "int32"]),
    ("mask-float", dict(mask=arr((T, S), jnp.float32)), TypeError, ["mask", "bool", "float32"]),
    ("bias-int", dict(bias=arr((T, S), jnp.int32)), TypeError, ["bias", "float", "int32"]),
    ("bias-bool", dict(bias=arr((T, S), jnp.bool_)), TypeError, ["bias", "float", "bool"]),
    ("bias-bad-S", dict(bias=arr((T, S + 1), jnp.float32)), ValueError, ["bias", "S", "8", "expected 1 or 7"]),
    ("bias-bad-T", dict(bias=arr((T + 2, S), jnp.float32)), ValueError, ["bias", "T", "expected 1 or 5"]),
    ("bias-bad-H", dict(bias=arr((3, T, S), jnp.float32)), ValueError, ["bias", "Hq", "expected 1 or 4"]),
    ("bias-bad-B", dict(bias=arr((5, 1, T, S), jnp.float32)), ValueError, ["bias", "B", "expected 1 or 2"]),
    ("bias-too-many-dims", dict(bias=arr((1, 1, 1, T, S), jnp.float32)), ValueError,
     ["bias", "5 dims", "at most 4"]),
    ("mask-bad-S", dict(mask=arr((T, 3), jnp.bool_)), ValueError, ["mask", "S", "expected 1 or 7"]),
    ("mask-bad-T", dict(mask=arr((2, S), jnp.bool_)), ValueError, ["mask", "T", "expected 1 or 5"]),
    ("mask-bad-H", dict(mask=arr((2, 1, S), jnp.bool_)), ValueError, ["mask", "Hq", "expected 1 or 4"]),
    ("mask-bad-B", dict(mask=arr((3, HQ, T, S), jnp.bool_)), ValueError, ["mask", "B", "expected 1 or 2"]),
    ("mask-too-many-dims", dict(mask=arr((1, B, HQ, T, S), jnp.bool_)), ValueError, ["mask", "at most 4"]),
    ("head-dim-0", dict(q=arr((B, T, HQ, 0)), k=arr((B, S, HKV, 0))), ValueError, ["head dim D", "1..1024", "0"]),
    ("head-dim-1025", dict(q=arr((B, T, HQ, 1025)), k=arr((B, S, HKV, 1025))), ValueError,
     ["head dim D", "1..1024", "1025"]),
    ("value-dim-0", dict(v=arr((B, S, HKV, 0))), ValueError, ["Dv", "1..1024", "0"]),
    ("value-dim-2048", dict(v=arr((B, S, HKV, 2048))), ValueError, ["Dv", "1..1024", "2048"]),
    ("T-zero", dict(q=arr((B, 0, HQ, D))), ValueError, ["query sequence length T", ">= 1", "0"]),
    ("S-zero", dict(k=arr((B, 0, HKV, D)), v=arr((B, 0, HKV, D))), ValueError,
     ["key/value sequence length S", ">= 1", "0"]),
    ("dropout-negative", dict(dropout_rate=-0.1), ValueError, ["dropout_rate", "[0, 1)", "-0.1"]),
    ("dropout-one", dict(dropout_rate=1.0), ValueError, ["dropout_rate", "[0, 1)", "1.0"]),
    ("dropout-nan", dict(dropout_rate=float("nan")), ValueError, ["dropout_rate", "nan"]),
    ("dropout-not-number", dict(dropout_rate="0.1x"), TypeError, ["dropout_rate", "0.1x"]),
    ("dropout-no-key", dict(dropout_rate=0.1), ValueError, ["dropout_rng", "None"]),
    ("dropout-bad-key", dict(dropout_rate=0.1, dropout_rng=np.zeros((3,), np.float32)), TypeError,
     ["dropout_rng", "PRNG key", "(3,)"]),
    ("dropout-key-batch", dict(dropout_rate=0.1, dropout_rng=jax.random.split(jax.random.key(0), 2)),
     ValueError, ["dropout_rng", "single", "(2,)"]),
    ("scale-inf", dict(scale=float("inf")), ValueError, ["scale", "finite", "inf"]),
    ("scale-nan", dict(scale=float("nan")), ValueError, ["scale", "finite", "nan"]),
    ("scale-string", dict(scale="big"), TypeError, ["scale", "'big'"]),
    ("implementation-unknown", dict(implementation_override="cuda"), ValueError,
     ["implementation", "'cuda'", "'pallas'", "'xla'"]),
    ("is-causal-not-bool", dict(is_causal="yes"), TypeError, ["is_causal", "'yes'"]),
    ("return-lse-not-bool", dict(return_lse=1), TypeError, ["return_lse", "1"]),
    ("query-not-array", dict(q=[[1.0]]), TypeError, ["query", "list"]),
]


@pytest.mark.parametrize("kwargs,exc,words", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input(kwargs, exc, words):
    kwargs = dict(kwargs)
    if "implementation_override" in kwargs:
        impl = kwargs.pop("implementation_override")
        with pytest.raises(exc) as info:
            jax.eval_shape(lambda q, k, v: ffpa_jax.attention(q, k, v, implementation=impl),
                           arr((B, T, HQ, D)), arr((B, S, HKV, D)), arr((B, S, HKV, D)))
    else:
        with pytest.raises(exc) as info:
            call(**kwargs)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_float64_inputs_are_rejected():
    """numpy float64 arrays keep their dtype (JAX would silently truncate them without x64)."""
    q = np.ones((B, T, HQ, D), np.float64)
    with pytest.raises(TypeError, match="float64"):
        ffpa_jax.attention(q, q[:, :, :HKV], q[:, :, :HKV])


def test_pallas_without_gpu_says_how_to_run():
    if jax.devices()[0].platform == "gpu":
        pytest.skip("this machine has a GPU")
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError) as info:
        ffpa_jax.attention(q, q, q, implementation="pallas")
    assert "interpret=True" in str(info.value) and "implementation='xla'" in str(info.value)


def test_traced_scale_is_rejected():
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(TypeError, match="scale must be a static Python float"):
        jax.jit(lambda s: ffpa_jax.attention(q, q, q, scale=s, implementation="xla"))(0.5)


def test_dropout_not_yet_implemented_is_clear():
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="dropout_rate"):
        ffpa_jax.attention(q, q, q, dropout_rate=0.1, dropout_rng=jax.random.key(0))


def test_validation_runs_before_any_kernel(monkeypatch):
    """A bad call on the Pallas path never reaches the kernel wrapper."""
    import ffpa_jax.api as attention_module

    def must_not_run(*args, **kwargs):
        raise AssertionError("kernel reached")

    monkeypatch.setattr(attention_module, "pallas_attention", must_not_run)
    q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="key head dim"):
        ffpa_jax.attention(q, jnp.ones((1, 4, 2, 9), jnp.bfloat16), q, interpret=True)
