"""Input checks for `ffpa_jax.attention`, run at trace time before any kernel.

Every error names the argument, what it received and what was expected. The
result is a `Call`: the `Problem` (pallas_kernels.problem, the one description of
a problem every layer reads) and the call's own options.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ffpa_jax import context_local
from ffpa_jax.context_blocks import STRATEGIES
from ffpa_jax.layout import CONTIGUOUS, LAYOUTS
from pallas_kernels import tiers
from pallas_kernels.problem import FeatureArrays, Problem
from tuning import dispatch

MAX_HEAD_DIM = 1024
SUPPORTED_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
IMPLEMENTATIONS = dispatch.IMPLEMENTATIONS
# paged_attention: the fused tier's decode kernels, or the dense path.
PAGED_IMPLEMENTATIONS = (None, tiers.PALLAS.name, tiers.XLA.name)
AUTOTUNE_MODES = (None, "fast", "max")


class Context(NamedTuple):
    """A call's context-parallel options, checked: the mesh axis its sequence is split
    over (None: the call is not inside a `shard_map`; sequence-sharded inputs under jit
    then take `strategy`), its size, the layout and the strategy (resolved under an axis;
    else as given)."""

    axis: str | None
    parts: int
    layout: str
    strategy: str | None


class Call(NamedTuple):
    """A checked call: its problem (batched, bias/mask shapes 4-D; a shard's under
    `context_axis`), whether the caller's arrays had a batch dim, the runtime autotune mode
    (None, "fast" or "max") and the context-parallel options (None: none given)."""

    problem: Problem
    batched: bool
    autotune: str | None
    context: Context | None = None


# Integer dtypes that every id and length converts to int32 without loss (int64 and uint32
# would be truncated silently: they are refused instead).
_ID_DTYPES = tuple(jnp.dtype(t) for t in (jnp.int8, jnp.int16, jnp.int32, jnp.uint8,
                                          jnp.uint16))


def _names(choices) -> str:
    """None, 'a', 'b' or 'c': the allowed values of a choice, as a sentence."""
    words = [repr(c) for c in choices]
    return ", ".join(words[:-1]) + " or " + words[-1]


def _shape_str(x) -> str:
    return f"shape {tuple(x.shape)} dtype {jnp.dtype(x.dtype).name}"


def _require_array(name: str, x: Any) -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"{name} must be an array (jax.Array or numpy.ndarray); got "
                        f"{type(x).__name__}.")


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


def _shared_dtype(**arrays) -> jnp.dtype:
    """The one dtype the named arrays share, which must be float16, bfloat16 or float32."""
    names = list(arrays)
    dtypes = [jnp.dtype(x.dtype) for x in arrays.values()]
    if len(set(dtypes)) != 1:
        raise TypeError(f"{', '.join(names[:-1])} and {names[-1]} must have the same dtype; "
                        f"got {', '.join(d.name for d in dtypes)}.")
    if dtypes[0] not in SUPPORTED_DTYPES:
        raise TypeError(f"{'/'.join(names)} dtype must be one of float16, bfloat16, float32; "
                        f"got {dtypes[0].name}.")
    return dtypes[0]


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


def check_deterministic(deterministic: Any) -> None:
    """A TypeError unless `deterministic` is None, True or False."""
    if deterministic is not None and not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be None, True or False; got {deterministic!r} "
                        f"({type(deterministic).__name__}).")


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
            raise ValueError("dropout_rng must be a single PRNG key (shape ()); got shape "
                             f"{rng.shape}.")
        return
    if dtype == jnp.uint32 and rng.shape == (2,):  # legacy raw key from jax.random.PRNGKey
        return
    raise TypeError("dropout_rng must be a jax PRNG key (jax.random.key(...) or "
                    f"jax.random.PRNGKey(...)); got {_shape_str(rng)}.")


def _static_number(name: str, value: Any, what: str) -> Any:
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name} must be a static Python {what} (it shapes the computation); "
                        "got a traced value. Pass a Python number, not a jax array.")
    if isinstance(value, (jax.Array, np.ndarray)):
        if value.shape != ():
            raise TypeError(f"{name} must be a Python {what}; got an array of shape "
                            f"{tuple(value.shape)}.")
        value = value.item()
    return value


def _check_window(window: Any) -> tuple[int, int] | None:
    """`local_window_size` as jax.nn takes it: None, an int w (= (w, w)) or (left, right)."""
    if window is None:
        return None
    pair = (window, window) if not isinstance(window, (tuple, list)) else tuple(window)
    if len(pair) != 2:
        raise ValueError("local_window_size must be an int or a pair (left, right) of ints; "
                         f"got {window!r} ({len(pair)} entries).")
    out = []
    for side, value in zip(("left", "right"), pair):
        value = _static_number("local_window_size", value, "int")
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"local_window_size must be an int or a pair (left, right) of ints; "
                            f"got {window!r} (its {side} size is {type(value).__name__}).")
        if value < 0:
            raise ValueError(f"local_window_size must be >= 0 on both sides; got {window!r} "
                             f"(its {side} size is {int(value)}).")
        out.append(int(value))
    return out[0], out[1]


def _check_soft_cap(cap: Any) -> float | None:
    if cap is None:
        return None
    cap = _static_number("logits_soft_cap", cap, "float")
    if isinstance(cap, (bool, np.bool_)) or not isinstance(cap, numbers.Real):
        raise TypeError(f"logits_soft_cap must be a positive real number or None; got {cap!r} "
                        f"({type(cap).__name__}).")
    value = float(cap)
    if not (math.isfinite(value) and value > 0.0):
        raise ValueError(f"logits_soft_cap must be a finite number > 0; got {value}.")
    return value


def _check_ids(name: str, x: Any, shape: tuple[int, ...], dims: str) -> None:
    """An int array of exactly `shape`: segment ids or sequence lengths."""
    _require_array(name, x)
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {dims} = {shape}; got {_shape_str(x)}.")
    if jnp.dtype(x.dtype) not in _ID_DTYPES:
        raise TypeError(f"{name} must be int32 (or a narrower integer type); got "
                        f"{_shape_str(x)}. Convert with .astype(jnp.int32).")


def _check_features(*, batched: bool, b: int, t: int, s: int, hq: int, q_segment_ids,
                    kv_segment_ids, query_seq_lengths, key_value_seq_lengths, sinks) -> None:
    """Shapes and dtypes of the feature arrays (their values are data: never read here)."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        given, missing = (("q_segment_ids", "kv_segment_ids") if kv_segment_ids is None
                          else ("kv_segment_ids", "q_segment_ids"))
        raise ValueError(f"{given} was given without {missing}: packed sequences need both "
                         "(for self-attention pass the same ids as both).")
    if q_segment_ids is not None:
        _check_ids("q_segment_ids", q_segment_ids, (b, t) if batched else (t,),
                   "[B, T]" if batched else "[T]")
        _check_ids("kv_segment_ids", kv_segment_ids, (b, s) if batched else (s,),
                   "[B, S]" if batched else "[S]")
    for name, x in (("query_seq_lengths", query_seq_lengths),
                    ("key_value_seq_lengths", key_value_seq_lengths)):
        if x is None:
            continue
        _require_array(name, x)
        if not batched and tuple(x.shape) == ():
            x = jax.ShapeDtypeStruct((1,), x.dtype)
        _check_ids(name, x, (b,), "[B]" if batched else "[1] (or a scalar, without batch)")
    if sinks is not None:
        _require_array("sinks", sinks)
        if tuple(sinks.shape) != (hq,):
            raise ValueError(f"sinks must have shape [Hq] = ({hq},) (one logit per query "
                             f"head); got {_shape_str(sinks)}.")
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise TypeError(f"sinks must have a float dtype; got {_shape_str(sinks)}.")


