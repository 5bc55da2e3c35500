"""The `"pallas"` implementation: launch configs from `tuning`, kernels from `pallas_kernels`,
and the `custom_vjp` that ties the forward to the backward kernels.

The forward saves only q, k, v, the bias and mask as given, the output and lse (and, in
float32, lse's low word: O(B·Hq·T) beyond what the caller already holds); the backward
recomputes the probabilities tile by tile. No [T, S] matrix exists in either direction.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

import tuning
from ffpa_jax import chunked_path, partitioning, runtime_autotune
from ffpa_jax.chunked_path import ChunkPlan
from ffpa_jax.validation import Problem
from pallas_kernels import (BwdConfig, DecodeConfig, FwdConfig, bwd_dbias, bwd_exact_rows,
                            bwd_generic_dkdv, bwd_generic_dq, bwd_preproc, decode_attention,
                            decode_num_splits, fwd_generic, rows_in_one_tile)

# The decode path (split-KV, GQA heads packed into the tile) serves a query block
# this short against at least DECODE_MIN_KEYS keys; see `uses_decode`.
DECODE_MAX_QUERIES = 16
DECODE_MIN_KEYS = 128


@dataclasses.dataclass(frozen=True)
class Plan:
    """Everything static about one attention call on the Pallas path (hashable)."""

    scale: float
    causal: bool
    interpret: bool
    dropout_rate: float
    fwd: FwdConfig
    preproc: BwdConfig
    dq: BwdConfig
    dkdv: BwdConfig
    dbias: BwdConfig
    decode: DecodeConfig | None = None  # the forward runs the decode kernels when set
    decode_splits: int = 1
    # The forward writes its output in float32 (the vjp's forward: a 16-bit backward's
    # δ = rowsum(dO·O) must not see O rounded to 16 bits, or gradients that cancel
    # lose the precision XLA's own gradient keeps; float32 does not read O).
    float32_out: bool = False
    # The caller returns lse: the forward rounds q·kᵀ per head-dim chunk, which keeps lse
    # within XLA's error at large D and costs speed (pallas_kernels.common.contract_chunks).
    precise_lse: bool = False
    # float32: the forward returns lse as a pair, hi + lo = m + fl(log l) exactly (the
    # decode path: lo = 0); the backward takes that pair as its residual, corrects lo so
    # that its own P sums to 1 and computes
    # δ = Σ P·dP from its own P and dP (`bwd_exact_rows`), as XLA's softmax gradient
    # does. From one float32 lse, every P of a row was off by up to an ulp of |lse|,
    # ~1e-5 relative at logits ~ 300, which gave float32 gradients several times XLA's
    # error. (16-bit P is rounded to 16 bits anyway.)
    lse_pair: bool = False
    # The backward's lse cotangent is not a symbolic zero (the caller differentiates
    # through lse): dS then carries d_lse·P, whose sums over heads and keys XLA keeps in
    # float32, so 16-bit kernels feed dS to dQ's and dK's matmuls as two words
    # (`common.accumulate_ds`: two more of the backward's 7 matmuls). Without it, no cost.
    lse_cotangent: bool = False
    # Which tier runs each direction: "pallas" (the fused kernels above) or "chunked"
    # (ffpa_jax.chunked_path, planned by `chunk`). Both directions agree on the residuals
    # (out in float32, lse), so any pairing is exact.
    forward_tier: str = "pallas"
    backward_tier: str = "pallas"
    chunk: ChunkPlan | None = None


def uses_decode(problem: Problem) -> bool:
    """Decode path rule: T <= 16 queries against S >= 128 keys. There the generic
    forward's grid (one program per 64-row query block and head) is a few dozen
    programs reading all of K and V each; the decode kernels split the keys over
    the GPU and read K/V once per GQA group."""
    return problem.seq_q <= DECODE_MAX_QUERIES and problem.seq_k >= DECODE_MIN_KEYS


def decode_config(problem: Problem, *, has_bias: bool, autotune: str | None = None,
                  interpret: bool = False) -> tuple[DecodeConfig, int]:
    """The decode kernels' launch parameters and split count (tuned entry or default;
    without a tuned NUM_SPLITS, the heuristic of `decode_num_splits`)."""
    config = DecodeConfig.from_tuned(
        _launch_config("decode_fwd_stage1", problem, has_bias=has_bias, autotune=autotune,
                       interpret=interpret),
        _launch_config("decode_fwd_stage2", problem, has_bias=has_bias, autotune=autotune,
                       interpret=interpret))
    splits = config.num_splits or decode_num_splits(
        batch=problem.batch, heads_kv=problem.heads_kv,
        packed_rows=problem.group * problem.seq_q, seq_k=problem.seq_k,
        head_dim_v=problem.head_dim_v, config=config,
        multiprocessors=tuning.multiprocessor_count())
    return config, splits


def _launch_config(kernel: str, problem: Problem, *, has_bias: bool,
                   autotune: str | None = None, interpret: bool = False) -> dict:
    """Runtime autotune's winner when `autotune` is set (and it found one), else the
    tuned entry for this device, else the built-in default."""
    if autotune is not None:
        tuned = runtime_autotune.autotuned_config(kernel, problem, has_bias=has_bias,
                                                  mode=autotune, interpret=interpret)
        if tuned is not None:
            return tuned
    return tuning.launch_config(
        kernel, direction="backward" if kernel.startswith("bwd") else "forward",
        dtype=tuning.dtype_name(problem.dtype), headdim=max(problem.head_dim, problem.head_dim_v),
        seqlen_q=problem.seq_q, seqlen_k=problem.seq_k, causal=problem.is_causal,
        has_attn_bias=has_bias, has_dropout=problem.dropout_rate > 0,
        nheads_q=problem.heads_q, nheads_kv=problem.heads_kv, batch=problem.batch,
        bias_grad=has_bias if kernel.startswith("bwd") else None)


def fwd_config(problem: Problem, *, has_bias: bool, autotune: str | None = None,
               interpret: bool = False) -> FwdConfig:
    """fwd_generic's launch parameters for this problem (autotuned, tuned entry or default)."""
    return FwdConfig.from_tuned(_launch_config("fwd_generic", problem, has_bias=has_bias,
                                               autotune=autotune, interpret=interpret))


