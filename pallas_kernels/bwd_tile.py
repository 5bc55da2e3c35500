"""What the backward kernels share: their launch config (`BwdConfig`), their per-row inputs
(`BackwardRows`), the preparation of a kernel's inputs and static record (`prepare`), and
`Tile`, the recomputation of one (query block, key block) tile of P, dP and dS.

With P = exp(S - lse) recomputed from the saved lse (no [T, S] matrix is kept):
    dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP − δ),  dQ = scale·dS·K,  dK = scale·dSᵀ·Q,
where δ = rowsum(dO ∘ O) − dlse (the lse output's own cotangent folds in here); for
float32, δ = Σ_j P·dP − dlse from the kernels' own P and dP (`bwd.bwd_exact_rows`).
Every kernel recomputes S and dP over head-dim chunks with `numerics.contract_chunks`
(static unroll or a dynamic chunk loop), and accumulates only a slice of the output head
dim, so registers and shared memory stay bounded up to D = 1024.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import kernel_inputs, numerics, static, tiles
from pallas_kernels.numerics import LOG2E
from pallas_kernels.problem import Inputs, Problem
from pallas_kernels.tiles import cdiv, fit_block, iota


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
            block_d=fit_block(self.block_d, widest),
            block_slice=fit_block(self.block_slice, widest))


class BackwardRows(NamedTuple):
    """The per-row inputs of the backward kernels besides `Inputs`: the output's cotangent
    dO [B, T, Hq, Dv], lse [B, Hq, T] (natural log), δ [B, Hq, T] (rowsum(dO ∘ O) − dlse; or
    dlse itself for `bwd_exact_rows` and for the kernels that form δ from their own tile,
    `own_delta`), and, where `Problem.lse_pair`, lse's low word."""

    d_out: Any
    lse: Any
    delta: Any
    lse_lo: Any = None


def n_chunks(st: static.KernelStatic, size: int) -> int:
    """Chunks of the S/dP reductions over a head dim of `size`."""
    return cdiv(size, st.cfg.block_d)


def n_slices(st: static.KernelStatic, size: int) -> int:
    """Accumulated head-dim slices over a head dim of `size`."""
    return cdiv(size, st.cfg.block_slice)


def fitted(config: BwdConfig, problem: Problem) -> BwdConfig:
    """The config fitted to the problem; in float32 the reduction chunks are the
    forward's (`numerics.rounds_per_chunk`), so S is recomputed bit for bit."""
    cfg = config.fitted(problem.seq_q, problem.seq_k, problem.head_dim, problem.head_dim_v)
    return numerics.capped_for_rounding(cfg, problem.dtype)[0]


def _fit_shared_memory(cfg: BwdConfig, problem: Problem, bias_dtype) -> BwdConfig:
    """`cfg` with at most 2 pipeline stages for float32 with a bias/mask tile or dropout.

    A float32 call of the GPU fuzz (D=81, dropout 0.5, a per-row bias) overflowed shared
    memory with dq's 3 dropout stages. The forward's estimate
    (`kernel_inputs.fit_stages`) overshoots the backward's real use several-fold (it would
    cut the bf16 dropout dq at D=128, measured to fit with 3 stages), so the backward takes
    this narrower rule, for the case seen."""
    extra = kernel_inputs.extra_tile_bytes(problem.bias_shape, problem.mask_shape, bias_dtype,
                                           block_m=cfg.block_m, block_n=cfg.block_n,
                                           dropout=problem.has_dropout)
    if not problem.natural or not extra or cfg.num_stages <= 2:
        return cfg
    return dataclasses.replace(cfg, num_stages=2)


def _lse_lo_inputs(problem: Problem, rows: BackwardRows) -> list:
    if not problem.lse_pair:
        return []
    if rows.lse_lo is None or rows.lse_lo.shape != rows.lse.shape:
        raise ValueError(f"float32 backward kernels take lse as an exact pair: lse_lo must "
                         f"have lse's shape {rows.lse.shape}; got "
                         f"{None if rows.lse_lo is None else rows.lse_lo.shape}")
    return [rows.lse_lo]


