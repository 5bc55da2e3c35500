"""The dropout keep-mask: Philox-4x32-10, evaluated inside the kernels and in plain JAX.

The keep decision for score element (b, h, i, j) is a pure function of a 64-bit
seed (two uint32 words) and of (b, h, i, j):

    j     = 32·c + 8·a + 2·q + p          (c >= 0; a, q in 0..3; p in 0..1)
    words = philox4x32_10(counter=(4·c + q, i, h, b), key=(seed0, seed1))
    u     = 16-bit half p of words[a]      (0 = low half)
    keep  = u >= threshold,   threshold = round(rate · 2^16)

One Philox call serves 8 columns, 16 bits each: the keep probability is
1 - threshold / 2^16 (within 2^-17 of 1 - rate), and the generator costs an
eighth of a call per score element. The 8 columns of a call, {32c + 8a + 2q + p},
are the ones a single GPU thread holds in a row of the matrix-multiply
accumulator's layout (columns 2q and 2q + 1 of every group of 8), so arranging a
call's draws into the score tile permutes registers and never moves data between
threads. (Serving 8 neighbouring columns instead sent every draw through shared
memory, at a cost of stores, loads and barriers in every step of the hot loop:
docs/history.md, "Numbers behind choices in the code".)
Nothing here depends on block sizes or the grid, so every kernel (and
`keep_mask_reference`) that asks about (b, h, i, j) gets the same answer.

A call may share one keep-mask among every batch row and head (`Problem.dropout_broadcast`,
Flax's broadcast_dropout): element (b, h, i, j) then takes the decision drawn at
(0, 0, i, j), in every tier (`static.dropout_keep` in the kernels, `keep_block` in XLA).

All arithmetic is on int32 holding the uint32 bit patterns (products and sums
wrap identically; right shifts are logical), because Triton's lowering wants
one signless integer type throughout. The high half of a 32×32-bit product is
built from 16-bit limbs for plain JAX and Pallas' interpreter, and is one
`mul.hi.u32` instruction in the Triton kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from pallas_kernels import ptx

# Philox-4x32 round multipliers and Weyl key increments (Salmon et al., SC'11).
_M0 = 0xD2511F53
_M1 = 0xCD9E8D57
_W0 = 0x9E3779B9
_W1 = 0xBB67AE85
ROUNDS = 10
CHUNK = 32  # columns served by 4 neighbouring counters: 4 calls x 4 words x 2 halves
_U16 = 1 << 16
# A block of a longer sequence (`FeatureArrays.positions`) draws at global keys col0 + j:
# its key offset col0 must be a multiple of this, so that every tile the kernels draw for
# (widths up to 128, each starting at a multiple of its width) still starts where
# `keep_tile` needs it to, and a traced offset suits `keep_mask_reference` (a multiple of
# CHUNK).
POSITION_ALIGN = 128


def keep_threshold(rate: float) -> int:
    """The 16-bit threshold: an element is kept iff its 16-bit draw is >= this."""
    return min(_U16 - 1, max(0, round(rate * _U16)))


def _c(x: int) -> jax.Array:
    """The int32 holding the bit pattern of the uint32 constant x."""
    return jnp.asarray(np.uint32(x).view(np.int32))


def _shr(x: jax.Array, n: int) -> jax.Array:
    """Logical right shift of int32-held uint32 bits."""
    return jax.lax.shift_right_logical(x, jnp.full(jnp.shape(x), n, jnp.int32))


def as_bits(x) -> jax.Array:
    """uint32 (or small non-negative int) values as the int32 bit patterns used here."""
    x = jnp.asarray(x)
    if x.dtype == jnp.uint32:
        return jax.lax.bitcast_convert_type(x, jnp.int32)
    return x.astype(jnp.int32)


def mulhi_limbs(a: jax.Array, m: int) -> jax.Array:
    """High 32 bits of a·m (unsigned; a int32-held, m a constant) from 16-bit limbs."""
    a_lo, a_hi = a & _c(0xFFFF), _shr(a, 16)
    m_lo, m_hi = _c(m & 0xFFFF), _c(m >> 16)
    lo_lo = a_lo * m_lo
    hi_lo = a_hi * m_lo
    lo_hi = a_lo * m_hi
    # As unsigned: (lo_lo >> 16) + (hi_lo & 0xFFFF) + lo_hi <= 2^32 - 1, no carry lost.
    cross = _shr(lo_lo, 16) + (hi_lo & _c(0xFFFF)) + lo_hi
    return a_hi * m_hi + _shr(hi_lo, 16) + _shr(cross, 16)


def mulhilo_limbs(a: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """(high, low) 32 bits of a·m (unsigned) in plain integer arithmetic."""
    return mulhi_limbs(a, m), a * _c(m)


def mulhilo_ptx(a: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """(high, low) 32 bits of a·m: `mul.hi.u32` for the high word (Triton kernels only)."""
    hi = ptx.elementwise("mul.hi.u32 $0, $1, $2;", a, jnp.broadcast_to(_c(m), a.shape),
                         dtype=jnp.int32)
    return hi, a * _c(m)


def philox4x32(c0, c1, c2, c3, k0, k1, *, mulhilo=mulhilo_limbs):
    """Philox-4x32-10 of counter (c0..c3) under key (k0, k1), as int32-held uint32 bits;
    arguments broadcastable (see `as_bits`), words returned at their broadcast shape.

    Nothing is broadcast before it has to be: in a kernel tile the counter words are a
    column vector, a row vector and two scalars, and the first rounds multiply those
    small operands, so only 15 of the 20 products run at the tile's full size.
    `mulhilo` gives (high, low) words of a product; scalars always take the limbs.
    """
    c0, c1, c2, c3, k0, k1 = (as_bits(x) for x in (c0, c1, c2, c3, k0, k1))
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in (c0, c1, c2, c3)))

    def product(a, m):
        return (mulhilo_limbs if a.size == 1 else mulhilo)(a, m)

    for r in range(ROUNDS):
        if r:
            k0 = k0 + _c(_W0)
            k1 = k1 + _c(_W1)
        hi0, lo0 = product(c0, _M0)
        hi1, lo1 = product(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return tuple(jnp.broadcast_to(x, shape) for x in (c0, c1, c2, c3))


def _join_last(x: jax.Array, y: jax.Array) -> jax.Array:
    """[..., n] x2 -> [..., n, 2]: the one interleave Triton's lowering offers (tt.join)."""
    return jnp.concatenate([x[..., None], y[..., None]], axis=-1)