def _check_context(problem: Problem, context_axis: Any, context_layout: Any,
                   context_strategy: Any, **placement) -> Context | None:
    """The context-parallel options of a call whose (shard's) problem is `problem`;
    `placement`: the call's implementation, interpret and deterministic (the strategy rule
    asks where the all-gather's blocks would run)."""
    if context_layout not in LAYOUTS:
        raise ValueError(f"context_layout must be one of {_names(LAYOUTS)}; got "
                         f"{context_layout!r}.")
    if context_strategy not in (None,) + STRATEGIES:
        raise ValueError(f"context_strategy must be one of {_names((None,) + STRATEGIES)}; "
                         f"got {context_strategy!r}.")
    if context_axis is None:
        if context_layout != CONTIGUOUS:
            raise ValueError(
                f"context_layout={context_layout!r} needs context_axis (the mesh axis of the "
                "enclosing shard_map that splits the sequence). Under jax.jit without a "
                "shard_map, sequence-sharded inputs are split contiguously.")
        if context_strategy is None:
            return None
        return Context(None, 1, CONTIGUOUS, context_strategy)
    if not isinstance(context_axis, str):
        raise TypeError(f"context_axis must be a mesh axis name (str) or None; got "
                        f"{context_axis!r} ({type(context_axis).__name__}).")
    try:
        parts = int(jax.lax.axis_size(context_axis))
    except NameError:
        raise ValueError(
            f"context_axis={context_axis!r} is not an axis of an enclosing shard_map: call "
            "attention inside jax.shard_map over a mesh with that axis, the sequence dim of "
            "query/key/value split over it (or, under jax.jit alone, shard the inputs along "
            "the sequence and pass no context_axis).") from None
    context_local.check_split(problem, parts, context_layout)
    whole = context_local.whole_problem(problem, parts)
    skips = functools.partial(context_local.gather_blocks_skip, whole, parts, context_layout,
                              **placement)
    strategy = context_local.choose_strategy(whole, parts, context_layout, context_strategy,
                                             gather_skips=skips)
    return Context(context_axis, parts, context_layout, strategy)


