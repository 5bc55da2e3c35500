"""What the Mosaic GPU kernels share: layouts, shared-memory tiles, the key-block walk
(`Walk`, `kv_range`: which key blocks a group of query rows visits, which of them need a
mask), the element-wise score step (`score_mod`), the online softmax, the epilogue's
normalisation, and the launch grid with its clusters (`Grid`).

Where more semantics go: `score_mod` is the one element-wise hook (a bias, a soft cap, a
window or segment comparison would be applied there); `kv_range` is the one place that
decides which key blocks a group of rows walks (a window or segment bounds would narrow it).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import compat
from pallas_kernels.mosaic.config import Config

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")

# The kernels' own axis names (grid, cluster, warpgroups). Mosaic GPU resolves a JAX mesh
# axis of the same name first, inside a shard_map: the index would then be the device's, and
# every device would compute one batch row for all of its own. So they carry a prefix no
# user's mesh axis is likely to have.
Q_TILES, HEADS, BATCH = "ffpa_mosaic_q", "ffpa_mosaic_h", "ffpa_mosaic_b"
CLUSTER, WARPGROUPS = "ffpa_mosaic_cl", "ffpa_mosaic_wg"

WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)


def load_rows(ref):
    """Loads a [64] float32 SMEM vector in the WGMMA row layout."""
    return compat.mosaic_load(ref, layout=ROW)


def smem_transforms(minor: int, dtype):
    """Tiling + swizzle transforms for a 2D SMEM tile with `minor` columns."""
    itemsize = jnp.dtype(dtype).itemsize
    swz = min(128, minor * itemsize)
    if swz not in (32, 64, 128):
        raise ValueError(f"unsupported minor size {minor} for {dtype}")
    return (plgpu.TilingTransform((8, swz // itemsize)), plgpu.SwizzleTransform(swz))


def tiled_smem(shape, dtype):
    return plgpu.SMEM(shape, dtype, transforms=smem_transforms(shape[-1], dtype))


def cdiv(a, b):
    """Ceil division for non-negative traced or static integers."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return lax.div(a + (b - 1), jnp.int32(b))


def imin(a, b):
    """min() that stays a Python int when both operands are static."""
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return jnp.minimum(a, b)


def iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)


@dataclasses.dataclass(frozen=True)
class Walk:
    T: int
    S: int
    causal: bool
    block_kv: int

    @property
    def num_kv_blocks(self):
        return cdiv(self.S, self.block_kv)


def kv_range(p: Walk, q_first, q_last):
    """Key blocks walked by query rows [q_first, q_last] (q_last clipped to T-1).

    Returns (lo, full_hi, hi): blocks [lo, full_hi) need no mask at all (every key
    is visible to every row of the group), blocks [full_hi, hi) go through
    `score_mod`, blocks >= hi are fully hidden and skipped.  A sliding window /
    segment bounds would raise `lo` and lower `hi`/`full_hi` here.
    """
    bkv = p.block_kv
    lo = 0
    hi = p.num_kv_blocks
    full_hi = p.S // bkv
    if not p.causal:
        # Static Python ints: the key loops get compile-time trip counts.
        return lo, full_hi, hi
    if p.causal:
        off = p.S - p.T
        # Keys visible to the last row: [0, q_last + off].
        hi = jnp.minimum(hi, cdiv(jnp.maximum(q_last + off + 1, 0), bkv))
        # Keys visible to every row (the first row of the group): [0, q_first + off].
        full_hi = jnp.minimum(full_hi, lax.div(jnp.maximum(q_first + off + 1, 0), jnp.int32(bkv)))
    full_hi = jnp.clip(full_hi, lo, hi)
    return lo, full_hi, hi


