"""A/B of the committed tuned file on this GPU, at every grid point of it (forward entries:
the forward; backward entries: forward+backward; decode entries: T = 1 against
S = seqlen_k). The public `ffpa_jax.attention` is timed twice in one process:

- `--versus defaults` (the default): with the file (A) and with
  FFPA_SKIP_PERSIST_TUNED_CONFIG=1 (B, the built-in configs and tier rule);
- `--versus pallas`: the tuned dispatch, each direction on its tier (A), against
  implementation="pallas" with the same file (B, the fused kernels alone).

The two are timed alternately, several rounds, and each side's median is kept, so clock
drift hits both alike. Where A and B would run exactly the same kernels and launch
parameters they compile to the same program; the point is recorded as "same plan" and
not timed.

    python scripts/tuned_ab.py --out ab.json [--config tuning/configs/NVIDIA_H200.json]
        [--versus defaults|pallas]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import ffpa_jax
import tuning
from ffpa_jax import validation
from tuning.lookup import ENV_SKIP, PACKAGED_CONFIG_DIR
from tuning.timing import time_samples

SKIP = ENV_SKIP[0]
SMALL_CALL_MS = 0.1
SMALL_CALL_ROUNDS = 9


def grid_points(entries) -> list[tuple[str, int, int, int, bool]]:
    """(mode, D, T, S, causal) per distinct problem of the file's common/decode entries."""
    points = set()
    for e in entries:
        if e.get("dtype") != "bf16" or e.get("has_attn_bias") or e.get("has_dropout"):
            continue
        if e["kernel"].startswith("decode"):
            points.add(("decode", e["headdim"], 1, e["seqlen_k"], bool(e["causal"])))
        elif e.get("nheads_q") == e.get("nheads_kv"):
            mode = "fwd" if e["direction"] == "forward" else "fwdbwd"
            points.add((mode, e["headdim"], e["seqlen_q"], e["seqlen_k"], bool(e["causal"])))
    return sorted(points)


def plan_for(q, k, v, causal: bool, implementation: str):
    """The plan `attention` would trace for these inputs under the current env."""
    problem = validation.validate(q, k, v, None, None, scale=None, is_causal=causal,
                                  dropout_rate=0.0, dropout_rng=None, return_lse=False,
                                  implementation=None, interpret=False).problem
    return tuning.plan(problem, None if implementation == "auto" else implementation)


def kernels_used(plan, mode: str) -> tuple:
    """What a call of `mode` runs under `plan`: tiers and launch parameters."""
    directions = ("forward",) if mode in ("fwd", "decode") else ("forward", "backward")
    return tuple((plan.tier(d), c.kernel, c.config) for d in directions
                 for c in plan.kernels if c.direction == d)


def make_fn(mode: str, causal: bool, implementation: str):
    """A freshly jitted call (a new function object, so it is traced under the env now)."""
    impl = None if implementation == "auto" else implementation
    attend = lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=causal, implementation=impl)
    if mode in ("fwd", "decode"):
        return jax.jit(lambda q, k, v, do: attend(q, k, v))

    def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out, *vjp(do))
    return jax.jit(fwd_bwd)


def with_env(skip: bool):
    """Tuned file on or off; lookups cache per environment, so no cache to clear."""
    if skip:
        os.environ[SKIP] = "1"
    else:
        os.environ.pop(SKIP, None)


