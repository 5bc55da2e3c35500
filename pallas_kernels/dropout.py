"""The dropout keep-mask: Philox-4x32-10, evaluated inside the kernels and in plain JAX.

The keep decision for score element (b, h, i, j) is a pure function of a 64-bit
seed (two uint32 words) and of (b, h, i, j):

    words = philox4x32_10(counter=(j // 8, i, h, b), key=(seed0, seed1))
    t     = j % 8
    u     = 16-bit half (t % 2) of words[t // 2]        (0 = low half)
    keep  = u >= threshold,   threshold = round(rate · 2^16)

One Philox call serves 8 neighbouring columns, 16 bits each: the keep
probability is 1 - threshold / 2^16 (within 2^-17 of 1 - rate), and the
generator costs an eighth of a call per score element. Nothing here depends on
block sizes or the grid, so every kernel (and `keep_mask_reference`) that asks
about (b, h, i, j) gets the same answer.

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
COLUMNS_PER_CALL = 8  # 4 words x 2 halves of 16 bits
_U16 = 1 << 16


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


def mulhi_ptx(a: jax.Array, m: int) -> jax.Array:
    """High 32 bits of a·m with the GPU's own instruction (Triton kernels only)."""
    return ptx.elementwise("mul.hi.u32 $0, $1, $2;", a, jnp.broadcast_to(_c(m), a.shape),
                           dtype=jnp.int32)


def philox4x32(c0, c1, c2, c3, k0, k1, *, mulhi=mulhi_limbs):
    """Philox-4x32-10 of counter (c0..c3) under key (k0, k1), as int32-held uint32 bits;
    arguments broadcastable (see `as_bits`)."""
    c0, c1, c2, c3, k0, k1 = (as_bits(x) for x in (c0, c1, c2, c3, k0, k1))
    shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in (c0, c1, c2, c3)))
    c0, c1, c2, c3 = (jnp.broadcast_to(x, shape) for x in (c0, c1, c2, c3))
    for r in range(ROUNDS):
        if r:
            k0 = k0 + _c(_W0)
            k1 = k1 + _c(_W1)
        hi0, lo0 = mulhi(c0, _M0), c0 * _c(_M0)
        hi1, lo1 = mulhi(c2, _M1), c2 * _c(_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _join_last(x: jax.Array, y: jax.Array) -> jax.Array:
    """[..., n] x2 -> [..., n, 2]: the one interleave Triton's lowering offers (tt.join)."""
    return jnp.concatenate([x[..., None], y[..., None]], axis=-1)


def draws_tile(seed0, seed1, b, h, rows: jax.Array, col_start, n_cols: int, *,
               on_gpu: bool) -> jax.Array:
    """The 16-bit draws (int32 in [0, 2^16)) of columns [col_start, col_start + n_cols)
    for query rows `rows` [m] of head h (a scalar, or [m]: each row's head), batch b:
    [m, n_cols]. col_start and n_cols
    must be multiples of 8 (true for every kernel tile)."""
    groups = n_cols // COLUMNS_PER_CALL
    c0 = jnp.asarray(col_start, jnp.int32) // COLUMNS_PER_CALL + jnp.arange(groups,
                                                                            dtype=jnp.int32)
    h = jnp.asarray(h, jnp.int32)
    h = h[:, None] if h.ndim == 1 else h  # one head per row (decode's packed GQA rows)
    w = philox4x32(c0[None, :], rows.astype(jnp.int32)[:, None], h, b, seed0, seed1,
                   mulhi=mulhi_ptx if on_gpu else mulhi_limbs)
    # words[2a + b'] at [..., a, b'], then halves at [..., a, b', c]: column 8g + 4a + 2b' + c
    # is half c of word 2a + b' = (t // 2), half t % 2, as the module docstring says.
    words = _join_last(_join_last(w[0], w[2]), _join_last(w[1], w[3]))
    halves = _join_last(words & _c(0xFFFF), _shr(words, 16))
    return halves.reshape(rows.shape[0], n_cols)


def keep_tile(seed_ref, b, h, rows: jax.Array, col_start, n_cols: int, *, rate: float,
              on_gpu: bool) -> jax.Array:
    """Kernel side: bool [len(rows), n_cols], True = keep. `seed_ref` holds the seed's
    two words as int32 bit patterns (see `as_bits`)."""
    draws = draws_tile(seed_ref[0], seed_ref[1], b, h, rows, col_start, n_cols, on_gpu=on_gpu)
    return draws >= jnp.int32(keep_threshold(rate))


def keep_mask_reference(seed: jax.Array, shape: tuple[int, int, int, int],
                        rate: float) -> jax.Array:
    """Plain JAX: the keep-mask bool[B, H, T, S] every kernel applies for this seed."""
    batch, heads, seq_q, seq_k = shape
    groups = -(-seq_k // COLUMNS_PER_CALL)
    seed = as_bits(seed)
    c0 = jnp.arange(groups, dtype=jnp.int32)[None, None, None, :]
    c1 = jnp.arange(seq_q, dtype=jnp.int32)[None, None, :, None]
    c2 = jnp.arange(heads, dtype=jnp.int32)[None, :, None, None]
    c3 = jnp.arange(batch, dtype=jnp.int32)[:, None, None, None]
    words = jnp.stack(philox4x32(c0, c1, c2, c3, seed[0], seed[1]), axis=-1)  # [..., g, 4]
    halves = jnp.stack([words & _c(0xFFFF), _shr(words, 16)], axis=-1)  # [..., g, 4, 2]
    draws = halves.reshape(batch, heads, seq_q, groups * COLUMNS_PER_CALL)[..., :seq_k]
    return draws >= jnp.int32(keep_threshold(rate))
