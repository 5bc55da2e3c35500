"""The autotuner's search spaces and its candidate filter (tuning.autotune.measure).

The filter runs the real kernels in Pallas' interpreter on tiny shapes, with
candidates that fail to compile or compute the wrong thing injected among
good ones: those must be discarded, never chosen, never written.
"""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp
import pytest

from tuning.autotune import measure as am
from tuning.autotune import runners
from tuning.autotune import search_space
from tuning.autotune.sched import ResultStore
from tuning.autotune.tasks import Task
from tuning.defaults import default_config
from tuning.lookup import clear_cache, lookup_config
from pallas_kernels.problem import Problem
from tuning.registry import config_problem


def spec_of(**fields) -> Problem:
    """A bf16 problem with the autotuner's scale (1/sqrt(D))."""
    return Problem(dtype="bfloat16", scale=fields["head_dim"] ** -0.5, **fields)
from tuning.schema import load_config_file

TUNED_KERNELS = ("fwd_generic", "bwd_preproc", "bwd_generic_dq", "bwd_generic_dkdv", "bwd_dbias")
GRID_DIMS = (64, 128, 256, 320, 512, 640, 768, 1024)
QUICK = am.Settings(prune=1e9, min_sample_s=0.0, reps_short=1, reps_long=1,
                    task_budget_s=1e9, compile_workers=2, warmup_s=0.0)


# ---------------------------------------------------------------- search spaces


@pytest.mark.parametrize("kernel", TUNED_KERNELS)
def test_search_space_sizes_validity_and_default_first(kernel):
    for d in GRID_DIMS:
        fast = search_space.candidates(kernel, headdim=d, mode="fast")
        full = search_space.candidates(kernel, headdim=d, mode="max")
        assert 1 <= len(fast) <= search_space.FAST_LIMIT
        assert len(full) >= search_space.MAX_MIN, (kernel, d, len(full))
        assert fast == full[:len(fast)]  # max extends fast
        # The default is always measured (head-dim tiles clamped to the head dim,
        # as the kernels fit them anyway).
        widest = max(16, 1 << (d - 1).bit_length())
        default = {k: min(v, widest) if k.startswith("BLOCK_HEADDIM") else v
                   for k, v in default_config(kernel, headdim=d).items()}
        assert fast[0] == default
        for cfg in full:
            assert config_problem(kernel, cfg) is None, cfg
        assert len({tuple(sorted(c.items())) for c in full}) == len(full)
    if kernel != "bwd_preproc":  # fast mode explores: several candidates
        assert len(search_space.candidates(kernel, headdim=512, mode="fast")) == 8


def test_every_descriptor_is_registered_defaulted_searched_and_run():
    """The tuned-file registry, the defaults, the search space and the autotune runners all
    come from pallas_kernels.KERNEL_DESCRIPTORS: one list names every tuned kernel."""
    from pallas_kernels import KERNEL_DESCRIPTORS
    from tuning import KERNELS

    names = [d.name for d in KERNEL_DESCRIPTORS]
    assert names == ["fwd_generic", "decode_fwd_stage1", "decode_fwd_stage2", "bwd_preproc",
                     "bwd_generic_dkdv", "bwd_generic_dq", "bwd_dbias"]
    # FFPA's fused-backward kernels are valid file entries that we never run; the Mosaic
    # tier's two kernels are ours, without descriptors (their configs check themselves).
    mosaic = ["mosaic_fwd", "mosaic_bwd"]
    assert list(KERNELS) == names + ["bwd_generic", "decode_bwd_stage1"] + mosaic
    assert set(runners.RUNNERS) == set(names + mosaic)
    assert [KERNELS[k].direction for k in mosaic] == ["forward", "backward"]
    for d in KERNEL_DESCRIPTORS:
        assert KERNELS[d.name].block_keys == d.block_keys
        assert runners.RUNNERS[d.name].kernel_fn is d.function
        for dim in (64, 512):
            assert config_problem(d.name, default_config(d.name, headdim=dim)) is None
    with pytest.raises(KeyError):
        default_config("bwd_generic", headdim=64)  # registered, but no built-in config
    with pytest.raises(KeyError):
        default_config("mosaic_fwd", headdim=64)  # its defaults live in its tier