def measure_point(point, *, batch: int, heads: int, rounds: int, time_all: bool,
                  versus: str) -> dict:
    mode, d, t, s, causal = point
    record = {"mode": mode, "headdim": d, "seqlen_q": t, "seqlen_k": s, "causal": causal,
              "batch": batch, "heads": heads}
    keys = jax.random.split(jax.random.key(d * 100003 + s), 4)
    q = jax.random.normal(keys[0], (batch, t, heads, d), jnp.bfloat16)
    k = jax.random.normal(keys[1], (batch, s, heads, d), jnp.bfloat16)
    v = jax.random.normal(keys[2], (batch, s, heads, d), jnp.bfloat16)
    do = jax.random.normal(keys[3], (batch, t, heads, d), jnp.bfloat16)
    args = (q, k, v, do)
    # (env skip, implementation) of A ("tuned") and B ("default")
    sides = {"tuned": (False, "auto"),
             "default": (True, "auto") if versus == "defaults" else (False, "pallas")}
    plans = {}
    fns = {}
    for name, (skip, implementation) in sides.items():
        with_env(skip)
        plans[name] = kernels_used(plan_for(q, k, v, causal, implementation), mode)
        fn = make_fn(mode, causal, implementation)
        fns[name] = fn.lower(*args).compile() if (time_all or name == "tuned") else None
    with_env(False)
    record["tuned_plan"] = repr(plans["tuned"])
    if plans["tuned"] == plans["default"] and not time_all:
        record["status"] = "same plan"
        return record
    if fns["default"] is None:
        skip, implementation = sides["default"]
        with_env(skip)
        fns["default"] = make_fn(mode, causal, implementation).lower(*args).compile()
        with_env(False)
    record["default_plan"] = repr(plans["default"])
    samples = {"tuned": [], "default": []}
    done = 0
    while done < rounds:
        for name in ("tuned", "default"):
            samples[name] += time_samples(fns[name], args, min_rep_s=0.02, reps=3, budget_s=2.0)
        done += 1
        # Calls under SMALL_CALL_MS swing by several percent between samples (rounds 2
        # and 3 saw one decode point move from 0.95 to 1.02): time them in more rounds.
        if done == 1 and statistics.median(samples["default"]) < SMALL_CALL_MS:
            rounds = max(rounds, SMALL_CALL_ROUNDS)
    record["rounds"] = rounds
    record["tuned_ms"] = statistics.median(samples["tuned"])
    record["default_ms"] = statistics.median(samples["default"])
    record["ratio"] = record["tuned_ms"] / record["default_ms"]
    record["status"] = "ok"
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", help="tuned-config file (default: this device's packaged one)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--time-all", action="store_true",
                        help="time points whose tuned and default plans are equal, too")
    parser.add_argument("--points", help="only modes in this comma list (fwd,fwdbwd,decode)")
    parser.add_argument("--versus", choices=("defaults", "pallas"), default="defaults",
                        help="B: the built-in configs and tier rule, or the fused kernels "
                             "alone (implementation='pallas')")
    parser.add_argument("--headdims", help="only these head dims (comma list)")
    args = parser.parse_args()

    device_name, _ = tuning.current_device()
    path = args.config or str(PACKAGED_CONFIG_DIR / f"{tuning.sanitize_device_name(device_name or '')}.json")
    if args.config:
        os.environ["FFPA_TUNED_CONFIG_DIR"] = os.path.dirname(os.path.abspath(path))
    file = tuning.load_config_file(path)
    if file is None:
        print(f"no valid tuned-config file at {path}", file=sys.stderr)
        return 2
    batch, heads = int(file.header.get("B", 1)), int(file.header.get("H", 32))
    points = grid_points(file.entries)
    if args.points:
        points = [p for p in points if p[0] in args.points.split(",")]
    if args.headdims:
        points = [p for p in points if p[1] in {int(d) for d in args.headdims.split(",")}]
    results = {"device": jax.devices()[0].device_kind, "config_file": os.path.basename(path),
               "versus": args.versus,
               "date": time.strftime("%Y-%m-%d"), "jax": jax.__version__, "records": []}
    started = time.time()
    for point in points:
        if time.time() - started > args.budget_s:
            results["records"].append({"point": list(point), "status": "skipped: budget"})
            continue
        try:
            record = measure_point(point, batch=batch, heads=heads, rounds=args.rounds,
                                   time_all=args.time_all, versus=args.versus)
        except Exception as exc:  # noqa: BLE001 - one bad point must not lose the others
            record = {"point": list(point), "status": f"error: {type(exc).__name__}: "
                      + (str(exc).splitlines() or [""])[0][:200]}
        results["records"].append(record)
        print(json.dumps({k: v for k, v in record.items() if not k.endswith("_plan")}),
              flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    timed = [r for r in results["records"] if r.get("status") == "ok"]
    if timed:
        speedups = [r["default_ms"] / r["tuned_ms"] for r in timed]
        worst = min(timed, key=lambda r: r["default_ms"] / r["tuned_ms"])
        print(f"{len(timed)} timed points ({args.versus}); speedup B time / A time: geomean "
              f"{math.exp(statistics.fmean(math.log(x) for x in speedups)):.3f}, lowest "
              f"{min(speedups):.3f} at {worst['mode']} D={worst['headdim']} "
              f"S={worst['seqlen_k']} causal={worst['causal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
