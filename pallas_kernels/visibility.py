"""Which keys a query row sees, and which blocks of keys (or rows) can be skipped.

The one statement of the visibility rule. The reference (`reference.py`) applies it densely,
the fused kernels (`fwd.py`, `bwd*.py`) and the decode kernels (`decode.py`) per tile and per
walk over blocks, the chunked tier (`chunked.py`, `blocked.py`) per block of its GEMMs, the
Mosaic kernels (`mosaic/`) per tile (`sees_causal`; `sees_window`'s bounds) and per walk
over whole blocks (`BlockWalk`, `kv_walk`, `q_walk`).

Query row i (0 <= i < T) sits at key position i' = i + shift, shift = S - T (bottom-right
alignment); the paged decode kernels align a sequence to its own length instead, and a block
of a longer sequence (`FeatureArrays.positions`: context parallelism) takes the runtime shift
of its place in the whole (`shift_of`), so every rule and every walk below takes the shift
as an int32 that may be traced. Row i sees
key j (0 <= j < S) iff every rule that the call uses holds:
- the mask: mask[b, h, i, j] (the caller's array; each tier reads it itself);
- causality: j <= i';
- the sliding window (left, right): i' - left <= j <= i' + right;
- packed segments: q_segment_ids[b, i] == kv_segment_ids[b, j];
- padding lengths: i < q_len[b] and j < kv_len[b].

The element functions take positions `rows` [R] and `cols` [C] and return bool [R, C]
(`sees_causal` and `sees_window` take matching shapes: the Mosaic kernels' index tiles); the
segment ids may carry leading batch dims. The runtime values the kernels read from refs
(segment ids, lengths, a block's segment range) may be given as zero-argument callables:
they are then read where the rule first needs them, which keeps each kernel's order of
operations (and its compiled code) what it was when the rule lived inline.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from jax import lax

from pallas_kernels.tiles import cdiv, i32


def _value(x):
    """A runtime value given directly or as a callable that reads it."""
    return x() if callable(x) else x


def _ranked(a, b):
    """a and b at one rank, the lower given leading axes, where both are arrays of different
    ranks: callers may run under jax_numpy_rank_promotion='raise' (a window's [R, C] meets
    batched segments' [B, R, C], rows [R] meet lengths [B, 1]). A scalar broadcasts as it
    is (the kernels' per-program lengths)."""
    ra, rb = jnp.ndim(a), jnp.ndim(b)
    if ra == rb or ra == 0 or rb == 0:
        return a, b
    rank = max(ra, rb)
    return tuple(jnp.reshape(x, (1,) * (rank - jnp.ndim(x)) + jnp.shape(x)) for x in (a, b))


def _both(a, b):
    if a is None:
        return b
    a, b = _ranked(a, b)
    return a & b


def _below(x, bound):
    """x < bound, ranks aligned (`_ranked`)."""
    x, bound = _ranked(x, bound)
    return x < bound


def _max(a, b):
    """max of two int32 bounds: Python's for two Python ints (a bound known at trace time
    stays a constant), else `jnp.maximum`."""
    return max(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.maximum(a, b)


def _min(a, b):
    return min(a, b) if isinstance(a, int) and isinstance(b, int) else jnp.minimum(a, b)


# ---------------------------------------------------------------- element rules


def default_shift(seq_q: int, seq_k: int) -> int:
    """Where row 0 sits among the keys: S - T (bottom-right alignment)."""
    return seq_k - seq_q


def shift_or_default(shift, seq_q: int, seq_k: int):
    """`shift` (static or traced), or S - T where it is None."""
    return default_shift(seq_q, seq_k) if shift is None else shift


def shift_of(seq_q: int, seq_k: int, positions=None):
    """Where row 0 sits among the keys: S - T, a Python int (static), or where `positions`
    (int32[3] (row0, col0, shift), an array or a kernel's ref) place the rows and keys as a
    block of a longer sequence, its runtime shift."""
    return default_shift(seq_q, seq_k) if positions is None else positions[2]


def sees_causal(row, col, shift):
    """Element-wise (any matching shapes): key `col` is at or before row `row`'s diagonal,
    j <= i + shift."""
    return col <= row + shift


def sees_window(row, col, window: tuple[int, int], shift):
    """Element-wise (any matching shapes): key `col` lies in row `row`'s window,
    i' - left <= j <= i' + right."""
    left, right = window
    diagonal = row + shift
    return (col >= diagonal - left) & (col <= diagonal + right)


def causal_visible(rows, cols, shift):
    """bool [R, C]: `sees_causal` of rows [R] against keys [C]."""
    return sees_causal(rows[:, None], cols[None, :], shift)


def window_visible(rows, cols, window: tuple[int, int], shift):
    """bool [R, C]: `sees_window` of rows [R] against keys [C]."""
    return sees_window(rows[:, None], cols[None, :], window, shift)


def same_segment(q_ids, kv_ids):
    """bool [..., R, C]: the row's and the key's segment ids are equal."""
    return q_ids[..., :, None] == kv_ids[..., None, :]


def feature_visible(rows, cols, *, shift, window=None, segments=None, q_len=None,
                    kv_len=None):
    """bool, broadcastable to [..., R, C], or None when no rule applies: the window, the
    segments (`segments`: (q_ids [..., R], kv_ids [..., C]), or a callable giving them), and
    the lengths (scalars, or callables; with batched ids, [B, 1] and [B, 1] columns) at rows
    `rows` [R] and keys `cols` [C]. Causality and the mask are the callers' (they order
    them before these, as the semantics do)."""
    keep = None
    if window is not None:
        keep = window_visible(rows, cols, window, shift)
    if segments is not None:
        keep = _both(keep, same_segment(*_value(segments)))
    if q_len is not None:
        keep = _both(keep, _below(rows, _value(q_len))[..., :, None])
    if kv_len is not None:
        keep = _both(keep, _below(cols, _value(kv_len))[..., None, :])
    return keep


# ---------------------------------------------------------------- walks over blocks
# The fused kernels walk key blocks of `bn` keys for a query block of `bm` rows (or query
# blocks for a key block); the bounds below are int32 scalars, traced or not.


def causal_kv_blocks(q_start, block_m: int, block_n: int, seq_q: int, seq_k: int, shift=None):
    """For the query rows [q_start, q_start + block_m): (n_unmasked, n_total) key blocks.

    Blocks [0, n_unmasked) are visible to every row of the tile; blocks [n_unmasked,
    n_total) are partly visible and need the element-wise causal mask; later blocks are
    skipped."""
    shift = shift_or_default(shift, seq_q, seq_k)
    # Keys visible to the last (valid) row and to the first row, as counts >= 0,
    # so the integer divisions below never see a negative operand.
    keys_last_row = jnp.maximum(jnp.minimum(q_start + block_m - 1, seq_q - 1) + shift + 1, 0)
    keys_first_row = jnp.maximum(q_start + shift + 1, 0)
    n_total = jnp.minimum((keys_last_row + block_n - 1) // block_n, cdiv(seq_k, block_n))
    n_unmasked = jnp.minimum(keys_first_row // block_n, n_total)
    return n_unmasked, n_total


def causal_q_blocks(kv_start, block_m: int, block_n: int, seq_q: int, seq_k: int, shift=None):
    """For the keys [kv_start, kv_start + block_n): (first, first_unmasked) query blocks.

    Query blocks before `first` see none of these keys (skipped); blocks in
    [first, first_unmasked) see some (element-wise causal mask); blocks from
    `first_unmasked` on see all of them."""
    shift = shift_or_default(shift, seq_q, seq_k)
    n_q = cdiv(seq_q, block_m)
    first = jnp.minimum(jnp.maximum(kv_start - shift, 0) // block_m, n_q)
    all_visible_from = jnp.maximum(kv_start + block_n - 1 - shift, 0)
    first_unmasked = jnp.clip((all_visible_from + block_m - 1) // block_m, first, n_q)
    return first, first_unmasked


def kv_block_range(q_start, blocks: tuple[int, int], hi, *, seq_q: int, shift, window=None,
                   kv_len=None, q_len=None, segment_range=None, lo=None):
    """[lo, hi) of the key blocks (`blocks`: (block_m, block_n), the tile's rows and keys)
    that rows [q_start, q_start + block_m) can see, within
    the caller's [lo, hi) (`lo` None: from 0): the window's band, the kv length, the
    q length (a block past it sees nothing) and the block's segment range (`segment_range(i)`
    reads its first (i = 0) or end (i = 1) key block, from `segment_block_ranges`)."""
    block_m, block_n = blocks
    lo_in = lo
    lo = i32(0) if lo is None else i32(lo)
    hi = i32(hi)
    if window is not None:
        left, right = window
        first_row_key = shift if isinstance(q_start, int) and q_start == 0 else q_start + shift
        window_lo = _max(first_row_key - left, 0) // block_n
        lo = window_lo if lo_in is None else jnp.maximum(lo, window_lo)
        last = _min(q_start + block_m - 1, seq_q - 1)
        # The key after the last row's window: a static last row adds its 1 first, so a
        # traced shift (paged decode) takes one add.
        end = (last + 1) + shift + right if isinstance(last, int) else last + shift + right + 1
        hi = jnp.minimum(hi, (_max(end, 0) + block_n - 1) // block_n)
    if kv_len is not None:
        hi = jnp.minimum(hi, (jnp.maximum(_value(kv_len), 0) + block_n - 1) // block_n)
    if q_len is not None:
        hi = jnp.where(q_start < _value(q_len), hi, lo)
    if segment_range is not None:
        lo = jnp.maximum(lo, segment_range(0))
        hi = jnp.minimum(hi, segment_range(1))
    return lo, jnp.maximum(hi, lo)


def q_block_range(kv_start, blocks: tuple[int, int], lo, hi, *, seq_k: int, shift,
                  window=None, q_len=None, kv_len=None, segment_range=None):
    """[lo, hi) of the query blocks that see any of the keys [kv_start, kv_start + block_n),
    within the caller's [lo, hi) (causality's, or all query blocks): the transpose of
    `kv_block_range`, for the kernels that walk query blocks (dK, dV); `segment_range` is
    the key block's range of query blocks; `shift` where row 0 sits among the keys
    (`shift_of`); `blocks` is (block_m, block_n)."""
    block_m, block_n = blocks
    lo, hi = i32(lo), i32(hi)
    if window is not None:
        left, right = window
        # Row i sees key j iff j - shift - right <= i <= j - shift + left.
        lo = jnp.maximum(lo, jnp.maximum(kv_start - shift - right, 0) // block_m)
        last_key = jnp.minimum(kv_start + block_n - 1, seq_k - 1)
        hi = jnp.minimum(hi, (jnp.maximum(last_key - shift + left + 1, 0) + block_m - 1)
                         // block_m)
    if q_len is not None:
        hi = jnp.minimum(hi, (jnp.maximum(_value(q_len), 0) + block_m - 1) // block_m)
    if kv_len is not None:
        hi = jnp.where(kv_start < _value(kv_len), hi, lo)
    if segment_range is not None:
        lo = jnp.maximum(lo, segment_range(0))
        hi = jnp.minimum(hi, segment_range(1))
    return lo, jnp.maximum(hi, lo)


def causal_tiles(n_q: int, n_kv: int, block_m: int, block_n: int, seq_q: int, seq_k: int,
                 shift=None):
    """bool [n_q, n_kv]: whether tile (query block i, key block j) holds a key that
    causality lets one of its rows see (`shift` None: S - T)."""
    shift = shift_or_default(shift, seq_q, seq_k)
    # Tile (i, j) holds a visible key iff its first key j·bn is at most the limit of its
    # last row, i·bm + bm - 1 + S - T. Clamping that row to T - 1 (rows past T are padding)
    # would change nothing, as a tile's first key is below S; and the clamp, `jnp.minimum`,
    # is what XLA miscompiled on the GPU (jax 0.11.2, H100: `0 <= min(i·bm + bm - 1, T - 1)
    # + S - T` came out inverted at equality, e.g. T=276, S=1, dropping the only visible
    # tile; the HLO after optimization was right, eager and CPU runs too; the repro is in
    # docs/history.md).
    last_row_limit = jnp.arange(n_q) * block_m + (block_m - 1 + shift)
    return (jnp.arange(n_kv) * block_n)[None, :] <= last_row_limit[:, None]


def segment_block_ranges(q_ids, kv_ids, *, block_m: int, block_n: int, full: bool = False):
    """int32 [B, nq, 2]: for each query block of `block_m` rows, the key blocks
    [first, last + 1) of `block_n` keys whose id ranges (min to max) meet the block's
    ([0, 0) where none does). A cheap XLA pass over the ids ([B, nq, nk] booleans, never
    [T, S]); exact for contiguous (sorted) segments, a superset for others: the element
    masks decide, the range only skips blocks. `full`: [B, nq, 4], with the run of key
    blocks [first, end) every row of the query block sees whole by the ids (all of its
    rows' and keys' ids one and the same; the first such block and those right after it,
    [first, first) where there is none): the ids need no comparison there."""
    def block_min_max(ids, block):
        b, n = ids.shape
        blocks = cdiv(n, block)
        padded = jnp.pad(ids, ((0, 0), (0, blocks * block - n)), mode="edge")
        padded = padded.reshape(b, blocks, block)
        return padded.min(axis=-1), padded.max(axis=-1)
    q_min, q_max = block_min_max(q_ids, block_m)
    k_min, k_max = block_min_max(kv_ids, block_n)
    meet = (k_min[:, None, :] <= q_max[:, :, None]) & (k_max[:, None, :] >= q_min[:, :, None])
    n_k = meet.shape[-1]
    any_meet = meet.any(axis=-1)
    first = jnp.argmax(meet, axis=-1)
    last = n_k - 1 - jnp.argmax(meet[..., ::-1], axis=-1)
    lo = jnp.where(any_meet, first, 0)
    hi = jnp.where(any_meet, last + 1, 0)
    if not full:
        return jnp.stack([lo, hi], axis=-1).astype(jnp.int32)
    same = ((q_min == q_max)[:, :, None] & (k_min == k_max)[:, None, :]
            & (k_min[:, None, :] == q_min[:, :, None]))
    start = jnp.argmax(same, axis=-1)
    index = jnp.arange(n_k)
    after = (index[None, None, :] > start[..., None]) & ~same  # the first block that is not
    end = jnp.where(after.any(axis=-1), jnp.argmax(after, axis=-1), n_k)
    start = jnp.where(same.any(axis=-1), start, 0)
    end = jnp.where(same.any(axis=-1), end, 0)
    return jnp.stack([lo, hi, start, end], axis=-1).astype(jnp.int32)


def mask_is_segments(mask_shape) -> bool:
    """Whether a 4-D mask of this shape ([B|1, H|1, T|1, S|1]) says no more than a pair of
    segment ids can: the same for every head, and a key mask (one row for all rows) or a
    query mask (one column for all keys). `segments_of_mask` makes the ids."""
    return mask_shape is not None and mask_shape[1] == 1 and 1 in mask_shape[2:]


def segments_of_mask(mask, batch: int, seq_q: int, seq_k: int):
    """(q_ids int32 [B, T], kv_ids int32 [B, S]) under which row i sees key j exactly where
    `mask` (a shape `mask_is_segments` accepts) lets it: a key mask keeps the rows' ids at 1
    and gives each key 1 (seen) or 0 (hidden); a query mask gives each row 1 or 0 and the
    keys 1. A row that sees no key is a row of no segment: out 0, as under the mask."""
    m = mask[:, 0].astype(jnp.int32)  # [B|1, T|1, S|1]
    if m.shape[1] == 1:  # a key mask (also one value for the whole row block)
        kv = jnp.broadcast_to(m[:, 0, :], (batch, seq_k))
        return jnp.ones((batch, seq_q), jnp.int32), kv
    q = jnp.broadcast_to(m[:, :, 0], (batch, seq_q))
    return q, jnp.ones((batch, seq_k), jnp.int32)


# ---------------------------------------------------------------- static spans of keys
# The chunked tier plans its blocks of rows at trace time, in Python integers, from the
# static shift (S - T, or a block's `Problem.positions_shift`); where positions make the
# shift runtime data only, only the band's width (which does not depend on the shift) is
# planned, and its start found at run time.


def right_reach(causal: bool, window) -> int | None:
    """How far right of its diagonal i' a row sees: 0 under causality, the window's right
    size, the smaller of both, or None (no limit)."""
    reach = 0 if causal else None
    if window is not None:
        reach = window[1] if reach is None else min(reach, window[1])
    return reach


def key_limit(r1: int, *, seq_q: int, seq_k: int, causal: bool, window,
              shift: int | None = None) -> int:
    """Keys [0, limit) that rows [., r1) can see: causality and the window's right side hide
    the rest. `shift` (static) None: S - T."""
    reach = right_reach(causal, window)
    if reach is None:
        return seq_k
    shift = shift_or_default(shift, seq_q, seq_k)
    return max(0, min(seq_k, r1 + shift + reach))


def band_keys(rows: int, *, seq_k: int, causal: bool, window, align: int = 1) -> int:
    """How many keys a block of `rows` rows sees under the window: its band's width (all
    of S when the band is that wide). With `align` > 1 the band starts at a multiple of
    `align` (`band_start`): it is widened by align - 1 keys to hold the rows' keys from
    there, and so that S - width is a multiple of `align` too (a band moved left from S
    then still starts at one)."""
    if window is None:
        return seq_k
    width = rows + window[0] + right_reach(causal, window)
    if align > 1:
        width = seq_k - (seq_k - (width + align - 1)) // align * align
    return min(seq_k, width)


def band_start(r0, keys: int, *, seq_q: int, seq_k: int, window, shift=None, align: int = 1):
    """The first key of the band of `keys` keys (`band_keys`, with the same `align`) that
    rows from `r0` (int or traced) see: the left end of the window of row r0, rounded down
    to a multiple of `align`, moved left where the band would pass S (so that the band
    stays in range and still holds every key the rows see); `shift` None: S - T."""
    shift = shift_or_default(shift, seq_q, seq_k)
    start = r0 + shift - window[0]
    if align > 1:
        start = start // align * align
    if isinstance(start, int):
        return max(0, min(start, seq_k - keys))
    return jnp.clip(start, 0, seq_k - keys)


def rows_see_a_key(r0: int, rows: int, *, seq_q: int, seq_k: int, causal: bool,
                   window, shift: int | None = None) -> bool:
    """Whether any of rows [r0, r0 + rows) sees a key by causality and the window (`shift`
    static, None: S - T)."""
    shift = shift_or_default(shift, seq_q, seq_k)
    limit = key_limit(r0 + rows, seq_q=seq_q, seq_k=seq_k, causal=causal, window=window,
                      shift=shift)
    if window is not None:  # the first key of the block's first row's window
        return limit > 0 and r0 + shift - window[0] < seq_k
    return limit > 0


# ---------------------------------------------------------------- blocks of a longer sequence
# Context parallelism splits a call into (rows, keys) blocks of the whole problem and asks,
# per block, whether to skip it, run it without the causal/window mask, or run it masked.

BLOCK_HIDDEN = 0  # no row of the block sees a key of it
BLOCK_FULL = 1  # every row sees every key (by causality and the window)
BLOCK_PARTIAL = 2  # some do: the block needs its element mask


def block_relation(r0, rows: int, c0, keys: int, *, shift, causal: bool, window):
    """BLOCK_HIDDEN, BLOCK_FULL or BLOCK_PARTIAL for rows [r0, r0 + rows) against keys
    [c0, c0 + keys), row i's diagonal at key i + shift, by causality and the window alone
    (the masks that are data, segments and lengths, are the block's to apply). Python ints
    give a Python int; traced bounds an int32 scalar."""
    reach = right_reach(causal, window)
    first_diag, last_diag = r0 + shift, r0 + rows - 1 + shift
    last_key = c0 + keys - 1
    hidden, full = False, True
    if reach is not None:
        hidden = hidden | (c0 > last_diag + reach)
        full = full & (last_key <= first_diag + reach)
    if window is not None:
        hidden = hidden | (last_key < first_diag - window[0])
        full = full & (c0 >= last_diag - window[0])
    if isinstance(hidden, bool) and isinstance(full, bool):
        return BLOCK_HIDDEN if hidden else (BLOCK_FULL if full else BLOCK_PARTIAL)
    return jnp.where(hidden, BLOCK_HIDDEN, jnp.where(full, BLOCK_FULL, BLOCK_PARTIAL)).astype(
        jnp.int32)


# ---------------------------------------------------------------- the Mosaic kernels' walks
# The Mosaic kernels walk whole blocks (of keys in the forward, of query rows in the
# backward) for a group of rows (keys), and split the walk into the blocks every row sees
# whole (no mask) and those that go through the element rule (`sees_causal`,
# `sees_window`, the key length, the segments' comparison).


def div_up(a, b: int):
    """Ceil division of a non-negative int32, static or traced (`lax.div`), by a static b."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return lax.div(a + (b - 1), jnp.int32(b))


@dataclasses.dataclass(frozen=True)
class BlockWalk:
    """What decides which blocks a group of rows (or keys) walks: the true lengths T and S
    (the arrays may be padded), causality, the sliding window (left, right), the key block,
    a batch row's key length and the segments' block range."""

    T: int
    S: int
    causal: bool
    block_kv: int
    window: tuple[int, int] | None = None
    # A batch row's key length (traced int32, at most S): keys from it on are seen by no
    # row. None: all S keys.
    key_end: Any = None
    # Segment ids: a row sees only keys of its own segment, so every block walked goes
    # through the element rule (with the ids' comparison), and the walk stays within a
    # range of blocks the host computed from the ids (`segment_block_ranges`).
    segments: bool = False
    segment_range: Any = None  # (first, end) blocks, traced int32; None: no bound
    # (first, end) blocks the whole group sees by the ids (`segment_block_ranges(...,
    # full=True)`): walked without the element rule where nothing else masks them. None:
    # every block masked.
    segment_full: Any = None
    # A block of a longer sequence (`FeatureArrays.positions`): where its row 0 sits among
    # its keys, traced int32 (the positions' shift). None: S - T.
    row_shift: Any = None

    @property
    def keys(self):
        """The end of the keys any row sees: `key_end`, else S."""
        return self.S if self.key_end is None else self.key_end

    @property
    def num_kv_blocks(self):
        return div_up(self.S, self.block_kv)

    @property
    def shift(self):
        """Where row 0 sits among the keys: bottom-right alignment (S - T), or a block's
        runtime shift (`row_shift`)."""
        return self.S - self.T if self.row_shift is None else self.row_shift

    @property
    def right(self) -> int | None:
        """The last visible key's offset from a row's diagonal: 0 under causality (or the
        window's right edge if it is tighter), the window's right edge without; None when
        nothing bounds it."""
        if self.window is None:
            return 0 if self.causal else None
        return min(self.window[1], 0) if self.causal else self.window[1]



def _blocks_below(keys, bkv: int):
    """Key blocks that end at or before key count `keys` (traced, may be negative): the
    number of whole blocks in [0, keys)."""
    return lax.div(jnp.maximum(keys, 0), jnp.int32(bkv))


def kv_walk(p: BlockWalk, q_first, q_last):
    """Key blocks walked by query rows [q_first, q_last] (q_last clipped to T-1).

    Returns (lo, mask_lo, full_hi, hi): blocks [lo, hi) hold every key some row of the group
    sees (the others are skipped); of them, [mask_lo, full_hi) are visible whole to every
    row and need no mask, while [lo, mask_lo) (a window's left edge) and [full_hi, hi) (the
    diagonal, a window's right edge, the padded last block) go through the element rule.
    """
    bkv = p.block_kv
    lo = mask_lo = 0
    hi = p.num_kv_blocks
    full_hi = p.S // bkv
    right = p.right
    if right is None and p.window is None and p.key_end is None and not p.segments:
        # Static Python ints: the key loops get compile-time trip counts.
        return lo, mask_lo, full_hi, hi
    if p.key_end is not None:
        hi = jnp.minimum(hi, div_up(p.key_end, bkv))
        full_hi = jnp.minimum(full_hi, _blocks_below(p.key_end, bkv))
    if right is not None:
        # Keys visible to the last row: [.., q_last + shift + right]; to every row of the
        # group: [.., q_first + shift + right].
        edge = p.shift + right
        hi = jnp.minimum(hi, div_up(jnp.maximum(q_last + edge + 1, 0), bkv))
        full_hi = jnp.minimum(full_hi, _blocks_below(q_first + edge + 1, bkv))
    if p.window is not None:
        left = p.window[0]
        # Keys visible to the first row: [q_first + shift - left, ..]; to every row of the
        # group: [q_last + shift - left, ..].
        lo = jnp.minimum(_blocks_below(q_first + p.shift - left, bkv), hi)
        mask_lo = jnp.clip(div_up(jnp.maximum(q_last + p.shift - left, 0), bkv), lo, hi)
    if p.segments:
        return _segment_walk(p, lo, mask_lo, full_hi, hi)
    full_hi = jnp.clip(full_hi, mask_lo, hi)
    return lo, mask_lo, full_hi, hi


def _segment_walk(p: BlockWalk, lo, mask_lo, full_hi, hi):
    """`kv_walk`'s or `q_walk`'s (lo, mask_lo, full_hi, hi) under segment ids, from the
    walk's bounds without them: [lo, hi) within the segments' range of blocks; unmasked
    only the blocks both the bounds [mask_lo, full_hi) and the ids (`segment_full`) leave
    whole, every other block masked."""
    if p.segment_range is not None:
        lo = jnp.maximum(lo, p.segment_range[0])
        hi = jnp.minimum(hi, p.segment_range[1])
    lo = jnp.minimum(lo, hi)
    if p.segment_full is None:
        return lo, lo, lo, hi
    mask_lo = jnp.clip(jnp.maximum(mask_lo, p.segment_full[0]), lo, hi)
    full_hi = jnp.clip(jnp.minimum(full_hi, p.segment_full[1]), mask_lo, hi)
    return lo, mask_lo, full_hi, hi


def q_walk(p: BlockWalk, k_first, k_last, block_q: int):
    """Query blocks (of `block_q` rows) that see keys [k_first, k_last] (the backward's
    walk, `kv_walk` turned around; k_last may pass S - 1: keys past S are padding).

    Returns (lo, mask_lo, full_hi, hi): blocks [lo, hi) hold every row that sees some key of
    the group; [mask_lo, full_hi) see every key of it (no mask needed), the rest of [lo, hi)
    go through the element rule. A group that reaches past S masks every block (its padding
    keys must not count).
    """
    n = div_up(p.T, block_q)
    lo = mask_lo = 0
    hi = full_hi = n
    right = p.right
    if right is not None:
        # Row q sees key k only if k <= q + shift + right: rows from k_first - shift - right
        # see some key of the group, rows from k_last - shift - right every key.
        edge = p.shift + right
        # At most n: a block's runtime shift may place keys after every row.
        lo = jnp.minimum(_blocks_below(k_first - edge, block_q), n)
        mask_lo = div_up(jnp.maximum(k_last - edge, 0), block_q)
    if p.window is not None:
        # Row q sees key k only if k >= q + shift - left: rows up to k_last + left - shift
        # see some key, rows up to k_first + left - shift every key.
        reach = p.window[0] - p.shift
        hi = jnp.minimum(n, div_up(jnp.maximum(k_last + reach + 1, 0), block_q))
        full_hi = _blocks_below(k_first + reach + 1, block_q)
    if p.key_end is not None:  # keys past the row's key length: no row sees them
        hi = jnp.where(k_first < p.key_end, hi, lo)
    if not (isinstance(k_last, int) and p.key_end is None and k_last < p.S):
        full_hi = jnp.where(k_last < p.keys, full_hi, 0)
    if p.segments:
        return _segment_walk(p, lo, mask_lo, full_hi, hi)
    if isinstance(lo, int) and isinstance(hi, int) and isinstance(full_hi, int):
        return lo, mask_lo, full_hi, hi
    lo = jnp.minimum(lo, hi)
    mask_lo = jnp.clip(mask_lo, lo, hi)
    full_hi = jnp.clip(full_hi, mask_lo, hi)
    return lo, mask_lo, full_hi, hi
