"""Context parallelism (issue 32): attention over a sequence split across devices.

CPU: one subprocess with 8 fake CPU devices (XLA_FLAGS must be set before JAX starts) runs
every case of `CASES` once (tests/context_parallel_checks.py); each test reads its case's
report. Each case compares out, lse and the gradients (of q, k, v, and of the sinks and a
broadcast bias where given) with the unsharded call of the same tier: float32 within 1e-5
of the values' scale; bfloat16 by the tolerance rule against the float64 reference (given
the case's features and dropout's keep mask as the call is). The
cases cover both layouts, both strategies, causal or not, GQA, segments, windows, lengths,
sinks, the soft cap, dropout (a mask per batch row and head, or one shared by all), 4 and 8
devices, shard_map with and without check_vma, and jit on sequence-sharded inputs (Auto and
Explicit mesh axes), whose compiled HLO must not all-gather q. Every tier runs them where it
places blocks of a sequence (`Problem.positions`); a tier that does not yet is skipped,
saying so.

In-process: the layouts, the block relation against a brute-force one, the strategy rule,
the argument checks, a one-device shard_map, and that a tier's positions guard is current.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from context_parallel_checks import (JIT_AUTO, JIT_EXPLICIT, CPCase, gathers_q,
                                     positioned_block_matches_dense, tier_lacks_positions)
from fake_devices import worker_report
from ffpa_jax import context_local
from ffpa_jax.layout import Pieces, zigzag_order
from pallas_kernels import visibility
from pallas_kernels.problem import Problem

# One worker runs the module: its tests share one subprocess report (conftest.py).
pytestmark = pytest.mark.shared_report

FEATURES = ("window", "segments", "lengths", "sinks", "softcap", "bias")
# Ring blocks start at multiples of 128 keys under dropout: 4 shards of 128.
DROP = dict(t=512, hq=2, hkv=1, d=8, features=("dropout",))


def _tier_cases(tier: str, interpret: bool) -> list[CPCase]:
    """A tier's cases. Pallas' interpreter trips `check_vma` by itself
    (tests/test_sharding.py), the compiled tiers run under it. The fused kernels skip by a
    block's runtime shift: their zigzag blocks that are hidden, fully or partly visible by
    shard and step run as one kernel (no switch), and so does the halo's."""
    kw = dict(tier=tier, interpret=interpret, check_vma=not interpret)
    small = [CPCase(f"{tier}/zigzag-halo-window", layout="zigzag", strategy="halo", t=512,
                    hq=2, hkv=1, d=8, features=("window",), **kw)] if interpret else [
        # A shard's rows and keys in several blocks: the tier's loops carry accumulators
        # that must vary over the context axis as the shard's data does (check_vma).
        # ... and the backward's keys in two rounds
        CPCase(f"{tier}/zigzag-ring-causal-small-blocks-2-rounds", layout="zigzag", t=512,
               hq=2, hkv=1, d=8, chunk_budget_mib=0.002, ring_rounds=2, **kw)]
    return [*small, CPCase(f"{tier}/zigzag-ring-causal", layout="zigzag", **kw),
            CPCase(f"{tier}/contiguous-allgather-features", strategy="all_gather",
                   features=FEATURES, **kw),
            CPCase(f"{tier}/jit-auto-default", strategy=None, mode=JIT_AUTO, **kw)]


