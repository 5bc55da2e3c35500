"""Helpers shared by the attention kernels (forward, backward, decode).

Conventions used throughout `pallas_kernels`:
- q [B, T, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv], o like q with Dv; lse [B, Hq, T] f32.
- bias/mask arrive 4-D, [b, h, t, s] with each dim 1 or full. A dim of size 1 is
  read at index 0 (stride 0): broadcast dims are never materialised.
- Every tile is a power of two; ragged edges are handled with load/store masks.
- 16-bit kernels keep scores in the log2 domain (scaled by log2(e)), so exp2 takes
  them directly. float32 kernels keep natural-log scores, as XLA does, and scale
  only the difference to the row's max or lse by log2(e) (`KernelStatic.natural`):
  rounding scale·log2(e)·q·kᵀ at |score| ~ 250 cost P about twice XLA's error.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import dropout, ptx

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# Triton's dot needs every tile dim >= 16.
MIN_TILE = 16


@dataclasses.dataclass(frozen=True)
class KernelStatic:
    """What a kernel body knows at trace time: the problem's sizes and options, the
    launch config (the kernel's own config class), and the outer extent of its mask
    block lists (1 when one list serves every outer block)."""

    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    scale: float
    causal: bool
    bias_shape: tuple[int, ...] | None
    mask_shape: tuple[int, ...] | None
    list_outer: int
    cfg: Any
    dropout_rate: float = 0.0  # > 0: a uint32[2] seed input follows the mask inputs
    interpret: bool = False  # Pallas' interpreter (no inline PTX)
    natural: bool = False  # scores in natural-log units (float32), else log2 units
    lse_pair: bool = False  # backward: lse arrives as an exact pair, inputs lse (hi) and lse_lo
    split_ds: bool = False  # backward: 16-bit dS enters dQ's and dK's matmuls as two words
    # backward: every row's keys fit in one tile; the "delta" input holds dlse, and δ comes
    # from the tile's own normalised P and dP (see pallas_kernels.bwd.rows_in_one_tile)
    own_delta: bool = False
    # The language-model features (`Features`): the window (left, right) and the soft cap
    # are static; which runtime arrays are inputs (segment ids with their per-query-block
    # key-block ranges, q lengths, kv lengths, sinks) follow the seed, in that order.
    window: tuple[int, int] | None = None
    softcap: float | None = None
    segment_ids: bool = False
    q_lengths: bool = False
    kv_lengths: bool = False
    sinks: bool = False

    @property
    def ranged(self) -> bool:
        """Whether the key blocks a query block visits are bounded by the window, the
        segments or the lengths (`feature_block_range`), with their element masks."""
        return (self.window is not None or self.segment_ids or self.q_lengths
                or self.kv_lengths)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def score_unit(self) -> float:
        """Score units per natural-log unit: 1, or log2(e) in the log2 domain."""
        return 1.0 if self.natural else LOG2E

    def exp2_arg(self, x):
        """A score difference `x` (≤ 0 near a row's max) as exp2's argument. Scaling the
        small difference, not the score, costs no rounding at the score's magnitude."""
        return x * LOG2E if self.natural else x

    def exp2(self, x):
        """2^x of a float32 tile, as the softmax uses it.

        Pallas lowers `jnp.exp2` to libdevice's `__nv_exp2f`, which the Triton inside
        jaxlib compiled slower than the single instruction (docs/history.md, "exp2 and
        fma"). 16-bit kernels on the GPU use `ex2.approx.ftz.f32` instead,
        as Triton's own `tl.math.exp2` does. Its results below 2^-126 become 0, invisible next to a row's
        max term of 1, and its relative error is about 2^-22, far below a 16-bit output's
        2^-8. float32 kernels and the interpreter keep `jnp.exp2`, whose
        gradients were checked against XLA's in the GPU fuzz. So do head dims above 256
        (see `fast_softmax`)."""
        if not self.fast_softmax:
            return jnp.exp2(x)
        return fast_exp2(x)

    def tanh(self, x):
        """tanh of a float32 tile, as the soft cap uses it: `fast_tanh` where the softmax is
        fast (`fast_softmax`), else `jnp.tanh` (libdevice's `tanhf`, which made the capped
        fused kernels the slower; docs/history.md, the soft cap's tanh)."""
        if not self.fast_softmax:
            return jnp.tanh(x)
        return fast_tanh(x)

    @property
    def fast_softmax(self) -> bool:
        """Whether the softmax uses `fast_exp2` and `fma` (16-bit, on the GPU, head dims
        up to 256). These gave 2-13% at D = 64-256 on the H200 (docs/history.md, exp2 and fma).
        At D = 512 they made the forward slower: that kernel already spills at 255
        registers, so D > 256 keeps the plain operations."""
        return (not self.interpret and not self.natural
                and max(self.head_dim, self.head_dim_v) <= 256)


def fast_exp2(x: jax.Array) -> jax.Array:
    """2^x with the GPU's `ex2.approx.ftz.f32` (Triton kernels only; float32 in and out)."""
    return ptx.elementwise("ex2.approx.ftz.f32 $0, $1;", x, dtype=jnp.float32)


def fast_tanh(x: jax.Array) -> jax.Array:
    """tanh(x) = 1 - 2 / (1 + 2^(2x·log2 e)) with the GPU's `ex2.approx.ftz.f32` and
    `rcp.approx.ftz.f32`: two special-function operations and no branch (Triton kernels only;
    float32 in and out). Its absolute error is about 2^-22 (±1 exactly at ±inf), far below
    a 16-bit output's 2^-8 once the cap multiplies it."""
    e = fast_exp2(x * (2.0 * LOG2E))
    return 1.0 - 2.0 * ptx.elementwise("rcp.approx.ftz.f32 $0, $1;", e + 1.0,
                                       dtype=jnp.float32)


def natural_units(dtype) -> bool:
    """Whether kernels on `dtype` inputs keep natural-log scores (float32)."""
    return jnp.dtype(dtype) == jnp.float32


def kernel_static(q, k, v, bias, mask, *, scale: float, causal: bool, cfg,
                  list_outer: int = 1, dropout_rate: float = 0.0,
                  interpret: bool = False, lse_pair: bool = False,
                  split_ds: bool = False, own_delta: bool = False,
                  window: tuple[int, int] | None = None, softcap: float | None = None,
                  features=None) -> KernelStatic:
    batch, seq_q, heads_q, head_dim = q.shape
    if own_delta and cfg.block_n < k.shape[1]:
        raise ValueError(f"own_delta needs every row's {k.shape[1]} keys in one tile; the "
                         f"config's block_n is {cfg.block_n}")
    return KernelStatic(batch=batch, seq_q=seq_q, seq_k=k.shape[1], heads_q=heads_q,
                        heads_kv=k.shape[2], head_dim=head_dim, head_dim_v=v.shape[3],
                        scale=float(scale), causal=causal,
                        bias_shape=None if bias is None else tuple(bias.shape),
                        mask_shape=None if mask is None else tuple(mask.shape),
                        list_outer=list_outer, cfg=cfg, dropout_rate=float(dropout_rate),
                        interpret=interpret, natural=natural_units(q.dtype),
                        lse_pair=lse_pair, split_ds=split_ds, own_delta=own_delta,
                        window=None if window is None else tuple(window),
                        softcap=None if softcap is None else float(softcap),
                        segment_ids=features is not None and features.q_segment_ids is not None,
                        q_lengths=features is not None and features.q_lengths is not None,
                        kv_lengths=features is not None and features.kv_lengths is not None,
                        sinks=features is not None and features.sinks is not None)


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


def dot(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False) -> jax.Array:
    """op(a) @ op(b) with a float32 accumulator, op = transpose where asked.

    float32 operands ask for IEEE precision: Triton's default for a float32 dot
    is TF32, which would miss the 1e-5 accuracy we promise for float32.
    """
    contract_a = 0 if trans_a else 1
    contract_b = 1 if trans_b else 0
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                               precision=precision, preferred_element_type=jnp.float32)


def accumulate_ds(acc: jax.Array, ds: jax.Array, operand: jax.Array, *, trans_a: bool = False,
                  split: bool = False) -> jax.Array:
    """acc + op(dS) @ operand, float32, for dS a float32 [m, n] tile: dS is rounded to the
    operand's dtype for the tensor cores (float32 operands take it as it is).

    `split` also feeds the rounding residual, dS - hi, as a second product of the same
    dtype, so dS enters with about twice the significant bits. A 16-bit dS costs a
    gradient ~eps·Σ|terms|, which is within the tolerance rule unless the terms cancel
    far below their size: an lse cotangent does that, as dS then holds d_lse·P, whose
    sum over MQA heads (dK) or keys (dQ) XLA's float32 softmax gradient keeps exact
    (in the GPU fuzz, dk 1.0e-2 against XLA's 2.2e-5). Both products are added to `acc`
    one after the other, so Triton chains them into the accumulator (a sum of the two
    products first would cost a float32 add per accumulator element)."""
    if operand.dtype == jnp.float32:
        return acc + dot(ds, operand, trans_a=trans_a)
    if not split:
        return acc + dot(ds.astype(operand.dtype), operand, trans_a=trans_a)
    hi, lo = split_words(ds, operand.dtype)
    return acc + dot(hi, operand, trans_a=trans_a) + dot(lo, operand, trans_a=trans_a)


def split_words(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) in a 16-bit `dtype` with hi + lo ≈ x (float32) to about twice dtype's
    significant bits: hi = x rounded to dtype, lo = the rest rounded to dtype.

    For bfloat16, hi is formed on the float32 bit pattern: adding half a bfloat16 ulp
    (0x8000) and clearing the low 16 bits rounds the magnitude to nearest (ties away from
    zero), and leaves hi a float32 whose conversion to bfloat16 is exact. That spares
    the convert-back of hi that `x - float32(bfloat16(x))` needs: per element an integer
    add and a mask instead of a single (unpacked) conversion, a shift and a permute."""
    if jnp.dtype(dtype) != jnp.bfloat16:
        hi = x.astype(dtype)
        return hi, (x - hi.astype(jnp.float32)).astype(dtype)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    hi32 = jax.lax.bitcast_convert_type((bits + jnp.uint32(0x8000)) & jnp.uint32(0xFFFF0000),
                                        jnp.float32)
    return hi32.astype(dtype), (x - hi32).astype(dtype)


# The widest head-dim chunk of one tensor-core accumulation chain when lse must be
# precise: per-chunk sums of 64 matched XLA's lse error on the H200 at D = 512-1024
# (a chain over 256 did not always: docs/benchmarks.md, "lse accuracy").
PRECISE_CHUNK = 64
# The widest head-dim chunk of one float32 dot (an in-order FMA chain) in float32
# kernels, whose chunks are then summed with compensation (`contract_chunks(compensated=True)`).
# The chain's rounding grows with its length: on the GPU fuzz draw of D=150, S=208 and
# logits ~ 170, chains of 64 gave dq 3.1x XLA's float32 error (H200) and chains of 16
# the floor set by rounding the logits themselves (emulated: 1.9e-4 -> 7.3e-5).
FLOAT32_CHUNK = 16


def rounds_per_chunk(dtype, precise_lse: bool = False) -> bool:
    """Whether q·kᵀ is summed over head-dim chunks, each rounded on its own
    (`contract_chunks(round_per_chunk=True)`, or `compensated=True` in float32): when lse
    must be precise, and always in float32. There the backward recomputes the logits and
    must get the forward's own values: float32 dots are in-order FMA sums, so the same
    chunks give the same bits in every kernel, whatever its tiles. With different
    chunkings the forward and backward logits differed by float32 roundings of |logit|
    (at logits ~ 300: P off by ~1e-5 relative), which gave gradients 3-9x the error of
    XLA's (D=149, scale 1.5)."""
    return precise_lse or jnp.dtype(dtype) == jnp.float32


def capped_for_rounding(cfg, dtype, precise_lse: bool = False):
    """(cfg, per_chunk): `per_chunk = rounds_per_chunk(dtype, precise_lse)`, and then the
    config's head-dim chunk (`block_d`) at most PRECISE_CHUNK wide (FLOAT32_CHUNK in
    float32)."""
    per_chunk = rounds_per_chunk(dtype, precise_lse)
    widest = FLOAT32_CHUNK if natural_units(dtype) else PRECISE_CHUNK
    if per_chunk and cfg.block_d > widest:
        cfg = dataclasses.replace(cfg, block_d=widest)
    return cfg, per_chunk


def contract_chunks(load_a, load_b, n_chunks: int, *, dynamic: bool, shape: tuple[int, int],
                    scale: float | None = None, round_per_chunk: bool = False,
                    compensated: bool = False):
    """scale·Σ_c load_a(c) @ load_b(c)ᵀ over head-dim chunks c, float32 [shape].

    `dynamic` walks the chunks with a fori_loop (one chunk of each operand live,
    software-pipelined by Triton like a matmul's K loop); otherwise the loop is
    unrolled in Python, and the loaders may return chunks loaded once up front.

    Triton feeds the running sum to the next chunk's MMA as its accumulator
    (it fuses `acc + dot(a, b)`), so by default one tensor-core accumulation
    chain spans the whole head dim. At D = 512-1024 that chain gives logits,
    and so lse, 3-5x the error of XLA's matmul. `round_per_chunk` (needs
    `scale`) adds `dot(a, b) * scale` instead, which Triton does not fuse: each
    chain then spans one chunk and the chunks are summed by round-to-nearest
    float32 FMAs, within XLA's error, at the price of waiting for every chunk's
    MMA (forward up to 1.6x slower at D >= 512; docs/benchmarks.md, "lse accuracy").

    `compensated` (float32) sums the chunks' products exactly instead, as a (hi, lo)
    pair (Knuth's TwoSum; each product has several uses, so Triton fuses none), and
    scales once at the end. A float32 dot is an in-order FMA chain whose error grows
    with its length: at D = 1024 a chain over the whole head dim gave dP errors that
    put the GPU fuzz's dk at 3.6x XLA's; chains of FLOAT32_CHUNK, summed
    with compensation, leave the rounding of the result itself as the main error.
    """
    if compensated:
        return _compensated_chunks(load_a, load_b, n_chunks, dynamic=dynamic, shape=shape,
                                   scale=scale)
    scale_each = round_per_chunk and scale is not None

    def product(c):
        part = dot(load_a(c), load_b(c), trans_b=True)
        return part * scale if scale_each else part

    if dynamic and n_chunks > 1:
        acc = jax.lax.fori_loop(i32(0), i32(n_chunks), lambda c, acc: acc + product(c),
                                jnp.zeros(shape, jnp.float32))
    else:
        acc = None
        for c in range(n_chunks):
            acc = product(c) if acc is None else acc + product(c)
    return acc if scale is None or scale_each else acc * scale


def _two_sum(hi, lo, part):
    """(hi, lo) + part as a new (hi, lo): hi the rounded sum, lo accumulating each
    step's rounding error (Knuth's TwoSum gives it exactly; its sum into lo rounds,
    at the magnitude of the errors, not of the sum)."""
    total = hi + part
    back = total - hi
    return total, lo + ((hi - (total - back)) + (part - back))


def _compensated_chunks(load_a, load_b, n_chunks: int, *, dynamic: bool, shape, scale):
    product = lambda c: dot(load_a(c), load_b(c), trans_b=True)
    if dynamic and n_chunks > 1:
        zeros = jnp.zeros(shape, jnp.float32)
        hi, lo = jax.lax.fori_loop(i32(0), i32(n_chunks),
                                   lambda c, acc: _two_sum(*acc, product(c)), (zeros, zeros))
    else:
        hi, lo = product(0), None
        for c in range(1, n_chunks):
            hi, lo = _two_sum(hi, 0.0 if lo is None else lo, product(c))
    total = hi if lo is None else hi + lo
    return total if scale is None else total * scale


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
               n_cols: int, extra_mask=None):
    """Store a [rows, cols] tile into a [B, N, H, D] ref, skipping out-of-bounds elements."""
    row_ok = (rows_start + iota(rows)) < n_rows
    col_ok = (cols_start + iota(cols)) < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    if extra_mask is not None:
        mask = mask & extra_mask
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


