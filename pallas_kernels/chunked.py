"""The `"chunked"` tier: attention as large matrix products over blocks of queries (and keys),
with a workspace bounded by a budget.

Each block of queries (rows [r0, r1)) against a range of keys (columns [c0, c1)) is three
steps that XLA compiles to library GEMMs and fusions:
  1. logits = q·kᵀ for all heads of the block at once, in float32 (one batched GEMM; GQA by
     reshaping the query heads of a group into the rows, never by repeating K/V);
  2. one elementwise/row step: scale, bias, the soft cap, mask, causality, window, segment
     ids and lengths (each from the block's own rows and keys: O(block), never [T, S]),
     softmax, lse, dropout (the same Philox keep decisions as the kernels:
     `pallas_kernels.dropout.keep_mask_reference`);
  3. P·V by GEMM, accumulated in float32.
Key blocks of one query block merge by their lse; the sinks join last, as one more "block"
with lse = the sink and no value. Blocks that causality or the window hide entirely are
never built: with a window, each query block reads only the band of keys its rows can see.
The backward recomputes each block from the saved lse (no row max or sum):
dV += Pᵀ·dO, dP = dO·Vᵀ, dS = P·(dP − δ)·cap', dQ = dS·K, dK += dSᵀ·Q, with cap' the soft
cap's derivative 1 − tanh²(logits / c).

The workspace of one block is O(B·Hq·rows·keys); `block_sizes` picks the blocks so that it
stays under a byte budget, never O(T·S) unless the problem itself is that small.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp

from pallas_kernels.blocked import MAX_ROW_KEYS, softmax_grad, softmax_rows
from pallas_kernels.dropout import keep_mask_reference
from pallas_kernels.problem import FeatureArrays, Problem
from pallas_kernels.reference import causal_keep, feature_keep, soft_cap, softmax

# Peak bytes of one block's temporaries (logits, P, dP, dS): 4 GiB unless the environment
# variable says otherwise (`budget_from_env`).
DEFAULT_BUDGET_BYTES = 4 << 30
BUDGET_ENV = "FFPA_CHUNKED_BUDGET_MIB"


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """Everything static about one call on the chunked tier (hashable)."""

    scale: float
    causal: bool
    dropout_rate: float
    block_q: int  # query rows per block
    block_k: int  # keys per block (>= S: one key block per query block)
    # The step between the GEMMs: "pallas" (pallas_kernels.blocked) or "xla" (an XLA fusion,
    # what runs without a GPU).
    step: str = "xla"
    interpret: bool = False
    lse_cotangent: bool = False  # backward: the caller differentiates through lse
    # The backward's blocks (its temporaries per element are twice the forward's); 0: the
    # forward's.
    bwd_block_q: int = 0
    bwd_block_k: int = 0
    window: tuple[int, int] | None = None  # (left, right), bottom-right aligned
    softcap: float | None = None

    def for_backward(self) -> "ChunkPlan":
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
    cap = causal_rows_cap(t) if problem.causal else t
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


# ---------------------------------------------------------------- the blocks


@dataclasses.dataclass(frozen=True)
class _Group:
    """`count` query blocks of `rows` rows, the first at row `first`, each seeing `keys`
    keys: [0, keys), or with `band` the `keys` keys from `_key_start` of the block's first
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


def _right_reach(plan: ChunkPlan) -> int | None:
    """How far right of its diagonal (i + S - T) a row sees: 0 under causality, the window's
    right size, the smaller of both, or None (no limit)."""
    reach = 0 if plan.causal else None
    if plan.window is not None:
        reach = plan.window[1] if reach is None else min(reach, plan.window[1])
    return reach


def _key_limit(plan: ChunkPlan, r1: int, seq_q: int, seq_k: int) -> int:
    """Keys [0, limit) that rows [., r1) can see: causality and the window's right side hide
    the rest."""
    reach = _right_reach(plan)
    if reach is None:
        return seq_k
    return max(0, min(seq_k, r1 + seq_k - seq_q + reach))


