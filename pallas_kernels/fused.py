"""The fused tier: attention as Pallas kernels lowered to Triton (`fwd.py`, `decode.py`,
`bwd.py`), one kernel per step, every feature inside the kernels.

Its forward runs `fwd_generic`, or for decode shapes (a few queries against many keys) the
split-KV decode kernels; its backward `bwd_preproc` (or δ from each tile, or
`bwd_exact_rows` in float32), `bwd_generic_dq`, `bwd_generic_dkdv` and `bwd_dbias`. Which
kernels a problem runs, and from which of them δ and the bias gradient come, is decided here
once (`kernels`, `delta_source`, `dbias_source`) for the run and for `python -m
ffpa_jax.info` alike.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import chunked_grad
from pallas_kernels.bwd import (bwd_dbias, bwd_exact_rows, bwd_generic_dkdv, bwd_generic_dq,
                                bwd_preproc)
from pallas_kernels.bwd_descriptors import BWD_DBIAS, BWD_GENERIC_DKDV, BWD_GENERIC_DQ, BWD_PREPROC
from pallas_kernels.bwd_tile import BackwardRows, BwdConfig, rows_in_one_tile
from pallas_kernels.decode import (DECODE_FWD_STAGE1, DECODE_FWD_STAGE2, DecodeConfig,
                                   decode_attention, decode_num_splits)
from pallas_kernels.fwd import FWD_GENERIC, FwdConfig, fwd_generic
from pallas_kernels.plan import KernelChoice, Plan, Target
from pallas_kernels.problem import Cotangents, Inputs, Problem, Saved

# The decode kernels (split-KV, GQA heads packed into the tile) serve a query block this
# short against at least DECODE_MIN_KEYS keys; see `uses_decode`.
DECODE_MAX_QUERIES = 16
DECODE_MIN_KEYS = 128

# Where δ comes from in the backward (`delta_source`).
DELTA_EXACT_ROWS = "exact rows"
DELTA_OWN_TILE = "own tile"
DELTA_PREPROC = "preproc"


def uses_decode(problem: Problem) -> bool:
    """The decode rule: T <= 16 queries against S >= 128 keys. There the generic forward's
    grid (one program per 64-row query block and head) is a few dozen programs reading all
    of K and V each; the decode kernels split the keys over the GPU and read K/V once per
    GQA group. A block of a longer sequence (`Problem.positions`) takes the generic forward:
    the decode kernels take no positions."""
    return (problem.seq_q <= DECODE_MAX_QUERIES and problem.seq_k >= DECODE_MIN_KEYS
            and not problem.positions)


def delta_source(problem: Problem, plan_or_configs) -> str:
    """Where the backward's δ = Σ P·dP − dlse comes from: float32 forms it from the
    kernels' own P and dP in a pass of its own (`bwd_exact_rows`); where every row's keys
    fit one tile of each kernel, each tile forms it (`rows_in_one_tile`); else
    `bwd_preproc` takes rowsum(dO ∘ O). A block of a longer sequence (`Problem.positions`)
    holds only some of each row's keys, so its own P sums to less than 1 and says nothing of
    δ: it takes rowsum(dO ∘ O) of the whole sequence's output (given to the backward), and
    P from the whole sequence's lse."""
    configs = _backward_configs(plan_or_configs)
    if problem.positions:
        return DELTA_PREPROC
    if problem.natural:
        return DELTA_EXACT_ROWS
    if rows_in_one_tile(problem.seq_k, configs["dq"], configs["dkdv"], configs["dbias"]):
        return DELTA_OWN_TILE
    return DELTA_PREPROC


def closed_form_dbias(problem: Problem) -> bool:
    """Whether the bias gradient is d_lse summed (`chunked_grad.row_constant_dbias`): a bias
    constant over the keys only shifts lse, unless the soft cap bends it or a sink (which it
    does not shift) shares the denominator, or the keys are a block of a longer sequence
    (`Problem.positions`: the block's share of the gradient is its keys' dS alone); then
    the kernels' dS sum (`bwd_dbias`)."""
    return (problem.has_bias and problem.bias_shape[-1] == 1 and problem.softcap is None
            and not problem.sinks and not problem.positions)


def _backward_configs(plan_or_configs) -> dict:
    if isinstance(plan_or_configs, Plan):
        return {role: plan_or_configs.config(d.name) for role, d in _BACKWARD_KERNELS}
    return plan_or_configs


_BACKWARD_KERNELS = (("preproc", BWD_PREPROC), ("dq", BWD_GENERIC_DQ),
                     ("dkdv", BWD_GENERIC_DKDV), ("dbias", BWD_DBIAS))


# ---------------------------------------------------------------- configs


def configs(problem: Problem, direction: str, lookup, target: Target) -> tuple[KernelChoice, ...]:
    """The launch configs this tier runs `direction` of `problem` with. `lookup(kernel)`
    gives (a config dict in FFPA's keys, why) for a kernel name (tuned, overridden or
    built-in)."""
    if direction == "forward":
        if uses_decode(problem):
            return decode_configs(problem, lookup, target)
        config, why = lookup(FWD_GENERIC.name)
        return (KernelChoice.of(FWD_GENERIC.name, FwdConfig.from_tuned(config), why, direction,
                                config),)
    return tuple(KernelChoice.of(d.name, BwdConfig.from_tuned(config), why, direction, config)
                 for _, d in _BACKWARD_KERNELS for config, why in (lookup(d.name),))


