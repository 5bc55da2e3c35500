"""The fused elementwise steps of the chunked tier, between its library GEMMs.

The chunked tier computes a block of queries against a block of keys as large matrix
products; these kernels are what runs between them, one pass over the block each:

- `softmax_rows`: float32 logits q·kᵀ [B, Hq, R, K] -> probabilities P in the value dtype
  (scale, bias, soft cap, mask, causality, window, segment ids, lengths, softmax over the
  block's keys, dropout) and the rows' lse.
  A program holds whole rows, so each logit is read once.
- `softmax_grad`: logits and dP = dO·Vᵀ [B, Hq, R, K] with the rows' lse and
  δ = rowsum(dO·O) - dlse -> the dropped P (for dV = Pᵀ·dO) and dS = P·(dP - δ) (for
  dQ = dS·K and dK = dSᵀ·Q) in the input dtype, optionally dS's low word and dS in float32;
  dS of the logits before the soft cap.

The block sits at global row r0 and key c0 of the problem (`offsets`, a runtime int32[2]):
bias, mask, causality and the dropout keep decisions are taken at global positions, so
every block agrees with the fused kernels and with `dropout.keep_mask_reference`. Bias and
mask are the problem's 4-D arrays with broadcast dims of size 1 (read with stride 0); the
segment ids ([B, T] and [B, S]) are read at the tile's own rows and keys, the lengths [B]
once per program.
Natural-log units throughout, like XLA's softmax.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common, compat, dropout
from pallas_kernels.common import cdiv, i32, iota
from pallas_kernels.problem import FeatureArrays

# Whole rows live in registers: the widest key block `softmax_rows` takes.
MAX_ROW_KEYS = 16384


@dataclasses.dataclass(frozen=True)
class BlockStatic:
    """What both kernels know at trace time."""

    seq_q: int  # the problem's T and S (for causality and the bias/mask bounds)
    seq_k: int
    heads_q: int
    scale: float
    causal: bool
    bias_shape: tuple[int, ...] | None
    mask_shape: tuple[int, ...] | None
    dropout_rate: float
    interpret: bool
    block_m: int
    block_n: int
    num_warps: int
    window: tuple[int, int] | None = None
    softcap: float | None = None
    # Which of the visibility arrays (q/kv segment ids, q lengths, kv lengths) are inputs.
    segment_ids: bool = False
    q_lengths: bool = False
    kv_lengths: bool = False


def _static(logits, bias, mask, *, seq_q, seq_k, scale, causal, dropout_rate, interpret,
            block_m, block_n, num_warps, window=None, softcap=None,
            features=None) -> BlockStatic:
    f = FeatureArrays() if features is None else features
    return BlockStatic(seq_q=seq_q, seq_k=seq_k, heads_q=logits.shape[1], scale=float(scale),
                       causal=bool(causal),
                       bias_shape=None if bias is None else tuple(bias.shape),
                       mask_shape=None if mask is None else tuple(mask.shape),
                       dropout_rate=float(dropout_rate), interpret=interpret,
                       block_m=block_m, block_n=block_n, num_warps=num_warps,
                       window=None if window is None else tuple(window),
                       softcap=None if softcap is None else float(softcap),
                       segment_ids=f.q_segment_ids is not None,
                       q_lengths=f.q_lengths is not None, kv_lengths=f.kv_lengths is not None)


@dataclasses.dataclass(frozen=True)
class _FeatureRefs:
    """The visibility arrays' refs of a kernel (None where not given)."""

    q_ids: object = None
    kv_ids: object = None
    q_len: object = None
    kv_len: object = None


def _feature_keep(st: BlockStatic, fr: _FeatureRefs, b, row_start, bm: int, col_start,
                  bn: int):
    """bool [bm, bn] (or None): the window, segments and lengths at the global rows
    [row_start, row_start + bm) × keys [col_start, col_start + bn) of batch `b` (ids out of
    range read as 0: the callers mask those rows and keys)."""
    keep = None
    rows, cols = row_start + iota(bm), col_start + iota(bn)

    def both(a, x):
        return x if a is None else a & x
    if st.window is not None:
        shifted = rows[:, None] + (st.seq_k - st.seq_q)
        keep = ((cols[None, :] >= shifted - st.window[0])
                & (cols[None, :] <= shifted + st.window[1]))
    if fr.q_ids is not None:
        q_ids = plgpu.load(fr.q_ids.at[i32(b), common.ds(row_start, bm)],
                           mask=rows < st.seq_q, other=0)
        kv_ids = plgpu.load(fr.kv_ids.at[i32(b), common.ds(col_start, bn)],
                            mask=cols < st.seq_k, other=0)
        keep = both(keep, q_ids[:, None] == kv_ids[None, :])
    if fr.q_len is not None:
        keep = both(keep, (rows < fr.q_len[i32(b)])[:, None])
    if fr.kv_len is not None:
        keep = both(keep, (cols < fr.kv_len[i32(b)])[None, :])
    return keep


