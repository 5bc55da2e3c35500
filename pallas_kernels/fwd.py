"""`fwd_generic`: the blocked online-softmax forward, for every head dim up to 1024.

Grid: (query blocks × V slices, B·Hq). Each program owns BLOCK_M query rows of
one head and one BLOCK_HEADDIM_V-wide slice of the output head dim, and walks the
KV blocks of its KV head (GQA by index: kv head = h // (Hq // Hkv)).

Split-D: QKᵀ is accumulated over BLOCK_HEADDIM_QK-wide chunks of D, and the
output head dim is split across programs, so neither the float32 accumulator
([BLOCK_M, BLOCK_HEADDIM_V]) nor the K/V tiles grow with D. Three ways to walk
the QKᵀ chunks (`q_mode`), which the Triton compiler treats very differently:
- "resident": static unroll; Q's chunks are loaded once, before the KV loop.
- "reload":   static unroll; Q's chunks are re-read (from L1/L2) every KV block,
              so only one chunk of Q is live at a time.
- "dynamic":  a `fori_loop` over the chunks (one Q and one K chunk live), which
              Triton software-pipelines like the K loop of a matmul.
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

from pallas_kernels import compat, kernel_inputs, numerics, static, tiles
from pallas_kernels.numerics import dot
from pallas_kernels.problem import Inputs, Problem
from pallas_kernels.tiles import cdiv, fit_block, i32, iota
from pallas_kernels.descriptor import (KernelDescriptor, Move, Table, add_stages, scaled, set_to,
                                       tile_width, toggle_warps)

Q_MODES = ("resident", "reload", "dynamic")


@dataclasses.dataclass(frozen=True)
class FwdConfig:
    """Launch parameters of `fwd_generic` (FFPA's config keys, plus `q_mode`)."""

    block_m: int = 64
    block_n: int = 64
    block_d: int = 64  # BLOCK_HEADDIM_QK: chunk of D per QKᵀ partial product
    block_dv: int = 64  # BLOCK_HEADDIM_V: output head-dim slice per program
    num_warps: int = 4
    num_stages: int = 2
    q_mode: str = "resident"
    # Issue the V tile's load before the QKᵀ loop, so its latency overlaps the
    # QKᵀ dots (the V load sits outside Triton's pipelined inner loop).
    prefetch_v: bool = False

    @classmethod
    def from_tuned(cls, cfg: dict) -> "FwdConfig":
        """A tuned-config `config` dict (FFPA's keys) as a FwdConfig."""
        return cls(block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"],
                   block_d=cfg["BLOCK_HEADDIM_QK"], block_dv=cfg["BLOCK_HEADDIM_V"],
                   num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                   q_mode=cfg.get("Q_MODE", "resident"))

    def fitted(self, seq_q: int, seq_k: int, head_dim: int, head_dim_v: int) -> "FwdConfig":
        """The same config with tiles shrunk to the problem (powers of two, >= 16)."""
        return dataclasses.replace(
            self,
            block_m=fit_block(self.block_m, seq_q),
            block_n=fit_block(self.block_n, seq_k),
            block_d=fit_block(self.block_d, head_dim),
            block_dv=fit_block(self.block_dv, head_dim_v),
        )


def _n_dchunks(st: static.KernelStatic) -> int:
    return cdiv(st.problem.head_dim, st.cfg.block_d)


def _n_vslices(st: static.KernelStatic) -> int:
    return cdiv(st.problem.head_dim_v, st.cfg.block_dv)


def _fwd_kernel(*refs, st: static.KernelStatic, per_chunk: bool):
    problem = st.problem
    cfg = st.cfg
    bm, bn, bd, bdv = cfg.block_m, cfg.block_n, cfg.block_d, cfg.block_dv
    q_ref, k_ref, v_ref, *rest = refs
    bias_ref = rest.pop(0) if problem.bias_shape is not None else None
    mask_ref = count_ref = index_ref = None
    if problem.mask_shape is not None:
        mask_ref, count_ref, index_ref = rest[:3]
        rest = rest[3:]
    seed_ref = rest.pop(0) if problem.dropout_rate > 0 else None
    feature_refs = kernel_inputs.pop_feature_refs(st, rest)
    o_ref, lse_ref, *lo_ref = rest

    pid = pl.program_id(0)
    bh = pl.program_id(1)
    if _n_vslices(st) == 1:
        q_block, v_slice = pid, i32(0)
    else:
        q_block, v_slice = pid // _n_vslices(st), pid % _n_vslices(st)
    b = bh // problem.heads_q
    h = bh % problem.heads_q
    hk = h // problem.group
    q_start = q_block * bm
    v_start = v_slice * bdv
    rows = q_start + iota(bm)
    features = (static.TileFeatures(st, feature_refs, b, q_start, bm) if st.tile_features
                else None)
    qk_scale = problem.scale * st.score_unit
    raw_scale = qk_scale if numerics.folds_scale(st, per_chunk=per_chunk) else None

    resident_q = None
    if cfg.q_mode == "resident":
        resident_q = [tiles.load_tile(q_ref, b, q_start, bm, h, c * bd, bd,
                                      n_rows=problem.seq_q, n_cols=problem.head_dim)
                      for c in range(_n_dchunks(st))]

    def scores(kv_start):
        """scale·q·kᵀ in score units for one KV block, [bm, bn] float32 (q·kᵀ unscaled
        when the softmax step folds the scale in: `raw_scale`)."""
        def q_chunk_at(c):
            if resident_q is not None:
                return resident_q[c]
            return tiles.load_tile(q_ref, b, q_start, bm, h, tiles.chunk_start(c, bd), bd,
                                   n_rows=problem.seq_q, n_cols=problem.head_dim)

        def k_chunk_at(c):
            return tiles.load_tile(k_ref, b, kv_start, bn, hk, tiles.chunk_start(c, bd), bd,
                                   n_rows=problem.seq_k, n_cols=problem.head_dim)

        return numerics.contract_chunks(q_chunk_at, k_chunk_at, _n_dchunks(st),
                                        dynamic=cfg.q_mode == "dynamic", shape=(bm, bn),
                                        scale=qk_scale if raw_scale is None else None,
                                        round_per_chunk=per_chunk,
                                        compensated=problem.natural)

    def visit(kv_block, carry, *, causal_mask: bool, with_mask: bool):
        m_i, l_i, acc = carry
        kv_start = kv_block * bn
        cols = kv_start + iota(bn)

        def v_tile_load():
            return tiles.load_tile(v_ref, b, kv_start, bn, hk, v_start, bdv,
                                   n_rows=problem.seq_k, n_cols=problem.head_dim_v)

        v_tile = v_tile_load() if cfg.prefetch_v else None
        s = static.bias_and_masks(scores(kv_start), st, bias_ref, mask_ref,
                                  static.TileAt(b, h, q_start, kv_start, rows, cols),
                                  causal_mask=causal_mask, with_mask=with_mask,
                                  features=features)

        m_new, p, alpha, l_i = numerics.online_softmax_step(s, m_i, l_i, st, raw_scale=raw_scale)
        if seed_ref is not None:
            # Dropped after the statistics: lse stays the undropped normaliser.
            keep = static.dropout_keep(st, seed_ref, b, h, rows, kv_start, bn,
                                       None if features is None else features.place)
            p = jnp.where(keep, p, 0.0)
        if v_tile is None:
            v_tile = v_tile_load()
        p = p if v_tile.dtype == jnp.float32 else p.astype(v_tile.dtype)
        acc = acc * alpha[:, None] + dot(p, v_tile)
        return m_new, l_i, acc

    carry = (jnp.full((bm,), -jnp.inf, jnp.float32), jnp.zeros((bm,), jnp.float32),
             jnp.zeros((bm, bdv), jnp.float32))

    # Block-sparse over the mask's lists, or the blocks the window, segments, lengths and
    # causality leave.
    lists = (count_ref, index_ref) if problem.mask_shape is not None else None
    carry = static.walk_kv_blocks(st, lists, b, h, q_block, q_start, visit, carry, features)

    m_i, l_i, acc = carry
    if problem.sinks:
        m_i, l_i, acc = numerics.join_sink(m_i, l_i, acc, feature_refs["sinks"][i32(h)], st)
    has_keys = l_i > 0.0
    l_safe = jnp.where(has_keys, l_i, 1.0)
    # Kept values are scaled by 1/(1-rate); lse below stays the undropped normaliser.
    kept = 1.0 - problem.dropout_rate
    out = acc / (l_safe if problem.dropout_rate == 0 else l_safe * kept)[:, None]
    tiles.store_tile(o_ref, out, b, q_start, bm, h, v_start, bdv,
                     n_rows=problem.seq_q, n_cols=problem.head_dim_v)
    lse, lo = numerics.row_lse(m_i, l_safe, has_keys, st)
    lse_mask = rows < problem.seq_q
    if _n_vslices(st) > 1:
        lse_mask = lse_mask & (v_slice == 0)  # one writer per row
    plgpu.store(lse_ref.at[b, h, tiles.ds(q_start, bm)], lse, mask=lse_mask)
    if lo_ref:
        plgpu.store(lo_ref[0].at[b, h, tiles.ds(q_start, bm)], lo, mask=lse_mask)


def _fit_shared_memory(cfg: FwdConfig, problem: Problem, inputs: Inputs) -> FwdConfig:
    """`cfg` with fewer pipeline stages where bias/mask/dropout tiles would overflow
    shared memory (`kernel_inputs.fit_stages`): Q's chunks stay resident (or are reloaded
    per step), each KV step buffers K's chunks, the V slice and the extra tiles. The dynamic
    chunk loop is left alone: its stages pipeline the D chunks, not the KV steps."""
    if cfg.q_mode == "dynamic":
        return cfg
    qb, vb = jnp.dtype(inputs.q.dtype).itemsize, jnp.dtype(inputs.v.dtype).itemsize
    head_dim = problem.head_dim
    q_bytes = cfg.block_m * cdiv(head_dim, cfg.block_d) * cfg.block_d * qb
    k_bytes = cfg.block_n * cdiv(head_dim, cfg.block_d) * cfg.block_d * qb
    resident = q_bytes if cfg.q_mode == "resident" else 0
    # (the V tile is block_dv wide, padded past Dv)
    per_stage = k_bytes + cfg.block_n * cfg.block_dv * vb + (q_bytes - resident)
    bias = inputs.bias
    extra = kernel_inputs.extra_tile_bytes(problem.bias_shape, problem.mask_shape,
                                           None if bias is None else bias.dtype,
                                           block_m=cfg.block_m, block_n=cfg.block_n,
                                           dropout=problem.has_dropout)
    if problem.segment_ids:
        extra += cfg.block_n * 4  # each KV step's int32 segment ids
    stages = kernel_inputs.fit_stages(cfg.num_stages, resident=resident, per_stage=per_stage,
                                      extra=extra)
    return cfg if stages == cfg.num_stages else dataclasses.replace(cfg, num_stages=stages)


def fwd_generic(problem: Problem, config: FwdConfig, inputs: Inputs, *, interpret: bool = False,
                out_dtype=None) -> tuple[jax.Array, ...]:
    """Attention forward on Pallas/Triton: (o [B,T,Hq,Dv] in `out_dtype` (default q's dtype),
    lse [B,Hq,T] f32), and lse's low word where `problem.lse_pair` (float32).

    `problem` says what to compute (`Problem.sized` fits it to the arrays of `inputs`, which
    may be one device's shard); `config` how. With dropout, `inputs.seed` (uint32[2], a
    runtime input) picks the keep-mask (see `dropout`). `problem.return_lse` rounds q·kᵀ per
    head-dim chunk (`numerics.contract_chunks`): lse within XLA's error at large D, for
    callers that return it, at a cost in speed (float32 always does:
    `numerics.rounds_per_chunk`). In float32 the pair's hi is lse, the float32 sum
    m + fl(log l), and lo its rounding error (hi + lo = m + fl(log l) exactly), the form
    the backward kernels take. With sinks, lse counts them.
    """
    problem = problem.sized(inputs)
    q, k, v, bias, mask, seed, _ = inputs
    if config.q_mode not in Q_MODES:
        raise ValueError(f"q_mode must be one of {Q_MODES}; got {config.q_mode!r}")
    cfg = config.fitted(problem.seq_q, problem.seq_k, problem.head_dim, problem.head_dim_v)
    cfg, per_chunk = numerics.capped_for_rounding(cfg, q.dtype, problem.return_lse)
    cfg = _fit_shared_memory(cfg, problem, inputs)
    compat.silence_triton_deprecation()
    mask_args, list_outer = kernel_inputs.mask_inputs(
        mask, block_m=cfg.block_m, block_n=cfg.block_n, seq_q=problem.seq_q,
        seq_k=problem.seq_k, causal=problem.causal, over_kv=True,
        positions=inputs.features.positions)
    arrays = ([q, k, v] + ([bias] if bias is not None else []) + mask_args
              + kernel_inputs.seed_inputs(problem.dropout_rate, seed)
              + kernel_inputs.feature_inputs(inputs.given_features, block_m=cfg.block_m,
                                             block_n=cfg.block_n))
    st = static.KernelStatic(problem=problem, cfg=cfg, list_outer=list_outer,
                             interpret=interpret)
    grid = (cdiv(problem.seq_q, cfg.block_m) * _n_vslices(st), problem.batch * problem.heads_q)
    rows_out = compat.output_struct((problem.batch, problem.heads_q, problem.seq_q),
                                    jnp.float32, q)
    out_shape = (compat.output_struct((problem.batch, problem.seq_q, problem.heads_q,
                                       problem.head_dim_v), out_dtype or q.dtype, q),
                 rows_out) + ((rows_out,) if problem.lse_pair else ())
    return pl.pallas_call(
        functools.partial(_fwd_kernel, st=st, per_chunk=per_chunk),
        out_shape=out_shape,
        grid=grid,
        compiler_params=compat.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name=fwd_generic.__name__,
    )(*arrays)


# ------------------------------------------------------------------ descriptor
# Built-in launch configs (used whenever no tuned entry matches), per head dim, chosen by
# the launch-variant sweeps on the H200 (docs/fwd_variants.md; the figures are in
# docs/history.md, "Numbers behind choices in the code").

_DEFAULTS: Table = (
    (64, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=64,
              num_warps=8, num_stages=3)),
    (128, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_HEADDIM_QK=128, BLOCK_HEADDIM_V=128,
               num_warps=8, num_stages=3)),
    (256, dict(BLOCK_M=128, BLOCK_N=64, BLOCK_HEADDIM_QK=256, BLOCK_HEADDIM_V=256,
               num_warps=8, num_stages=2)),
    # Above 256 a static unroll over D chunks overflows shared memory (Triton's
    # pipeliner buffers every chunk); the dynamic chunk loop keeps one live.
    (512, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=256,
               num_warps=8, num_stages=4, Q_MODE="dynamic")),
    (1024, dict(BLOCK_M=128, BLOCK_N=128, BLOCK_HEADDIM_QK=64, BLOCK_HEADDIM_V=256,
                num_warps=8, num_stages=4, Q_MODE="dynamic")),
)
# float32 tiles take twice the shared memory of 16-bit ones: float32 calls of the GPU fuzz
# overflowed it at D <= 128 and D <= 256, so those tiles shrink (float32 is the accuracy
# path, not the speed one).
_FP32_OVERRIDES: Table = ((128, dict(BLOCK_N=64)), (256, dict(BLOCK_M=64, BLOCK_N=32)))
# With dropout each tile also generates its keep-mask, which changes the best tiles (the
# dropout launch sweep). Dropout is for training, so the forward that counts is the vjp's,
# which writes a float32 output; at D = 512 that one is fastest with the plain default.
_DROPOUT_OVERRIDES: Table = ((128, dict(BLOCK_N=64, num_stages=3)),)


