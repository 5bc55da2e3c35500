"""The backward kernels: `bwd_preproc` (or `bwd_exact_rows`), `bwd_generic_dq`,
`bwd_generic_dkdv`, `bwd_dbias` (the tile's recomputation they share is `bwd_tile.Tile`).

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

Each takes the call's `Problem` (fitted to the arrays it is given: `Problem.sized`), its
`BwdConfig`, the call's `Inputs` and the per-row `BackwardRows`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import compat, kernel_inputs, numerics, static, tiles, visibility
from pallas_kernels.bwd_tile import (BackwardRows, BwdConfig, Tile, TileOperands, fitted,
                                     input_names, n_chunks, n_slices, prepare, ref_dict)
from pallas_kernels.numerics import LN2, dot
from pallas_kernels.problem import Inputs, Problem
from pallas_kernels.tiles import cdiv, fit_block, i32, iota


def _lists(r: dict):
    """The mask's block lists (counts, indices) among a kernel's refs, or None."""
    return (r["counts"], r["indices"]) if "counts" in r else None


# ----------------------------------------------------------------------------- preproc
# ----------------------------------------------------------------------------- preproc
def _preproc_kernel(o_ref, do_ref, dlse_ref, delta_ref, *, seq_q, heads_q, head_dim_v, bm, bd):
    pid, bh = pl.program_id(0), pl.program_id(1)
    b, h = bh // heads_q, bh % heads_q
    q_start = pid * bm
    acc = jnp.zeros((bm,), jnp.float32)
    for c in range(cdiv(head_dim_v, bd)):
        o = tiles.load_tile(o_ref, b, q_start, bm, h, c * bd, bd, n_rows=seq_q, n_cols=head_dim_v)
        do = tiles.load_tile(do_ref, b, q_start, bm, h, c * bd, bd, n_rows=seq_q,
                             n_cols=head_dim_v)
        acc += jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=1)
    rows_ok = (q_start + iota(bm)) < seq_q
    view = lambda ref: ref.at[b, h, tiles.ds(q_start, bm)]
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
        interpret=interpret, name=bwd_preproc.__name__)(o, do, dlse)


# ----------------------------------------------------------------------------- exact rows
def _exact_rows_kernel(*refs, st: static.KernelStatic):
    problem = st.problem
    names = input_names(st, with_lists=True)  # the "delta" input holds dlse here
    r = ref_dict(names, refs[:len(names)])
    delta_ref, lo_ref = refs[len(names):]
    cfg = st.cfg
    bm, bn = cfg.block_m, cfg.block_n
    q_block, bh = pl.program_id(0), pl.program_id(1)
    b, h = bh // problem.heads_q, bh % problem.heads_q
    q_start = q_block * bm
    tile = Tile(st, r, b, h // problem.group)
    row_lse, dlse = tile.row_stats(h, q_start)
    q_chunk, do_chunk = tile.query_operands(h, q_start)
    features = tile.features(q_start)

    def visit(kv_block, sums, *, causal_mask, with_mask):
        p_dp_sum, p_sum = sums
        kv_start = kv_block * bn
        p, _, dp = tile.probs_and_dp(h, q_start, kv_start, row_lse, operands=TileOperands(
                                         q_chunk, tile.kv_chunks("k", kv_start), do_chunk,
                                         tile.kv_chunks("v", kv_start)),
                                     causal_mask=causal_mask, with_mask=with_mask,
                                     features=features)
        return p_dp_sum + jnp.sum(p * dp, axis=1), p_sum + jnp.sum(p, axis=1)

    zero = jnp.zeros((bm,), jnp.float32)
    p_dp_sum, p_sum = static.walk_kv_blocks(st, _lists(r), b, h, q_block, q_start, visit,
                                            (zero, zero), features)
    sink = static.sink_share(st, r, h, *row_lse)
    if sink is not None:  # the sink's share completes the row's sum to 1
        p_sum = p_sum + sink
    p_sum = jnp.where(p_sum > 0.0, p_sum, 1.0)  # a row without keys: P = 0 anyway
    lo = row_lse[1] if row_lse[1] is not None else zero
    rows_ok = (q_start + iota(bm)) < problem.seq_q
    plgpu.store(delta_ref.at[b, h, tiles.ds(q_start, bm)], p_dp_sum / p_sum - dlse,
                mask=rows_ok)
    plgpu.store(lo_ref.at[b, h, tiles.ds(q_start, bm)], lo + jnp.log2(p_sum) * LN2,
                mask=rows_ok)


def bwd_exact_rows(problem: Problem, config: BwdConfig, inputs: Inputs, rows: BackwardRows, *,
                   interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(δ, lse_lo), float32 [B, Hq, T] each, from the backward's own P and dP (float32);
    `rows.delta` holds dlse here, `rows.lse_lo` the forward's low word of lse.

    The returned lse_lo (the given one plus a correction) makes the backward's
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
    if not problem.natural:
        raise ValueError(f"bwd_exact_rows is for float32 inputs; got {problem.dtype}")
    arrays, st = prepare(problem, config, inputs, rows, over_kv=True, interpret=interpret)
    p = st.problem
    out = compat.output_struct((p.batch, p.heads_q, p.seq_q), jnp.float32, inputs.q)
    compat.silence_triton_deprecation()
    return pl.pallas_call(
        functools.partial(_exact_rows_kernel, st=st), out_shape=(out, out),
        grid=(cdiv(p.seq_q, st.cfg.block_m), p.batch * p.heads_q),
        compiler_params=compat.compiler_params(st.cfg.num_warps, st.cfg.num_stages),
        interpret=interpret, name=bwd_exact_rows.__name__)(*arrays)


# ----------------------------------------------------------------------------- dq
def _dq_kernel(*refs, st: static.KernelStatic):
    problem = st.problem
    names = input_names(st, with_lists=True)
    r = ref_dict(names, refs[:len(names)])
    dq_ref = refs[len(names)]
    cfg = st.cfg
    bm, bn, width = cfg.block_m, cfg.block_n, cfg.block_slice
    slices = n_slices(st, problem.head_dim)
    pid, bh = pl.program_id(0), pl.program_id(1)
    q_block, sl = (pid, i32(0)) if slices == 1 else (pid // slices, pid % slices)
    b, h = bh // problem.heads_q, bh % problem.heads_q
    hk = h // problem.group
    q_start = q_block * bm
    tile = Tile(st, r, b, hk)
    row_lse, delta = tile.row_stats(h, q_start)
    q_chunk, do_chunk = tile.query_operands(h, q_start)
    features = tile.features(q_start)

    def visit(kv_block, acc, *, causal_mask, with_mask):
        kv_start = kv_block * bn
        _, ds = tile.probs_and_ds(h, q_start, kv_start, row_lse, delta, operands=TileOperands(
                                      q_chunk, tile.kv_chunks("k", kv_start), do_chunk,
                                      tile.kv_chunks("v", kv_start)),
                                  causal_mask=causal_mask, with_mask=with_mask,
                                  features=features)
        k_slice = tiles.load_tile(r["k"], b, kv_start, bn, hk, sl * width, width,
                                  n_rows=problem.seq_k, n_cols=problem.head_dim)
        return numerics.accumulate_ds(acc, ds, k_slice, split=st.split_ds)

    acc = static.walk_kv_blocks(st, _lists(r), b, h, q_block, q_start, visit,
                                jnp.zeros((bm, width), jnp.float32), features)
    tiles.store_tile(dq_ref, acc * problem.scale, b, q_start, bm, h, sl * width, width,
                     n_rows=problem.seq_q, n_cols=problem.head_dim)


def bwd_generic_dq(problem: Problem, config: BwdConfig, inputs: Inputs, rows: BackwardRows, *,
                   interpret: bool = False, split_ds: bool = False,
                   own_delta: bool = False) -> jax.Array:
    """dQ [B, T, Hq, D] in q's dtype. `split_ds`: dS in two 16-bit words
    (`numerics.accumulate_ds`), for a delta that carries an lse cotangent. `own_delta`:
    `rows.delta` is -dlse, and δ comes from each tile (see `rows_in_one_tile`)."""
    arrays, st = prepare(problem, config, inputs, rows, over_kv=True, interpret=interpret,
                         split_ds=split_ds, own_delta=own_delta)
    p, cfg, q = st.problem, st.cfg, inputs.q
    compat.silence_triton_deprecation()
    grid = (cdiv(p.seq_q, cfg.block_m) * n_slices(st, p.head_dim), p.batch * p.heads_q)
    return pl.pallas_call(
        functools.partial(_dq_kernel, st=st), out_shape=compat.output_struct(q.shape, q.dtype, q),
        grid=grid, compiler_params=compat.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret, name=bwd_generic_dq.__name__)(*arrays)


# ----------------------------------------------------------------------------- dk, dv
def _dkdv_kernel(*refs, st: static.KernelStatic, tasks: tuple[tuple[str, int], ...]):
    """`tasks` lists, per program along grid axis 0 (after the KV block), which
    accumulator(s) it computes: ("dkdv" | "dk" | "dv", slice index)."""
    names = input_names(st, with_lists=True)
    r = ref_dict(names, refs[:len(names)])
    dk_ref, dv_ref = refs[len(names):]
    bn = st.cfg.block_n
    pid, bhk = pl.program_id(0), pl.program_id(1)
    kv_block, task = pid // len(tasks), pid % len(tasks)
    b, hk = bhk // st.problem.heads_kv, bhk % st.problem.heads_kv
    kv_start = kv_block * bn

    if len(tasks) == 1:
        (kind, sl), = tasks
        _dkdv_program(st, r, (dk_ref, dv_ref), b, hk, kv_block, kv_start,
                      with_dk=kind in ("dkdv", "dk"), with_dv=kind in ("dkdv", "dv"), sl=sl)
        return
    # Each task is its own branch; a program runs exactly one.
    for task_id, (kind, sl) in enumerate(tasks):
        @pl.when(task == task_id)
        def _run(kind=kind, sl=sl):
            _dkdv_program(st, r, (dk_ref, dv_ref), b, hk, kv_block, kv_start,
                          with_dk=kind in ("dkdv", "dk"), with_dv=kind in ("dkdv", "dv"), sl=sl)


def _dkdv_program(st, r, out_refs, b, hk, kv_block, kv_start, *, with_dk, with_dv, sl):
    """dK and/or dV (`with_dk`, `with_dv`) of slice `sl` of one key block of KV head `hk`
    into `out_refs` (dk_ref, dv_ref)."""
    dk_ref, dv_ref = out_refs
    problem = st.problem
    cfg = st.cfg
    bm, bn, width = cfg.block_m, cfg.block_n, cfg.block_slice
    tile = Tile(st, r, b, hk)
    k_chunk, v_chunk = tile.kv_chunks("k", kv_start), tile.kv_chunks("v", kv_start)
    if not cfg.dynamic:
        k_chunk = tile.resident(k_chunk, n_chunks(st, problem.head_dim))
        if with_dk:
            v_chunk = tile.resident(v_chunk, n_chunks(st, problem.head_dim_v))

    def visit(q_block, accs, h, *, causal_mask, with_mask):
        dk_acc, dv_acc = accs
        q_start = q_block * bm
        row_lse, delta = tile.row_stats(h, q_start)
        p, ds = tile.probs_and_ds(h, q_start, kv_start, row_lse, delta,
                                  operands=TileOperands(tile.q_chunks("q", q_start, h), k_chunk,
                                                        tile.q_chunks("do", q_start, h), v_chunk),
                                  causal_mask=causal_mask, with_mask=with_mask, need_ds=with_dk,
                                  features=tile.features(q_start))
        if with_dv:
            do_slice = tiles.load_tile(r["do"], b, q_start, bm, h, sl * width, width,
                                       n_rows=problem.seq_q, n_cols=problem.head_dim_v)
            dv_acc = dv_acc + dot(p.astype(do_slice.dtype), do_slice, trans_a=True)
        if with_dk:
            q_slice = tiles.load_tile(r["q"], b, q_start, bm, h, sl * width, width,
                                      n_rows=problem.seq_q, n_cols=problem.head_dim)
            dk_acc = numerics.accumulate_ds(dk_acc, ds, q_slice, trans_a=True,
                                            split=st.split_ds)
        return dk_acc, dv_acc

    def over_q_blocks(h, accs):
        partial = lambda **kw: (lambda i, a: visit(i, a, h, **kw))
        if problem.mask_shape is not None:
            lb = i32(tiles.broadcast_index(b, r["counts"].shape[0]))
            lh = i32(tiles.broadcast_index(h, r["counts"].shape[1]))
            lk = kv_block if st.list_outer != 1 else i32(0)
            listed = lambda i, a: visit(r["indices"][lb, lh, lk, i], a, h,
                                        causal_mask=problem.causal, with_mask=True)
            return jax.lax.fori_loop(i32(0), r["counts"][lb, lh, lk], listed, accs)
        n_q = i32(cdiv(problem.seq_q, bm))
        shift = static.kernel_shift(st, r)  # S - T, or the positions' runtime shift
        if st.ranged:
            # The query blocks the window, segments and lengths let see this key block;
            # every visit takes their element masks (and causality's).
            first = (visibility.causal_q_blocks(kv_start, bm, bn, problem.seq_q, problem.seq_k,
                                                shift)[0]
                     if problem.causal else i32(0))
            lo, hi = static.q_block_range(st, r, b, kv_block, kv_start, bm, bn, first, n_q)
            return jax.lax.fori_loop(lo, hi, partial(causal_mask=problem.causal, with_mask=False),
                                     accs)
        if problem.causal:
            first, first_unmasked = visibility.causal_q_blocks(kv_start, bm, bn, problem.seq_q,
                                                               problem.seq_k, shift)
            accs = jax.lax.fori_loop(first, first_unmasked,
                                     partial(causal_mask=True, with_mask=False), accs)
            return jax.lax.fori_loop(first_unmasked, n_q,
                                     partial(causal_mask=False, with_mask=False), accs)
        return jax.lax.fori_loop(i32(0), n_q, partial(causal_mask=False, with_mask=False), accs)

    zeros = jnp.zeros((bn, width), jnp.float32)
    accs = (zeros if with_dk else None, zeros if with_dv else None)
    h0 = hk * problem.group
    if problem.group == 1:
        accs = over_q_blocks(h0, accs)
    else:
        accs = jax.lax.fori_loop(i32(0), i32(problem.group),
                                 lambda g, a: over_q_blocks(h0 + g, a), accs)
    dk_acc, dv_acc = accs
    if with_dk:
        tiles.store_tile(dk_ref, dk_acc * problem.scale, b, kv_start, bn, hk, sl * width, width,
                         n_rows=problem.seq_k, n_cols=problem.head_dim)
    if with_dv:
        tiles.store_tile(dv_ref, dv_acc, b, kv_start, bn, hk, sl * width, width,
                         n_rows=problem.seq_k, n_cols=problem.head_dim_v)


def dkdv_tasks(head_dim: int, head_dim_v: int, width: int, split: bool):
    """Per-KV-block programs: which accumulators each computes, over which slice."""
    n_k, n_v = cdiv(head_dim, width), cdiv(head_dim_v, width)
    if split:
        return tuple(("dk", s) for s in range(n_k)) + tuple(("dv", s) for s in range(n_v))
    return tuple(("dkdv" if s < min(n_k, n_v) else ("dk" if s < n_k else "dv"), s)
                 for s in range(max(n_k, n_v)))


def bwd_generic_dkdv(problem: Problem, config: BwdConfig, inputs: Inputs, rows: BackwardRows, *,
                     interpret: bool = False, split_ds: bool = False, own_delta: bool = False):
    """(dK [B, S, Hkv, D], dV [B, S, Hkv, Dv]) in k's / v's dtype. `split_ds` and
    `own_delta` as in `bwd_generic_dq`."""
    arrays, st = prepare(problem, config, inputs, rows, over_kv=False, interpret=interpret,
                         split_ds=split_ds, own_delta=own_delta)
    p, cfg, (q, k, v) = st.problem, st.cfg, inputs[:3]
    tasks = dkdv_tasks(p.head_dim, p.head_dim_v, cfg.block_slice, cfg.split_dkdv)
    compat.silence_triton_deprecation()
    grid = (cdiv(p.seq_k, cfg.block_n) * len(tasks), p.batch * p.heads_kv)
    return pl.pallas_call(
        functools.partial(_dkdv_kernel, st=st, tasks=tasks),
        out_shape=(compat.output_struct(k.shape, k.dtype, q),
                   compat.output_struct(v.shape, v.dtype, q)),
        grid=grid, compiler_params=compat.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret, name=bwd_generic_dkdv.__name__)(*arrays)


# ----------------------------------------------------------------------------- dbias
def _dbias_kernel(*refs, st: static.KernelStatic):
    problem = st.problem
    names = input_names(st, with_lists=False)
    r = ref_dict(names, refs[:len(names)])
    dbias_ref = refs[len(names)]
    cfg = st.cfg
    bm, bn = cfg.block_m, cfg.block_n
    bb, bh_, bt, bs = problem.bias_shape
    n_tk = cdiv(problem.seq_k, bn) if bs != 1 else 1
    pid, owner = pl.program_id(0), pl.program_id(1)
    tq, tk = (pid // n_tk, pid % n_tk) if n_tk > 1 else (pid, i32(0))
    tb, th = owner // bh_, owner % bh_

    # The program owns bias tile (tb, th, tq, tk) and sums dS over every dim the
    # bias broadcasts: batch, heads, query blocks, KV blocks, flattened into one loop.
    loop_b = problem.batch if bb == 1 else 1
    loop_h = problem.heads_q if bh_ == 1 else 1
    loop_q = cdiv(problem.seq_q, bm) if bt == 1 else 1
    loop_k = cdiv(problem.seq_k, bn) if bs == 1 else 1

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
        tile = Tile(st, r, b, h // problem.group)
        row_lse, delta = tile.row_stats(h, q_start)
        _, ds = tile.probs_and_ds(h, q_start, kv_start, row_lse, delta,
                                  operands=TileOperands(tile.q_chunks("q", q_start, h),
                                                        tile.kv_chunks("k", kv_start),
                                                        tile.q_chunks("do", q_start, h),
                                                        tile.kv_chunks("v", kv_start)),
                                  causal_mask=problem.causal,
                                  with_mask=problem.mask_shape is not None,
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
        mask = rows < problem.seq_q
    if cols is not None:
        mask = cols < problem.seq_k if mask is None else mask & (cols < problem.seq_k)
    r_ds = tiles.ds(tq * bm, bm) if bt != 1 else tiles.ds(0, 1)
    c_ds = tiles.ds(tk * bn, bn) if bs != 1 else tiles.ds(0, 1)
    plgpu.store(dbias_ref.at[tb, th, r_ds, c_ds], acc, mask=mask)


def bwd_dbias(problem: Problem, config: BwdConfig, inputs: Inputs, rows: BackwardRows, *,
              interpret: bool = False, own_delta: bool = False) -> jax.Array:
    """dbias with the bias's own 4-D shape (each dim 1 or full), float32. `own_delta` as in
    `bwd_generic_dq` (every tile is visited; the window, segments and lengths mask within
    it)."""
    problem = problem.sized(inputs)
    q, k, v, bias, mask, seed, _ = inputs
    cfg = dataclasses.replace(fitted(config, problem), split_dkdv=False)
    st = static.KernelStatic(problem=problem, cfg=cfg, interpret=interpret, own_delta=own_delta)
    lse_lo = [rows.lse_lo] if problem.lse_pair else []
    arrays = ([q, k, v, rows.d_out, rows.lse] + lse_lo + [rows.delta, bias]
              + ([mask] if mask is not None else [])
              + kernel_inputs.seed_inputs(problem.dropout_rate, seed)
              + kernel_inputs.feature_inputs(inputs.given_features, block_m=cfg.block_m,
                                             block_n=cfg.block_n))
    bb, bh, bt, bs = bias.shape
    n_tq = cdiv(problem.seq_q, cfg.block_m) if bt != 1 else 1
    n_tk = cdiv(problem.seq_k, cfg.block_n) if bs != 1 else 1
    compat.silence_triton_deprecation()
    return pl.pallas_call(
        functools.partial(_dbias_kernel, st=st),
        out_shape=compat.output_struct(bias.shape, jnp.float32, q),
        grid=(n_tq * n_tk, bb * bh),
        compiler_params=compat.compiler_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret, name=bwd_dbias.__name__)(*arrays)
