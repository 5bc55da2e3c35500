"""The Mosaic tier's directions for the registry (`pallas_kernels.tiers`): its forward (the
"rows" and "wide" Mosaic GPU kernels), its config, and what it does not compute yet.

It has no backward of its own: the dispatcher pairs its forward with another tier's
backward (every tier's directions agree on what passes between them: the output in float32
when differentiated, and lse).
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.mosaic.config import default_config, round_up
from pallas_kernels.mosaic.forward import mosaic_attention_forward
from pallas_kernels.plan import KernelChoice, Plan, Target
from pallas_kernels.problem import Inputs, Problem

KERNEL = "mosaic_fwd"  # the tier's config in a plan
MAX_HEAD_DIM = 512


def unsupported(problem: Problem, direction: str) -> tuple[str, ...]:
    """What of `problem` the Mosaic tier does not compute, by argument name (or what). The
    kernels take a window and a soft cap (`mosaic_attention_forward`); the tier serves them
    once their GPU numerics test (tests/test_mosaic.py, `-m gpu`) has passed."""
    del direction  # the forward: the tier has no backward (`Tier.directions`)
    missing = [name for name, lacks in (
        ("bias", problem.has_bias), ("mask", problem.mask_shape is not None),
        ("dropout_rate", problem.has_dropout), *((name, True) for name in problem.features),
        ("context_axis (positions)", problem.positions),
        ("float32 (16-bit only)", problem.natural),
        (f"head dims above {MAX_HEAD_DIM}", problem.headdim > MAX_HEAD_DIM),
        ("scale 0", problem.scale == 0.0)) if lacks]
    return tuple(missing)


def configs(problem: Problem, direction: str, lookup, target: Target) -> tuple[KernelChoice, ...]:
    """The kernels' config: the built-in choice per head size (not in the tuned files yet)."""
    del lookup, target
    config = default_config(problem.head_dim, problem.head_dim_v, problem.dtype,
                            problem.causal, gqa_group=problem.group)
    kernel = "wide" if max(round_up(problem.head_dim, 64),
                           round_up(problem.head_dim_v, 64)) > 256 else "rows"
    settings = dict(kernel=kernel, block_kv=config.block_kv, num_stages=config.num_stages,
                    cluster=config.cluster, cluster_axis=config.cluster_axis,
                    grid_order=config.grid_order, lowering=config.lowering)
    return (KernelChoice.of(KERNEL, config, "built-in default (mosaic/config.py)", direction,
                            settings),)


def forward(plan: Plan, inputs: Inputs):
    """(out, lse): out in float32 when differentiated (`plan.float32_out`)."""
    problem = plan.problem
    out_dtype = jnp.float32 if plan.float32_out else None
    return mosaic_attention_forward(inputs.q, inputs.k, inputs.v, scale=problem.scale,
                                    causal=problem.causal, config=plan.config(KERNEL),
                                    out_dtype=out_dtype)
