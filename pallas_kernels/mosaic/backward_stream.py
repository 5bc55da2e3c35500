"""What the Mosaic backward kernels share (`backward.rows_backward`,
`backward_halves.halves_backward`): one CTA per block of keys of one KV head, whose producer
warpgroup streams the query blocks of the GQA group that see them through a ring of stages
(Q with its rows' lse and segment ids, dO with its rows' δ), and the launch with the float32
dQ buffer that the consumers' TMA reduce-adds fill.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat
from pallas_kernels.mosaic.common import WARPGROUPS, Walk, cdiv, compiler_params, padded_ids
from pallas_kernels.mosaic.config import Config
from pallas_kernels.visibility import q_walk, segment_block_ranges

K_TILES, KV_HEADS, BATCH = "ffpa_mosaic_k", "ffpa_mosaic_hk", "ffpa_mosaic_b"


@dataclasses.dataclass(frozen=True)
class Stream:
    """A backward launch's static shape: keys per CTA, query rows per step, query heads per
    KV head, stages of the ring, and whether segment ids come with the blocks."""

    block_k: int
    block_q: int
    group: int
    stages: int
    segments: bool

    @classmethod
    def of(cls, q, v, config: Config, *, block_k: int, prob: Walk, segment_ids) -> "Stream":
        stream = cls(block_k=block_k, block_q=config.block_q, group=q.shape[2] // v.shape[2],
                     stages=config.num_stages, segments=segment_ids is not None)
        assert stream.segments == prob.segments
        return stream

    def segment_inputs(self, segment_ids, rows: int, key_blocks: int) -> tuple:
        """(q ids padded to `rows`, kv ids padded to `key_blocks` blocks (`padded_ids`), each
        key block's range of query blocks [B, key_blocks, 2]), or () without segment ids."""
        if segment_ids is None:
            return ()
        q_ids, kv_ids = (x.astype(jnp.int32) for x in segment_ids)
        ranges = segment_block_ranges(kv_ids, q_ids, block_m=self.block_k,
                                      block_n=self.block_q)
        return (*padded_ids(segment_ids, rows, key_blocks * self.block_k), ranges)

    def row_scratch(self) -> tuple:
        """Shared memory the stream fills beside Q, dO, K and V: each stage's lse, δ (and
        rows' ids), the keys' ids, and the four barriers of `produce` (K and V landed; Q
        with lse and ids; dO with δ; a stage free again, by both consumers)."""
        ns, seg, bq = self.stages, self.segments, self.block_q
        return (plgpu.SMEM((ns, bq), jnp.float32),
                plgpu.SMEM((ns, bq), jnp.float32),
                plgpu.SMEM((ns, bq), jnp.int32) if seg else None,
                plgpu.SMEM((self.block_k,), jnp.int32) if seg else None,
                plgpu.Barrier(num_arrivals=2 + seg),
                plgpu.Barrier(num_arrivals=2 + seg, num_barriers=ns),
                plgpu.Barrier(num_arrivals=2, num_barriers=ns),
                plgpu.Barrier(num_arrivals=2, num_barriers=ns))


class Cta(NamedTuple):
    """Where a backward CTA stands: its warpgroup, batch row, KV head, first key, the walk
    (with the row's key length and segment range) and its query blocks [lo, hi) per head
    (`visibility.q_walk`)."""

    wg: Any
    b: Any
    hk: Any
    k0: Any
    walk: Walk
    blocks: tuple  # (lo, mask_lo, full_hi, hi)

    @property
    def count(self):
        """Steps per query head."""
        return self.blocks[3] - self.blocks[0]

    @classmethod
    def locate(cls, prob: Walk, stream: Stream, kvlen_ref, pos_ref, ranges_ref) -> "Cta":
        b = lax.axis_index(BATCH)
        kt = lax.axis_index(K_TILES)
        walk = prob.with_key_end(kvlen_ref, b).with_positions(pos_ref)
        walk = walk.with_segment_range(ranges_ref, b, kt)
        k0 = kt * stream.block_k
        return cls(lax.axis_index(WARPGROUPS), b, lax.axis_index(KV_HEADS), k0, walk,
                   q_walk(walk, k0, k0 + stream.block_k - 1, stream.block_q))


def produce(stream: Stream, cta: Cta, refs: tuple, tiles: tuple, row_scratch: tuple,
            registers: int):
    """The producer warpgroup (`registers` each): K and V (and the keys' ids) once, then for
    step n (query block j of head g of the group) Q, lse (and the rows' ids) into stage
    n % stages, then dO and δ, each stage once both consumers freed it. `refs` as `launch`
    gives them, `tiles` = (K, V, Q stages, dO stages), `row_scratch` the refs of
    `Stream.row_scratch`."""
    plgpu.set_max_registers(registers, action="decrease")
    q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, _, (qid_ref, kid_ref, _) = refs[:8]
    k_smem, v_smem, q_smem, do_smem = tiles
    lse_smem, delta_smem, qid_smem, kid_smem, kv_bar, q_full, do_full, free = row_scratch
    b, hk, count, lo = cta.b, cta.hk, cta.count, cta.blocks[0]
    keys = pl.ds(cta.k0, stream.block_k)
    plgpu.copy_gmem_to_smem(k_ref.at[b, keys, hk], k_smem, kv_bar)
    plgpu.copy_gmem_to_smem(v_ref.at[b, keys, hk], v_smem, kv_bar)
    if stream.segments:
        plgpu.copy_gmem_to_smem(kid_ref.at[b, keys], kid_smem, kv_bar)

    @pl.loop(0, stream.group * count)
    def _load(n):
        g = lax.div(n, jnp.maximum(count, 1))
        j = lo + n - g * count
        h = hk * stream.group + g
        slot = lax.rem(n, stream.stages)
        rows = pl.ds(j * stream.block_q, stream.block_q)

        @pl.when(n >= stream.stages)
        def _():
            plgpu.barrier_wait(free.at[slot])

        plgpu.copy_gmem_to_smem(q_ref.at[b, rows, h], q_smem.at[slot], q_full.at[slot])
        plgpu.copy_gmem_to_smem(lse_ref.at[b, h, rows], lse_smem.at[slot], q_full.at[slot])
        if stream.segments:
            plgpu.copy_gmem_to_smem(qid_ref.at[b, rows], qid_smem.at[slot], q_full.at[slot])
        plgpu.copy_gmem_to_smem(do_ref.at[b, rows, h], do_smem.at[slot], do_full.at[slot])
        plgpu.copy_gmem_to_smem(delta_ref.at[b, h, rows], delta_smem.at[slot],
                                do_full.at[slot])


def launch(kernel, scratch: tuple, arrays: tuple, stream: Stream, *, prob: Walk,
           config: Config, kv_lengths=None, segment_ids=None, positions=None):
    """(dq float32 [B, Tp, Hq, D], dk, dv) of `kernel(cta, refs, scoped)` on the grid (KV
    heads, key blocks, batch) with three warpgroups; refs = (q, k, v, do, lse, δ, key
    lengths or None, (q ids, kv ids, ranges) or Nones, dq buffer, dk, dv), `scoped` the
    shared memory of `scratch`, `cta` where the CTA stands (`Cta.locate`). `arrays` = (q, k,
    v, do, lse2, δ) as the kernels take them; `segment_ids` None or (q ids, kv ids)."""
    q, k, v = arrays[:3]
    B, _, Hq, D = q.shape
    _, S8, Hkv, Dv = v.shape
    Tp = arrays[4].shape[-1]
    n_kt = cdiv(S8, stream.block_k)
    segments = stream.segment_inputs(segment_ids, rows=Tp, key_blocks=n_kt)

    def entry(*refs):
        refs = list(refs)
        kvlen = refs.pop(6) if kv_lengths is not None else None
        pos = refs.pop(6) if positions is not None else None
        seg = tuple(refs.pop(6) for _ in range(3)) if segments else (None,) * 3
        refs = (*refs[:6], kvlen, seg, *refs[6:])
        cta = Cta.locate(prob, stream, kvlen, pos, seg[2])
        pl.run_scoped(lambda *scoped: kernel(cta, refs, scoped), *scratch,
                      collective_axes=WARPGROUPS)

    mesh = plgpu.Mesh(grid=(Hkv, n_kt, B), grid_names=(KV_HEADS, K_TILES, BATCH),
                      num_threads=3, thread_name=WARPGROUPS)
    # Inside a shard_map that checks varying manual axes, this launch (unlike the forward's
    # `plgpu.kernel`) takes its outputs' types as declared: they vary as q does. It takes no
    # varying ref: the dQ accumulator stays typed alike on every shard (the caller's
    # `vary_like` types what it read out of it).
    inputs = (*arrays, *(() if kv_lengths is None else (kv_lengths,)),
              *(() if positions is None else (positions,)), *segments)
    inputs = tuple(compat.vary_like(x, q) for x in inputs)
    dq_acc = jax.new_ref(jnp.zeros((B, Tp, Hq, D), jnp.float32))
    dk, dv = pl.kernel(
        entry,
        out_type=(compat.output_struct((B, S8, Hkv, D), q.dtype, q),
                  compat.output_struct((B, S8, Hkv, Dv), q.dtype, q)),
        mesh=mesh,
        compiler_params=compiler_params(config),
    )(*inputs, dq_acc)
    return dq_acc[...], dk, dv