CASES = [
    CPCase("contiguous-ring-causal"),
    CPCase("contiguous-allgather-causal", strategy="all_gather"),
    CPCase("zigzag-ring-causal", layout="zigzag"),
    CPCase("zigzag-ring-full", layout="zigzag", causal=False),
    CPCase("zigzag-allgather-causal", layout="zigzag", strategy="all_gather"),
    # ... the backward's keys in four rounds (context_ring.rounds)
    CPCase("zigzag-ring-features-novma-4-rounds", layout="zigzag", features=FEATURES,
           check_vma=False, b=2, ring_rounds=4),
    CPCase("zigzag-allgather-features", layout="zigzag", strategy="all_gather",
           features=FEATURES, b=2),
    CPCase("contiguous-ring-window-both-mask", causal=False, b=2,
           features=("window_both", "segments", "mask")),
    # two rounds of 128 keys (the dropout tiles)
    CPCase("contiguous-ring-dropout-2-rounds", **dict(DROP, t=1024), ring_rounds=2),
    CPCase("zigzag-allgather-dropout", layout="zigzag", strategy="all_gather",
           features=("dropout",)),
    # bf16 by the tolerance rule, the features and dropout's keep mask given to the float64
    # reference as to the call (no segments here: rows of a few packed tokens leave the
    # window nothing to hide)
    CPCase("bf16-zigzag-allgather-dropout", layout="zigzag", strategy="all_gather",
           dtype="bfloat16", features=("dropout",)),
    CPCase("bf16-zigzag-ring-features", layout="zigzag", b=2, dtype="bfloat16",
           features=("window", "lengths", "sinks", "softcap", "bias")),
    CPCase("jit-auto-ring", mode=JIT_AUTO),
    CPCase("jit-auto-allgather", strategy="all_gather", mode=JIT_AUTO),
    CPCase("jit-explicit-rule", strategy=None, mode=JIT_EXPLICIT),
    # Control: the dense tier under jit without context_strategy is XLA's to partition, and
    # its backward gathers q (dK needs every row): the HLO check can fail.
    CPCase("control-jit-auto-xla", strategy=None, mode=JIT_AUTO),
    CPCase("8dev-zigzag-ring-causal", devices=8, layout="zigzag"),
    CPCase("data2x4-zigzag-ring-sinks", devices=8, data=2, b=2, layout="zigzag",
           features=("sinks", "bias", "window")),
    CPCase("jit-auto-data2x2-allgather", data=2, b=2, strategy="all_gather", mode=JIT_AUTO,
           features=("sinks", "dropout")),
    # One dropout mask for every batch row and head, the batch split over "data" too (inside
    # the user's shard_map, where a shard's batch offset is not known: none is needed).
    CPCase("data2x2-allgather-shared-dropout", data=2, b=2, strategy="all_gather",
           features=("shared_dropout",)),
    # The halo: a shard fetches the keys its queries see (a window) from their owners. At
    # 2048 tokens a shard's fetched ranges start inside other shards' pieces (on tiles of
    # 128 keys); at 64 they are whole pieces. A window on both sides fetches from both
    # neighbours.
    CPCase("contiguous-halo-window", strategy="halo", t=2048, hq=2, hkv=1, d=8,
           features=("window",)),
    CPCase("zigzag-halo-window-both-segments", layout="zigzag", strategy="halo", causal=False,
           t=2048, hq=2, hkv=1, d=8, b=2, features=("window_both", "segments")),
    CPCase("zigzag-halo-features", layout="zigzag", strategy="halo", b=2, features=FEATURES),
    CPCase("contiguous-halo-dropout", strategy="halo",
           **dict(DROP, t=2048, features=("dropout", "window"))),
    CPCase("bf16-zigzag-halo-window", layout="zigzag", strategy="halo", t=2048, hq=2, hkv=1,
           d=8, dtype="bfloat16", features=("window", "sinks")),
    CPCase("8dev-zigzag-halo-window", devices=8, layout="zigzag", strategy="halo", t=2048,
           hq=2, hkv=1, d=8, features=("window",)),
    # The rule picks the halo (a narrow window) inside a shard_map and under jit.
    CPCase("zigzag-rule-window", layout="zigzag", strategy=None, t=2048, hq=2, hkv=1, d=8,
           features=("window",)),
    CPCase("jit-auto-halo", strategy="halo", mode=JIT_AUTO, t=2048, hq=2, hkv=1, d=8,
           features=("window",)),
    *_tier_cases("pallas", interpret=True),
    *_tier_cases("chunked", interpret=False),
]
# On a stand-in for a tier with a backward of its own (`standin_tier`): the ring's block
# backward through `tiers.backward` with the merged out and lse, and a planned call's own
# sequence split under jit (Auto and Explicit axes, batch split too).
STANDIN = "chunked"
STANDIN_CASES = [
    CPCase("standin/zigzag-ring-features", layout="zigzag", tier=STANDIN,
           features=FEATURES, b=2),
    CPCase("standin/jit-auto-default", strategy=None, mode=JIT_AUTO, tier=STANDIN,
           features=FEATURES),
    CPCase("standin/jit-explicit-default-dropout", strategy=None, mode=JIT_EXPLICIT,
           tier=STANDIN, **DROP),
    CPCase("standin/jit-auto-data2x2", strategy=None, mode=JIT_AUTO, tier=STANDIN, data=2,
           b=2, features=("sinks", "bias")),
    CPCase("standin/jit-auto-data2x2-shared-dropout", strategy=None, mode=JIT_AUTO,
           tier=STANDIN, data=2, b=2, features=("shared_dropout",)),
]
BY_NAME = {case.name: case for case in CASES + STANDIN_CASES}
# With `-m slow` (a subprocess of their own): cases whose every dimension a default case
# takes. The Pallas interpreter's all-gather with features and its jit split (its ring
# stays); the stand-in's jit splits with dropout or a data axis (its ring with features
# and its plain jit split stay); the data axis with the all-gather (it stays with the
# ring); the float32 zigzag all-gather with dropout (bf16 takes it, and the ring in rounds);
# the halo in bf16 and on 8 devices (its float32 cases and the ring's bf16 and 8-device
# cases stay); the plain causal all-gathers of both layouts and the zigzag one with features
# (their cases with features, dropout and under jit stay); the ring under jit with Auto axes
# (the all-gather's and Explicit axes' stay); the contiguous halo with a window alone (its
# case with dropout stays).
SLOW = {"pallas/contiguous-allgather-features", "pallas/jit-auto-default",
        "standin/jit-explicit-default-dropout", "standin/jit-auto-data2x2",
        "standin/jit-auto-data2x2-shared-dropout", "jit-auto-data2x2-allgather",
        "data2x2-allgather-shared-dropout", "zigzag-allgather-dropout",
        "bf16-zigzag-halo-window", "8dev-zigzag-halo-window",
        "contiguous-allgather-causal", "zigzag-allgather-causal", "jit-auto-ring",
        "zigzag-allgather-features", "contiguous-halo-window"}
