"""The dispatcher: which tier runs each direction of a call, and every kernel's config.

One place decides, for the run (`plan`) and for `python -m ffpa_jax.info` (`explain`) alike:

1. `implementation=` names a tier of the registry (`pallas_kernels.tiers.TIERS`): that tier,
   if it runs here and serves the problem; else a ValueError that says why.
2. `implementation=None` without an NVIDIA GPU: Pallas' interpreter with `interpret=True`;
   else the chunked tier where the dense logits would pass its workspace budget, and XLA's
   dense path below it.
3. `implementation=None` on an NVIDIA GPU, each direction by the first rule that applies:
   - a mask: a key or query mask shared by the heads (up to D = 256, without segment ids)
     the Mosaic kernels, as segment ids; any other mask the rules below without them;
   - segment ids up to D = 256: the fused kernels (the Mosaic ones where they measured
     faster, `SEGMENTS_MOSAIC`);
   - a sliding window narrow enough for the fused kernels' tile skipping (`narrow_window`);
   - the decode shapes' forward: the fused tier's split-KV decode kernels;
   - the tier the device's tuned file names for the nearest problem (its "tier" field);
   - the built-in rule (`built_in_tier`).
   Where the rule names the Mosaic tier and it cannot serve the problem (`Tier.unsupported`)
   or does not run here, the same rules pick again without it (`mosaic=False`: the Triton
   kernels, or the chunked tier where it beats them). Any other tier that cannot passes the
   direction to the next tier of the registry that can; the explanation says why.
   Where the forward's tuned entry says a forward+backward in one program ran faster with
   the backward's tier's forward ("tier_differentiated"), a differentiated call's forward
   runs on that tier (`vjp_forward_tier`; only under `implementation=None`).
4. `deterministic=True` (or None with XLA's `--xla_gpu_deterministic_ops` in `XLA_FLAGS`:
   `resolve_deterministic`) passes over, for the backward, a tier whose backward does not
   add in one order (`Tier.ordered_backward`), whether named or picked by a rule.
Then each chosen tier fills the plan with its kernels' configs (`Tier.configs`): for the
Triton kernels the runtime autotune's winner, else the tuned entry, else the built-in default
(`select.kernel_config`); the chunked tier sizes its blocks from its workspace budget and the
Mosaic tier takes its built-in configs with a tuned entry's fields (`mosaic/tuned.py`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import jax.numpy as jnp

from pallas_kernels import chunked_plan, compat, fused, tiers, visibility
from pallas_kernels.plan import Plan, Target
from pallas_kernels.problem import Problem
from pallas_kernels.tiers import TIERS, Tier
from tuning import device as devices
from tuning.lookup import explain_entry
from tuning.select import kernel_config, lookup_fields

# The names `implementation=` accepts (None: the dispatcher's choice).
IMPLEMENTATIONS: tuple[str | None, ...] = (None,) + tuple(tier.name for tier in TIERS)
DIRECTIONS = ("forward", "backward")

# (kernel name, problem) -> a config dict that replaces the tuned/default one, or None.
Override = Callable[[str, Problem], "dict | None"]

# The kernel whose tuned entry carries a direction's "tier" field.
TIER_KERNELS = {"forward": fused.FWD_GENERIC.name, "backward": fused.BWD_GENERIC_DKDV.name}
# The field of a forward entry naming the forward's tier when the call is differentiated,
# set where forward+backward in one program measured faster with it than with "tier"
# (`vjp_forward_tier`).
VJP_TIER_FIELD = "tier_differentiated"

# A sliding window whose band is at most 1/NARROW_WINDOW_RATIO of the keys runs both
# directions on the fused kernels, up to NARROW_WINDOW_MAX_HEADDIM: they skip hidden tiles at
# their own tile width, where the chunked tier's query blocks read their rows' whole band
# (the tuned tiers were measured without windows; docs/benchmarks.md has the A/B).
NARROW_WINDOW_RATIO = 8
NARROW_WINDOW_MAX_HEADDIM = 512
# Of them, the Mosaic kernels (where they run) up to MOSAIC_MAX_HEADDIM: measured faster
# than the Triton kernels at D = 128 and 256 in both directions, docs/benchmarks.md.

# Segment ids (packed sequences) up to D = SEGMENTS_MAX_HEADDIM: the fused kernels skip the
# other segments' tiles, where the tuned tiers were measured without segments and the
# chunked tier's blocks walk them all. Of the fused kernels the Mosaic ones measured faster
# over (low, high] of SEGMENTS_MOSAIC, per direction: the forward above D = 64, the
# backward above D = 128 (its D <= 128 kernel was slower than the Triton kernels';
# docs/benchmarks.md, sessions 21 and 22).
SEGMENTS_MAX_HEADDIM = 256
SEGMENTS_MOSAIC = {"forward": (64, 256), "backward": (128, 256)}

# The rules' Mosaic tier (where it runs and serves the problem) up to this head dim in both
# directions: above it the chunked tier's GEMMs measured faster than its forward, and its
# backward stops there (docs/benchmarks.md).
MOSAIC_MAX_HEADDIM = 256


@dataclasses.dataclass(frozen=True)
class Device:
    """The device a call is planned for: JAX's (`Device.current`), or one named for
    `info` (`--device-name`)."""

    nvidia_gpu: bool
    name: str | None = None
    compute_capability: str | None = None
    multiprocessors: int = devices.DEFAULT_MULTIPROCESSORS

    @classmethod
    def current(cls) -> "Device":
        if not devices.default_backend_is_nvidia_gpu():
            return cls(nvidia_gpu=False)
        name, capability = devices.current_device()
        return cls(nvidia_gpu=True, name=name, compute_capability=capability,
                   multiprocessors=devices.multiprocessor_count())

    def lookup_keys(self) -> dict:
        """The tuned lookup's device keywords (None: JAX's own device)."""
        return dict(device_name=self.name, compute_capability=self.compute_capability)


@dataclasses.dataclass(frozen=True)
class TierChoice:
    """The tier of one direction, and why."""

    tier: str
    why: str


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What a call runs and why: the tier of each direction, the tiers passed over (by
    name, with the reason), the plan, whose kernels carry their configs' reasons, and
    whether the backward was asked to be bitwise reproducible (and why)."""

    forward: TierChoice
    backward: TierChoice
    passed_over: tuple[tuple[str, str], ...]
    plan: Plan
    determinism: str = ""
    # The forward of a differentiated call, where it runs on another tier (`Plan.vjp_forward_tier`).
    vjp_forward: TierChoice | None = None

    def choice(self, direction: str) -> TierChoice:
        return self.forward if direction == "forward" else self.backward


