"""`mosaic_attention_forward`: the Mosaic tier's forward entry point (padding to the
kernels' tiles, the choice between the "rows" and "wide" kernels)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.chunked import with_sinks
from pallas_kernels.mosaic.common import Walk
from pallas_kernels.mosaic.config import Config, default_config, round_up, runs_wide_kernel
from pallas_kernels.mosaic.rows import rows_forward
from pallas_kernels.mosaic.wide import wide_forward
from pallas_kernels.problem import FeatureArrays


def pad_axes(x, sizes):
    pads = [(0, sizes.get(i, n) - n) for i, n in enumerate(x.shape)]
    if not any(p for _, p in pads):
        return x
    return jnp.pad(x, pads)


def mosaic_attention_forward(
    q, k, v, *, scale: float, causal: bool, config: Config | None = None, out_dtype=None,
    window: tuple[int, int] | None = None, softcap: float | None = None,
    features: FeatureArrays | None = None
):
    """Returns (out [B,T,Hq,Dv], lse f32 [B,Hq,T]). `window` (left, right) and `softcap`
    as `ffpa_jax.attention`'s local_window_size and logits_soft_cap; `features`' sequence
    lengths and sinks as its query_seq_lengths, key_value_seq_lengths and sinks (the kernels
    walk a batch row's keys up to its key length; after them rows past a query length are
    set to out 0 and lse -inf, and the sinks join each row's denominator as one more block
    of keys, in float32), and its segment ids as q_segment_ids and kv_segment_ids (head
    dims up to 256: the "rows" kernel), and its positions (a block of a longer sequence:
    causality and the window take the positions' runtime shift). See the module
    docstring."""
    f = FeatureArrays() if features is None else features
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be [B, T|S, H, D]")
    B, T, Hq, D = q.shape
    Bk, S, Hkv, Dk = k.shape
    if (Bk, S, Hkv) != v.shape[:3] or Bk != B or Dk != D:
        raise ValueError(f"incompatible shapes {q.shape} {k.shape} {v.shape}")
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError("q, k, v must share a dtype")
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise NotImplementedError(f"dtype {q.dtype} (bf16 / f16 only)")
    Dv = v.shape[-1]
    if not (1 <= D <= 512 and 1 <= Dv <= 512 and T >= 1 and S >= 1):
        raise ValueError("need 1 <= D, Dv <= 512 and T, S >= 1")
    scale = float(scale)
    if not scale > 0.0:
        if scale < 0.0:
            q, scale = -q, -scale  # exact in bf16/f16
        else:
            raise ValueError("scale must be non-zero")
    out_dtype = jnp.dtype(q.dtype if out_dtype is None else out_dtype)
    if config is None:
        config = default_config(D, Dv, q.dtype, causal, gqa_group=Hq // Hkv,
                                segments=f.q_segment_ids is not None, window=window, seq_q=T)
    Dp, Dvp = round_up(D, 64), round_up(Dv, 64)
    wide = runs_wide_kernel(config, D, Dv)
    if wide:
        Dp, Dvp = round_up(D, 256), round_up(Dv, 256)
        fwd = wide_forward
    else:
        if max(Dp, Dvp) > 256:
            raise ValueError("the rows kernel supports D, Dv <= 256")
        fwd = rows_forward
    segments = {}  # the rows kernel's segment ids, where given
    if f.q_segment_ids is not None:
        if wide:
            raise NotImplementedError("segment ids on the Mosaic tier: D, Dv <= 256 only")
        segments = dict(segment_ids=(f.q_segment_ids, f.kv_segment_ids))
    # TMA tiles need the row dimension (T / S) to be a multiple of 8 and the
    # head dims to be multiples of 64 (zero columns do not change q.k).
    T8, S8 = round_up(T, 8), round_up(S, 8)
    qp = pad_axes(q, {1: T8, 3: Dp})
    kp = pad_axes(k, {1: S8, 3: Dp})
    vp = pad_axes(v, {1: S8, 3: Dvp})
    walk = Walk(T=T, S=S, causal=causal, block_kv=config.block_kv,
                window=None if window is None else tuple(int(x) for x in window),
                softcap=None if softcap is None else float(softcap), scale=scale,
                segments=bool(segments))
    q_lengths, kv_lengths = f.q_lengths, f.kv_lengths
    final_dtype = out_dtype
    if f.sinks is not None:  # joined in float32, then rounded once
        out_dtype = jnp.dtype(jnp.float32)
    out, lse = fwd(qp, kp, vp, walk, config=config, out_dtype=out_dtype,
                   kv_lengths=None if kv_lengths is None else kv_lengths.astype(jnp.int32),
                   positions=f.kernel_positions(), **segments)
    if Dvp != Dv or T8 != T:
        out = out[:, :T, :, :Dv]
    if lse.shape[-1] != T:
        lse = lse[..., :T]
    if q_lengths is not None:
        padding = jnp.arange(T)[None, :] >= q_lengths.astype(jnp.int32)[:, None]  # [B, T]
        out = jnp.where(padding[:, :, None, None], jnp.zeros((), out.dtype), out)
        lse = jnp.where(padding[:, None, :], -jnp.inf, lse)
    if f.sinks is not None:
        out, lse = with_sinks(out, lse, f.sinks)
        out = out.astype(final_dtype)
    return out, lse