def _moves(headdim: int) -> list[Move]:
    """The fast search: the knobs the variant sweeps (docs/fwd_variants.md) showed to matter
    most at this head dim first."""
    if headdim <= 128:
        return [scaled("BLOCK_N", 2), scaled("BLOCK_N", 0.5), scaled("BLOCK_M", 0.5),
                toggle_warps, add_stages(1), add_stages(-1), scaled("BLOCK_M", 2),
                scaled("BLOCK_HEADDIM_QK", 0.5)]
    if headdim <= 256:
        return [scaled("BLOCK_N", 2), set_to("Q_MODE", "dynamic"), scaled("BLOCK_HEADDIM_QK", 0.25),
                scaled("BLOCK_N", 0.5), add_stages(1), scaled("BLOCK_M", 0.5), toggle_warps,
                set_to("Q_MODE", "reload")]
    return [scaled("BLOCK_HEADDIM_V", 0.5), scaled("BLOCK_N", 0.5), add_stages(-1),
            scaled("BLOCK_HEADDIM_QK", 2), scaled("BLOCK_M", 0.5), scaled("BLOCK_HEADDIM_V", 2),
            toggle_warps, add_stages(-2)]


def _grid(headdim: int) -> Iterable[dict]:
    d = tile_width(headdim)
    if headdim <= 128:
        for bm, bn, w, st in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
            yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_HEADDIM_QK=d, BLOCK_HEADDIM_V=d,
                       num_warps=w, num_stages=st)
    elif headdim <= 256:
        for bm, bn, st, (bd, mode) in itertools.product(
                (64, 128), (32, 64, 128), (2, 3), ((d, "resident"), (64, "dynamic"))):
            yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_HEADDIM_QK=bd, BLOCK_HEADDIM_V=d,
                       num_warps=8, num_stages=st, Q_MODE=mode)
    else:
        for bm, bn, bd, bdv, st in itertools.product((64, 128), (64, 128, 32), (64, 128),
                                                     (256, 128), (3, 2, 4)):
            yield dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_HEADDIM_QK=bd, BLOCK_HEADDIM_V=bdv,
                       num_warps=8, num_stages=st, Q_MODE="dynamic")


FWD_GENERIC = KernelDescriptor(
    name=fwd_generic.__name__, direction="forward", config=FwdConfig, role="attention",
    function=fwd_generic,
    block_keys=("BLOCK_M", "BLOCK_N", "BLOCK_HEADDIM_QK", "BLOCK_HEADDIM_V"),
    # Q_MODE: how the QKᵀ chunks are walked (our extension of FFPA's keys; absent means
    # "resident").
    optional_keys=("Q_MODE",),
    defaults=_DEFAULTS, fp32_overrides=_FP32_OVERRIDES, dropout_overrides=_DROPOUT_OVERRIDES,
    moves=_moves, grid=_grid)
