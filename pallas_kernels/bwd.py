"""The backward kernels: `bwd_preproc` (or `bwd_exact_rows`), `bwd_generic_dq`,
`bwd_generic_dkdv`, `bwd_dbias`.

With P = exp(S - lse) recomputed from the saved lse (no [T, S] matrix is kept):
    dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP − δ),  dQ = scale·dS·K,  dK = scale·dSᵀ·Q,
    dbias = dS (summed over the bias's broadcast dims),
where δ = rowsum(dO ∘ O) − dlse (the lse output's own cotangent folds in here); for
float32, δ = Σ_j P·dP − dlse from the kernels' own P and dP (`bwd_exact_rows`).

- `bwd_generic_dq`: one program per (query block, head, dQ head-dim slice); walks
  the KV blocks like the forward.
- `bwd_generic_dkdv`: one program per (KV block, batch·KV head, head-dim slice);
  loops over the query heads of its GQA group and over the query blocks, so dK
  and dV are reduced inside the program: deterministic, no atomics, never an
  expanded [B, S, Hq, D] gradient. For large D it can compute dK and dV in
  separate programs (`split_dkdv`), each holding one accumulator.
- `bwd_dbias`: one program per tile of the *bias's own shape*; it loops over the
  dims the bias broadcasts over and sums dS in registers, so no buffer larger
  than the bias exists. It is its own pallas_call: when nobody asks for the bias
  gradient, XLA drops it.

Every kernel recomputes S and dP over head-dim chunks with `common.contract_chunks`
(static unroll or a dynamic chunk loop), and accumulates only a slice of the
output head dim, so registers and shared memory stay bounded up to D = 1024.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Iterable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common, compat
from pallas_kernels.common import LN2, LOG2E, cdiv, dot, fit_block, i32, iota
from pallas_kernels.descriptor import (KernelDescriptor, Move, Table, add_stages, scaled, set_to,
                                       tile_width, toggle, toggle_warps)


@dataclasses.dataclass(frozen=True)
class BwdConfig:
    """Launch parameters of one backward kernel (FFPA's keys, plus ours)."""

    block_m: int = 64
    block_n: int = 64
    block_d: int = 64  # chunk of D / Dv for the S and dP reductions
    block_slice: int = 128  # BLOCK_HEADDIM: width of the accumulated head-dim slice
    num_warps: int = 4
    num_stages: int = 2
    dynamic: bool = False  # fori_loop over the reduction chunks instead of a static unroll
    split_dkdv: bool = False  # dkdv only: dK and dV in separate programs

    @classmethod
    def from_tuned(cls, cfg: dict) -> "BwdConfig":
        """A tuned-config `config` dict (FFPA's keys, plus ours) as a BwdConfig."""
        return cls(block_m=cfg["BLOCK_M"], block_n=cfg.get("BLOCK_N", 64),
                   block_d=cfg.get("BLOCK_HEADDIM_QK", 64), block_slice=cfg["BLOCK_HEADDIM"],
                   num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                   dynamic=cfg.get("DYNAMIC_D", False), split_dkdv=cfg.get("SPLIT_DKDV", False))

    def fitted(self, seq_q: int, seq_k: int, head_dim: int, head_dim_v: int) -> "BwdConfig":
        widest = max(head_dim, head_dim_v)
        return dataclasses.replace(
            self, block_m=fit_block(self.block_m, seq_q), block_n=fit_block(self.block_n, seq_k),
            block_d=fit_block(self.block_d, widest), block_slice=fit_block(self.block_slice, widest))


def _n_chunks(st: common.KernelStatic, size: int) -> int:
    """Chunks of the S/dP reductions over a head dim of `size`."""
    return cdiv(size, st.cfg.block_d)


def _n_slices(st: common.KernelStatic, size: int) -> int:
    """Accumulated head-dim slices over a head dim of `size`."""
    return cdiv(size, st.cfg.block_slice)


def _fitted(config: BwdConfig, q, k, v) -> BwdConfig:
    """The config fitted to the problem; in float32 the reduction chunks are the
    forward's (`common.rounds_per_chunk`), so S is recomputed bit for bit."""
    cfg = config.fitted(q.shape[1], k.shape[1], q.shape[3], v.shape[3])
    return common.capped_for_rounding(cfg, q.dtype)[0]


def _fit_shared_memory(cfg: BwdConfig, q, bias, mask, dropout_rate: float) -> BwdConfig:
    """`cfg` with at most 2 pipeline stages for float32 with a bias/mask tile or dropout.

    A float32 call of the GPU fuzz (D=81, dropout 0.5, a per-row bias) overflowed shared
    memory with dq's 3 dropout stages. The forward's estimate
    (`common.fit_stages`) overshoots the backward's real use several-fold (it would cut
    the bf16 dropout dq at D=128, measured to fit with 3 stages), so the backward takes
    this narrower rule, for the case seen."""
    extra = common.extra_tile_bytes(None if bias is None else bias.shape,
                                    None if mask is None else mask.shape,
                                    None if bias is None else bias.dtype,
                                    block_m=cfg.block_m, block_n=cfg.block_n,
                                    dropout=dropout_rate > 0)
    if jnp.dtype(q.dtype) != jnp.float32 or not extra or cfg.num_stages <= 2:
        return cfg
    return dataclasses.replace(cfg, num_stages=2)


def _lse_lo_inputs(lse, lse_lo, q_dtype) -> list:
    if lse_lo is None:
        return []
    if not common.natural_units(q_dtype):
        raise ValueError(f"lse_lo (an exact lse pair) needs float32 inputs; got {q_dtype}")
    if lse_lo.shape != lse.shape:
        raise ValueError(f"lse_lo must have lse's shape {lse.shape}; got {lse_lo.shape}")
    return [lse_lo]


def _prepare(q, k, v, do, lse, delta, bias, mask, seed, *, config: BwdConfig, scale: float,
             causal: bool, over_kv: bool, dropout_rate: float, interpret: bool,
             lse_lo, split_ds: bool = False, own_delta: bool = False, window=None,
             softcap=None, features=None):
    """(kernel inputs, KernelStatic) for dq (over_kv) or dkdv: the config fitted to the
    problem; inputs are the tensors, bias, mask block lists, seed and feature arrays."""
    cfg = _fit_shared_memory(_fitted(config, q, k, v), q, bias, mask, dropout_rate)
    mask_args, list_outer = common.mask_inputs(
        mask, block_m=cfg.block_m, block_n=cfg.block_n, seq_q=q.shape[1], seq_k=k.shape[1],
        causal=causal, over_kv=over_kv)
    inputs = ([q, k, v, do, lse] + _lse_lo_inputs(lse, lse_lo, q.dtype) + [delta]
              + ([bias] if bias is not None else []) + mask_args
              + common.seed_inputs(dropout_rate, seed)
              + common.feature_inputs(features, block_m=cfg.block_m, block_n=cfg.block_n,
                                      over_kv=over_kv))
    st = common.kernel_static(q, k, v, bias, mask, scale=scale, causal=causal, cfg=cfg,
                              list_outer=list_outer, dropout_rate=dropout_rate,
                              interpret=interpret, lse_pair=lse_lo is not None,
                              split_ds=split_ds, own_delta=own_delta, window=window,
                              softcap=softcap, features=features)
    return inputs, st


class _Tile:
    """Loads and recomputation for one (query block, KV block) tile of one head.

    `q_rows`/`kv_rows` are fixed per program for the operand a kernel keeps
    (Q and dO for dq; K and V for dkdv): `resident_*` lists hold their chunks
    when the reductions are unrolled, so they are loaded once per program.
    """

    def __init__(self, st: common.KernelStatic, refs: dict, b, hk):
        self.st, self.refs, self.b, self.hk = st, refs, b, hk
        self.cfg = st.cfg

    def chunk(self, name: str, start_row, rows: int, c, head, n_rows: int, n_cols: int):
        cfg = self.cfg
        return common.load_tile(self.refs[name], self.b, start_row, rows, head,
                                common.chunk_start(c, cfg.block_d), cfg.block_d,
                                n_rows=n_rows, n_cols=n_cols)

    def q_chunks(self, name: str, q_start, h):
        st = self.st
        dim = st.head_dim if name == "q" else st.head_dim_v
        return lambda c: self.chunk(name, q_start, self.cfg.block_m, c, h, st.seq_q, dim)

    def kv_chunks(self, name: str, kv_start):
        st = self.st
        dim = st.head_dim if name == "k" else st.head_dim_v
        return lambda c: self.chunk(name, kv_start, self.cfg.block_n, c, self.hk, st.seq_k, dim)

    @staticmethod
    def resident(loader, n_chunks: int):
        chunks = [loader(c) for c in range(n_chunks)]
        return lambda c: chunks[c]

    def query_operands(self, h, q_start):
        """(Q, dO) chunk loaders of the query block a program keeps (dq, exact rows):
        loaded once up front when the reductions are unrolled."""
        st = self.st
        q_chunk, do_chunk = self.q_chunks("q", q_start, h), self.q_chunks("do", q_start, h)
        if not self.cfg.dynamic:
            q_chunk = self.resident(q_chunk, _n_chunks(st, st.head_dim))
            do_chunk = self.resident(do_chunk, _n_chunks(st, st.head_dim_v))
        return q_chunk, do_chunk

    def features(self, q_start):
        """The window, segments and lengths of the query block at `q_start` (None without)."""
        if not self.st.ranged:
            return None
        return common.TileFeatures(self.st, self.refs, self.b, q_start, self.cfg.block_m)

    def probs_and_dp(self, h, q_start, kv_start, row_lse, **tile_args):
        """(P, dropped P, dP) of the [bm, bn] tile, float32: P = e^(S - lse); the dropped
        P (the forward's mask regenerated, kept values rescaled) is what dV sees; dP is
        dropped the same way, as dP reaches dS only through kept elements (None when
        not needed)."""
        return self._probs(h, q_start, kv_start, row_lse, **tile_args)[:3]

    def _probs(self, h, q_start, kv_start, row_lse, *, q_chunk, k_chunk, do_chunk,
               v_chunk, causal_mask: bool, with_mask: bool, need_dp: bool = True,
               features=None):
        """`probs_and_dp`'s three, and the soft cap's derivative (None without a cap)."""
        st, cfg = self.st, self.cfg
        bm, bn = cfg.block_m, cfg.block_n
        rows = q_start + iota(bm)
        cols = kv_start + iota(bn)
        qk_scale = st.scale * st.score_unit
        per_chunk = common.rounds_per_chunk(self.refs["q"].dtype)
        # As in the forward: unscaled scores, and one fused s·scale - lse per element.
        fold = common.folds_scale(st, per_chunk=per_chunk)
        s = common.contract_chunks(q_chunk, k_chunk, _n_chunks(st, st.head_dim),
                                   dynamic=cfg.dynamic, shape=(bm, bn),
                                   scale=None if fold else qk_scale,
                                   round_per_chunk=per_chunk, compensated=st.natural)
        s, cap_grad = common.bias_and_masks(
            s, st, self.refs.get("bias"), self.refs.get("mask"), self.b, h, q_start, kv_start,
            rows, cols, causal_mask=causal_mask, with_mask=with_mask, mask_rows=True,
            features=features, with_cap_grad=True)
        hi, lo = row_lse
        if fold:
            p = st.exp2(common.fma(s, qk_scale, -hi[:, None]))
        else:
            diff = s - hi[:, None]  # exact near the row's max
            if lo is not None:
                diff = diff - lo[:, None]
            p = st.exp2(st.exp2_arg(diff))
        if st.own_delta:
            # The tile holds the whole row: normalise P by its own sum, as XLA's softmax
            # does (a row's single key gets P = 1 exactly; no keys: P = 0, no 0/0).
            total = jnp.sum(p, axis=1)
            sink = common.sink_share(st, self.refs, h, hi, lo)
            if sink is not None:  # the sink's share of the denominator, which has no key
                total = total + sink
            p = p / jnp.where(total > 0.0, total, 1.0)[:, None]
        keep = None
        if st.dropout_rate > 0:
            keep = common.dropout_keep(st, self.refs["seed"], self.b, h, rows, kv_start, bn)
            inv_keep = 1.0 / (1.0 - st.dropout_rate)
        p_out = p if keep is None else jnp.where(keep, p * inv_keep, 0.0)
        if not need_dp:
            return p, p_out, None, cap_grad
        dp = common.contract_chunks(do_chunk, v_chunk, _n_chunks(st, st.head_dim_v),
                                    dynamic=cfg.dynamic, shape=(bm, bn), compensated=st.natural)
        if keep is not None:
            dp = jnp.where(keep, dp * inv_keep, 0.0)
        return p, p_out, dp, cap_grad

    def probs_and_ds(self, h, q_start, kv_start, row_lse, delta, *, need_ds: bool = True,
                     **tile_args):
        """(dropped P, dS) of the [bm, bn] tile, float32; dS is None when not needed.
        With `own_delta`, `delta` holds dlse and δ = Σ_j P·dP - dlse comes from the tile:
        XLA's softmax gradient, which for a row of one key gives dS = dlse exactly (from
        rowsum(dO ∘ O), summed in another order than the tensor cores' dP, it was ~1e-7
        off, and dQ of such rows ~1e-6 instead of 0)."""
        p, p_out, dp, cap_grad = self._probs(h, q_start, kv_start, row_lse, need_dp=need_ds,
                                             **tile_args)
        if dp is None:
            return p_out, None
        if self.st.own_delta:
            delta = jnp.sum(p * dp, axis=1) - delta
        ds = p * (dp - delta[:, None])
        # Through the soft cap: dS of the uncapped logits (0 where P is, hidden keys too).
        return p_out, ds if cap_grad is None else ds * cap_grad

    def row_stats(self, h, q_start):
        """((lse, lo), δ) for the tile's rows: lse in score units, and lo (None unless the
        kernel was given `lse_lo`) the rounding error of a natural-unit lse. A row with
        lse = -inf (no visible key) has S = -inf everywhere, so any finite stand-in
        gives P = 0 there."""
        st, bm = self.st, self.cfg.block_m
        rows_ok = (q_start + iota(bm)) < st.seq_q
        view = lambda name: self.refs[name].at[self.b, h, common.ds(q_start, bm)]
        lse = plgpu.load(view("lse"), mask=rows_ok, other=0.0)
        delta = plgpu.load(view("delta"), mask=rows_ok, other=0.0)
        lse = jnp.where(lse == -jnp.inf, 0.0, lse if st.natural else lse * LOG2E)
        lo = plgpu.load(view("lse_lo"), mask=rows_ok, other=0.0) if st.lse_pair else None
        return (lse, lo), delta


def rows_in_one_tile(seq_k: int, *configs: BwdConfig) -> bool:
    """Whether each of these kernels holds every key of a row in one tile (S at most its
    fitted BLOCK_N). Then a 16-bit backward takes δ = Σ_j P·dP − dlse from the tile's own
    normalised P and dP (`own_delta`), as XLA's softmax gradient does, instead of
    rowsum(dO ∘ O) from `bwd_preproc`: exact zeros where a row sees one key, for the
    price of a row sum per tile, and no preproc pass."""
    return all(seq_k <= fit_block(c.block_n, seq_k) for c in configs)


def _ref_dict(names, refs):
    return dict(zip(names, refs))


def _input_names(st: common.KernelStatic, *, with_lists: bool) -> list[str]:
    names = ["q", "k", "v", "do", "lse"] + ["lse_lo"] * st.lse_pair + ["delta"]
    if st.bias_shape is not None:
        names.append("bias")
    if st.mask_shape is not None:
        names.append("mask")
        if with_lists:
            names += ["counts", "indices"]
    if st.dropout_rate > 0:
        names.append("seed")
    return names + common.feature_names(st)


# ----------------------------------------------------------------------------- preproc
def _preproc_kernel(o_ref, do_ref, dlse_ref, delta_ref, *, seq_q, heads_q, head_dim_v, bm, bd):
    pid, bh = pl.program_id(0), pl.program_id(1)
    b, h = bh // heads_q, bh % heads_q
    q_start = pid * bm
    acc = jnp.zeros((bm,), jnp.float32)
    for c in range(cdiv(head_dim_v, bd)):
        o = common.load_tile(o_ref, b, q_start, bm, h, c * bd, bd, n_rows=seq_q, n_cols=head_dim_v)
        do = common.load_tile(do_ref, b, q_start, bm, h, c * bd, bd, n_rows=seq_q,
                              n_cols=head_dim_v)
        acc += jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=1)
    rows_ok = (q_start + iota(bm)) < seq_q
    view = lambda ref: ref.at[b, h, common.ds(q_start, bm)]
    dlse = plgpu.load(view(dlse_ref), mask=rows_ok, other=0.0)
    plgpu.store(view(delta_ref), acc - dlse, mask=rows_ok)


