"""The Mosaic backward step (see grad_step.py) launched persistently: one CTA per
multiprocessor walks its share of the block's tiles (128 rows x 128 keys of one head), and the
producer warpgroup streams the Q and K chunks of the next tile (one continuous ring across
tiles) and its dP, lse and delta (two epilogue slots) while the consumers run this tile's
epilogue, so that no tile starts by waiting on its first loads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat
from pallas_kernels.mosaic.common import (LOG2E, ROW, WARPGROUPS, WGMMA, Walk, iota,
                                          multiprocessors, score_mod, soft_cap, soft_cap_grad,
                                          tiled_smem)

ROWS_PER_WG = 64
BLOCK_KEYS = 128
CHUNK = 64
CTAS = "ffpa_step_sm"


def logits_grad_step_persistent(q5, k4, dp, lse2, delta, offsets, walk: Walk, *,
                                stages: int = 3, registers=(232, 40), ctas: int | None = None):
    """As grad_step.logits_grad_step (two consumer warpgroups), persistent."""
    B, _, G, _, D = q5.shape
    _, Hq, R, K = dp.shape
    bm, bk, ns = 2 * ROWS_PER_WG, BLOCK_KEYS, stages
    if R % bm or K % bk or D % CHUNK:
        raise ValueError(f"blocks of whole {bm} x {bk} tiles and D % {CHUNK} == 0")
    dtype = dp.dtype
    n_chunks = D // CHUNK
    n_rt, n_kt = R // bm, K // bk
    n_tiles = n_rt * n_kt * B * Hq
    n_ctas = min(ctas or multiprocessors(), n_tiles)
    c_exp = walk.scale * LOG2E
    consumer_regs, producer_regs = registers

    def entry(q_ref, k_ref, dp_ref, lse_ref, delta_ref, off_ref, p_ref, ds_ref):
        wg = lax.axis_index(WARPGROUPS)
        cta = lax.axis_index(CTAS)
        count = (n_tiles - cta + n_ctas - 1) // n_ctas  # this CTA's tiles
        r0, c0 = off_ref[0], off_ref[1]

        def place(t):
            """(batch, head, first row, first key in the block) of this CTA's tile t."""
            tile = cta + t * n_ctas
            rt = lax.rem(tile, n_rt)
            kt = lax.rem(tile // n_rt, n_kt)
            bh = tile // (n_rt * n_kt)
            return bh // Hq, lax.rem(bh, Hq), rt * bm, kt * bk

        def body(q_smem, k_smem, dp_smem, p_smem, lse_smem, delta_smem, full, free, rows_bar,
                 epi_free):
            @pl.when(wg < 2)
            def _consumer():
                plgpu.set_max_registers(consumer_regs, action="increase")
                my_rows = pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)

                @pl.loop(0, count)
                def _tile(t):
                    b, h, rows0, keys0 = place(t)
                    e = lax.rem(t, 2)
                    base = t * n_chunks

                    def chunks(s_ref):
                        for c in range(n_chunks):
                            slot = lax.rem(base + c, ns)
                            plgpu.barrier_wait(full.at[slot])
                            plgpu.wgmma(s_ref, q_smem.at[slot, my_rows],
                                        plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                            if c:
                                plgpu.wgmma_wait(1)
                                plgpu.barrier_arrive(free.at[lax.rem(base + c - 1, ns)])
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(free.at[lax.rem(base + n_chunks - 1, ns)])
                        return s_ref[...]

                    s = pl.run_scoped(chunks, plgpu.ACC((ROWS_PER_WG, bk), jnp.float32))
                    s = soft_cap(walk, s)
                    d_cap = soft_cap_grad(walk, s)
                    q_idx = r0 + rows0 + wg * ROWS_PER_WG + iota((ROWS_PER_WG, bk), 0)
                    k_idx = c0 + keys0 + iota((ROWS_PER_WG, bk), 1)
                    s = score_mod(walk, s, q_idx, k_idx)
                    mine = e * 2 + wg  # this warpgroup's rows in epilogue slot e
                    plgpu.barrier_wait(rows_bar.at[mine])
                    lse = compat.mosaic_load(lse_smem.at[mine], layout=ROW)
                    p = jnp.exp2(s * c_exp - lax.broadcast_in_dim(lse, s.shape, [0]))
                    dlt = compat.mosaic_load(delta_smem.at[mine], layout=ROW)
                    dpv = compat.mosaic_load(dp_smem.at[mine], layout=WGMMA).astype(jnp.float32)
                    ds = p * (dpv - lax.broadcast_in_dim(dlt, s.shape, [0]))
                    if d_cap is not None:
                        ds = ds * d_cap
                    # The last tile's P store must have read p_smem before it is written.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    p_smem.at[wg][...] = p.astype(dtype)
                    dp_smem.at[mine][...] = ds.astype(dtype)
                    plgpu.commit_smem()
                    rows = pl.ds(rows0 + wg * ROWS_PER_WG, ROWS_PER_WG)
                    keys = pl.ds(keys0, bk)
                    plgpu.copy_smem_to_gmem(p_smem.at[wg], p_ref.at[b, h, rows, keys])
                    plgpu.copy_smem_to_gmem(dp_smem.at[mine], ds_ref.at[b, h, rows, keys])
                    # The epilogue slot goes back to the producer once dS's store has read it.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    plgpu.barrier_arrive(epi_free.at[e])

                plgpu.wait_smem_to_gmem(0)

            @pl.when(wg == 2)
            def _producer():
                plgpu.set_max_registers(producer_regs, action="decrease")

                @pl.loop(0, count)
                def _tile(t):
                    b, h, rows0, keys0 = place(t)
                    hk, g = h // G, lax.rem(h, G)
                    e = lax.rem(t, 2)

                    @pl.when(t >= 2)
                    def _():
                        plgpu.barrier_wait(epi_free.at[e])

                    keys = pl.ds(keys0, bk)
                    for w in range(2):
                        rows = pl.ds(rows0 + w * ROWS_PER_WG, ROWS_PER_WG)
                        mine = e * 2 + w
                        plgpu.copy_gmem_to_smem(dp_ref.at[b, h, rows, keys], dp_smem.at[mine],
                                                rows_bar.at[mine])
                        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[mine],
                                                rows_bar.at[mine])
                        plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[mine],
                                                rows_bar.at[mine])
                    q_rows = pl.ds(r0 + rows0, bm)
                    k_rows = pl.ds(c0 + keys0, bk)
                    base = t * n_chunks
                    for c in range(n_chunks):
                        n = base + c
                        slot = lax.rem(n, ns)

                        @pl.when(n >= ns)
                        def _():
                            plgpu.barrier_wait(free.at[slot])

                        cols = pl.ds(c * CHUNK, CHUNK)
                        plgpu.copy_gmem_to_smem(q_ref.at[b, hk, g, q_rows, cols],
                                                q_smem.at[slot], full.at[slot])
                        plgpu.copy_gmem_to_smem(k_ref.at[b, hk, k_rows, cols],
                                                k_smem.at[slot], full.at[slot])

        pl.run_scoped(
            body,
            tiled_smem((ns, bm, CHUNK), q5.dtype),
            tiled_smem((ns, bk, CHUNK), k4.dtype),
            tiled_smem((4, ROWS_PER_WG, bk), dtype),  # dP, then dS: 2 slots x 2 warpgroups
            tiled_smem((2, ROWS_PER_WG, bk), dtype),  # P
            plgpu.SMEM((4, ROWS_PER_WG), jnp.float32),
            plgpu.SMEM((4, ROWS_PER_WG), jnp.float32),
            plgpu.Barrier(num_arrivals=2, num_barriers=ns),  # Q's and K's chunk landed
            plgpu.Barrier(num_arrivals=2, num_barriers=ns),  # both consumers done with it
            plgpu.Barrier(num_arrivals=3, num_barriers=4),  # a slot's dP, lse, delta landed
            plgpu.Barrier(num_arrivals=2, num_barriers=2),  # an epilogue slot free again
            collective_axes=WARPGROUPS)

    out = jax.ShapeDtypeStruct(dp.shape, dtype)
    outputs = plgpu.kernel(
        entry,
        out_type=(out, out),
        grid=(n_ctas,),
        grid_names=(CTAS,),
        num_threads=3,
        thread_name=WARPGROUPS,
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                             lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(q5, k4, dp, lse2, delta, offsets.astype(jnp.int32))
    return tuple(compat.vary_like(x, dp) for x in outputs)