def _band_keys(plan: ChunkPlan, rows: int, seq_k: int) -> int:
    """How many keys a block of `rows` rows sees under the window: its band's width (all
    of S when the band is that wide)."""
    if plan.window is None:
        return seq_k
    return min(seq_k, rows + plan.window[0] + _right_reach(plan))


def _key_start(plan: ChunkPlan, group: _Group, r0, seq_q: int, seq_k: int):
    """The first key of the block at row `r0` (int or traced): 0, or with a band the left
    end of the window of its first row, moved left where the band would pass S (so that
    the block's `group.keys` keys stay in range and still hold every key it sees)."""
    if not group.band:
        return 0
    start = r0 + (seq_k - seq_q) - plan.window[0]
    if isinstance(start, int):
        return max(0, min(start, seq_k - group.keys))
    return jnp.clip(start, 0, seq_k - group.keys)


def _sees_a_key(plan: ChunkPlan, r0: int, rows: int, seq_q: int, seq_k: int) -> bool:
    """Whether any of rows [r0, r0 + rows) sees a key by causality and the window."""
    limit = _key_limit(plan, r0 + rows, seq_q, seq_k)
    if plan.window is not None:  # the first key of the block's last row's window
        return limit > 0 and r0 + rows - 1 + seq_k - seq_q - plan.window[0] < seq_k
    return limit > 0


def _groups(plan: ChunkPlan, seq_q: int, seq_k: int) -> list[_Group]:
    """The query blocks in row order, grouped; blocks that see no key are left out."""
    size = plan.block_q
    full, tail = divmod(seq_q, size)
    blocks = [(i * size, size) for i in range(full)] + ([(full * size, tail)] if tail else [])
    blocks = [(r0, n, _key_limit(plan, r0 + n, seq_q, seq_k)) for r0, n in blocks
              if _sees_a_key(plan, r0, n, seq_q, seq_k)]
    if any(_band_keys(plan, n, seq_k) < seq_k for _, n, _ in blocks):
        # A window narrower than S: each block reads its own band of keys (equal widths for
        # equal rows), wherever its rows' windows put it.
        runs = [[b for b in blocks if b[1] == size], [b for b in blocks if b[1] != size]]
        return [_Group(first=run[0][0], rows=run[0][1], count=len(run),
                       keys=_band_keys(plan, run[0][1], seq_k), band=True)
                for run in runs if run]
    if _right_reach(plan) is None:
        runs = [[b for b in blocks if b[1] == size], [b for b in blocks if b[1] != size]]
    else:
        per = max(1, math.ceil(len(blocks) / MAX_CAUSAL_GROUPS))
        runs = [blocks[i:i + per] for i in range(0, len(blocks), per)]
        runs = [r for run in runs for r in ([run[:-1], run[-1:]] if run[-1][1] != size
                                              else [run])]
    return [_Group(first=run[0][0], rows=run[0][1], count=len(run),
                   keys=max(limit for _, _, limit in run)) for run in runs if run]


def _segments(limit: int, size: int) -> list[tuple[int, list[int]]]:
    """Key blocks covering [0, limit): (block size, starts) for the full blocks, then the tail."""
    full, tail = divmod(limit, size)
    out = [(size, [i * size for i in range(full)])] if full else []
    return out + ([(tail, [full * size])] if tail else [])


def _over(starts: list[int], body, carry):
    """`body(carry, start)` for each of the evenly spaced `starts` in order: (carry, outputs
    stacked on a new leading axis). One start runs once with a static start; more run in a
    `lax.scan`."""
    if len(starts) == 1:
        carry, out = body(carry, starts[0])
        return carry, jax.tree.map(lambda x: x[None], out)
    # An iota, not a constant array: the shard-local wrapper (custom_partitioning) takes no
    # closed-over constants.
    step = starts[1] - starts[0]
    return jax.lax.scan(body, carry, starts[0] + step * jax.lax.iota(jnp.int32, len(starts)))


def _rows_of(x, axis: int, start, size: int):
    """x[start:start + size] along `axis` (start may be traced), unless that dim broadcasts."""
    if x is None or x.shape[axis] == 1 or (isinstance(start, int) and start == 0
                                           and size == x.shape[axis]):
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