def bwd_preproc(o, do, dlse, *, config: BwdConfig, interpret: bool = False) -> jax.Array:
    """δ = rowsum(dO ∘ O) − dlse, float32 [B, Hq, T] (dlse: the lse output's cotangent)."""
    batch, seq_q, heads_q, head_dim_v = o.shape
    bm = fit_block(config.block_m, seq_q)
    bd = fit_block(config.block_slice, head_dim_v)
    compat.silence_triton_deprecation()
    kernel = functools.partial(_preproc_kernel, seq_q=seq_q, heads_q=heads_q,
                               head_dim_v=head_dim_v, bm=bm, bd=bd)
    return pl.pallas_call(
        kernel, out_shape=compat.output_struct((batch, heads_q, seq_q), jnp.float32, do),
        grid=(cdiv(seq_q, bm), batch * heads_q),
        compiler_params=compat.compiler_params(config.num_warps, config.num_stages),
        interpret=interpret, name="bwd_preproc")(o, do, dlse)


# ----------------------------------------------------------------------------- KV walk
def _walk_kv_blocks(st: common.KernelStatic, r: dict, b, h, q_block, q_start, visit,
                    carry, features=None):
    """`carry` folded through `visit(kv_block, carry, causal_mask=, with_mask=)` over the
    KV blocks that query block `q_block` of head h sees, the forward's walk: the mask's
    block list, or the blocks the window, segments and lengths leave (`features`), or the
    causal limits (unmasked blocks first), or every block."""
    bm, bn = st.cfg.block_m, st.cfg.block_n
    if st.mask_shape is None and st.ranged:
        hi = (common.causal_block_limits(q_start, bm, bn, st.seq_q, st.seq_k)[1] if st.causal
              else cdiv(st.seq_k, bn))
        lo, hi = features.kv_block_range(q_block, q_start, bm, bn, hi)
        return jax.lax.fori_loop(lo, hi, functools.partial(visit, causal_mask=st.causal,
                                                           with_mask=False), carry)
    if st.mask_shape is not None:
        lb = i32(common.broadcast_index(b, r["counts"].shape[0]))
        lh = i32(common.broadcast_index(h, r["counts"].shape[1]))
        lq = q_block if st.list_outer != 1 else i32(0)
        listed = lambda i, c: visit(r["indices"][lb, lh, lq, i], c, causal_mask=st.causal,
                                    with_mask=True)
        return jax.lax.fori_loop(i32(0), r["counts"][lb, lh, lq], listed, carry)
    if st.causal:
        n_unmasked, n_total = common.causal_block_limits(q_start, bm, bn, st.seq_q, st.seq_k)
        carry = jax.lax.fori_loop(i32(0), n_unmasked,
                                  functools.partial(visit, causal_mask=False, with_mask=False),
                                  carry)
        return jax.lax.fori_loop(n_unmasked, n_total,
                                 functools.partial(visit, causal_mask=True, with_mask=False),
                                 carry)
    return jax.lax.fori_loop(i32(0), i32(cdiv(st.seq_k, bn)),
                             functools.partial(visit, causal_mask=False, with_mask=False), carry)