assert SLOW <= set(BY_NAME), SLOW - set(BY_NAME)


# ---------------------------------------------------------------- the subprocess


def _worker(slow: bool) -> None:
    from context_parallel_checks import run_case, standin_tier
    jnp.zeros(())  # start the backend with the XLA_FLAGS the parent set
    def chosen(cases):
        return [case for case in cases if (case.name in SLOW) == slow]
    references: dict = {}
    report = {case.name: run_case(case, references) for case in chosen(CASES)}
    with standin_tier(STANDIN):
        report.update({case.name: run_case(case, {}) for case in chosen(STANDIN_CASES)})
    if slow:
        from context_parallel_checks import mosaic_lowering_report
        report[MOSAIC_LOWERING] = mosaic_lowering_report()
    else:
        from context_parallel_checks import (permuted_keys_report, ring_rounds_memory_report,
                                             switches_report)
        report[ROUNDS_MEMORY] = ring_rounds_memory_report()
        report[PERMUTED_KEYS] = permuted_keys_report()
        report[SWITCHES] = switches_report()
    print(json.dumps(report))


@pytest.fixture(scope="module")
def cpu_report() -> dict:
    return worker_report(__file__, devices=8, timeout=900)


@pytest.fixture(scope="module")
def cpu_report_slow() -> dict:
    return worker_report(__file__, devices=8, timeout=900, args=("--slow",))


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in SLOW
                                  else name for name in BY_NAME])
