"""The chunked tier's backward step on Hopper: a block's logits S = Q·Kᵀ on the tensor cores,
the head dim streamed through a ring of TMA stages, with the softmax gradient as the
epilogue, so that S never goes through memory:

    P = exp2(scale·log2e·S − lse·log2e),  dS = P ∘ (dP − δ)

for a block of R query rows × K keys of the chunked backward (`pallas_kernels.chunked`),
whose dP comes from a library GEMM. It does what `blocked.softmax_grad_of_operands` does
for the blocks without a bias, dropout, segment ids or sequence lengths.

The launch is persistent: one CTA per multiprocessor walks its share of the block's tiles
(128 rows × 128 keys of one query head; two consumer warpgroups of 64 rows each), and a
producer warpgroup streams the Q and K chunks of the next tile (one ring across tiles) and
its dP, lse and δ (two epilogue slots) while the consumers run this tile's epilogue, so that
no tile starts by waiting on its first loads. A CTA per tile, which waits on them, ran
slower than the Triton step (docs/history.md, session 44).
"""

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
CONSUMERS = 2
TILE_ROWS = CONSUMERS * ROWS_PER_WG
TILE_KEYS = 128
CHUNK = 64  # head-dim columns per ring stage
# Ring stages: four fill the shared memory with the epilogue's slots (and ran faster than
# three on the H200: docs/history.md, session 45).
STAGES = 4
REGISTERS = (232, 40)  # per thread: consumer warpgroups, producer warpgroup
CTAS = "ffpa_step_sm"


def unsupported(n_rows: int, n_keys: int, head_dim: int) -> str:
    """Why a block of these sizes cannot run here ("" if it can)."""
    if n_rows % TILE_ROWS or n_keys % TILE_KEYS:
        return (f"blocks of whole {TILE_ROWS}-row and {TILE_KEYS}-key tiles "
                f"(got {n_rows} x {n_keys})")
    if head_dim % CHUNK:
        return f"head dims that are multiples of {CHUNK} (got {head_dim})"
    return ""


def log2_lse(lse):
    """The step's lse operand: lse·log2(e), +inf on rows that see no key (lse = -inf), whose
    P is then 0 for every key, masked or not."""
    return jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf)


