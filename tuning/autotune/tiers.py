"""Measure which tier runs each direction fastest on this GPU and record it in the tuned file.

For every problem of the grid (square, T = S, causal or not, no bias or dropout: the
"common" case), every measured tier's forward and backward are timed on the same random
inputs (the tiers of the registry with a backward of their own that run on this GPU:
`measured_tiers`): the backwards take the same residuals (the output in float32 and lse),
so each direction is compared alone. The fastest tier goes into the "tier" field of the
entry that the dispatcher reads for that direction (`tuning.dispatch.TIER_KERNELS`:
fwd_generic for the forward, bwd_generic_dkdv for the backward), beside "tier_ms" with every
time; an absent entry is added with the built-in launch config. Where the two directions'
winners differ, both pairs are then timed as a differentiated call runs them, forward and
backward in one program (`measure_pair`: XLA may share work between the two, as the
chunked tier's GEMMs at D = 512): where the backward's tier's own pair is faster, the
forward entry's "tier_differentiated" names it (the forward of a differentiated call,
`tuning.dispatch.vjp_forward_tier`), beside "tier_pair_ms". FFPA's readers ignore these
fields.

    python -m tuning.autotune.tiers --file tuning/configs/NVIDIA_H200.json
        [--headdims 128,256,512] [--seqlens 1024,4096] [--causal both] [--dtypes bf16]
        [--B 1] [--H 32] [--budget-s 600]

`python -m tuning.autotune` runs this after its kernel tasks (and alone with --tiers-only).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from pallas_kernels import tiers as tiers_mod
from pallas_kernels.problem import DTYPES, Cotangents, Inputs, Problem, Saved
from tuning import dispatch
from tuning.autotune.tasks import Task, entries_for, entry_key
from tuning.defaults import default_config
from tuning.device import sanitize_device_name
from tuning.lookup import user_config_dir
from tuning.schema import load_config_file, write_config_file
from tuning.timing import median_ms


def problem_of(*, dtype: str, headdim: int, seqlen: int, causal: bool, batch: int,
               heads: int) -> Problem:
    return Problem(batch=batch, seq_q=seqlen, seq_k=seqlen, heads_q=heads, heads_kv=heads,
                   head_dim=headdim, head_dim_v=headdim, dtype=DTYPES[dtype],
                   scale=1.0 / math.sqrt(headdim), causal=causal)


def measured_tiers(direction: str | None = None) -> tuple[str, ...]:
    """The tiers whose directions are timed: those of the registry with kernels of their
    own (JAX differentiates the dense tier) that run on this GPU; with `direction`, those
    that have it."""
    device = dispatch.Device.current()
    return tuple(t.name for t in tiers_mod.TIERS if not t.differentiated_by_jax
                 and dispatch.runs_here(t, device, interpret=False) is None
                 and (direction is None or direction in t.directions))


def _plan(problem: Problem, tier: str):
    """The vjp's plan of `tier` in the directions it has (float32 output: the backward's
    residual); a forward-only tier's backward is the fused tier's, which is not timed."""
    backward = tier if "backward" in tiers_mod.BY_NAME[tier].directions else tiers_mod.PALLAS.name
    return dispatch.plan_for_tiers(problem, tier, backward).for_vjp()


def _arrays(problem: Problem):
    """Random q, k, v and the output's cotangent of `problem` (seeded by its shape)."""
    keys = jax.random.split(jax.random.key(problem.head_dim * 7919 + problem.seq_q), 4)
    shape_q = (problem.batch, problem.seq_q, problem.heads_q, problem.head_dim)
    shape_k = (problem.batch, problem.seq_k, problem.heads_kv, problem.head_dim)
    return tuple(jax.random.normal(key, shape, problem.dtype)
                 for key, shape in zip(keys, (shape_q, shape_k, shape_k, shape_q)))


