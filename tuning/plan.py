"""`make_plan`: everything static about one attention call, from the problem, the tuned-config
lookup and the built-in rules: which tier runs each direction and every kernel's launch
parameters (a `pallas_kernels.tiers.Plan`)."""

from __future__ import annotations

from typing import Callable

from pallas_kernels import BwdConfig, DecodeConfig, FwdConfig, chunked, decode_num_splits
from pallas_kernels.problem import Problem
from pallas_kernels.tiers import TIERS, Plan, fused_unsupported
from tuning.defaults import NARROW_WINDOW_RATIO, narrow_window_tier
from tuning.device import multiprocessor_count
from tuning.select import config_for, explain_tier

# The decode path (split-KV, GQA heads packed into the tile) serves a query block
# this short against at least DECODE_MIN_KEYS keys; see `uses_decode`.
DECODE_MAX_QUERIES = 16
DECODE_MIN_KEYS = 128

# (kernel name, problem) -> a config dict that replaces the tuned/default one, or None.
Override = Callable[[str, Problem], "dict | None"]


def uses_decode(problem: Problem) -> bool:
    """Decode path rule: T <= 16 queries against S >= 128 keys. There the generic
    forward's grid (one program per 64-row query block and head) is a few dozen
    programs reading all of K and V each; the decode kernels split the keys over
    the GPU and read K/V once per GQA group."""
    return problem.seq_q <= DECODE_MAX_QUERIES and problem.seq_k >= DECODE_MIN_KEYS


def launch_config(kernel: str, problem: Problem, override: Override | None = None) -> dict:
    """The override's config when it gives one (runtime autotune), else the tuned entry for
    this device, else the built-in default."""
    if override is not None:
        found = override(kernel, problem)
        if found is not None:
            return found
    return config_for(kernel, problem)


def fwd_config(problem: Problem, override: Override | None = None) -> FwdConfig:
    """fwd_generic's launch parameters for this problem."""
    return FwdConfig.from_tuned(launch_config("fwd_generic", problem, override))


def bwd_config(kernel: str, problem: Problem, override: Override | None = None) -> BwdConfig:
    """A backward kernel's launch parameters."""
    return BwdConfig.from_tuned(launch_config(kernel, problem, override))


def decode_config(problem: Problem, override: Override | None = None
                  ) -> tuple[DecodeConfig, int]:
    """The decode kernels' launch parameters and split count (without a tuned NUM_SPLITS,
    the heuristic of `decode_num_splits`)."""
    config = DecodeConfig.from_tuned(launch_config("decode_fwd_stage1", problem, override),
                                     launch_config("decode_fwd_stage2", problem, override))
    splits = config.num_splits or decode_num_splits(
        batch=problem.batch, heads_kv=problem.heads_kv,
        packed_rows=problem.group * problem.seq_q, seq_k=problem.seq_k,
        head_dim_v=problem.head_dim_v, config=config, multiprocessors=multiprocessor_count())
    return config, splits


def explain_tiers(problem: Problem, implementation: str, *, device_name: str | None = None,
                  compute_capability: str | None = None
                  ) -> tuple[tuple[str, str], tuple[str, str]]:
    """((forward tier, why), (backward tier, why)) of `tiers`, for the device JAX runs on or
    the one named."""
    def routed(direction):
        missing = fused_unsupported(problem, direction)
        if not missing:
            return None
        return ("chunked", f"{', '.join(missing)}: not in the fused {direction} kernels yet, "
                           "the chunked tier runs it")
    if implementation in TIERS:
        chosen = (implementation, f"implementation={implementation!r}")
        if implementation != "pallas":
            return chosen, chosen
        return routed("forward") or chosen, routed("backward") or chosen
    if implementation != "auto":
        raise ValueError(f"implementation must be 'auto' or one of {TIERS}; "
                         f"got {implementation!r}")
    device = dict(device_name=device_name, compute_capability=compute_capability)
    narrow = narrow_window_tier(problem)
    window = (narrow, f"a window of at most 1/{NARROW_WINDOW_RATIO} of the keys: the fused "
                      "kernels skip the hidden tiles") if narrow else None

    decode = (("pallas", f"decode shape (T <= {DECODE_MAX_QUERIES} queries against "
                         f">= {DECODE_MIN_KEYS} keys): the decode kernels")
              if uses_decode(problem) else None)
    forward = (routed("forward") or decode or window
               or explain_tier("forward", problem, **device))
    backward = routed("backward") or window or explain_tier("backward", problem, **device)
    return forward, backward


def tiers(problem: Problem, implementation: str) -> tuple[str, str]:
    """(forward tier, backward tier) of a call: `implementation` is a tier name, or "auto"
    (each direction on the tier the tuned data, then the built-in rule, picks). The decode
    shapes' forward always runs the Pallas decode kernels; a direction with a feature its
    fused kernels do not implement (`fused_unsupported`) runs on the chunked tier, under
    "auto" and "pallas" alike (the API refuses an explicit "pallas" before)."""
    (forward, _), (backward, _) = explain_tiers(problem, implementation)
    return forward, backward


def make_plan(problem: Problem, *, interpret: bool = False, precise_lse: bool = False,
              tiers: tuple[str, str] = ("pallas", "pallas"), step: str = "pallas",
              override: Override | None = None) -> Plan:
    """The plan of one call. `tiers` = (forward tier, backward tier); `step` is the chunked
    tier's step between its GEMMs ("pallas", or "xla" where no GPU runs the kernels);
    `precise_lse` when the caller returns lse (see Plan)."""
    decode, splits = (decode_config(problem, override) if uses_decode(problem) else (None, 1))
    chunk = (chunked.make_plan(problem, step=step, interpret=interpret)
             if "chunked" in tiers else None)
    return Plan(decode=decode, decode_splits=splits, scale=problem.scale,
                forward_tier=tiers[0], backward_tier=tiers[1], chunk=chunk,
                causal=problem.causal, interpret=interpret, window=problem.window,
                softcap=problem.softcap,
                dropout_rate=problem.dropout_rate, precise_lse=precise_lse,
                lse_pair=problem.dtype_name == "fp32",
                fwd=fwd_config(problem, override),
                preproc=bwd_config("bwd_preproc", problem, override),
                dq=bwd_config("bwd_generic_dq", problem, override),
                dkdv=bwd_config("bwd_generic_dkdv", problem, override),
                dbias=bwd_config("bwd_dbias", problem, override))
