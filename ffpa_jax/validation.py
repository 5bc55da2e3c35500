"""Input checks for `ffpa_jax.attention`, run at trace time before any kernel.

Every error names the argument, what it received and what was expected. The
result is a `Call`: the `Problem` (pallas_kernels.problem, the one description of
a problem every layer reads) and the call's own options.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.problem import Problem

MAX_HEAD_DIM = 1024
SUPPORTED_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
IMPLEMENTATIONS = (None, "pallas", "chunked", "xla")
AUTOTUNE_MODES = (None, "fast", "max")


class Call(NamedTuple):
    """A checked call: its problem (batched, bias/mask shapes 4-D), whether the caller's
    arrays had a batch dim, and the runtime autotune mode (None, "fast" or "max")."""

    problem: Problem
    batched: bool
    autotune: str | None


def _shape_str(x) -> str:
    return f"shape {tuple(x.shape)} dtype {jnp.dtype(x.dtype).name}"


def _require_array(name: str, x: Any) -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array (jax.Array or numpy.ndarray); got {type(x).__name__}.")


def _check_broadcastable(name: str, shape: tuple[int, ...], target: tuple[int, ...],
                         dim_names: tuple[str, ...]) -> None:
    """numpy broadcasting to `target`, every dim 1 or full; no more dims than target."""
    if len(shape) > len(target):
        raise ValueError(
            f"{name} has {len(shape)} dims (shape {shape}); expected at most {len(target)}, "
            f"broadcastable to [{', '.join(dim_names)}] = {target}.")
    offset = len(target) - len(shape)
    for i, size in enumerate(shape):
        full = target[offset + i]
        if size not in (1, full):
            raise ValueError(
                f"{name} with shape {shape} is not broadcastable to [{', '.join(dim_names)}] = "
                f"{target}: its dim {i} (aligned to {dim_names[offset + i]}) is {size}, "
                f"expected 1 or {full}.")


def _check_scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, jax.core.Tracer):
        raise TypeError("scale must be a static Python float (it is baked into the kernel); "
                        "got a traced value. Pass a Python number, not a jax array.")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number or None; got {scale!r} "
                        f"({type(scale).__name__}).") from None
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite; got {value}.")
    return value


def _check_dropout(rate: Any, rng: Any) -> float:
    if isinstance(rate, jax.core.Tracer):
        raise TypeError("dropout_rate must be a static Python float; got a traced value.")
    try:
        rate = float(rate)
    except (TypeError, ValueError):
        raise TypeError(f"dropout_rate must be a float in [0, 1); got {rate!r}.") from None
    if math.isnan(rate) or not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1); got {rate}.")
    if rate > 0.0 and rng is None:
        raise ValueError(f"dropout_rate={rate} needs dropout_rng (a jax PRNG key); got None.")
    if rng is not None:  # checked even at rate 0: garbage here is a bug at the call site
        _check_prng_key(rng)
    return rate


def check_autotune(autotune: Any) -> str | None:
    """`autotune` normalised: None (off), "fast" or "max"; TypeError/ValueError otherwise."""
    if autotune is None:
        return None
    if not isinstance(autotune, str):
        raise TypeError(f"autotune must be None, 'fast' or 'max'; got {autotune!r} "
                        f"({type(autotune).__name__}).")
    if autotune not in AUTOTUNE_MODES:
        raise ValueError(f"autotune must be None, 'fast' or 'max'; got {autotune!r}.")
    return autotune


def _check_prng_key(rng: Any) -> None:
    dtype = getattr(rng, "dtype", None)
    if dtype is None:
        raise TypeError(f"dropout_rng must be a jax PRNG key; got {type(rng).__name__}.")
    if jnp.issubdtype(dtype, jax.dtypes.prng_key):
        if rng.shape != ():
            raise ValueError(f"dropout_rng must be a single PRNG key (shape ()); got shape {rng.shape}.")
        return
    if dtype == jnp.uint32 and rng.shape == (2,):  # legacy raw key from jax.random.PRNGKey
        return
    raise TypeError("dropout_rng must be a jax PRNG key (jax.random.key(...) or "
                    f"jax.random.PRNGKey(...)); got {_shape_str(rng)}.")


def validate(query, key, value, bias, mask, *, scale, is_causal, dropout_rate, dropout_rng,
             return_lse, implementation, interpret, autotune=None, deterministic=None) -> Call:
    """Check every argument of `attention`; return the checked `Call`."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        _require_array(name, x)
    if query.ndim not in (3, 4):
        raise ValueError(f"query must be [B, T, Hq, D] or [T, Hq, D]; got {_shape_str(query)}.")
    expected_rank = query.ndim
    layout = "[B, S, Hkv, {}]" if expected_rank == 4 else "[S, Hkv, {}]"
    for name, x, last in (("key", key, "D"), ("value", value, "Dv")):
        if x.ndim != expected_rank:
            raise ValueError(f"{name} must be {layout.format(last)} (rank {expected_rank}, like "
                             f"query {tuple(query.shape)}); got {_shape_str(x)}.")

    batched = expected_rank == 4
    q_shape = tuple(query.shape) if batched else (1, *query.shape)
    k_shape = tuple(key.shape) if batched else (1, *key.shape)
    v_shape = tuple(value.shape) if batched else (1, *value.shape)
    b, t, hq, d = q_shape
    _, s, hkv, dk = k_shape
    dv = v_shape[3]

    dtypes = {jnp.dtype(x.dtype) for x in (query, key, value)}
    if len(dtypes) != 1:
        raise TypeError("query, key and value must have the same dtype; got "
                        f"{jnp.dtype(query.dtype).name}, {jnp.dtype(key.dtype).name}, "
                        f"{jnp.dtype(value.dtype).name}.")
    dtype = dtypes.pop()
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"query/key/value dtype must be one of float16, bfloat16, float32; "
                        f"got {dtype.name}.")

    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError("key and value must agree on batch, sequence and heads; got key "
                         f"{tuple(key.shape)} and value {tuple(value.shape)}.")
    if batched and k_shape[0] != b:
        raise ValueError(f"key batch size {k_shape[0]} does not match query batch size {b} "
                         f"(query {tuple(query.shape)}, key {tuple(key.shape)}).")
    if dk != d:
        raise ValueError(f"key head dim {dk} does not match query head dim {d} "
                         f"(query {tuple(query.shape)}, key {tuple(key.shape)}).")
    shapes = f"(query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)})"
    for name, size in (("query sequence length T", t), ("key/value sequence length S", s)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1; got {size} {shapes}.")
    for name, size in (("query heads Hq", hq), ("key/value heads Hkv", hkv), ("batch B", b)):
        if size < 1:
            raise ValueError(f"{name} must be >= 1; got {size} {shapes}.")
    if hq % hkv != 0:
        raise ValueError(f"query heads Hq={hq} must be a multiple of key/value heads Hkv={hkv} "
                         f"(GQA/MQA) {shapes}.")
    for name, size in (("head dim D (query/key last dim)", d), ("head dim Dv (value last dim)", dv)):
        if not 1 <= size <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be in 1..{MAX_HEAD_DIM}; got {size} {shapes}.")

    target = (b, hq, t, s) if batched else (hq, t, s)
    dim_names = ("B", "Hq", "T", "S") if batched else ("Hq", "T", "S")
    if bias is not None:
        _require_array("bias", bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise TypeError(f"bias must have a float dtype; got {_shape_str(bias)}.")
        _check_broadcastable("bias", tuple(bias.shape), target, dim_names)
    if mask is not None:
        _require_array("mask", mask)
        if jnp.dtype(mask.dtype) != jnp.bool_:
            raise TypeError(f"mask must be bool (True = attend); got {_shape_str(mask)}.")
        _check_broadcastable("mask", tuple(mask.shape), target, dim_names)

    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool; got {is_causal!r}.")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool; got {return_lse!r}.")
    if not isinstance(interpret, (bool, np.bool_)):
        raise TypeError(f"interpret must be a bool; got {interpret!r}.")
    if deterministic is not None and not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError("deterministic must be None (XLA's --xla_gpu_deterministic_ops "
                        f"decides), True or False; got {deterministic!r}.")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError("implementation must be None, 'pallas', 'chunked' or 'xla'; got "
                         f"{implementation!r}.")

    scale_value = _check_scale(scale, d)
    rate = _check_dropout(dropout_rate, dropout_rng)
    autotune_mode = check_autotune(autotune)

    shape4 = lambda x: None if x is None else (1,) * (4 - x.ndim) + tuple(x.shape)
    problem = Problem(batch=b, seq_q=t, seq_k=s, heads_q=hq, heads_kv=hkv, head_dim=d,
                      head_dim_v=dv, dtype=dtype, scale=scale_value, causal=bool(is_causal),
                      dropout_rate=rate, bias_shape=shape4(bias), mask_shape=shape4(mask))
    return Call(problem=problem, batched=batched, autotune=autotune_mode)


def as_4d(x, batched: bool):
    """bias/mask with leading 1s up to [B, Hq, T, S] rank (no copy: a reshape)."""
    if x is None:
        return None
    rank = 4 if batched else 3
    x = jnp.reshape(x, (1,) * (rank - x.ndim) + tuple(x.shape))
    return x if batched else x[None]