@dataclasses.dataclass(frozen=True)
class _Block:
    """Rows [r0, r0 + rows) against keys [c0, c0 + keys); r0 and c0 may be traced."""

    r0: object
    rows: int
    c0: object
    keys: int

    def offsets(self):
        return jnp.stack([jnp.asarray(self.r0, jnp.int32), jnp.asarray(self.c0, jnp.int32)])


# Operands in the GEMMs' layout: q-like [B, T, Hq, D] as [B, Hkv, G, T, D] (a query head's
# rows contiguous, the heads of a group stacked), k-like [B, S, Hkv, D] as [B, Hkv, S, D].
# Then every product is one batched GEMM over (B, Hkv) of [G·rows, D] by [keys, D], with a
# single contracting dim; with any other layout XLA transposes [rows, keys]-sized operands.


def _grouped(x, heads_kv: int):
    b, t, hq, d = x.shape
    return x.reshape(b, t, heads_kv, hq // heads_kv, d).transpose(0, 2, 3, 1, 4)


def _ungrouped(x):
    """[B, Hkv, G, T, D] -> [B, T, Hq, D]."""
    b, hkv, g, t, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, t, hkv * g, d)


def _block_rows(x5, blk: _Block):
    """[B, Hkv, G, T, D] -> the block's rows as [B, Hkv, G·rows, D]."""
    b, hkv, g, _, d = x5.shape
    return _rows_of(x5, 3, blk.r0, blk.rows).reshape(b, hkv, g * blk.rows, d)


def _mm(spec: str, a, b, out_dtype):
    """One batched GEMM. 16-bit operands multiply exactly with float32 accumulation at any
    precision setting; float32 ones need HIGHEST (else TF32)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.einsum(spec, a, b, preferred_element_type=out_dtype, precision=precision)


def _low_precision(dtype) -> bool:
    return jnp.dtype(dtype).itemsize < 4


def _visible(plan: ChunkPlan, mask, blk: _Block, *, seq_q: int, seq_k: int,
             features: FeatureArrays | None = None):
    """bool, broadcastable to [B, Hq, rows, keys], or None when every key is visible. The
    segment ids are sliced to the block's rows and keys: O(block), never [T, S]."""
    visible = None if mask is None else _rows_of(_rows_of(mask, 2, blk.r0, blk.rows), 3,
                                                 blk.c0, blk.keys)
    rows = blk.r0 + jnp.arange(blk.rows, dtype=jnp.int32)
    cols = blk.c0 + jnp.arange(blk.keys, dtype=jnp.int32)
    if plan.causal:
        keep = causal_keep(seq_q, seq_k, rows, cols)[None, None]  # [1, 1, rows, keys]
        visible = keep if visible is None else visible & keep
    f = FeatureArrays() if features is None else features
    if plan.window is not None or any(x is not None for x in f[:4]):
        keep = feature_keep(seq_q, seq_k, rows, cols, window=plan.window,
                            q_segment_ids=_rows_of(f.q_segment_ids, 1, blk.r0, blk.rows),
                            kv_segment_ids=_rows_of(f.kv_segment_ids, 1, blk.c0, blk.keys),
                            q_lengths=f.q_lengths, kv_lengths=f.kv_lengths)
        visible = keep if visible is None else visible & keep
    return visible


def _scores_xla(plan: ChunkPlan, logits, bias, blk: _Block):
    """scale·logits + bias, soft-capped, float32 [B, Hq, rows, keys] (natural-log units)."""
    s = logits * jnp.asarray(plan.scale, jnp.float32)
    if bias is not None:
        s = s + _rows_of(_rows_of(bias, 2, blk.r0, blk.rows), 3, blk.c0, blk.keys).astype(
            jnp.float32)
    return soft_cap(s, plan.softcap)