DETERMINISTIC_OPS_FLAG = "--xla_gpu_deterministic_ops"


def resolve_deterministic(deterministic: bool | None) -> tuple[bool, str]:
    """(whether the backward must be bitwise reproducible, why): `deterministic` itself when
    given, else XLA's own setting, `--xla_gpu_deterministic_ops` in `XLA_FLAGS` (its last
    occurrence; bare or `=true`/`=1` is on)."""
    if deterministic is not None:
        return bool(deterministic), f"deterministic={bool(deterministic)}"
    on = False
    for token in os.environ.get("XLA_FLAGS", "").split():
        name, _, value = token.partition("=")
        if name == DETERMINISTIC_OPS_FLAG:
            on = value.lower() in ("", "true", "1")
    return on, (f"deterministic=None: XLA_FLAGS {'sets' if on else 'does not set'} "
                f"{DETERMINISTIC_OPS_FLAG}")


def _unordered(tier: Tier, direction: str, deterministic: bool) -> str | None:
    """Why `tier` may not run `direction` under `deterministic` (None: it may)."""
    if deterministic and direction == "backward" and not tier.ordered_backward:
        return "its backward adds in a varying order, and the call asks for deterministic"
    return None


def runs_mosaic(device: Device, interpret: bool) -> bool:
    """Whether Mosaic GPU kernels run on `device` (`tiers.SM90`)."""
    return bool(device.nvidia_gpu and not interpret
                and str(device.compute_capability or "").startswith("9.")
                and compat.mosaic_gpu_runs())


def _target(device: Device, interpret: bool) -> Target:
    return Target(nvidia_gpu=device.nvidia_gpu, interpret=interpret,
                  multiprocessors=device.multiprocessors, sm90=runs_mosaic(device, interpret))


