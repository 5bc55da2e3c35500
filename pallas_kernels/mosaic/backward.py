"""The Mosaic tier's backward (D, Dv <= 128 after padding to 64; `backward_halves` takes
D = Dv up to 256): one pass over the query blocks per key block, dQ added to a float32
buffer by TMA reduce-add.

One CTA owns 128 keys of one KV head (two consumer warpgroups of 64 keys each) and walks
the query blocks (64 rows) of every query head of its GQA group that see them, streamed by
a producer warpgroup through a ring of shared-memory stages (Q, dO, and the rows' lse and
δ). Per block each consumer recomputes its probabilities from lse, as Pᵀ (keys × rows):

    Sᵀ = K Qᵀ,  Pᵀ = exp2(scale·log2e·Sᵀ − lse·log2e),  dPᵀ = V dOᵀ,
    dV += Pᵀ dO,  dSᵀ = Pᵀ ∘ (dPᵀ − δ),  dK += dSᵀ Q,

keeping dK and dV in registers over the whole walk. Both warpgroups publish dSᵀ in shared
memory (two buffers by step parity, so one warpgroup may run a step ahead), and each then
computes half of dQ's columns over all 128 keys, dQ[:, half] = dS K[:, half], which it adds
to the float32 dQ buffer with a TMA reduce-add (from two staging tiles, so that a step need
not wait for the last one's add to read its tile): the order of those adds varies from run
to run (`Tier.ordered_backward` is False for this tier). dK and the float32 dQ are scaled
by the softmax scale at the end.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat
from pallas_kernels.mosaic.backward_halves import MAX_HEAD_DIM, halves_backward
from pallas_kernels.mosaic.backward_stream import Stream, launch, produce
from pallas_kernels.mosaic.common import (COLUMNS, LOG2E, ROW, WGMMA, Walk, iota,
                                          opaque_zero, same_segment, score_mod, soft_cap,
                                          soft_cap_grad, tiled_smem, walk_kv)
from pallas_kernels.mosaic.config import Config, default_backward_config, round_up
from pallas_kernels.mosaic.forward import pad_axes

KEYS_PER_WG = 64
ROWS_MAX_HEAD_DIM = 128  # this module's kernel; larger head dims: `halves_backward`


def rows_backward(q, k, v, do, rows: tuple, prob: Walk, *, config: Config, kv_lengths=None,
                  segment_ids=None, positions=None):
    """(dq float32 [B, Tp, Hq, D], dk [B, S8, Hkv, D], dv [B, S8, Hkv, Dv]) of padded arrays:
    q/do [B, T8, Hq, D|Dv], k/v [B, S8, Hkv, D|Dv] (D, Dv in {64, 128}); `rows` = (lse2, δ):
    lse2 = lse·log2(e) with +inf on rows that see no key (their P is 0), δ = rowsum(dO ∘ O)
    − dlse, both float32 [B, Hq, Tp] (Tp: T rounded up to 64, padded with +inf and 0);
    `prob` the true lengths and the semantics (its block_kv unused: the walk is over query
    blocks, `visibility.q_walk`); `kv_lengths` int32 [B] or None: each batch row's key length;
    `segment_ids` None or (q ids [B, T], kv ids [B, S]) (`prob.segments` says which);
    `positions` None or int32 [3], the arrays' place in a longer sequence
    (`Walk.with_positions`)."""
    _, _, Hq, D = q.shape
    Dv = v.shape[3]
    dtype = q.dtype
    bq, wk = config.block_q, KEYS_PER_WG
    if bq > 64 and max(D, Dv) > 64:  # Sᵀ and dPᵀ of 64 x 128 beside dK and dV of 64 x 128
        raise ValueError(f"128 query rows per step need D, Dv <= 64; got D={D}, Dv={Dv}")
    bk = 2 * wk  # keys per CTA
    ns = config.num_stages
    half = D // 2  # dQ columns per warpgroup
    # K's column halves must be whole swizzle tiles (they are dQ's B operand), and a wgmma's
    # two shared-memory operands share a swizzle: K's is Q's (Sᵀ = K Qᵀ) and dSᵀ's (dQ).
    swizzle = min(128, half * jnp.dtype(dtype).itemsize)
    scale = prob.scale
    c_exp = scale * LOG2E
    stream = Stream.of(q, v, config, block_k=bk, prob=prob, segment_ids=segment_ids)
    has_segments = stream.segments
    dq_tiles = 1 if has_segments else 2  # dQ's staging tiles per warpgroup

    def kernel(cta, refs, scoped):
        dq_ref, dk_ref, dv_ref = refs[-3:]
        k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem = scoped[:6]
        rows_scoped, (ds_ready, done) = scoped[6:14], scoped[14:]
        lse_smem, delta_smem, qid_smem, kid_smem, kv_bar, q_full, do_full, free = rows_scoped
        wg, b, hk, k0, walk = cta.wg, cta.b, cta.hk, cta.k0, cta.walk
        lo, mask_lo, full_hi, hi = cta.blocks
        count = cta.count
        group = stream.group

        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(config.consumer_regs, action="increase")
            my_keys = pl.ds(wg * wk, wk)
            my_cols = pl.ds(wg * half, half)
            dk = plgpu.layout_cast(jnp.zeros((wk, D), jnp.float32), WGMMA)
            dv = plgpu.layout_cast(jnp.zeros((wk, Dv), jnp.float32), WGMMA)
            plgpu.barrier_wait(kv_bar)
            key_ids = (compat.mosaic_load(kid_smem.at[my_keys], layout=ROW) if has_segments
                       else None)

            def head(g, carry):
                h = hk * group + g

                def step(j, carry, *, masked):
                    dk, dv = carry
                    n = g * count + (j - lo)
                    slot = lax.rem(n, ns)
                    parity = lax.rem(n, 2)
                    q0 = j * bq
                    # K's and V's descriptors made at each step, not held (`opaque_zero`)
                    kv_now = opaque_zero(j)
                    k_now, v_now = k_smem.at[kv_now], v_smem.at[kv_now]

                    def scores(refs):
                        s_ref, dp_ref = refs
                        plgpu.barrier_wait(q_full.at[slot])
                        plgpu.wgmma(s_ref, k_now.at[my_keys],
                                    q_smem.at[slot].transpose((1, 0)))
                        plgpu.barrier_wait(do_full.at[slot])
                        plgpu.wgmma(dp_ref, v_now.at[my_keys],
                                    do_smem.at[slot].transpose((1, 0)))

                    zeros = plgpu.layout_cast(jnp.zeros((wk, bq), jnp.float32), WGMMA)
                    s, dp = pl.run_state(scores)((plgpu.ACC.init(zeros),
                                                  plgpu.ACC.init(zeros)))
                    same = None
                    if masked and has_segments:  # the rows' ids landed with Q
                        row_ids = compat.mosaic_load(qid_smem.at[slot], layout=COLUMNS)
                        same = same_segment(key_ids, row_ids, (wk, bq))
                    s = soft_cap(walk, s)
                    d_cap = soft_cap_grad(walk, s)
                    if masked:
                        q_idx = q0 + iota((wk, bq), 1)
                        k_idx = k0 + wg * wk + iota((wk, bq), 0)
                        s = score_mod(walk, s, q_idx, k_idx, same)
                    lse = compat.mosaic_load(lse_smem.at[slot], layout=COLUMNS)
                    p = jnp.exp2(s * c_exp - lax.broadcast_in_dim(lse, s.shape, [1]))
                    dlt = compat.mosaic_load(delta_smem.at[slot], layout=COLUMNS)
                    ds = p * (dp - lax.broadcast_in_dim(dlt, dp.shape, [1]))
                    if d_cap is not None:
                        ds = ds * d_cap
                    p16, ds16 = p.astype(dtype), ds.astype(dtype)

                    def grads(refs):
                        dv_ref, dk_ref = refs
                        plgpu.wgmma(dv_ref, p16, do_smem.at[slot])
                        plgpu.wgmma(dk_ref, ds16, q_smem.at[slot])

                    dv, dk = pl.run_state(grads)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
                    plgpu.barrier_arrive(free.at[slot])

                    # dS to shared memory for both warpgroups' dQ columns.
                    ds_smem.at[parity, my_keys][...] = ds16
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(ds_ready.at[parity])
                    plgpu.barrier_wait(ds_ready.at[parity])

                    def dq_cols(acc_ref):
                        plgpu.wgmma(acc_ref, ds_smem.at[parity].transpose((1, 0)),
                                    k_now.at[:, my_cols])

                    dq = pl.run_state(dq_cols)(plgpu.ACC.init(
                        plgpu.layout_cast(jnp.zeros((bq, half), jnp.float32), WGMMA)))
                    # Two staging tiles by step parity: the reduce-add of two steps ago
                    # (the one before the last) must have read this one. (One tile with
                    # segment ids, whose ids take the shared memory of the other: the last
                    # step's add must have read it.)
                    tile = dq_smem.at[wg, parity if dq_tiles == 2 else 0]
                    plgpu.wait_smem_to_gmem(dq_tiles - 1, wait_read_only=True)
                    tile[...] = dq
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(tile,
                                            dq_ref.at[b, pl.ds(q0, bq), h, my_cols],
                                            reduction_op="add")
                    return dk, dv

                return walk_kv(step, carry, lo, mask_lo, full_hi, hi)

            dk, dv = lax.fori_loop(0, group, head, (dk, dv))
            # K and V take the results once both warpgroups have read them for the last time.
            plgpu.barrier_arrive(done)
            plgpu.barrier_wait(done)
            k_smem.at[0, my_keys][...] = (dk * scale).astype(dtype)
            v_smem.at[0, my_keys][...] = dv.astype(dtype)
            plgpu.commit_smem()
            rows = pl.ds(k0 + wg * wk, wk)
            plgpu.copy_smem_to_gmem(k_smem.at[0, my_keys], dk_ref.at[b, rows, hk])
            plgpu.copy_smem_to_gmem(v_smem.at[0, my_keys], dv_ref.at[b, rows, hk])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _producer():
            produce(stream, cta, refs, (k_smem.at[0], v_smem.at[0], q_smem, do_smem),
                    rows_scoped, config.producer_regs)

    scratch = (
        tiled_smem((1, bk, D), dtype, swizzle),  # K, read through `opaque_zero`
        tiled_smem((1, bk, Dv), dtype),
        tiled_smem((ns, bq, D), dtype, swizzle),
        tiled_smem((ns, bq, Dv), dtype),
        tiled_smem((2, bk, bq), dtype, swizzle),
        tiled_smem((2, dq_tiles, bq, half), jnp.float32),
        *stream.row_scratch(),
        plgpu.Barrier(num_arrivals=2, num_barriers=2),  # both halves of dSᵀ written
        plgpu.Barrier(num_arrivals=2),  # both consumers out of the walk
    )
    dq, dk, dv = launch(kernel, scratch, (q, k, v, do, *rows), stream, prob=prob,
                        config=config, kv_lengths=kv_lengths, segment_ids=segment_ids,
                        positions=positions)
    return dq * scale, dk, dv


def mosaic_attention_backward(inputs, saved, cotangents, *, scale: float, causal: bool,
                              config: Config | None = None,
                              window: tuple[int, int] | None = None,
                              softcap: float | None = None):
    """(dq, dk, dv) of `mosaic_attention_forward`'s saved = (out, lse) for the cotangents
    (d_out [B, T, Hq, Dv], d_lse [B, Hq, T] or None: lse not differentiated), in q's dtype.
    `inputs`: `pallas_kernels.problem.Inputs` (q, k, v and, in its features, the sequence
    lengths and segment ids; no bias, mask or dropout). D and Dv up to 128, or D = Dv up to
    256 (after padding to 64: `unsupported_head_dims`); out may be float32 (the
    differentiated forward's). `jax.vmap` has no rule for it (its dQ buffer is a mutable
    array, which `pl.kernel` does not batch): fold a mapped axis into the batch, as
    `ffpa_jax.attention` does."""
    q, k, v = inputs.q, inputs.k, inputs.v
    q_lengths, kv_lengths = inputs.features.q_lengths, inputs.features.kv_lengths
    q_ids = inputs.features.q_segment_ids
    (out, lse), (d_out, d_lse) = saved[:2], cotangents
    B, T, Hq, D = q.shape
    S, Dv = k.shape[1], v.shape[3]
    reason = unsupported_head_dims(D, Dv)
    if reason:
        raise ValueError(f"the Mosaic backward does not take {reason}; got D={D}, Dv={Dv}")
    config = config or default_backward_config(D, Dv, segments=q_ids is not None)
    scale = float(scale)
    if scale < 0.0:  # as the forward: q negated, exact in 16 bits
        dq, dk, dv = mosaic_attention_backward(
            inputs._replace(q=-q), saved, cotangents, scale=-scale, causal=causal,
            config=config, window=window, softcap=softcap)
        return -dq, dk, dv
    delta = jnp.einsum("bthd,bthd->bht", out.astype(jnp.float32), d_out.astype(jnp.float32))
    empty = lse == -jnp.inf
    if d_lse is not None:
        delta = delta - jnp.where(empty, 0.0, d_lse.astype(jnp.float32))
    if q_lengths is not None:  # rows past a query length: no probabilities, no gradient
        empty = empty | (jnp.arange(T)[None, None, :]
                         >= q_lengths.astype(jnp.int32)[:, None, None])
    lse2 = jnp.where(empty, jnp.inf, lse * LOG2E)
    Tp = round_up(T, config.block_q)
    lse2 = jnp.pad(lse2, ((0, 0), (0, 0), (0, Tp - T)), constant_values=jnp.inf)
    delta = jnp.pad(delta, ((0, 0), (0, 0), (0, Tp - T)))
    Dp, Dvp, T8, S8 = round_up(D, 64), round_up(Dv, 64), round_up(T, 8), round_up(S, 8)
    walk = Walk(T=T, S=S, causal=causal, block_kv=2 * KEYS_PER_WG,
                window=None if window is None else tuple(int(x) for x in window),
                softcap=None if softcap is None else float(softcap), scale=scale,
                segments=q_ids is not None)
    kernel = halves_backward if uses_halves_kernel(D, Dv) else rows_backward
    dq, dk, dv = kernel(
        pad_axes(q, {1: T8, 3: Dp}), pad_axes(k, {1: S8, 3: Dp}), pad_axes(v, {1: S8, 3: Dvp}),
        pad_axes(d_out.astype(q.dtype), {1: T8, 3: Dvp}), (lse2, delta), walk, config=config,
        kv_lengths=None if kv_lengths is None else kv_lengths.astype(jnp.int32),
        segment_ids=None if q_ids is None else (q_ids, inputs.features.kv_segment_ids),
        positions=inputs.features.kernel_positions())
    dq = dq[:, :T, :, :D].astype(q.dtype)
    return tuple(compat.vary_like(x, q) for x in (dq, dk[:, :S, :, :D], dv[:, :S, :, :Dv]))


def uses_halves_kernel(head_dim: int, head_dim_v: int) -> bool:
    """Whether these head dims run `halves_backward` (above 128 once padded to 64), not
    `rows_backward`."""
    return max(round_up(head_dim, 64), round_up(head_dim_v, 64)) > ROWS_MAX_HEAD_DIM


def unsupported_head_dims(head_dim: int, head_dim_v: int) -> str:
    """What of these head dims the Mosaic backward does not take ("" if it takes them): up
    to 128 each (`rows_backward`), or equal up to 256 after padding to 64
    (`halves_backward`, whose dQ staging reuses a stage of Q and one of dO alike)."""
    if not uses_halves_kernel(head_dim, head_dim_v):
        return ""
    d, dv = round_up(head_dim, 64), round_up(head_dim_v, 64)
    if max(d, dv) > MAX_HEAD_DIM:
        return f"head dims above {MAX_HEAD_DIM}"
    if d != dv:
        return f"head dims above {ROWS_MAX_HEAD_DIM} with D != Dv"
    return ""