def decode_configs(problem: Problem, lookup, target: Target) -> tuple[KernelChoice, ...]:
    """The decode kernels' configs (both stages share one `DecodeConfig`, its key split
    count decided: the tuned NUM_SPLITS, else `decode_num_splits`' heuristic)."""
    (stage1, why1), (stage2, why2) = (lookup(DECODE_FWD_STAGE1.name),
                                      lookup(DECODE_FWD_STAGE2.name))
    config = DecodeConfig.from_tuned(stage1, stage2)
    if config.num_splits:
        why1 += f"; key splits: {config.num_splits} (the tuned NUM_SPLITS)"
    else:
        splits = decode_num_splits(
            batch=problem.batch, heads_kv=problem.heads_kv,
            packed_rows=problem.group * problem.seq_q, seq_k=problem.seq_k,
            head_dim_v=problem.head_dim_v, config=config,
            multiprocessors=target.multiprocessors)
        config = config.with_splits(splits)
        why1 += (f"; key splits: {splits} (the heuristic, for {target.multiprocessors} "
                 "multiprocessors)")
    return (KernelChoice.of(DECODE_FWD_STAGE1.name, config, why1, "forward", stage1),
            KernelChoice.of(DECODE_FWD_STAGE2.name, config, why2, "forward", stage2))


def runs(plan: Plan, direction: str) -> tuple[str, ...]:
    """The kernels `direction` of `plan` launches (the plan holds the backward's every
    config: whether each row fits one tile is asked of all of them)."""
    problem = plan.problem
    if direction == "forward":
        return tuple(c.kernel for c in plan.kernels if c.direction == "forward")
    launched = [BWD_GENERIC_DQ.name, BWD_GENERIC_DKDV.name]
    if delta_source(problem, plan) == DELTA_PREPROC:
        launched.append(BWD_PREPROC.name)
    if problem.has_bias and not closed_form_dbias(problem):
        launched.append(BWD_DBIAS.name)
    return tuple(launched)


def describe(plan: Plan, direction: str) -> list[str]:
    """What `direction` of `plan` runs beyond its kernels' configs, for `info`."""
    problem = plan.problem
    if direction == "forward":
        return []
    source = delta_source(problem, plan)
    lines = [{DELTA_EXACT_ROWS: f"delta: bwd_exact_rows (float32), with {BWD_GENERIC_DQ.name}'s "
                                "config",
              DELTA_OWN_TILE: "delta: each kernel's own P and dP (every row's keys fit one "
                              "tile)",
              DELTA_PREPROC: f"delta: {BWD_PREPROC.name}"}[source]]
    if closed_form_dbias(problem):
        lines.append("dbias: summed from d_lse (a bias constant along the keys)")
    return lines


# ---------------------------------------------------------------- the two directions


def forward(plan: Plan, inputs: Inputs) -> tuple:
    """(out, lse), or (out, hi, lo) where `Problem.lse_pair` (see plan.py)."""
    problem = plan.problem
    out_dtype = jnp.float32 if plan.float32_out else None
    if uses_decode(problem):
        config = plan.config(DECODE_FWD_STAGE1.name)
        out, lse = decode_attention(problem, config, inputs, num_splits=config.num_splits,
                                    interpret=plan.interpret, out_dtype=out_dtype)
        # The decode kernels merge their splits' lse: no exact pair here.
        return (out, lse, jnp.zeros_like(lse)) if problem.lse_pair else (out, lse)
    return fwd_generic(problem, plan.config(FWD_GENERIC.name), inputs, interpret=plan.interpret,
                       out_dtype=out_dtype)


def backward(plan: Plan, inputs: Inputs, saved: Saved, cotangents: Cotangents) -> tuple:
    """(dq, dk, dv, dbias) from the backward kernels (dbias None without a bias). The
    probabilities need no sink (lse counts them); their own gradient is the caller's
    (closed form: ffpa_jax.vjp.sinks_grad)."""
    problem = plan.problem
    configs = {role: plan.config(d.name) for role, d in _BACKWARD_KERNELS}
    kw = dict(interpret=plan.interpret)
    lse, lse_lo = saved.lse, saved.lse_lo
    # A row without keys has lse = -inf and no gradient path; drop its lse cotangent.
    d_lse = jnp.where(lse == -jnp.inf, 0.0, cotangents.d_lse.astype(jnp.float32))
    d_out = cotangents.d_out
    source = delta_source(problem.sized(inputs), configs)
    own_delta = source == DELTA_OWN_TILE
    if source == DELTA_EXACT_ROWS:
        delta, lse_lo = bwd_exact_rows(problem, configs["dq"], inputs,
                                       BackwardRows(d_out, lse, d_lse, lse_lo), **kw)
    elif own_delta:
        # Each kernel sees a row's keys in one tile and forms δ from its own P and dP.
        delta = d_lse
    else:
        delta = bwd_preproc(saved.out, d_out, d_lse, config=configs["preproc"], **kw)
    rows = BackwardRows(d_out, lse, delta, lse_lo)
    grads = dict(kw, split_ds=plan.lse_cotangent, own_delta=own_delta)
    dq = bwd_generic_dq(problem, configs["dq"], inputs, rows, **grads)
    dk, dv = bwd_generic_dkdv(problem, configs["dkdv"], inputs, rows, **grads)
    bias = inputs.bias
    dbias = None
    if bias is not None and closed_form_dbias(problem):
        dbias = chunked_grad.row_constant_dbias(d_lse, bias)
    elif bias is not None:
        dbias = bwd_dbias(problem, configs["dbias"], inputs, rows, own_delta=own_delta,
                          **kw).astype(bias.dtype)
    return dq, dk, dv, dbias
