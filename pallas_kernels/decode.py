"""Decode: split-KV attention for a few queries (T = 1..16) over a long key sequence.

One program per 64-row query block would leave most of the GPU idle when T is
tiny, so the work is split along the keys instead:

- `decode_fwd_stage1`: grid (splits × row blocks × V slices, B·Hkv). A program
  takes one chunk of keys of one KV head and *all* the query rows that read that
  head: the GQA group's Hq/Hkv heads × T queries are packed into the M dimension
  (packed row r = g·T + t is query t of head hk·G + g), so K and V are read once
  per group. It writes its normalised partial output and its partial lse, float32.
- `decode_fwd_stage2`: merges the partials of each query row by their lse:
  lse = log Σ_s exp(lse_s), out = Σ_s exp(lse_s - lse) · out_s.

Semantics are the forward's: bias/mask broadcast with stride 0 (gathered per
packed row), bottom-right causal, fully masked rows give 0 and lse -inf,
dropout with the same keep-mask as every other kernel. The language-model features too:
the soft cap after the bias; the window, segment ids (gathered per packed row) and lengths
mask each tile and bound the key blocks a split walks; the sinks join in stage 2, as one
more partial with lse = the sink and no value.

Paged KV (`paged_decode_attention`): K and V live in pages [Hkv, P, page, D] and a block
table [B, pages_per_seq] names each sequence's pages in order. Stage 1 is the same
program: it gathers each key tile's rows through the table (key j of sequence b is row
j % page of page table[b, j // page]), reads no page past the sequence's length, and
aligns the window to that length (the query is the sequence's last token).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Iterable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat, kernel_inputs, numerics, static, tiles, visibility
from pallas_kernels.numerics import dot
from pallas_kernels.problem import FeatureArrays, Inputs, Problem
from pallas_kernels.tiles import cdiv, fit_block, i32, iota
from pallas_kernels.descriptor import (KernelDescriptor, Move, Table, add_stages, scaled, set_to,
                                       tile_width, toggle_warps)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of `decode_fwd_stage1` (FFPA's keys) and of stage 2."""

    block_m: int = 16  # packed query rows (GQA group × T) per program
    block_n: int = 64  # keys per step
    block_d: int = 64  # BLOCK_HEADDIM_QK: chunk of D per QKᵀ partial product
    block_dv: int = 128  # BLOCK_HEADDIM_V: output head-dim slice per program
    num_warps: int = 4
    num_stages: int = 2
    dynamic: bool = False  # fori_loop over the D chunks (one Q and one K chunk live)
    num_splits: int = 0  # key chunks; 0 = the caller's heuristic decides
    stage2_block_dv: int = 128
    stage2_num_warps: int = 4

    @classmethod
    def from_tuned(cls, stage1: dict, stage2: dict | None = None) -> DecodeConfig:
        """Tuned-config `config` dicts (FFPA's keys) of the two stages as a DecodeConfig."""
        stage2 = stage2 or {}
        return cls(block_m=stage1["BLOCK_M"], block_n=stage1["BLOCK_N"],
                   block_d=stage1["BLOCK_HEADDIM_QK"], block_dv=stage1["BLOCK_HEADDIM_V"],
                   num_warps=stage1["num_warps"], num_stages=stage1["num_stages"],
                   dynamic=stage1.get("DYNAMIC_D", False),
                   num_splits=stage1.get("NUM_SPLITS", 0),
                   stage2_block_dv=stage2.get("BLOCK_HEADDIM_V", 128),
                   stage2_num_warps=stage2.get("num_warps", 4))

    def with_splits(self, num_splits: int) -> DecodeConfig:
        """The same config with the key split count decided (the heuristic's, where the
        tuned entry left it open)."""
        return dataclasses.replace(self, num_splits=num_splits)

    def fitted(self, packed_rows: int, seq_k: int, head_dim: int, head_dim_v: int):
        return dataclasses.replace(
            self, block_m=fit_block(self.block_m, packed_rows),
            block_n=fit_block(self.block_n, seq_k), block_d=fit_block(self.block_d, head_dim),
            block_dv=fit_block(self.block_dv, head_dim_v),
            stage2_block_dv=fit_block(self.stage2_block_dv, head_dim_v))


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Static sizes of one decode launch."""

    st: static.KernelStatic
    n_splits: int
    blocks_per_split: int
    page_size: int = 0  # paged K/V: keys per page (0: contiguous [B, S, Hkv, D])
    n_pages: int = 0  # paged K/V: pages in the pool

    @property
    def packed(self) -> int:  # rows per KV head: G · T
        return self.st.problem.group * self.st.problem.seq_q

    @property
    def n_mblocks(self) -> int:
        return cdiv(self.packed, self.st.cfg.block_m)

    @property
    def n_vslices(self) -> int:
        return cdiv(self.st.problem.head_dim_v, self.st.cfg.block_dv)


def _gather_tile(ref, b, h_rows, t_rows, cols, *, rows_ok, seq_k: int, other):
    """[M, BN] tile of a 4-D bias/mask ref [b?, h?, t?, s?] (dims of size 1 broadcast),
    rows given per packed row by their head and query index."""
    bb, hb, tb, sb = ref.shape
    b_idx = i32(b if bb != 1 else 0)
    h_idx = (h_rows if hb != 1 else jnp.zeros_like(h_rows))[:, None]
    t_idx = (t_rows if tb != 1 else jnp.zeros_like(t_rows))[:, None]
    if sb != 1:
        c_idx = cols[None, :]
        mask = rows_ok[:, None] & (cols < seq_k)[None, :]
    else:
        c_idx = jnp.zeros((1, 1), jnp.int32)
        mask = rows_ok[:, None]
    return plgpu.load(ref.at[b_idx, h_idx, t_idx, c_idx], mask=mask, other=other)


def _paged_rows(table_ref, b, cols, kv_len, lay: _Layout):
    """Where the keys `cols` of sequence b live in the page pool: (page ids [BN], rows in
    the page [BN], valid [BN]). Keys at or past the sequence's length are not valid: their
    table entries are not read and their rows are never loaded. A page id outside the pool
    is clamped into it (memory safety; the API checks the table where it can)."""
    valid = cols < kv_len
    pages = plgpu.load(table_ref.at[i32(b), cols // lay.page_size], mask=valid, other=0)
    pages = jnp.clip(pages, 0, lay.n_pages - 1)
    return pages, cols % lay.page_size, valid


def _load_paged(pages_ref, hk, rows, cols_start, cols: int, *, n_cols: int):
    """A [BN, cols] tile of a page pool [Hkv, P, page, D] at the key rows `rows`
    (`_paged_rows`) and head-dim columns cols_start:, 0 where not valid."""
    pages, slots, valid = rows
    col_ids = cols_start + iota(cols)
    mask = valid[:, None] & (col_ids < n_cols)[None, :]
    return plgpu.load(pages_ref.at[i32(hk), pages[:, None], slots[:, None], col_ids[None, :]],
                      mask=mask, other=0)


def _stage1_kernel(*refs, lay: _Layout, per_chunk: bool):
    st = lay.st
    problem = st.problem
    cfg = st.cfg
    bm, bn, bd, bdv = cfg.block_m, cfg.block_n, cfg.block_d, cfg.block_dv
    q_ref, k_ref, v_ref, *rest = refs
    table_ref = rest.pop(0) if lay.page_size else None
    bias_ref = rest.pop(0) if problem.bias_shape is not None else None
    mask_ref = rest.pop(0) if problem.mask_shape is not None else None
    seed_ref = rest.pop(0) if problem.dropout_rate > 0 else None
    feature_refs = kernel_inputs.pop_feature_refs(st, rest)
    o_ref, lse_ref = rest

    pid, bhk = pl.program_id(0), pl.program_id(1)
    v_slice = pid % lay.n_vslices
    m_block = (pid // lay.n_vslices) % lay.n_mblocks
    split = pid // (lay.n_vslices * lay.n_mblocks)
    b, hk = bhk // problem.heads_kv, bhk % problem.heads_kv
    v_start = v_slice * bdv

    # Packed rows of this program: r = g·T + t -> query t of head hk·G + g.
    r = m_block * bm + iota(bm)
    rows_ok = r < lay.packed
    r_safe = jnp.where(rows_ok, r, 0)
    t_rows = r_safe % problem.seq_q
    h_rows = hk * problem.group + r_safe // problem.seq_q
    q_ids = q_len = kv_len = None
    if problem.segment_ids:
        q_ids = plgpu.load(feature_refs["q_ids"].at[i32(b), t_rows], mask=rows_ok, other=0)
    if problem.q_lengths:
        q_len = feature_refs["q_len"][i32(b)]
    if problem.kv_lengths:
        kv_len = feature_refs["kv_len"][i32(b)]
    # Where the query rows end among the keys: bottom-right at S, or (paged) at the
    # sequence's own length.
    shift = (kv_len - problem.seq_q if lay.page_size
             else visibility.default_shift(problem.seq_q, problem.seq_k))

    def feature_keep(kv_start, cols):
        """The window, segments and lengths at the packed rows × `cols` (None without)."""
        segments = None
        if q_ids is not None:
            segments = lambda: (q_ids, plgpu.load(  # noqa: E731
                feature_refs["kv_ids"].at[i32(b), tiles.ds(kv_start, bn)],
                mask=cols < problem.seq_k, other=0))
        return visibility.feature_visible(t_rows, cols, shift=shift, window=problem.window,
                                          segments=segments, q_len=q_len, kv_len=kv_len)

    def q_chunk_at(c):
        cols = tiles.chunk_start(c, bd) + iota(bd)
        mask = rows_ok[:, None] & (cols < problem.head_dim)[None, :]
        return plgpu.load(q_ref.at[i32(b), t_rows[:, None], h_rows[:, None], cols[None, :]],
                          mask=mask, other=0)

    n_dchunks = cdiv(problem.head_dim, bd)
    if not cfg.dynamic:
        q_chunks = [q_chunk_at(c) for c in range(n_dchunks)]
        q_chunk = lambda c: q_chunks[c]
    else:
        q_chunk = q_chunk_at
    qk_scale = problem.scale * st.score_unit

    def visit(kv_block, carry):
        m_i, l_i, acc = carry
        kv_start = kv_block * bn
        cols = kv_start + iota(bn)
        if lay.page_size:
            rows = _paged_rows(table_ref, b, cols, kv_len, lay)
            k_chunk = lambda c: _load_paged(k_ref, hk, rows, tiles.chunk_start(c, bd), bd,
                                            n_cols=problem.head_dim)
        else:
            k_chunk = lambda c: tiles.load_tile(k_ref, b, kv_start, bn, hk,
                                                tiles.chunk_start(c, bd), bd,
                                                n_rows=problem.seq_k, n_cols=problem.head_dim)
        s = numerics.contract_chunks(q_chunk, k_chunk, n_dchunks, dynamic=cfg.dynamic,
                                     shape=(bm, bn), scale=qk_scale, round_per_chunk=per_chunk,
                                     compensated=problem.natural)
        if bias_ref is not None:
            bias = _gather_tile(bias_ref, b, h_rows, t_rows, cols, rows_ok=rows_ok,
                                seq_k=problem.seq_k, other=0)
            s = numerics.add_bias(s, bias, st)
        if problem.softcap is not None:
            s = numerics.soft_cap(s, st)
        if mask_ref is not None:
            keep = _gather_tile(mask_ref, b, h_rows, t_rows, cols, rows_ok=rows_ok,
                                seq_k=problem.seq_k, other=False)
            s = jnp.where(keep, s, -jnp.inf)
        if problem.causal:  # (never paged: there the query is the sequence's last token)
            s = jnp.where(visibility.causal_visible(t_rows, cols, shift), s, -jnp.inf)
        if st.ranged:
            keep = feature_keep(kv_start, cols)
            if keep is not None:
                s = jnp.where(keep, s, -jnp.inf)
        if problem.seq_k % bn != 0:
            s = jnp.where((cols < problem.seq_k)[None, :], s, -jnp.inf)

        m_new, p, alpha, l_i = numerics.online_softmax_step(s, m_i, l_i, st)
        if seed_ref is not None:
            keep = static.dropout_keep(st, seed_ref, b, h_rows, t_rows, kv_start, bn)
            p = jnp.where(keep, p, 0.0)
        if lay.page_size:
            v_tile = _load_paged(v_ref, hk, rows, v_start, bdv, n_cols=problem.head_dim_v)
        else:
            v_tile = tiles.load_tile(v_ref, b, kv_start, bn, hk, v_start, bdv,
                                     n_rows=problem.seq_k, n_cols=problem.head_dim_v)
        p = p if v_tile.dtype == jnp.float32 else p.astype(v_tile.dtype)
        acc = acc * alpha[:, None] + dot(p, v_tile)
        return m_new, l_i, acc

    first = split * lay.blocks_per_split
    last = jnp.minimum(first + lay.blocks_per_split, cdiv(problem.seq_k, bn))
    if st.ranged:
        # Every query row of the call is in this program's rows: the key blocks any of
        # them can see, as one block of T rows.
        segment_range = None
        if problem.segment_ids:
            ranges = feature_refs["seg_ranges"]
            segment_range = lambda i: ranges[i32(b), i32(0), i]  # noqa: E731
        first, last = visibility.kv_block_range(
            0, (problem.seq_q, bn), last, seq_q=problem.seq_q, shift=shift, window=problem.window,
            kv_len=kv_len, q_len=q_len, segment_range=segment_range, lo=first)
    carry = (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32),
             jnp.zeros((bm, bdv), jnp.float32))
    m_i, l_i, acc = jax.lax.fori_loop(i32(first), i32(last), visit, carry)

    has_keys = l_i > 0.0
    l_safe = jnp.where(has_keys, l_i, 1.0)
    norm = l_safe if problem.dropout_rate == 0 else l_safe * (1.0 - problem.dropout_rate)
    out = acc / norm[:, None]
    # Output rows h·T + t = hk·G·T + r: one contiguous slab per KV head.
    row0 = hk * lay.packed + m_block * bm
    out_cols = v_start + iota(bdv)
    plgpu.store(o_ref.at[i32(b), i32(split), tiles.ds(row0, bm), tiles.ds(v_start, bdv)],
                out, mask=rows_ok[:, None] & (out_cols < problem.head_dim_v)[None, :])
    lse, _ = numerics.row_lse(m_i, l_safe, has_keys, st)
    plgpu.store(lse_ref.at[i32(b), i32(split), tiles.ds(row0, bm)], lse,
                mask=rows_ok & (v_slice == 0))


def decode_num_splits(*, batch: int, heads_kv: int, packed_rows: int, seq_k: int,
                      head_dim_v: int, config: DecodeConfig, multiprocessors: int) -> int:
    """The split count when the config leaves it open: enough programs for about four
    waves over the multiprocessors, each split at least two key blocks long."""
    cfg = config.fitted(packed_rows, seq_k, 1, head_dim_v)
    programs = batch * heads_kv * cdiv(packed_rows, cfg.block_m) * cdiv(head_dim_v, cfg.block_dv)
    n_blocks = cdiv(seq_k, cfg.block_n)
    wanted = cdiv(4 * multiprocessors, programs)
    return max(1, min(wanted, n_blocks // 2, 128))


class PagedKV(NamedTuple):
    """A paged KV cache: pools k_pages [Hkv, P, page, D] and v_pages [Hkv, P, page, Dv],
    block_tables int32 [B, pages_per_seq] (sequence b's pages, in order) and lengths int32
    [B] (its keys j < lengths[b]; the window ends at each sequence's length)."""

    k_pages: Any
    v_pages: Any
    block_tables: Any
    lengths: Any


def decode_fwd_stage1(problem: Problem, config: DecodeConfig, inputs: Inputs, *,
                      num_splits: int, interpret: bool = False):
    """Partial outputs float32 [B, splits, Hq·T, Dv] (row h·T + t) and partial lse
    float32 [B, splits, Hq·T], one per key chunk, of the problem's every feature but the
    sinks (stage 2's)."""
    return _launch_stage1(problem, config, inputs, num_splits=num_splits, interpret=interpret)


def paged_decode_stage1(problem: Problem, config: DecodeConfig, q, pages: PagedKV, *,
                        num_splits: int, interpret: bool = False):
    """Stage 1 over paged K/V (`problem.seq_k` = pages_per_seq · page keys, with
    `pages.lengths` as the kv lengths): the partials of `decode_fwd_stage1`."""
    batch, heads_kv = q.shape[0], pages.k_pages.shape[0]
    seq_k = problem.seq_k
    # The layout and the problem read K's and V's shapes as [B, S, Hkv, D].
    k_like = jax.ShapeDtypeStruct((batch, seq_k, heads_kv, pages.k_pages.shape[3]),
                                  pages.k_pages.dtype)
    v_like = jax.ShapeDtypeStruct((batch, seq_k, heads_kv, pages.v_pages.shape[3]),
                                  pages.v_pages.dtype)
    inputs = Inputs(q, k_like, v_like,
                    features=FeatureArrays(kv_lengths=pages.lengths.astype(jnp.int32)))
    return _launch_stage1(problem, config, inputs, num_splits=num_splits, interpret=interpret,
                          pages=pages)


def _launch_stage1(problem: Problem, config: DecodeConfig, inputs: Inputs, *, num_splits: int,
                   interpret: bool, pages: PagedKV | None = None):
    """The stage-1 pallas_call. `pages` replaces K and V (then `inputs.k` and `inputs.v`
    only give the [B, S, Hkv, D] shapes)."""
    inputs = inputs._replace(features=inputs.features.without_sinks())
    problem = dataclasses.replace(problem.sized(inputs), sinks=False)
    q, k, v, bias, mask, seed, _ = inputs
    cfg = config.fitted(problem.group * problem.seq_q, problem.seq_k, problem.head_dim,
                        problem.head_dim_v)
    cfg, per_chunk = numerics.capped_for_rounding(cfg, q.dtype, problem.return_lse)
    n_blocks = cdiv(problem.seq_k, cfg.block_n)
    blocks_per_split = cdiv(n_blocks, max(1, num_splits))
    n_splits = cdiv(n_blocks, blocks_per_split)  # no empty split
    st = static.KernelStatic(problem=problem, cfg=cfg, interpret=interpret)
    kv_arrays = [k, v]
    lay = _Layout(st=st, n_splits=n_splits, blocks_per_split=blocks_per_split)
    if pages is not None:
        kv_arrays = [pages.k_pages, pages.v_pages, pages.block_tables.astype(jnp.int32)]
        lay = dataclasses.replace(lay, page_size=pages.k_pages.shape[2],
                                  n_pages=pages.k_pages.shape[1])
    arrays = ([q] + kv_arrays + [x for x in (bias, mask) if x is not None]
              + kernel_inputs.seed_inputs(problem.dropout_rate, seed)
              # the queries' ids as one block of T rows: the key blocks any of them meets
              + kernel_inputs.feature_inputs(inputs.given_features, block_m=problem.seq_q,
                                             block_n=cfg.block_n))
    compat.silence_triton_deprecation()
    rows = problem.heads_q * problem.seq_q
    batch, head_dim_v = problem.batch, problem.head_dim_v
    return pl.pallas_call(
        functools.partial(_stage1_kernel, lay=lay, per_chunk=per_chunk),
        out_shape=(compat.output_struct((batch, n_splits, rows, head_dim_v), jnp.float32, q),
                   compat.output_struct((batch, n_splits, rows), jnp.float32, q)),
        grid=(n_splits * lay.n_mblocks * lay.n_vslices, batch * problem.heads_kv),
        compiler_params=compat.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret, name=decode_fwd_stage1.__name__)(*arrays)


def _stage2_kernel(o_part_ref, lse_part_ref, *refs, n_splits: int, seq_q: int,
                   heads_q: int, head_dim_v: int, bs: int, bdv: int, sinks: bool = False):
    sinks_ref = refs[0] if sinks else None
    o_ref, lse_ref = refs[-2:]
    row, b = pl.program_id(0), pl.program_id(1)  # row = h·T + t
    v_slice = pl.program_id(2)
    splits = iota(bs)
    split_ok = splits < n_splits
    lse_s = plgpu.load(lse_part_ref.at[i32(b), splits, i32(row)], mask=split_ok,
                       other=-jnp.inf)
    m = jnp.max(lse_s)
    sink = None
    if sinks_ref is not None:  # one more partial: lse = the head's sink, no value
        sink = sinks_ref[i32(row // seq_q)]
        m = jnp.maximum(m, sink)
    m_use = jnp.where(m == -jnp.inf, 0.0, m)
    w = jnp.exp(lse_s - m_use)  # 0 for empty splits and padding
    total = jnp.sum(w)
    if sink is not None:
        total = total + jnp.exp(sink - m_use)
    has_keys = total > 0.0
    w = w / jnp.where(has_keys, total, 1.0)
    cols = v_slice * bdv + iota(bdv)
    parts = plgpu.load(o_part_ref.at[i32(b), splits[:, None], i32(row), cols[None, :]],
                       mask=split_ok[:, None] & (cols < head_dim_v)[None, :], other=0.0)
    out = jnp.sum(parts * w[:, None], axis=0)
    h, t = row // seq_q, row % seq_q
    plgpu.store(o_ref.at[i32(b), i32(t), i32(h), cols], out.astype(o_ref.dtype),
                mask=cols < head_dim_v)

    @pl.when(v_slice == 0)
    def _():
        lse = jnp.where(has_keys, m_use + jnp.log(jnp.where(has_keys, total, 1.0)), -jnp.inf)
        plgpu.store(lse_ref.at[i32(b), pl.ds(i32(row), 1)], jnp.full((1,), lse, jnp.float32))


def decode_fwd_stage2(o_part, lse_part, *, seq_q: int, heads_q: int, dtype,
                      config: DecodeConfig, interpret: bool = False, sinks=None):
    """Merge the partials: (out [B, T, Hq, Dv] in `dtype`, lse [B, Hq, T] float32), with
    each head's sink (`sinks` [Hq], or None) in the denominator."""
    batch, n_splits, rows, head_dim_v = o_part.shape
    bdv = fit_block(config.stage2_block_dv, head_dim_v)
    bs = max(2, tiles.next_pow2(n_splits))
    kernel = functools.partial(_stage2_kernel, n_splits=n_splits, seq_q=seq_q, heads_q=heads_q,
                               head_dim_v=head_dim_v, bs=bs, bdv=bdv, sinks=sinks is not None)
    inputs = (o_part, lse_part) + (() if sinks is None else (sinks.astype(jnp.float32),))
    compat.silence_triton_deprecation()
    out, lse = pl.pallas_call(
        kernel,
        out_shape=(compat.output_struct((batch, seq_q, heads_q, head_dim_v), dtype, o_part),
                   compat.output_struct((batch, rows), jnp.float32, o_part)),
        grid=(rows, batch, cdiv(head_dim_v, bdv)),
        compiler_params=compat.compiler_params(config.stage2_num_warps, 1),
        interpret=interpret, name=decode_fwd_stage2.__name__)(*inputs)
    return out, lse.reshape(batch, heads_q, seq_q)


def decode_attention(problem: Problem, config: DecodeConfig, inputs: Inputs, *, num_splits: int,
                     interpret: bool = False, out_dtype=None):
    """Both stages: (out [B, T, Hq, Dv] in `out_dtype` (default q's dtype), lse [B, Hq, T]
    float32), with every feature of `problem` (as in `fwd_generic`) but positions (a block
    of a longer sequence runs `fwd_generic`: `fused.uses_decode`)."""
    if problem.positions:
        raise ValueError("decode_attention takes no positions (FeatureArrays.positions): a "
                         "block of a longer sequence runs fwd_generic; got a problem with "
                         "positions=True")
    o_part, lse_part = decode_fwd_stage1(problem, config, inputs, num_splits=num_splits,
                                         interpret=interpret)
    q = inputs.q
    return decode_fwd_stage2(o_part, lse_part, seq_q=q.shape[1], heads_q=q.shape[2],
                             dtype=out_dtype or q.dtype, config=config, interpret=interpret,
                             sinks=inputs.features.sinks)


def paged_decode_attention(problem: Problem, config: DecodeConfig, q, pages: PagedKV, *,
                           num_splits: int, interpret: bool = False, sinks=None):
    """Both stages over paged K/V (`paged_decode_stage1`): (out [B, T, Hq, Dv] in q's dtype,
    lse [B, Hq, T] float32), with each head's sink (`sinks` [Hq] or None) in the
    denominator."""
    o_part, lse_part = paged_decode_stage1(problem, config, q, pages, num_splits=num_splits,
                                           interpret=interpret)
    return decode_fwd_stage2(o_part, lse_part, seq_q=q.shape[1], heads_q=q.shape[2],
                             dtype=q.dtype, config=config, interpret=interpret, sinks=sinks)


# ------------------------------------------------------------------ descriptors
# Decode (T <= 16 against long S): memory-bound, so each program keeps the whole
# output head dim (V is read once) and only 16 packed query rows; the D chunks of
# QKᵀ walk in a loop above 256 to keep one K chunk live, but at D = 512 the whole chunk
# static was faster (the decode launch sweep, H200; the figures are in docs/history.md,
# "Numbers behind choices in the code").
_STAGE1_DEFAULTS: Table = (
    (128, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_HEADDIM_QK=128, BLOCK_HEADDIM_V=128,
               num_warps=4, num_stages=4)),
    (256, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=256,
               num_warps=4, num_stages=3, DYNAMIC_D=True)),
    (512, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_HEADDIM_QK=512, BLOCK_HEADDIM_V=512,
               num_warps=8, num_stages=2)),
    # BLOCK_N=64 beat 32 at S = 1K to 16K in the H200 autotune run.
    (1024, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=1024,
                num_warps=8, num_stages=2, DYNAMIC_D=True)),
)
# float32 V tiles are twice the bytes: fewer buffered stages / keys per step.
_STAGE1_FP32: Table = ((512, dict(BLOCK_N=16)), (1024, dict(BLOCK_N=16)))
_STAGE2_DEFAULTS: Table = (
    (1024, dict(BLOCK_HEADDIM_V=128, num_warps=4, num_stages=1)),
)


