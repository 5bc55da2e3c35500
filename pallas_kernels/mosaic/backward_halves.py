"""The Mosaic tier's backward for head dims 129..256 (D = Dv after padding to 64): the two
consumer warpgroups split the head dim, not the keys.

At D = 256 the rows backward's plan (each warpgroup keeps dK and dV of its 64 keys in
registers) needs 256 float32 registers per thread for the two accumulators alone. Here one
CTA owns 64 keys of one KV head, and each consumer keeps dK and dV of all 64 keys for its
half of the columns (64 + 64 registers). The scores are not split: per query block (64 rows)
of every query head of the GQA group, streamed by the producer as in the rows backward,

    warpgroup 0 ("scores"):    Sᵀ = K Qᵀ, Pᵀ = exp2(scale·log2e·Sᵀ − lse·log2e) → shared memory,
    warpgroup 1 ("gradients"): dPᵀ = V dOᵀ, Pᵀ from shared memory, dSᵀ = Pᵀ ∘ (dPᵀ − δ)
                               → shared memory,

then each, for its columns c: dV[:, c] += Pᵀ dO[:, c], dK[:, c] += dSᵀ Q[:, c], and
dQ[:, c] = dS K[:, c], added to the float32 dQ buffer with a TMA reduce-add. Each
warpgroup takes the operand it computed from its registers (Pᵀ for warpgroup 0, dSᵀ for
warpgroup 1) and the other's from shared memory, so both run 2.5 of the step's five
matmuls. Pᵀ passes twice: in 16 bits as dV's operand, and in float32 for dSᵀ
(16 bits raised dq's error by up to 1.4x: docs/benchmarks.md), as
Pᵀ ∘ d(capped)/d(raw) under the soft cap. With segment ids only the 16-bit one fits. Masks
(causality, windows, lengths, segment ids) are applied to Sᵀ by warpgroup 0 only: a hidden
key's P is 0, and so is its dS.

Shared memory holds K, V, two stages of (Q, dO) and the 64 × 64 exchange tiles (225 KiB
at D = 256). dQ's staging tiles would not fit beside them, so each warpgroup stages its
float32 half of dQ in the stage it has finished with (warpgroup 0 in Q's, warpgroup 1 in
dO's: a stage of Q or dO is 64·D 16-bit values, one half of dQ 64·D/2 float32 values; a
`plgpu.RefUnion`): both warpgroups first meet on a barrier that says neither reads the
stage's Q or dO any more, and the stage goes back to the producer once both reduce-adds
have read it (checked one step later, so that the add overlaps the next step's first
matmul). dK and the float32 dQ are scaled by the softmax scale at the end.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat
from pallas_kernels.mosaic.backward_stream import Stream, launch, produce
from pallas_kernels.mosaic.common import (COLUMNS, LOG2E, ROW, WGMMA, Walk, iota,
                                          opaque_zero, same_segment, score_mod, soft_cap,
                                          soft_cap_grad, tiled_smem, walk_kv)
from pallas_kernels.mosaic.config import Config

BLOCK_K = 64  # keys per CTA
MAX_HEAD_DIM = 256


def _swizzle(columns: int, dtype) -> int:
    """The largest swizzle of which a row of `columns` values is a whole number of tiles
    (every tile here is sliced into column halves: K, Q and dO as wgmma operands)."""
    row_bytes = columns * jnp.dtype(dtype).itemsize
    return next(s for s in (128, 64, 32) if row_bytes % s == 0)


def halves_backward(q, k, v, do, rows: tuple, prob: Walk, *, config: Config, kv_lengths=None,
                    segment_ids=None, positions=None):
    """(dq float32 [B, Tp, Hq, D], dk [B, S8, Hkv, D], dv [B, S8, Hkv, D]) of padded arrays,
    as `backward.rows_backward` takes them, for 128 < D = Dv <= 256 (multiples of 64). dSᵀ
    comes from a float32 Pᵀ, or with segment ids from its 16-bit copy."""
    _, _, Hq, D = q.shape
    Dv = v.shape[3]
    if D != Dv or D % 64 or not 128 < D <= MAX_HEAD_DIM:
        raise ValueError(f"halves_backward takes D = Dv in (128, {MAX_HEAD_DIM}], multiples "
                         f"of 64; got D={D}, Dv={Dv}")
    if config.block_q != 64:  # shared memory holds two stages of 64 rows at D = 256
        raise ValueError(f"halves_backward takes 64 query rows per step; got {config.block_q}")
    dtype = q.dtype
    bq, bk = config.block_q, BLOCK_K
    ns = config.num_stages
    if ns < 2:  # a stage goes back to the producer one step after its own
        raise ValueError(f"halves_backward needs num_stages >= 2; got {ns}")
    half = D // 2  # each consumer's columns
    swizzle = _swizzle(half, dtype)  # one swizzle: a wgmma's two shared operands share it
    scale, softcap = prob.scale, prob.softcap
    c_exp = scale * LOG2E
    stream = Stream.of(q, v, config, block_k=bk, prob=prob, segment_ids=segment_ids)
    exact_p = not stream.segments  # no room for both the ids and a float32 Pᵀ

    def kernel(cta, refs, scoped):
        dq_ref, dk_ref, dv_ref = refs[-3:]
        k_smem, v_smem, stages, p_smem, pd_smem, ds_smem = scoped[:6]
        rows_scoped, (p_ready, ds_ready, stage_read, done) = scoped[6:14], scoped[14:]
        lse_smem, delta_smem, qid_smem, kid_smem, kv_bar, q_full, do_full, free = rows_scoped
        (q_smem, do_smem), dq_stages = stages
        wg, b, hk, k0, walk = cta.wg, cta.b, cta.hk, cta.k0, cta.walk
        lo, mask_lo, full_hi, hi = cta.blocks
        count = cta.count

        def release_previous(n):
            # The last step's reduce-add has read its staging tile: its stage may refill.
            @pl.when(n > 0)
            def _():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                plgpu.barrier_arrive(free.at[lax.rem(n - 1, ns)])

        def keys_by_rows(keys, stages, landed, n, slot):
            """keys · stages[slot]ᵀ (float32, keys × rows) once the stage has landed; then
            the last step's stage goes back to the producer (its reduce-add has had the
            product's time to read it)."""
            plgpu.barrier_wait(landed.at[slot])

            def product(acc_ref):
                plgpu.wgmma(acc_ref, keys, stages.at[slot].transpose((1, 0)))

            acc = pl.run_state(product)(plgpu.ACC.init(
                plgpu.layout_cast(jnp.zeros((bk, bq), jnp.float32), WGMMA)))
            release_previous(n)
            return acc

        def consumer(role_step):
            """Walks every step of the CTA with `role_step(n, slot, j, h, cols, masked,
            carry, kv) -> (dk, dv)`, where `kv` holds this step's views of K and V, then
            writes this warpgroup's columns of dK and dV."""
            plgpu.set_max_registers(config.consumer_regs, action="increase")
            cols = pl.ds(wg * half, half)
            dk = plgpu.layout_cast(jnp.zeros((bk, half), jnp.float32), WGMMA)
            dv = plgpu.layout_cast(jnp.zeros((bk, half), jnp.float32), WGMMA)
            plgpu.barrier_wait(kv_bar)

            def head(g, carry):
                h = hk * stream.group + g

                def step(j, carry, *, masked):
                    n = g * count + (j - lo)
                    # K's and V's descriptors made at each step, not held (`opaque_zero`)
                    now = opaque_zero(j)
                    kv = (k_smem.at[now], v_smem.at[now])
                    return role_step(n, lax.rem(n, ns), j, h, cols, masked, carry, kv)

                return walk_kv(step, carry, lo, mask_lo, full_hi, hi)

            dk, dv = lax.fori_loop(0, stream.group, head, (dk, dv))
            # A column half of a tile is not contiguous, which a TMA copy needs: both halves
            # meet in the first stage of Q (dK) and of dO (dV), once both warpgroups are out
            # of the walk and their last reduce-adds have read the stages.
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            plgpu.barrier_arrive(done)
            plgpu.barrier_wait(done)
            q_smem.at[0, :, cols][...] = (dk * scale).astype(dtype)
            do_smem.at[0, :, cols][...] = dv.astype(dtype)
            plgpu.commit_smem()
            plgpu.barrier_arrive(done)
            plgpu.barrier_wait(done)
            keys = pl.ds(k0, bk)

            @pl.when(wg == 0)
            def _():
                plgpu.copy_smem_to_gmem(q_smem.at[0], dk_ref.at[b, keys, hk])

            @pl.when(wg == 1)
            def _():
                plgpu.copy_smem_to_gmem(do_smem.at[0], dv_ref.at[b, keys, hk])

            plgpu.wait_smem_to_gmem(0)

        def finish_step(n, slot, j, h, cols, dq_from, k_now):
            """Both warpgroups are done with the stage's Q and dO: this one's dQ columns
            (dS K[:, cols]) go through the stage's staging view to the float32 buffer."""
            plgpu.barrier_arrive(stage_read)

            def dq_cols(acc_ref):
                plgpu.wgmma(acc_ref, ds_smem.transpose((1, 0)), k_now.at[:, cols])

            dq = pl.run_state(dq_cols)(plgpu.ACC.init(
                plgpu.layout_cast(jnp.zeros((bq, half), jnp.float32), WGMMA)))
            plgpu.barrier_wait(stage_read)
            tile = dq_stages[dq_from].at[slot]
            tile[...] = dq
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(tile, dq_ref.at[b, pl.ds(j * bq, bq), h, cols],
                                    reduction_op="add")

        def scores_step(n, slot, j, h, cols, masked, carry, kv):
            dk, dv = carry
            q0 = j * bq
            s = keys_by_rows(kv[0], q_smem, q_full, n, slot)  # Sᵀ = K Qᵀ
            s = soft_cap(walk, s)
            d_cap = soft_cap_grad(walk, s)
            if masked:
                same = None
                if stream.segments:
                    key_ids = compat.mosaic_load(kid_smem, layout=ROW)
                    row_ids = compat.mosaic_load(qid_smem.at[slot], layout=COLUMNS)
                    same = same_segment(key_ids, row_ids, (bk, bq))
                q_idx = q0 + iota((bk, bq), 1)
                k_idx = k0 + iota((bk, bq), 0)
                s = score_mod(walk, s, q_idx, k_idx, same)
            lse = compat.mosaic_load(lse_smem.at[slot], layout=COLUMNS)
            p = jnp.exp2(s * c_exp - lax.broadcast_in_dim(lse, s.shape, [1]))
            p16 = p.astype(dtype)
            p_smem[...] = p16
            if exact_p or softcap is not None:
                pd_smem[...] = (p if d_cap is None else p * d_cap).astype(pd_smem.dtype)
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready)

            def grads(refs):
                dv_ref, dk_ref = refs
                plgpu.barrier_wait(do_full.at[slot])
                plgpu.wgmma(dv_ref, p16, do_smem.at[slot, :, cols])
                plgpu.barrier_wait(ds_ready)
                plgpu.wgmma(dk_ref, ds_smem, q_smem.at[slot, :, cols])

            dv, dk = pl.run_state(grads)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
            finish_step(n, slot, j, h, cols, 0, kv[0])
            return dk, dv

        def gradients_step(n, slot, j, h, cols, masked, carry, kv):
            del masked  # the scores' warpgroup masks: hidden keys come with P = 0
            dk, dv = carry
            dp = keys_by_rows(kv[1], do_smem, do_full, n, slot)  # dPᵀ = V dOᵀ
            dlt = compat.mosaic_load(delta_smem.at[slot], layout=COLUMNS)
            plgpu.barrier_wait(p_ready)
            p = compat.mosaic_load(pd_smem if exact_p or softcap is not None else p_smem,
                                   layout=WGMMA).astype(jnp.float32)
            ds16 = (p * (dp - lax.broadcast_in_dim(dlt, dp.shape, [1]))).astype(dtype)
            ds_smem[...] = ds16
            plgpu.commit_smem()
            plgpu.barrier_arrive(ds_ready)

            def grads(refs):
                dv_ref, dk_ref = refs
                plgpu.wgmma(dv_ref, p_smem, do_smem.at[slot, :, cols])
                plgpu.barrier_wait(q_full.at[slot])
                plgpu.wgmma(dk_ref, ds16, q_smem.at[slot, :, cols])

            dv, dk = pl.run_state(grads)((plgpu.ACC.init(dv), plgpu.ACC.init(dk)))
            finish_step(n, slot, j, h, cols, 1, kv[0])
            return dk, dv

        @pl.when(wg == 0)
        def _scores():
            consumer(scores_step)

        @pl.when(wg == 1)
        def _gradients():
            consumer(gradients_step)

        @pl.when(wg == 2)
        def _producer():
            produce(stream, cta, refs, (k_smem.at[0], v_smem.at[0], q_smem, do_smem),
                    rows_scoped, config.producer_regs)

    # A stage of Q (or dO) and a float32 half of dQ are the same number of bytes, so stage i
    # of either view starts at the same offset.
    stages = plgpu.RefUnion(
        (tiled_smem((ns, bq, D), dtype, swizzle), tiled_smem((ns, bq, Dv), dtype, swizzle)),
        (tiled_smem((ns, bq, half), jnp.float32), tiled_smem((ns, bq, half), jnp.float32)))
    exchange = tiled_smem((bk, bq), dtype, swizzle)
    scratch = (
        tiled_smem((1, bk, D), dtype, swizzle),  # K, read through `opaque_zero`
        tiled_smem((1, bk, Dv), dtype, swizzle),  # V
        stages,
        exchange,  # Pᵀ
        # Pᵀ for dSᵀ (∘ d(capped)/d(raw)), in float32 with `exact_p`
        (tiled_smem((bk, bq), jnp.float32) if exact_p else
         exchange if softcap is not None else None),
        exchange,  # dSᵀ
        *stream.row_scratch(),
        plgpu.Barrier(num_arrivals=1),  # Pᵀ written
        plgpu.Barrier(num_arrivals=1),  # dSᵀ written
        plgpu.Barrier(num_arrivals=2),  # neither reads the stage's Q or dO any more
        plgpu.Barrier(num_arrivals=2),  # both out of the walk; both halves of dK, dV stored
    )
    dq, dk, dv = launch(kernel, scratch, (q, k, v, do, *rows), stream, prob=prob,
                        config=config, kv_lengths=kv_lengths, segment_ids=segment_ids,
                        positions=positions)
    return dq * scale, dk, dv