def test_matches_unsharded_call(request, name):
    report = request.getfixturevalue("cpu_report_slow" if name in SLOW else "cpu_report")
    case, entry = BY_NAME[name], report[name]
    if "skip" in entry:
        pytest.skip(entry["skip"])
    assert "error" not in entry, f"{name}: {entry['error']}\n{entry.get('trace', '')}"
    if case.ring_rounds:
        assert entry["rounds"] == [case.ring_rounds], f"{name}: {entry}"
    if case.dtype == "float32":
        assert entry["rel"] <= 1e-5, f"{name}: {entry}"
    else:
        assert entry["rule"] is None, f"{name}: {entry['rule']}"
    if case.mode in (JIT_AUTO, JIT_EXPLICIT):
        # q stays split: no all-gather produces an array of q's (global) size, and out
        # keeps q's sharding.
        if name.startswith("control"):
            assert gathers_q(entry), f"{name}: the check cannot see a gathered q: {entry}"
        else:
            assert not gathers_q(entry), f"{name}: {entry}"
        batch = "'data'" if case.data > 1 else "None"
        assert entry["out_spec"].startswith(f"({batch}, 'cp'"), f"{name}: {entry}"


MOSAIC_LOWERING = "mosaic-lowering"


@pytest.mark.slow
def test_blocks_on_the_mosaic_tier_lower_for_cuda(cpu_report_slow):
    """A context-parallel call whose blocks run on the Mosaic tier (a simulated H100, the
    kernels taking the blocks' positions) lowers for CUDA, forward and backward, in a
    shard_map's ring and all-gather (the traces that raised on the GPUs until the
    backward's outputs were declared varying)."""
    report = cpu_report_slow[MOSAIC_LOWERING]
    for name, entry in report.items():
        assert isinstance(entry, dict) and entry["kernels"] > 0, f"{name}: {entry}"
        # The Mosaic kernels skip by a block's runtime shift: no block needs a switch.
        assert entry["switches"] == 0, f"{name}: {entry}"
    assert set(report) == {"ring_zigzag", "all_gather", "halo_zigzag"}


ROUNDS_MEMORY = "ring-rounds-memory"


def test_the_ring_backward_in_rounds_holds_less(cpu_report):
    """The rounds hold one round's float32 dK, dV (about three times: received, sent on,
    this step's) instead of the whole shard's: four rounds save about 2.25 times the
    accumulators' size in XLA's plan, and at least once that size. (Each round's slices and
    zero accumulators once were made up front and held together, and four rounds saved an
    eighth of it.)"""
    report = cpu_report[ROUNDS_MEMORY]
    saved = report["1"] - report["4"]
    assert saved >= report["accumulators"], report


PERMUTED_KEYS = "permuted-keys"


def test_the_halo_passes_only_the_windows_keys(cpu_report):
    """Under a causal window of 100 keys, contiguous shards of 1024: the halo passes one
    tile of 128 keys per array (K, V forward; K, V again and their dK, dV backward), the
    ring whole shards, each around the axis."""
    report = cpu_report[PERMUTED_KEYS]
    assert report["halo"] == [128] * 6, report
    assert report["ring"] and set(report["ring"]) == {1024}, report


SWITCHES = "switches"


def test_blocks_of_kernels_that_skip_by_their_shift_need_no_switch(cpu_report):
    """A block whose relation differs between shards or steps runs, on the fused kernels,
    as one partly visible block placed at run time (its kernels skip the hidden tiles), not
    under a `lax.switch`, whose index XLA's GPU runtime reads back to the host and waits
    for. On the dense tier, which computes whatever it is given, the switch stays: causal
    zigzag, the ring's 2 x 2 blocks, the halo's of a window."""
    report = cpu_report[SWITCHES]
    assert report["pallas/ring"] == 0 and report["pallas/halo"] == 0, report
    assert report["xla/ring"] > 0 and report["xla/halo"] > 0, report