def _keep(plan: ChunkPlan, seed, blk: _Block, *, batch: int, heads_q: int):
    """The dropout keep-mask of the block, [B, Hq, rows, keys]. A shard's seed carries its
    global batch and head offsets as words 2 and 3."""
    b0, h0 = (seed[2], seed[3]) if seed.shape[0] == 4 else (0, 0)
    return keep_mask_reference(seed[:2], (batch, heads_q, blk.rows, blk.keys),
                               plan.dropout_rate, offsets=(b0, h0, blk.r0, blk.c0))


def _softmax_xla(plan: ChunkPlan, logits, bias, mask, seed, blk: _Block, *, seq_q: int,
                 seq_k: int, p_dtype, features: FeatureArrays | None = None):
    """`softmax_rows` as XLA ops: (P [B, Hq, rows, keys] in `p_dtype`, lse [B, Hq, rows])."""
    b, hq = logits.shape[:2]
    s = _scores_xla(plan, logits, bias, blk)
    probs, lse = softmax(s, _visible(plan, mask, blk, seq_q=seq_q, seq_k=seq_k,
                                     features=features))
    if plan.dropout_rate > 0.0:
        keep = _keep(plan, seed, blk, batch=b, heads_q=hq)
        probs = jnp.where(keep, probs / (1.0 - plan.dropout_rate), jnp.zeros_like(probs))
    return probs.astype(p_dtype), lse


def _forward_block(plan: ChunkPlan, qg, kk, vv, bias, mask, seed, features, blk: _Block, *,
                   seq_q: int):
    """(out [B, Hkv, G, rows, Dv] float32, lse [B, Hq, rows]) of one block, each normalised
    over the block's own keys (lse -inf and out 0 where a row sees none of them)."""
    b, hkv, g, _, _ = qg.shape
    seq_k = kk.shape[2]
    q_blk = _block_rows(qg, blk)
    k_blk = _rows_of(kk, 2, blk.c0, blk.keys)
    v_blk = _rows_of(vv, 2, blk.c0, blk.keys)
    logits = _mm("bkmd,bksd->bkms", q_blk, k_blk, jnp.float32).reshape(
        b, hkv * g, blk.rows, blk.keys)
    p_dtype = vv.dtype if _low_precision(vv.dtype) else jnp.float32
    if plan.step == "pallas":
        probs, lse = softmax_rows(logits, blk.offsets(), bias, mask, seed, seq_q=seq_q,
                                  seq_k=seq_k, scale=plan.scale, causal=plan.causal,
                                  dropout_rate=plan.dropout_rate, out_dtype=p_dtype,
                                  interpret=plan.interpret, **_step_features(plan, features))
    else:
        probs, lse = _softmax_xla(plan, logits, bias, mask, seed, blk, seq_q=seq_q,
                                  seq_k=seq_k, p_dtype=p_dtype, features=features)
    out = _mm("bkms,bksd->bkmd", probs.reshape(b, hkv, g * blk.rows, blk.keys), v_blk,
              jnp.float32)
    return out.reshape(b, hkv, g, blk.rows, -1), lse


def _merge(acc, part):
    """Two (out [B, Hkv, G, rows, Dv], lse [B, Hq, rows]) over disjoint keys -> the pair
    over their union."""
    (o1, l1), (o2, l2) = acc, part
    lse = jnp.logaddexp(l1, l2)
    safe = jnp.where(lse == -jnp.inf, 0.0, lse)
    w1 = jnp.where(l1 == -jnp.inf, 0.0, jnp.exp(l1 - safe))
    w2 = jnp.where(l2 == -jnp.inf, 0.0, jnp.exp(l2 - safe))
    as_rows = lambda w: w.reshape(o1.shape[:4] + (1,))
    return o1 * as_rows(w1) + o2 * as_rows(w2), lse