def prepare(problem: Problem, config: BwdConfig, inputs: Inputs, rows: BackwardRows, *,
            over_kv: bool, interpret: bool, split_ds: bool = False, own_delta: bool = False):
    """(kernel arrays, KernelStatic) of a backward kernel that walks key blocks (`over_kv`:
    dq, exact rows) or query blocks (dkdv): the problem fitted to the arrays, the config to
    the problem; the arrays are the tensors, the row inputs, the bias, the mask's block
    lists, the seed and the feature arrays, in `input_names`' order."""
    problem = problem.sized(inputs)
    q, k, v, bias, mask, seed, _ = inputs
    cfg = _fit_shared_memory(fitted(config, problem), problem,
                             None if bias is None else bias.dtype)
    mask_args, list_outer = kernel_inputs.mask_inputs(
        mask, block_m=cfg.block_m, block_n=cfg.block_n, seq_q=problem.seq_q,
        seq_k=problem.seq_k, causal=problem.causal, over_kv=over_kv,
        positions=inputs.features.positions)
    arrays = ([q, k, v, rows.d_out, rows.lse] + _lse_lo_inputs(problem, rows) + [rows.delta]
              + ([bias] if bias is not None else []) + mask_args
              + kernel_inputs.seed_inputs(problem.dropout_rate, seed)
              + kernel_inputs.feature_inputs(inputs.given_features, block_m=cfg.block_m,
                                             block_n=cfg.block_n, over_kv=over_kv))
    st = static.KernelStatic(problem=problem, cfg=cfg, list_outer=list_outer,
                             interpret=interpret, split_ds=split_ds, own_delta=own_delta)
    return arrays, st


class TileOperands(NamedTuple):
    """The chunk readers of a [bm, bn] tile's four operands (`Tile.q_chunks`,
    `Tile.kv_chunks`, or their resident forms): S = Q·Kᵀ and dP = dO·Vᵀ."""

    q: Any
    k: Any
    do: Any
    v: Any