# ---------------------------------------------------------------- in-process


@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_zigzag_round_trip_and_pieces(parts):
    x = jnp.arange(2 * 4 * parts * 3).reshape(2, 4 * parts, 3)
    z = ffpa_jax.zigzag(x, parts, axis=1)
    np.testing.assert_array_equal(ffpa_jax.unzigzag(z, parts, axis=1), x)
    pieces = Pieces("zigzag", parts, 4)
    for shard in range(parts):
        local = z[:, 4 * shard:4 * (shard + 1)]
        for piece in range(2):
            start = pieces.start(shard, piece)
            np.testing.assert_array_equal(pieces.local_slice(local, piece, 1),
                                          x[:, start:start + 2])
    assert sorted(zigzag_order(parts)) == list(range(2 * parts))


def test_zigzag_rejects_uneven_lengths():
    with pytest.raises(ValueError, match="equal chunks"):
        ffpa_jax.zigzag(jnp.zeros((1, 6)), 2)


@pytest.mark.parametrize("causal,window", [(True, None), (False, (3, 5)), (True, (4, 0)),
                                           (True, (2, 9)), (False, (0, 0))])
def test_block_relation_matches_brute_force(causal, window):
    """Blocks of 4 rows and 5 keys, row i's diagonal at key i + 3: the relation with Python
    ints and traced (one vmapped program) equals the one of the element masks."""
    shift = 3
    starts = [(r0, c0) for r0 in range(0, 24, 4) for c0 in range(0, 30, 5)]
    relation = lambda r0, c0: visibility.block_relation(r0, 4, c0, 5, shift=shift,
                                                        causal=causal, window=window)
    r0s, c0s = (jnp.asarray(x) for x in zip(*starts))
    traced = np.asarray(jax.jit(jax.vmap(relation))(r0s, c0s)) if (causal or window) else None
    for i, (r0, c0) in enumerate(starts):
        rows, cols = np.arange(r0, r0 + 4)[:, None] + shift, np.arange(c0, c0 + 5)[None, :]
        seen = np.ones((4, 5), bool)
        if causal:
            seen &= cols <= rows
        if window is not None:
            seen &= (cols >= rows - window[0]) & (cols <= rows + window[1])
        want = (visibility.BLOCK_FULL if seen.all() else
                visibility.BLOCK_HIDDEN if not seen.any() else visibility.BLOCK_PARTIAL)
        assert relation(r0, c0) == want, (r0, c0)
        if traced is not None:
            assert traced[i] == want, (r0, c0)


def _problem(**kw) -> Problem:
    base = dict(batch=1, seq_q=4096, seq_k=4096, heads_q=8, heads_kv=8, head_dim=64,
                head_dim_v=64, dtype=jnp.bfloat16, scale=0.125)
    return Problem(**{**base, **kw})


