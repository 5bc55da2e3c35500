"""The kernels' extra inputs, prepared on the XLA side of a call: the mask's block lists,
the segment ids with their block ranges, the lengths, the sinks and the dropout seed (in the
order the kernels pop them), and the shared-memory estimate that trims pipeline stages
when such tiles join a kernel's loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import dropout, visibility
from pallas_kernels.tiles import cdiv


# The most dynamic shared memory one program may use on the H100 and H200 (227 KiB).
SHARED_MEMORY_BYTES = 232448


def extra_tile_bytes(bias_shape, mask_shape, bias_dtype, *, block_m: int, block_n: int,
                     dropout: bool) -> int:
    """Bytes per KV step that a bias tile, a mask tile and the dropout generator add to a
    [block_m, block_n] score tile's pipelined loads (0 for a plain call). Broadcast dims
    of bias/mask load one element along them. Dropout is allowed one float32 tile: what
    its generator needed while its interleave went through shared memory (it now permutes
    registers only), kept because the dropout launch defaults were measured with it."""
    total = 0
    for shape, itemsize in ((bias_shape, None if bias_dtype is None
                             else jnp.dtype(bias_dtype).itemsize), (mask_shape, 1)):
        if shape is not None and (shape[2] != 1 or shape[3] != 1):
            total += ((block_m if shape[2] != 1 else 1) * (block_n if shape[3] != 1 else 1)
                      * itemsize)
    if dropout:
        total += block_m * block_n * 4
    return total


def fit_stages(num_stages: int, *, resident: int, per_stage: int, extra: int) -> int:
    """Pipeline stages for a kernel whose loop buffers `per_stage + extra` bytes per stage
    beside `resident` bytes: the requested count, or fewer where a bias/mask/dropout
    tile (`extra` > 0) would take the estimate past SHARED_MEMORY_BYTES. Plain calls
    (extra = 0) keep the tuned count, which was measured to fit. The GPU fuzz overflowed
    shared memory with the D <= 128 defaults (3 stages) plus a [T, S] mask."""
    while (extra and num_stages > 1
           and resident + num_stages * (per_stage + extra) > SHARED_MEMORY_BYTES):
        num_stages -= 1
    return num_stages


def seed_inputs(dropout_rate: float, seed) -> list:
    """The kernel inputs that carry the dropout seed when dropping, else []: uint32[2], or
    uint32[4] whose last two words are a shard's global (batch, head) offsets."""
    if dropout_rate <= 0:
        return []
    if seed is None or seed.shape not in ((2,), (4,)):
        raise ValueError(f"dropout_rate={dropout_rate} needs seed, a uint32[2] (or [4]) array; "
                         f"got {None if seed is None else seed.shape}")
    return [dropout.as_bits(seed)]


def feature_inputs(features, *, block_m: int, block_n: int, over_kv: bool = True) -> list:
    """The kernel inputs the feature arrays bring, in `KernelStatic`'s order: q ids, kv ids
    and their block ranges (per query block: the key blocks, `over_kv`; else per key block:
    the query blocks), q lengths, kv lengths, sinks (float32), positions (int32[3])."""
    if features is None:
        return []
    out = []
    if features.q_segment_ids is not None:
        q_ids, kv_ids = features.q_segment_ids, features.kv_segment_ids
        ranges = (visibility.segment_block_ranges(q_ids, kv_ids, block_m=block_m,
                                                  block_n=block_n)
                  if over_kv else
                  visibility.segment_block_ranges(kv_ids, q_ids, block_m=block_n,
                                                  block_n=block_m))
        out += [q_ids, kv_ids, ranges]
    if features.q_lengths is not None:
        out.append(features.q_lengths)
    if features.kv_lengths is not None:
        out.append(features.kv_lengths)
    if features.sinks is not None:
        out.append(features.sinks.astype(jnp.float32))
    if features.positions is not None:
        out.append(features.kernel_positions())
    return out


def feature_names(st) -> list[str]:
    """The names of the feature inputs' refs, in `feature_inputs`' order."""
    p = st.problem
    return (["q_ids", "kv_ids", "seg_ranges"] * p.segment_ids + ["q_len"] * p.q_lengths
            + ["kv_len"] * p.kv_lengths + ["sinks"] * p.sinks + ["positions"] * p.positions)