def _forward_rows(plan: ChunkPlan, qg, kk, vv, bias, mask, seed, features, r0, rows: int,
                  start, limit: int, *, seq_q: int):
    """(out, lse) of rows [r0, r0 + rows) over keys [start, start + limit), key blocks
    merged by lse."""
    segments = _segments(limit, plan.block_k)
    run = functools.partial(_forward_block, plan, qg, kk, vv, bias, mask, seed, features,
                            seq_q=seq_q)
    if len(segments) == 1 and len(segments[0][1]) == 1:
        return run(_Block(r0, rows, start, limit))
    b, hkv, g, _, _ = qg.shape
    acc = (jnp.zeros((b, hkv, g, rows, vv.shape[3]), jnp.float32),
           jnp.full((b, hkv * g, rows), -jnp.inf, jnp.float32))
    for keys, starts in segments:
        def body(acc, c0, keys=keys):
            return _merge(acc, run(_Block(r0, rows, start + c0, keys))), None
        acc, _ = _over(starts, body, acc)
    return acc


def _step_features(plan: ChunkPlan, features) -> dict:
    """The Pallas steps' feature arguments (none when the call uses no feature, so that
    their kernels stay what they were)."""
    kw = {}
    if plan.window is not None:
        kw["window"] = plan.window
    if plan.softcap is not None:
        kw["softcap"] = plan.softcap
    if features is not None and any(x is not None for x in features[:4]):
        kw["features"] = features.without_sinks()
    return kw


def with_sinks(out, lse, sinks):
    """(out, lse) of rows [B, T, Hq, Dv] / [B, Hq, T] with each head's sink joined to the
    row's denominator: the sink is one more block of keys with lse = sink and no value."""
    if sinks is None:
        return out, lse
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], lse.shape)
    total = jnp.logaddexp(lse, sink)
    weight = jnp.where(lse == -jnp.inf, 0.0, jnp.exp(lse - total))  # the keys' share
    return out * jnp.swapaxes(weight, 1, 2)[..., None], total


def _stacked_rows(x, axis: int):
    """[count, ..., rows (at axis + 1), ...] -> [..., count·rows, ...]."""
    x = jnp.moveaxis(x, 0, axis)
    shape = x.shape
    return x.reshape(shape[:axis] + (shape[axis] * shape[axis + 1],) + shape[axis + 2:])


def _in_row_order(pieces, groups, *, seq_q: int, axis: int, fill):
    """Each group's stacked rows, with `fill` rows where no block ran, concatenated along
    `axis` into all seq_q rows."""
    out, covered = [], 0
    for piece, g in zip(pieces, groups):
        piece = _stacked_rows(piece, axis)
        if g.first > covered:
            shape = list(piece.shape)
            shape[axis] = g.first - covered
            out.append(jnp.full(shape, fill, piece.dtype))
        out.append(piece)
        covered = g.first + g.rows * g.count
    if covered < seq_q or not out:
        shape = list(pieces[0].shape[1:]) if pieces else None
        if shape is None:
            return None
        shape[axis] = seq_q - covered
        out.append(jnp.full(shape, fill, pieces[0].dtype))
    return jnp.concatenate(out, axis=axis)


def forward(plan: ChunkPlan, q, k, v, bias, mask, seed, features: FeatureArrays | None = None):
    """(out [B, T, Hq, Dv] float32, lse [B, Hq, T] float32); `features` the feature arrays
    (segment ids, lengths, sinks) or None."""
    b, t, hq, _ = q.shape
    hkv, s = k.shape[2], k.shape[1]
    sinks = None if features is None else features.sinks
    qg, kk, vv = _grouped(q, hkv), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    groups = _groups(plan, t, s)
    if not groups:  # no row sees a key
        return with_sinks(jnp.zeros((b, t, hq, v.shape[3]), jnp.float32),
                          jnp.full((b, hq, t), -jnp.inf, jnp.float32), sinks)
    outs, lses = [], []
    for g in groups:
        def body(carry, r0, g=g):
            return carry, _forward_rows(plan, qg, kk, vv, bias, mask, seed, features, r0,
                                        g.rows, _key_start(plan, g, r0, t, s), g.keys,
                                        seq_q=t)
        _, (out, lse) = _over(g.starts, body, None)
        outs.append(out)
        lses.append(lse)
    out = _in_row_order(outs, groups, seq_q=t, axis=3, fill=0.0)
    lse = _in_row_order(lses, groups, seq_q=t, axis=2, fill=-jnp.inf)
    return with_sinks(_ungrouped(out), lse, sinks)


