"""Context parallelism: exact attention over a sequence split across devices along a mesh
axis (issue 32). Each device holds a shard of the sequence of q, k, v (and of the segment
ids) and gets back its shard of out and lse; the result is the unsharded call's, with global
positions (causality, windows, lengths and dropout's keep decisions are the whole
sequence's).

Two ways in:
- inside a `shard_map` (`attention(..., context_axis=name)`): `attention` here, a
  `custom_vjp` over this shard's forward and backward (`context_local`). The forward saves
  the inputs as given and this shard's out and lse; the backward recomputes the blocks.
- under `jax.jit` without a `shard_map`, inputs sharded along the sequence: a planned
  call's shard-local wrapper splits the sequence itself (`context_local.SequenceSplit` in
  `vjp.py`); with `context_strategy=` given, `jit_attention` here does it for any tier
  (its own `custom_vjp` around `partitioning.ShardLocal` wrappers whose plan is the
  `ContextCall`).

The sinks' gradient is closed-form from the merged out and lse (`vjp.sinks_grad`). The
gradients of arrays every shard holds alike (a broadcast bias, the sinks) are sums over the
shards: inside a `shard_map` that checks varying axes the backward sums them itself (their
cotangent must be the same on every shard); with check_vma=False `shard_map`'s transpose
does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax

from ffpa_jax import context_blocks as cb
from ffpa_jax import context_local, partitioning
from ffpa_jax.context_blocks import ContextCall
from ffpa_jax.vjp import _cotangent, _primal_value, _shift_seed as shift_seed, sinks_grad
from pallas_kernels import compat
from pallas_kernels.problem import Cotangents, Inputs, Saved


def _outputs(rows: cb.Rows, dtype):
    return rows.out.astype(dtype), rows.hi


def _gradients(inputs: Inputs, saved: Saved, cts, grads):
    """The custom_vjp's cotangent of `inputs` from this shard's (dq, dk, dv, dbias): the
    sinks' closed form; a shared array's gradient summed over the manual axes q varies over
    and it does not (where JAX types them: its cotangent must be shared too; without
    typed axes `shard_map`'s transpose sums what each shard returns)."""
    (d_out, _), (d_lse, _) = map(_cotangent, cts)
    dq, dk, dv, dbias = grads
    features = inputs.features
    d_sinks = None
    if features.sinks is not None:
        d_sinks = sinks_grad(features.sinks, saved.out, saved.lse, d_out, d_lse)
    d_sinks, dbias = (_shared_sum(g, x, inputs.q) for g, x in
                      ((d_sinks, features.sinks), (dbias, inputs.bias)))
    if dbias is not None:
        dbias = dbias.astype(inputs.bias.dtype)
    d_features = features._replace(q_segment_ids=None, kv_segment_ids=None, q_lengths=None,
                                   kv_lengths=None, sinks=d_sinks, positions=None)
    return (Inputs(dq, dk, dv, dbias, None, None, d_features),)


def _shared_sum(grad, primal, q):
    """`grad` summed over the manual axes q varies over and `primal` does not."""
    if grad is None:
        return None
    axes = compat.varying_axes(q) - compat.varying_axes(primal)
    return jax.lax.psum(grad, tuple(sorted(axes))) if axes else grad


# ---------------------------------------------------------------- inside a shard_map


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(call: ContextCall, inputs: Inputs):
    return _outputs(context_local.forward(call, inputs), inputs.q.dtype)


def _attention_fwd(call: ContextCall, inputs: Inputs):
    inputs = jax.tree.map(_primal_value, inputs,
                          is_leaf=lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal))
    rows = context_local.forward(call, inputs)
    outputs = _outputs(rows, inputs.q.dtype)
    # The backward reads out in the output's dtype, as the unsharded call's does: the
    # residual is the output itself, not a float32 copy twice its size.
    return outputs, (inputs, Saved(outputs[0], rows.hi, rows.lo))


def _attention_bwd(call: ContextCall, residuals, cts):
    inputs, saved = residuals
    (d_out, _), (d_lse, lse_unused) = map(_cotangent, cts)
    grads = context_local.backward(call, inputs, saved, Cotangents(d_out, d_lse),
                                   lse_cotangent=not lse_unused)
    return _gradients(inputs, saved, cts, grads)


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def attention(call: ContextCall, inputs: Inputs):
    """(out, lse) of this shard's rows (inside a `shard_map` over `call.axis`), differentiable
    with respect to q, k, v, the bias and the sinks."""
    return _attention(call, inputs)