def test_unknown_mode_or_kernel():
    with pytest.raises(ValueError, match="mode"):
        search_space.candidates("fwd_generic", headdim=64, mode="slow")
    with pytest.raises(KeyError):
        search_space.candidates("no_such_kernel", headdim=64)


def test_unsupported_kernels_and_dropout_are_reported():
    spec = spec_of(batch=1, seq_q=1, seq_k=512, heads_q=2, heads_kv=2, head_dim=64,
                   head_dim_v=64)
    assert runners.unsupported("fwd_generic", spec) is None
    assert "no autotune runner" in runners.unsupported("no_such_kernel", spec)
    assert "needs a bias" in runners.unsupported("bwd_dbias", spec)
    missing = dataclasses.replace(runners.RUNNERS["fwd_generic"], kernel_fn=None)
    assert "pallas_kernels has no fwd_generic yet" in missing.unsupported(spec)

    no_dropout = dataclasses.replace(runners.RUNNERS["fwd_generic"], dropout=False)
    dropout_spec = dataclasses.replace(spec, dropout_rate=0.1)
    assert no_dropout.unsupported(spec) is None
    assert "does not apply dropout" in no_dropout.unsupported(dropout_spec)
    caps = am.capabilities()
    assert set(caps) >= set(TUNED_KERNELS) and caps["fwd_generic"]["missing"] is None


# ---------------------------------------------------------------- candidate filter


def perturbing_runner(kernel: str, *, bad_everywhere_warps: int, bad_row_warps: int,
                      row: int) -> am.KernelRunner:
    """RUNNERS[kernel] whose launches under two marked configs return wrong outputs:
    every value off (warps = bad_everywhere_warps), or one query row off, a row the
    sampled reference does not look at (warps = bad_row_warps)."""
    base = runners.RUNNERS[kernel]

    def launcher(cfg, spec, interpret):
        launch = base.launcher(cfg, spec, interpret)
        if cfg["num_warps"] == bad_everywhere_warps:
            def wrong(*args):
                out = launch(*args)
                first = out[0] if isinstance(out, tuple) else out
                bad = first * 1.5 + 0.25
                return (bad, *out[1:]) if isinstance(out, tuple) else bad
            return wrong
        if cfg["num_warps"] == bad_row_warps:
            def wrong_row(*args):
                out = launch(*args)
                first = out[0] if isinstance(out, tuple) else out
                bad = first.at[:, row].add(jnp.asarray(3.0, first.dtype))
                return (bad, *out[1:]) if isinstance(out, tuple) else bad
            return wrong_row
        return launch

    return dataclasses.replace(base, launcher=launcher)


def fwd_cfg(warps: int, **kw) -> dict:
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_HEADDIM_QK=16, BLOCK_HEADDIM_V=16,
               num_warps=warps, num_stages=2, num_ctas=1)
    cfg.update(kw)
    return cfg