def _keep_halves(word: jax.Array, threshold: int) -> jax.Array:
    """[..., n] words -> bool [..., n, 2]: keep flags of their low and high 16-bit halves."""
    return _join_last((word & _c(0xFFFF)) >= threshold, _shr(word, 16) >= threshold)


def keep_tile(seed_ref, b, h, rows: jax.Array, col_start, n_cols: int, *, rate: float,
              on_gpu: bool) -> jax.Array:
    """Kernel side: bool [len(rows), n_cols], True = keep, for columns [col_start,
    col_start + n_cols) of query rows `rows` [m] of head h (a scalar, or [m]: each row's
    head) in batch b. `seed_ref` holds the seed's two words as int32 bit patterns (see
    `as_bits`). n_cols is a multiple of 32 or 16 and col_start a multiple of n_cols (true
    for every kernel tile); a 16-wide tile computes its chunk's 4 calls and keeps 2 words."""
    m = rows.shape[0]
    chunks = max(1, n_cols // CHUNK)
    col_start = jnp.asarray(col_start, jnp.int32)
    c0 = (col_start // CHUNK) * 4 + jnp.arange(4 * chunks, dtype=jnp.int32)
    h = jnp.asarray(h, jnp.int32)
    h = h[:, None] if h.ndim == 1 else h  # one head per row (decode's packed GQA rows)
    w = philox4x32(c0[None, :], rows.astype(jnp.int32)[:, None], h, b, seed_ref[0],
                   seed_ref[1], mulhilo=mulhilo_ptx if on_gpu else mulhilo_limbs)
    threshold = keep_threshold(rate)
    if n_cols % CHUNK:  # 16 columns: words a = 0, 1 or a = 2, 3 of the chunk
        upper = (col_start // (CHUNK // 2)) % 2 == 1
        w = [jnp.where(upper, w[2], w[0]), jnp.where(upper, w[3], w[1])]
        x = [_keep_halves(word, threshold).reshape(m, 1, 4, 2) for word in w]
        y = _join_last(x[0], x[1])  # [m, c, q, p, a]
        return jnp.transpose(y, (0, 1, 4, 2, 3)).reshape(m, n_cols)
    x = [_keep_halves(word, threshold).reshape(m, chunks, 4, 2) for word in w]
    y = _join_last(_join_last(x[0], x[1]), _join_last(x[2], x[3]))  # [m, c, q, p, a%2, a//2]
    return jnp.transpose(y, (0, 1, 5, 4, 2, 3)).reshape(m, n_cols)


def keep_mask_reference(seed: jax.Array, shape: tuple[int, int, int, int], rate: float, *,
                        offsets: tuple = (0, 0, 0, 0)) -> jax.Array:
    """Plain JAX: the keep-mask bool[B, H, T, S] every kernel applies for this seed, or, with
    `offsets` (b0, h0, i0, j0), the block of that shape starting there in the full mask.
    Any offset may be traced; a traced j0 must be a multiple of 32."""
    batch, heads, seq_q, seq_k = shape
    b0, h0, i0, j0 = offsets
    if isinstance(j0, int):
        first, skip = j0 // CHUNK, j0 % CHUNK  # draws are sliced from the first chunk
    else:
        first, skip = jnp.asarray(j0, jnp.int32) // CHUNK, 0
    chunks = -(-(skip + seq_k) // CHUNK)
    seed = as_bits(seed)
    index = lambda start, n: jnp.asarray(start, jnp.int32) + jnp.arange(n, dtype=jnp.int32)
    c0 = index(4 * first, 4 * chunks)[None, None, None, :]
    c1 = index(i0, seq_q)[None, None, :, None]
    c2 = index(h0, heads)[None, :, None, None]
    c3 = index(b0, batch)[:, None, None, None]
    words = jnp.stack(philox4x32(c0, c1, c2, c3, seed[0], seed[1]), axis=-1)  # [.., 4c+q, a]
    halves = jnp.stack([words & _c(0xFFFF), _shr(words, 16)], axis=-1)  # [.., 4c+q, a, p]
    halves = halves.reshape(batch, heads, seq_q, chunks, 4, 4, 2)  # [.., c, q, a, p]
    draws = jnp.swapaxes(halves, -3, -2).reshape(batch, heads, seq_q, chunks * CHUNK)
    return draws[..., skip:skip + seq_k] >= jnp.int32(keep_threshold(rate))


def keep_block(seed: jax.Array, shape: tuple[int, int, int, int], rate: float, *,
               broadcast: bool = False, rows=0, cols=0) -> jax.Array:
    """XLA's side of the tiers' draws: the keep-mask bool[B, H, T, S] of a block of scores
    whose rows and keys start at `rows` and `cols` of the whole call's (a traced `cols` a
    multiple of 32), from the tiers' runtime seed: uint32[2], or [4] whose words 2 and 3
    are a shard's global batch and head offsets (`problem.Inputs`). With `broadcast`, the
    one mask [1, 1, T, S] every batch row and head shares, drawn at batch 0 and head 0
    wherever the shard is. The kernels' side is `static.dropout_keep`."""
    batch, heads, seq_q, seq_k = shape
    if broadcast:
        return keep_mask_reference(seed[:2], (1, 1, seq_q, seq_k), rate,
                                   offsets=(0, 0, rows, cols))
    b0, h0 = (seed[2], seed[3]) if seed.shape[0] == 4 else (0, 0)
    return keep_mask_reference(seed[:2], shape, rate, offsets=(b0, h0, rows, cols))