def _stage1_moves(headdim: int) -> list[Move]:
    # Without NUM_SPLITS the kernel's heuristic picks the split count (about four
    # waves of programs); explicit counts around it come first.
    del headdim
    return [set_to("NUM_SPLITS", 32), set_to("NUM_SPLITS", 8), scaled("BLOCK_N", 2),
            scaled("BLOCK_N", 0.5), toggle_warps, add_stages(1), set_to("NUM_SPLITS", 64)]


def _stage1_grid(headdim: int) -> Iterable[dict]:
    d = tile_width(headdim)
    dynamic = headdim > 256
    for splits, bn, w, st in itertools.product((16, 32, 8, 64), (32, 64, 16), (4, 8), (3, 2)):
        yield dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_HEADDIM_QK=min(d, 64 if dynamic else 128),
                   BLOCK_HEADDIM_V=d, NUM_SPLITS=splits, num_warps=w, num_stages=st,
                   **({"DYNAMIC_D": True} if dynamic else {}))


def _stage2_moves(headdim: int) -> list[Move]:
    del headdim
    return [scaled("BLOCK_HEADDIM_V", 2), scaled("BLOCK_HEADDIM_V", 0.5), set_to("num_warps", 8),
            set_to("num_warps", 2), scaled("BLOCK_HEADDIM_V", 4)]