def bias_and_masks(s, st: KernelStatic, bias_ref, mask_ref, b, h, q_start, kv_start, rows,
                   cols, *, causal_mask: bool, with_mask: bool, mask_rows: bool = False,
                   features: "TileFeatures | None" = None, with_cap_grad: bool = False):
    """Scores [bm, bn] (in `st.score_unit`s) + bias, soft-capped, then mask, causal, the
    window, segments and lengths (`features`), and bounds as -inf.

    The order is the semantics' own (bias, then the cap, then the masks); forward and
    backward both call this, so they can never disagree on which scores exist.
    `rows`/`cols` are the tile's query/key indices; `mask_rows` also hides rows
    past T, for kernels that sum over query rows. `with_cap_grad` returns (scores, the
    soft cap's derivative at every element, finite even where a key is hidden; None
    without a cap).
    """
    cap_grad = None
    bm, bn = s.shape
    if st.bias_shape is not None:
        bias = load_broadcast_tile(
            bias_ref, broadcast_index(b, st.bias_shape[0]), broadcast_index(h, st.bias_shape[1]),
            q_start, bm, kv_start, bn, n_rows=st.seq_q, n_cols=st.seq_k, other=0)
        s = add_bias(s, bias, st)
    if st.softcap is not None:
        s = soft_cap(s, st)
        if with_cap_grad:
            cap_grad = soft_cap_grad(s, st)
    if with_mask:
        keep = load_broadcast_tile(
            mask_ref, broadcast_index(b, st.mask_shape[0]), broadcast_index(h, st.mask_shape[1]),
            q_start, bm, kv_start, bn, n_rows=st.seq_q, n_cols=st.seq_k, other=False)
        s = jnp.where(keep, s, -jnp.inf)
    if causal_mask:
        s = jnp.where(cols[None, :] <= rows[:, None] + (st.seq_k - st.seq_q), s, -jnp.inf)
    if features is not None:
        keep = features.keep(kv_start, rows, cols)
        if keep is not None:
            s = jnp.where(keep, s, -jnp.inf)
    if st.seq_k % bn != 0:
        s = jnp.where((cols < st.seq_k)[None, :], s, -jnp.inf)
    if mask_rows and st.seq_q % bm != 0:
        s = jnp.where((rows < st.seq_q)[:, None], s, -jnp.inf)
    return (s, cap_grad) if with_cap_grad else s


