"""What the Mosaic GPU kernels share: layouts, shared-memory tiles, the walk's record
(`Walk`: `pallas_kernels.visibility.BlockWalk` with the soft cap), the element-wise score
steps (`soft_cap`, `score_mod`), the online softmax, the epilogue's normalisation, and the
launch grid with its clusters (`Grid`).

Where more semantics go: `score_mod` is the one element-wise mask hook (the rules of
`pallas_kernels.visibility` for causality, the window, key lengths and the segment ids'
comparison; a bias would be added there); `visibility.kv_walk` (and `visibility.q_walk`,
the backward's) decides which blocks a group of rows (keys) walks: the window, lengths and
the segments' block ranges narrow it.
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
from pallas_kernels.visibility import BlockWalk, kv_walk, sees_causal
from pallas_kernels.visibility import div_up as cdiv

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
NEG_INF = float("-inf")

# The kernels' own axis names (grid, cluster, warpgroups). Mosaic GPU resolves a JAX mesh
# axis of the same name first, inside a shard_map: the index would then be the device's, and
# every device would compute one batch row for all of its own. So they carry a prefix no
# user's mesh axis is likely to have.
Q_TILES, HEADS, BATCH = "ffpa_mosaic_q", "ffpa_mosaic_h", "ffpa_mosaic_b"
CLUSTER, WARPGROUPS = "ffpa_mosaic_cl", "ffpa_mosaic_wg"
PERSISTENT = "ffpa_mosaic_sm"  # a persistent launch's one grid axis
# By levels (`Grid.levels`), a persistent launch takes its query tiles in groups of
# ceil(LEVEL_SHARING · heads / CTAs) neighbouring tiles of each (batch, head cluster), so
# that a round's CTAs share each head's K/V reads in L2 (with one tile of every head per
# level, a round of B·H >= 128 heads streamed every head's K/V from memory; 8 measured
# against 4: docs/history.md, session 27).
LEVEL_SHARING = 8

# Multiprocessors of an H100 / H200 (SXM): the persistent launch's size where JAX cannot
# tell (lowering for CUDA on a machine without a GPU).
HOPPER_MULTIPROCESSORS = 132


def multiprocessors() -> int:
    """This process's first device's multiprocessor count, for a persistent launch (a local
    device: under `jax.distributed` the first global one may be another host's)."""
    device = jax.local_devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else HOPPER_MULTIPROCESSORS

WGMMA = plgpu.Layout.WGMMA
ROW = plgpu.Layout.WGMMA.reduce(1)  # a vector along a tile's rows
COLUMNS = plgpu.Layout.WGMMA.reduce(0)  # a vector along a tile's columns


def load_rows(ref):
    """Loads a [64] float32 SMEM vector in the WGMMA row layout."""
    return compat.mosaic_load(ref, layout=ROW)


def smem_transforms(minor: int, dtype, swizzle: int = 128):
    """Tiling + swizzle transforms for a 2D SMEM tile with `minor` columns (a narrower
    `swizzle` makes column slices of that many bytes whole tiles)."""
    itemsize = jnp.dtype(dtype).itemsize
    swz = min(swizzle, minor * itemsize)
    if swz not in (32, 64, 128):
        raise ValueError(f"unsupported minor size {minor} for {dtype}")
    return (plgpu.TilingTransform((8, swz // itemsize)), plgpu.SwizzleTransform(swz))


def tiled_smem(shape, dtype, swizzle: int = 128):
    return plgpu.SMEM(shape, dtype, transforms=smem_transforms(shape[-1], dtype, swizzle))


def imin(a, b):
    """min() that stays a Python int when both operands are static."""
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return jnp.minimum(a, b)


def opaque_zero(j):
    """0, computed from the loop index `j` through an optimization barrier (an empty inline asm
    in Mosaic GPU) that LLVM can neither fold nor move out of the loop.

    A shared-memory buffer read by wgmmas at every step of a loop over `j` is at the same
    place each step, so LLVM makes its wgmma descriptors (64 bits each, one per wgmma) once
    before the loop and holds them in registers through it; beside the accumulators they
    spilled (docs/history.md, sessions 34 and 35). Such a buffer is declared with a leading
    axis of 1 and read through `buffer.at[opaque_zero(j)]`, which makes each descriptor
    again next to its wgmma."""
    return lax.optimization_barrier(j) - j


def iota(shape, dim):
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=WGMMA)


def same_segment(row_ids, col_ids, shape):
    """bool `shape` (WGMMA layout): whether the segment id of a tile's row (`row_ids`, [rows]
    in `ROW`) equals its column's (`col_ids`, [cols] in `COLUMNS`)."""
    return (lax.broadcast_in_dim(row_ids, shape, [0])
            == lax.broadcast_in_dim(col_ids, shape, [1]))


@dataclasses.dataclass(frozen=True)
class Walk(BlockWalk):
    """A kernel's `visibility.BlockWalk` (which blocks a group of rows walks), with what
    decides what the visible scores become: the logit soft cap and its scale (the softmax
    scale, which the cap's tanh takes inside)."""

    softcap: float | None = None
    scale: float = 1.0

    def with_segment_range(self, ranges_ref, b, tile):
        """This walk bounded by the block range of `tile` of batch row `b` (`ranges_ref`:
        int32 [B, tiles, 2 or 4] in global memory, `visibility.segment_block_ranges`, with
        the blocks the ids leave whole where it has 4 columns; None: no segment ids)."""
        if ranges_ref is None:
            return self
        if ranges_ref.shape[-1] == 4:
            return dataclasses.replace(
                self, segment_range=(ranges_ref[b, tile, 0], ranges_ref[b, tile, 1]),
                segment_full=(ranges_ref[b, tile, 2], ranges_ref[b, tile, 3]))
        return dataclasses.replace(self, segment_range=(ranges_ref[b, tile, 0],
                                                        ranges_ref[b, tile, 1]))

    def with_positions(self, positions_ref):
        """This walk for a block of a longer sequence (`positions_ref`: int32 [3] (row0,
        col0, shift) in global memory, `FeatureArrays.positions`; None: not a block):
        causality and the window take the block's runtime shift."""
        if positions_ref is None:
            return self
        return dataclasses.replace(self, row_shift=positions_ref[2])

    def with_key_end(self, lengths_ref, b):
        """This walk for batch row `b` of a call with key lengths (`lengths_ref`: int32 [B]
        in global memory, or None)."""
        if lengths_ref is None:
            return self
        return dataclasses.replace(self, key_end=jnp.clip(lengths_ref[b], 0, self.S))


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


def soft_cap(p: Walk, s):
    """Raw scores s = q.k (float32) under the logit soft cap c: the logits scale·s become
    c·tanh(scale·s / c), returned in raw units (divided by the scale again) so that the
    softmax's one multiply by scale·log2(e) stays as it is. tanh(x) = 1 - 2 / (1 + e^(2x)),
    the reciprocal as rsqrt squared: under the kernels' `approx_math` that is ex2.approx and
    rsqrt.approx with multiplies (relative error about 2^-22 each), where a division would be
    an exact one (arith.divf: a dozen instructions per score). e^(2x) overflowing to inf gives
    tanh = 1; rows whose scores all get masked afterwards are unaffected. (tanh.approx.f32,
    one instruction, missed the tolerance rule on lse: docs/history.md, session 20.)"""
    if p.softcap is None:
        return s
    x = s * (p.scale / p.softcap)
    root = lax.rsqrt(jnp.exp2(x * (2.0 * LOG2E)) + 1.0)
    tanh = 1.0 - 2.0 * (root * root)
    return tanh * (p.softcap / p.scale)


def soft_cap_grad(p: Walk, capped):
    """d(capped)/d(raw) of `soft_cap`'s scores (the backward's factor on dS): 1 - tanh²,
    tanh = scale·capped / cap, taken before a mask turns hidden scores to -inf; None
    without a cap."""
    if p.softcap is None:
        return None
    tanh = capped * (p.scale / p.softcap)
    return 1.0 - tanh * tanh


def padded_ids(segment_ids, rows: int, keys: int):
    """(q ids int32 [B, rows], kv ids int32 [B, keys]): the segment ids padded to the
    kernels' tiles (padding rows' results are dropped, padding keys masked by the key count,
    so the pads' ids do not matter)."""
    q_ids, kv_ids = (x.astype(jnp.int32) for x in segment_ids)
    return (jnp.pad(q_ids, ((0, 0), (0, rows - q_ids.shape[1]))),
            jnp.pad(kv_ids, ((0, 0), (0, keys - kv_ids.shape[1]))))


def score_mod(p: Walk, s, q_idx, k_idx, same=None):
    """Element-wise hook on scores (float32, WGMMA layout, soft-capped already): keys a row
    does not see become -inf, by the rule of `pallas_kernels.visibility` (the key's end or
    the row's key length, causality, the window, and `same`: whether the row's and the
    key's segment ids are equal, where segment ids are given).

    q_idx / k_idx are absolute query / key indices (int32, same layout).  A bias would be
    added here.
    """
    visible = k_idx < p.keys
    if same is not None:
        visible = visible & same
    if p.causal:
        visible = visible & sees_causal(q_idx, k_idx, p.shift)
    if p.window is not None:
        # `visibility.sees_window`, its two bounds ANDed into the mask one at a time (the
        # order of operations the kernels were checked on the GPU with).
        left, right = p.window
        diagonal = q_idx + p.shift
        visible = visible & (k_idx >= diagonal - left) & (k_idx <= diagonal + right)
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
    clusters: int = 0  # persistent launch: clusters (CTAs where ncl == 1) launched; 0: not
    # A persistent launch's units by levels (`unit_indices`) for tiles of unequal work
    # (causal without a narrow window): the number of neighbouring query tiles of one head
    # taken together; 0: query tile fastest.
    levels: int = 0

    @classmethod
    def of(cls, config: Config, *, n_q: int, Hq: int, B: int, group: int, causal: bool,
           persistent: bool = False, balanced: bool = True):
        """The grid of `n_q` query tiles of every (query head, batch), with `config`'s
        clusters, order and (causal) heaviest-first walk; `persistent`: one cluster per
        `ncl` multiprocessors, walking the tiles in turn (`tiles`), by levels where the
        tiles are not `balanced` (`config.balanced_tiles`)."""
        grid = cls(n_q=n_q, Hq=Hq, B=B, group=group, ncl=config.cluster,
                   cluster_axis=config.cluster_axis, grid_order=config.grid_order,
                   reverse=causal and config.reverse_causal)
        if not persistent:
            return grid
        clusters = max(1, min(grid.units, multiprocessors() // grid.ncl))
        levels = 0
        if not balanced:
            heads = grid.units // grid.q_extent
            levels = min(grid.q_extent, cdiv(LEVEL_SHARING * heads, clusters))
        return dataclasses.replace(grid, clusters=clusters, levels=levels)

    def __post_init__(self):
        if self.ncl > 1 and self.cluster_axis == "heads" and self.group % self.ncl:
            raise ValueError(
                f"cluster={self.ncl} along heads needs (Hq//Hkv)={self.group} "
                "to be a multiple of it"
            )

    @property
    def units(self):
        """A persistent launch's units of work: (query tile, batch row, cluster of heads)."""
        return self.q_extent * self.B * (self.Hq // self.ncl)

    @property
    def q_extent(self):  # query tiles padded to a multiple of the q-cluster
        if self.cluster_axis == "q":
            return cdiv(self.n_q, self.ncl) * self.ncl
        return self.n_q

    @property
    def n_q_clusters(self):
        return self.q_extent // (self.ncl if (self.ncl > 1 and self.cluster_axis == "q") else 1)

    def kernel_kwargs(self):
        if self.clusters:
            kw = dict(grid=(self.clusters,), grid_names=(PERSISTENT,))
            if self.ncl > 1:
                kw.update(cluster=(self.ncl,), cluster_names=(CLUSTER,))
            return kw
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

    def tiles(self, body, carry):
        """`body(indices, carry, following) -> carry` over the tiles of this CTA of a
        persistent launch (`indices` as `indices()` returns them; `following`: (whether
        there is a next tile, its indices)): one unit of each round of `clusters` units
        (`unit_indices`), the cluster's own position in the round (mirrored in odd rounds
        by levels, so that who took a round's heaviest tile takes the next one's lightest)."""
        assert self.clusters, "a persistent launch"
        me = lax.axis_index(PERSISTENT)
        rounds, rest = divmod(self.units, self.clusters)
        # The last, partial round's units are positions 0..rest-1 (mirrored: from the end).
        in_last = (me < rest) if not (self.levels and rounds % 2) else (
            self.clusters - 1 - me < rest)
        count = rounds + in_last.astype(jnp.int32)

        def one(i, carry):
            following = (i + 1 < count, self.unit_indices(self.unit_of(me, i + 1)))
            return body(self.unit_indices(self.unit_of(me, i)), carry, following)
        return lax.fori_loop(0, count, one, carry)

    def unit_of(self, me, i):
        """The unit cluster `me` of a persistent launch takes in round `i`."""
        if self.levels:
            me = jnp.where(lax.rem(i, 2) == 1, self.clusters - 1 - me, me)
        return me + i * self.clusters

    def first_tile(self):
        """The indices of this CTA's first tile in a persistent launch."""
        return self.unit_indices(lax.axis_index(PERSISTENT))

    def unit_indices(self, unit):
        """The indices (as `indices()`) of a persistent launch's unit: query tile fastest,
        then batch, then the cluster of heads (consecutive units share K/V); by levels, the
        query tiles in groups of `levels` (the last group may be shorter): group slowest,
        then the cluster of heads, then batch, then the group's tiles (a round's units walk
        about as many key blocks, and each head's K/V serves `levels` of them)."""
        if self.levels:
            g, heads = self.levels, self.units // self.q_extent
            whole = self.q_extent // g  # groups of g tiles; then one of q_extent % g
            in_whole = unit < whole * g * heads
            size = jnp.where(in_whole, g, self.q_extent % g or g)
            rest = jnp.where(in_whole, lax.rem(unit, jnp.int32(g * heads)),
                             unit - whole * g * heads)
            t = jnp.where(in_whole, lax.div(unit, jnp.int32(g * heads)), whole) * g + lax.rem(
                rest, size)
            rest = lax.div(rest, size)
            b = lax.rem(rest, jnp.int32(self.B))
            h = lax.div(rest, jnp.int32(self.B))
        else:
            t = lax.rem(unit, jnp.int32(self.q_extent))
            rest = lax.div(unit, jnp.int32(self.q_extent))
            b = lax.rem(rest, jnp.int32(self.B))
            h = lax.div(rest, jnp.int32(self.B))
        if self.reverse:
            t = (self.q_extent - 1) - t
        if self.ncl > 1:
            h = h * self.ncl + lax.axis_index(CLUSTER)
        return t, h, b, t, 1

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
    """(lo, hi, kv_of) of the key blocks a cluster walks: `visibility.kv_walk` over the rows
    of all its CTAs (query tiles t_first.. of `rows` rows; multicast needs every CTA to load
    the same tiles), and the walk's order (`kv_order`; not under a window, whose walk
    starts with masked blocks)."""
    first = t_first * rows
    last = jnp.minimum(first + t_count * rows - 1, p.T - 1)
    lo, _, full_hi, hi = kv_walk(p, first, last)
    kv_of = kv_order(lo, full_hi, lax.div(t_first, jnp.int32(t_count)), grid.n_q_clusters,
                     kv_rotate and p.window is None)
    return lo, hi, kv_of


def consumer_walk(p: Walk, lo, q_first, q_last, *, padding_rows: bool):
    """(mask_lo, full_hi, hi) of one consumer's rows [q_first, q_last] within its cluster's
    walk from `lo` (`cluster_walk`): the blocks before its own first one are walked masked
    (the producer loads them for the cluster), those from `hi` to the cluster's end are
    released unread. `padding_rows`: the rows may lie wholly past T (a padded query tile),
    then the consumer walks nothing."""
    _, mask_lo, full_hi, hi = kv_walk(p, q_first, q_last)
    if padding_rows:
        hi = jnp.where(q_first < p.T, hi, lo)
    full_hi = imin(full_hi, hi)
    if not (isinstance(mask_lo, int) and mask_lo == 0):  # 0: no block before full_hi masked
        mask_lo = imin(mask_lo, full_hi)
    return mask_lo, full_hi, hi


def walk_kv(step, carry, lo, mask_lo, full_hi, hi):
    """`step(j, carry, masked=...)` over the key blocks [lo, mask_lo) with the element
    masks, [mask_lo, full_hi) without them, then [full_hi, hi) with them (`visibility.kv_walk`'s
    split)."""
    if not (isinstance(lo, int) and isinstance(mask_lo, int) and lo == mask_lo):
        carry = lax.fori_loop(lo, mask_lo, functools.partial(step, masked=True), carry)
    carry = lax.fori_loop(mask_lo, full_hi, functools.partial(step, masked=False), carry)
    return lax.fori_loop(full_hi, hi, functools.partial(step, masked=True), carry)


def launch(entry, grid: Grid, config: Config, inputs: tuple, *, out_dtype, lse_rows: int):
    """`entry` run by a producer and two consumer warpgroups over `grid` with `inputs`
    (q, k, v[, key lengths]): (out [B, Tq, Hq, Dv] in `out_dtype`, lse [B, Hq, lse_rows]
    float32)."""
    q, v = inputs[0], inputs[2]
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
    )(*inputs)
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