# ----------------------------------------------------------------------------- exact rows
def _exact_rows_kernel(*refs, st: common.KernelStatic):
    names = _input_names(st, with_lists=True)  # the "delta" input holds dlse here
    r = _ref_dict(names, refs[:len(names)])
    delta_ref, lo_ref = refs[len(names):]
    cfg = st.cfg
    bm, bn = cfg.block_m, cfg.block_n
    q_block, bh = pl.program_id(0), pl.program_id(1)
    b, h = bh // st.heads_q, bh % st.heads_q
    q_start = q_block * bm
    tile = _Tile(st, r, b, h // st.group)
    row_lse, dlse = tile.row_stats(h, q_start)
    q_chunk, do_chunk = tile.query_operands(h, q_start)
    features = tile.features(q_start)

    def visit(kv_block, sums, *, causal_mask, with_mask):
        p_dp_sum, p_sum = sums
        kv_start = kv_block * bn
        p, _, dp = tile.probs_and_dp(h, q_start, kv_start, row_lse, q_chunk=q_chunk,
                                     k_chunk=tile.kv_chunks("k", kv_start), do_chunk=do_chunk,
                                     v_chunk=tile.kv_chunks("v", kv_start),
                                     causal_mask=causal_mask, with_mask=with_mask,
                                     features=features)
        return p_dp_sum + jnp.sum(p * dp, axis=1), p_sum + jnp.sum(p, axis=1)

    zero = jnp.zeros((bm,), jnp.float32)
    p_dp_sum, p_sum = _walk_kv_blocks(st, r, b, h, q_block, q_start, visit, (zero, zero),
                                      features)
    sink = common.sink_share(st, r, h, *row_lse)
    if sink is not None:  # the sink's share completes the row's sum to 1
        p_sum = p_sum + sink
    p_sum = jnp.where(p_sum > 0.0, p_sum, 1.0)  # a row without keys: P = 0 anyway
    lo = row_lse[1] if row_lse[1] is not None else zero
    rows_ok = (q_start + iota(bm)) < st.seq_q
    plgpu.store(delta_ref.at[b, h, common.ds(q_start, bm)], p_dp_sum / p_sum - dlse,
                mask=rows_ok)
    plgpu.store(lo_ref.at[b, h, common.ds(q_start, bm)], lo + jnp.log2(p_sum) * LN2,
                mask=rows_ok)


def bwd_exact_rows(q, k, v, do, lse, dlse, bias=None, mask=None, *, scale: float,
                   causal: bool, config: BwdConfig, interpret: bool = False,
                   dropout_rate: float = 0.0, seed: jax.Array | None = None,
                   lse_lo: jax.Array | None = None, window=None, softcap=None,
                   features=None) -> tuple[jax.Array, jax.Array]:
    """(δ, lse_lo), float32 [B, Hq, T] each, from the backward's own P and dP (float32).

    The returned lse_lo (the given one, or 0, plus a correction) makes the backward's
    P = e^((S - lse) - lse_lo) sum to 1 over each row, and δ = Σ_j P·dP − dlse over that
    P: XLA's softmax gradient, which normalises P and subtracts Σ P·dP of its own values.
    float32 needs both:
    - rowsum(dO ∘ O) (`bwd_preproc`) rounds differently from the kernels' dP, and the two
      cancel in dS = P ∘ (dP − δ) (exactly, for a row that sees one key): in the GPU
      fuzz, float32, D=1024, T=1, S=10, dropout 0.9 gave dq 52x XLA's error.
    - P from the forward's lse sums to 1 only where the backward rounds every logit as
      the forward did; a row sum off by 6e-6, times |δ| ~ 27, gave dq 5x XLA's error
      (float32, D=150, S=208, logits ~ 170; Pallas interpreter).
    The price: one more pass over the keys (S and dP recomputed: 2 of the backward's 7
    matmuls)."""
    if not common.natural_units(q.dtype):
        raise ValueError(f"bwd_exact_rows is for float32 inputs; got {q.dtype}")
    inputs, st = _prepare(q, k, v, do, lse, dlse, bias, mask, seed, config=config,
                          scale=scale, causal=causal, over_kv=True, dropout_rate=dropout_rate,
                          interpret=interpret, lse_lo=lse_lo, window=window, softcap=softcap,
                          features=features)
    rows = compat.output_struct((st.batch, st.heads_q, st.seq_q), jnp.float32, q)
    compat.silence_triton_deprecation()
    return pl.pallas_call(
        functools.partial(_exact_rows_kernel, st=st), out_shape=(rows, rows),
        grid=(cdiv(st.seq_q, st.cfg.block_m), st.batch * st.heads_q),
        compiler_params=compat.compiler_params(st.cfg.num_warps, st.cfg.num_stages),
        interpret=interpret, name="bwd_exact_rows")(*inputs)


# ----------------------------------------------------------------------------- dq
def _dq_kernel(*refs, st: common.KernelStatic):
    names = _input_names(st, with_lists=True)
    r = _ref_dict(names, refs[:len(names)])
    dq_ref = refs[len(names)]
    cfg = st.cfg
    bm, bn, width = cfg.block_m, cfg.block_n, cfg.block_slice
    n_slices = _n_slices(st, st.head_dim)
    pid, bh = pl.program_id(0), pl.program_id(1)
    q_block, sl = (pid, i32(0)) if n_slices == 1 else (pid // n_slices, pid % n_slices)
    b, h = bh // st.heads_q, bh % st.heads_q
    hk = h // st.group
    q_start = q_block * bm
    tile = _Tile(st, r, b, hk)
    row_lse, delta = tile.row_stats(h, q_start)
    q_chunk, do_chunk = tile.query_operands(h, q_start)
    features = tile.features(q_start)

    def visit(kv_block, acc, *, causal_mask, with_mask):
        kv_start = kv_block * bn
        _, ds = tile.probs_and_ds(h, q_start, kv_start, row_lse, delta, q_chunk=q_chunk,
                                  k_chunk=tile.kv_chunks("k", kv_start), do_chunk=do_chunk,
                                  v_chunk=tile.kv_chunks("v", kv_start),
                                  causal_mask=causal_mask, with_mask=with_mask,
                                  features=features)
        k_slice = common.load_tile(r["k"], b, kv_start, bn, hk, sl * width, width,
                                   n_rows=st.seq_k, n_cols=st.head_dim)
        return common.accumulate_ds(acc, ds, k_slice, split=st.split_ds)

    acc = _walk_kv_blocks(st, r, b, h, q_block, q_start, visit,
                          jnp.zeros((bm, width), jnp.float32), features)
    common.store_tile(dq_ref, acc * st.scale, b, q_start, bm, h, sl * width, width,
                      n_rows=st.seq_q, n_cols=st.head_dim)


def bwd_generic_dq(q, k, v, do, lse, delta, bias=None, mask=None, *, scale: float, causal: bool,
                   config: BwdConfig, interpret: bool = False, dropout_rate: float = 0.0,
                   seed: jax.Array | None = None, lse_lo: jax.Array | None = None,
                   split_ds: bool = False, own_delta: bool = False, window=None,
                   softcap=None, features=None) -> jax.Array:
    """dQ [B, T, Hq, D] in q's dtype. `split_ds`: dS in two 16-bit words
    (`common.accumulate_ds`), for a delta that carries an lse cotangent. `own_delta`: `delta`
    is dlse, and δ comes from each tile (see `rows_in_one_tile`). `window`, `softcap` and
    `features` (segment ids, lengths, sinks) as in `fwd_generic`."""
    inputs, st = _prepare(q, k, v, do, lse, delta, bias, mask, seed, config=config, scale=scale,
                          causal=causal, over_kv=True, dropout_rate=dropout_rate,
                          interpret=interpret, lse_lo=lse_lo, split_ds=split_ds,
                          own_delta=own_delta, window=window, softcap=softcap,
                          features=features)
    cfg = st.cfg
    compat.silence_triton_deprecation()
    grid = (cdiv(st.seq_q, cfg.block_m) * _n_slices(st, st.head_dim), st.batch * st.heads_q)
    return pl.pallas_call(
        functools.partial(_dq_kernel, st=st), out_shape=compat.output_struct(q.shape, q.dtype, q),
        grid=grid, compiler_params=compat.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret, name="bwd_generic_dq")(*inputs)


# ----------------------------------------------------------------------------- dk, dv
def _dkdv_kernel(*refs, st: common.KernelStatic, tasks: tuple[tuple[str, int], ...]):
    """`tasks` lists, per program along grid axis 0 (after the KV block), which
    accumulator(s) it computes: ("dkdv" | "dk" | "dv", slice index)."""
    names = _input_names(st, with_lists=True)
    r = _ref_dict(names, refs[:len(names)])
    dk_ref, dv_ref = refs[len(names):]
    bn = st.cfg.block_n
    pid, bhk = pl.program_id(0), pl.program_id(1)
    kv_block, task = pid // len(tasks), pid % len(tasks)
    b, hk = bhk // st.heads_kv, bhk % st.heads_kv
    kv_start = kv_block * bn

    if len(tasks) == 1:
        (kind, sl), = tasks
        _dkdv_program(st, r, dk_ref, dv_ref, b, hk, kv_block, kv_start,
                      with_dk=kind in ("dkdv", "dk"), with_dv=kind in ("dkdv", "dv"), sl=sl)
        return
    # Each task is its own branch; a program runs exactly one.
    for task_id, (kind, sl) in enumerate(tasks):
        @pl.when(task == task_id)
        def _run(kind=kind, sl=sl):
            _dkdv_program(st, r, dk_ref, dv_ref, b, hk, kv_block, kv_start,
                          with_dk=kind in ("dkdv", "dk"), with_dv=kind in ("dkdv", "dv"), sl=sl)


def _dkdv_program(st, r, dk_ref, dv_ref, b, hk, kv_block, kv_start, *, with_dk, with_dv, sl):
    cfg = st.cfg
    bm, bn, width = cfg.block_m, cfg.block_n, cfg.block_slice
    tile = _Tile(st, r, b, hk)
    k_chunk, v_chunk = tile.kv_chunks("k", kv_start), tile.kv_chunks("v", kv_start)
    if not cfg.dynamic:
        k_chunk = tile.resident(k_chunk, _n_chunks(st, st.head_dim))
        if with_dk:
            v_chunk = tile.resident(v_chunk, _n_chunks(st, st.head_dim_v))

    def visit(q_block, accs, h, *, causal_mask, with_mask):
        dk_acc, dv_acc = accs
        q_start = q_block * bm
        row_lse, delta = tile.row_stats(h, q_start)
        p, ds = tile.probs_and_ds(h, q_start, kv_start, row_lse, delta,
                                  q_chunk=tile.q_chunks("q", q_start, h), k_chunk=k_chunk,
                                  do_chunk=tile.q_chunks("do", q_start, h), v_chunk=v_chunk,
                                  causal_mask=causal_mask, with_mask=with_mask, need_ds=with_dk,
                                  features=tile.features(q_start))
        if with_dv:
            do_slice = common.load_tile(r["do"], b, q_start, bm, h, sl * width, width,
                                        n_rows=st.seq_q, n_cols=st.head_dim_v)
            dv_acc = dv_acc + dot(p.astype(do_slice.dtype), do_slice, trans_a=True)
        if with_dk:
            q_slice = common.load_tile(r["q"], b, q_start, bm, h, sl * width, width,
                                       n_rows=st.seq_q, n_cols=st.head_dim)
            dk_acc = common.accumulate_ds(dk_acc, ds, q_slice, trans_a=True,
                                          split=st.split_ds)
        return dk_acc, dv_acc

    def over_q_blocks(h, accs):
        partial = lambda **kw: (lambda i, a: visit(i, a, h, **kw))
        if st.mask_shape is not None:
            lb = i32(common.broadcast_index(b, r["counts"].shape[0]))
            lh = i32(common.broadcast_index(h, r["counts"].shape[1]))
            lk = kv_block if st.list_outer != 1 else i32(0)
            listed = lambda i, a: visit(r["indices"][lb, lh, lk, i], a, h,
                                        causal_mask=st.causal, with_mask=True)
            return jax.lax.fori_loop(i32(0), r["counts"][lb, lh, lk], listed, accs)
        n_q = i32(cdiv(st.seq_q, bm))
        if st.ranged:
            # The query blocks the window, segments and lengths let see this key block;
            # every visit takes their element masks (and causality's).
            first = (common.causal_q_block_limits(kv_start, bm, bn, st.seq_q, st.seq_k)[0]
                     if st.causal else i32(0))
            lo, hi = common.q_block_range(st, r, b, kv_block, kv_start, bm, bn, first, n_q)
            return jax.lax.fori_loop(lo, hi, partial(causal_mask=st.causal, with_mask=False),
                                     accs)
        if st.causal:
            first, first_unmasked = common.causal_q_block_limits(kv_start, bm, bn, st.seq_q,
                                                                 st.seq_k)
            accs = jax.lax.fori_loop(first, first_unmasked,
                                     partial(causal_mask=True, with_mask=False), accs)
            return jax.lax.fori_loop(first_unmasked, n_q,
                                     partial(causal_mask=False, with_mask=False), accs)
        return jax.lax.fori_loop(i32(0), n_q, partial(causal_mask=False, with_mask=False), accs)

    zeros = jnp.zeros((bn, width), jnp.float32)
    accs = (zeros if with_dk else None, zeros if with_dv else None)
    h0 = hk * st.group
    if st.group == 1:
        accs = over_q_blocks(h0, accs)
    else:
        accs = jax.lax.fori_loop(i32(0), i32(st.group),
                                 lambda g, a: over_q_blocks(h0 + g, a), accs)
    dk_acc, dv_acc = accs
    if with_dk:
        common.store_tile(dk_ref, dk_acc * st.scale, b, kv_start, bn, hk, sl * width, width,
                          n_rows=st.seq_k, n_cols=st.head_dim)
    if with_dv:
        common.store_tile(dv_ref, dv_acc, b, kv_start, bn, hk, sl * width, width,
                          n_rows=st.seq_k, n_cols=st.head_dim_v)


def dkdv_tasks(head_dim: int, head_dim_v: int, width: int, split: bool):
    """Per-KV-block programs: which accumulators each computes, over which slice."""
    n_k, n_v = cdiv(head_dim, width), cdiv(head_dim_v, width)
    if split:
        return tuple(("dk", s) for s in range(n_k)) + tuple(("dv", s) for s in range(n_v))
    return tuple(("dkdv" if s < min(n_k, n_v) else ("dk" if s < n_k else "dv"), s)
                 for s in range(max(n_k, n_v)))


def bwd_generic_dkdv(q, k, v, do, lse, delta, bias=None, mask=None, *, scale: float,
                     causal: bool, config: BwdConfig, interpret: bool = False,
                     dropout_rate: float = 0.0, seed: jax.Array | None = None,
                     lse_lo: jax.Array | None = None, split_ds: bool = False,
                     own_delta: bool = False, window=None, softcap=None, features=None):
    """(dK [B, S, Hkv, D], dV [B, S, Hkv, Dv]) in k's / v's dtype. `split_ds`,
    `own_delta`, `window`, `softcap` and `features` as in `bwd_generic_dq`."""
    inputs, st = _prepare(q, k, v, do, lse, delta, bias, mask, seed, config=config, scale=scale,
                          causal=causal, over_kv=False, dropout_rate=dropout_rate,
                          interpret=interpret, lse_lo=lse_lo, split_ds=split_ds,
                          own_delta=own_delta, window=window, softcap=softcap,
                          features=features)
    cfg = st.cfg
    tasks = dkdv_tasks(st.head_dim, st.head_dim_v, cfg.block_slice, cfg.split_dkdv)
    compat.silence_triton_deprecation()
    grid = (cdiv(st.seq_k, cfg.block_n) * len(tasks), st.batch * st.heads_kv)
    return pl.pallas_call(
        functools.partial(_dkdv_kernel, st=st, tasks=tasks),
        out_shape=(compat.output_struct(k.shape, k.dtype, q),
                   compat.output_struct(v.shape, v.dtype, q)),
        grid=grid, compiler_params=compat.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret, name="bwd_generic_dkdv")(*inputs)


# ----------------------------------------------------------------------------- dbias
def _dbias_kernel(*refs, st: common.KernelStatic):
    names = _input_names(st, with_lists=False)
    r = _ref_dict(names, refs[:len(names)])
    dbias_ref = refs[len(names)]
    cfg = st.cfg
    bm, bn = cfg.block_m, cfg.block_n
    bb, bh_, bt, bs = st.bias_shape
    n_tk = cdiv(st.seq_k, bn) if bs != 1 else 1
    pid, owner = pl.program_id(0), pl.program_id(1)
    tq, tk = (pid // n_tk, pid % n_tk) if n_tk > 1 else (pid, i32(0))
    tb, th = owner // bh_, owner % bh_

    # The program owns bias tile (tb, th, tq, tk) and sums dS over every dim the
    # bias broadcasts: batch, heads, query blocks, KV blocks, flattened into one loop.
    loop_b = st.batch if bb == 1 else 1
    loop_h = st.heads_q if bh_ == 1 else 1
    loop_q = cdiv(st.seq_q, bm) if bt == 1 else 1
    loop_k = cdiv(st.seq_k, bn) if bs == 1 else 1

    def body(it, acc):
        ik = it % loop_k
        iq = (it // loop_k) % loop_q
        ih = (it // (loop_k * loop_q)) % loop_h
        ib = it // (loop_k * loop_q * loop_h)
        b = tb if bb != 1 else ib
        h = th if bh_ != 1 else ih
        q_block = tq if bt != 1 else iq
        kv_block = tk if bs != 1 else ik
        q_start, kv_start = q_block * bm, kv_block * bn
        tile = _Tile(st, r, b, h // st.group)
        row_lse, delta = tile.row_stats(h, q_start)
        _, ds = tile.probs_and_ds(h, q_start, kv_start, row_lse, delta,
                                  q_chunk=tile.q_chunks("q", q_start, h),
                                  k_chunk=tile.kv_chunks("k", kv_start),
                                  do_chunk=tile.q_chunks("do", q_start, h),
                                  v_chunk=tile.kv_chunks("v", kv_start),
                                  causal_mask=st.causal, with_mask=st.mask_shape is not None,
                                  features=tile.features(q_start))
        if bt == 1:
            ds = jnp.sum(ds, axis=0, keepdims=True)
        if bs == 1:
            ds = jnp.sum(ds, axis=1, keepdims=True)
        return acc + ds

    acc = jnp.zeros((bm if bt != 1 else 1, bn if bs != 1 else 1), jnp.float32)
    acc = jax.lax.fori_loop(i32(0), i32(loop_b * loop_h * loop_q * loop_k), body, acc)
    rows = (tq * bm + iota(bm))[:, None] if bt != 1 else None
    cols = (tk * bn + iota(bn))[None, :] if bs != 1 else None
    mask = None
    if rows is not None:
        mask = rows < st.seq_q
    if cols is not None:
        mask = cols < st.seq_k if mask is None else mask & (cols < st.seq_k)
    r_ds = common.ds(tq * bm, bm) if bt != 1 else common.ds(0, 1)
    c_ds = common.ds(tk * bn, bn) if bs != 1 else common.ds(0, 1)
    plgpu.store(dbias_ref.at[tb, th, r_ds, c_ds], acc, mask=mask)


def bwd_dbias(q, k, v, do, lse, delta, bias, mask=None, *, scale: float, causal: bool,
              config: BwdConfig, interpret: bool = False, dropout_rate: float = 0.0,
              seed: jax.Array | None = None, lse_lo: jax.Array | None = None,
              own_delta: bool = False, window=None, softcap=None,
              features=None) -> jax.Array:
    """dbias with bias's own 4-D shape (each dim 1 or full), float32. `own_delta`,
    `window`, `softcap` and `features` as in `bwd_generic_dq` (every tile is visited; the
    features mask within it)."""
    cfg = dataclasses.replace(_fitted(config, q, k, v), split_dkdv=False)
    st = common.kernel_static(q, k, v, bias, mask, scale=scale, causal=causal, cfg=cfg,
                              dropout_rate=dropout_rate, interpret=interpret,
                              lse_pair=lse_lo is not None, own_delta=own_delta,
                              window=window, softcap=softcap, features=features)
    inputs = ([q, k, v, do, lse] + _lse_lo_inputs(lse, lse_lo, q.dtype) + [delta, bias]
              + ([mask] if mask is not None else [])
              + common.seed_inputs(dropout_rate, seed)
              + common.feature_inputs(features, block_m=cfg.block_m, block_n=cfg.block_n))
    bb, bh, bt, bs = bias.shape
    n_tq = cdiv(st.seq_q, cfg.block_m) if bt != 1 else 1
    n_tk = cdiv(st.seq_k, cfg.block_n) if bs != 1 else 1
    compat.silence_triton_deprecation()
    return pl.pallas_call(
        functools.partial(_dbias_kernel, st=st),
        out_shape=compat.output_struct(bias.shape, jnp.float32, q),
        grid=(n_tq * n_tk, bb * bh),
        compiler_params=compat.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret, name="bwd_dbias")(*inputs)


# ------------------------------------------------------------------ descriptors
# Built-in launch configs per head dim, chosen by the launch-variant sweeps on the H200
# (docs/bwd_variants.md; the figures are in docs/history.md, "Numbers behind choices in
# the code").
# BLOCK_HEADDIM is the accumulated head-dim slice, BLOCK_HEADDIM_QK the chunk of the S/dP
# reductions.

_DQ_DEFAULTS: Table = (
    (64, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_HEADDIM=64, BLOCK_HEADDIM_QK=64,
              num_warps=8, num_stages=3)),
    (128, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_HEADDIM=128, BLOCK_HEADDIM_QK=128,
               num_warps=8, num_stages=2)),
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_HEADDIM=256, BLOCK_HEADDIM_QK=64,
               DYNAMIC_D=True, num_warps=8, num_stages=3)),
    # A 512-wide slice halves the S/dP recomputation against 256 and still fits;
    # BLOCK_N = 128 doubles the work per reloaded Q/dO chunk.
    (1024, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_HEADDIM=512, BLOCK_HEADDIM_QK=64,
                DYNAMIC_D=True, num_warps=8, num_stages=3)),
)
# dbias recomputes S and dP like dq, but no operand is resident: Q, dO, K and V are
# all reloaded per tile and pipelined, so dq's D=128 tiles (4 x 32 KiB x 2 stages)
# overflow shared memory; half-size tiles.
_DBIAS_DEFAULTS: Table = tuple(
    (dim, dict(cfg, BLOCK_M=64, BLOCK_N=64, num_warps=4) if dim == 128 else cfg)
    for dim, cfg in _DQ_DEFAULTS)
_DKDV_DEFAULTS: Table = (
    (64, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_HEADDIM=64, BLOCK_HEADDIM_QK=64,
              num_warps=4, num_stages=3)),
    (128, dict(BLOCK_M=64, BLOCK_N=64, BLOCK_HEADDIM=128, BLOCK_HEADDIM_QK=128,
               num_warps=4, num_stages=2)),
    (256, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_HEADDIM=256, BLOCK_HEADDIM_QK=64,
               DYNAMIC_D=True, SPLIT_DKDV=True, num_warps=8, num_stages=3)),
    # BLOCK_M (the query tile walked by each KV program) = 128 likewise.
    (1024, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_HEADDIM=512, BLOCK_HEADDIM_QK=64,
                DYNAMIC_D=True, SPLIT_DKDV=True, num_warps=8, num_stages=3)),
)
_PREPROC_DEFAULTS: Table = (
    (1024, dict(BLOCK_M=64, BLOCK_HEADDIM=128, num_warps=4, num_stages=1)),
)

