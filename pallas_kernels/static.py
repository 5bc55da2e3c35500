"""`KernelStatic`: what a Pallas kernel body knows at trace time (the problem of the arrays it
holds, its launch config and the flags derived from both), and the per-tile steps every
attention kernel shares: the scores' bias, soft cap and masks, the visibility of a query
block's rows, the sinks and the dropout keep-mask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import dropout, numerics, visibility
from pallas_kernels.numerics import LOG2E
from pallas_kernels.problem import Problem
from pallas_kernels.tiles import broadcast_index, cdiv, ds, i32, iota, load_broadcast_tile


@dataclasses.dataclass(frozen=True)
class KernelStatic:
    """What a kernel body knows at trace time: the problem of the arrays it holds (the
    call's, or one device's shard of it: `Problem.sized`), its launch config (the kernel's
    own config class), and flags derived from them."""

    problem: Problem
    cfg: Any
    # The outer extent of the mask's block lists (1 when one list serves every outer block).
    list_outer: int = 1
    interpret: bool = False  # Pallas' interpreter (no inline PTX)
    split_ds: bool = False  # backward: 16-bit dS enters dQ's and dK's matmuls as two words
    # backward: every row's keys fit in one tile; the "delta" input holds dlse, and δ comes
    # from the tile's own normalised P and dP (see pallas_kernels.bwd.rows_in_one_tile)
    own_delta: bool = False

    def __post_init__(self):
        if self.own_delta and self.cfg.block_n < self.problem.seq_k:
            raise ValueError(f"own_delta needs every row's {self.problem.seq_k} keys in one "
                             f"tile; the config's block_n is {self.cfg.block_n}")

    @property
    def ranged(self) -> bool:
        """Whether the key blocks a query block visits are bounded by the window, the
        segments or the lengths (`TileFeatures.kv_block_range`), with their element masks."""
        p = self.problem
        return p.window is not None or p.segment_ids or p.q_lengths or p.kv_lengths

    @property
    def tile_features(self) -> bool:
        """Whether a query block's rows carry a `TileFeatures`: the range-bounding features,
        or positions that place the block in a longer sequence (their runtime shift and
        offsets travel in it)."""
        return self.ranged or self.problem.positions

    @property
    def score_unit(self) -> float:
        """Score units per natural-log unit: 1, or log2(e) in the log2 domain."""
        return 1.0 if self.problem.natural else LOG2E

    def exp2_arg(self, x):
        """A score difference `x` (≤ 0 near a row's max) as exp2's argument. Scaling the
        small difference, not the score, costs no rounding at the score's magnitude."""
        return x * LOG2E if self.problem.natural else x

    def exp2(self, x):
        """2^x of a float32 tile, as the softmax uses it.

        Pallas lowers `jnp.exp2` to libdevice's `__nv_exp2f`, which the Triton inside
        jaxlib compiled slower than the single instruction (docs/history.md, "exp2 and
        fma"). 16-bit kernels on the GPU use `ex2.approx.ftz.f32` instead, as Triton's own
        `tl.math.exp2` does. Its results below 2^-126 become 0, invisible next to a row's
        max term of 1, and its relative error is about 2^-22, far below a 16-bit output's
        2^-8. float32 kernels and the interpreter keep `jnp.exp2`, whose gradients were
        checked against XLA's in the GPU fuzz. So do head dims above 256 (see
        `fast_softmax`)."""
        if not self.fast_softmax:
            return jnp.exp2(x)
        return numerics.fast_exp2(x)

    def tanh(self, x):
        """tanh of a float32 tile, as the soft cap uses it: `fast_tanh` where the softmax is
        fast (`fast_softmax`), else `jnp.tanh` (libdevice's `tanhf`, which made the capped
        fused kernels the slower; docs/history.md, the soft cap's tanh)."""
        if not self.fast_softmax:
            return jnp.tanh(x)
        return numerics.fast_tanh(x)

    @property
    def fast_softmax(self) -> bool:
        """Whether the softmax uses `fast_exp2` and `fma` (16-bit, on the GPU, head dims
        up to 256). These gave 2-13% at D = 64-256 on the H200 (docs/history.md, exp2 and
        fma). At D = 512 they made the forward slower: that kernel already spills at 255
        registers, so D > 256 keeps the plain operations."""
        return (not self.interpret and not self.problem.natural
                and self.problem.headdim <= 256)


class TileAt(NamedTuple):
    """Where a [bm, bn] score tile sits: batch b, query head h, its first query row and
    key, and its rows' and keys' indices ([bm] and [bn])."""

    b: Any
    h: Any
    q_start: Any
    kv_start: Any
    rows: Any
    cols: Any


def bias_and_masks(s, st: KernelStatic, bias_ref, mask_ref, at: TileAt, *, causal_mask: bool,
                   with_mask: bool, mask_rows: bool = False,
                   features: "TileFeatures | None" = None, with_cap_grad: bool = False):
    """Scores [bm, bn] (in `st.score_unit`s) + bias, soft-capped, then mask, causal, the
    window, segments and lengths (`features`), and bounds as -inf.

    The order is the semantics' own (bias, then the cap, then the masks); forward and
    backward both call this, so they can never disagree on which scores exist.
    `at` places the tile; `mask_rows` also hides rows past T, for kernels that sum over
    query rows. `with_cap_grad` returns (scores, the
    soft cap's derivative at every element, finite even where a key is hidden; None
    without a cap).
    """
    p = st.problem
    b, h, q_start, kv_start, rows, cols = at
    cap_grad = None
    bm, bn = s.shape
    if p.bias_shape is not None:
        bias = load_broadcast_tile(
            bias_ref, broadcast_index(b, p.bias_shape[0]), broadcast_index(h, p.bias_shape[1]),
            q_start, bm, kv_start, bn, n_rows=p.seq_q, n_cols=p.seq_k, other=0)
        s = numerics.add_bias(s, bias, st)
    if p.softcap is not None:
        s = numerics.soft_cap(s, st)
        if with_cap_grad:
            cap_grad = numerics.soft_cap_grad(s, st)
    if with_mask:
        keep = load_broadcast_tile(
            mask_ref, broadcast_index(b, p.mask_shape[0]), broadcast_index(h, p.mask_shape[1]),
            q_start, bm, kv_start, bn, n_rows=p.seq_q, n_cols=p.seq_k, other=False)
        s = jnp.where(keep, s, -jnp.inf)
    if causal_mask:
        shift = (visibility.default_shift(p.seq_q, p.seq_k) if features is None
                 else features.shift)
        s = jnp.where(visibility.causal_visible(rows, cols, shift), s, -jnp.inf)
    if features is not None:
        keep = features.keep(kv_start, rows, cols)
        if keep is not None:
            s = jnp.where(keep, s, -jnp.inf)
    if p.seq_k % bn != 0:
        s = jnp.where((cols < p.seq_k)[None, :], s, -jnp.inf)
    if mask_rows and p.seq_q % bm != 0:
        s = jnp.where((rows < p.seq_q)[:, None], s, -jnp.inf)
    return (s, cap_grad) if with_cap_grad else s


class TileFeatures:
    """The window, segment ids and lengths of one program's query rows (its loaded ids and
    lengths), and where the rows sit among the keys (`shift`, runtime where positions place
    the block in a longer sequence; then `place` (row0, col0) too, else None), for
    `bias_and_masks`, the dropout draws and the block ranges of the kernels' walks."""

    def __init__(self, st: KernelStatic, refs: dict, b, q_start, bm: int):
        p = self.problem = st.problem
        self.refs = refs
        self.b = b
        positions = refs["positions"] if p.positions else None
        self.shift = visibility.shift_of(p.seq_q, p.seq_k, positions)
        self.place = (positions[0], positions[1]) if p.positions else None
        self.q_ids = None
        if p.segment_ids:
            rows = q_start + iota(bm)
            self.q_ids = plgpu.load(refs["q_ids"].at[i32(b), ds(q_start, bm)],
                                    mask=rows < p.seq_q, other=0)
        self.q_len = refs["q_len"][i32(b)] if p.q_lengths else None
        self.kv_len = refs["kv_len"][i32(b)] if p.kv_lengths else None

    def keep(self, kv_start, rows, cols):
        """bool [bm, bn] (or None): the window, segments and lengths at rows × cols."""
        p = self.problem
        segments = None
        if self.q_ids is not None:
            segments = lambda: (self.q_ids, plgpu.load(  # noqa: E731
                self.refs["kv_ids"].at[i32(self.b), ds(kv_start, cols.shape[0])],
                mask=cols < p.seq_k, other=0))
        return visibility.feature_visible(
            rows, cols, shift=self.shift, window=p.window,
            segments=segments, q_len=self.q_len, kv_len=self.kv_len)

    def kv_block_range(self, q_block, q_start, bm: int, bn: int, hi):
        """[lo, hi) of the key blocks rows [q_start, q_start + bm) can see, within the
        caller's `hi` (its causal limit, or all key blocks): the window's band, the
        segments' ranges (`visibility.segment_block_ranges`) and the lengths bound it."""
        p = self.problem
        segment_range = None
        if p.segment_ids:
            ranges = self.refs["seg_ranges"]
            segment_range = lambda i: ranges[i32(self.b), i32(q_block), i]  # noqa: E731
        return visibility.kv_block_range(
            q_start, (bm, bn), hi, seq_q=p.seq_q, shift=self.shift,
            window=p.window, kv_len=self.kv_len, q_len=self.q_len, segment_range=segment_range)


def q_block_range(st: KernelStatic, refs: dict, b, kv_block, kv_start, bm: int, bn: int,
                  lo, hi):
    """[lo, hi) of the query blocks that see any of the keys [kv_start, kv_start + bn),
    within the caller's [lo, hi) (causality's, or all query blocks): the transpose of
    `TileFeatures.kv_block_range`, for the kernels that walk query blocks (dK, dV); the
    segment ranges here are per key block (`kernel_inputs.feature_inputs(over_kv=False)`);
    the shift is `kernel_shift`'s."""
    p = st.problem
    segment_range = None
    if p.segment_ids:
        ranges = refs["seg_ranges"]
        segment_range = lambda i: ranges[i32(b), i32(kv_block), i]  # noqa: E731
    return visibility.q_block_range(
        kv_start, (bm, bn), lo, hi, seq_k=p.seq_k, shift=kernel_shift(st, refs),
        window=p.window,
        q_len=(lambda: refs["q_len"][i32(b)]) if p.q_lengths else None,
        kv_len=(lambda: refs["kv_len"][i32(b)]) if p.kv_lengths else None,
        segment_range=segment_range)


def kernel_shift(st: KernelStatic, refs: dict):
    """Where query row 0 sits among the keys in a kernel: S - T (a Python int), or the
    runtime shift of the "positions" input where the problem has positions."""
    p = st.problem
    return visibility.shift_of(p.seq_q, p.seq_k, refs["positions"] if p.positions else None)


def sink_share(st: KernelStatic, refs: dict, h, lse_hi, lse_lo=None):
    """The sink's probability e^(sink - lse) of each row ([bm], 0 without sinks), from the
    rows' lse in score units (and its low word): what the keys' P lack from 1."""
    if not st.problem.sinks:
        return None
    diff = refs["sinks"][i32(h)] * st.score_unit - lse_hi
    if lse_lo is not None:
        diff = diff - lse_lo
    return st.exp2(st.exp2_arg(diff))


def dropout_keep(st: KernelStatic, seed_ref, b, h, rows, kv_start, n_cols: int,
                 place=None) -> jax.Array:
    """The tile's dropout keep-mask, bool [len(rows), n_cols] (see `dropout`). A shard of a
    partitioned call draws with its global batch and head indices (seed words 2 and 3); a
    block of a longer sequence at its global rows and keys (`place`: (row0, col0), from
    the positions, or None), so that its keep decisions are the whole sequence's. The
    draws come 32 keys to a Philox chunk, so a key offset must keep tiles on chunk starts:
    `FeatureArrays.positions` asks col0 to be a multiple of `dropout.POSITION_ALIGN`.
    Under `Problem.dropout_broadcast` every batch row and head (of every shard) draws at
    batch 0 and head 0: the one mask they share."""
    if place is not None:
        rows, kv_start = rows + place[0], kv_start + place[1]
    if st.problem.dropout_broadcast:
        b = h = jnp.int32(0)
    elif seed_ref.shape[0] == 4:
        b = b + seed_ref[2]
        h = h + seed_ref[3]
    return dropout.keep_tile(seed_ref, b, h, rows, kv_start, n_cols,
                             rate=st.problem.dropout_rate, on_gpu=not st.interpret)


def _short_unmasked_run(st: KernelStatic, shift) -> bool:
    """Whether the causal walk should mask every key block instead of splitting off the
    unmasked ones. Where the grid has one query block and the shift is static, the loops'
    bounds are compile-time constants; with an unmasked loop of one block, XLA's Triton
    asked for one K/V stage more than the kernel budgets (D = 256, T = 113, S = 203: 256
    KiB, past the card's shared memory; the `triton` package compiled the same kernel
    within the budget; docs/history.md, session 37). Masking a run shorter than the
    pipeline, in a problem of one query block, costs little."""
    problem, cfg = st.problem, st.cfg
    if shift is not None or cdiv(problem.seq_q, cfg.block_m) != 1:
        return False
    keys_first_row = max(visibility.default_shift(problem.seq_q, problem.seq_k) + 1, 0)
    return 0 < keys_first_row // cfg.block_n < cfg.num_stages


def walk_kv_blocks(st: KernelStatic, lists, b, h, q_block, q_start, visit, carry,
                   features: TileFeatures | None = None):
    """`carry` folded through `visit(kv_block, carry, causal_mask=, with_mask=)` over the key
    blocks that query block `q_block` (rows from `q_start`) of head h sees: the mask's block
    list (`lists`: its (counts, indices) refs), or the blocks the window, segments and
    lengths leave (`features`), or causality's limits (unmasked blocks first), or every
    block; causality at `features.shift` where positions place the block (runtime), else at
    S - T. The forward and the kernels of the backward that walk key blocks share it."""
    problem = st.problem
    bm, bn = st.cfg.block_m, st.cfg.block_n
    # Where the rows sit among the keys: S - T, or the positions' runtime shift.
    shift = None if features is None else features.shift
    if problem.mask_shape is not None:
        counts, indices = lists
        lb = i32(broadcast_index(b, counts.shape[0]))
        lh = i32(broadcast_index(h, counts.shape[1]))
        lq = q_block if st.list_outer != 1 else i32(0)
        listed = lambda i, c: visit(indices[lb, lh, lq, i], c,  # noqa: E731
                                    causal_mask=problem.causal, with_mask=True)
        return jax.lax.fori_loop(i32(0), counts[lb, lh, lq], listed, carry)
    if st.ranged:
        # The window, the segments and the lengths bound the key blocks; every visited
        # block takes their element masks (and causality's).
        hi = (visibility.causal_kv_blocks(q_start, bm, bn, problem.seq_q, problem.seq_k,
                                          shift)[1]
              if problem.causal else cdiv(problem.seq_k, bn))
        lo, hi = features.kv_block_range(q_block, q_start, bm, bn, hi)
        return jax.lax.fori_loop(lo, hi, functools.partial(visit, causal_mask=problem.causal,
                                                           with_mask=False), carry)
    if problem.causal:
        n_unmasked, n_total = visibility.causal_kv_blocks(q_start, bm, bn, problem.seq_q,
                                                          problem.seq_k, shift)
        if _short_unmasked_run(st, shift):
            return jax.lax.fori_loop(i32(0), n_total,
                                     functools.partial(visit, causal_mask=True,
                                                       with_mask=False), carry)
        carry = jax.lax.fori_loop(i32(0), n_unmasked,
                                  functools.partial(visit, causal_mask=False, with_mask=False),
                                  carry)
        return jax.lax.fori_loop(n_unmasked, n_total,
                                 functools.partial(visit, causal_mask=True, with_mask=False),
                                 carry)
    return jax.lax.fori_loop(i32(0), i32(cdiv(problem.seq_k, bn)),
                             functools.partial(visit, causal_mask=False, with_mask=False), carry)