def bwd_config(kernel: str, problem: Problem, *, has_bias: bool, autotune: str | None = None,
               interpret: bool = False) -> BwdConfig:
    """A backward kernel's launch parameters (autotuned, tuned entry or default)."""
    return BwdConfig.from_tuned(_launch_config(kernel, problem, has_bias=has_bias,
                                               autotune=autotune, interpret=interpret))


def make_plan(problem: Problem, *, has_bias: bool, interpret: bool,
              autotune: str | None = None, precise_lse: bool = False,
              tiers: tuple[str, str] = ("pallas", "pallas"), step: str = "pallas") -> Plan:
    """The plan of one call. `tiers` = (forward tier, backward tier); `step` is the chunked
    tier's step between its GEMMs ("pallas", or "xla" where no GPU runs the kernels)."""
    tune = dict(has_bias=has_bias, autotune=autotune, interpret=interpret)
    decode, splits = (decode_config(problem, **tune) if uses_decode(problem) else (None, 1))
    chunk = (chunked_path.make_plan(problem, step=step, interpret=interpret)
             if "chunked" in tiers else None)
    plan = Plan(decode=decode, decode_splits=splits, scale=problem.scale,
                forward_tier=tiers[0], backward_tier=tiers[1], chunk=chunk,
                causal=problem.is_causal, interpret=interpret,
                dropout_rate=problem.dropout_rate, precise_lse=precise_lse,
                lse_pair=jnp.dtype(problem.dtype) == jnp.float32,
                fwd=fwd_config(problem, **tune),
                preproc=bwd_config("bwd_preproc", problem, **tune),
                dq=bwd_config("bwd_generic_dq", problem, **tune),
                dkdv=bwd_config("bwd_generic_dkdv", problem, **tune),
                dbias=bwd_config("bwd_dbias", problem, **tune))
    if autotune is not None:
        runtime_autotune.release_inputs()  # the benchmark's own inputs
    return plan