def runs_here(tier: Tier, device: Device, interpret: bool) -> str | None:
    """Why `tier` cannot run on `device` (None: it can)."""
    if tier.runs_on == tiers.ANYWHERE:
        return None
    if tier.runs_on == tiers.SM90:
        return None if runs_mosaic(device, interpret) else f"needs {tier.runs_on}"
    if device.nvidia_gpu and not interpret:
        return None
    if interpret and tier.interpretable:
        return None
    return (f"needs {tier.runs_on}" + (" (its kernels do not run in Pallas' interpreter)"
                                       if interpret else ""))


def narrow_window(problem: Problem) -> bool:
    """Whether a window is narrow enough for the fused kernels' tile skipping to win (see
    NARROW_WINDOW_RATIO)."""
    band = problem.window_band
    return (band is not None and problem.headdim <= NARROW_WINDOW_MAX_HEADDIM
            and band * NARROW_WINDOW_RATIO <= problem.seq_k)


def built_in_tier(direction: str, problem: Problem, mosaic: bool = True) -> tuple[Tier, str]:
    """The tier a direction runs on without a tuned entry. Both directions up to D = 256 run
    on the Mosaic kernels where they run (about cuDNN's speed, where the Triton kernels reach
    0.55-0.93x of it: docs/benchmarks.md); without them (`mosaic=False`: they cannot serve
    the problem or do not run here) the fused Triton kernels, and the chunked tier from
    D = 256 in the backward. The chunked tier's GEMMs beat the fused kernels'
    register-bound head-dim slices above D = 256 (H200, bf16); float32 keeps the fused
    kernels, whose backward recomputes its own normalised P exactly."""
    if problem.natural:
        return tiers.PALLAS, "built-in rule: float32 runs the fused kernels"
    if problem.headdim > MOSAIC_MAX_HEADDIM:
        return tiers.CHUNKED, f"built-in rule: chunked above D = 256 in the {direction}"
    if mosaic:
        return tiers.MOSAIC, f"built-in rule: mosaic up to D = 256 in the {direction}"
    if direction == "backward" and problem.headdim >= 256:
        return tiers.CHUNKED, "built-in rule: chunked from D = 256 in the backward"
    return tiers.PALLAS, f"built-in rule: pallas up to D = 256 in the {direction}"


def tuned_tier(direction: str, problem: Problem, device: Device) -> tuple[Tier | None, str]:
    """(the tier the matched tuned entry names, why), or (None, why not). An entry chooses
    among the tiers it measured ("tier_ms"): where the built-in rule names a tier the entry
    never measured (one added since the file was tuned), the entry has no say."""
    found, where = explain_entry(direction, TIER_KERNELS[direction], **device.lookup_keys(),
                                 **lookup_fields(problem, direction))
    if found is None:
        return None, where
    name = found.entry.get("tier")
    if name not in tiers.BY_NAME:
        return None, f"the matched entry ({where}) names no tier"
    measured = found.entry.get("tier_ms") or {}
    rule, _ = built_in_tier(direction, problem)
    if measured and rule.name not in measured:
        return None, (f"the matched entry ({where}) measured {sorted(measured)}, not "
                      f"{rule.name}")
    return tiers.BY_NAME[name], f"tuned entry ({where})"


def _rule(direction: str, problem: Problem, device: Device,
          mosaic: bool = True) -> tuple[Tier, str]:
    """The GPU's first applicable rule for `direction` (step 3 of the module docstring);
    `mosaic=False`: the rules without the Mosaic tier."""
    if mosaic and problem.mask_shape is not None:
        return _mask_rule(direction, problem, device)
    if problem.segment_ids and problem.headdim <= SEGMENTS_MAX_HEADDIM:
        low, high = SEGMENTS_MOSAIC[direction]
        fused_tier = (tiers.MOSAIC if mosaic and low < problem.headdim <= high
                      else tiers.PALLAS)
        return fused_tier, ("segment ids: the fused kernels skip the other segments' tiles "
                            f"({fused_tier.name})")
    if narrow_window(problem):
        # The Mosaic kernels skip hidden tiles too, and measured faster where they serve.
        fused_tier = (tiers.MOSAIC if mosaic and problem.headdim <= MOSAIC_MAX_HEADDIM
                      else tiers.PALLAS)
        return fused_tier, (f"a window of at most 1/{NARROW_WINDOW_RATIO} of the keys: the "
                            f"fused kernels skip the hidden tiles ({fused_tier.name})")
    if direction == "forward" and fused.uses_decode(problem):
        return tiers.PALLAS, (f"decode shape (T <= {fused.DECODE_MAX_QUERIES} queries against "
                              f">= {fused.DECODE_MIN_KEYS} keys): the decode kernels")
    tier, why = tuned_tier(direction, problem, device)
    if tier is not None and (mosaic or tier is not tiers.MOSAIC):
        return tier, why
    tier, rule = built_in_tier(direction, problem, mosaic)
    return tier, f"{rule} ({why})"