def pop_feature_refs(st, refs: list) -> dict:
    """The feature inputs' refs by name, popped from the front of `refs`."""
    out = {}
    if st.problem.segment_ids:
        out["q_ids"], out["kv_ids"], out["seg_ranges"] = refs.pop(0), refs.pop(0), refs.pop(0)
    if st.problem.q_lengths:
        out["q_len"] = refs.pop(0)
    if st.problem.kv_lengths:
        out["kv_len"] = refs.pop(0)
    if st.problem.sinks:
        out["sinks"] = refs.pop(0)
    if st.problem.positions:
        out["positions"] = refs.pop(0)
    return out


def block_visits(mask4: jax.Array, *, block_m: int, block_n: int, seq_q: int, seq_k: int,
                 causal: bool, shift=None) -> jax.Array:
    """[mb, mh, nq, nk] bool: does tile (query block i, KV block j) hold a visible key?

    nq is 1 when neither the mask's T dim nor causality varies with the query
    block, nk likewise for the S dim. Reads the mask once; tiny next to it. `shift`:
    causality's (None: S - T; the runtime shift of positions, traced, works alike).
    """
    mb, mh, mt, ms = mask4.shape
    n_q, n_kv = cdiv(seq_q, block_m), cdiv(seq_k, block_n)
    m = mask4
    if ms != 1:
        m = jnp.pad(m, ((0, 0), (0, 0), (0, 0), (0, n_kv * block_n - ms)))
        m = m.reshape(mb, mh, mt, n_kv, block_n).any(axis=-1)
    if mt != 1:
        m = jnp.pad(m, ((0, 0), (0, 0), (0, n_q * block_m - mt), (0, 0)))
        m = m.reshape(mb, mh, n_q, block_m, m.shape[-1]).any(axis=3)
    if causal:
        m = m & visibility.causal_tiles(n_q, n_kv, block_m, block_n, seq_q, seq_k,
                                        shift)[None, None]
    return m


def visit_lists(visits: jax.Array, *, over_kv: bool):
    """Block lists from `block_visits`, for a loop over KV blocks (over_kv) or over query blocks.

    Returns (counts [mb, mh, n_outer], indices [mb, mh, n_outer, n_inner]) int32:
    the first counts[...] entries of indices are the inner blocks to visit, in
    ascending order. n_outer is 1 when the visits do not depend on the outer block.
    """
    if not over_kv:
        visits = jnp.swapaxes(visits, 2, 3)
    counts = visits.sum(axis=-1, dtype=jnp.int32)
    # A stable sort on "not visited" lists visited blocks first, in ascending order.
    indices = jnp.argsort(~visits, axis=-1, stable=True).astype(jnp.int32)
    return counts, indices


def mask_inputs(mask4, *, block_m: int, block_n: int, seq_q: int, seq_k: int, causal: bool,
                over_kv: bool, positions=None) -> tuple[list, int]:
    """The kernel inputs a boolean mask brings ([mask, counts, indices], or [] without
    a mask) and the outer extent of its block lists; causality's tiles at the runtime shift
    of `positions` where given (a block of a longer sequence)."""
    if mask4 is None:
        return [], 1
    counts, indices = mask_block_lists(mask4, block_m=block_m, block_n=block_n, seq_q=seq_q,
                                       seq_k=seq_k, causal=causal, over_kv=over_kv,
                                       shift=None if positions is None else positions[2])
    return [mask4, counts, indices], counts.shape[2]


def mask_block_lists(mask4: jax.Array, *, block_m: int, block_n: int, seq_q: int, seq_k: int,
                     causal: bool, over_kv: bool = True, shift=None):
    """(counts, indices) of the blocks each query block (over_kv) or KV block must visit
    (`shift` as in `block_visits`)."""
    visits = block_visits(mask4, block_m=block_m, block_n=block_n, seq_q=seq_q, seq_k=seq_k,
                          causal=causal, shift=shift)
    n_q, n_kv = cdiv(seq_q, block_m), cdiv(seq_k, block_n)
    mb, mh, vq, vk = visits.shape
    if over_kv:
        visits = jnp.broadcast_to(visits, (mb, mh, vq, n_kv))
    else:
        visits = jnp.broadcast_to(visits, (mb, mh, n_q, vk))
    return visit_lists(visits, over_kv=over_kv)