def validate(query, key, value, bias, mask, *, scale, is_causal, dropout_rate, dropout_rng,
             return_lse, implementation, interpret, dropout_broadcast=False,
             return_residual=False, autotune=None, local_window_size=None,
             logits_soft_cap=None, q_segment_ids=None, kv_segment_ids=None,
             query_seq_lengths=None, key_value_seq_lengths=None, sinks=None,
             context_axis=None, context_layout=CONTIGUOUS, context_strategy=None,
             deterministic=None) -> Call:
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

    dtype = _shared_dtype(query=query, key=key, value=value)

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
    for name, size in (("head dim D (query/key last dim)", d),
                       ("head dim Dv (value last dim)", dv)):
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
    for name, flag in (("return_lse", return_lse), ("return_residual", return_residual)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool; got {flag!r}.")
    if return_lse and return_residual:
        raise ValueError("return_lse and return_residual ask for the same lse in two forms "
                         "([B, Hq, T] float32 with its gradient, or jax.nn's [B, T, Hq] in "
                         "the query's dtype without); got both True: pass one.")
    if not isinstance(dropout_broadcast, (bool, np.bool_)):
        raise TypeError("dropout_broadcast must be a static Python bool (whether one keep-mask "
                        f"is shared by every batch row and head); got {dropout_broadcast!r}.")
    if not isinstance(interpret, (bool, np.bool_)):
        raise TypeError(f"interpret must be a bool; got {interpret!r}.")
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {_names(IMPLEMENTATIONS)}; got "
                         f"{implementation!r}.")

    scale_value = _check_scale(scale, d)
    rate = _check_dropout(dropout_rate, dropout_rng)
    autotune_mode = check_autotune(autotune)
    check_deterministic(deterministic)
    window = _check_window(local_window_size)
    cap = _check_soft_cap(logits_soft_cap)
    _check_features(batched=batched, b=b, t=t, s=s, hq=hq, q_segment_ids=q_segment_ids,
                    kv_segment_ids=kv_segment_ids, query_seq_lengths=query_seq_lengths,
                    key_value_seq_lengths=key_value_seq_lengths, sinks=sinks)

    shape4 = lambda x: None if x is None else (1,) * (4 - x.ndim) + tuple(x.shape)
    # The kernels' precise lse (slower at large D) only where it survives the residual's
    # rounding to the inputs' dtype.
    precise_lse = bool(return_lse or (return_residual and dtype == jnp.float32))
    problem = Problem(batch=b, seq_q=t, seq_k=s, heads_q=hq, heads_kv=hkv, head_dim=d,
                      head_dim_v=dv, dtype=dtype, scale=scale_value, causal=bool(is_causal),
                      dropout_rate=rate, dropout_broadcast=bool(dropout_broadcast),
                      bias_shape=shape4(bias), mask_shape=shape4(mask),
                      window=window, softcap=cap, segment_ids=q_segment_ids is not None,
                      q_lengths=query_seq_lengths is not None,
                      kv_lengths=key_value_seq_lengths is not None, sinks=sinks is not None,
                      return_lse=precise_lse)
    context = _check_context(problem, context_axis, context_layout, context_strategy,
                             implementation=implementation, interpret=bool(interpret),
                             deterministic=deterministic)
    return Call(problem=problem, batched=batched, autotune=autotune_mode, context=context)


