"""tuning.timing: the one timing helper of the bench, the autotuner and the scripts."""

from __future__ import annotations

import time

import jax.numpy as jnp

from tuning import timing


def test_calls_per_sample_loops_short_calls_and_caps():
    assert timing.calls_per_sample(0.001, 0.01) == 10
    assert timing.calls_per_sample(0.001, 0.01, most=4) == 4
    assert timing.calls_per_sample(0.5, 0.01) == 1          # a slow call: one per sample
    assert timing.calls_per_sample(0.0, 0.01) == 10_000     # a zero time counts as 1 us


def test_looped_samples_calls_inner_times_reps_and_returns_milliseconds():
    calls = []

    def fn(x):
        calls.append(1)
        return x + 1

    samples = timing.looped_samples(fn, (jnp.zeros(()),), inner=4, reps=3)
    assert len(calls) == 12 and len(samples) == 3
    assert all(0.0 <= ms < 1e4 for ms in samples)


def test_time_samples_warms_up_then_keeps_to_the_budget():
    calls = []

    def slow(x):
        calls.append(1)
        time.sleep(0.02)
        return x

    samples = timing.time_samples(slow, (jnp.zeros(()),), min_rep_s=0.0, reps=50, budget_s=0.07)
    # Two untimed calls (warm-up, then the one that sizes the loop); a 20 ms call within a
    # 0.07 s budget gets the minimum of 3 samples of one call each.
    assert len(samples) == 3 and len(calls) == 2 + 3
    assert all(ms >= 19.0 for ms in samples)