def kv_order(lo, full, tc, n_qc: int, enabled: bool):
    """Maps a walk position i in [lo, hi) to the key block it processes.

    Positions below `full` (blocks fully visible to every row of the CTA /
    cluster) are rotated by an offset spread evenly over the query-tile clusters;
    the online softmax does not depend on the order.  Positions >= full (blocks
    that need `score_mod`) keep their natural order.  Producer and consumers
    use the same map, so ring slots stay in sequence order.
    """
    if not enabled:
        return lambda i: i
    n_full = jnp.maximum(full - lo, 1)
    rot = lax.div(tc * n_full, jnp.int32(n_qc))

    def kv_of(i):
        return jnp.where(i < full, lo + lax.rem(i - lo + rot, n_full), i)

    return kv_of


def score_mod(p: Walk, s, q_idx, k_idx):
    """Element-wise hook on raw scores s = q.k (float32, WGMMA layout).

    q_idx / k_idx are absolute query / key indices (int32, same layout).  Masked
    entries become -inf.  A bias would be added here, a soft cap applied here, a
    window / segment-id comparison AND-ed into `visible` here.
    """
    visible = k_idx < p.S
    if p.causal:
        visible = visible & (k_idx <= q_idx + (p.S - p.T))
    return jnp.where(visible, s, NEG_INF)


def softmax_update(s, m_i, l_i, c, *, guard):
    """One online-softmax step in log2 units.

    s: raw scores (masked entries -inf); m_i: running max of c*s; c = scale*log2e.
    Returns (p (f32), alpha, m_new, l_partial_sum_of_p).
    guard: rows whose scores are all -inf so far keep m = -inf without NaNs.
    """
    m_blk = s.max(axis=1) * c
    m_new = jnp.maximum(m_i, m_blk)
    m_use = jnp.where(m_new == NEG_INF, 0.0, m_new) if guard else m_new
    alpha = jnp.exp2(m_i - m_use)
    p = jnp.exp2(s * c - lax.broadcast_in_dim(m_use, s.shape, [0]))
    return p, alpha, m_new


def finalize(acc_list, m_i, l_i):
    """Normalises the accumulators and computes lse (natural log)."""
    empty = l_i == 0.0
    inv = 1.0 / jnp.where(empty, 1.0, l_i)
    outs = [a * lax.broadcast_in_dim(inv, a.shape, [0]) for a in acc_list]
    lse = jnp.where(empty, NEG_INF, m_i * LN2 + jnp.log(jnp.where(empty, 1.0, l_i)))
    return outs, lse


@dataclasses.dataclass(frozen=True)
class Grid:
    n_q: int  # query tiles
    Hq: int
    B: int
    group: int
    ncl: int
    cluster_axis: str
    grid_order: str
    reverse: bool

    @classmethod
    def of(cls, config: Config, *, n_q: int, Hq: int, B: int, group: int, causal: bool):
        """The grid of `n_q` query tiles of every (query head, batch), with `config`'s
        clusters, order and (causal) heaviest-first walk."""
        return cls(n_q=n_q, Hq=Hq, B=B, group=group, ncl=config.cluster,
                   cluster_axis=config.cluster_axis, grid_order=config.grid_order,
                   reverse=causal and config.reverse_causal)

    def __post_init__(self):
        if self.ncl > 1 and self.cluster_axis == "heads" and self.group % self.ncl:
            raise ValueError(
                f"cluster={self.ncl} along heads needs (Hq//Hkv)={self.group} "
                "to be a multiple of it"
            )

    @property
    def q_extent(self):  # query tiles padded to a multiple of the q-cluster
        if self.cluster_axis == "q":
            return cdiv(self.n_q, self.ncl) * self.ncl
        return self.n_q

    @property
    def n_q_clusters(self):
        return self.q_extent // (self.ncl if (self.ncl > 1 and self.cluster_axis == "q") else 1)

    def kernel_kwargs(self):
        nq, nh = self.q_extent, self.Hq
        if self.ncl > 1:
            if self.cluster_axis == "q":
                nq //= self.ncl
            else:
                nh //= self.ncl
        dims = {Q_TILES: nq, HEADS: nh, BATCH: self.B}
        order = ((Q_TILES, HEADS, BATCH) if self.grid_order == "q" else
                 (HEADS, Q_TILES, BATCH))
        kw = dict(grid=tuple(dims[n] for n in order), grid_names=order)
        if self.ncl > 1:
            ax = Q_TILES if self.cluster_axis == "q" else HEADS
            pos = order.index(ax)
            cluster = [1] * (pos + 1)
            cluster[pos] = self.ncl
            names = [f"{CLUSTER}{i}" for i in range(pos)] + [CLUSTER]
            kw.update(cluster=tuple(cluster), cluster_names=tuple(names))
        return kw

    def indices(self):
        """(q tile, q head, batch, first q tile of the cluster, #q tiles in it)."""
        t = lax.axis_index(Q_TILES)
        h = lax.axis_index(HEADS)
        b = lax.axis_index(BATCH)
        nq = self.q_extent // (self.ncl if (self.ncl > 1 and self.cluster_axis == "q") else 1)
        if self.reverse:
            t = (nq - 1) - t
        if self.ncl > 1 and self.cluster_axis == "q":
            return t * self.ncl + lax.axis_index(CLUSTER), h, b, t * self.ncl, self.ncl
        if self.ncl > 1:
            h = h * self.ncl + lax.axis_index(CLUSTER)
        return t, h, b, t, 1


