"""The differentiable call: a plan's forward and backward (pallas_kernels.tiers) tied by a
`custom_vjp`, each run shard-locally under sharded `jit` (ffpa_jax.partitioning).

The forward saves only the inputs as given (q, k, v, the bias and mask, the seed, the feature
arrays), the output in float32 and lse (and, in float32, lse's low word: O(B·Hq·T) beyond
what the caller already holds); the backward recomputes the probabilities block by block.
No [T, S] matrix is kept from one direction to the other. lse counts the sinks, so the
backward's probabilities exp(logits - lse) need no sink; the sinks' own gradient is
closed-form (`sinks_grad`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

from ffpa_jax import partitioning
from ffpa_jax.context_local import SequenceSplit
from pallas_kernels import tiers
from pallas_kernels.plan import Plan, row_outputs
from pallas_kernels.problem import Cotangents, Inputs, Saved


# Shard-local under jit when the inputs are sharded over batch and/or heads: each
# shard runs its own kernels, q/k/v are never gathered (see partitioning.py).
def _shift_seed(seed, batch_offset, head_offset):
    """A shard's dropout seed: the key's two words, then its global batch and head offsets
    (the kernels add them, so each shard draws its slice of the unsharded mask)."""
    offsets = jnp.stack([batch_offset, head_offset]).astype(jnp.uint32)
    return jnp.concatenate([seed[:2].astype(jnp.uint32), offsets])


# Sharded along the sequence, they run context parallelism over that mesh axis where the
# plan's tiers can place a block of the sequence (context_local.SequenceSplit).
_forward = partitioning.ShardLocal(tiers.forward, "forward", shift_seed=_shift_seed,
                                   row_outputs=row_outputs,
                                   context=SequenceSplit("forward"))
_backward = partitioning.ShardLocal(tiers.backward, "backward", shift_seed=_shift_seed,
                                    context=SequenceSplit("backward"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(plan: Plan, inputs: Inputs):
    # a pair's lo is the vjp's
    out, lse, *_ = _forward(plan, inputs)
    return out, lse


def _primal_value(x):
    return x.value if isinstance(x, CustomVJPPrimal) else x


def _cotangent(x) -> tuple[jax.Array, bool]:
    """(the cotangent as an array, whether it is a symbolic zero) for a vjp with
    `symbolic_zeros=True`: a symbolic zero is what the caller's unused output gets."""
    if isinstance(x, SymbolicZero):
        return jnp.zeros(x.shape, x.dtype), True
    return x, False


def _attention_fwd(plan: Plan, inputs: Inputs):
    inputs = jax.tree.map(_primal_value, inputs,
                          is_leaf=lambda x: isinstance(x, CustomVJPPrimal))
    out32, *rows = _forward(plan.for_vjp(), inputs)
    # Rounding the float32 result here equals the kernel's own rounding on store, so the
    # primal (out, lse) is bit-identical to the undifferentiated call's (where the plan
    # runs the same forward tier both ways: a `vjp_forward_tier` differs within the
    # tolerance rule, as tiers do).
    return (out32.astype(inputs.q.dtype), rows[0]), (inputs, Saved(out32, *rows))


def sinks_grad(sinks, out, lse, d_out, d_lse):
    """d sinks [Hq] in float32, in closed form: the sink's probability in row (b, h, i) is
    p = exp(sink[h] - lse), and the sink has no value, so d out/d sink = -p·out and
    d lse/d sink = p; summed over the rows, d sinks = Σ p·(d_lse - rowsum(dO·O)).
    O(B·Hq·T·Dv), never a [T, S] matrix; XLA partitions it like any jnp code."""
    p = jnp.exp(sinks[None, :, None] - lse)  # lse >= sink > -inf on every row
    rowsum = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out,
                        precision=jax.lax.Precision.HIGHEST)
    return jnp.sum(p * (d_lse.astype(jnp.float32) - rowsum), axis=(0, 2))


def _attention_bwd(plan: Plan, residuals, cotangents):
    inputs, saved = residuals
    (d_out, _), (d_lse, lse_unused) = map(_cotangent, cotangents)
    plan = dataclasses.replace(plan.for_vjp(), lse_cotangent=not lse_unused)
    dq, dk, dv, dbias = _backward(plan, inputs, saved, Cotangents(d_out, d_lse))
    features = inputs.features
    d_sinks = None
    if features.sinks is not None:
        d_sinks = sinks_grad(features.sinks, saved.out, saved.lse, d_out, d_lse)
    # ids, lengths and positions get no gradient; the mask and the seed neither.
    d_features = features._replace(q_segment_ids=None, kv_segment_ids=None, q_lengths=None,
                                   kv_lengths=None, sinks=d_sinks, positions=None)
    return (Inputs(dq, dk, dv, dbias, None, None, d_features),)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def attention(plan: Plan, inputs: Inputs):
    """(out, lse) through the tiers of `plan`, differentiable with respect to q, k, v, the
    bias and the sinks; `inputs` batched (bias/mask 4-D or None, the seed uint32[2] when
    dropping)."""
    return _attention(plan, inputs)
