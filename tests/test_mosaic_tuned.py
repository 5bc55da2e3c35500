"""The Mosaic tier's configs in the tuned files (CPU): what an entry may carry, how a call
takes it or why not, the autotuner's candidates and tasks for the two kernels, and a tuned
file's entry reaching the plan through the lookup."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import compat
from pallas_kernels.mosaic import tuned
from pallas_kernels.mosaic.config import Config, default_backward_config, default_config
from pallas_kernels.problem import FeatureArrays, Problem
from tuning import dispatch
from tuning.autotune import search_space
from tuning.autotune.runners import RUNNERS
from tuning.autotune.tasks import (MOSAIC_BACKWARD_KERNEL, MOSAIC_FORWARD_KERNEL, Task,
                                   build_tasks, entries_for)
from tuning.lookup import clear_cache
from tuning.registry import config_problem
from tuning.schema import load_config_file, write_config_file

sd = jax.ShapeDtypeStruct
FWD, BWD = tuned.FORWARD_KERNEL, tuned.BACKWARD_KERNEL
DEVICE = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("kernel,config,why", [
    (FWD, {"block_kv": 96}, "must be 64, 128, 192 or 256"),
    (FWD, {"cluster": 3}, "cluster must be 1, 2 or 4"),
    (FWD, {"num_stages": 0}, "num_stages=0 not in 1..6"),
    (FWD, {"block_kv": 128.0}, "is not int"),
    (FWD, {"wide": 1}, "is not bool"),
    (FWD, {"wide": True, "overlap": True}, "overlap: the rows kernel's"),
    (FWD, {"block_q": 64}, "'block_q' is not a field of mosaic_fwd's config"),
    (BWD, {"block_q": 96}, "block_q=96 must be 64 or 128"),
    (BWD, {"BLOCK_M": 64}, "'BLOCK_M' is not a field"),
    (BWD, [64], "config is list, expected a dict"),
])
def test_a_malformed_entry_says_why(kernel, config, why):
    assert why in config_problem(kernel, config)


def test_the_defaults_fields_are_a_valid_entry():
    for d in (40, 64, 128, 256, 320, 512):
        assert config_problem(FWD, tuned.as_fields(FWD, default_config(d, d))) is None
    for d in (64, 128, 256):
        assert config_problem(BWD, tuned.as_fields(BWD, default_backward_config(d, d))) is None


def _take(kernel, default, fields, d=128, group=1, segments=False):
    return tuned.tuned_config(kernel, default, fields, head_dim=d, head_dim_v=d, group=group,
                              segments=segments)


def test_an_entry_changes_only_its_fields():
    default = default_config(128, 128)
    config, note = _take(FWD, default, {"block_kv": 64, "num_stages": 3, "wide": False})
    assert note == "" and (config.block_kv, config.num_stages) == (64, 3)
    assert config.lowering == default.lowering and config.consumer_regs == default.consumer_regs
    assert _take(FWD, default, None) == (default, "")


def test_an_entry_without_the_newer_fields_runs_as_it_was_measured():
    """An entry written before `persistent` and `overlap` existed was measured on one CTA
    per tile without the overlap: it runs so, whatever the built-in config says."""
    default = dataclasses.replace(default_config(256, 256), persistent=True, overlap=True)
    config, note = _take(FWD, default, {"block_kv": 64, "num_stages": 3}, d=256)
    assert note == "" and not config.persistent and not config.overlap
    config, _ = _take(FWD, default, {"block_kv": 64, "overlap": True}, d=256)
    assert config.overlap


@pytest.mark.parametrize("kernel,d,group,segments,fields,why", [
    (FWD, 128, 1, True, {"block_kv": 64}, "not with segment ids"),
    (FWD, 256, 1, False, {"wide": True}, "tuned on the wide kernel"),
    (FWD, 512, 1, False, {"wide": False}, "tuned on the rows kernel"),
    (FWD, 128, 3, False, {"cluster": 2, "cluster_axis": "heads"},
     "clusters of 2 query heads do not divide the GQA group of 3"),
    (FWD, 512, 1, False, {"wide": True, "block_kv": 64}, "at least 128 keys per step"),
    (BWD, 128, 1, False, {"block_q": 128}, "fit only head dims up to 64"),
])
def test_an_entry_a_call_cannot_take_leaves_the_default(kernel, d, group, segments, fields,
                                                        why):
    default = (default_backward_config(d, d) if kernel == BWD
               else default_config(d, d, gqa_group=group))
    config, note = _take(kernel, default, fields, d=d, group=group, segments=segments)
    assert config == default and why in note


@pytest.mark.parametrize("kernel,d,group", [
    (FWD, 64, 1), (FWD, 128, 4), (FWD, 256, 3), (FWD, 512, 1), (FWD, 512, 4),
    (BWD, 64, 1), (BWD, 128, 4), (BWD, 256, 1)])
def test_candidates_start_at_the_default_and_are_all_runnable(kernel, d, group):
    default = (default_backward_config(d, d) if kernel == BWD
               else default_config(d, d, gqa_group=group))
    fast = search_space.candidates(kernel, headdim=d, group=group)
    grid = search_space.candidates(kernel, headdim=d, group=group, mode="max")
    assert fast[0] == tuned.as_fields(kernel, default) == grid[0]
    assert len(fast) <= search_space.FAST_LIMIT and len(grid) >= len(fast)
    assert fast == grid[:len(fast)]
    for fields in grid:
        assert config_problem(kernel, fields) is None
        config, note = _take(kernel, default, fields, d=d, group=group)
        assert note == "" and isinstance(config, Config)
    assert len({json.dumps(f, sort_keys=True) for f in grid}) == len(grid)
    if kernel == FWD and d <= 256:  # the rows kernel's knobs move one at a time
        assert {f["block_kv"] for f in fast} == {64, 128, 256}


def _tasks(mosaic, **kw):
    args = dict(directions=("forward", "backward"), dtypes=("bf16", "fp32"), batch=1, heads=8,
                headdims=(64, 256, 512), seqlens=(1, 128, 512), full_tasks=True, mosaic=mosaic)
    args.update(kw)
    return build_tasks(**args)


def test_the_mosaic_tasks_follow_ffpas_grid_where_the_tier_computes_them():
    plain, with_mosaic = _tasks(False), _tasks(True)
    assert with_mosaic[:len(plain)] == plain
    extra = with_mosaic[len(plain):]
    assert extra and {t.kernel for t in extra} == {MOSAIC_FORWARD_KERNEL, MOSAIC_BACKWARD_KERNEL}
    assert all(t.dtype == "bf16" and t.seqlen_q > 1 for t in extra)
    assert not any(t.has_attn_bias or t.has_dropout for t in extra)
    backward = {(t.headdim, t.seqlen_k) for t in extra if t.direction == "backward"}
    assert backward == {(64, 512), (256, 512)}  # not at D = 512, not at one tile of keys
    assert {t.headdim for t in extra if t.direction == "forward"} == {64, 256, 512}
    assert {(t.nheads_q, t.nheads_kv) for t in extra} == {(8, 8), (8, 2), (8, 1)}
    assert len({t.key for t in extra}) == len(extra)
    forward_only = _tasks(True, directions=("forward",))
    assert {t.direction for t in forward_only} == {"forward"}


def test_the_mosaic_runners_say_why_they_cannot_tune_here():
    task = Task(direction="forward", kernel=FWD, case_name="common", dtype="bf16", headdim=64,
                seqlen_q=512, seqlen_k=512, causal=False, batch=1, nheads_q=4, nheads_kv=4)
    if RUNNERS[FWD].missing() is None:
        pytest.skip("the Mosaic kernels run here (tests/test_autotune_gpu.py tunes them)")
    assert "needs an sm90 GPU" in RUNNERS[FWD].missing()
    assert "needs an sm90 GPU" in RUNNERS[BWD].unsupported(task.problem())
    refuses = RUNNERS[FWD].refuses
    assert refuses(task.problem()) is None
    q = sd((1, 512, 4, 64), jnp.bfloat16)
    ids = sd((1, 512), jnp.int32)
    segmented = Problem.of(q, q, q, features=FeatureArrays(ids, ids))
    assert "does not make q_segment_ids" in refuses(segmented)
    assert "bias" in refuses(Problem.of(q, q, q, bias=sd((1, 1, 512, 512), jnp.bfloat16)))


def _file(tmp_path, entries):
    header = {"device_name": DEVICE, "autotune_mode": "fast", "B": 1, "H": 32,
              "compute_capability": "9.0"}
    write_config_file(tmp_path / "NVIDIA_H100_80GB_HBM3.json", header, entries)


def _entry(kernel, direction, config, *, d=128, n=4096, causal=False, heads=(32, 32)):
    task = Task(direction=direction, kernel=kernel, case_name="common", dtype="bf16",
                headdim=d, seqlen_q=n, seqlen_k=n, causal=causal, batch=1,
                nheads_q=heads[0], nheads_kv=heads[1])
    return entries_for(task, config, tuned_ms=1.0, default_ms=1.1)[0]


def _choice(plan, kernel):
    return next(choice for choice in plan.kernels if choice.kernel == kernel)


def test_a_tuned_entry_reaches_the_plan_and_one_a_call_cannot_take_does_not(tmp_path,
                                                                          monkeypatch):
    monkeypatch.setattr(compat, "mosaic_gpu_runs", lambda: True)
    monkeypatch.setenv("FFPA_TUNED_CONFIG_DIR", str(tmp_path))
    monkeypatch.delenv("FFPA_SKIP_PERSIST_TUNED_CONFIG", raising=False)
    forward = dict(tuned.as_fields(FWD, default_config(128, 128)), block_kv=64, num_stages=3)
    backward = dict(tuned.as_fields(BWD, default_backward_config(128, 128)), num_stages=3)
    heads = dict(tuned.as_fields(FWD, default_config(128, 128, causal=True, gqa_group=4,
                                                     seq_q=4096)), block_kv=256)
    assert heads["cluster"] == 2 and heads["cluster_axis"] == "heads"
    _file(tmp_path, [_entry(FWD, "forward", forward), _entry(BWD, "backward", backward),
                     _entry(FWD, "forward", heads, causal=True, heads=(32, 8)),
                     _entry(FWD, "forward", {"block_kv": 3000})])  # malformed: skipped
    assert load_config_file(tmp_path / "NVIDIA_H100_80GB_HBM3.json").skipped == 1
    clear_cache()
    device = dispatch.Device(nvidia_gpu=True, name=DEVICE, compute_capability="9.0")
    try:
        q = sd((1, 4096, 32, 128), jnp.bfloat16)
        plan = dispatch.explain(Problem.of(q, q, q), device=device).plan
        fwd, bwd = _choice(plan, FWD), _choice(plan, BWD)
        assert (fwd.config.block_kv, fwd.config.num_stages) == (64, 3)
        assert bwd.config.num_stages == 3 and bwd.config.block_q == 64
        assert fwd.why.startswith("tuned entry") and bwd.why.startswith("tuned entry")
        # An entry with clusters of 2 query heads, looked up by a GQA group of 3 (the
        # nearest heads): the call keeps its default and says why.
        q3 = sd((1, 4096, 24, 128), jnp.bfloat16)
        kv3 = sd((1, 4096, 8, 128), jnp.bfloat16)
        choice = _choice(dispatch.explain(Problem.of(q3, kv3, kv3, causal=True),
                                          device=device).plan, FWD)
        assert choice.config == default_config(128, 128, causal=True, gqa_group=3)
        assert "not used: its clusters of 2 query heads" in choice.why
        # With segment ids the kernels keep their default (their tiles take shared memory).
        ids = sd((1, 4096), jnp.int32)
        segmented = Problem.of(q, q, q, features=FeatureArrays(ids, ids))
        choice = _choice(dispatch.explain(segmented, device=device).plan, FWD)
        assert choice.config == default_config(128, 128, segments=True)
        assert "not with segment ids" in choice.why
    finally:
        clear_cache()