# float32 tiles take twice the shared memory of 16-bit ones: where a 16-bit
# default is sized to the limit, float32 gets the smaller tile it was measured
# with first; float32 calls of the GPU fuzz overflowed shared memory at D <= 128 (dq's
# tiles halve) and D <= 256 (dq, dbias and dkdv shrink).
_DQ_FP32: Table = ((128, dict(BLOCK_M=64, BLOCK_N=64)), (256, dict(BLOCK_N=64)),
                   (1024, dict(BLOCK_N=64)))
_DBIAS_FP32: Table = ((256, dict(BLOCK_N=64)), (1024, dict(BLOCK_N=64)))
_DKDV_FP32: Table = ((256, dict(BLOCK_N=64)), (1024, dict(BLOCK_M=64)))

# With dropout each tile also generates its keep-mask, which changes the best tiles (the
# dropout launch sweep).
_DQ_DROPOUT: Table = ((128, dict(BLOCK_N=64, num_stages=3)), (1024, dict(BLOCK_HEADDIM_QK=128)))
_DKDV_DROPOUT: Table = ((1024, dict(BLOCK_M=64)),)


def _moves(headdim: int, *, split_dkdv: bool = False) -> list[Move]:
    if headdim <= 128:
        return [scaled("BLOCK_N", 0.5), scaled("BLOCK_M", 0.5), add_stages(1), toggle_warps,
                scaled("BLOCK_N", 2), scaled("BLOCK_M", 2), add_stages(-1)]
    moves = [scaled("BLOCK_HEADDIM", 0.5), scaled("BLOCK_N", 0.5), scaled("BLOCK_M", 0.5),
             scaled("BLOCK_HEADDIM_QK", 2), add_stages(1), add_stages(-1), toggle_warps]
    if split_dkdv:
        moves.insert(2, toggle("SPLIT_DKDV"))
    return moves