def _capped(st: BlockStatic, s):
    """(c·tanh(s / c), its derivative 1 - tanh²) under a soft cap, else (s, None)."""
    if st.softcap is None:
        return s, None
    t = jnp.tanh(s / st.softcap)
    return st.softcap * t, 1.0 - t * t


def _scores(st: BlockStatic, logits, bias_ref, mask_ref, b, h, row_start, col_start,
            fr: _FeatureRefs | None = None, with_cap_grad: bool = False):
    """scale·logits + bias, soft-capped, then mask, causality, window, segments and lengths
    as -inf, for the tile of `logits` whose first element sits at global query row
    `row_start` and key `col_start`. With `with_cap_grad`, also the soft cap's derivative
    (None without a cap)."""
    bm, bn = logits.shape
    s = logits * st.scale
    if bias_ref is not None:
        bias = common.load_broadcast_tile(
            bias_ref, common.broadcast_index(b, st.bias_shape[0]),
            common.broadcast_index(h, st.bias_shape[1]), row_start, bm, col_start, bn,
            n_rows=st.seq_q, n_cols=st.seq_k, other=0)
        s = s + bias.astype(jnp.float32)
    s, cap_grad = _capped(st, s)
    if mask_ref is not None:
        keep = common.load_broadcast_tile(
            mask_ref, common.broadcast_index(b, st.mask_shape[0]),
            common.broadcast_index(h, st.mask_shape[1]), row_start, bm, col_start, bn,
            n_rows=st.seq_q, n_cols=st.seq_k, other=False)
        s = jnp.where(keep, s, -jnp.inf)
    if st.causal:
        rows, cols = row_start + iota(bm), col_start + iota(bn)
        s = jnp.where(cols[None, :] <= rows[:, None] + (st.seq_k - st.seq_q), s, -jnp.inf)
    if fr is not None:
        keep = _feature_keep(st, fr, b, row_start, bm, col_start, bn)
        if keep is not None:
            s = jnp.where(keep, s, -jnp.inf)
    return (s, cap_grad) if with_cap_grad else s


def _refs(st: BlockStatic, refs):
    """(named inputs..., outputs) of a kernel's refs in the order the wrappers pass them."""
    refs = list(refs)
    bias_ref = refs.pop(0) if st.bias_shape is not None else None
    mask_ref = refs.pop(0) if st.mask_shape is not None else None
    seed_ref = refs.pop(0) if st.dropout_rate > 0 else None
    return bias_ref, mask_ref, seed_ref, refs


def _feature_refs(st: BlockStatic, refs: list) -> _FeatureRefs:
    """The visibility arrays' refs, popped from the front of `refs` (after the seed)."""
    q_ids = refs.pop(0) if st.segment_ids else None
    kv_ids = refs.pop(0) if st.segment_ids else None
    q_len = refs.pop(0) if st.q_lengths else None
    kv_len = refs.pop(0) if st.kv_lengths else None
    return _FeatureRefs(q_ids=q_ids, kv_ids=kv_ids, q_len=q_len, kv_len=kv_len)


def _keep(st: BlockStatic, seed_ref, b, h, rows, c0, n_cols: int):
    if seed_ref.shape[0] == 4:  # a shard's global batch and head offsets
        b = b + seed_ref[2]
        h = h + seed_ref[3]
    return dropout.keep_tile(seed_ref, b, h, rows, c0, n_cols, rate=st.dropout_rate,
                             on_gpu=not st.interpret)