def test_forward_filter_discards_compile_failures_and_wrong_results(tmp_path):
    spec = spec_of(batch=1, seq_q=40, seq_k=48, heads_q=2, heads_kv=1, head_dim=16,
                          head_dim_v=16, causal=True, bias_shape=(1, 1, 1, 48))
    unsampled = 5
    assert unsampled not in runners._sample_indices(spec.seq_q)
    runner = perturbing_runner("fwd_generic", bad_everywhere_warps=2, bad_row_warps=8,
                               row=unsampled)
    candidates = [fwd_cfg(2),                          # wrong everywhere: the reference
                  fwd_cfg(4),                          # good: becomes the baseline
                  fwd_cfg(4, Q_MODE="sideways"),       # cannot be built: compile failure
                  fwd_cfg(8)]                          # wrong in one unsampled row: baseline
    result = am.tune("fwd_generic", spec, candidates=candidates, interpret=True,
                     settings=QUICK, runner=runner)
    statuses = [(r.config["num_warps"], r.config.get("Q_MODE"), r.status) for r in result.records]
    assert statuses == [(2, None, "wrong result"), (4, None, "ok"),
                        (4, "sideways", "compile failed"), (8, None, "wrong result")]
    assert "float32 reference" in result.records[0].detail
    assert "q_mode must be one of" in result.records[2].detail
    assert "baseline" in result.records[3].detail
    assert result.best == fwd_cfg(4) and result.best_ms is not None

    # What a task writes from this result parses and is what lookups return.
    task = Task(direction="forward", kernel="fwd_generic", case_name="attn-mask", dtype="bf16",
                headdim=16, seqlen_q=40, seqlen_k=48, causal=True, batch=1, nheads_q=2,
                nheads_kv=1, has_attn_bias=True)
    header = {"device_name": "Interp GPU", "compute_capability": "0.0",
              "autotune_mode": "fast", "B": 1, "H": 2}
    store = ResultStore.open(tmp_path / "Interp_GPU.json", header, resume=False)
    store.add_result(task, {"config": result.best, "tuned_ms": result.best_ms})
    loaded = load_config_file(tmp_path / "Interp_GPU.json")
    assert loaded is not None and loaded.skipped == 0 and len(loaded.entries) == 1
    os.environ["FFPA_TUNED_CONFIG_DIR"] = str(tmp_path)
    clear_cache()
    try:
        assert lookup_config("forward", "fwd_generic", dtype="bf16", headdim=16, seqlen_q=33,
                             seqlen_k=40, causal=True, has_attn_bias=True,
                             device_name="Interp GPU") == fwd_cfg(4)
        assert lookup_config("forward", "fwd_generic", dtype="bf16", headdim=16, seqlen_q=33,
                             seqlen_k=40, causal=False, has_attn_bias=True,
                             device_name="Interp GPU") is None
    finally:
        del os.environ["FFPA_TUNED_CONFIG_DIR"]
        clear_cache()


def test_backward_filter_discards_wrong_dkdv_and_nothing_passing_gives_none():
    spec = spec_of(batch=1, seq_q=32, seq_k=40, heads_q=2, heads_kv=2, head_dim=16,
                          head_dim_v=16)
    runner = perturbing_runner("bwd_generic_dkdv", bad_everywhere_warps=2, bad_row_warps=-1,
                               row=0)
    good = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_HEADDIM=16, BLOCK_HEADDIM_QK=16, num_warps=4,
                num_stages=2, num_ctas=1)
    inputs = am.Inputs(spec, interpret=True)
    result = am.tune("bwd_generic_dkdv", spec, candidates=[dict(good, num_warps=2), good],
                     interpret=True, settings=QUICK, runner=runner, inputs=inputs)
    assert [r.status for r in result.records] == ["wrong result", "ok"]
    assert result.best == good
    # Every candidate wrong: no winner at all (the task then writes no entry).
    nothing = am.tune("bwd_generic_dkdv", spec, candidates=[dict(good, num_warps=2)],
                      interpret=True, settings=QUICK, runner=runner, inputs=inputs)
    assert nothing.best is None and nothing.records[0].status == "wrong result"


def test_decode_runners_check_both_stages_against_the_reference():
    spec = spec_of(batch=1, seq_q=1, seq_k=64, heads_q=2, heads_kv=1, head_dim=16,
                          head_dim_v=16, causal=True)
    if runners.unsupported("decode_fwd_stage1", spec):
        pytest.skip(runners.unsupported("decode_fwd_stage1", spec))
    inputs = am.Inputs(spec, interpret=True)
    runner = perturbing_runner("decode_fwd_stage1", bad_everywhere_warps=8, bad_row_warps=-1,
                               row=0)
    stage1 = search_space.candidates("decode_fwd_stage1", headdim=16)[0]
    result = am.tune("decode_fwd_stage1", spec, interpret=True, settings=QUICK, runner=runner,
                     candidates=[dict(stage1, num_warps=8), dict(stage1, NUM_SPLITS=2)],
                     inputs=inputs)
    assert [r.status for r in result.records] == ["wrong result", "ok"]
    assert result.best == dict(stage1, NUM_SPLITS=2)
    stage2 = am.tune("decode_fwd_stage2", spec, interpret=True, settings=QUICK, inputs=inputs,
                     candidates=search_space.candidates("decode_fwd_stage2", headdim=16)[:1])
    assert [r.status for r in stage2.records] == ["ok"] and stage2.records[0].error < 2e-2


