"""The one timing helper: per-call milliseconds of a warm call, for the bench, the autotuner
(its candidates and its tier measurement) and the maintained scripts. Wall clock around
`block_until_ready`, so the device work is inside the samples; short calls are looped so
that launch overhead does not decide."""

from __future__ import annotations

import statistics
import time

import jax


def calls_per_sample(once_s: float, min_sample_s: float, *, most: int | None = None) -> int:
    """How many back-to-back calls of `once_s` seconds each make one sample last at least
    `min_sample_s` (at least 1, at most `most`)."""
    inner = max(1, int(min_sample_s / max(once_s, 1e-6)))
    return inner if most is None else min(most, inner)


def looped_samples(fn, args, *, inner: int, reps: int) -> list[float]:
    """Per-call milliseconds, `reps` samples: each times `inner` back-to-back calls and
    blocks at the end (no warm-up: the caller's `fn` is warm)."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append(1e3 * (time.perf_counter() - start) / inner)
    return samples


def time_samples(fn, args, *, min_rep_s: float, reps: int, budget_s: float = 5.0) -> list[float]:
    """Per-call milliseconds, `reps` samples of a warm call (after one warm-up call).

    Each sample times enough back-to-back calls to last min_rep_s and blocks at the end; a
    call slower than budget_s / reps gets fewer samples (at least 3)."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = max(time.perf_counter() - start, 1e-6)
    inner = calls_per_sample(once, min_rep_s)
    if once * inner * reps > budget_s:
        reps = min(reps, max(3, int(budget_s / (once * inner))))
    return looped_samples(fn, args, inner=inner, reps=reps)


def median_ms(fn, args, *, min_rep_s: float = 0.05, reps: int = 7, budget_s: float = 5.0) -> float:
    """The median of `time_samples`."""
    return statistics.median(time_samples(fn, args, min_rep_s=min_rep_s, reps=reps,
                                          budget_s=budget_s))
