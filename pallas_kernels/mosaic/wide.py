"""The "wide" kernel (D or Dv > 256, e.g. 512): the 64 x Dv float32 accumulator does not fit
one warpgroup's registers, so the two consumer warpgroups share the same 64 query rows and
split the work: S = Q Kᵀ is split by key columns (each warpgroup computes 64 x block_kv/2),
the row maxima are exchanged through shared memory so both use the same running max, each
warpgroup publishes its half of P in shared memory, and O is split by Dv halves (each
warpgroup owns a 64 x Dv/2 accumulator, computing P_own V (P from registers) + P_other V
(P from smem)). K/V tiles go through one ring of uniform slots [2, block_kv, W]
(W = config.wide_piece; a K slot holds 2W columns of the head dim, a V slot holds W columns
of each Dv half). A call that returns lse (`Config.precise_lse`) gives each K tile its own
accumulation chain and sums the tiles' scores in float32, which keeps lse within XLA's error
at a cost in registers and speed.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic.common import (CLUSTER, LOG2E, NEG_INF, ROW, WARPGROUPS, WGMMA, Grid,
                                          Walk, cdiv, cluster_walk, consumer_walk, finalize, iota,
                                          launch, load_rows, opaque_zero, score_mod, soft_cap,
                                          tiled_smem, walk_kv)
from pallas_kernels.mosaic.config import Config


def wide_forward(q, k, v, prob: Walk, *, config: Config, out_dtype, kv_lengths=None,
                 positions=None):
    B, Tq, Hq, D = q.shape  # D multiple of 256; Tq = T rounded up to 8
    _, _, Hkv, Dv = v.shape  # Dv multiple of 256
    dtype = q.dtype
    group = Hq // Hkv
    bq = 64
    bkv = config.block_kv
    hk_cols = bkv // 2  # key columns per warpgroup
    ns = config.num_stages
    ncl = config.cluster
    T = prob.T
    assert prob.block_kv == bkv
    if config.persistent:
        raise ValueError("persistent: the rows kernel only (D, Dv <= 256)")
    c_exp = prob.scale * LOG2E
    _W = config.wide_piece  # columns of one ring piece
    eager = config.wide_eager_release
    precise_lse = config.precise_lse
    # Each K tile's wgmmas awaited and its slot released at once: the eager release, and
    # the chains of a precise lse (each read before the next starts).
    release_each_k = eager or precise_lse
    if bkv < 128:
        raise ValueError("the wide kernel needs block_kv >= 128 (64 key columns per warpgroup)")
    nK = D // (2 * _W)  # K tiles per step (each: 2 pieces of 128 head-dim columns)
    dvh = Dv // 2  # Dv per warpgroup
    nV = dvh // _W  # V tiles per step (each: 128 columns of each half)
    tiles = nK + nV
    grid = Grid.of(config, n_q=cdiv(T, bq), Hq=Hq, B=B, group=group, causal=prob.causal)
    Tp = grid.q_extent * bq
    oc = min(config.out_chunk or _W, _W)
    assert dvh % oc == 0

    def kernel(q_ref, k_ref, v_ref, kvlen_ref, pos_ref, o_ref, lse_ref, scoped):
        (
            (q_smem, o_smem),
            ring,
            p_smem,
            m_smem,
            lse_smem,
            q_bar,
            full,
            free,
            m_ready,
            p_ready,
            exit_bar,
        ) = scoped
        wg = lax.axis_index(WARPGROUPS)
        other = 1 - wg
        t, h, b, t_first, t_count = grid.indices()
        # the batch row's key length and the block's place, if given
        walk = prob.with_key_end(kvlen_ref, b).with_positions(pos_ref)
        hk = lax.div(h, jnp.int32(group))
        lo, hi, kv_of = cluster_walk(walk, grid, t_first, t_count, bq,
                                              config.kv_rotate)
        q0 = t * bq
        collective = CLUSTER if ncl > 1 else None

        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(config.consumer_regs, action="increase")

            @pl.when(wg == 0)
            def _():
                plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(q0, bq), h], q_smem.at[0], q_bar)

            q_last = jnp.minimum(q0 + bq - 1, T - 1)
            mask_lo, full_hi, my_hi = consumer_walk(walk, lo, q0, q_last,
                                                    padding_rows=grid.q_extent * bq - bq >= T)

            m_i = plgpu.layout_cast(jnp.full((bq,), NEG_INF, jnp.float32), ROW)
            l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), ROW)
            accs = tuple(
                plgpu.layout_cast(jnp.zeros((bq, _W), jnp.float32), WGMMA) for _ in range(nV)
            )
            plgpu.barrier_wait(q_bar)
            my_rows = pl.ds(wg * hk_cols, hk_cols)
            other_rows = pl.ds(other * hk_cols, hk_cols)

            def step(j, carry, *, masked):
                accs, m_i, l_i = carry
                base = (j - lo) * tiles

                # ---- S_own = Q K[own key columns]^T, accumulated over K tiles.
                # Q's 32 descriptors made at each step, not held (`opaque_zero`).
                q_now = q_smem.at[opaque_zero(j)]

                def qk(kts, s_ref):
                    for kt in kts:
                        slot = lax.rem(base + kt, ns)
                        plgpu.barrier_wait(full.at[slot])
                        for pc in range(2):
                            col = (2 * kt + pc) * _W
                            plgpu.wgmma(
                                s_ref,
                                q_now.at[:, pl.ds(col, _W)],
                                ring.at[slot, pc, my_rows].transpose((1, 0)),
                            )
                        if release_each_k:
                            plgpu.wgmma_wait(0)
                            plgpu.barrier_arrive(free.at[slot])
                        elif kt:
                            plgpu.wgmma_wait(2)
                            plgpu.barrier_arrive(free.at[lax.rem(base + kt - 1, ns)])
                    return s_ref[...]

                # A returned lse takes one accumulation chain per K tile, the tiles' scores
                # summed in float32: one chain over D = 512 gave lse several times XLA's
                # error (docs/history.md, session 36), and this costs registers and speed.
                chains = [(kt,) for kt in range(nK)] if precise_lse else [tuple(range(nK))]
                s = None
                for kts in chains:
                    part = pl.run_scoped(functools.partial(qk, kts),
                                         plgpu.ACC((bq, hk_cols), jnp.float32))
                    s = part if s is None else s + part
                if not release_each_k:
                    plgpu.barrier_arrive(free.at[lax.rem(base + nK - 1, ns)])
                s = soft_cap(walk, s)
                if masked:
                    q_idx = q0 + iota((bq, hk_cols), 0)
                    k_idx = kv_of(j) * bkv + wg * hk_cols + iota((bq, hk_cols), 1)
                    s = score_mod(walk, s, q_idx, k_idx)

                # ---- exchange the row maxima so both halves use the same max.
                m_loc = s.max(axis=1) * c_exp
                m_smem.at[wg][...] = m_loc
                plgpu.barrier_arrive(m_ready.at[wg])
                plgpu.barrier_wait(m_ready.at[other])
                m_oth = load_rows(m_smem.at[other])
                m_new = jnp.maximum(m_i, jnp.maximum(m_loc, m_oth))
                m_use = jnp.where(m_new == NEG_INF, 0.0, m_new) if masked else m_new
                alpha = jnp.exp2(m_i - m_use)
                p = jnp.exp2(s * c_exp - lax.broadcast_in_dim(m_use, s.shape, [0]))
                p16 = p.astype(dtype)
                # ---- publish our half of P for the other warpgroup.
                p_smem.at[wg][...] = p16
                plgpu.commit_smem()
                plgpu.barrier_arrive(p_ready.at[wg])
                l_i = l_i * alpha + p.sum(axis=1)
                accs = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [0]) for a in accs)

                # ---- O_half += P_own V[own keys, half] + P_other V[other keys, half]
                def pv(acc_refs):
                    for vt in range(nV):
                        slot = lax.rem(base + nK + vt, ns)
                        plgpu.barrier_wait(full.at[slot])
                        piece = ring.at[slot, wg]
                        plgpu.wgmma(acc_refs[vt], p16, piece.at[my_rows])
                        if vt == 0:
                            plgpu.barrier_wait(p_ready.at[other])
                        plgpu.wgmma(acc_refs[vt], p_smem.at[other], piece.at[other_rows])
                        if eager:
                            plgpu.wgmma_wait(0)
                            plgpu.barrier_arrive(free.at[slot])
                        elif vt:
                            plgpu.wgmma_wait(2)
                            plgpu.barrier_arrive(free.at[lax.rem(base + nK + vt - 1, ns)])

                accs = pl.run_state(pv)(tuple(plgpu.ACC.init(a) for a in accs))
                if not eager:
                    plgpu.barrier_arrive(free.at[lax.rem(base + tiles - 1, ns)])
                return accs, m_new, l_i

            accs, m_i, l_i = walk_kv(step, (accs, m_i, l_i), lo, mask_lo, full_hi, my_hi)

            # Tiles loaded for the rest of the cluster but hidden for our rows.
            @pl.loop(my_hi, hi)
            def _skip(j):
                base = (j - lo) * tiles
                for i in range(tiles):
                    slot = lax.rem(base + i, ns)
                    plgpu.barrier_wait(full.at[slot])
                    plgpu.barrier_arrive(free.at[slot])

            # ---- combine the two partial row sums.
            m_smem.at[wg][...] = l_i
            plgpu.barrier_arrive(m_ready.at[wg])
            plgpu.barrier_wait(m_ready.at[other])
            l_i = l_i + load_rows(m_smem.at[other])
            outs, lse = finalize(list(accs), m_i, l_i)

            @pl.when(wg == 0)
            def _():
                lse_smem[...] = lse
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[b, h, pl.ds(q0, bq)])

            my_o = o_smem.at[wg]
            per = _W // oc
            for ci in range(dvh // oc):
                if ci:
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                chunk = outs[ci // per][:, (ci % per) * oc : (ci % per + 1) * oc]
                my_o[...] = chunk.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    my_o, o_ref.at[b, pl.ds(q0, bq), h, pl.ds(wg * dvh + ci * oc, oc)]
                )
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            if ncl > 1:
                plgpu.barrier_arrive(exit_bar)
                plgpu.barrier_wait(exit_bar)

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(config.producer_regs, action="decrease")

            @pl.loop(lo, hi)
            def _load(j):
                base = (j - lo) * tiles
                kv_rows = pl.ds(kv_of(j) * bkv, bkv)
                for i in range(tiles):
                    n = base + i
                    slot = lax.rem(n, ns)

                    @pl.when(n >= ns)
                    def _():
                        plgpu.barrier_wait(free.at[slot])

                    for pc in range(2):
                        if i < nK:
                            src = k_ref.at[b, kv_rows, hk, pl.ds((2 * i + pc) * _W, _W)]
                        else:
                            col = pc * dvh + (i - nK) * _W
                            src = v_ref.at[b, kv_rows, hk, pl.ds(col, _W)]
                        plgpu.copy_gmem_to_smem(
                            src, ring.at[slot, pc], full.at[slot], collective_axes=collective
                        )

    def entry(q_ref, k_ref, v_ref, *refs):
        refs = list(refs)
        kvlen_ref = refs.pop(0) if kv_lengths is not None else None
        pos_ref = refs.pop(0) if positions is not None else None
        o_ref, lse_ref = refs
        if ncl > 1:
            free = plgpu.ClusterBarrier(collective_axes=(CLUSTER,), num_arrivals=2, num_barriers=ns)
            exit_bar = plgpu.ClusterBarrier(collective_axes=(CLUSTER,), num_arrivals=2)
        else:
            free = plgpu.Barrier(num_arrivals=2, num_barriers=ns)
            exit_bar = None
        pl.run_scoped(
            lambda *args: kernel(q_ref, k_ref, v_ref, kvlen_ref, pos_ref, o_ref, lse_ref, args),
            plgpu.RefUnion(tiled_smem((1, bq, D), dtype), tiled_smem((2, bq, oc), out_dtype)),
            tiled_smem((ns, 2, bkv, _W), dtype),
            tiled_smem((2, bq, hk_cols), dtype),
            plgpu.SMEM((2, bq), jnp.float32),
            plgpu.SMEM((bq,), jnp.float32),
            plgpu.Barrier(),
            plgpu.Barrier(num_arrivals=2, num_barriers=ns),
            free,
            plgpu.Barrier(num_barriers=2),
            plgpu.Barrier(num_barriers=2),
            exit_bar,
            collective_axes=WARPGROUPS,
        )

    inputs = (q, k, v, *(() if kv_lengths is None else (kv_lengths,)),
              *(() if positions is None else (positions,)))
    return launch(entry, grid, config, inputs, out_dtype=out_dtype, lse_rows=Tp)