def as_4d(x, batched: bool):
    """bias/mask with leading 1s up to [B, Hq, T, S] rank (no copy: a reshape)."""
    if x is None:
        return None
    rank = 4 if batched else 3
    x = jnp.reshape(x, (1,) * (rank - x.ndim) + tuple(x.shape))
    return x if batched else x[None]


def feature_arrays(batched: bool, *, q_segment_ids=None, kv_segment_ids=None,
                   query_seq_lengths=None, key_value_seq_lengths=None,
                   sinks=None) -> FeatureArrays:
    """The checked feature arrays, batched, ids and lengths as int32 and sinks as float32
    (sinks' gradient is returned in the caller's dtype by the cast's own transpose)."""
    def ids(x, rank):
        if x is None:
            return None
        x = jnp.asarray(x).astype(jnp.int32)
        return x if batched else x.reshape((1,) * (rank - x.ndim) + x.shape)
    return FeatureArrays(q_segment_ids=ids(q_segment_ids, 2),
                         kv_segment_ids=ids(kv_segment_ids, 2),
                         q_lengths=ids(query_seq_lengths, 1),
                         kv_lengths=ids(key_value_seq_lengths, 1),
                         sinks=None if sinks is None else jnp.asarray(sinks).astype(jnp.float32))


def _check_page_pools(k_pages: Any, v_pages: Any) -> tuple[int, int, int, int, int]:
    """k_pages [Hkv, P, page, D] and v_pages [Hkv, P, page, Dv] agreeing on [Hkv, P, page];
    returns (Hkv, P, page, D, Dv)."""
    for name, pages, last in (("k_pages", k_pages, "D"), ("v_pages", v_pages, "Dv")):
        _require_array(name, pages)
        if pages.ndim != 4:
            raise ValueError(f"{name} must be [Hkv, P, page, {last}] (a pool of P pages of "
                             f"page keys per KV head); got {_shape_str(pages)}.")
        if min(pages.shape) < 1:
            raise ValueError(f"{name} must have every dim >= 1; got {_shape_str(pages)}.")
    if tuple(v_pages.shape[:3]) != tuple(k_pages.shape[:3]):
        raise ValueError("k_pages and v_pages must agree on [Hkv, P, page]; got k_pages "
                         f"{tuple(k_pages.shape)} and v_pages {tuple(v_pages.shape)}.")
    return (*k_pages.shape, v_pages.shape[3])


def _check_block_tables(block_tables: Any, batch: int) -> None:
    _require_array("block_tables", block_tables)
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must be [B, pages_per_seq] with B = {batch}; got "
                         f"{_shape_str(block_tables)}.")
    if jnp.dtype(block_tables.dtype) not in _ID_DTYPES:
        raise TypeError(f"block_tables must be int32; got {_shape_str(block_tables)}.")


