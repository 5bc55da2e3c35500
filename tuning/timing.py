"""The one timing helper: per-call milliseconds of a warm call, for the bench, the autotuner's
tier measurement and the maintained scripts. Wall clock around `block_until_ready`, so
the device work is inside the samples; short calls are looped so that launch overhead
does not decide."""

from __future__ import annotations

import statistics
import time

import jax


def time_samples(fn, args, *, min_rep_s: float, reps: int, budget_s: float = 5.0) -> list[float]:
    """Per-call milliseconds, `reps` samples of a warm call (after one warm-up call).

    Each sample times `inner` back-to-back calls (enough to last min_rep_s) and blocks at
    the end; a call slower than budget_s / reps gets fewer samples (at least 3)."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = max(time.perf_counter() - start, 1e-6)
    inner = max(1, int(min_rep_s / once))
    if once * inner * reps > budget_s:
        reps = min(reps, max(3, int(budget_s / (once * inner))))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append(1e3 * (time.perf_counter() - start) / inner)
    return samples


def median_ms(fn, args, *, min_rep_s: float = 0.05, reps: int = 7, budget_s: float = 5.0) -> float:
    """The median of `time_samples`."""
    return statistics.median(time_samples(fn, args, min_rep_s=min_rep_s, reps=reps,
                                          budget_s=budget_s))
