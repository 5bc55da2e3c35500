"""The "rows" kernel (D, Dv <= 256 after padding): FA3-style warp specialisation.

One CTA = 2 consumer warpgroups x 64 query rows + 1 producer warpgroup that streams K and V
tiles through a ring of shared-memory stages with TMA and mbarriers. Consumers run
S = Q Kᵀ (wgmma, smem x smem), the online softmax in registers (exp2, scale·log2(e) folded
in), O += P V (wgmma, P from registers). A shared "schedule" barrier makes the two consumer
warpgroups ping-pong: one runs its softmax while the other's matmuls occupy the tensor
cores. With `Config.overlap`, each warpgroup instead keeps the tensor cores busy by itself
(FlashAttention-3's intra-warpgroup overlap): a step issues S(j) = Q K(j)ᵀ and
O += P(j-1) V(j-1) together and runs the softmax of S(j) while the P V wgmma is in flight.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat
from pallas_kernels.mosaic.common import (CLUSTER, COLUMNS, LOG2E, NEG_INF, ROW, WARPGROUPS,
                                          WGMMA, Grid, Walk, cdiv, cluster_walk, consumer_walk,
                                          finalize, iota, launch, padded_ids, same_segment,
                                          score_mod, soft_cap, softmax_update, tiled_smem,
                                          walk_kv)
from pallas_kernels.mosaic.config import Config, balanced_tiles, walks_overlapped
from pallas_kernels.visibility import segment_block_ranges


def rows_forward(q, k, v, prob: Walk, *, config: Config, out_dtype, kv_lengths=None,
                 segment_ids=None, positions=None):
    # prob.T, prob.S: true lengths; the arrays may be padded to multiples of 8 (TMA tiling).
    # `segment_ids`: None, or (q ids [B, T], kv ids [B, S]) (prob.segments says which).
    # `positions`: None, or int32 [3] placing the arrays in a longer sequence
    # (`Walk.with_positions`).
    B, Tq, Hq, D = q.shape
    _, _, Hkv, Dv = v.shape
    dtype = q.dtype
    group = Hq // Hkv
    bq = 64
    nwg = 2
    rows_cta = nwg * bq
    bkv = config.block_kv
    ns = config.num_stages
    ncl = config.cluster
    T = prob.T
    assert prob.block_kv == bkv
    c_exp = prob.scale * LOG2E
    out_itemsize = jnp.dtype(out_dtype).itemsize
    has_segments = segment_ids is not None
    # float32 O in chunks of 128 columns (64 where Dv is an odd number of 64s: D = 192).
    oc = config.out_chunk or (Dv if out_itemsize == 2 else 128 if Dv % 128 == 0 else 64)
    # Persistent where separate Q and O tiles fit beside the ring; else one tile per CTA.
    persistent_chunk = (persistent_out_chunk(config, D, Dv, dtype, out_dtype, has_segments)
                        if config.persistent else None)
    persistent = persistent_chunk is not None
    overlap = walks_overlapped(config, persistent)
    # The overlap keeps each warpgroup's own wgmmas back to back; the ping-pong's
    # lock-step breaks that (measured slower together, docs/history.md, session 38).
    pingpong = config.schedule_barrier and not overlap
    oc = persistent_chunk or oc
    grid = Grid.of(config, n_q=cdiv(T, rows_cta), Hq=Hq, B=B, group=group, causal=prob.causal,
                   persistent=persistent, balanced=balanced_tiles(prob.causal, prob.window, T))
    Tp = grid.q_extent * rows_cta
    assert Dv % oc == 0
    assert has_segments == prob.segments
    segments = None
    if has_segments:
        segments = segment_inputs(segment_ids, grid, rows_cta, bkv, Tp=Tp, head_dim=max(D, Dv),
                                  keys=prob.num_kv_blocks * bkv)

    def kernel(q_ref, k_ref, v_ref, kvlen_ref, pos_ref, seg_refs, o_ref, lse_ref, scoped):
        (
            (q_smem, o_smem),
            lse_smem,
            k_smem,
            v_smem,
            qid_smem,
            kid_smem,
            q_bar,
            k_bar,
            v_bar,
            k_free,
            v_free,
            sched,
            exit_bar,
        ) = scoped
        wg = lax.axis_index(WARPGROUPS)
        qid_ref, kid_ref, ranges_ref = seg_refs
        collective = CLUSTER if ncl > 1 else None

        def tile_walk(indices):
            """(walk, kv head, lo, hi, kv_of) of a tile (`Grid.indices`)."""
            _, h, b, t_first, t_count = indices
            # the batch row's key length and the block's place, if given
            walk = prob.with_key_end(kvlen_ref, b).with_positions(pos_ref)
            walk = walk.with_segment_range(ranges_ref, b, lax.div(t_first, jnp.int32(t_count)))
            hk = lax.div(h, jnp.int32(group))
            lo, hi, kv_of = cluster_walk(walk, grid, t_first, t_count, rows_cta,
                                         config.kv_rotate)
            return walk, hk, lo, hi, kv_of

        def ring_index(done, i):
            """The ring position of a tile's i-th block, after `done` blocks of earlier
            tiles (None: the CTA's first and only tile)."""
            return i if done is None else done + i

        def ring_slot(done, i):
            return lax.rem(ring_index(done, i), ns)

        def walked(done, lo, hi):
            """The ring blocks passed after a tile (None where there is no next tile)."""
            return None if done is None else done + (hi - lo)

        def sched_sync():
            if pingpong:
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(sched)

        def first_row(t):
            """This warpgroup's first query row in query tile t."""
            return t * rows_cta + wg * bq

        def load_q(q0, h, b):
            """This warpgroup's rows of Q (and their segment ids) from row q0 of query head
            h of batch row b, into shared memory."""
            plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], q_smem.at[wg], q_bar.at[wg])
            if has_segments:
                plgpu.copy_gmem_to_smem(qid_ref.at[b, pl.ds(q0, bq)], qid_smem.at[wg],
                                        q_bar.at[wg])

        def scores(my_q, slot):
            """S = Q Kᵀ of the K tile in ring `slot`, waited for (the ping-pong's turn, where
            it runs, passed once the wgmma is issued)."""

            def qk(s_ref):
                plgpu.wgmma(s_ref, my_q, k_smem.at[slot].transpose((1, 0)))
                sched_sync()
                return s_ref[...]

            return pl.run_scoped(qk, plgpu.ACC((bq, bkv), jnp.float32))

        def serial_walk(carry, my_q, done, lo, mask_lo, full_hi, my_hi, visible_scores):
            """(acc, m, l) after this warpgroup's blocks [lo, my_hi), one after the other:
            each step's P V follows its softmax; the two warpgroups ping-pong."""

            @pl.when(my_hi > lo)
            def _():
                plgpu.barrier_wait(k_bar.at[0 if done is None else ring_slot(done, 0)])

            pl.when(wg == 1)(sched_sync)

            def step(j, carry, *, masked):
                acc, m_i, l_i = carry
                slot = ring_slot(done, j - lo)

                s = visible_scores(j, slot, scores(my_q, slot), masked)
                p, alpha, m_new = softmax_update(s, m_i, l_i, c_exp, guard=masked)
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha
                p16 = p.astype(dtype)
                if Dv <= 128:
                    l_i = l_i + p.sum(axis=1)
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                if pingpong:
                    plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_bar.at[slot])
                if pingpong:
                    plgpu.barrier_wait(sched)
                if Dv > 128:
                    l_i = l_i + p.sum(axis=1)

                # (computed outside the run_state closure: the Warpgroup lowering
                # cannot carry literal constants through run_state)
                has_next = j + 1 < my_hi
                next_slot = ring_slot(done, j + 1 - lo)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                    @pl.when(has_next)
                    def _():
                        plgpu.barrier_wait(k_bar.at[next_slot])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            return walk_kv(step, carry, lo, mask_lo, full_hi, my_hi)

        def overlapped_walk(carry, my_q, done, lo, mask_lo, full_hi, my_hi, visible_scores):
            """(acc, m, l) after this warpgroup's blocks [lo, my_hi), overlapped: the first
            block only computes its P; each later step j issues S(j) and P(j-1) V(j-1)
            together and runs the softmax of S(j) while the P V wgmma is in flight; a last
            step adds P V of the last block. O is rescaled to a block's maximum before that
            block's P V is added (alpha carried one step)."""

            def softmax(s, m_i, l_i, masked):
                p, alpha, m_new = softmax_update(s, m_i, l_i, c_exp, guard=masked)
                return p.astype(dtype), alpha, m_new, l_i * alpha + p.sum(axis=1)

            def first(j, carry, *, masked):
                acc, m_i, l_i, _, _ = carry
                slot = ring_slot(done, j - lo)
                plgpu.barrier_wait(k_bar.at[slot])
                s = visible_scores(j, slot, scores(my_q, slot), masked)
                p16, alpha, m_new, l_new = softmax(s, m_i, l_i, masked)
                return acc, m_new, l_new, p16, alpha

            def step(j, carry, *, masked):
                acc, m_i, l_i, p_prev, alpha_prev = carry
                slot = ring_slot(done, j - lo)
                prev = ring_slot(done, j - 1 - lo)
                acc = acc * lax.broadcast_in_dim(alpha_prev, acc.shape, [0])
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_wait(v_bar.at[prev])

                def body(refs):
                    acc_ref, m_ref, l_ref, p_ref, a_ref = refs

                    def issue(s_ref):
                        plgpu.wgmma(s_ref, my_q, k_smem.at[slot].transpose((1, 0)))
                        plgpu.wgmma(acc_ref, p_prev, v_smem.at[prev])
                        # S(j) once its wgmma is done, the P V one still in flight
                        return compat.wgmma_accumulator_load(s_ref, wait_n=1)

                    s = visible_scores(j, slot,
                                       pl.run_scoped(issue, plgpu.ACC((bq, bkv), jnp.float32)),
                                       masked)
                    p16, alpha, m_new, l_new = softmax(s, m_ref[...], l_ref[...], masked)
                    m_ref[...] = m_new
                    l_ref[...] = l_new
                    p_ref[...] = p16
                    a_ref[...] = alpha

                # (run_state's end waits for the P V wgmma)
                acc, m_new, l_new, p16, alpha = pl.run_state(body)(
                    (plgpu.ACC.init(acc), m_i, l_i, p_prev, alpha_prev))
                # P(j-1) stays live until its wgmma has been waited for: otherwise ptxas may
                # give the new P its registers while the wgmma still reads them, and then
                # serialises the wgmmas (its C7513 report; slower under causality and windows)
                acc, p16, _ = lax.optimization_barrier((acc, p16, p_prev))
                plgpu.barrier_arrive(v_free.at[prev])
                return acc, m_new, l_new, p16, alpha

            def last(j, carry):
                acc, m_i, l_i, p_prev, alpha_prev = carry
                slot = ring_slot(done, j - lo)
                acc = acc * lax.broadcast_in_dim(alpha_prev, acc.shape, [0])
                plgpu.barrier_wait(v_bar.at[slot])

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p_prev, v_smem.at[slot])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_i, l_i, p_prev, alpha_prev

            acc, m_i, l_i = carry
            ones = plgpu.layout_cast(jnp.ones((bq,), jnp.float32), ROW)
            p0 = plgpu.layout_cast(jnp.zeros((bq, bkv), dtype), WGMMA)
            carry = (acc, m_i, l_i, p0, ones)
            # The first block, [lo, e) with e = min(lo + 1, my_hi) (empty where the
            # warpgroup sees no block), split as the walk splits it; then the rest.
            e = jnp.minimum(lo + 1, my_hi)
            carry = walk_kv(first, carry, lo, jnp.minimum(mask_lo, e), jnp.minimum(full_hi, e),
                            e)
            carry = walk_kv(step, carry, e, jnp.maximum(mask_lo, e), jnp.maximum(full_hi, e),
                            my_hi)
            acc, m_i, l_i, _, _ = lax.fori_loop(jnp.maximum(lo, my_hi - 1), my_hi, last, carry)
            return acc, m_i, l_i

        def consumer_tile(indices, done, following=None):
            """One tile of the consumers. One tile per CTA (`done` None): its Q loaded
            here. Persistent: its Q was loaded before (by the last tile, or before the
            first); the next tile's Q loads once this one's walk is done."""
            t, h, b, _, _ = indices
            walk, _, lo, hi, kv_of = shared if shared is not None else tile_walk(indices)
            q0 = first_row(t)
            my_q = q_smem.at[wg]
            if done is None:
                load_q(q0, h, b)
            q_last = jnp.minimum(q0 + bq - 1, T - 1)
            mask_lo, full_hi, my_hi = consumer_walk(  # a warpgroup may hold padding rows only
                walk, lo, q0, q_last, padding_rows=grid.q_extent * rows_cta - bq >= T)

            m_i = plgpu.layout_cast(jnp.full((bq,), NEG_INF, jnp.float32), ROW)
            l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), ROW)
            acc = plgpu.layout_cast(jnp.zeros((bq, Dv), jnp.float32), WGMMA)

            plgpu.barrier_wait(q_bar.at[wg])
            row_ids = (compat.mosaic_load(qid_smem.at[wg], layout=ROW) if has_segments
                       else None)

            def visible_scores(j, slot, s, masked):
                """S(j) with the soft cap and, in `masked` steps, the element masks; K(j)'s
                slot is released here (its ids read first)."""
                same = None
                if masked and has_segments:  # read before the slot is released
                    col_ids = compat.mosaic_load(kid_smem.at[slot], layout=COLUMNS)
                    same = same_segment(row_ids, col_ids, (bq, bkv))
                plgpu.barrier_arrive(k_free.at[slot])
                s = soft_cap(walk, s)
                if masked:
                    q_idx = q0 + iota((bq, bkv), 0)
                    k_idx = kv_of(j) * bkv + iota((bq, bkv), 1)
                    s = score_mod(walk, s, q_idx, k_idx, same)
                return s

            if overlap:
                acc, m_i, l_i = overlapped_walk(
                    (acc, m_i, l_i), my_q, done, lo, mask_lo, full_hi, my_hi, visible_scores)
            else:
                acc, m_i, l_i = serial_walk(
                    (acc, m_i, l_i), my_q, done, lo, mask_lo, full_hi, my_hi, visible_scores)

            # Blocks loaded for the other warpgroup / the cluster but hidden for us:
            # release them (only once they have landed, so that no warpgroup can
            # ever arrive for a later phase of a slot before the current one is
            # complete) and keep the schedule barrier in lock-step.
            @pl.loop(my_hi, hi)
            def _skip(j):
                slot = ring_slot(done, j - lo)
                plgpu.barrier_wait(k_bar.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_wait(v_bar.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                sched_sync()
                sched_sync()

            if following is not None:
                has_next, (next_t, next_h, next_b, _, _) = following
                pl.when(has_next)(lambda: load_q(first_row(next_t), next_h, next_b))

            if pingpong:
                pl.when(wg == 0)(sched_sync)
            else:
                # O aliases Q of the other warpgroup: wait until both left the loop.
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(sched)

            (out,), lse = finalize([acc], m_i, l_i)
            if done is not None:
                # The last tile's O and lse stores have read their tiles (waited for
                # here, not after them, so that they overlap this tile's last steps).
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            lse_smem.at[wg][...] = lse
            my_o = o_smem.at[wg]
            for ci in range(Dv // oc):
                if ci:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                my_o[...] = out[:, ci * oc : (ci + 1) * oc].astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(my_o, o_ref.at[b, pl.ds(q0, bq), h, pl.ds(ci * oc, oc)])
            plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[b, h, pl.ds(q0, bq)])
            if done is None:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            return walked(done, lo, hi)

        def producer_tile(indices, done, following=None):
            _, _, b, _, _ = indices
            _, hk, lo, hi, kv_of = shared if shared is not None else tile_walk(indices)

            @pl.loop(lo, hi)
            def _load(j):
                i = j - lo
                slot = ring_slot(done, i)
                kv_rows = pl.ds(kv_of(j) * bkv, bkv)
                # K first, then V: each waits for its slot to be released, from the
                # second turn of the ring on.
                for ref, smem, free, bar in ((k_ref, k_smem, k_free, k_bar),
                                             (v_ref, v_smem, v_free, v_bar)):
                    @pl.when(ring_index(done, i) >= ns)
                    def _(free=free):
                        plgpu.barrier_wait(free.at[slot])

                    plgpu.copy_gmem_to_smem(ref.at[b, kv_rows, hk], smem.at[slot], bar.at[slot],
                                            collective_axes=collective)
                    if has_segments and ref is k_ref:  # the keys' ids land with K
                        plgpu.copy_gmem_to_smem(kid_ref.at[b, kv_rows], kid_smem.at[slot],
                                                bar.at[slot])
            return walked(done, lo, hi)

        # One tile per CTA: its walk computed once for both roles. Persistent: each role
        # walks the CTA's tiles, counting the ring blocks passed.
        if persistent:
            shared = None
            run_tiles = lambda body: grid.tiles(body, jnp.int32(0))  # noqa: E731
        else:
            indices = grid.indices()
            shared = tile_walk(indices)
            run_tiles = lambda body: body(indices, None)  # noqa: E731

        @pl.when(wg < nwg)
        def _consumer():
            plgpu.set_max_registers(config.consumer_regs, action="increase")
            if persistent:
                t, h, b, _, _ = grid.first_tile()
                load_q(first_row(t), h, b)
            run_tiles(consumer_tile)
            if persistent:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            if ncl > 1:
                # Nobody in the cluster may exit while others can still signal it.
                plgpu.barrier_arrive(exit_bar)
                plgpu.barrier_wait(exit_bar)

        @pl.when(wg == nwg)
        def _producer():
            plgpu.set_max_registers(config.producer_regs, action="decrease")
            run_tiles(producer_tile)

    def entry(q_ref, k_ref, v_ref, *refs):
        refs = list(refs)
        kvlen_ref = refs.pop(0) if kv_lengths is not None else None
        pos_ref = refs.pop(0) if positions is not None else None
        seg_refs = tuple(refs.pop(0) for _ in range(3)) if has_segments else (None,) * 3
        o_ref, lse_ref = refs
        def free():
            if ncl > 1:
                return plgpu.ClusterBarrier(collective_axes=(CLUSTER,), num_arrivals=nwg,
                                            num_barriers=ns)
            return plgpu.Barrier(num_arrivals=nwg, num_barriers=ns)

        exit_bar = (plgpu.ClusterBarrier(collective_axes=(CLUSTER,), num_arrivals=nwg)
                    if ncl > 1 else None)
        q_and_o = (tiled_smem((nwg, bq, D), dtype), tiled_smem((nwg, bq, oc), out_dtype))
        # One tile per CTA: O takes Q's place once the walk is done. Persistent: the next
        # tile's Q lands while this one's O is stored.
        q_and_o_smem = q_and_o if persistent else plgpu.RefUnion(*q_and_o)
        pl.run_scoped(
            lambda *args: kernel(q_ref, k_ref, v_ref, kvlen_ref, pos_ref, seg_refs, o_ref,
                                 lse_ref, args),
            q_and_o_smem,
            plgpu.SMEM((nwg, bq), jnp.float32),
            tiled_smem((ns, bkv, D), dtype),
            tiled_smem((ns, bkv, Dv), dtype),
            plgpu.SMEM((nwg, bq), jnp.int32) if has_segments else None,  # rows' ids
            plgpu.SMEM((ns, bkv), jnp.int32) if has_segments else None,  # keys' ids
            plgpu.Barrier(num_arrivals=1 + has_segments, num_barriers=nwg),
            plgpu.Barrier(num_arrivals=1 + has_segments, num_barriers=ns),
            plgpu.Barrier(num_barriers=ns),
            free(),
            free(),
            plgpu.Barrier(num_arrivals=nwg),  # schedule (ping-pong) barrier
            exit_bar,
            collective_axes=WARPGROUPS,
        )

    inputs = (q, k, v, *(() if kv_lengths is None else (kv_lengths,)),
              *(() if positions is None else (positions,)),
              *(() if segments is None else segments))
    return launch(entry, grid, config, inputs, out_dtype=out_dtype, lse_rows=Tp)


# Shared memory of a CTA on sm90 (227 KiB), and what a persistent launch's estimate keeps
# free beside its tiles for barriers and the allocations' alignment.
SMEM_BYTES = 227 * 1024
SMEM_SLACK = 2048


def persistent_out_chunk(config: Config, D: int, Dv: int, dtype, out_dtype,
                         segments: bool) -> int | None:
    """The widest O chunk (the config's, else all of Dv, 128 or 64 columns) with which a
    persistent launch's separate Q and O tiles fit shared memory beside the K/V ring (None:
    none)."""
    item, out_item = jnp.dtype(dtype).itemsize, jnp.dtype(out_dtype).itemsize
    rows = 2 * 64  # two consumer warpgroups of 64 rows
    ring = config.num_stages * config.block_kv
    fixed = rows * D * item + ring * (D + Dv) * item + rows * 4 + SMEM_SLACK  # Q, K/V, lse
    if segments:
        fixed += rows * 4 + ring * 4
    for oc in (config.out_chunk,) if config.out_chunk else (Dv, 128, 64):
        if Dv % oc == 0 and fixed + rows * oc * out_item <= SMEM_BYTES:
            return oc
    return None


# The widest head dim (after padding) whose walk under segment ids runs the blocks the ids
# leave whole without comparing them: faster there, not at D = 256 (docs/history.md,
# session 26).
UNMASKED_SEGMENT_BLOCKS_MAX_HEAD_DIM = 128


def segment_inputs(segment_ids, grid: Grid, rows_cta: int, bkv: int, *, Tp: int, keys: int,
                   head_dim: int):
    """The kernel's segment inputs: q ids int32 [B, Tp] and kv ids int32 [B, keys] (padded:
    the padding rows' outputs are dropped and the padding keys masked by the key count),
    and each cluster's range of key blocks (`visibility.segment_block_ranges` over the
    rows of a cluster, [B, clusters along the queries, 2]; (0, 0) for clusters past T), up
    to `UNMASKED_SEGMENT_BLOCKS_MAX_HEAD_DIM` with the blocks the ids leave whole (4
    columns)."""
    rows = rows_cta * grid.q_extent // grid.n_q_clusters  # a cluster's rows
    ranges = segment_block_ranges(*(x.astype(jnp.int32) for x in segment_ids), block_m=rows,
                                  block_n=bkv,
                                  full=head_dim <= UNMASKED_SEGMENT_BLOCKS_MAX_HEAD_DIM)
    ranges = jnp.pad(ranges, ((0, 0), (0, grid.n_q_clusters - ranges.shape[1]), (0, 0)))
    return (*padded_ids(segment_ids, Tp, keys), ranges)
