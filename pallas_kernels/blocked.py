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
every block agrees with the fused kernels and with `dropout.keep_mask_reference`. Where the
problem is itself a block of a longer sequence (`FeatureArrays.positions`, one more input),
causality and the window take its runtime shift, and dropout draws at row0 + r0 + i and
col0 + c0 + j. Bias and
mask are the problem's 4-D arrays with broadcast dims of size 1 (read with stride 0); the
segment ids ([B, T] and [B, S]) are read at the tile's own rows and keys, the lengths [B]
once per program.
Natural-log units throughout, like XLA's softmax.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat, kernel_inputs, numerics, static, tiles, visibility
from pallas_kernels.problem import Inputs, Problem
from pallas_kernels.tiles import cdiv, i32, iota

# Whole rows live in registers: the widest key block `softmax_rows` takes.
MAX_ROW_KEYS = 16384


@dataclasses.dataclass(frozen=True)
class BlockStatic:
    """What both kernels know at trace time: the problem of the arrays they hold (its T
    and S place the block for causality and the bias/mask bounds), and their tiles."""

    problem: Problem
    block_m: int
    block_n: int
    num_warps: int
    interpret: bool


@dataclasses.dataclass(frozen=True)
class _FeatureRefs:
    """The visibility arrays' refs of a kernel (None where not given)."""

    q_ids: object = None
    kv_ids: object = None
    q_len: object = None
    kv_len: object = None
    positions: object = None

    def shift(self, problem: Problem):
        """Where query row 0 sits among the keys: S - T, or the positions' runtime shift."""
        return visibility.shift_of(problem.seq_q, problem.seq_k, self.positions)

    @property
    def place(self):
        """(row0, col0) of the positions (the dropout draws' offsets), or None."""
        return None if self.positions is None else (self.positions[0], self.positions[1])


def _feature_keep(st: BlockStatic, fr: _FeatureRefs, b, row_start, bm: int, col_start,
                  bn: int):
    """bool [bm, bn] (or None): the window, segments and lengths at the global rows
    [row_start, row_start + bm) × keys [col_start, col_start + bn) of batch `b` (ids out of
    range read as 0: the callers mask those rows and keys)."""
    problem = st.problem
    rows, cols = row_start + iota(bm), col_start + iota(bn)
    segments = None
    if fr.q_ids is not None:
        segments = lambda: (  # noqa: E731
            plgpu.load(fr.q_ids.at[i32(b), tiles.ds(row_start, bm)], mask=rows < problem.seq_q,
                       other=0),
            plgpu.load(fr.kv_ids.at[i32(b), tiles.ds(col_start, bn)], mask=cols < problem.seq_k,
                       other=0))
    return visibility.feature_visible(
        rows, cols, shift=fr.shift(problem),
        window=problem.window, segments=segments,
        q_len=None if fr.q_len is None else (lambda: fr.q_len[i32(b)]),
        kv_len=None if fr.kv_len is None else (lambda: fr.kv_len[i32(b)]))


def _capped(st: BlockStatic, s):
    """(c·tanh(s / c), its derivative 1 - tanh²) under a soft cap, else (s, None)."""
    problem = st.problem
    if problem.softcap is None:
        return s, None
    t = jnp.tanh(s / problem.softcap)
    return problem.softcap * t, 1.0 - t * t