def _grid(headdim: int, *, split_dkdv: bool = False) -> Iterable[dict]:
    d = tile_width(headdim)
    if headdim <= 128:
        for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
            yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_HEADDIM=d, BLOCK_HEADDIM_QK=d,
                       num_warps=w, num_stages=st)
        return
    splits = (True, False) if split_dkdv else (False,)
    slices = (256, 128) if headdim <= 256 else (512, 256)
    for bm, bn, sl, bd, st, split in itertools.product((64, 128), (64, 128, 32), slices,
                                                        (64, 128), (3, 2), splits):
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_HEADDIM=sl, BLOCK_HEADDIM_QK=bd,
                   DYNAMIC_D=True, num_warps=8, num_stages=st)
        if split_dkdv:
            cfg["SPLIT_DKDV"] = split
        yield cfg


def _preproc_moves(headdim: int) -> list[Move]:
    del headdim
    return [scaled("BLOCK_M", 2), scaled("BLOCK_M", 0.5), scaled("BLOCK_HEADDIM", 2),
            scaled("BLOCK_HEADDIM", 0.5), set_to("num_warps", 8), set_to("num_warps", 2),
            add_stages(1)]


def _preproc_grid(headdim: int) -> Iterable[dict]:
    del headdim
    for st, bm, bh, w in itertools.product((1, 2), (64, 32, 128, 256), (128, 64, 256),
                                           (4, 2, 8, 1)):
        yield dict(BLOCK_M=bm, BLOCK_HEADDIM=bh, num_warps=w, num_stages=st)