def test_strategy_rule():
    choose = context_local.choose_strategy
    assert choose(_problem(), 4, "contiguous") == "ring"
    assert choose(_problem(heads_kv=2), 4, "contiguous") == "all_gather"  # few KV heads
    assert choose(_problem(heads_kv=2, seq_q=2**24, seq_k=2**24), 4, "zigzag") == "ring"
    assert choose(_problem(heads_kv=2), 4, "zigzag", "ring") == "ring"  # forced
    # dropout: ring blocks must start at multiples of 128 keys, else the all-gather
    odd = _problem(seq_q=4 * 200, seq_k=4 * 200, dropout_rate=0.1)
    assert choose(odd, 4, "contiguous") == "all_gather"
    with pytest.raises(ValueError, match="multiple of 128"):
        choose(odd, 4, "contiguous", "ring")
    # Few KV heads under causality or a window wider than a shard: the all-gather only where
    # its blocks' tiers skip what those hide by a runtime shift (else the ring); without
    # them, either way.
    for hidden in (dict(causal=True), dict(window=(2048, 0))):
        assert choose(_problem(heads_kv=2, **hidden), 4, "zigzag", gather_skips=False) == "ring"
        assert choose(_problem(heads_kv=2, **hidden), 4, "zigzag",
                      gather_skips=lambda: True) == "all_gather"
    assert choose(_problem(heads_kv=2), 4, "zigzag", gather_skips=False) == "all_gather"
    # A window that shows a shard at most one shard's keys of the others: the halo, first,
    # whatever the KV heads; a wider one: as without it.
    for layout in ("contiguous", "zigzag"):
        for heads_kv in (8, 2):
            narrow = _problem(heads_kv=heads_kv, causal=True, window=(500, 0))
            assert choose(narrow, 4, layout, gather_skips=False) == "halo"
    assert choose(_problem(causal=True, window=(3000, 0)), 4, "contiguous") == "ring"
    # a shard of 1024 keys: a window of 1024 keys left sees all of the shard before, one
    # more key a tile of the one before that
    assert choose(_problem(causal=True, window=(1024, 0)), 4, "contiguous") == "halo"
    assert choose(_problem(causal=True, window=(1025, 0)), 4, "contiguous") == "ring"
    # ... and it keeps dropout's tiles as the ring does
    with pytest.raises(ValueError, match="context_strategy='halo' with dropout"):
        choose(odd, 4, "contiguous", "halo")


@pytest.mark.parametrize("layout,parts,local,causal,window", [
    ("contiguous", 4, 512, True, (200, 0)), ("contiguous", 4, 512, False, (130, 300)),
    ("zigzag", 4, 1024, True, (300, 0)), ("zigzag", 3, 1024, False, (700, 40)),
    ("contiguous", 2, 384, True, (383, 0)), ("zigzag", 8, 256, True, (100, 0))])
def test_the_halo_fetches_the_tiles_of_the_keys_a_shard_sees(layout, parts, local, causal,
                                                             window):
    """Each fetch is the smallest range in whole tiles of 128 keys (or to a piece's end)
    that holds every key of that piece of shard i - step which some query of shard i sees,
    by the element rule; steps and pieces with none are not fetched."""
    from ffpa_jax import context_halo
    from ffpa_jax.context_blocks import ContextCall
    n = parts * local
    call = ContextCall(problem=_problem(seq_q=n, seq_k=n, causal=causal, window=window),
                       axis=None, parts=parts, layout=layout, strategy="halo")
    qp, kp = call.q_pieces, call.k_pieces
    want = {}
    for step in range(1, parts):
        for piece in range(kp.count):
            seen = np.zeros(kp.size, bool)
            for i in range(parts):
                rows = np.concatenate([np.arange(qp.start(i, a), qp.start(i, a) + qp.size)
                                       for a in range(qp.count)])[:, None]
                cols = kp.start((i - step) % parts, piece) + np.arange(kp.size)[None, :]
                sees = (cols >= rows - window[0]) & (cols <= rows + window[1])
                if causal:
                    sees &= cols <= rows
                seen |= sees.any(axis=0)
            if seen.any():
                first, last = np.flatnonzero(seen)[[0, -1]]
                lo, hi = first // 128 * 128, min(-(-(last + 1) // 128) * 128, kp.size)
                want[step, piece] = (lo, hi - lo)
    got = {(f.step, f.piece): (f.keys.offset, f.keys.size) for f in context_halo.fetches(call)}
    assert got == want


@pytest.mark.parametrize("implementation,interpret,skips", [
    ("chunked", False, False), ("xla", False, False), ("pallas", True, True)])
def test_whether_the_all_gathers_blocks_skip(implementation, interpret, skips):
    """The all-gather's blocks (a query piece against every key, its place runtime data)
    skip by their runtime shift on the fused kernels, not on the chunked or dense tiers."""
    problem = _problem(heads_kv=2, causal=True, seq_q=1024, seq_k=1024)
    assert context_local.gather_blocks_skip(problem, 4, "zigzag", implementation=implementation,
                                            interpret=interpret) is skips