def _mask_rule(direction: str, problem: Problem, device: Device) -> tuple[Tier, str]:
    """A call with a mask. A key or query mask shared by the heads, without segment ids
    and up to D = 256, runs on the Mosaic kernels as segment ids (whose block ranges skip
    the key tiles outside the seen keys' span: key padding's tail): measured faster than
    the Triton kernels' dense mask reads in both directions at every head dim they serve
    (docs/benchmarks.md). Any other mask, and the decode shapes'
    forward (the split-KV kernels'): the rules without the Mosaic tier."""
    decode = direction == "forward" and fused.uses_decode(problem)
    if (visibility.mask_is_segments(problem.mask_shape) and not decode
            and not problem.segment_ids and problem.headdim <= MOSAIC_MAX_HEADDIM):
        return tiers.MOSAIC, ("a key or query mask shared by the heads: the Mosaic kernels "
                              "take it as segment ids")
    tier, why = _rule(direction, problem, device, mosaic=False)
    return tier, f"{why} (a mask the Mosaic tier does not take)"


def _off_gpu(problem: Problem, interpret: bool) -> tuple[Tier, str]:
    """The tier of both directions without an NVIDIA GPU (step 2 of the module docstring)."""
    if interpret:
        return tiers.PALLAS, "interpret=True: the Pallas kernels in Pallas' interpreter"
    dense_bytes = dense_logits_bytes(problem)
    budget = chunked_plan.budget_from_env()
    if dense_bytes > budget:
        return tiers.CHUNKED, (f"no NVIDIA GPU, and the dense logits ({dense_bytes / 2**20:.0f} "
                               f"MiB in float32) pass the chunked tier's workspace budget "
                               f"({budget / 2**20:g} MiB, ${chunked_plan.BUDGET_ENV})")
    return tiers.XLA, "no NVIDIA GPU: the dense plain-JAX path"


def _serving(tier: Tier, direction: str, problem: Problem, device: Device, interpret: bool,
             passed_over: list, deterministic: bool = False) -> Tier:
    """`tier`, or the first tier after it in the registry that runs here and serves
    `direction` of `problem` (each one passed over noted with why)."""
    for candidate in TIERS[TIERS.index(tier):]:
        why = _unavailable(candidate, direction, problem, device, interpret, deterministic)
        if why is None:
            return candidate
        passed_over.append((candidate.name, why))
    return tiers.XLA


def _unavailable(tier: Tier, direction: str, problem: Problem, device: Device,
                 interpret: bool, deterministic: bool) -> str | None:
    """Why `tier` cannot run `direction` of `problem` here (None: it can): it does not run
    on this device, or refuses the problem (`_refusal`)."""
    return (runs_here(tier, device, interpret)
            or _refusal(tier, direction, problem, deterministic))


def _require_runs_here(tier: Tier, device: Device, interpret: bool) -> None:
    """A ValueError when `implementation=tier.name` cannot run here, saying why and what to
    pass instead."""
    reason = runs_here(tier, device, interpret)
    if reason is None:
        return
    hint = (" Pass interpret=True to run its kernels in Pallas' interpreter (slow; for "
            "tests)," if tier.interpretable and not interpret else " Pass")
    raise ValueError(
        f"implementation={tier.name!r} {reason}, and the default JAX backend is "
        f"{devices.default_backend()!r}.{hint} implementation=None (the dispatcher's choice) "
        f"or implementation={tiers.XLA.name!r}.")


def _explicit(name: str, problem: Problem, device: Device, interpret: bool) -> Tier:
    """The tier `implementation=name` names, or a ValueError saying why it cannot run: it
    must run here and serve the forward (a backward it cannot serve goes to the rules:
    `_refusal`)."""
    tier = tiers.BY_NAME[name]
    _require_runs_here(tier, device, interpret)
    missing = tier.unsupported(problem, DIRECTIONS[0])
    if missing:
        raise ValueError(
            f"implementation={name!r} does not support {', '.join(missing)} in the "
            f"{DIRECTIONS[0]}. Pass implementation=None (another tier then runs it) or "
            f"{tiers.CHUNKED.name!r} (same results, bounded memory), or {tiers.XLA.name!r}.")
    return tier


