"""The arithmetic of the attention kernels: matrix products and their rounding, the online
softmax, lse and its exact pair, the soft cap, and the GPU's fast special functions.

16-bit kernels keep scores in the log2 domain (scaled by log2(e)), so exp2 takes them
directly. float32 kernels keep natural-log scores, as XLA does, and scale only the
difference to the row's max or lse by log2(e) (`KernelStatic.natural`): rounding
scale·log2(e)·q·kᵀ at |score| ~ 250 cost P about twice XLA's error. Functions that take
`st` read its `score_unit`, `exp2`, `exp2_arg`, `tanh` and the problem's soft cap.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from pallas_kernels import ptx
from pallas_kernels.tiles import i32

if TYPE_CHECKING:  # the record's module imports this one
    from pallas_kernels.static import KernelStatic

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


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
    MMA (the forward measured slower at D >= 512; docs/benchmarks.md, "lse accuracy").

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


def add_bias(s, bias, st: KernelStatic):
    """Scores plus a bias tile (natural-log units) converted to the scores' units."""
    bias = bias.astype(jnp.float32)
    return s + (bias if st.problem.natural else bias * LOG2E)


def soft_cap(s, st: KernelStatic):
    """c·tanh(x / c) of scores `s` in `st.score_unit`s (x = s / unit): the cap scaled to
    the scores' units, so that no extra multiply reaches the natural-log logits."""
    cap = st.problem.softcap * st.score_unit
    return cap * st.tanh(s * (1.0 / cap))


def soft_cap_grad(s_capped, st: KernelStatic):
    """d capped / d x at the capped scores: 1 - tanh², tanh = capped / (c·unit); finite
    wherever the capped score is (callers zero the hidden keys' dS by P = 0 first)."""
    t = s_capped * (1.0 / (st.problem.softcap * st.score_unit))
    return 1.0 - t * t


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
    p = st.problem
    return (st.fast_softmax and not per_chunk and p.bias_shape is None and p.scale > 0
            and p.softcap is None)


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
    if not st.problem.natural:
        return jnp.where(has_keys, (m_i + jnp.log2(l_safe)) * LN2, -jnp.inf), None
    log_l = jnp.log2(l_safe) * LN2
    hi = m_i + log_l
    back = hi - m_i
    lo = (m_i - (hi - back)) + (log_l - back)
    return jnp.where(has_keys, hi, -jnp.inf), jnp.where(has_keys, lo, 0.0)


def join_sink(m_i, l_i, acc, sink, st: KernelStatic):
    """The running (max, sum, accumulator) of rows with the head's sink logit `sink`
    (natural-log units, a scalar) joined to the denominator: one more key, no value."""
    sink_u = sink * st.score_unit
    m_new = jnp.maximum(m_i, sink_u)
    alpha = st.exp2(st.exp2_arg(m_i - m_new))  # m_i = -inf (no key yet): 0
    l_new = l_i * alpha + st.exp2(st.exp2_arg(sink_u - m_new))
    return m_new, l_new, acc * alpha[:, None]