def _concrete(x) -> np.ndarray | None:
    """x's values when known at trace time (not a tracer), else None."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except Exception:  # noqa: BLE001  (anything not convertible is simply not checked)
        return None


def _check_tables(block_tables, lengths, *, n_pages: int, page: int) -> None:
    """Block-table entries in the pool and lengths within the table, where the values are
    known at trace time (the entries a sequence reads: those below its length)."""
    tables, lens = _concrete(block_tables), _concrete(lengths)
    per_seq = block_tables.shape[1]
    if lens is not None and lens.size and (lens.min() < 0 or lens.max() > per_seq * page):
        b = int(np.argmax((lens < 0) | (lens > per_seq * page)))
        raise ValueError(f"lengths[{b}] = {int(lens[b])} is outside [0, {per_seq * page}] "
                         f"(block_tables has {per_seq} pages of {page} keys per sequence).")
    if tables is None:
        return
    used = np.ones(tables.shape, bool)
    if lens is not None:
        used = np.arange(per_seq)[None, :] < -(-lens[:, None] // page)
    bad = used & ((tables < 0) | (tables >= n_pages))
    if bad.any():
        b, j = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"block_tables[{b}, {j}] = {int(tables[b, j])} is not a page of the "
                         f"pool: expected 0 <= entry < P = {n_pages}.")


def validate_paged(query, k_pages, v_pages, block_tables, lengths, *, scale,
                   local_window_size, logits_soft_cap, sinks, return_lse, implementation,
                   interpret) -> Call:
    """Check every argument of `paged_attention`; the problem is one query per sequence
    against S = pages_per_seq · page keys, with the lengths as key_value_seq_lengths."""
    _require_array("query", query)
    if query.ndim != 3:
        raise ValueError(f"query must be [B, Hq, D] (one token per sequence); got "
                         f"{_shape_str(query)}.")
    hkv, n_pages, page, dk, dv = _check_page_pools(k_pages, v_pages)
    b, hq, d = query.shape
    pools = f"(k_pages {tuple(k_pages.shape)}, v_pages {tuple(v_pages.shape)})"
    dtype = _shared_dtype(query=query, k_pages=k_pages, v_pages=v_pages)
    if dk != d:
        raise ValueError(f"k_pages head dim {dk} does not match query head dim {d} "
                         f"(query {tuple(query.shape)}, {pools[1:-1]}).")
    if b < 1 or hq < 1:
        raise ValueError(f"query must have B >= 1 and Hq >= 1; got {_shape_str(query)}.")
    if hq % hkv != 0:
        raise ValueError(f"query heads Hq={hq} must be a multiple of the pools' KV heads "
                         f"Hkv={hkv} (GQA/MQA) (query {tuple(query.shape)}, {pools[1:-1]}).")
    for name, size in (("head dim D", d), ("head dim Dv (v_pages' last dim)", dv)):
        if not 1 <= size <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be in 1..{MAX_HEAD_DIM}; got {size}.")
    _check_block_tables(block_tables, b)
    _check_ids("lengths", lengths, (b,), "[B]")
    _check_tables(block_tables, lengths, n_pages=n_pages, page=page)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse must be a bool; got {return_lse!r}.")
    if not isinstance(interpret, (bool, np.bool_)):
        raise TypeError(f"interpret must be a bool; got {interpret!r}.")
    if implementation not in PAGED_IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {_names(PAGED_IMPLEMENTATIONS)} for "
                         f"paged_attention; got {implementation!r}.")
    window = _check_window(local_window_size)
    if sinks is not None:
        _check_features(batched=True, b=b, t=1, s=1, hq=hq, q_segment_ids=None,
                        kv_segment_ids=None, query_seq_lengths=None,
                        key_value_seq_lengths=None, sinks=sinks)
    problem = Problem(batch=b, seq_q=1, seq_k=block_tables.shape[1] * page, heads_q=hq,
                      heads_kv=hkv, head_dim=d, head_dim_v=dv, dtype=dtype,
                      scale=_check_scale(scale, d), window=window,
                      softcap=_check_soft_cap(logits_soft_cap), kv_lengths=True,
                      sinks=sinks is not None)
    return Call(problem=problem, batched=True, autotune=None)


def validate_kv_update(k_pages, v_pages, key, value, block_tables, positions):
    """Check `update_kv_pages`' arguments; returns key and value as [B, T, Hkv, D|Dv]."""
    hkv, n_pages, page, d, dv = _check_page_pools(k_pages, v_pages)
    out = []
    for name, x, last in (("key", key, d), ("value", value, dv)):
        _require_array(name, x)
        if x.ndim == 3:
            x = x[:, None]
        if x.ndim != 4 or tuple(x.shape[2:]) != (hkv, last):
            raise ValueError(f"{name} must be [B, T, Hkv, {'D' if name == 'key' else 'Dv'}] "
                             f"or [B, Hkv, ...] with Hkv = {hkv} and last dim {last} (the "
                             f"pools'); got {_shape_str(x)}.")
        out.append(x)
    key, value = out
    b = key.shape[0]
    if tuple(value.shape[:2]) != tuple(key.shape[:2]):
        raise ValueError(f"key and value must agree on [B, T]; got key {tuple(key.shape)} and "
                         f"value {tuple(value.shape)}.")
    _check_block_tables(block_tables, b)
    _check_ids("positions", positions, (b,), "[B]")
    pos = _concrete(positions)
    if pos is not None and pos.size:
        capacity = block_tables.shape[1] * page
        ends = pos + key.shape[1]
        if pos.min() < 0 or ends.max() > capacity:
            i = int(np.argmax((pos < 0) | (ends > capacity)))
            raise ValueError(f"positions[{i}] = {int(pos[i])} with T = {key.shape[1]} new "
                             f"tokens does not fit the table: expected 0 <= positions and "
                             f"positions + T <= pages_per_seq * page = {capacity}.")
        _check_tables(block_tables, ends, n_pages=n_pages, page=page)
    return key, value