def _refusal(tier: Tier, direction: str, problem: Problem, deterministic: bool) -> str | None:
    """Why `tier` does not run `direction` of `problem` wherever it runs (None: it does): it
    may not under `deterministic`, has no such direction, or lacks a feature there."""
    unordered = _unordered(tier, direction, deterministic)
    if unordered or direction not in tier.directions:
        return unordered or f"has no {direction} of its own"
    missing = tier.unsupported(problem, direction)
    return f"does not implement {', '.join(missing)} in the {direction}" if missing else None


def explain(problem: Problem, implementation: str | None = None, *, interpret: bool = False,
            device: Device | None = None, override: Override | None = None,
            deterministic: bool | None = None) -> Explanation:
    """What a call of `problem` with `implementation` runs on `device` (default: JAX's), and
    why; its `plan` is what the call runs. `override` (runtime autotune) may replace any
    kernel's config; `deterministic` (`resolve_deterministic`) may pass over a backward."""
    device = Device.current() if device is None else device
    ordered, determinism = resolve_deterministic(deterministic)
    passed_over: list[tuple[str, str]] = []

    def by_rules(direction: str) -> tuple[Tier, str]:
        if device.nvidia_gpu and not interpret:
            tier, why = _rule(direction, problem, device)
            refusal = tier is tiers.MOSAIC and _unavailable(tier, direction, problem, device,
                                                            interpret, ordered)
            if refusal:
                passed_over.append((tier.name, refusal))
                tier, why = _rule(direction, problem, device, mosaic=False)
                why = f"{why}; {tiers.MOSAIC.name} passed over"
        else:
            tier, why = _off_gpu(problem, interpret)
        served = _serving(tier, direction, problem, device, interpret, passed_over, ordered)
        if served is not tier:
            why = f"{why}; {tier.name} passed over, {served.name} runs it"
        return served, why

    chosen = {}
    if implementation is not None:
        if implementation not in tiers.BY_NAME:
            raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got "
                             f"{implementation!r}")
        tier = _explicit(implementation, problem, device, interpret)
        for direction in DIRECTIONS:
            refusal = _refusal(tier, direction, problem, ordered)
            if refusal is None:
                chosen[direction] = (tier, f"implementation={implementation!r}")
                continue
            # The rules pick the direction the named tier has not, or may not run.
            served, why = by_rules(direction)
            chosen[direction] = (served, f"{why} ({implementation!r} {refusal})")
    else:
        chosen = {direction: by_rules(direction) for direction in DIRECTIONS}
    dense = [(tier, why) for tier, why in chosen.values() if tier.differentiated_by_jax]
    if dense:
        # JAX differentiates that tier's forward itself: both directions are that tier's.
        chosen = {d: dense[0] for d in DIRECTIONS}
    vjp_forward = None
    if implementation is None and device.nvidia_gpu and not interpret:
        vjp_forward = vjp_forward_tier(problem, device, chosen["forward"][0],
                                       chosen["backward"][0])
    plan = _configured(problem, {d: tier for d, (tier, _) in chosen.items()}, interpret,
                       device, override, vjp_forward=vjp_forward and vjp_forward[0])
    plan = dataclasses.replace(plan, deterministic=ordered)
    return Explanation(forward=TierChoice(chosen["forward"][0].name, chosen["forward"][1]),
                       backward=TierChoice(chosen["backward"][0].name, chosen["backward"][1]),
                       passed_over=tuple(dict.fromkeys(passed_over)),  # once per tier and why
                       plan=plan, determinism=determinism,
                       vjp_forward=vjp_forward and TierChoice(vjp_forward[0].name,
                                                              vjp_forward[1]))


