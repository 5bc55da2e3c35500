"""The tier registry: every way this project computes attention, each with its name, where it
runs, what it supports, the configs it needs and its two directions.

`TIERS` is the one list. The dispatcher (`tuning.dispatch`) picks a tier per direction from
it and fills the plan's configs through `Tier.configs`; `forward` and `backward` here run a
plan's directions on the tiers it names. Every tier's directions agree on what passes
between them (the output in float32 when differentiated, lse, and in float32 lse's low
word: `problem.Saved`), so a plan may pair the forward of one tier with the backward of
another. Not so the dense tier, whose forward JAX differentiates: where either direction
lands on it, the dispatcher runs both there. Adding a tier is its module, one entry in
`TIERS` and the few hand-written lists docs/design.md names ("Adding a tier, a kernel or a
semantic option").
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import chunked, chunked_grad, chunked_plan, dense, dropout, fused
from pallas_kernels.mosaic import grad_step as mosaic_grad_step
from pallas_kernels.mosaic import tier as mosaic_tier
from pallas_kernels.plan import KernelChoice, Plan, Target
from pallas_kernels.problem import Cotangents, Inputs, Problem, Saved

# Where a tier runs (`Tier.runs_on`).
ANYWHERE = "anywhere"
NVIDIA_GPU = "an NVIDIA GPU"
SM90 = "an sm90 GPU (H100, H200) and jax >= 0.11"


def _none(*_):
    return ()


@dataclasses.dataclass(frozen=True)
class Tier:
    """One tier.

    - `name`: what `implementation=` and the tuned files' "tier" field call it.
    - `runs_on`: `ANYWHERE`; `NVIDIA_GPU` (then `interpretable` says whether its Pallas
      kernels also run in Pallas' interpreter elsewhere, for tests); or `SM90`: a GPU of
      compute capability 9.x with jax >= 0.11, never in the interpreter
      (`tuning.dispatch.runs_here` decides).
    - `forward(plan, inputs)` -> (out, lse[, lse_lo]); `backward(plan, inputs, saved,
      cotangents)` -> (dq, dk, dv, dbias), or None: JAX differentiates `forward` itself
      (`differentiated_by_jax`), or the tier has no backward (`directions` without it:
      another tier's runs the backward).
    - `configs(problem, direction, lookup, target)` -> the `KernelChoice`s it runs a
      direction with (`lookup(kernel)` gives a tuned or built-in config dict, and why).
    - `unsupported(problem, direction)` -> the features of `problem` it cannot compute, by
      their argument names (empty: it serves the problem).
    - `runs(plan, direction)` -> the kernels (configs) of the plan that the tier launches
      for the direction (default: none); a plan holds the configs of every tier it runs.
    - `describe(plan, direction)` -> lines for `python -m ffpa_jax.info` beyond the configs.
    - `ordered_backward`: whether its backward adds every sum in one order, so that reruns
      are bitwise equal (no floating-point atomics or reduce-adds whose order varies): what
      `deterministic=True` asks for. `xla_backward`: its backward is, in part or whole,
      XLA's own operations (the chunked tier's GEMMs, the dense tier), as reproducible as
      XLA makes them (bitwise under `--xla_gpu_deterministic_ops`).
    - `skips_by_runtime_shift`: whether, for a block of a longer sequence whose place is
      runtime data (`FeatureArrays.positions`), its kernels skip the tiles causality and the
      window hide by that shift (else it plans by `Problem.positions_shift` where given, and
      otherwise computes the whole block and masks it).
    """

    name: str
    summary: str
    runs_on: str
    forward: Callable
    backward: Callable | None
    configs: Callable = _none
    unsupported: Callable = _none
    describe: Callable = lambda plan, direction: []
    runs: Callable = lambda plan, direction: ()
    interpretable: bool = False
    directions: tuple[str, ...] = ("forward", "backward")
    differentiated_by_jax: bool = False
    ordered_backward: bool = True
    xla_backward: bool = False
    skips_by_runtime_shift: bool = False


def _chunked_configs(problem: Problem, direction: str, lookup, target: Target):
    del lookup  # sized from the workspace budget, not from tuned entries
    step = chunked_plan.STEP_KERNEL if target.runs_kernels else chunked_plan.STEP_FUSION
    in_step = chunked_grad.logits_in_step(problem, step)
    mosaic_step = target.sm90 and in_step and not mosaic_grad_step.unserved(problem)
    config = chunked_plan.make_config(problem, step=step, mosaic_step=mosaic_step)
    blocks = config if direction == "forward" else config.for_backward()
    budget = chunked_plan.budget_from_env() / 2**20
    why = (f"the workspace budget ({budget:g} MiB, ${chunked_plan.BUDGET_ENV}); the step "
           "between the GEMMs: "
           + ("Pallas kernels" if step == chunked_plan.STEP_KERNEL else "XLA fusions"))
    if direction == "backward" and in_step:
        why += ("; blocks that see part of their rows' keys compute their logits in the "
                "step's kernel" + (" (Mosaic GPU where they are whole tiles of it)"
                                   if mosaic_step else ""))
    settings = dict(block_q=blocks.block_q, block_k=blocks.block_k, step=step)
    return (KernelChoice.of(CHUNKED_KERNEL, config, why, direction, settings),)


CHUNKED_KERNEL = "chunked_blocks"  # the chunked tier's config in a plan


def _chunked_forward(plan: Plan, inputs: Inputs):
    out, lse = chunked.forward(plan.problem, plan.config(CHUNKED_KERNEL), inputs,
                               interpret=plan.interpret)
    out = out if plan.float32_out else out.astype(inputs.q.dtype)
    return (out, lse, jnp.zeros_like(lse)) if plan.problem.lse_pair else (out, lse)


def _chunked_backward(plan: Plan, inputs: Inputs, saved: Saved, cotangents: Cotangents):
    return chunked_grad.backward(plan.problem, plan.config(CHUNKED_KERNEL), inputs, saved,
                                 cotangents, interpret=plan.interpret,
                                 lse_cotangent=plan.lse_cotangent)


XLA = Tier(
    name="xla", runs_on=ANYWHERE, forward=dense.forward, backward=None,
    differentiated_by_jax=True, xla_backward=True,
    summary="the dense plain-JAX path (pallas_kernels.reference), differentiated by JAX; "
            "O(T*S) memory")
CHUNKED = Tier(
    name="chunked", runs_on=ANYWHERE, forward=_chunked_forward, backward=_chunked_backward,
    configs=_chunked_configs, runs=lambda plan, direction: (CHUNKED_KERNEL,), xla_backward=True,
    summary="blocks of queries and keys as large GEMMs with a fused step between them; "
            "memory bounded by a budget")
PALLAS = Tier(
    name="pallas", runs_on=NVIDIA_GPU, interpretable=True, forward=fused.forward,
    backward=fused.backward, configs=fused.configs, describe=fused.describe, runs=fused.runs,
    skips_by_runtime_shift=True,
    summary="the fused Pallas kernels lowered to Triton (forward, backward, decode)")

MOSAIC = Tier(
    name="mosaic", runs_on=SM90, forward=mosaic_tier.forward, backward=mosaic_tier.backward,
    configs=mosaic_tier.configs, unsupported=mosaic_tier.unsupported, ordered_backward=False,
    skips_by_runtime_shift=True,
    runs=lambda plan, direction: (mosaic_tier.KERNEL if direction == "forward"
                                  else mosaic_tier.BACKWARD_KERNEL,),
    summary="Pallas Mosaic GPU kernels for sm90 (wgmma, TMA, warp specialisation): the "
            "forward up to D = 512, the backward for D, Dv <= 128 and for D = Dv up to 256 "
            "(dQ by TMA reduce-add, in a varying order)")

# Every tier, in the order the dispatcher falls back along (`_serving`; the most general last
# but one: the dense path serves everything, the chunked tier everything in bounded memory).
# The fallback never starts at the Mosaic tier: where a rule names it and it cannot take a
# direction, the rules pick again without it (`tuning.dispatch._rule(..., mosaic=False)`).
TIERS: tuple[Tier, ...] = (MOSAIC, PALLAS, CHUNKED, XLA)
BY_NAME = {tier.name: tier for tier in TIERS}


def forward(plan: Plan, inputs: Inputs):
    """(out, lse[, lse_lo]) of the plan's forward tier. Every array of `inputs` has batch as
    dim 0 and heads as dim 2 (q/k/v) or dim 1 (bias/mask): a sharding wrapper partitions
    this function.

    A block of a longer sequence (`FeatureArrays.positions`) gives its rows' (out, lse)
    over its own keys: blocks of keys merge by lse, as `chunked` merges its key blocks."""
    _check_positions(plan.problem, inputs)
    return BY_NAME[plan.forward_tier].forward(plan, _local_lengths(inputs))


def backward(plan: Plan, inputs: Inputs, saved: Saved, cotangents: Cotangents):
    """(dq, dk, dv, dbias) of the plan's backward tier.

    For a block of a longer sequence (`FeatureArrays.positions`), `saved` and `cotangents`
    are its rows' of the whole sequence (out and lse merged over every key block; in float32
    lse_lo zeros where no exact pair is at hand): it returns its share, dq of its rows from
    its keys and dk, dv of its keys from its rows (summed over blocks by the caller)."""
    _check_positions(plan.problem, inputs)
    return BY_NAME[plan.backward_tier].backward(plan, _local_lengths(inputs), saved, cotangents)


def _check_positions(problem: Problem, inputs: Inputs) -> None:
    """The positions' rules: given iff the problem says so, int32[3], a shift equal to
    `Problem.positions_shift` where both are known, never with sinks (the
    caller joins them once it has merged the blocks), and with dropout a key offset col0
    that is a multiple of `dropout.POSITION_ALIGN` (checked where col0 is known at trace
    time; a traced col0 must keep the rule all the same)."""
    positions = inputs.features.positions
    if problem.positions != (positions is not None):
        raise ValueError(f"Problem.positions is {problem.positions} but FeatureArrays.positions "
                         f"is {'given' if positions is not None else 'None'}; they go together")
    if positions is None:
        if problem.positions_shift is not None:
            raise ValueError(f"Problem.positions_shift is {problem.positions_shift} without "
                             "positions; it is the shift of a block of a longer sequence")
        return
    if jnp.shape(positions) != (3,):
        raise ValueError(f"FeatureArrays.positions must be int32[3] (row0, col0, shift); got "
                         f"shape {jnp.shape(positions)}")
    known = problem.positions_shift
    if known is not None and not isinstance(positions, jax.core.Tracer):
        shift = int(np.asarray(positions)[2])
        if shift != known:
            raise ValueError(f"Problem.positions_shift is {known} but the positions' shift "
                             f"(positions[2]) is {shift}; a tier plans by the first")
    if inputs.features.sinks is not None or problem.sinks:
        raise ValueError("sinks cannot be given with positions (FeatureArrays.positions): a "
                         "block holds only some of each row's keys, so the caller joins the "
                         "sinks once to the merged rows; got both")
    if problem.has_dropout and not isinstance(positions, jax.core.Tracer):
        col0 = int(np.asarray(positions)[1])
        if col0 % dropout.POSITION_ALIGN:
            raise ValueError(
                f"dropout with positions needs the key offset col0 (positions[1]) to be a "
                f"multiple of {dropout.POSITION_ALIGN}, so that the blocks draw the whole "
                f"sequence's keep decisions; got col0 = {col0}")


def _local_lengths(inputs: Inputs) -> Inputs:
    """Inputs whose lengths count the block's own rows and keys: for a block of a longer
    sequence (`FeatureArrays.positions`), global row row0 + i is within q_len iff local row
    i < q_len - row0 (keys likewise), so no tier needs to know the block's place for them."""
    f = inputs.features
    if f.positions is None or (f.q_lengths is None and f.kv_lengths is None):
        return inputs
    row0, col0 = f.positions[0], f.positions[1]
    return inputs._replace(features=f._replace(
        q_lengths=None if f.q_lengths is None else f.q_lengths - row0,
        kv_lengths=None if f.kv_lengths is None else f.kv_lengths - col0))