def _softmax_rows_kernel(logits_ref, offsets_ref, *refs, st: BlockStatic, n_rows: int,
                         n_keys: int):
    bias_ref, mask_ref, seed_ref, rest = _refs(st, refs)
    fr = _feature_refs(st, rest)
    p_ref, lse_ref = rest
    bm, bk = st.block_m, st.block_n
    r = pl.program_id(0) * bm + iota(bm)
    bh = pl.program_id(1)
    b, h = bh // st.heads_q, bh % st.heads_q
    r0, c0 = offsets_ref[0], offsets_ref[1]
    j = iota(bk)
    row_ok = r < n_rows
    col_ok = j < n_keys
    view = logits_ref.at[i32(b), i32(h), common.ds(pl.program_id(0) * bm, bm), common.ds(0, bk)]
    logits = plgpu.load(view, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    s = _scores(st, logits, bias_ref, mask_ref, b, h, r0 + pl.program_id(0) * bm, c0, fr)
    s = jnp.where(col_ok[None, :], s, -jnp.inf)
    m = jnp.max(s, axis=1)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    e = jnp.exp(s - m_safe[:, None])
    total = jnp.sum(e, axis=1)
    has_keys = total > 0.0
    safe = jnp.where(has_keys, total, 1.0)
    p = e / safe[:, None]
    if seed_ref is not None:
        keep = _keep(st, seed_ref, b, h, r0 + r, c0, bk)
        p = jnp.where(keep, p / (1.0 - st.dropout_rate), 0.0)
    plgpu.store(p_ref.at[i32(b), i32(h), common.ds(pl.program_id(0) * bm, bm), common.ds(0, bk)],
                p.astype(p_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])
    lse = jnp.where(has_keys, m_safe + jnp.log(safe), -jnp.inf)
    plgpu.store(lse_ref.at[i32(b), i32(h), common.ds(pl.program_id(0) * bm, bm)], lse,
                mask=row_ok)


def _inputs(bias, mask, dropout_rate, seed, features=None) -> list:
    f = FeatureArrays() if features is None else features
    visibility = [x for x in (f.q_segment_ids, f.kv_segment_ids, f.q_lengths, f.kv_lengths)
                  if x is not None]
    return (([bias] if bias is not None else []) + ([mask] if mask is not None else [])
            + common.seed_inputs(dropout_rate, seed) + visibility)


def row_block(n_keys: int) -> tuple[int, int, int]:
    """(rows per program, key tile, warps) of `softmax_rows` for a block of `n_keys` keys."""
    bk = common.fit_block(n_keys, n_keys)
    if bk > MAX_ROW_KEYS:
        raise ValueError(f"softmax_rows holds whole rows of at most {MAX_ROW_KEYS} keys; "
                         f"got {n_keys}")
    return max(1, min(16, 4096 // bk)), bk, 16 if bk >= 8192 else 8 if bk >= 1024 else 4


def softmax_rows(logits, offsets, bias=None, mask=None, seed=None, *, seq_q: int, seq_k: int,
                 scale: float, causal: bool, dropout_rate: float = 0.0, out_dtype,
                 interpret: bool = False, window: tuple[int, int] | None = None,
                 softcap: float | None = None,
                 features: FeatureArrays | None = None) -> tuple[jax.Array, jax.Array]:
    """(P [B, Hq, R, K] in `out_dtype`, lse [B, Hq, R] float32) of a block of float32 logits
    [B, Hq, R, K] at global (row, key) `offsets` (int32[2]); see the module docstring. Rows
    that see no key of the block get P = 0 and lse = -inf. K <= MAX_ROW_KEYS. `window`,
    `softcap` and `features` (its segment ids and lengths; not its sinks) as in
    `ffpa_jax.attention`."""
    batch, heads, n_rows, n_keys = logits.shape
    bm, bk, warps = row_block(n_keys)
    st = _static(logits, bias, mask, seq_q=seq_q, seq_k=seq_k, scale=scale, causal=causal,
                 dropout_rate=dropout_rate, interpret=interpret, block_m=bm, block_n=bk,
                 num_warps=warps, window=window, softcap=softcap, features=features)
    compat.silence_triton_deprecation()
    out_shape = (compat.output_struct(logits.shape, out_dtype, logits),
                 compat.output_struct((batch, heads, n_rows), jnp.float32, logits))
    return pl.pallas_call(
        functools.partial(_softmax_rows_kernel, st=st, n_rows=n_rows, n_keys=n_keys),
        out_shape=out_shape, grid=(cdiv(n_rows, bm), batch * heads),
        compiler_params=compat.compiler_params(warps, 1), interpret=interpret,
        name="softmax_rows",
    )(logits, offsets.astype(jnp.int32), *_inputs(bias, mask, dropout_rate, seed, features))


def _softmax_grad_kernel(logits_ref, dp_ref, lse_ref, delta_ref, offsets_ref, *refs,
                         st: BlockStatic, n_rows: int, n_keys: int, split: bool,
                         with_ds32: bool, own_delta: bool):
    bias_ref, mask_ref, seed_ref, outs = _refs(st, refs)
    fr = _feature_refs(st, outs)
    pd_ref, ds_ref, *rest = outs
    lo_ref = rest.pop(0) if split else None
    ds32_ref = rest.pop(0) if with_ds32 else None
    bm, bn = st.block_m, st.block_n
    n_col_blocks = cdiv(n_keys, bn)
    row_block_index, col_block = pl.program_id(0) // n_col_blocks, pl.program_id(0) % n_col_blocks
    bh = pl.program_id(1)
    b, h = bh // st.heads_q, bh % st.heads_q
    r0, c0 = offsets_ref[0], offsets_ref[1]
    rs, cs = row_block_index * bm, col_block * bn
    r, j = rs + iota(bm), cs + iota(bn)
    ok = (r < n_rows)[:, None] & (j < n_keys)[None, :]

    def tile(ref, other=0.0):
        return plgpu.load(ref.at[i32(b), i32(h), common.ds(rs, bm), common.ds(cs, bn)],
                          mask=ok, other=other)

    row_lse = plgpu.load(lse_ref.at[i32(b), i32(h), common.ds(rs, bm)], mask=r < n_rows,
                         other=-jnp.inf)
    delta = plgpu.load(delta_ref.at[i32(b), i32(h), common.ds(rs, bm)], mask=r < n_rows,
                       other=0.0)
    s, cap_grad = _scores(st, tile(logits_ref), bias_ref, mask_ref, b, h, r0 + rs, c0 + cs, fr,
                          with_cap_grad=True)
    finite = row_lse != -jnp.inf
    p = jnp.where(ok & finite[:, None],
                  jnp.exp(s - jnp.where(finite, row_lse, 0.0)[:, None]), 0.0)
    dp = tile(dp_ref).astype(jnp.float32)
    dropped = p
    if seed_ref is not None:
        keep = _keep(st, seed_ref, b, h, r0 + r, c0 + cs, bn)
        inv = 1.0 - st.dropout_rate
        dropped = jnp.where(keep, p / inv, 0.0)
        dp = jnp.where(keep, dp / inv, 0.0)
    if own_delta:  # the tile holds whole rows: δ from its own P and dP
        delta = jnp.sum(p * dp, axis=1) + delta
    ds = p * (dp - delta[:, None])
    if cap_grad is not None:
        ds = ds * cap_grad

    def store(ref, value):
        plgpu.store(ref.at[i32(b), i32(h), common.ds(rs, bm), common.ds(cs, bn)],
                    value.astype(ref.dtype), mask=ok)

    store(pd_ref, dropped)
    hi = ds.astype(ds_ref.dtype)
    store(ds_ref, hi)
    if lo_ref is not None:
        store(lo_ref, ds - hi.astype(jnp.float32))
    if ds32_ref is not None:
        store(ds32_ref, ds)


def grad_block(n_keys: int, own_delta: bool) -> tuple[int, int, int]:
    """(rows, keys, warps) of a `softmax_grad` tile: whole rows with `own_delta`."""
    if own_delta:
        return row_block(n_keys)
    return 64, common.fit_block(min(n_keys, 128), n_keys), 4


def softmax_grad(logits, dp, lse, delta, offsets, bias=None, mask=None, seed=None, *,
                 seq_q: int, seq_k: int, scale: float, causal: bool, dropout_rate: float = 0.0,
                 out_dtype, split: bool = False, with_ds32: bool = False,
                 own_delta: bool = False, interpret: bool = False,
                 window: tuple[int, int] | None = None, softcap: float | None = None,
                 features: FeatureArrays | None = None) -> tuple[jax.Array, ...]:
    """(dropped P, dS[, dS's low word][, dS float32]) of a block, each [B, Hq, R, K]; P and
    dS in `out_dtype`. logits [B, Hq, R, K] float32, dp [B, Hq, R, K] (float32 or the input
    dtype); lse and delta [B, Hq, R]: δ = rowsum(dO·O) - dlse, or with `own_delta` (the
    block holds all of its rows' keys, K <= MAX_ROW_KEYS) -dlse, and δ = Σ P·dP + that is
    formed from the tile's own rows. `split`: dS's rounding error as a second word. dS is
    the gradient of the logits before the soft cap `softcap`; `window` and `features` as in
    `softmax_rows`."""
    batch, heads, n_rows, n_keys = logits.shape
    bm, bn, warps = grad_block(n_keys, own_delta)
    st = _static(logits, bias, mask, seq_q=seq_q, seq_k=seq_k, scale=scale, causal=causal,
                 dropout_rate=dropout_rate, interpret=interpret, block_m=bm, block_n=bn,
                 num_warps=warps, window=window, softcap=softcap, features=features)
    compat.silence_triton_deprecation()
    block = compat.output_struct(logits.shape, out_dtype, logits)
    out_shape = ((block, block) + ((block,) if split else ())
                 + ((compat.output_struct(logits.shape, jnp.float32, logits),)
                    if with_ds32 else ()))
    grid = (cdiv(n_rows, bm) * cdiv(n_keys, bn), batch * heads)
    return pl.pallas_call(
        functools.partial(_softmax_grad_kernel, st=st, n_rows=n_rows, n_keys=n_keys,
                          split=split, with_ds32=with_ds32, own_delta=own_delta),
        out_shape=out_shape, grid=grid, compiler_params=compat.compiler_params(warps, 1),
        interpret=interpret, name="softmax_grad",
    )(logits, dp, lse, delta, offsets.astype(jnp.int32),
      *_inputs(bias, mask, dropout_rate, seed, features))