def forward_kernels(plan: Plan, q, k, v, bias, mask, seed):
    """(out, lse) from the forward kernel, or (out, hi, lo) with hi = lse and lo its low
    word when `plan.lse_pair` (see Plan). `seed` is the dropout seed (uint32[2]) or None.

    Every argument array has batch as dim 0 and heads as dim 2 (q/k/v) or dim 1
    (bias/mask), so this function is what a sharding wrapper partitions."""
    out_dtype = jnp.float32 if plan.float32_out else None
    if plan.forward_tier == "chunked":
        out, lse = chunked_path.forward(plan.chunk, q, k, v, bias, mask, seed)
        out = out if plan.float32_out else out.astype(q.dtype)
        return (out, lse, jnp.zeros_like(lse)) if plan.lse_pair else (out, lse)
    if plan.decode is not None:
        out, lse = decode_attention(q, k, v, bias, mask, scale=plan.scale, causal=plan.causal,
                                    config=plan.decode, num_splits=plan.decode_splits,
                                    interpret=plan.interpret, dropout_rate=plan.dropout_rate,
                                    seed=seed, out_dtype=out_dtype,
                                    precise_lse=plan.precise_lse)
        if not plan.lse_pair:
            return out, lse
        # The decode kernels merge their splits' lse: no exact pair here.
        return out, lse, jnp.zeros_like(lse)
    return fwd_generic(q, k, v, bias, mask, scale=plan.scale, causal=plan.causal,
                       config=plan.fwd, interpret=plan.interpret,
                       dropout_rate=plan.dropout_rate, seed=seed, out_dtype=out_dtype,
                       precise_lse=plan.precise_lse, lse_pair=plan.lse_pair)


def backward_kernels(plan: Plan, q, k, v, bias, mask, seed, out, *rows_and_cotangents):
    """(dq, dk, dv, dbias) from the backward kernels (dbias None without a bias).
    `rows_and_cotangents`: the forward's row statistics (lse, or hi and lo with
    `plan.lse_pair`), then d_out and d_lse."""
    if plan.lse_pair:
        lse, lse_lo, d_out, d_lse = rows_and_cotangents
    else:
        (lse, d_out, d_lse), lse_lo = rows_and_cotangents, None
    if plan.backward_tier == "chunked":
        chunk = dataclasses.replace(plan.chunk.for_backward(), lse_cotangent=plan.lse_cotangent)
        return chunked_path.backward(chunk, q, k, v, bias, mask, seed, out, lse, d_out, d_lse)
    # A row without keys has lse = -inf and no gradient path; drop its lse cotangent.
    d_lse = jnp.where(lse == -jnp.inf, 0.0, d_lse.astype(jnp.float32))
    own_delta = False
    if plan.lse_pair:
        delta, lse_lo = bwd_exact_rows(q, k, v, d_out, lse, d_lse, bias, mask, config=plan.dq,
                                       scale=plan.scale, causal=plan.causal,
                                       interpret=plan.interpret, dropout_rate=plan.dropout_rate,
                                       seed=seed, lse_lo=lse_lo)
    elif rows_in_one_tile(k.shape[1], plan.dq, plan.dkdv, plan.dbias):
        # Each kernel sees a row's keys in one tile and forms δ from its own P and dP.
        delta, own_delta = d_lse, True
    else:
        delta = bwd_preproc(out, d_out, d_lse, config=plan.preproc, interpret=plan.interpret)
    common = dict(scale=plan.scale, causal=plan.causal, interpret=plan.interpret,
                  dropout_rate=plan.dropout_rate, seed=seed, lse_lo=lse_lo, own_delta=own_delta)
    split = dict(split_ds=plan.lse_cotangent)
    dq = bwd_generic_dq(q, k, v, d_out, lse, delta, bias, mask, config=plan.dq, **common,
                        **split)
    dk, dv = bwd_generic_dkdv(q, k, v, d_out, lse, delta, bias, mask, config=plan.dkdv,
                              **common, **split)
    dbias = None
    if bias is not None and bias.shape[-1] == 1:
        dbias = _row_constant_dbias(d_lse, bias)
    elif bias is not None:
        dbias = bwd_dbias(q, k, v, d_out, lse, delta, bias, mask, config=plan.dbias,
                          **common).astype(bias.dtype)
    return dq, dk, dv, dbias