# Our extensions of FFPA's backward keys (absent = the kernel's default):
# BLOCK_HEADDIM_QK, the head-dim chunk of the S and dP reductions; DYNAMIC_D, walk
# those chunks with a dynamic loop; SPLIT_DKDV, dK and dV in separate programs.
_OPTIONAL = ("BLOCK_HEADDIM_QK", "DYNAMIC_D")
_BLOCKS = ("BLOCK_M", "BLOCK_N", "BLOCK_HEADDIM")

BWD_PREPROC = KernelDescriptor(
    name="bwd_preproc", direction="backward", config=BwdConfig, role="delta",
    function=bwd_preproc, block_keys=("BLOCK_M", "BLOCK_HEADDIM"),
    optional_keys=("D_CHUNK",), defaults=_PREPROC_DEFAULTS, moves=_preproc_moves,
    grid=_preproc_grid)
BWD_GENERIC_DKDV = KernelDescriptor(
    name="bwd_generic_dkdv", direction="backward", config=BwdConfig, role="dkdv",
    function=bwd_generic_dkdv, block_keys=_BLOCKS, optional_keys=_OPTIONAL + ("SPLIT_DKDV",),
    defaults=_DKDV_DEFAULTS, fp32_overrides=_DKDV_FP32, dropout_overrides=_DKDV_DROPOUT,
    moves=functools.partial(_moves, split_dkdv=True),
    grid=functools.partial(_grid, split_dkdv=True))
BWD_GENERIC_DQ = KernelDescriptor(
    name="bwd_generic_dq", direction="backward", config=BwdConfig, role="dq",
    function=bwd_generic_dq, block_keys=_BLOCKS, optional_keys=_OPTIONAL,
    defaults=_DQ_DEFAULTS, fp32_overrides=_DQ_FP32, dropout_overrides=_DQ_DROPOUT,
    moves=_moves, grid=_grid)
# Ours: the bias gradient, summed over the bias's broadcast dims in-kernel.
BWD_DBIAS = KernelDescriptor(
    name="bwd_dbias", direction="backward", config=BwdConfig, role="dbias",
    function=bwd_dbias, block_keys=_BLOCKS, optional_keys=_OPTIONAL,
    defaults=_DBIAS_DEFAULTS, fp32_overrides=_DBIAS_FP32, moves=_moves, grid=_grid)
