"""The chunked tier's plan: how large its blocks of queries and keys are (`ChunkConfig`, from
a byte budget), and which blocks of rows run, grouped, against which keys (`groups`).

The workspace of one block is O(B·Hq·rows·keys); `block_sizes` picks the blocks so that it
stays under a byte budget, never O(T·S) unless the problem itself is that small. Rows that
see no key (causality, the window) are never planned; with a window narrower than S each
block reads only the band of keys its rows can see (`visibility`'s static spans).

A block of a longer sequence (`Problem.positions`) sits among its keys by a runtime shift:
unless that shift is known at trace time (`Problem.positions_shift`), the plan cannot tell
which rows see which keys, so every row block runs against all keys (the element masks
decide), or under a window narrower than S against its band, whose width does not depend
on the shift and whose start is found at run time (`key_start`).
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax.numpy as jnp
import numpy as np

from pallas_kernels import dropout, visibility
from pallas_kernels.blocked import MAX_ROW_KEYS
from pallas_kernels.problem import Problem

# Peak bytes of one block's temporaries (logits, P, dP, dS): 4 GiB unless the environment
# variable says otherwise (`budget_from_env`).
DEFAULT_BUDGET_BYTES = 4 << 30
BUDGET_ENV = "FFPA_CHUNKED_BUDGET_MIB"
# The step between the GEMMs: the Pallas kernels of `blocked`, or the same as XLA ops (what
# runs without a GPU).
STEP_KERNEL = "kernel"
STEP_FUSION = "fusion"


@dataclasses.dataclass(frozen=True)
class ChunkConfig:
    """The chunked tier's blocks (hashable): query rows and keys per block of the forward,
    the backward's (its temporaries per element are twice the forward's; 0: the forward's),
    the step between the GEMMs (`STEP_KERNEL` or `STEP_FUSION`), and whether the backward's
    blocks that compute their logits in the step run its Mosaic GPU kernel
    (`mosaic.grad_step`: on an sm90 GPU, for the problems it serves; the rule is
    `tiers._chunked_configs`), else the Pallas-Triton one."""

    block_q: int
    block_k: int  # >= S: one key block per query block
    bwd_block_q: int = 0
    bwd_block_k: int = 0
    step: str = STEP_FUSION
    mosaic_step: bool = False
    # The workspace budget the blocks were sized from; the backward's unrolled key blocks
    # keep their float32 parts within it too (`chunked_grad._unrolled_part_bytes`).
    budget_bytes: int = DEFAULT_BUDGET_BYTES

    def for_backward(self) -> "ChunkConfig":
        return dataclasses.replace(self, block_q=self.bwd_block_q or self.block_q,
                                   block_k=self.bwd_block_k or self.block_k)


# ---------------------------------------------------------------- block sizes


def bytes_per_element(dtype, direction: str) -> int:
    """Temporary bytes one block holds per (head, query, key) element, with room for one
    more input-dtype copy: forward, float32 logits and P; backward, float32 logits, dP, P
    and dS (and dS's low word under an lse cotangent) in the input dtype."""
    item = jnp.dtype(dtype).itemsize
    return 4 + 2 * item if direction == "forward" else 4 + 5 * item


def _equal_rows(t: int, most: int) -> int:
    """Rows per block: the fewest blocks of at most `most` rows, made equal (a multiple of
    128 where there are several blocks and room for one)."""
    most = max(1, min(t, most))
    count = -(-t // most)
    rows = -(-t // count)
    if count > 1 and rows >= 128:
        rows = min(-(-rows // 128) * 128, most - most % 128)
    return rows


def _power_of_two_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def causal_rows_cap(seq_q: int) -> int:
    """The most rows of a causal block: a quarter of T (at least 256), so that at least four
    row blocks split the triangle and the hidden blocks beyond each one's keys are skipped
    (one block of all T rows took as long as the whole square: docs/history.md)."""
    return max(256, -(-seq_q // 4 // 128) * 128)


def window_rows_cap(band: int) -> int:
    """The most rows of a block under a sliding window whose rows each see `band` keys at
    most: about the band (at least 256), so that the keys a block reads (its rows plus the
    band) stay near twice those its rows see; blocks of a quarter of T read up to five times
    as many at a window of T/16 (docs/history.md)."""
    return max(256, -(-band // 128) * 128)


def block_sizes(problem: Problem, direction: str, budget_bytes: int = DEFAULT_BUDGET_BYTES,
                max_keys: int | None = None) -> tuple[int, int]:
    """(query rows, keys) per block of `direction` ("forward" or "backward") whose
    temporaries stay under `budget_bytes`.

    The forward takes all keys (at most `max_keys`, a power of two) and as many rows as fit:
    key blocks would merge the output. The backward adds each block's dK and dV into float32
    accumulators and each key block's dQ into the rows': the traffic of that grows as
    Hkv/rows + Hq/keys, so its blocks are about sqrt(area·Hkv/Hq) rows by
    sqrt(area·Hq/Hkv) keys (keys a power of two, or all of S). Causal blocks take at most
    `causal_rows_cap` rows, windowed ones at most `window_rows_cap`."""
    per_element = problem.batch * problem.heads_q * bytes_per_element(problem.dtype, direction)
    t, s = problem.seq_q, problem.seq_k
    area = max(1, budget_bytes // per_element)  # (query, key) elements per block and head
    # (A runtime shift makes causality's skipping a runtime matter: no cap then.)
    cap = causal_rows_cap(t) if problem.causal and problem.static_shift is not None else t
    if problem.window is not None:
        cap = min(cap, window_rows_cap(problem.window_band))
    if direction == "forward":
        keys = s if max_keys is None or s <= max_keys else max_keys
        while area // keys < min(t, 16) and keys > 128:
            keys = _power_of_two_at_most(keys - 1)
        return _equal_rows(t, min(cap, area // keys)), keys
    keys = int(math.sqrt(area * problem.heads_q / problem.heads_kv))
    if keys < s:
        keys = max(128, _power_of_two_at_most(keys))
    keys = min(keys, s)
    rows = min(cap, area // keys)
    if area // keys > rows:  # rows are few (or capped): widen the key blocks instead
        keys = min(s, max(keys, area // max(1, rows)))
        if keys < s:
            keys = _power_of_two_at_most(keys)
    return _equal_rows(t, min(rows, area // keys)), keys



# ---------------------------------------------------------------- the groups of blocks


@dataclasses.dataclass(frozen=True)
class Group:
    """`count` query blocks of `rows` rows, the first at row `first`, each seeing `keys`
    keys: [0, keys), or with `band` the `keys` keys from `key_start` of the block's first
    row (a window's band). One `lax.scan` runs them: XLA then runs the blocks one after
    another, which is what bounds the workspace (unrolled, XLA hoists every block's logits
    GEMM)."""

    first: int
    rows: int
    count: int
    keys: int
    band: bool = False

    @property
    def starts(self) -> list[int]:
        return [self.first + i * self.rows for i in range(self.count)]


# Causal query blocks are grouped by the keys they see; each group computes up to its last
# block's key limit and masks the rest, so at most 1/(2·groups) of the visible work is wasted.
MAX_CAUSAL_GROUPS = 8


def band_align(problem: Problem) -> int:
    """The multiple of which a band's first key is (1: any key). A block with dropout
    draws its keep decisions 32 keys to a Philox chunk from its first key on (the Pallas
    step's `keep_tile`, the XLA step's `keep_mask_reference` at a traced key), which must
    then start a chunk."""
    return dropout.CHUNK if problem.has_dropout else 1


def key_start(problem: Problem, group: Group, r0, shift=None):
    """The first key of the block at row `r0` (int or traced): 0, or with a band the left
    end of the window of its first row, moved left where the band would pass S (so that
    the block's `group.keys` keys stay in range and still hold every key it sees); `shift`:
    the positions' runtime shift, used where the problem's is not static (None: S - T)."""
    if not group.band:
        return 0
    if problem.static_shift is not None:
        shift = problem.static_shift
    return visibility.band_start(r0, group.keys, seq_q=problem.seq_q, seq_k=problem.seq_k,
                                 window=problem.window, shift=shift, align=band_align(problem))


# Rows that see few keys: near the start of a causal sequence, of a document under segment
# ids, or under a narrow window. XLA's softmax gradient takes δ = Σ P·dP from the same
# 16-bit dP as dS, so dP's rounding cancels over each row; with δ from the output it does
# not, and in a row of n keys it leaves an error in dQ of about 1/sqrt(n) of XLA's own (all
# of it at n = 1, where dQ is 0). The backward gives such rows δ from their own P and dP in
# a prelude over bands: every FEW_KEY_ROWS rows against the 2·FEW_KEY_ROWS keys up to their
# last (`few_key_bands`); a row takes its band's δ where every key it sees is in the band.
FEW_KEY_ROWS = 128


def few_key_bands(problem: Problem, rows: int = FEW_KEY_ROWS) -> tuple[int, int, list, list] | None:
    """(rows, keys, row starts, key starts): bands of `rows` rows (all T if fewer; the last
    moved back to end at T), each against `keys` keys (about twice as many, all S if fewer)
    ending at the keys its last row can see, or centred on its rows' diagonal where rows
    see keys on both sides; with dropout, key starts at multiples of its draw
    (`band_align`). Where only causality and the window decide what a row sees, only the
    bands with a row whose keys all lie in them. None where no row can see fewer than all
    keys, where none would gain, or where which rows see which keys is known only at run
    time."""
    t, s, shift = problem.seq_q, problem.seq_k, problem.static_shift
    runtime_rules = (problem.segment_ids or problem.q_lengths or problem.kv_lengths
                     or problem.mask_shape is not None)
    reach = visibility.right_reach(problem.causal, problem.window)
    if shift is None or not (runtime_rules or problem.causal or problem.window is not None):
        return None
    rows = min(rows, t)
    align = band_align(problem)
    keys = min(s, 2 * rows + align - 1)
    if keys < s:  # widened so that S - keys is a multiple of `align` too
        keys = s - (s - keys) // align * align
    left = problem.window[0] if problem.window is not None else None
    row_starts, key_starts = [], []
    for r0 in sorted({min(r0, t - rows) for r0 in range(0, t, rows)}):
        end = r0 + rows + shift + (reach if reach is not None else rows // 2)
        c0 = min(max(0, end - keys), s - keys) // align * align
        if not runtime_rules:  # a row's keys [first, last] are static: keep bands that hold some
            r = np.arange(r0, r0 + rows)
            last = np.minimum(s - 1, r + shift + reach) if reach is not None else s - 1
            first = np.maximum(0, r + shift - left) if left is not None else 0
            if not ((last >= first) & (first >= c0) & (last < c0 + keys)).any():
                continue
        row_starts.append(r0)
        key_starts.append(c0)
    return (rows, keys, row_starts, key_starts) if row_starts else None


def groups(problem: Problem, block_q: int) -> list[Group]:
    """The query blocks of `block_q` rows in row order, grouped; blocks that see no key are
    left out."""
    t, s = problem.seq_q, problem.seq_k
    shift = problem.static_shift
    span = dict(seq_q=t, seq_k=s, causal=problem.causal, window=problem.window, shift=shift)
    band = dict(seq_k=s, causal=problem.causal, window=problem.window,
                align=band_align(problem))
    full, tail = divmod(t, block_q)
    blocks = [(i * block_q, block_q) for i in range(full)] + ([(full * block_q, tail)]
                                                              if tail else [])
    if shift is None:  # the shift is runtime data: every block, every key (or band)
        blocks = [(r0, n, s) for r0, n in blocks]
    else:
        blocks = [(r0, n, visibility.key_limit(r0 + n, **span)) for r0, n in blocks
                  if visibility.rows_see_a_key(r0, n, **span)]
    if any(visibility.band_keys(n, **band) < s for _, n, _ in blocks):
        # A window narrower than S: each block reads its own band of keys (equal widths for
        # equal rows), wherever its rows' windows put it.
        runs = [[b for b in blocks if b[1] == block_q], [b for b in blocks if b[1] != block_q]]
        return [Group(first=run[0][0], rows=run[0][1], count=len(run),
                      keys=visibility.band_keys(run[0][1], **band), band=True)
                for run in runs if run]
    if visibility.right_reach(problem.causal, problem.window) is None or shift is None:
        runs = [[b for b in blocks if b[1] == block_q], [b for b in blocks if b[1] != block_q]]
    else:
        per = max(1, math.ceil(len(blocks) / MAX_CAUSAL_GROUPS))
        runs = [blocks[i:i + per] for i in range(0, len(blocks), per)]
        runs = [r for run in runs for r in ([run[:-1], run[-1:]] if run[-1][1] != block_q
                                            else [run])]
    return [Group(first=run[0][0], rows=run[0][1], count=len(run),
                  keys=max(limit for _, _, limit in run)) for run in runs if run]


# ---------------------------------------------------------------- the config


def budget_from_env(default: int = DEFAULT_BUDGET_BYTES) -> int:
    """The workspace budget: $FFPA_CHUNKED_BUDGET_MIB (MiB) when set to a positive number,
    else `default`. Read when a call is traced."""
    raw = os.environ.get(BUDGET_ENV, "").strip()
    try:
        value = float(raw)
    except ValueError:
        return default
    return int(value * 2**20) if value > 0 else default


def make_config(problem: Problem, *, step: str, budget_bytes: int | None = None,
                blocks: tuple[int, int] | None = None, mosaic_step: bool = False) -> ChunkConfig:
    """The chunked tier's blocks for `problem`. `step`: `STEP_KERNEL` (pallas_kernels.blocked)
    or `STEP_FUSION`. `blocks` = (query rows, keys) per block, both directions, overrides
    the budget (tests). `mosaic_step`: `ChunkConfig.mosaic_step`."""
    budget = budget_from_env() if budget_bytes is None else budget_bytes
    max_keys = MAX_ROW_KEYS if step == STEP_KERNEL else None
    if blocks is not None:
        fwd_blocks = bwd_blocks = tuple(int(x) for x in blocks)
    else:
        fwd_blocks, bwd_blocks = (block_sizes(problem, direction, budget, max_keys=max_keys)
                                  for direction in ("forward", "backward"))
    if max_keys is not None and fwd_blocks[1] > max_keys:  # softmax_rows holds whole rows
        fwd_blocks = (fwd_blocks[0], max_keys)
    return ChunkConfig(block_q=max(1, fwd_blocks[0]), block_k=max(1, fwd_blocks[1]),
                       bwd_block_q=max(1, bwd_blocks[0]), bwd_block_k=max(1, bwd_blocks[1]),
                       step=step, mosaic_step=mosaic_step, budget_bytes=budget)