def _stage2_grid(headdim: int) -> Iterable[dict]:
    del headdim
    for st, bdv, w in itertools.product((1, 2, 3), (64, 128, 256, 512, 1024), (1, 2, 4, 8)):
        yield dict(BLOCK_HEADDIM_V=bdv, num_warps=w, num_stages=st)


# Stage 1 is tuned with stage 2 at its default and timed together with it (what a decode
# call costs); stage 2 on stage 1's partials. NUM_SPLITS, DYNAMIC_D: ours (DecodeConfig).
DECODE_FWD_STAGE1 = KernelDescriptor(
    name=decode_fwd_stage1.__name__, direction="forward", config=DecodeConfig, role="decode_stage1",
    function=decode_fwd_stage1,
    block_keys=("BLOCK_M", "BLOCK_N", "BLOCK_HEADDIM_QK", "BLOCK_HEADDIM_V"),
    optional_keys=("NUM_SPLITS", "DYNAMIC_D"), defaults=_STAGE1_DEFAULTS,
    fp32_overrides=_STAGE1_FP32, moves=_stage1_moves, grid=_stage1_grid)
DECODE_FWD_STAGE2 = KernelDescriptor(
    name=decode_fwd_stage2.__name__, direction="forward", config=DecodeConfig, role="decode_stage2",
    function=decode_fwd_stage2, block_keys=("BLOCK_HEADDIM_V",), defaults=_STAGE2_DEFAULTS,
    moves=_stage2_moves, grid=_stage2_grid)