# ---------------------------------------------------------------- backward


def _softmax_grad_xla(plan: ChunkPlan, logits, dp, lse, delta, bias, mask, seed, blk: _Block, *,
                      seq_q: int, seq_k: int, out_dtype, split: bool, own_delta: bool,
                      features: FeatureArrays | None = None):
    """`softmax_grad` as XLA ops: (dropped P, (dS[, dS's low word]), dS float32), each
    [B, Hq, rows, keys]; dS is the gradient of the logits before the soft cap."""
    b, hq = logits.shape[:2]
    lse, delta = lse[..., None], delta[..., None]
    s = _scores_xla(plan, logits, bias, blk)
    ok = jnp.isfinite(lse)
    visible = _visible(plan, mask, blk, seq_q=seq_q, seq_k=seq_k, features=features)
    if visible is not None:
        ok = ok & visible
    probs = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)), 0.0)
    dp = dp.astype(jnp.float32)
    dropped = probs
    if plan.dropout_rate > 0.0:
        keep = _keep(plan, seed, blk, batch=b, heads_q=hq)
        inv = 1.0 - plan.dropout_rate
        dropped = jnp.where(keep, probs / inv, 0.0)
        dp = jnp.where(keep, dp / inv, 0.0)
    if own_delta:
        delta = jnp.sum(probs * dp, axis=-1, keepdims=True) + delta
    ds = probs * (dp - delta)
    if plan.softcap is not None:  # through c·tanh(x / c): times 1 - tanh²
        t = s / jnp.asarray(plan.softcap, jnp.float32)
        ds = ds * (1.0 - t * t)
    hi = ds.astype(out_dtype)
    parts = (hi, (ds - hi.astype(jnp.float32)).astype(out_dtype)) if split else (hi,)
    return dropped.astype(out_dtype), parts, ds


def _backward_block(plan: ChunkPlan, qg, kk, vv, dog, lse, deltas, bias, mask, seed, features,
                    blk: _Block, *, seq_q: int, want_ds: bool):
    """(dq [B, Hkv, G, rows, D], dk [B, Hkv, keys, D], dv [B, Hkv, keys, Dv], ds) of one
    block, float32; ds [B, Hq, rows, keys] float32 only when `want_ds` (a bias's gradient).

    `deltas` = (rowsum(dO·O) - dlse, -dlse). A block that holds all of its rows' keys takes
    δ = Σ P·dP from its own P and dP (XLA's softmax gradient) plus -dlse: then dS sums to
    dlse·P over a row as it must, and a row with a single key gets dq = 0 exactly (with δ
    from O, dP's 16-bit rounding does not cancel)."""
    b, hkv, g, _, d = qg.shape
    seq_k = kk.shape[2]
    rows, keys = blk.rows, blk.keys
    q_blk, do_blk = _block_rows(qg, blk), _block_rows(dog, blk)
    k_blk, v_blk = _rows_of(kk, 2, blk.c0, keys), _rows_of(vv, 2, blk.c0, keys)
    own_delta = (isinstance(blk.c0, int) and blk.c0 == 0 and keys == seq_k
                 and (plan.step != "pallas" or keys <= MAX_ROW_KEYS))
    lse_blk = _rows_of(lse, 2, blk.r0, rows)
    delta_blk = _rows_of(deltas[1] if own_delta else deltas[0], 2, blk.r0, rows)
    low = _low_precision(qg.dtype)
    in_dtype = qg.dtype if low else jnp.float32
    split = low and plan.lse_cotangent
    shape4 = (b, hkv * g, rows, keys)
    logits = _mm("bkmd,bksd->bkms", q_blk, k_blk, jnp.float32).reshape(shape4)
    # dP in the input dtype, as XLA's own gradient rounds it (the cotangent of 16-bit P).
    dp = _mm("bkmd,bksd->bkms", do_blk, v_blk, in_dtype).reshape(shape4)
    if plan.step == "pallas":
        outs = softmax_grad(logits, dp, lse_blk, delta_blk, blk.offsets(), bias, mask, seed,
                            seq_q=seq_q, seq_k=seq_k, scale=plan.scale, causal=plan.causal,
                            dropout_rate=plan.dropout_rate, out_dtype=in_dtype, split=split,
                            with_ds32=want_ds, own_delta=own_delta, interpret=plan.interpret,
                            **_step_features(plan, features))
        dropped, parts, ds32 = outs[0], outs[1:2 + split], outs[-1] if want_ds else None
    else:
        dropped, parts, ds32 = _softmax_grad_xla(plan, logits, dp, lse_blk, delta_blk, bias,
                                                 mask, seed, blk, seq_q=seq_q, seq_k=seq_k,
                                                 out_dtype=in_dtype, split=split,
                                                 own_delta=own_delta, features=features)
    as3 = lambda x: x.reshape(b, hkv, g * rows, keys)
    scale = jnp.asarray(plan.scale, jnp.float32)
    dv = _mm("bkms,bkmd->bksd", as3(dropped), do_blk, jnp.float32)
    dq = sum(_mm("bkms,bksd->bkmd", as3(p), k_blk, jnp.float32) for p in parts) * scale
    dk = sum(_mm("bkms,bkmd->bksd", as3(p), q_blk, jnp.float32) for p in parts) * scale
    return dq.reshape(b, hkv, g, rows, d), dk, dv, (ds32 if want_ds else None)