def logits_grad_step(q5, k4, dp, lse2, delta, offsets, walk: Walk, *, stages: int = STAGES,
                     registers: tuple[int, int] = REGISTERS, ctas: int | None = None):
    """(P, dS) [B, Hq, R, K] in dP's dtype of the block at global (row, key) `offsets`
    (int32[2]) of a problem with `walk`'s T, S, causality, window, soft cap and scale:
    q5 [B, Hkv, G, R, D] and k4 [B, Hkv, K, D] the block's rows of q and keys of k (16-bit,
    D a multiple of 64; the offsets only place them for the mask: a TMA copy's start must
    be a whole number of its 8-row swizzle tiles, which a block's place need not be), dp
    [B, Hq, R, K] the block's dP (query head h = kv head · G + group member), lse2
    [B, Hq, R] = `log2_lse(lse)`, delta [B, Hq, R] = rowsum(dO·O) − dlse. dS is the
    gradient of the logits before the soft cap, as `blocked.softmax_grad`'s. `ctas`: the
    persistent grid (default: one per multiprocessor)."""
    B, _, G, _, D = q5.shape
    _, Hq, R, K = dp.shape
    reason = unsupported(R, K, D)
    if reason:
        raise ValueError(f"logits_grad_step takes {reason}")
    if q5.shape[3] != R or k4.shape[2] != K:
        raise ValueError(f"logits_grad_step takes the block's {R} rows and {K} keys; got q "
                         f"{q5.shape} and k {k4.shape}")
    dtype = dp.dtype
    bm, bk, ns = TILE_ROWS, TILE_KEYS, stages
    n_chunks = D // CHUNK
    n_row_tiles, n_key_tiles = R // bm, K // bk
    n_tiles = n_row_tiles * n_key_tiles * B * Hq
    n_ctas = min(ctas or multiprocessors(), n_tiles)
    c_exp = walk.scale * LOG2E
    consumer_regs, producer_regs = registers

    def entry(q_ref, k_ref, dp_ref, lse_ref, delta_ref, off_ref, p_ref, ds_ref):
        wg = lax.axis_index(WARPGROUPS)
        cta = lax.axis_index(CTAS)
        count = (n_tiles - cta + n_ctas - 1) // n_ctas  # this CTA's tiles
        r0, c0 = off_ref[0], off_ref[1]

        def place(t):
            """(batch, head, first row, first key in the block) of this CTA's tile t: row
            tiles fastest, so that the CTAs running together share one head's K in L2."""
            tile = cta + t * n_ctas
            row_tile = lax.rem(tile, n_row_tiles)
            key_tile = lax.rem(tile // n_row_tiles, n_key_tiles)
            bh = tile // (n_row_tiles * n_key_tiles)
            return bh // Hq, lax.rem(bh, Hq), row_tile * bm, key_tile * bk

        def body(q_smem, k_smem, dp_smem, p_smem, lse_smem, delta_smem, full, free, rows_bar,
                 epilogue_free):
            @pl.when(wg < CONSUMERS)
            def _consumer():
                plgpu.set_max_registers(consumer_regs, action="increase")
                my_rows = pl.ds(wg * ROWS_PER_WG, ROWS_PER_WG)

                @pl.loop(0, count)
                def _tile(t):
                    b, h, rows0, keys0 = place(t)
                    epilogue = lax.rem(t, 2)
                    first_chunk = t * n_chunks  # of this tile in the ring

                    def logits(s_ref):
                        for c in range(n_chunks):
                            slot = lax.rem(first_chunk + c, ns)
                            plgpu.barrier_wait(full.at[slot])
                            plgpu.wgmma(s_ref, q_smem.at[slot, my_rows],
                                        k_smem.at[slot].transpose((1, 0)))
                            if c:  # the previous chunk's product is done: its stage is free
                                plgpu.wgmma_wait(1)
                                plgpu.barrier_arrive(free.at[lax.rem(first_chunk + c - 1, ns)])
                        plgpu.wgmma_wait(0)
                        plgpu.barrier_arrive(free.at[lax.rem(first_chunk + n_chunks - 1, ns)])
                        return s_ref[...]

                    s = pl.run_scoped(logits, plgpu.ACC((ROWS_PER_WG, bk), jnp.float32))
                    s = soft_cap(walk, s)
                    d_cap = soft_cap_grad(walk, s)
                    q_idx = r0 + rows0 + wg * ROWS_PER_WG + iota((ROWS_PER_WG, bk), 0)
                    k_idx = c0 + keys0 + iota((ROWS_PER_WG, bk), 1)
                    s = score_mod(walk, s, q_idx, k_idx)
                    mine = epilogue * CONSUMERS + wg  # this warpgroup's rows in the slot
                    plgpu.barrier_wait(rows_bar.at[mine])
                    lse = compat.mosaic_load(lse_smem.at[mine], layout=ROW)
                    p = jnp.exp2(s * c_exp - lax.broadcast_in_dim(lse, s.shape, [0]))
                    dlt = compat.mosaic_load(delta_smem.at[mine], layout=ROW)
                    dpv = compat.mosaic_load(dp_smem.at[mine], layout=WGMMA).astype(jnp.float32)
                    ds = p * (dpv - lax.broadcast_in_dim(dlt, s.shape, [0]))
                    if d_cap is not None:
                        ds = ds * d_cap
                    # The previous tile's P store must have read p_smem before it is written.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    p_smem.at[wg][...] = p.astype(dtype)
                    dp_smem.at[mine][...] = ds.astype(dtype)  # dS takes dP's place
                    plgpu.commit_smem()
                    rows = pl.ds(rows0 + wg * ROWS_PER_WG, ROWS_PER_WG)
                    keys = pl.ds(keys0, bk)
                    plgpu.copy_smem_to_gmem(p_smem.at[wg], p_ref.at[b, h, rows, keys])
                    plgpu.copy_smem_to_gmem(dp_smem.at[mine], ds_ref.at[b, h, rows, keys])
                    # The slot goes back to the producer once dS's store has read it.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    plgpu.barrier_arrive(epilogue_free.at[epilogue])

                plgpu.wait_smem_to_gmem(0)

            @pl.when(wg == CONSUMERS)
            def _producer():
                plgpu.set_max_registers(producer_regs, action="decrease")

                @pl.loop(0, count)
                def _tile(t):
                    b, h, rows0, keys0 = place(t)
                    hk, g = h // G, lax.rem(h, G)
                    epilogue = lax.rem(t, 2)

                    @pl.when(t >= 2)
                    def _():
                        plgpu.barrier_wait(epilogue_free.at[epilogue])

                    keys = pl.ds(keys0, bk)
                    for w in range(CONSUMERS):
                        rows = pl.ds(rows0 + w * ROWS_PER_WG, ROWS_PER_WG)
                        mine = epilogue * CONSUMERS + w
                        plgpu.copy_gmem_to_smem(dp_ref.at[b, h, rows, keys], dp_smem.at[mine],
                                                rows_bar.at[mine])
                        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[mine],
                                                rows_bar.at[mine])
                        plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[mine],
                                                rows_bar.at[mine])
                    q_rows = pl.ds(rows0, bm)
                    k_rows = pl.ds(keys0, bk)
                    first_chunk = t * n_chunks
                    for c in range(n_chunks):
                        n = first_chunk + c
                        slot = lax.rem(n, ns)

                        @pl.when(n >= ns)
                        def _():
                            plgpu.barrier_wait(free.at[slot])

                        cols = pl.ds(c * CHUNK, CHUNK)
                        plgpu.copy_gmem_to_smem(q_ref.at[b, hk, g, q_rows, cols],
                                                q_smem.at[slot], full.at[slot])
                        plgpu.copy_gmem_to_smem(k_ref.at[b, hk, k_rows, cols],
                                                k_smem.at[slot], full.at[slot])

        slots = 2 * CONSUMERS  # two epilogue slots of each consumer's rows
        pl.run_scoped(
            body,
            tiled_smem((ns, bm, CHUNK), q5.dtype),
            tiled_smem((ns, bk, CHUNK), k4.dtype),
            tiled_smem((slots, ROWS_PER_WG, bk), dtype),  # dP, then dS
            tiled_smem((CONSUMERS, ROWS_PER_WG, bk), dtype),  # P
            plgpu.SMEM((slots, ROWS_PER_WG), jnp.float32),  # lse
            plgpu.SMEM((slots, ROWS_PER_WG), jnp.float32),  # δ
            plgpu.Barrier(num_arrivals=2, num_barriers=ns),  # Q's and K's chunk landed
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=ns),  # both done with it
            plgpu.Barrier(num_arrivals=3, num_barriers=slots),  # a slot's dP, lse, δ landed
            plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=2),  # an epilogue slot free
            collective_axes=WARPGROUPS)

    out = jax.ShapeDtypeStruct(dp.shape, dtype)
    outputs = plgpu.kernel(
        entry,
        out_type=(out, out),
        grid=(n_ctas,),
        grid_names=(CTAS,),
        num_threads=CONSUMERS + 1,
        thread_name=WARPGROUPS,
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0,
                                             lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(q5, k4, dp, lse2, delta, offsets.astype(jnp.int32))
    return tuple(compat.vary_like(x, dp) for x in outputs)


def unserved(problem) -> tuple[str, ...]:
    """What of `problem` (a `Problem`) the step does not compute, by argument name (or what):
    the chunked tier's Pallas-Triton step computes it there."""
    return tuple(name for name, lacks in (
        ("bias", problem.has_bias), ("mask", problem.mask_shape is not None),
        ("dropout_rate", problem.has_dropout), ("q_segment_ids", problem.segment_ids),
        ("query_seq_lengths", problem.q_lengths),
        ("key_value_seq_lengths", problem.kv_lengths),
        ("context_axis (a block of a longer sequence)", problem.positions),
        ("float32 (16-bit only)", problem.natural),
        (f"head dims that are not multiples of {CHUNK}", problem.head_dim % CHUNK != 0))
        if lacks)


# Jitted once: the blocks of one call with the same shapes (unrolled where the chunked
# backward keeps dK and dV per key block) then share one traced and lowered kernel, not
# one per block.
_shared_step = jax.jit(logits_grad_step,
                       static_argnames=("walk", "stages", "registers", "ctas"))


def block_step(problem, q5, k4, dp, lse, delta, offsets):
    """`logits_grad_step` of one block of the chunked backward of `problem` (which it serves:
    `unserved`): lse [B, Hq, R] natural, as the chunked tier keeps it; q5 [B, Hkv, G, R, D]
    and k4 [B, Hkv, K, D] the block's rows and keys."""
    walk = Walk(T=problem.seq_q, S=problem.seq_k, causal=problem.causal, block_kv=TILE_KEYS,
                window=problem.window, softcap=problem.softcap, scale=problem.scale)
    return _shared_step(q5, k4, dp, log2_lse(lse), delta, offsets, walk=walk)
