"""Indices and tiles of the Triton kernels: int32 index helpers, power-of-two tile sizes, and
masked loads and stores of [rows, cols] tiles from [B, N, H, D] arrays and from 4-D
bias/mask arrays whose size-1 dims broadcast (read with stride 0, never materialised).

Every tile is a power of two; ragged edges are handled with load/store masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
# Triton's dot needs every tile dim >= 16.
MIN_TILE = 16


def i32(x) -> jax.Array:
    """An int32 index, also under jax_enable_x64 (where Python ints become int64 and
    the interpreter rejects index tuples of mixed integer types)."""
    return jnp.asarray(x, dtype=jnp.int32)


def iota(n: int) -> jax.Array:
    return jnp.arange(n, dtype=jnp.int32)


def ds(start, size: int):
    """pl.ds with an int32 start."""
    return pl.ds(i32(start), size)


def chunk_start(c, width: int):
    """Start of head-dim chunk `c`: a Python int in static loops, a traced index
    (marked as a multiple of `width` for the compiler) in dynamic ones."""
    return c * width if isinstance(c, int) else pl.multiple_of(c * width, width)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def fit_block(requested: int, size: int) -> int:
    """A power-of-two tile no larger than needed for `size`, at least MIN_TILE."""
    return max(MIN_TILE, min(next_pow2(requested), next_pow2(size)))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def broadcast_index(index, size: int):
    """`index` for a full dim, 0 for a broadcast (size-1) dim."""
    return index if size != 1 else 0


def load_tile(ref, b, rows_start, rows, h, cols_start, cols, *, n_rows: int, n_cols: int,
              rows_valid=None):
    """A [rows, cols] tile of a [B, N, H, D] ref at (b, rows_start:, h, cols_start:), 0 outside.

    `rows_valid` (optional, bool [rows]) overrides the row bound check.
    Masks are only emitted for the edges that can actually be ragged.
    """
    row_ids = rows_start + iota(rows)
    col_ids = cols_start + iota(cols)
    mask = None
    if rows_valid is not None or n_rows % rows != 0:
        ok = rows_valid if rows_valid is not None else row_ids < n_rows
        mask = ok[:, None]
    if n_cols % cols != 0 or (isinstance(cols_start, int) and cols_start + cols > n_cols):
        col_ok = (col_ids < n_cols)[None, :]
        mask = col_ok if mask is None else mask & col_ok
    view = ref.at[i32(b), ds(rows_start, rows), i32(h), ds(cols_start, cols)]
    if mask is None:
        return plgpu.load(view)
    return plgpu.load(view, mask=mask, other=0)


def store_tile(ref, value, b, rows_start, rows, h, cols_start, cols, *, n_rows: int,
               n_cols: int):
    """Store a [rows, cols] tile into a [B, N, H, D] ref, skipping out-of-bounds elements."""
    row_ok = (rows_start + iota(rows)) < n_rows
    col_ok = (cols_start + iota(cols)) < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    plgpu.store(ref.at[i32(b), ds(rows_start, rows), i32(h), ds(cols_start, cols)],
                value.astype(ref.dtype), mask=mask)


def load_broadcast_tile(ref, b, h, rows_start, rows, cols_start, cols, *, n_rows: int,
                        n_cols: int, other):
    """A tile of a 4-D bias/mask ref [b?, h?, t?, s?] whose dims may be 1 (broadcast).

    Returns an array of shape [rows or 1, cols or 1] that broadcasts against the
    [rows, cols] score tile. `b`/`h` must already be 0 for broadcast dims.
    """
    full_rows = ref.shape[2] != 1
    full_cols = ref.shape[3] != 1
    r = ds(rows_start, rows) if full_rows else ds(0, 1)
    c = ds(cols_start, cols) if full_cols else ds(0, 1)
    mask = None
    if full_rows and n_rows % rows != 0:
        mask = ((rows_start + iota(rows)) < n_rows)[:, None]
    if full_cols and n_cols % cols != 0:
        col_ok = ((cols_start + iota(cols)) < n_cols)[None, :]
        mask = col_ok if mask is None else mask & col_ok
    view = ref.at[i32(b), i32(h), r, c]
    if mask is None:
        return plgpu.load(view)
    return plgpu.load(view, mask=mask, other=other)