def test_ring_rounds_rule(monkeypatch):
    """The backward's rounds: the fewest (a power of two) that keep one round's float32
    dK, dV within half the workspace budget ($FFPA_CHUNKED_BUDGET_MIB), each round a whole
    number of keys per piece, starting at a multiple of 128 keys under dropout."""
    from ffpa_jax import context_ring
    from ffpa_jax.context_blocks import ContextCall
    from pallas_kernels.chunked_plan import BUDGET_ENV

    def rounds(parts=4, layout="zigzag", **kw):
        call = ContextCall(problem=_problem(**kw), axis="cp", parts=parts, layout=layout,
                           strategy="ring")
        return context_ring.rounds(call)
    n = dict(seq_q=131072, seq_k=131072, head_dim=512, head_dim_v=512)
    # a shard's dK + dV: 4 bytes x 32768 keys x 8 heads x (512 + 512) = 1 GiB
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    assert rounds(**n) == 1  # the default budget, 4 GiB
    monkeypatch.setenv(BUDGET_ENV, "2047")
    assert rounds(**n) == 2
    monkeypatch.setenv(BUDGET_ENV, "512")
    assert rounds(**n) == 4
    assert rounds(**n, layout="contiguous") == 4
    # 6 keys per piece (zigzag, 4 shards of 12): halved once, then odd
    assert rounds(seq_q=48, seq_k=48, head_dim=2**22, head_dim_v=2**22) == 2
    # 256 keys per piece whose dK + dV are 8 x half the budget: eight rounds; under dropout
    # two of 128 keys, not four of 64
    drop = dict(seq_q=4 * 512, seq_k=4 * 512, dropout_rate=0.1, head_dim=2**16,
                head_dim_v=2**16)
    assert rounds(**drop) == 2
    assert rounds(**{**drop, "dropout_rate": 0.0}) == 8
    # $FFPA_RING_ROUNDS asks for a number, within what the pieces can be split into; a
    # malformed value leaves the rule in charge
    monkeypatch.setenv(BUDGET_ENV, "2048")
    assert rounds(**n) == 1
    monkeypatch.setenv(context_ring.ROUNDS_ENV, "2")
    assert rounds(**n) == 2
    monkeypatch.setenv(context_ring.ROUNDS_ENV, "1")
    assert rounds(**n, layout="contiguous") == 1
    monkeypatch.setenv(context_ring.ROUNDS_ENV, "8")
    assert rounds(**drop) == 2 and rounds(**n) == 8
    assert rounds(seq_q=48, seq_k=48, head_dim=8, head_dim_v=8) == 2
    for malformed in ("3", "0", "-2", "two", "", "2.0"):
        monkeypatch.setenv(context_ring.ROUNDS_ENV, malformed)
        assert rounds(**n) == 1, malformed