def _scores(st: BlockStatic, logits, bias_ref, mask_ref, b, h, row_start, col_start,
            fr: _FeatureRefs | None = None, with_cap_grad: bool = False):
    """scale·logits + bias, soft-capped, then mask, causality, window, segments and lengths
    as -inf, for the tile of `logits` whose first element sits at global query row
    `row_start` and key `col_start`. With `with_cap_grad`, also the soft cap's derivative
    (None without a cap)."""
    problem = st.problem
    bm, bn = logits.shape
    s = logits * problem.scale
    if bias_ref is not None:
        bias = tiles.load_broadcast_tile(
            bias_ref, tiles.broadcast_index(b, problem.bias_shape[0]),
            tiles.broadcast_index(h, problem.bias_shape[1]), row_start, bm, col_start, bn,
            n_rows=problem.seq_q, n_cols=problem.seq_k, other=0)
        s = s + bias.astype(jnp.float32)
    s, cap_grad = _capped(st, s)
    if mask_ref is not None:
        keep = tiles.load_broadcast_tile(
            mask_ref, tiles.broadcast_index(b, problem.mask_shape[0]),
            tiles.broadcast_index(h, problem.mask_shape[1]), row_start, bm, col_start, bn,
            n_rows=problem.seq_q, n_cols=problem.seq_k, other=False)
        s = jnp.where(keep, s, -jnp.inf)
    if problem.causal:
        rows, cols = row_start + iota(bm), col_start + iota(bn)
        shift = (visibility.default_shift(problem.seq_q, problem.seq_k) if fr is None
                 else fr.shift(problem))
        s = jnp.where(visibility.causal_visible(rows, cols, shift), s, -jnp.inf)
    if fr is not None:
        keep = _feature_keep(st, fr, b, row_start, bm, col_start, bn)
        if keep is not None:
            s = jnp.where(keep, s, -jnp.inf)
    return (s, cap_grad) if with_cap_grad else s


def _refs(st: BlockStatic, refs):
    """(named inputs..., outputs) of a kernel's refs in the order the wrappers pass them."""
    problem = st.problem
    refs = list(refs)
    bias_ref = refs.pop(0) if problem.bias_shape is not None else None
    mask_ref = refs.pop(0) if problem.mask_shape is not None else None
    seed_ref = refs.pop(0) if problem.dropout_rate > 0 else None
    return bias_ref, mask_ref, seed_ref, refs


def _feature_refs(st: BlockStatic, refs: list) -> _FeatureRefs:
    """The visibility arrays' refs, popped from the front of `refs` (after the seed)."""
    problem = st.problem
    q_ids = refs.pop(0) if problem.segment_ids else None
    kv_ids = refs.pop(0) if problem.segment_ids else None
    q_len = refs.pop(0) if problem.q_lengths else None
    kv_len = refs.pop(0) if problem.kv_lengths else None
    positions = refs.pop(0) if problem.positions else None
    return _FeatureRefs(q_ids=q_ids, kv_ids=kv_ids, q_len=q_len, kv_len=kv_len,
                        positions=positions)


def _softmax_rows_kernel(logits_ref, offsets_ref, *refs, st: BlockStatic, n_rows: int,
                         n_keys: int):
    problem = st.problem
    bias_ref, mask_ref, seed_ref, rest = _refs(st, refs)
    fr = _feature_refs(st, rest)
    p_ref, lse_ref = rest
    bm, bk = st.block_m, st.block_n
    r = pl.program_id(0) * bm + iota(bm)
    bh = pl.program_id(1)
    b, h = bh // problem.heads_q, bh % problem.heads_q
    r0, c0 = offsets_ref[0], offsets_ref[1]
    j = iota(bk)
    row_ok = r < n_rows
    col_ok = j < n_keys
    view = logits_ref.at[i32(b), i32(h), tiles.ds(pl.program_id(0) * bm, bm), tiles.ds(0, bk)]
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
        keep = static.dropout_keep(st, seed_ref, b, h, r0 + r, c0, bk, fr.place)
        p = jnp.where(keep, p / (1.0 - problem.dropout_rate), 0.0)
    plgpu.store(p_ref.at[i32(b), i32(h), tiles.ds(pl.program_id(0) * bm, bm), tiles.ds(0, bk)],
                p.astype(p_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])
    lse = jnp.where(has_keys, m_safe + jnp.log(safe), -jnp.inf)
    plgpu.store(lse_ref.at[i32(b), i32(h), tiles.ds(pl.program_id(0) * bm, bm)], lse,
                mask=row_ok)


def _inputs(problem: Problem, inputs: Inputs) -> list:
    """The kernels' inputs after the block's own: bias, mask, seed, then the visibility
    arrays (segment ids, lengths, positions; the sinks join the merged rows, not a
    block)."""
    f = inputs.features
    visible = [x for x in (f.q_segment_ids, f.kv_segment_ids, f.q_lengths, f.kv_lengths,
                           f.kernel_positions()) if x is not None]
    return ([x for x in (inputs.bias, inputs.mask) if x is not None]
            + kernel_inputs.seed_inputs(problem.dropout_rate, inputs.seed) + visible)


