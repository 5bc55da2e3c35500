"""The Mosaic tier's directions for the registry (`pallas_kernels.tiers`): its forward (the
"rows" and "wide" Mosaic GPU kernels), its backward (`backward.rows_backward`, D and
Dv <= 128; `backward_halves.halves_backward`, D = Dv <= 256), their configs, and what each
does not compute yet.

Where the backward cannot serve a problem that the forward can (larger head dims), the
dispatcher pairs the Mosaic forward with another tier's backward (every tier's directions
agree on what passes between them: the output in float32 when differentiated, and lse).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import visibility
from pallas_kernels.mosaic import backward as mosaic_backward
from pallas_kernels.mosaic import tuned
from pallas_kernels.mosaic.config import runs_wide_kernel, uses_wide_kernel
from pallas_kernels.mosaic.forward import mosaic_attention_forward
from pallas_kernels.plan import KernelChoice, Plan, Target
from pallas_kernels.problem import Cotangents, Inputs, Problem, Saved

KERNEL = tuned.FORWARD_KERNEL  # the tier's configs in a plan and in the tuned files
BACKWARD_KERNEL = tuned.BACKWARD_KERNEL
MAX_HEAD_DIM = 512  # the forward's; the backward's: `mosaic_backward.unsupported_head_dims`
ONE_TILE_KEYS = 128
SERVED_FEATURES = ("local_window_size", "logits_soft_cap", "q_segment_ids",
                   "query_seq_lengths", "key_value_seq_lengths", "sinks")


def unsupported(problem: Problem, direction: str) -> tuple[str, ...]:
    """What of `problem` the Mosaic tier does not compute in `direction`, by argument name
    (or what). Segment ids are served up to D = 256 in the forward (the "rows" kernel) and
    in the backward: the kernels compare the ids in their masks and walk the range of
    blocks the ids allow (`visibility.segment_block_ranges`). So is a mask the same for
    every head that is a key mask or a query mask: it becomes segment ids
    (`visibility.segments_of_mask`), where no segment ids are given. Sequence lengths and sinks
    are served: the kernels take the lengths (`mosaic_attention_forward(features=)`, the
    backward's `inputs.features`), the forward joins the sinks on the host, and the
    backward needs nothing for them (lse counts them; their own gradient is the caller's
    closed form). So is a block of a longer sequence (context parallelism,
    `Problem.positions`): the kernels walk and mask by the positions' runtime shift
    (`Walk.with_positions`), and the backward takes δ from the whole rows' O and dO as it
    does for any call."""
    features = [name for name in problem.features if name not in SERVED_FEATURES]
    head_dims = (mosaic_backward.unsupported_head_dims(problem.head_dim, problem.head_dim_v)
                 if direction == "backward" else
                 f"head dims above {MAX_HEAD_DIM}" if problem.headdim > MAX_HEAD_DIM else "")
    wide = uses_wide_kernel(problem.head_dim, problem.head_dim_v)  # no segment ids there
    mask = problem.mask_shape is not None
    missing = [name for name, lacks in (
        ("bias", problem.has_bias),
        ("mask other than a key or query mask shared by the heads",
         mask and not visibility.mask_is_segments(problem.mask_shape)),
        ("mask with q_segment_ids", mask and problem.segment_ids),
        ("mask with head dims above 256", mask and wide and direction == "forward"),
        ("dropout_rate", problem.has_dropout), *((name, True) for name in features),
        ("float32 (16-bit only)", problem.natural),
        (head_dims, bool(head_dims)),
        ("q_segment_ids with head dims above 256", problem.segment_ids and wide
         and direction == "forward"),
        ("scale 0", problem.scale == 0.0),
        # Rows whose keys all fit one tile: the fused kernels form δ from their own P and dP
        # there, which makes a row of one key's dq exactly 0 as XLA's (docs/history.md,
        # session 10); this kernel takes δ from O and dO, a few ulps off. A block of a longer
        # sequence takes δ from the whole rows' O and dO on every tier.
        (f"key lengths up to {ONE_TILE_KEYS} (the fused kernels' exact one-tile δ)",
         direction == "backward" and problem.seq_k <= ONE_TILE_KEYS
         and not problem.positions)) if lacks]
    return tuple(missing)


def configs(problem: Problem, direction: str, lookup, target: Target) -> tuple[KernelChoice, ...]:
    """The kernels' config: the built-in choice per head size (`mosaic/config.py`), with the
    fields of a tuned entry where one matches and fits the call (`tuned.tuned_config`)."""
    del target
    kernel = BACKWARD_KERNEL if direction == "backward" else KERNEL
    segments = _segmented(problem)
    default = tuned.default_for(kernel, problem.head_dim, problem.head_dim_v,
                                group=problem.group, segments=segments, causal=problem.causal,
                                window=problem.window, seq_q=problem.seq_q)
    entry, why = lookup(kernel)
    config, note = tuned.tuned_config(kernel, default, entry, head_dim=problem.head_dim,
                                      head_dim_v=problem.head_dim_v, group=problem.group,
                                      segments=segments)
    if entry is None:
        why = f"built-in default (mosaic/config.py); {why}"
    elif note:
        why = f"built-in default (mosaic/config.py); {why}, not used: {note}"
    if direction == "backward":
        name = ("halves_backward" if mosaic_backward.uses_halves_kernel(
            problem.head_dim, problem.head_dim_v) else "rows_backward")
        settings = dict(kernel=name, num_stages=config.num_stages,
                        consumer_regs=config.consumer_regs, block_q=config.block_q)
    else:
        wide = runs_wide_kernel(config, problem.head_dim, problem.head_dim_v)
        name = "wide" if wide else "rows"
        if problem.return_lse and wide:  # the rows kernel (chains of 256 at most) meets the rule
            config = dataclasses.replace(config, precise_lse=True)
        settings = dict(kernel=name, block_kv=config.block_kv, num_stages=config.num_stages,
                        cluster=config.cluster, cluster_axis=config.cluster_axis,
                        grid_order=config.grid_order, lowering=config.lowering,
                        persistent=config.persistent, precise_lse=config.precise_lse)
    return (KernelChoice.of(kernel, config, why, direction, settings),)


def _segmented(problem: Problem) -> bool:
    """Whether the kernels compare segment ids: given, or made from a mask."""
    return problem.segment_ids or problem.mask_shape is not None


def _with_mask_as_segments(inputs: Inputs) -> Inputs:
    """`inputs` with a mask (one `unsupported` lets through) turned into segment ids."""
    if inputs.mask is None:
        return inputs
    q, k = inputs.q, inputs.k
    q_ids, kv_ids = visibility.segments_of_mask(inputs.mask, q.shape[0], q.shape[1],
                                                k.shape[1])
    features = inputs.features._replace(q_segment_ids=q_ids, kv_segment_ids=kv_ids)
    return inputs._replace(mask=None, features=features)


def forward(plan: Plan, inputs: Inputs):
    """(out, lse): out in float32 when differentiated (`plan.float32_out`)."""
    problem = plan.problem
    out_dtype = jnp.float32 if plan.float32_out else None
    inputs = _with_mask_as_segments(inputs)
    return mosaic_attention_forward(inputs.q, inputs.k, inputs.v, scale=problem.scale,
                                    causal=problem.causal, config=plan.config(KERNEL),
                                    out_dtype=out_dtype, window=problem.window,
                                    softcap=problem.softcap, features=inputs.given_features)


def backward(plan: Plan, inputs: Inputs, saved: Saved, cotangents: Cotangents):
    """(dq, dk, dv, None): the tier takes no bias."""
    problem = plan.problem
    dq, dk, dv = mosaic_backward.mosaic_attention_backward(
        _with_mask_as_segments(inputs), saved, cotangents, scale=problem.scale,
        causal=problem.causal, config=plan.config(BACKWARD_KERNEL), window=problem.window,
        softcap=problem.softcap)
    return dq, dk, dv, None
