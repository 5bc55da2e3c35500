"""What the variant sweeps share: compile, check against a reference, time, record."""

from __future__ import annotations

import argparse
import json
import time

import jax

from ffpa_jax.bench import _time_ms


def base_parser(*, budget_s: float) -> argparse.ArgumentParser:
    """The arguments every sweep takes."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="64,128,256,512,1024")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--budget-s", type=float, default=budget_s)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--interpret", action="store_true", help="CPU smoke run of the sweep")
    parser.add_argument("--out", required=True)
    return parser


def measure_candidate(record: dict, fn, argv, *, error_of, tolerance: float, flops: float,
                      reps: int = 5) -> dict:
    """Fill `record` with compile time, error, ms and TF/s (or a failure status).

    `error_of(outputs)` gives the relative error against the reference; a candidate
    above `tolerance` is marked "wrong result" and never timed. A compile failure
    (e.g. shared memory overflow) is recorded, not raised.
    """
    try:
        started = time.time()
        compiled = jax.jit(fn).lower(*argv).compile()
        outputs = compiled(*argv)
        jax.block_until_ready(outputs)
        record["compile_s"] = round(time.time() - started, 1)
        record["rel_err"] = error_of(outputs)
        if record["rel_err"] > tolerance:
            record["status"] = "wrong result"
        else:
            record["ms"] = _time_ms(compiled, argv, min_rep_s=0.05, reps=reps)
            record["tflops"] = flops / (record["ms"] * 1e-3) / 1e12
            record["status"] = "ok"
    except Exception as exc:
        record["status"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return record


def save(results: list[dict], record: dict, path: str) -> None:
    """Append, print and rewrite the results file (so an interrupted sweep keeps its data)."""
    results.append(record)
    print(json.dumps(record), flush=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
