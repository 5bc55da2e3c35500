"""The chunked tier's backward step on Hopper (experimental, not yet dispatched): a block's
logits S = Q·Kᵀ on the tensor cores, the head dim streamed through a ring of TMA stages, with
the softmax gradient as the epilogue, so that S never goes through memory:

    P = exp2(scale·log2e·S − lse·log2e),  dS = P ∘ (dP − δ)

for a block of R query rows × K keys of the chunked backward (`pallas_kernels.chunked`),
whose dP comes from a library GEMM. One CTA takes 128 rows (two consumer warpgroups of 64, or one)
× 128 keys of one query head; a producer warpgroup streams Q's and K's 64-column chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat
from pallas_kernels.mosaic.common import (LOG2E, ROW, WARPGROUPS, WGMMA, Walk, iota, score_mod,
                                          soft_cap, soft_cap_grad, tiled_smem)

ROWS_PER_WG = 64
BLOCK_KEYS = 128
CHUNK = 64
ROW_TILES, KEY_TILES, HEADS = "ffpa_step_r", "ffpa_step_k", "ffpa_step_bh"


def unsupported(n_rows: int, n_keys: int, head_dim: int, consumers: int = 2) -> str:
    """Why a block of these sizes cannot run here ("" if it can)."""
    if n_rows % (consumers * ROWS_PER_WG) or n_keys % BLOCK_KEYS:
        return (f"blocks of whole {consumers * ROWS_PER_WG}-row and {BLOCK_KEYS}-key tiles "
                f"(got {n_rows} x {n_keys})")
    if head_dim % CHUNK:
        return f"head dims that are multiples of {CHUNK} (got {head_dim})"
    return ""


def logits_grad_step(q5, k4, dp, lse2, delta, offsets, walk: Walk, *, stages: int = 3,
                     consumers: int = 2, registers: tuple[int, int] = (232, 40)):
    """(P, dS) [B, Hq, R, K] in dP's dtype of the block at global (row, key) `offsets`
    (int32[2]) of a problem with `walk`'s T, S, causality, window, soft cap and scale:
    q5 [B, Hkv, G, T, D] and k4 [B, Hkv, S, D] whole (16-bit, D a multiple of 64), dp
    [B, Hq, R, K] the block's dP, lse2 [B, Hq, R] float32 = lse·log2(e) with +inf on rows
    that see no key, delta [B, Hq, R] = rowsum(dO·O) − dlse. dS is the gradient of the
    logits before the soft cap, as `blocked.softmax_grad`'s. `consumers`: warpgroups of 64
    rows per CTA (1 leaves room for two CTAs on a multiprocessor, one's epilogue beside the
    other's products; `registers` then about (168, 40))."""
    B, _, G, _, D = q5.shape
    _, Hq, R, K = dp.shape
    reason = unsupported(R, K, D, consumers)
    if reason:
        raise ValueError(f"logits_grad_step takes {reason}")
    dtype = dp.dtype
    bm, bk, ns = consumers * ROWS_PER_WG, BLOCK_KEYS, stages
    n_chunks = D // CHUNK
    c_exp = walk.scale * LOG2E
    consumer_regs, producer_regs = registers or (None, None)

    def entry(q_ref, k_ref, dp_ref, lse_ref, delta_ref, off_ref, p_ref, ds_ref):
        wg = lax.axis_index(WARPGROUPS)
        rt, kt, bh = (lax.axis_index(n) for n in (ROW_TILES, KEY_TILES, HEADS))
        b, h = bh // Hq, bh % Hq
        hk, g = h // G, h % G
        r0, c0 = off_ref[0], off_ref[1]
        rows_in_block = rt * bm  # the CTA's first row, in the block
        keys_in_block = kt * bk

        def body(q_smem, k_smem, dp_smem, p_smem, lse_smem, delta_smem, full, free, rows_bar):
            @pl.when(wg < consumers)
            def _consumer():
                if consumer_regs:
                    plgpu.set_max_registers(consumer_regs, action="increase")
                my_rows = pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)

                def chunks(s_ref):
                    for c in range(n_chunks):
                        slot = c % ns
                        plgpu.barrier_wait(full.at[slot])
                        plgpu.wgmma(s_ref, q_smem.at[slot, my_rows],
                                    plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                        if c:  # the previous chunk's wgmma is done: its stage is free
                            plgpu.wgmma_wait(1)
                            plgpu.barrier_arrive(free.at[(c - 1) % ns])
                    plgpu.wgmma_wait(0)
                    plgpu.barrier_arrive(free.at[(n_chunks - 1) % ns])
                    return s_ref[...]

                s = pl.run_scoped(chunks, plgpu.ACC((ROWS_PER_WG, bk), jnp.float32))
                s = soft_cap(walk, s)
                d_cap = soft_cap_grad(walk, s)
                q_idx = r0 + rows_in_block + wg * ROWS_PER_WG + iota((ROWS_PER_WG, bk), 0)
                k_idx = c0 + keys_in_block + iota((ROWS_PER_WG, bk), 1)
                s = score_mod(walk, s, q_idx, k_idx)
                plgpu.barrier_wait(rows_bar.at[wg])
                lse = compat.mosaic_load(lse_smem.at[wg], layout=ROW)
                p = jnp.exp2(s * c_exp - lax.broadcast_in_dim(lse, s.shape, [0]))
                dlt = compat.mosaic_load(delta_smem.at[wg], layout=ROW)
                dpv = compat.mosaic_load(dp_smem.at[wg], layout=WGMMA).astype(jnp.float32)
                ds = p * (dpv - lax.broadcast_in_dim(dlt, s.shape, [0]))
                if d_cap is not None:
                    ds = ds * d_cap
                p_smem.at[wg][...] = p.astype(dtype)
                dp_smem.at[wg][...] = ds.astype(dtype)
                plgpu.commit_smem()
                rows = pl.ds(rows_in_block + wg * ROWS_PER_WG, ROWS_PER_WG)
                keys = pl.ds(keys_in_block, bk)
                plgpu.copy_smem_to_gmem(p_smem.at[wg], p_ref.at[b, h, rows, keys])
                plgpu.copy_smem_to_gmem(dp_smem.at[wg], ds_ref.at[b, h, rows, keys])
                plgpu.wait_smem_to_gmem(0)

            @pl.when(wg == consumers)
            def _producer():
                if producer_regs:
                    plgpu.set_max_registers(producer_regs, action="decrease")
                keys = pl.ds(keys_in_block, bk)
                for w in range(consumers):
                    rows = pl.ds(rows_in_block + w * ROWS_PER_WG, ROWS_PER_WG)
                    plgpu.copy_gmem_to_smem(dp_ref.at[b, h, rows, keys], dp_smem.at[w],
                                            rows_bar.at[w])
                    plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[w],
                                            rows_bar.at[w])
                    plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[w],
                                            rows_bar.at[w])
                q_rows = pl.ds(r0 + rows_in_block, bm)
                k_rows = pl.ds(c0 + keys_in_block, bk)
                for c in range(n_chunks):
                    slot = c % ns
                    if c >= ns:
                        plgpu.barrier_wait(free.at[slot])
                    cols = pl.ds(c * CHUNK, CHUNK)
                    plgpu.copy_gmem_to_smem(q_ref.at[b, hk, g, q_rows, cols], q_smem.at[slot],
                                            full.at[slot])
                    plgpu.copy_gmem_to_smem(k_ref.at[b, hk, k_rows, cols], k_smem.at[slot],
                                            full.at[slot])

        pl.run_scoped(
            body,
            tiled_smem((ns, bm, CHUNK), q5.dtype),
            tiled_smem((ns, bk, CHUNK), k4.dtype),
            tiled_smem((consumers, ROWS_PER_WG, bk), dtype),
            tiled_smem((consumers, ROWS_PER_WG, bk), dtype),
            plgpu.SMEM((consumers, ROWS_PER_WG), jnp.float32),
            plgpu.SMEM((consumers, ROWS_PER_WG), jnp.float32),
            plgpu.Barrier(num_arrivals=2, num_barriers=ns),  # Q's and K's chunk landed
            plgpu.Barrier(num_arrivals=consumers, num_barriers=ns),  # the consumers are done
            plgpu.Barrier(num_arrivals=3, num_barriers=consumers),  # a consumer's dP, lse, δ
            collective_axes=WARPGROUPS)

    out = jax.ShapeDtypeStruct(dp.shape, dtype)
    outputs = plgpu.kernel(
        entry,
        out_type=(out, out),
        grid=(R // bm, K // bk, B * Hq),
        grid_names=(ROW_TILES, KEY_TILES, HEADS),
        num_threads=consumers + 1,
        thread_name=WARPGROUPS,
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                             lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(q5, k4, dp, lse2, delta, offsets.astype(jnp.int32))
    return tuple(compat.vary_like(x, dp) for x in outputs)