class Tile:
    """Loads and recomputation for one (query block, KV block) tile of one head.

    `q_rows`/`kv_rows` are fixed per program for the operand a kernel keeps
    (Q and dO for dq; K and V for dkdv): `resident_*` lists hold their chunks
    when the reductions are unrolled, so they are loaded once per program.
    """

    def __init__(self, st: static.KernelStatic, refs: dict, b, hk):
        self.st, self.refs, self.b, self.hk = st, refs, b, hk
        self.cfg = st.cfg

    def chunk(self, name: str, start_row, rows: int, c, head, n_rows: int, n_cols: int):
        cfg = self.cfg
        return tiles.load_tile(self.refs[name], self.b, start_row, rows, head,
                               tiles.chunk_start(c, cfg.block_d), cfg.block_d,
                               n_rows=n_rows, n_cols=n_cols)

    def q_chunks(self, name: str, q_start, h):
        st = self.st
        problem = st.problem
        dim = problem.head_dim if name == "q" else problem.head_dim_v
        return lambda c: self.chunk(name, q_start, self.cfg.block_m, c, h, problem.seq_q, dim)

    def kv_chunks(self, name: str, kv_start):
        st = self.st
        problem = st.problem
        dim = problem.head_dim if name == "k" else problem.head_dim_v
        block_n = self.cfg.block_n
        return lambda c: self.chunk(name, kv_start, block_n, c, self.hk, problem.seq_k, dim)

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
            q_chunk = self.resident(q_chunk, n_chunks(st, st.problem.head_dim))
            do_chunk = self.resident(do_chunk, n_chunks(st, st.problem.head_dim_v))
        return q_chunk, do_chunk

    def features(self, q_start):
        """The window, segments and lengths of the query block at `q_start`, and where
        positions place it (None without any of them)."""
        if not self.st.tile_features:
            return None
        return static.TileFeatures(self.st, self.refs, self.b, q_start, self.cfg.block_m)

    def probs_and_dp(self, h, q_start, kv_start, row_lse, **tile_args):
        """(P, dropped P, dP) of the [bm, bn] tile, float32: P = e^(S - lse); the dropped
        P (the forward's mask regenerated, kept values rescaled) is what dV sees; dP is
        dropped the same way, as dP reaches dS only through kept elements (None when
        not needed)."""
        return self._probs(h, q_start, kv_start, row_lse, **tile_args)[:3]

    def _probs(self, h, q_start, kv_start, row_lse, *, operands: "TileOperands",
               causal_mask: bool, with_mask: bool, need_dp: bool = True, features=None):
        """`probs_and_dp`'s three, and the soft cap's derivative (None without a cap)."""
        q_chunk, k_chunk, do_chunk, v_chunk = operands
        st, cfg = self.st, self.cfg
        problem = st.problem
        bm, bn = cfg.block_m, cfg.block_n
        rows = q_start + iota(bm)
        cols = kv_start + iota(bn)
        qk_scale = problem.scale * st.score_unit
        per_chunk = numerics.rounds_per_chunk(self.refs["q"].dtype)
        # As in the forward: unscaled scores, and one fused s·scale - lse per element.
        fold = numerics.folds_scale(st, per_chunk=per_chunk)
        s = numerics.contract_chunks(q_chunk, k_chunk, n_chunks(st, problem.head_dim),
                                     dynamic=cfg.dynamic, shape=(bm, bn),
                                     scale=None if fold else qk_scale,
                                     round_per_chunk=per_chunk, compensated=problem.natural)
        s, cap_grad = static.bias_and_masks(
            s, st, self.refs.get("bias"), self.refs.get("mask"),
            static.TileAt(self.b, h, q_start, kv_start, rows, cols), causal_mask=causal_mask,
            with_mask=with_mask, mask_rows=True, features=features, with_cap_grad=True)
        hi, lo = row_lse
        if fold:
            p = st.exp2(numerics.fma(s, qk_scale, -hi[:, None]))
        else:
            diff = s - hi[:, None]  # exact near the row's max
            if lo is not None:
                diff = diff - lo[:, None]
            p = st.exp2(st.exp2_arg(diff))
        if st.own_delta:
            # The tile holds the whole row: normalise P by its own sum, as XLA's softmax
            # does (a row's single key gets P = 1 exactly; no keys: P = 0, no 0/0).
            total = jnp.sum(p, axis=1)
            sink = static.sink_share(st, self.refs, h, hi, lo)
            if sink is not None:  # the sink's share of the denominator, which has no key
                total = total + sink
            p = p / jnp.where(total > 0.0, total, 1.0)[:, None]
        keep = None
        if problem.dropout_rate > 0:
            keep = static.dropout_keep(st, self.refs["seed"], self.b, h, rows, kv_start, bn,
                                       None if features is None else features.place)
            inv_keep = 1.0 / (1.0 - problem.dropout_rate)
        p_out = p if keep is None else jnp.where(keep, p * inv_keep, 0.0)
        if not need_dp:
            return p, p_out, None, cap_grad
        dp = numerics.contract_chunks(do_chunk, v_chunk, n_chunks(st, problem.head_dim_v),
                                      dynamic=cfg.dynamic, shape=(bm, bn),
                                      compensated=problem.natural)
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
        problem = st.problem
        rows_ok = (q_start + iota(bm)) < problem.seq_q
        view = lambda name: self.refs[name].at[self.b, h, tiles.ds(q_start, bm)]
        lse = plgpu.load(view("lse"), mask=rows_ok, other=0.0)
        delta = plgpu.load(view("delta"), mask=rows_ok, other=0.0)
        lse = jnp.where(lse == -jnp.inf, 0.0, lse if problem.natural else lse * LOG2E)
        lo = plgpu.load(view("lse_lo"), mask=rows_ok, other=0.0) if problem.lse_pair else None
        return (lse, lo), delta


def rows_in_one_tile(seq_k: int, *configs: BwdConfig) -> bool:
    """Whether each of these kernels holds every key of a row in one tile (S at most its
    fitted BLOCK_N). Then a 16-bit backward takes δ = Σ_j P·dP − dlse from the tile's own
    normalised P and dP (`own_delta`), as XLA's softmax gradient does, instead of
    rowsum(dO ∘ O) from `bwd_preproc`: exact zeros where a row sees one key, for the
    price of a row sum per tile, and no preproc pass."""
    return all(seq_k <= fit_block(c.block_n, seq_k) for c in configs)


def ref_dict(names, refs):
    return dict(zip(names, refs))


def input_names(st: static.KernelStatic, *, with_lists: bool) -> list[str]:
    problem = st.problem
    names = ["q", "k", "v", "do", "lse"] + ["lse_lo"] * problem.lse_pair + ["delta"]
    if problem.bias_shape is not None:
        names.append("bias")
    if problem.mask_shape is not None:
        names.append("mask")
        if with_lists:
            names += ["counts", "indices"]
    if problem.dropout_rate > 0:
        names.append("seed")
    return names + kernel_inputs.feature_names(st)