def cluster_walk(p: Walk, grid: "Grid", t_first, t_count, rows: int, kv_rotate: bool):
    """(lo, full_hi, hi, kv_of) of the key blocks a cluster walks: `kv_range` over the rows
    of all its CTAs (query tiles t_first.. of `rows` rows; multicast needs every CTA to load
    the same tiles), and the walk's order (`kv_order`)."""
    first = t_first * rows
    last = jnp.minimum(first + t_count * rows - 1, p.T - 1)
    lo, full_hi, hi = kv_range(p, first, last)
    kv_of = kv_order(lo, full_hi, lax.div(t_first, jnp.int32(t_count)), grid.n_q_clusters,
                     kv_rotate)
    return lo, full_hi, hi, kv_of


def walk_kv(step, carry, lo, full_hi, hi):
    """`step(j, carry, masked=...)` over the key blocks [lo, full_hi) without the element
    masks, then over [full_hi, hi) with them (`kv_range`'s split)."""
    carry = lax.fori_loop(lo, full_hi, functools.partial(step, masked=False), carry)
    return lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)


def launch(entry, grid: Grid, config: Config, q, k, v, *, out_dtype, lse_rows: int):
    """`entry` run by a producer and two consumer warpgroups over `grid`: (out
    [B, Tq, Hq, Dv] in `out_dtype`, lse [B, Hq, lse_rows] float32)."""
    B, Tq, Hq, _ = q.shape
    Dv = v.shape[3]
    outputs = plgpu.kernel(
        entry,
        out_type=(
            jax.ShapeDtypeStruct((B, Tq, Hq, Dv), out_dtype),
            jax.ShapeDtypeStruct((B, Hq, lse_rows), jnp.float32),
        ),
        num_threads=3,
        thread_name=WARPGROUPS,
        compiler_params=compiler_params(config),
        **grid.kernel_kwargs(),
    )(q, k, v)
    # Mosaic GPU traces its kernels with JAX's check of varying manual axes off, so their
    # outputs come out typed alike on every shard of a shard_map. Typed so, a differentiated
    # call's output would have its cotangent summed over the shards: they vary as q does.
    return tuple(compat.vary_like(x, q) for x in outputs)


def compiler_params(config: Config):
    sem = (
        plgpu.LoweringSemantics.Warpgroup
        if config.lowering == "warpgroup"
        else plgpu.LoweringSemantics.Lane
    )
    # Row reductions of WGMMA-layout tiles stay inside a warp (no cross-warp
    # scratch needed); the 2 KiB default would cost one pipeline stage at D=128.
    return plgpu.CompilerParams(approx_math=True, lowering_semantics=sem, reduction_scratch_bytes=0)
