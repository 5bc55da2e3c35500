"""The Mosaic tier's launch config (`Config`) and the built-in choice per head size
(`default_config`), from the measurements in docs/history.md (session 18, the Mosaic forward).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Config:
    """Tuning knobs.

    block_kv:       keys per pipeline step.
    num_stages:     rows kernel: K and V ring depth; wide kernel: number of ring
                    slots ([2, block_kv, 128] each).
    cluster:        CTAs per cluster along the query-tile axis sharing K/V tiles
                    through TMA multicast (1 = no cluster).
    wide:           None = automatic (D or Dv > 256 after padding).
    schedule_barrier: rows kernel only: ping-pong the two consumer warpgroups.
    consumer_regs / producer_regs: setmaxnreg budgets.
    reverse_causal: walk query tiles from the heaviest (last) one under causal.
    lowering:       "warpgroup" or "lane" Mosaic GPU lowering semantics.
    out_chunk:      columns of O written per TMA store in the epilogue
                    (None = all of Dv for 16-bit outputs, 128 for float32).
    grid_order:     the launch grid's order, named by its outermost (slowest) axis:
                    Pallas Mosaic GPU launches the last grid dim fastest (it reverses
                    the grid into CUDA's x, y, z). "heads" (default): (heads, q tiles,
                    batch), batch fastest, then query tiles, heads slowest: CTAs
                    that run together mostly read one head's K/V, shared in L2;
                    "q": (q tiles, heads, batch), batch then heads fastest, query
                    tiles slowest: CTAs that run together read different K/V
                    (measured slower for both kernels' defaults).
    cluster_axis:   "q": a cluster is `cluster` consecutive query tiles of one
                    head (they walk the union of their key ranges); "heads": a
                    cluster is `cluster` query heads of one GQA group on the same
                    query tile (needs (Hq // Hkv) % cluster == 0).
    wide_piece:     wide kernel: columns of one ring piece (64 or 128).
    kv_rotate:      walk the fully visible key blocks starting at an offset that
                    depends on the query tile, so that CTAs running together do
                    not all read the same K/V tile at the same moment
                    (measured neutral with grid_order="heads"; off by default).
    wide_eager_release: wide kernel: wait for each tile's wgmmas and release its
                    ring slot immediately (instead of one tile later): faster
                    at D=512 (docs/history.md, session 18).
    precise_lse:    wide kernel: one accumulation chain of S per K tile, the tiles'
                    scores summed in float32 (the tier sets it where the call returns
                    lse: one chain over D = 512 gave lse several times XLA's error).
    block_q:        backward: query rows per step (64; 128 for head dims up to 64,
                    where the step's scores of 64 keys x 128 rows still fit the
                    consumers' registers beside dK and dV).
    overlap:        rows kernel: FlashAttention-3's intra-warpgroup overlap in place of the
                    ping-pong (`schedule_barrier` is then unused): each step issues
                    S(j) = Q K(j)ᵀ and P(j-1) V(j-1) together and runs the softmax of S(j)
                    under the P V wgmma. On by default at head dims 65-256 without segment
                    ids (measured faster there, causal and windowed too, once P(j-1) is kept
                    live until its wgmma is waited for); slower at D <= 64, where S and P of
                    256 keys leave too few registers, and with packed segments
                    (docs/history.md, sessions 38-39). Never run in persistent clusters
                    (`walks_overlapped`).
    persistent:     rows kernel: launch one CTA (cluster) per multiprocessor, each
                    walking query tiles in turn (query tiles fastest, then batch, heads
                    slowest), its producer loading the next tile's K/V while the
                    consumers finish the last one. Q and O then take separate shared
                    memory. Clusters along the query tiles are not combined with it.
    """

    block_kv: int = 128
    num_stages: int = 2
    cluster: int = 1
    wide: bool | None = None
    schedule_barrier: bool = True
    consumer_regs: int = 232
    producer_regs: int = 40
    reverse_causal: bool = True
    lowering: str = "lane"
    out_chunk: int | None = None
    grid_order: str = "heads"
    cluster_axis: str = "q"
    wide_piece: int = 128
    kv_rotate: bool = False
    wide_eager_release: bool = True
    precise_lse: bool = False
    block_q: int = 64
    persistent: bool = False
    overlap: bool = False

    def __post_init__(self):
        if self.block_kv % 64 or not 64 <= self.block_kv <= 256:
            raise ValueError(f"block_kv={self.block_kv} must be 64, 128, 192 or 256")
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")
        if self.cluster not in (1, 2, 4):
            raise ValueError("cluster must be 1, 2 or 4")
        if self.lowering not in ("warpgroup", "lane"):
            raise ValueError("lowering must be 'warpgroup' or 'lane'")
        if self.grid_order not in ("q", "heads") or self.cluster_axis not in ("q", "heads"):
            raise ValueError("grid_order / cluster_axis must be 'q' or 'heads'")
        if self.wide_piece not in (64, 128):
            raise ValueError("wide_piece must be 64 or 128")
        if self.block_q not in (64, 128):
            raise ValueError(f"block_q={self.block_q} must be 64 or 128")
        if self.overlap and self.wide:
            raise ValueError("overlap: the rows kernel's (the wide kernel has no such walk)")
        if self.persistent and (self.wide or (self.cluster > 1 and self.cluster_axis == "q")):
            raise ValueError("persistent: the rows kernel, without clusters along the queries")


def walks_overlapped(config: "Config", persistent: bool) -> bool:
    """Whether the rows kernel walks its blocks overlapped (`Config.overlap`) in a launch
    that is `persistent` or not: never in persistent clusters. There, loops of forward and
    backward launches hung now and then (D = 256, GQA clusters of 2 query heads, within some
    hundreds of steps; docs/history.md, session 40), while the same walk without clusters,
    or one tile per CTA in clusters, ran on."""
    return config.overlap and not (persistent and config.cluster > 1)


def round_up(x, m):
    return (x + m - 1) // m * m


def uses_wide_kernel(head_dim: int, head_dim_v: int) -> bool:
    """Whether the forward runs the "wide" kernel by default: head dims above 256 once
    padded to 64 (the "rows" kernel takes up to 256)."""
    return max(round_up(head_dim, 64), round_up(head_dim_v, 64)) > 256


def runs_wide_kernel(config: "Config", head_dim: int, head_dim_v: int) -> bool:
    """Whether a forward with `config` runs the "wide" kernel: its `wide` field, or by
    default the head dims (`uses_wide_kernel`)."""
    return config.wide if config.wide is not None else uses_wide_kernel(head_dim, head_dim_v)


def default_config(
    head_dim: int,
    head_dim_v: int | None = None,
    dtype=jnp.bfloat16,
    causal: bool = False,
    gqa_group: int = 1,
    segments: bool = False,
    window: tuple[int, int] | None = None,
    seq_q: int | None = None,
) -> Config:
    """Best measured configuration for a head size (docs/history.md, session 18).

    gqa_group = Hq // Hkv (optional): with an even number of query heads per KV head,
    CTAs of sibling query heads are paired in a cluster and share K/V tiles by
    TMA multicast (not in persistent launches that walk overlapped). `segments`: segment
    ids are given (their ids' tiles in shared memory leave no room for three stages of 256
    keys at D <= 64). `causal`, `window` and `seq_q` (the query length) decide whether the
    launch is persistent and in which order (`balanced_tiles`).
    """
    del dtype  # the same choice won for bf16 and fp16
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    d = round_up(head_dim, 64)
    dv = round_up(head_dim_v, 64)
    if uses_wide_kernel(head_dim, head_dim_v):
        # 64-row CTAs, Dv split over the 2 consumer warpgroups; a ring of 3 slots of
        # [2, 128, 64] (96 KiB: every ring of 128 KiB measured slower); pairs of
        # CTAs share every K/V tile by multicast (sibling query heads of a GQA group, else
        # neighbouring query tiles); grid_order="heads" (docs/history.md, session 24).
        return Config(block_kv=128, num_stages=3, wide=True, wide_piece=64, cluster=2,
                      cluster_axis="heads" if gqa_group % 2 == 0 else "q",
                      grid_order="heads")
    # Persistent where it measured faster (docs/history.md, sessions 26-27): query tiles of
    # about equal work walked in turn; causal ones (unequal) by levels (`Grid.levels`), but
    # at head dims 65-128, where causal tiles one CTA each measured faster; not with segment
    # ids (their ranges differ per tile; not measured).
    persistent = not segments and (balanced_tiles(causal, window, seq_q)
                                   or not 64 < max(d, dv) <= 128)
    # FlashAttention-3's intra-warpgroup overlap above D = 64 (`Config.overlap`), not with
    # segment ids (measured slower there, with packed documents of 1024 tokens).
    overlap = max(d, dv) > 64 and not segments
    # An even GQA group pairs sibling query heads in clusters that share K/V tiles by
    # multicast, but not where the launch is persistent and walks overlapped: persistent
    # clusters walk serially (`walks_overlapped`), and there one CTA per cluster walking
    # overlapped measured faster (docs/history.md, session 41).
    if gqa_group % 2 == 0 and not (persistent and overlap):
        clu = dict(cluster=2, cluster_axis="heads")
    else:
        clu = {}
    if max(d, dv) > 128:
        return Config(block_kv=64, num_stages=2, grid_order="heads", lowering="lane",
                      persistent=persistent, overlap=overlap, **clu)
    if max(d, dv) > 64:
        return Config(block_kv=128, num_stages=2, grid_order="heads", lowering="warpgroup",
                      persistent=persistent, overlap=overlap, **clu)
    if segments:
        return Config(block_kv=128, num_stages=2, grid_order="heads", lowering="lane", **clu)
    return Config(block_kv=256, num_stages=3, grid_order="heads", lowering="lane",
                  persistent=persistent, **clu)


def balanced_tiles(causal: bool, window: tuple[int, int] | None, seq_q: int | None) -> bool:
    """Whether a call's query tiles walk about as many key blocks each: without causality,
    or causal with a window whose left side spans at most a quarter of the queries (only
    the first tiles, within its reach of the start, walk fewer). Causal without a window,
    the last tile walks all keys and the first one: a persistent launch takes such tiles by
    levels (`Grid.levels`); in turn, query tile fastest, they left multiprocessors idle
    (docs/history.md, sessions 26-27)."""
    if not causal:
        return True
    return window is not None and seq_q is not None and 4 * window[0] <= seq_q


def default_backward_config(head_dim: int, head_dim_v: int | None = None,
                            segments: bool = False) -> Config:
    """The backward's launch config (`backward.rows_backward`): a ring of two query blocks;
    the consumers take 240 registers each (dK and dV of 64 keys stay in them), the producer
    24 (docs/history.md, session 20). Head dims up to 64 walk 128 query rows per step
    (`block_q`), which halves the steps' waits and each key tile's reads per row (measured
    faster, docs/history.md, session 23); not with segment ids (not measured there)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    narrow = max(head_dim, head_dim_v) <= 64 and not segments
    return Config(num_stages=2, consumer_regs=240, producer_regs=24,
                  block_q=128 if narrow else 64)