def _dbias_block(ds, bias_shape):
    """The block's ds [B, Hq, rows, keys] summed over the bias's broadcast dims."""
    axes = tuple(i for i, n in enumerate(bias_shape) if n == 1 and ds.shape[i] != 1)
    return jnp.sum(ds, axis=axes, keepdims=True) if axes else ds


def _add_at(acc, part, starts):
    """acc with `part` added at `starts` (each may be traced)."""
    if part.shape == acc.shape:  # the whole array: a plain add, which XLA folds into a GEMM
        return acc + part
    current = jax.lax.dynamic_slice(acc, starts, part.shape)
    return jax.lax.dynamic_update_slice(acc, current + part, starts)


def backward(plan: ChunkPlan, q, k, v, bias, mask, seed, out, lse, d_out, d_lse,
             features: FeatureArrays | None = None):
    """(dq, dk, dv, dbias) in the inputs' dtypes (dbias in the bias's, None without one).
    `features`: the feature arrays or None (lse counts the sinks already: they only decide
    how a bias constant over the keys gets its gradient)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    # A row without keys has lse = -inf and no gradient path; drop its lse cotangent.
    d_lse = jnp.where(lse == -jnp.inf, 0.0, d_lse.astype(jnp.float32))
    deltas = (jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out,
                         precision=jax.lax.Precision.HIGHEST) - d_lse, -d_lse)
    qg, dog = _grouped(q, hkv), _grouped(d_out, hkv)
    kk, vv = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    has_sinks = features is not None and features.sinks is not None
    # A bias constant over the keys has a closed-form gradient (`row_constant_dbias`) unless
    # the soft cap bends the logits or a sink does not move with them: then it takes dS's
    # sum over the keys like any other bias.
    full_bias = bias is not None and (bias.shape[-1] != 1 or plan.softcap is not None
                                      or has_sinks)
    carry = (jnp.zeros(kk.shape, jnp.float32), jnp.zeros(vv.shape, jnp.float32),
             jnp.zeros(bias.shape, jnp.float32) if full_bias else None)
    groups = _groups(plan, t, k.shape[1])
    features = None if features is None else features.without_sinks()
    run = functools.partial(_backward_block, plan, qg, kk, vv, dog, lse, deltas, bias, mask,
                            seed, features, seq_q=t, want_ds=full_bias)
    dqs = []
    for grp in groups:
        def rows_body(carry, r0, grp=grp):
            dk, dv, dbias = carry
            dq = jnp.zeros((b, hkv, hq // hkv, grp.rows, d), jnp.float32)
            first = _key_start(plan, grp, r0, t, k.shape[1])
            for keys, starts in _segments(grp.keys, plan.block_k):
                def keys_body(inner, c0, keys=keys):
                    c0 = first + c0
                    dq, dk, dv, dbias = inner
                    dq_b, dk_b, dv_b, ds = run(_Block(r0, grp.rows, c0, keys))
                    dk = _add_at(dk, dk_b, (0, 0, c0, 0))
                    dv = _add_at(dv, dv_b, (0, 0, c0, 0))
                    if full_bias:
                        starts = (0, 0, r0 if bias.shape[2] != 1 else 0,
                                  c0 if bias.shape[3] != 1 else 0)
                        dbias = _add_at(dbias, _dbias_block(ds, bias.shape), starts)
                    return (dq + dq_b, dk, dv, dbias), None
                (dq, dk, dv, dbias), _ = _over(starts, keys_body, (dq, dk, dv, dbias))
            return (dk, dv, dbias), dq.astype(q.dtype)  # final: its key blocks are summed
        carry, dq_rows = _over(grp.starts, rows_body, carry)
        dqs.append(dq_rows)
    dk, dv, dbias = carry
    dq = (_ungrouped(_in_row_order(dqs, groups, seq_q=t, axis=3, fill=0.0)) if groups
          else jnp.zeros(q.shape, q.dtype))
    if bias is None:
        db = None
    elif full_bias:
        db = dbias.astype(bias.dtype)
    else:
        db = row_constant_dbias(d_lse, bias)
    return (dq.astype(q.dtype), dk.transpose(0, 2, 1, 3).astype(k.dtype),
            dv.transpose(0, 2, 1, 3).astype(v.dtype), db)


def row_constant_dbias(d_lse, bias):
    """dbias of a bias broadcast over the keys (last dim 1), in closed form: adding c to
    every logit of a row leaves P unchanged and adds c to lse, so dbias is d_lse summed over
    the bias's broadcast dims (rows without keys already carry d_lse = 0)."""
    per_row = d_lse[..., None]  # [B, Hq, T, 1]
    axes = tuple(i for i in range(3) if bias.shape[i] == 1 and per_row.shape[i] != 1)
    return jnp.sum(per_row, axis=axes, keepdims=True).astype(bias.dtype)