def soft_cap(s, st: KernelStatic):
    """c·tanh(x / c) of scores `s` in `st.score_unit`s (x = s / unit): the cap scaled to
    the scores' units, so that no extra multiply reaches the natural-log logits."""
    cap = st.softcap * st.score_unit
    return cap * st.tanh(s * (1.0 / cap))


def soft_cap_grad(s_capped, st: KernelStatic):
    """d capped / d x at the capped scores: 1 - tanh², tanh = capped / (c·unit); finite
    wherever the capped score is (callers zero the hidden keys' dS by P = 0 first)."""
    t = s_capped * (1.0 / (st.softcap * st.score_unit))
    return 1.0 - t * t


class TileFeatures:
    """The window, segment ids and lengths of one program's query rows (its loaded ids and
    lengths), for `bias_and_masks` and the block ranges of the kernels' walks."""

    def __init__(self, st: KernelStatic, refs: dict, b, q_start, bm: int):
        self.st = st
        self.refs = refs
        self.b = b
        self.q_ids = None
        if st.segment_ids:
            rows = q_start + iota(bm)
            self.q_ids = plgpu.load(refs["q_ids"].at[i32(b), ds(q_start, bm)],
                                    mask=rows < st.seq_q, other=0)
        self.q_len = refs["q_len"][i32(b)] if st.q_lengths else None
        self.kv_len = refs["kv_len"][i32(b)] if st.kv_lengths else None

    def keep(self, kv_start, rows, cols):
        """bool [bm, bn] (or None): the window, segments and lengths at rows × cols."""
        st, keep = self.st, None

        def both(a, x):
            return x if a is None else a & x
        if st.window is not None:
            shifted = rows[:, None] + (st.seq_k - st.seq_q)
            keep = ((cols[None, :] >= shifted - st.window[0])
                    & (cols[None, :] <= shifted + st.window[1]))
        if self.q_ids is not None:
            kv_ids = plgpu.load(self.refs["kv_ids"].at[i32(self.b), ds(kv_start, cols.shape[0])],
                                mask=cols < st.seq_k, other=0)
            keep = both(keep, self.q_ids[:, None] == kv_ids[None, :])
        if self.q_len is not None:
            keep = both(keep, (rows < self.q_len)[:, None])
        if self.kv_len is not None:
            keep = both(keep, (cols < self.kv_len)[None, :])
        return keep

    def kv_block_range(self, q_block, q_start, bm: int, bn: int, hi):
        """[lo, hi) of the key blocks rows [q_start, q_start + bm) can see, within the
        caller's `hi` (its causal limit, or all key blocks): the window's band, the
        segments' ranges (`segment_block_ranges`) and the lengths bound it."""
        st = self.st
        lo = i32(0)
        hi = i32(hi)
        shift = st.seq_k - st.seq_q
        if st.window is not None:
            left, right = st.window
            lo = jnp.maximum(q_start + shift - left, 0) // bn
            last = jnp.minimum(q_start + bm - 1, st.seq_q - 1)
            hi = jnp.minimum(hi, (jnp.maximum(last + shift + right + 1, 0) + bn - 1) // bn)
        if self.kv_len is not None:
            hi = jnp.minimum(hi, (jnp.maximum(self.kv_len, 0) + bn - 1) // bn)
        if self.q_len is not None:
            hi = jnp.where(q_start < self.q_len, hi, lo)
        if st.segment_ids:
            ranges = self.refs["seg_ranges"]
            lo = jnp.maximum(lo, ranges[i32(self.b), i32(q_block), 0])
            hi = jnp.minimum(hi, ranges[i32(self.b), i32(q_block), 1])
        return lo, jnp.maximum(hi, lo)


def q_block_range(st: KernelStatic, refs: dict, b, kv_block, kv_start, bm: int, bn: int,
                  lo, hi):
    """[lo, hi) of the query blocks that see any of the keys [kv_start, kv_start + bn),
    within the caller's [lo, hi) (causality's, or all query blocks): the transpose of
    `TileFeatures.kv_block_range`, for the kernels that walk query blocks (dK, dV); the
    segment ranges here are per key block (`feature_inputs(over_kv=False)`)."""
    lo, hi = i32(lo), i32(hi)
    shift = st.seq_k - st.seq_q
    if st.window is not None:
        left, right = st.window
        # Row i sees key j iff j - shift - right <= i <= j - shift + left.
        lo = jnp.maximum(lo, jnp.maximum(kv_start - shift - right, 0) // bm)
        last_key = jnp.minimum(kv_start + bn - 1, st.seq_k - 1)
        hi = jnp.minimum(hi, (jnp.maximum(last_key - shift + left + 1, 0) + bm - 1) // bm)
    if st.q_lengths:
        hi = jnp.minimum(hi, (jnp.maximum(refs["q_len"][i32(b)], 0) + bm - 1) // bm)
    if st.kv_lengths:
        hi = jnp.where(kv_start < refs["kv_len"][i32(b)], hi, lo)
    if st.segment_ids:
        ranges = refs["seg_ranges"]
        lo = jnp.maximum(lo, ranges[i32(b), i32(kv_block), 0])
        hi = jnp.minimum(hi, ranges[i32(b), i32(kv_block), 1])
    return lo, jnp.maximum(hi, lo)


def sink_share(st: KernelStatic, refs: dict, h, lse_hi, lse_lo=None):
    """The sink's probability e^(sink - lse) of each row ([bm], 0 without sinks), from the
    rows' lse in score units (and its low word): what the keys' P lack from 1."""
    if not st.sinks:
        return None
    diff = refs["sinks"][i32(h)] * st.score_unit - lse_hi
    if lse_lo is not None:
        diff = diff - lse_lo
    return st.exp2(st.exp2_arg(diff))


def segment_block_ranges(q_ids, kv_ids, *, block_m: int, block_n: int) -> jax.Array:
    """int32 [B, nq, 2]: for each query block of `block_m` rows, the key blocks
    [first, last + 1) of `block_n` keys whose id ranges (min to max) meet the block's
    ([0, 0) where none does). A cheap XLA pass over the ids ([B, nq, nk] booleans, never
    [T, S]); exact for contiguous (sorted) segments, a superset for others: the element
    masks decide, the range only skips blocks."""
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
    return jnp.stack([lo, hi], axis=-1).astype(jnp.int32)


def feature_inputs(features, *, block_m: int, block_n: int, over_kv: bool = True) -> list:
    """The kernel inputs the feature arrays bring, in `KernelStatic`'s order: q ids, kv ids
    and their block ranges (per query block: the key blocks, `over_kv`; else per key block:
    the query blocks), q lengths, kv lengths, sinks (float32)."""
    if features is None:
        return []
    out = []
    if features.q_segment_ids is not None:
        q_ids, kv_ids = features.q_segment_ids, features.kv_segment_ids
        ranges = (segment_block_ranges(q_ids, kv_ids, block_m=block_m, block_n=block_n)
                  if over_kv else
                  segment_block_ranges(kv_ids, q_ids, block_m=block_n, block_n=block_m))
        out += [q_ids, kv_ids, ranges]
    if features.q_lengths is not None:
        out.append(features.q_lengths)
    if features.kv_lengths is not None:
        out.append(features.kv_lengths)
    if features.sinks is not None:
        out.append(features.sinks.astype(jnp.float32))
    return out


def feature_names(st: KernelStatic) -> list[str]:
    """The names of the feature inputs' refs, in `feature_inputs`' order."""
    return (["q_ids", "kv_ids", "seg_ranges"] * st.segment_ids + ["q_len"] * st.q_lengths
            + ["kv_len"] * st.kv_lengths + ["sinks"] * st.sinks)


def pop_feature_refs(st: KernelStatic, refs: list) -> dict:
    """The feature inputs' refs by name, popped from the front of `refs`."""
    out = {}
    if st.segment_ids:
        out["q_ids"], out["kv_ids"], out["seg_ranges"] = refs.pop(0), refs.pop(0), refs.pop(0)
    if st.q_lengths:
        out["q_len"] = refs.pop(0)
    if st.kv_lengths:
        out["kv_len"] = refs.pop(0)
    if st.sinks:
        out["sinks"] = refs.pop(0)
    return out


def join_sink(m_i, l_i, acc, sink, st: KernelStatic):
    """The running (max, sum, accumulator) of rows with the head's sink logit `sink`
    (natural-log units, a scalar) joined to the denominator: one more key, no value."""
    sink_u = sink * st.score_unit
    m_new = jnp.maximum(m_i, sink_u)
    alpha = st.exp2(st.exp2_arg(m_i - m_new))  # m_i = -inf (no key yet): 0
    l_new = l_i * alpha + st.exp2(st.exp2_arg(sink_u - m_new))
    return m_new, l_new, acc * alpha[:, None]


def add_bias(s, bias, st: KernelStatic):
    """Scores plus a bias tile (natural-log units) converted to the scores' units."""
    bias = bias.astype(jnp.float32)
    return s + (bias if st.natural else bias * LOG2E)


def online_softmax_step(s, m_i, l_i, st: KernelStatic, *, raw_scale: float | None = None):
    """One KV block of the online softmax, scores `s` [bm, bn] in `st.score_unit`s:
    (new row max, unnormalised p = e^(s - max), rescale factor for the running
    sums, new row sum). The row statistics are the undropped ones.

    With `raw_scale` (see `folds_scale`), `s` is the unscaled q·kᵀ (masked with -inf)
    and the scale is applied inside: the row max scales per row, and each element
    takes one fused multiply-add, s·scale - max, instead of a multiply and a subtract."""
    if raw_scale is None:
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    else:
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1) * raw_scale)
    # A row with no visible key so far keeps m = -inf; subtracting 0 instead
    # keeps exp2 at exactly 0 for it and never produces NaN.
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    if raw_scale is None:
        p = st.exp2(st.exp2_arg(s - m_use[:, None]))
    else:
        p = st.exp2(fma(s, raw_scale, -m_use[:, None]))
    alpha = st.exp2(st.exp2_arg(m_i - m_use))
    return m_new, p, alpha, l_i * alpha + jnp.sum(p, axis=1)


def folds_scale(st: KernelStatic, *, per_chunk: bool) -> bool:
    """Whether a kernel can hand its softmax unscaled scores (`raw_scale`): where
    `st.fast_softmax`, without a bias (a bias is added in score units), without
    per-chunk rounding (which scales each chunk's product), and with a positive scale
    (only then is max(s)·scale the max of the scaled scores; a zero scale would also
    turn masked -inf scores into NaN), and without a soft cap (it bends the scaled
    scores)."""
    return (st.fast_softmax and not per_chunk and st.bias_shape is None and st.scale > 0
            and st.softcap is None)


def fma(a: jax.Array, b: float, c: jax.Array) -> jax.Array:
    """a·b + c rounded once (`fma.rn.f32`; Triton kernels only): a [m, n], b a Python
    float, c broadcastable to a. Written out because Pallas' lowering does not
    contract a multiply and an add into one instruction."""
    c = jnp.broadcast_to(c, a.shape)
    return ptx.elementwise("fma.rn.f32 $0, $1, $2, $3;", a,
                           jnp.broadcast_to(jnp.float32(b), a.shape), c, dtype=jnp.float32)


def row_lse(m_i, l_safe, has_keys, st: KernelStatic):
    """(lse, lo) of rows with running max `m_i` and sum `l_safe` (1 where the row has no
    keys): lse in natural-log units, -inf without keys. With natural units `lo` is the
    rounding error of lse = m + fl(log l) (Knuth's TwoSum, exact in float32), so a
    backward given the pair recomputes P = e^((s - lse) - lo) with no rounding at the
    scores' magnitude; in log2 units `lo` is None."""
    if not st.natural:
        return jnp.where(has_keys, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf), None
    log_l = jnp.log2(l_safe) * LN2
    hi = m_i + log_l
    back = hi - m_i
    lo = (m_i - (hi - back)) + (log_l - back)
    return jnp.where(has_keys, hi, -jnp.inf), jnp.where(has_keys, lo, 0.0)


def seed_inputs(dropout_rate: float, seed) -> list:
    """The kernel inputs that carry the dropout seed when dropping, else []: uint32[2], or
    uint32[4] whose last two words are a shard's global (batch, head) offsets."""
    if dropout_rate <= 0:
        return []
    if seed is None or seed.shape not in ((2,), (4,)):
        raise ValueError(f"dropout_rate={dropout_rate} needs seed, a uint32[2] (or [4]) array; "
                         f"got {None if seed is None else seed.shape}")
    return [dropout.as_bits(seed)]


def dropout_keep(st: KernelStatic, seed_ref, b, h, rows, kv_start, n_cols: int) -> jax.Array:
    """The tile's dropout keep-mask, bool [len(rows), n_cols] (see `dropout`). A shard of a
    partitioned call draws with its global batch and head indices (seed words 2 and 3)."""
    if seed_ref.shape[0] == 4:
        b = b + seed_ref[2]
        h = h + seed_ref[3]
    return dropout.keep_tile(seed_ref, b, h, rows, kv_start, n_cols, rate=st.dropout_rate,
                             on_gpu=not st.interpret)


def broadcast_index(index, size: int):
    """`index` for a full dim, 0 for a broadcast (size-1) dim."""
    return index if size != 1 else 0


def causal_block_limits(q_start, block_m: int, block_n: int, seq_q: int, seq_k: int):
    """For the query rows [q_start, q_start + block_m): (n_unmasked, n_total) KV blocks.

    Query i attends key j iff j <= i + (S - T). Blocks [0, n_unmasked) are fully
    visible to every row of the tile; blocks [n_unmasked, n_total) are partly
    visible and need the element-wise causal mask; later blocks are skipped.
    """
    shift = seq_k - seq_q
    # Keys visible to the last (valid) row and to the first row, as counts >= 0,
    # so the integer divisions below never see a negative operand.
    keys_last_row = jnp.maximum(jnp.minimum(q_start + block_m - 1, seq_q - 1) + shift + 1, 0)
    keys_first_row = jnp.maximum(q_start + shift + 1, 0)
    n_total = jnp.minimum((keys_last_row + block_n - 1) // block_n, cdiv(seq_k, block_n))
    n_unmasked = jnp.minimum(keys_first_row // block_n, n_total)
    return n_unmasked, n_total


def causal_q_block_limits(kv_start, block_m: int, block_n: int, seq_q: int, seq_k: int):
    """For the keys [kv_start, kv_start + block_n): (first, first_unmasked) query blocks.

    Query blocks before `first` see none of these keys (skipped); blocks in
    [first, first_unmasked) see some (element-wise causal mask); blocks from
    `first_unmasked` on see all of them.
    """
    shift = seq_k - seq_q
    n_q = cdiv(seq_q, block_m)
    first = jnp.minimum(jnp.maximum(kv_start - shift, 0) // block_m, n_q)
    all_visible_from = jnp.maximum(kv_start + block_n - 1 - shift, 0)
    first_unmasked = jnp.clip((all_visible_from + block_m - 1) // block_m, first, n_q)
    return first, first_unmasked


def block_visits(mask4: jax.Array, *, block_m: int, block_n: int, seq_q: int, seq_k: int,
                 causal: bool) -> jax.Array:
    """[mb, mh, nq, nk] bool: does tile (query block i, KV block j) hold a visible key?

    nq is 1 when neither the mask's T dim nor causality varies with the query
    block, nk likewise for the S dim. Reads the mask once; tiny next to it.
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
        # Tile (i, j) holds a visible key iff its first key j·bn is at most the limit
        # of its last row, i·bm + bm - 1 + S - T. Clamping that row to T - 1 (rows past
        # T are padding) would change nothing, as a tile's first key is below S; and
        # the clamp, `jnp.minimum`, is what XLA miscompiled on the GPU (jax 0.11.2,
        # H100: `0 <= min(i·bm + bm - 1, T - 1) + S - T` came out inverted at equality,
        # e.g. T=276, S=1, dropping the only visible tile; the HLO after optimization
        # was right, eager and CPU runs too; the repro is in docs/history.md).
        last_row_limit = jnp.arange(n_q) * block_m + (block_m - 1 + seq_k - seq_q)
        m = m & ((jnp.arange(n_kv) * block_n)[None, :] <= last_row_limit[:, None])[None, None]
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
                over_kv: bool) -> tuple[list, int]:
    """The kernel inputs a boolean mask brings ([mask, counts, indices], or [] without
    a mask) and the outer extent of its block lists."""
    if mask4 is None:
        return [], 1
    counts, indices = mask_block_lists(mask4, block_m=block_m, block_n=block_n, seq_q=seq_q,
                                       seq_k=seq_k, causal=causal, over_kv=over_kv)
    return [mask4, counts, indices], counts.shape[2]


def mask_block_lists(mask4: jax.Array, *, block_m: int, block_n: int, seq_q: int, seq_k: int,
                     causal: bool, over_kv: bool = True):
    """(counts, indices) of the blocks each query block (over_kv) or KV block must visit."""
    visits = block_visits(mask4, block_m=block_m, block_n=block_n, seq_q=seq_q, seq_k=seq_k,
                          causal=causal)
    n_q, n_kv = cdiv(seq_q, block_m), cdiv(seq_k, block_n)
    mb, mh, vq, vk = visits.shape
    if over_kv:
        visits = jnp.broadcast_to(visits, (mb, mh, vq, n_kv))
    else:
        visits = jnp.broadcast_to(visits, (mb, mh, n_q, vk))
    return visit_lists(visits, over_kv=over_kv)