# ---------------------------------------------------------------- under jit, any tier


class _Split:
    """The sequence split of a `ContextCall` (for `partitioning.ShardLocal`): the call's
    strategy and layout over the mesh axis the partitioner finds."""

    def __init__(self, kind: str):
        self.kind = kind

    @staticmethod
    def supports(call: ContextCall, parts: int) -> bool:
        problem = call.problem
        return (parts > 1 and problem.seq_q % parts == 0 and problem.seq_k % parts == 0
                and (call.strategy not in (cb.RING, cb.HALO)
                     or context_local.ring_dropout_ok(problem, parts, call.layout)))

    def __call__(self, call: ContextCall, axis: str, parts: int, inputs: Inputs,
                 saved: Saved | None = None, cotangents: Cotangents | None = None):
        skips = functools.partial(
            context_local.gather_blocks_skip, call.problem, parts, call.layout,
            implementation=call.implementation, interpret=call.interpret,
            deterministic=call.deterministic, tiers=call.tiers)
        strategy = context_local.choose_strategy(call.problem, parts, call.layout,
                                                 call.strategy, gather_skips=skips)
        call = dataclasses.replace(call, axis=axis, parts=parts, strategy=strategy)
        return _run(self.kind, call, inputs, saved, cotangents)


def _run(kind: str, call: ContextCall, inputs: Inputs, saved=None, cotangents=None):
    """One shard's direction as flat arrays (the wrappers' convention): (out float32, hi[,
    lo]) or (dq, dk, dv, dbias)."""
    if kind == "backward":
        return context_local.backward(call, inputs, saved, cotangents, call.lse_cotangent)
    rows = context_local.forward(call, inputs)
    return (rows.out, rows.hi) + (() if rows.lo is None else (rows.lo,))


def _unsplit(kind: str):
    """The wrappers' kernels: the call on one shard of the sequence (all of it)."""
    def run(call: ContextCall, inputs, saved=None, cotangents=None):
        call = dataclasses.replace(call, axis=None, parts=1, strategy=cb.RING)
        return _run(kind, call, inputs, saved, cotangents)
    return run


_row_outputs = lambda call: 2 if call.problem.lse_pair else 1  # noqa: E731
_jit_forward = partitioning.ShardLocal(_unsplit("forward"), "forward", shift_seed=shift_seed,
                                       row_outputs=_row_outputs, context=_Split("forward"))
_jit_backward = partitioning.ShardLocal(_unsplit("backward"), "backward",
                                        shift_seed=shift_seed, context=_Split("backward"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _jit_attention(call: ContextCall, inputs: Inputs):
    out, hi, *_ = _jit_forward(call, inputs)
    return out.astype(inputs.q.dtype), hi


def _jit_attention_fwd(call: ContextCall, inputs: Inputs):
    inputs = jax.tree.map(_primal_value, inputs,
                          is_leaf=lambda x: isinstance(x, jax.custom_derivatives.CustomVJPPrimal))
    out, *rows = _jit_forward(call, inputs)
    return (out.astype(inputs.q.dtype), rows[0]), (inputs, Saved(out, *rows))


def _jit_attention_bwd(call: ContextCall, residuals, cts):
    inputs, saved = residuals
    (d_out, _), (d_lse, lse_unused) = map(_cotangent, cts)
    # The wrapper's backward takes a d_lse always; whether it is a symbolic zero rides in
    # the call (the 16-bit kernels' dS split depends on it).
    call = dataclasses.replace(call, lse_cotangent=not lse_unused)
    grads = _jit_backward(call, inputs, saved, Cotangents(d_out, d_lse))
    return _gradients(inputs, saved, cts, grads)


_jit_attention.defvjp(_jit_attention_fwd, _jit_attention_bwd, symbolic_zeros=True)


def jit_attention(call: ContextCall, inputs: Inputs):
    """(out, lse) of the whole call under `jax.jit` (`call.axis` None): where q is sharded
    along its sequence over one mesh axis (the partitioner's, or an Explicit one), each
    device runs `call.strategy` (None: the rule's) over that axis on its shard; elsewhere
    the call runs unsplit."""
    return _jit_attention(call, inputs)