def row_block(n_keys: int) -> tuple[int, int, int]:
    """(rows per program, key tile, warps) of `softmax_rows` for a block of `n_keys` keys."""
    bk = tiles.fit_block(n_keys, n_keys)
    if bk > MAX_ROW_KEYS:
        raise ValueError(f"softmax_rows holds whole rows of at most {MAX_ROW_KEYS} keys; "
                         f"got {n_keys}")
    return max(1, min(16, 4096 // bk)), bk, 16 if bk >= 8192 else 8 if bk >= 1024 else 4


def softmax_rows(problem: Problem, logits, offsets, inputs: Inputs, *, out_dtype,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(P [B, Hq, R, K] in `out_dtype`, lse [B, Hq, R] float32) of a block of float32 logits
    [B, Hq, R, K] at global (row, key) `offsets` (int32[2]) of `problem` (fitted to
    `inputs`, whose bias, mask, seed and visibility arrays it reads); see the module
    docstring. Rows that see no key of the block get P = 0 and lse = -inf.
    K <= MAX_ROW_KEYS."""
    batch, heads, n_rows, n_keys = logits.shape
    bm, bk, warps = row_block(n_keys)
    problem = problem.sized(inputs)
    st = BlockStatic(problem=problem, block_m=bm, block_n=bk, num_warps=warps,
                     interpret=interpret)
    compat.silence_triton_deprecation()
    out_shape = (compat.output_struct(logits.shape, out_dtype, logits),
                 compat.output_struct((batch, heads, n_rows), jnp.float32, logits))
    return pl.pallas_call(
        functools.partial(_softmax_rows_kernel, st=st, n_rows=n_rows, n_keys=n_keys),
        out_shape=out_shape, grid=(cdiv(n_rows, bm), batch * heads),
        compiler_params=compat.compiler_params(warps, 1), interpret=interpret,
        name="softmax_rows",
    )(logits, offsets.astype(jnp.int32), *_inputs(problem, inputs))


def _softmax_grad_kernel(*refs, st: BlockStatic, n_rows: int, n_keys: int, split: bool,
                         with_ds32: bool, own_delta: bool, normalise: bool):
    logits_ref, dp_ref, lse_ref, delta_ref, offsets_ref = refs[:5]
    tile = _GradTile.of(st, refs[5:], offsets_ref, n_rows=n_rows, n_keys=n_keys,
                        split=split, with_ds32=with_ds32)

    def load(ref):
        return plgpu.load(ref.at[i32(tile.b), i32(tile.h), tiles.ds(tile.rs, st.block_m),
                                 tiles.ds(tile.cs, st.block_n)], mask=tile.ok, other=0.0)

    _grad_epilogue(st, tile, load(logits_ref), load(dp_ref).astype(jnp.float32), lse_ref,
                   delta_ref, own_delta=own_delta, normalise=normalise)


@dataclasses.dataclass(frozen=True)
class _GradTile:
    """Where a program of the gradient steps sits: batch b and query head h, the tile's
    first row and key in the block (rs, cs) and the block's global (r0, c0), the in-block
    masks, and the kernel's named-input and output refs."""

    b: Any
    h: Any
    rs: Any
    cs: Any
    r0: Any
    c0: Any
    rows: Any  # in-block row indices [bm]
    cols: Any  # in-block key indices [bn]
    row_ok: Any  # rows < n_rows, [bm]
    ok: Any  # rows < n_rows and keys < n_keys, [bm, bn]
    bias_ref: Any
    mask_ref: Any
    seed_ref: Any
    features: _FeatureRefs
    pd_ref: Any
    ds_ref: Any
    lo_ref: Any
    ds32_ref: Any

    @classmethod
    def of(cls, st: BlockStatic, refs, offsets_ref, *, n_rows: int, n_keys: int, split: bool,
           with_ds32: bool) -> _GradTile:
        problem = st.problem
        bias_ref, mask_ref, seed_ref, outs = _refs(st, refs)
        fr = _feature_refs(st, outs)
        pd_ref, ds_ref, *rest = outs
        lo_ref = rest.pop(0) if split else None
        ds32_ref = rest.pop(0) if with_ds32 else None
        bm, bn = st.block_m, st.block_n
        n_col_blocks = cdiv(n_keys, bn)
        row_block_index = pl.program_id(0) // n_col_blocks
        col_block = pl.program_id(0) % n_col_blocks
        bh = pl.program_id(1)
        rs, cs = row_block_index * bm, col_block * bn
        rows, cols = rs + iota(bm), cs + iota(bn)
        row_ok = rows < n_rows
        return cls(b=bh // problem.heads_q, h=bh % problem.heads_q, rs=rs, cs=cs,
                   r0=offsets_ref[0], c0=offsets_ref[1], rows=rows, cols=cols, row_ok=row_ok,
                   ok=row_ok[:, None] & (cols < n_keys)[None, :],
                   bias_ref=bias_ref, mask_ref=mask_ref, seed_ref=seed_ref, features=fr,
                   pd_ref=pd_ref, ds_ref=ds_ref, lo_ref=lo_ref, ds32_ref=ds32_ref)


def _grad_epilogue(st: BlockStatic, tile: _GradTile, logits, dp, lse_ref, delta_ref, *,
                   own_delta: bool, normalise: bool):
    """A tile's dropped P and dS from its float32 logits and dP, stored to the outputs."""
    problem = st.problem
    b, h, rs, ok, fr = tile.b, tile.h, tile.rs, tile.ok, tile.features
    row_lse = plgpu.load(lse_ref.at[i32(b), i32(h), tiles.ds(rs, st.block_m)],
                         mask=tile.row_ok, other=-jnp.inf)
    delta = plgpu.load(delta_ref.at[i32(b), i32(h), tiles.ds(rs, st.block_m)],
                       mask=tile.row_ok, other=0.0)
    s, cap_grad = _scores(st, logits, tile.bias_ref, tile.mask_ref, b, h, tile.r0 + rs,
                          tile.c0 + tile.cs, fr, with_cap_grad=True)
    finite = row_lse != -jnp.inf
    p = jnp.where(ok & finite[:, None],
                  jnp.exp(s - jnp.where(finite, row_lse, 0.0)[:, None]), 0.0)
    if normalise:
        p = own_normalised(p, axis=1)
    dropped = p
    if tile.seed_ref is not None:
        keep = static.dropout_keep(st, tile.seed_ref, b, h, tile.r0 + tile.rows,
                                   tile.c0 + tile.cs, st.block_n, fr.place)
        inv = 1.0 - problem.dropout_rate
        dropped = jnp.where(keep, p / inv, 0.0)
        dp = jnp.where(keep, dp / inv, 0.0)
    if own_delta:  # the tile holds whole rows: δ from its own P and dP
        delta = jnp.sum(p * dp, axis=1) + delta
    ds = p * (dp - delta[:, None])
    if cap_grad is not None:
        ds = ds * cap_grad

    def store(ref, value):
        plgpu.store(ref.at[i32(b), i32(h), tiles.ds(rs, st.block_m),
                           tiles.ds(tile.cs, st.block_n)], value.astype(ref.dtype), mask=ok)

    store(tile.pd_ref, dropped)
    hi = ds.astype(tile.ds_ref.dtype)
    store(tile.ds_ref, hi)
    if tile.lo_ref is not None:
        store(tile.lo_ref, ds - hi.astype(jnp.float32))
    if tile.ds32_ref is not None:
        store(tile.ds32_ref, ds)


def own_normalised(p, axis: int):
    """A block's probabilities (float32, holding its rows' every key) divided by their own
    row sums: P from the forward's lse misses a sum of 1 by lse's float32 rounding (a few
    ulps of |lse|, relative), which XLA's softmax gradient, normalising its own P, does not
    (the fused kernels' `bwd_exact_rows` does the same; docs/history.md, sessions 7 and
    22). Rows with no visible key stay 0."""
    total = jnp.sum(p, axis=axis, keepdims=True)
    return jnp.where(total > 0.0, p / jnp.where(total > 0.0, total, 1.0), 0.0)


def grad_block(n_keys: int, own_delta: bool) -> tuple[int, int, int]:
    """(rows, keys, warps) of a `softmax_grad` tile: whole rows with `own_delta`."""
    if own_delta:
        return row_block(n_keys)
    return 64, tiles.fit_block(min(n_keys, 128), n_keys), 4


def _grad_outputs(like, out_dtype, *, split: bool, with_ds32: bool) -> tuple:
    """The gradient steps' outputs, each of `like`'s [B, Hq, R, K] shape: dropped P and dS in
    `out_dtype`, dS's low word with `split`, dS in float32 with `with_ds32`."""
    out = compat.output_struct(like.shape, out_dtype, like)
    return ((out, out) + ((out,) if split else ())
            + ((compat.output_struct(like.shape, jnp.float32, like),) if with_ds32 else ()))


class GradBlock(NamedTuple):
    """One block of the chunked backward, [B, Hq, R, K] each: the float32 logits (None for
    `softmax_grad_of_operands`, which computes them), dP (float32 or the input dtype), and
    the rows' lse and δ [B, Hq, R]: δ = rowsum(dO·O) - dlse, or -dlse where the block forms
    δ = Σ P·dP + that from its own rows (`own_delta`); `offsets` (int32[2]) its global
    (row, key)."""

    logits: Any
    dp: Any
    lse: Any
    delta: Any
    offsets: Any


def softmax_grad(problem: Problem, block: GradBlock, inputs: Inputs, *, out_dtype,
                 split: bool = False, with_ds32: bool = False, own_delta: bool = False,
                 normalise: bool = False, interpret: bool = False) -> tuple[jax.Array, ...]:
    """(dropped P, dS[, dS's low word][, dS float32]) of a block, each [B, Hq, R, K]; P and
    dS in `out_dtype`. With `own_delta` the block holds all of its rows' keys
    (K <= MAX_ROW_KEYS), and with `normalise` too its P is divided by its own row sums
    (`own_normalised`: where the rows' probabilities sum to 1 over these keys). `split`:
    dS's rounding error as a second word. dS is the gradient of the logits before the
    problem's soft cap."""
    logits = block.logits
    batch, heads, n_rows, n_keys = logits.shape
    bm, bn, warps = grad_block(n_keys, own_delta)
    problem = problem.sized(inputs)
    st = BlockStatic(problem=problem, block_m=bm, block_n=bn, num_warps=warps,
                     interpret=interpret)
    compat.silence_triton_deprecation()
    out_shape = _grad_outputs(logits, out_dtype, split=split, with_ds32=with_ds32)
    grid = (cdiv(n_rows, bm) * cdiv(n_keys, bn), batch * heads)
    return pl.pallas_call(
        functools.partial(_softmax_grad_kernel, st=st, n_rows=n_rows, n_keys=n_keys,
                          split=split, with_ds32=with_ds32, own_delta=own_delta,
                          normalise=normalise),
        out_shape=out_shape, grid=grid, compiler_params=compat.compiler_params(warps, 1),
        interpret=interpret, name="softmax_grad",
    )(logits, block.dp, block.lse, block.delta, block.offsets.astype(jnp.int32),
      *_inputs(problem, inputs))


class LogitOperands(NamedTuple):
    """The logits' operands of a backward block, whole (not the block's rows), in the
    chunked tier's GEMM layout: q [B, Hkv, G, T, D] and k [B, Hkv, S, D], 16-bit."""

    q: Any
    k: Any


# The tiles of `softmax_grad_of_operands`: rows × keys per program, the head-dim chunk its
# product steps over, warps and pipeline stages (faster on the H200 at D = 512 than
# 128 × 128 with 8 warps: docs/history.md, session 44).
OPERAND_GRAD_TILE = (64, 128, 64, 4, 3)


def _softmax_grad_of_operands_kernel(*refs, st: BlockStatic, n_rows: int, n_keys: int,
                                     split: bool, with_ds32: bool, chunk: int):
    q_ref, k_ref, dp_ref, lse_ref, delta_ref, offsets_ref = refs[:6]
    refs = refs[6:]
    problem = st.problem
    tile = _GradTile.of(st, refs, offsets_ref, n_rows=n_rows, n_keys=n_keys, split=split,
                        with_ds32=with_ds32)
    group = problem.heads_q // problem.heads_kv
    hk, hg = tile.h // group, tile.h % group
    width = problem.head_dim
    ragged = width % chunk != 0
    col_ok = tile.cols < n_keys
    q_at = tiles.ds(tile.r0 + tile.rs, st.block_m)
    k_at = tiles.ds(tile.c0 + tile.cs, st.block_n)

    def body(c, acc):
        d0 = tiles.chunk_start(c, chunk)
        d_ok = (d0 + iota(chunk) < width)[None, :] if ragged else True
        q = plgpu.load(q_ref.at[i32(tile.b), i32(hk), i32(hg), q_at, tiles.ds(d0, chunk)],
                       mask=tile.row_ok[:, None] & d_ok, other=0.0)
        k = plgpu.load(k_ref.at[i32(tile.b), i32(hk), k_at, tiles.ds(d0, chunk)],
                       mask=col_ok[:, None] & d_ok, other=0.0)
        return acc + numerics.dot(q, k, trans_b=True)

    logits = jax.lax.fori_loop(0, cdiv(width, chunk), body,
                               jnp.zeros((st.block_m, st.block_n), jnp.float32))
    dp = plgpu.load(dp_ref.at[i32(tile.b), i32(tile.h), tiles.ds(tile.rs, st.block_m),
                              tiles.ds(tile.cs, st.block_n)], mask=tile.ok, other=0.0)
    _grad_epilogue(st, tile, logits, dp.astype(jnp.float32), lse_ref, delta_ref,
                   own_delta=False, normalise=False)


def softmax_grad_of_operands(problem: Problem, operands: LogitOperands, block: GradBlock,
                             inputs: Inputs, *, out_dtype, split: bool = False,
                             with_ds32: bool = False,
                             interpret: bool = False) -> tuple[jax.Array, ...]:
    """`softmax_grad` of a block whose logits q·kᵀ it computes in the kernel from their
    operands (16-bit), so that they never go through memory in float32: `block` as
    `softmax_grad` takes it without its logits (None), its dP [B, Hq, R, K], lse and δ
    [B, Hq, R] (δ = rowsum(dO·O) - dlse: a block never forms its own δ here, its rows'
    keys span several programs) and its global (row, key) offsets."""
    if jnp.dtype(operands.q.dtype).itemsize != 2:
        raise ValueError(f"softmax_grad_of_operands takes 16-bit operands; got {operands.q.dtype}")
    dp = block.dp
    batch, heads, n_rows, n_keys = dp.shape
    bm, bn, chunk, warps, stages = OPERAND_GRAD_TILE
    bm, bn = tiles.fit_block(bm, n_rows), tiles.fit_block(bn, n_keys)
    chunk = tiles.fit_block(chunk, problem.head_dim)
    problem = problem.sized(inputs)
    st = BlockStatic(problem=problem, block_m=bm, block_n=bn, num_warps=warps,
                     interpret=interpret)
    compat.silence_triton_deprecation()
    out_shape = _grad_outputs(dp, out_dtype, split=split, with_ds32=with_ds32)
    grid = (cdiv(n_rows, bm) * cdiv(n_keys, bn), batch * heads)
    return pl.pallas_call(
        functools.partial(_softmax_grad_of_operands_kernel, st=st, n_rows=n_rows,
                          n_keys=n_keys, split=split, with_ds32=with_ds32, chunk=chunk),
        out_shape=out_shape, grid=grid, compiler_params=compat.compiler_params(warps, stages),
        interpret=interpret, name="softmax_grad_of_operands",
    )(operands.q, operands.k, dp, block.lse, block.delta, block.offsets.astype(jnp.int32),
      *_inputs(problem, inputs))
