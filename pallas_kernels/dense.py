"""The dense tier: the plain-JAX reference (`reference.attention`) as the computation,
differentiated by JAX itself. O(T·S) memory; it runs anywhere, and it is the semantics every
other tier is tested against."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import reference
from pallas_kernels.dropout import keep_block
from pallas_kernels.plan import Plan
from pallas_kernels.problem import Inputs


def forward(plan: Plan, inputs: Inputs):
    """(out [B, T, Hq, Dv] in q's dtype (float32 where `plan.float32_out`), lse [B, Hq, T])
    of batched inputs (their lengths the block's own where `positions` place them in a
    longer sequence: `tiers.forward`)."""
    problem = plan.problem
    q, k, seed, positions = inputs.q, inputs.k, inputs.seed, inputs.features.positions
    row0 = col0 = 0
    if positions is not None:
        row0, col0 = positions[0], positions[1]
    keep = None
    if seed is not None:
        shape = (q.shape[0], q.shape[2], q.shape[1], k.shape[1])
        keep = keep_block(seed, shape, problem.dropout_rate,
                          broadcast=problem.dropout_broadcast, rows=row0, cols=col0)
    return reference.attention(problem, inputs, keep,
                               out_dtype=jnp.float32 if plan.float32_out else None)