def test_a_tier_run_over_some_head_dims_keeps_the_grid_of_the_others():
    """Re-measuring the tiers at D = 256 and 512 in a file measured at 256-1024 keeps D = 1024
    (its entries stay) in the grid the file names; a grid of another B or H is replaced."""
    from tuning.autotune.tiers import merged_grid
    old = {"headdims": [256, 512, 1024], "seqlens": [1024, 4096, 16384], "causal": "true",
           "dtypes": ["bf16"], "B": 1, "H": 32}
    new = {"headdims": [512, 256], "seqlens": [1024, 4096, 16384], "causal": "both",
           "dtypes": ["bf16"], "B": 1, "H": 32}
    assert merged_grid(old, new) == {**old, "causal": "both"}
    assert merged_grid({**old, "causal": "both"}, {**new, "causal": "true"})["causal"] == "both"
    assert merged_grid({**old, "causal": "both"}, {**new, "causal": "both"})["causal"] == "both"
    assert merged_grid({**old, "H": 16}, new) == new
    assert merged_grid(None, new) == new


def test_the_tier_tool_names_a_differentiated_forward_where_the_pair_measured_faster():
    """Where the directions' winners differ, the tool times both pairs in one program; the
    forward entry names the backward's tier for a differentiated call only where its own
    pair ran faster, and a re-measured entry keeps no stale choice (nor its note)."""
    import jax.numpy as jnp

    from tuning.autotune.tiers import differentiated_tier, pairs_to_time, record, record_pairs
    from tuning.autotune.tiers import problem_of

    times = {"forward": {"mosaic": 0.18, "chunked": 0.24, "pallas": 0.29},
             "backward": {"mosaic": None, "chunked": 0.50, "pallas": 1.10}}
    assert pairs_to_time(times) == (("mosaic", "chunked"), ("chunked", "chunked"))
    assert differentiated_tier(times, {"mosaic/chunked": 0.71, "chunked/chunked": 0.64}) == (
        "chunked")
    assert differentiated_tier(times, {"mosaic/chunked": 0.60, "chunked/chunked": 0.64}) is None
    assert differentiated_tier(times, {"mosaic/chunked": 0.71, "chunked/chunked": None}) is None
    same = {"forward": {"chunked": 1.0, "pallas": 2.0}, "backward": {"chunked": 1.0}}
    assert pairs_to_time(same) == () and differentiated_tier(same, {}) is None

    problem = problem_of(dtype="bf16", headdim=512, seqlen=1024, causal=False, batch=1,
                         heads=32)
    assert problem.dtype == jnp.bfloat16
    entries: list[dict] = []
    for direction in ("forward", "backward"):
        record(entries, problem, direction, times[direction])
    record_pairs(entries, problem, times, {"mosaic/chunked": 0.71, "chunked/chunked": 0.64})
    forward = [e for e in entries if e["direction"] == "forward"]
    assert len(forward) == 1 and forward[0]["tier"] == "mosaic"
    assert forward[0]["tier_differentiated"] == "chunked"
    assert forward[0]["tier_pair_ms"] == {"mosaic/chunked": 0.71, "chunked/chunked": 0.64}
    assert all("tier_differentiated" not in e for e in entries if e["direction"] == "backward")
    forward[0]["tier_differentiated_measured"] = "a hand-set note"
    record_pairs(entries, problem, same, {})
    assert not [f for f in forward[0] if f.startswith("tier_differentiated")]
    assert "tier_pair_ms" not in forward[0]


def test_a_pair_of_tiers_is_timed_in_one_program():
    """`measure_pair` compiles and times a forward and a backward together (here the chunked
    tier's, which runs without a GPU); a pair that cannot run times as None."""
    from tuning.autotune.tiers import measure_pair, problem_of

    problem = problem_of(dtype="fp32", headdim=40, seqlen=113, causal=True, batch=1, heads=2)
    ms = measure_pair(problem, "chunked", "chunked", min_rep_s=0.0, reps=1)
    assert ms is not None and ms > 0
    assert measure_pair(problem, "mosaic", "chunked", min_rep_s=0.0, reps=1) is None