def _row_constant_dbias(d_lse, bias):
    """dbias of a bias broadcast over the keys (last dim 1), in closed form.

    Adding c to every logit of a row leaves P unchanged and adds c to lse, so
    d out / d c = 0 and d lse / d c = 1: dbias is d_lse summed over the bias's
    broadcast dims (rows without keys already carry d_lse = 0). The kernel's sum of
    dS over the row would reach the same value only up to the rounding of P to 16
    bits in the forward's P·V, which does not cancel in Σ_j dS_ij (it is exact in
    XLA's autodiff); the closed form is exact, with or without dropout.
    """
    per_row = d_lse[..., None]  # [B, Hq, T, 1]
    axes = tuple(i for i in range(3) if bias.shape[i] == 1 and per_row.shape[i] != 1)
    return jnp.sum(per_row, axis=axes, keepdims=True).astype(bias.dtype)


# Shard-local under jit when the inputs are sharded over batch and/or heads: each
# shard runs its own kernels, q/k/v are never gathered (see partitioning.py).
def _shift_seed(seed, batch_offset, head_offset):
    """A shard's dropout seed: the key's two words, then its global batch and head offsets
    (the kernels add them, so each shard draws its slice of the unsharded mask)."""
    offsets = jnp.stack([batch_offset, head_offset]).astype(jnp.uint32)
    return jnp.concatenate([seed[:2].astype(jnp.uint32), offsets])


def forward_row_outputs(plan: Plan) -> int:
    """How many row statistics [B, Hq, T] `forward_kernels` returns after out."""
    return 2 if plan.lse_pair else 1


_forward = partitioning.ShardLocal(forward_kernels, "forward", shift_seed=_shift_seed,
                                   row_outputs=forward_row_outputs)
_backward = partitioning.ShardLocal(backward_kernels, "backward", shift_seed=_shift_seed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan: Plan, q, k, v, bias, mask, seed):
    out, lse, *_ = _forward(plan, q, k, v, bias, mask, seed)  # a pair's lo is the vjp's
    return out, lse


def _vjp_plan(plan: Plan) -> Plan:
    return dataclasses.replace(plan, float32_out=True)


def _primal_value(x):
    return x.value if isinstance(x, CustomVJPPrimal) else x


def _cotangent(x) -> tuple[jax.Array, bool]:
    """(the cotangent as an array, whether it is a symbolic zero) for a vjp with
    `symbolic_zeros=True`: a symbolic zero is what the caller's unused output gets."""
    if isinstance(x, SymbolicZero):
        return jnp.zeros(x.shape, x.dtype), True
    return x, False


def _attention_fwd(plan: Plan, q, k, v, bias, mask, seed):
    q, k, v, bias, mask, seed = jax.tree.map(
        _primal_value, (q, k, v, bias, mask, seed),
        is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
    plan = _vjp_plan(plan)
    out32, *rows = _forward(plan, q, k, v, bias, mask, seed)
    # Rounding the float32 result here equals the kernel's own rounding on store, so the
    # primal (out, lse) is bit-identical to the undifferentiated call's.
    return (out32.astype(q.dtype), rows[0]), (q, k, v, bias, mask, seed, out32, *rows)


def _attention_bwd(plan: Plan, residuals, cotangents):
    q, k, v, bias, mask, seed, out, *rows = residuals
    (d_out, _), (d_lse, lse_unused) = map(_cotangent, cotangents)
    plan = dataclasses.replace(_vjp_plan(plan), lse_cotangent=not lse_unused)
    dq, dk, dv, dbias = _backward(plan, q, k, v, bias, mask, seed, out, *rows, d_out, d_lse)
    return dq, dk, dv, dbias, None, None  # the mask and the seed get no gradient


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def pallas_attention(q, k, v, bias4, mask4, problem: Problem, *, interpret: bool,
                     seed: jax.Array | None = None, autotune: str | None = None,
                     precise_lse: bool = False, tiers: tuple[str, str] = ("pallas", "pallas"),
                     step: str = "pallas"):
    """(out, lse) through the kernels of `tiers` (forward, backward), differentiable with
    respect to q, k, v and bias; q/k/v batched, bias4/mask4 4-D or None; seed uint32[2] when
    dropping; `precise_lse` when the caller returns lse (see Plan)."""
    plan = make_plan(problem, has_bias=bias4 is not None, interpret=interpret,
                     autotune=autotune, precise_lse=precise_lse, tiers=tiers, step=step)
    return _attention(plan, q, k, v, bias4, mask4, seed)