def measure(problem: Problem, *, min_rep_s: float = 0.05, reps: int = 5) -> dict:
    """{direction: {tier: ms}} of `problem` (ms None where a tier failed to run)."""
    q, k, v, do = _arrays(problem)
    times: dict[str, dict[str, float | None]] = {"forward": {}, "backward": {}}
    residuals = None
    for tier in measured_tiers("forward"):
        plan = _plan(problem, tier)
        forward = jax.jit(lambda q, k, v, plan=plan: tiers_mod.forward(plan, Inputs(q, k, v)))
        try:
            times["forward"][tier] = median_ms(forward, (q, k, v), min_rep_s=min_rep_s,
                                               reps=reps)
            if residuals is None:
                residuals = jax.block_until_ready(forward(q, k, v))
        except Exception as exc:  # noqa: BLE001 - a tier that cannot run this problem loses
            print(f"  forward {tier}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            times["forward"][tier] = None
    if residuals is None:
        return times
    out, *rows = residuals
    d_lse = jnp.zeros_like(rows[0])
    for tier in measured_tiers("backward"):
        plan = _plan(problem, tier)
        backward = jax.jit(lambda q, k, v, out, do, *rows, plan=plan: tiers_mod.backward(
            plan, Inputs(q, k, v), Saved(out, *rows), Cotangents(do, d_lse)))
        try:
            times["backward"][tier] = median_ms(backward, (q, k, v, out, do, *rows),
                                                min_rep_s=min_rep_s, reps=reps)
        except Exception as exc:  # noqa: BLE001
            print(f"  backward {tier}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)
            times["backward"][tier] = None
    return times


def measure_pair(problem: Problem, forward: str, backward: str, *, min_rep_s: float = 0.05,
                 reps: int = 5) -> float | None:
    """ms of `forward`'s forward and `backward`'s backward of `problem` in one jitted
    program, as a differentiated call runs them (None where it failed to run)."""
    q, k, v, do = _arrays(problem)
    forward_plan, backward_plan = _plan(problem, forward), _plan(problem, backward)

    def step(q, k, v, do):
        out, *rows = tiers_mod.forward(forward_plan, Inputs(q, k, v))
        cotangents = Cotangents(do, jnp.zeros_like(rows[0]))
        return tiers_mod.backward(backward_plan, Inputs(q, k, v), Saved(out, *rows),
                                  cotangents)
    try:
        return median_ms(jax.jit(step), (q, k, v, do), min_rep_s=min_rep_s, reps=reps)
    except Exception as exc:  # noqa: BLE001 - a pair that cannot run is not chosen
        print(f"  pair {forward}/{backward}: {type(exc).__name__}: {str(exc)[:200]}",
              file=sys.stderr)
        return None


def pairs_to_time(times: dict) -> tuple[tuple[str, str], ...]:
    """The (forward, backward) tier pairs to time in one program: the two directions'
    winners, and the backward's tier in both directions, where the winners differ."""
    forward, backward = winner(times["forward"]), winner(times["backward"])
    if forward is None or backward is None or forward == backward:
        return ()
    return (forward, backward), (backward, backward)


def differentiated_tier(times: dict, pair_ms: dict[str, float | None]) -> str | None:
    """The forward tier a differentiated call should run: the backward's where its own
    pair ran faster than the winners' pair in one program (`pair_ms`, keyed
    "forward/backward"), else None (the forward's winner)."""
    pairs = pairs_to_time(times)
    if not pairs:
        return None
    winners, own = ("/".join(pair) for pair in pairs)
    if pair_ms.get(winners) is None or pair_ms.get(own) is None:
        return None
    return pairs[1][0] if pair_ms[own] < pair_ms[winners] else None


def winner(times: dict[str, float | None]) -> str | None:
    ran = {tier: ms for tier, ms in times.items() if ms is not None}
    return min(ran, key=ran.get) if ran else None


def record(entries: list[dict], problem: Problem, direction: str, times: dict) -> None:
    """Write the direction's winning tier into its entry of `entries` (added when absent)."""
    tier = winner(times)
    if tier is None:
        return
    for entry in _entries_of(entries, problem, direction):
        entry["tier"] = tier
        entry["tier_ms"] = {t: None if ms is None else round(ms, 4) for t, ms in times.items()}


def record_pairs(entries: list[dict], problem: Problem, times: dict,
                 pair_ms: dict[str, float | None]) -> None:
    """Write the differentiated call's forward tier (`differentiated_tier`) and the pairs'
    times into the forward's entries, or clear both where no pair says so (a file
    re-measured keeps no stale choice)."""
    tier = differentiated_tier(times, pair_ms)
    for entry in _entries_of(entries, problem, "forward"):
        for field in [f for f in entry if f.startswith(dispatch.VJP_TIER_FIELD)]:
            entry.pop(field)  # with its note (a hand-set choice's "..._measured")
        entry.pop("tier_pair_ms", None)
        if pair_ms:
            entry["tier_pair_ms"] = {pair: None if ms is None else round(ms, 4)
                                     for pair, ms in pair_ms.items()}
        if tier is not None:
            entry[dispatch.VJP_TIER_FIELD] = tier


def _entries_of(entries: list[dict], problem: Problem, direction: str) -> list[dict]:
    """The entries of `entries` that carry `direction`'s tier for `problem`, one added
    with the built-in launch config where there is none."""
    kernel = dispatch.TIER_KERNELS[direction]
    task = Task(direction=direction, kernel=kernel, case_name="common",
                dtype=problem.dtype_name, headdim=problem.head_dim, seqlen_q=problem.seq_q,
                seqlen_k=problem.seq_k, causal=problem.causal, batch=problem.batch,
                nheads_q=problem.heads_q, nheads_kv=problem.heads_kv)
    key = task.key
    matches = [e for e in entries if entry_key(e) == key]
    if not matches:
        config = default_config(kernel, headdim=problem.headdim, dtype=problem.dtype_name)
        matches = entries_for(task, config)[:1]
        entries.extend(matches)
    return matches


def merged_grid(old: dict | None, new: dict) -> dict:
    """The file's "tier_grid" after measuring `new` on top of `old`: a run over some head
    dims or lengths re-measures those points and keeps the others' entries, so the grid
    names the union (causal "both" where the two runs differ). A grid of another B or H
    describes other problems: `new` replaces it."""
    if not old or (old.get("B"), old.get("H")) != (new["B"], new["H"]):
        return dict(new)
    union = {key: sorted(set(old.get(key, ())) | set(new[key]))
             for key in ("headdims", "seqlens", "dtypes")}
    causal = new["causal"] if old.get("causal") == new["causal"] else "both"
    return {**union, "causal": causal, "B": new["B"], "H": new["H"]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tuning.autotune.tiers",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, help="the tuned file to update (default: "
                        "<output-dir>/<this device>.json)")
    parser.add_argument("--output-dir", type=Path, default=user_config_dir(),
                        help="where <this device>.json is (default: the user's tuned-config "
                             "directory, which the trace-time lookup reads)")
    ints = lambda text: [int(x) for x in text.split(",") if x]
    parser.add_argument("--headdims", type=ints, default=[128, 256, 320, 512, 768, 1024])
    parser.add_argument("--seqlens", type=ints, default=[1024, 4096, 16384])
    parser.add_argument("--causal", choices=("both", "true", "false"), default="both")
    parser.add_argument("--dtypes", type=lambda t: t.split(","), default=["bf16"])
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--H", type=int, default=32)
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="stop starting new problems after this many seconds")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = jax.devices()[0]
    if device.platform != "gpu":
        print("error: the tiers are measured on an NVIDIA GPU; JAX's device is "
              f"{device.platform!r}", file=sys.stderr)
        return 2
    path = args.file or (args.output_dir / f"{sanitize_device_name(device.device_kind)}.json")
    loaded = load_config_file(path) if path.exists() else None
    if path.exists() and loaded is None:
        print(f"error: {path} is not a valid tuned-config file", file=sys.stderr)
        return 2
    header = dict(loaded.header) if loaded is not None else {
        "device_name": device.device_kind, "autotune_mode": "fast", "B": args.B, "H": args.H,
        "compute_capability": str(getattr(device, "compute_capability", "")) or None}
    entries = [dict(e) for e in loaded.entries] if loaded is not None else []
    header["tier_grid"] = merged_grid(header.get("tier_grid"), {
        "headdims": args.headdims, "seqlens": args.seqlens, "causal": args.causal,
        "dtypes": args.dtypes, "B": args.B, "H": args.H})
    causal = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    started = time.monotonic()
    for dtype, d, n, c in itertools.product(args.dtypes, args.headdims, args.seqlens, causal):
        if time.monotonic() - started > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: stopping", file=sys.stderr)
            break
        problem = problem_of(dtype=dtype, headdim=d, seqlen=n, causal=c, batch=args.B,
                             heads=args.H)
        times = measure(problem)
        for direction in ("forward", "backward"):
            record(entries, problem, direction, times[direction])
        pair_ms = {"/".join(pair): measure_pair(problem, *pair)
                   for pair in pairs_to_time(times)}
        record_pairs(entries, problem, times, pair_ms)
        print(json.dumps({"dtype": dtype, "headdim": d, "seqlen": n, "causal": c, **times,
                          "pairs": pair_ms}), flush=True)
        write_config_file(path, header, entries)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