def _smap(fn, n=1):
    mesh = jax.make_mesh((n,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec(None, "cp")
    return jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)


def test_the_rings_diagonal_blocks_carry_their_shift():
    """At the ring's first step each shard holds its own keys: a causal ring's diagonal
    blocks (T = S) run with their shift known at trace time (0, or minus a round's key
    offset), on every shard alike, where their tiers cannot skip by a runtime shift (here
    the CPU's dense or chunked tier); blocks whose shift differs by shard (T != S) or that
    are not partly visible there do not."""
    from ffpa_jax import context_ring
    from ffpa_jax.context_blocks import FULL, PARTIAL, Block, ContextCall

    def call(layout, t, s):
        problem = Problem(batch=1, seq_q=t, seq_k=s, heads_q=2, heads_kv=1, head_dim=8,
                          head_dim_v=8, dtype=jnp.float32, scale=1.0, causal=True)
        return ContextCall(problem=problem, axis="cp", parts=4, layout=layout, strategy="ring")
    zig = call("zigzag", 1024, 1024)
    assert [context_ring.home_shift(zig, a, b) for a in (0, 1) for b in (0, 1)] == [
        0, None, None, 0]
    half = zig.k_pieces.size // 2  # two rounds: each diagonal block's keys in two parts
    assert [context_ring.home_shift(zig, 1, 1, context_ring.Keys(r * half, half))
            for r in (0, 1)] == [0, -half]
    assert Block(128, 128, PARTIAL, 0) in context_ring.blocks(zig, 0, 0)
    assert context_ring.home_shift(call("contiguous", 1024, 1024), 0, 0) == 0
    assert context_ring.home_shift(call("contiguous", 1024, 2048), 0, 0) is None
    assert PARTIAL not in {b.relation for b in context_ring.blocks(zig, 1, 0)}
    # The fused kernels skip by the runtime shift: the diagonal's one partly visible block,
    # placed at run time, serves its steps' every relation (no switch between branches).
    fused = dataclasses.replace(zig, implementation="pallas", interpret=True)
    assert context_ring.home_shift(fused, 0, 0) is None
    assert context_ring.blocks(fused, 0, 0) == [Block(128, 128, PARTIAL)]
    # A block fully visible on every shard at every step stays the unmasked kernel.
    assert context_ring.blocks(fused, 1, 0) == [Block(128, 128, FULL)]


def test_argument_errors():
    q = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(ValueError, match="not an axis of an enclosing shard_map"):
        ffpa_jax.attention(q, q, q, context_axis="cp")
    with pytest.raises(ValueError, match="context_layout='zigzag' needs context_axis"):
        ffpa_jax.attention(q, q, q, context_layout="zigzag")
    with pytest.raises(ValueError, match="context_layout must be one of"):
        ffpa_jax.attention(q, q, q, context_layout="striped")
    with pytest.raises(ValueError, match="context_strategy must be one of"):
        ffpa_jax.attention(q, q, q, context_strategy="tree")
    with pytest.raises(TypeError, match="context_axis must be a mesh axis name"):
        ffpa_jax.attention(q, q, q, context_axis=3)
    bias = jnp.zeros((1, 2, 16, 16))
    with pytest.raises(ValueError, match="segment_ids"):
        jax.jit(_smap(lambda q: ffpa_jax.attention(q, q, q, bias, context_axis="cp")))(q)
    odd = jnp.zeros((1, 15, 2, 8))
    with pytest.raises(ValueError, match="must be even"):
        jax.jit(_smap(lambda q: ffpa_jax.attention(q, q, q, context_axis="cp",
                                                   context_layout="zigzag")))(odd)
    with pytest.raises(ValueError, match="multiple of 128"):
        jax.jit(_smap(lambda q: ffpa_jax.attention(
            q, q, q, context_axis="cp", context_strategy="ring", dropout_rate=0.5,
            dropout_rng=jax.random.key(0))))(q)


def test_one_device_shard_map_equals_plain_call():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, 32, 4, 8), np.float32))
    k = jnp.asarray(rng.standard_normal((1, 32, 2, 8), np.float32))
    got = jax.jit(_smap(lambda q, k: ffpa_jax.attention(
        q, k, k, is_causal=True, context_axis="cp", context_layout="zigzag")))(q, k)
    want = ffpa_jax.attention(q, k, k, is_causal=True)
    np.testing.assert_allclose(got, want, atol=2e-6)


@pytest.mark.parametrize("tier,interpret", [("pallas", True), ("chunked", False)])
def test_every_tier_with_kernels_places_a_block(tier, interpret):
    """Each tier that serves a block of a sequence (`Problem.positions`) computes it as the
    dense tier does."""
    lacking = tier_lacks_positions(tier)
    if lacking is not None:
        pytest.skip(lacking)
    assert positioned_block_matches_dense(tier, interpret), (
        f"the {tier} tier claims positions but computes them wrong")


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(slow="--slow" in sys.argv)
