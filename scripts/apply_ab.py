"""Give the built-in defaults back to the tuned entries that lost an end-to-end A/B.

The autotuner times each kernel alone; `scripts/tuned_ab.py` times the public call
with the tuned file against the defaults. Every grid point the A/B found slower with
the tuned file (ratio above --threshold) gets, for each kernel that point runs, the
built-in default config in its entry (marked `ab_replaced_by_default` with the
measured ratio), so that point then compiles to the default program itself. A
threshold below 1 also gives the defaults to points whose gain is within the A/B's
run-to-run noise (round 2 found points at 1.001-1.012 that had won round 1).

    python scripts/apply_ab.py --ab tuned_ab.json --config tuning/configs/<device>.json
"""

from __future__ import annotations

import argparse
import json
import sys

import tuning

KERNELS = {
    "fwd": ("fwd_generic",),
    "fwdbwd": ("fwd_generic", "bwd_preproc", "bwd_generic_dq", "bwd_generic_dkdv"),
    "decode": ("decode_fwd_stage1", "decode_fwd_stage2"),
}


def same_problem(a: dict, b: dict) -> bool:
    return all(a[key] == b[key] for key in ("headdim", "seqlen_q", "seqlen_k", "causal"))


def kernels_to_replace(record: dict, records: list[dict], threshold: float) -> tuple[str, ...]:
    """The kernels of a losing point that go back to the defaults. A forward+backward
    point keeps its forward entry where the forward-only point of the same problem won
    on its own (the backward kernels are then the ones that lost)."""
    kernels = KERNELS[record["mode"]]
    if record["mode"] == "fwdbwd" and any(
            r.get("status") == "ok" and r["mode"] == "fwd" and same_problem(r, record)
            and r["ratio"] <= threshold for r in records):
        kernels = tuple(k for k in kernels if k != "fwd_generic")
    return kernels


def entry_matches(entry: dict, record: dict, kernels: tuple[str, ...]) -> bool:
    """Is `entry` one of `kernels` that the A/B point `record` ran (bf16, no bias, no
    dropout, H = Hkv)?"""
    if (entry.get("dtype") != "bf16" or entry.get("has_attn_bias") or entry.get("has_dropout")
            or entry["kernel"] not in kernels
            or entry["headdim"] != record["headdim"]
            or bool(entry["causal"]) != bool(record["causal"])
            or entry["seqlen_q"] != record["seqlen_q"] or entry["seqlen_k"] != record["seqlen_k"]):
        return False
    return entry.get("nheads_q") == entry.get("nheads_kv") == record["heads"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ab", required=True, help="the JSON written by scripts/tuned_ab.py")
    parser.add_argument("--config", required=True, help="the tuned-config file to update")
    parser.add_argument("--threshold", type=float, default=1.0,
                        help="replace where tuned/default time is above this")
    args = parser.parse_args()
    with open(args.ab) as f:
        ab = json.load(f)
    with open(args.config) as f:
        data = json.load(f)
    losers = [r for r in ab["records"] if r.get("status") == "ok" and r["ratio"] > args.threshold]
    replaced = 0
    for record in losers:
        note = (f"scripts/tuned_ab.py {ab.get('date', '')}: the tuned config took "
                f"{record['ratio']:.3f}x the default's time end to end (kept only at or "
                f"below {args.threshold})")
        kernels = kernels_to_replace(record, ab["records"], args.threshold)
        for entry in data["entries"]:
            if not entry_matches(entry, record, kernels) or "ab_replaced_by_default" in entry:
                continue
            entry["config"] = tuning.default_config(entry["kernel"], headdim=entry["headdim"],
                                                    dtype="bf16")
            if entry.get("default_ms") is not None:
                entry["tuned_ms"] = entry["default_ms"]
            entry["ab_replaced_by_default"] = note
            replaced += 1
    header = {k: v for k, v in data.items() if k != "entries"}
    tuning.write_config_file(args.config, header, data["entries"])
    print(f"{len(losers)} points above {args.threshold}x the defaults; {replaced} entries now hold the "
          f"default config", file=sys.stderr)
    if tuning.load_config_file(args.config) is None:
        print(f"{args.config} no longer validates", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