# ---------------------------------------------------------------- plans


def budget_from_env(default: int = DEFAULT_BUDGET_BYTES) -> int:
    """The workspace budget: $FFPA_CHUNKED_BUDGET_MIB (MiB) when set to a positive number,
    else `default`. Read when a call is traced."""
    raw = os.environ.get(BUDGET_ENV, "").strip()
    try:
        value = float(raw)
    except ValueError:
        return default
    return int(value * 2**20) if value > 0 else default


def make_plan(problem: Problem, *, step: str, interpret: bool = False,
              budget_bytes: int | None = None,
              blocks: tuple[int, int] | None = None) -> ChunkPlan:
    """The chunked tier's plan for `problem`. `step`: "pallas" (pallas_kernels.blocked; in
    Pallas' interpreter with `interpret`) or "xla". `blocks` = (query rows, keys) per block,
    both directions, overrides the budget (tests)."""
    budget = budget_from_env() if budget_bytes is None else budget_bytes
    max_keys = MAX_ROW_KEYS if step == "pallas" else None
    if blocks is not None:
        fwd_blocks = bwd_blocks = tuple(int(x) for x in blocks)
    else:
        fwd_blocks, bwd_blocks = (block_sizes(problem, direction, budget, max_keys=max_keys)
                                  for direction in ("forward", "backward"))
    if max_keys is not None and fwd_blocks[1] > max_keys:  # softmax_rows holds whole rows
        fwd_blocks = (fwd_blocks[0], max_keys)
    return ChunkPlan(scale=problem.scale, causal=problem.causal, window=problem.window,
                     softcap=problem.softcap,
                     dropout_rate=problem.dropout_rate, block_q=max(1, fwd_blocks[0]),
                     block_k=max(1, fwd_blocks[1]), bwd_block_q=max(1, bwd_blocks[0]),
                     bwd_block_k=max(1, bwd_blocks[1]), step=step, interpret=interpret)