def vjp_forward_tier(problem: Problem, device: Device, forward: Tier,
                     backward: Tier) -> tuple[Tier, str] | None:
    """(the forward's tier when the call is differentiated, why), where the forward's tuned
    entry names one other than `forward` (`VJP_TIER_FIELD`): measured end to end, a
    forward+backward can run faster on a forward that is slower alone, when it is the
    backward's own tier (the chunked pair at D = 512 shares GEMMs in one program,
    docs/history.md, session 25). Only the backward's tier is taken: that is the pair
    measured; and only where it serves this forward here."""
    found, where = explain_entry("forward", TIER_KERNELS["forward"], **device.lookup_keys(),
                                 **lookup_fields(problem, "forward"))
    name = None if found is None else found.entry.get(VJP_TIER_FIELD)
    # A malformed field (not a tier's name) is no choice: the file is data, never a crash.
    if not isinstance(name, str) or name == forward.name or name != backward.name:
        return None
    tier = tiers.BY_NAME[name]  # the backward's tier: a registered one
    if tier.differentiated_by_jax or _unavailable(tier, "forward", problem, device,
                                                  interpret=False, deterministic=False):
        return None
    return tier, (f"tuned entry ({where}): forward+backward measured faster with the "
                  f"{name} forward before the {name} backward")


def plan(problem: Problem, implementation: str | None = None, *, interpret: bool = False,
         override: Override | None = None, deterministic: bool | None = None) -> Plan:
    """The plan of a call on JAX's device (`explain`'s)."""
    return explain(problem, implementation, interpret=interpret, override=override,
                   deterministic=deterministic).plan


def _configured(problem: Problem, chosen, interpret: bool, device: Device,
                override: Override | None = None, vjp_forward: Tier | None = None) -> Plan:
    """The plan of `chosen` ({direction: tier}) with its tiers' kernels' configs, and those
    of `vjp_forward`'s forward (the differentiated call's) where given."""
    target = _target(device, interpret)
    lookup = _lookup(problem, device, override)
    runs = [(chosen[direction], direction) for direction in DIRECTIONS]
    if vjp_forward is not None:
        runs.append((vjp_forward, "forward"))
    kernels = {}
    for tier, direction in runs:
        for choice in tier.configs(problem, direction, lookup, target):
            kernels.setdefault((choice.kernel, choice.direction), choice)
    return Plan(problem=problem, forward_tier=chosen["forward"].name,
                backward_tier=chosen["backward"].name, kernels=tuple(kernels.values()),
                interpret=interpret,
                vjp_forward_tier=None if vjp_forward is None else vjp_forward.name)


def _lookup(problem: Problem, device: Device, override: Override | None):
    """kernel -> (config dict, why): the override's, else the tuned entry's or default."""
    def lookup(kernel: str):
        found = None if override is None else override(kernel, problem)
        if found is not None:
            return found, "runtime autotune (autotune=...)"
        return kernel_config(kernel, problem, **device.lookup_keys())
    return lookup


def plan_for_tiers(problem: Problem, forward: str, backward: str, *,
                   interpret: bool = False, vjp_forward: str | None = None) -> Plan:
    """A plan with the given tiers (and the differentiated call's forward tier), their
    configs as a call would take them (the tier autotuner and the A/B scripts measure tiers
    this way)."""
    chosen = {"forward": tiers.BY_NAME[forward], "backward": tiers.BY_NAME[backward]}
    return _configured(problem, chosen, interpret, Device.current(),
                       vjp_forward=None if vjp_forward is None else tiers.BY_NAME[vjp_forward])


def paged_decode_configs(problem: Problem, *, interpret: bool = False):
    """The paged decode kernels' config for `problem` (one query per sequence against
    pages_per_seq · page keys), whatever the decode rule says of S: the `DecodeConfig` of
    both stages."""
    device = Device.current()
    target = _target(device, interpret)
    return fused.decode_configs(problem, _lookup(problem, device, None), target)[0].config


def paged_decode_kernels(implementation: str | None, *, interpret: bool = False,
                         device: Device | None = None) -> bool:
    """Whether `paged_attention` runs the fused tier's paged decode kernels (else the dense
    tier over the gathered pages): `implementation` None takes them where they run, the fused
    tier's name insists (a ValueError where they cannot run), the dense tier's declines."""
    device = Device.current() if device is None else device
    if implementation == tiers.XLA.name:
        return False
    if implementation == tiers.PALLAS.name:
        _require_runs_here(tiers.PALLAS, device, interpret)
    return runs_here(tiers.PALLAS, device, interpret) is None


def dense_logits_bytes(problem: Problem) -> int:
    """Bytes of the [B, Hq, T, S] float32 logits the dense path materialises."""
    return problem.batch * problem.heads_q * problem.seq_q * problem.seq_k * jnp.dtype(
        jnp.float32).itemsize
