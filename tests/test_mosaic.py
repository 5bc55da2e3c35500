"""The Mosaic tier (Pallas Mosaic GPU, sm90): what a CPU can check. Its kernels have no
interpreter: here they are lowered for CUDA (Mosaic GPU's whole Pallas lowering runs without
a GPU), and the dispatcher's choices around the tier are checked on a simulated H100. Its
numerics run in the shared matrix on the GPU (the `tier` fixture, `-m gpu`)."""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import attn_testing as at
import ffpa_jax
from conftest import HAS_GPU, skip_unless_sm90
from pallas_kernels import compat, tiers, visibility
from pallas_kernels.mosaic import Config, default_config, mosaic_attention_forward
from pallas_kernels.mosaic.backward import mosaic_attention_backward, unsupported_head_dims
from pallas_kernels.mosaic.config import default_backward_config
from pallas_kernels.mosaic.common import Walk, soft_cap
from pallas_kernels.visibility import kv_walk, q_walk
from pallas_kernels.mosaic import tier as mosaic_tier
from pallas_kernels.problem import Cotangents, FeatureArrays, Inputs, Problem, Saved
from tuning import dispatch

sd = jax.ShapeDtypeStruct

# (B, T, S, Hq, Hkv, D, Dv, causal, config): both kernels, odd shapes (padded to the
# kernels' tiles), GQA with clusters along heads and along query tiles, both lowerings.
LOWERING_CASES = [
    (1, 113, 203, 4, 2, 59, 40, True, None),
    (2, 256, 256, 8, 2, 128, 128, False, None),
    (1, 300, 1000, 4, 4, 64, 64, True, None),
    (1, 256, 300, 2, 1, 256, 256, True, None),
    (1, 256, 256, 2, 2, 128, 128, True, Config(block_kv=128, cluster=2,
                                               lowering="warpgroup")),
    (1, 203, 300, 4, 2, 320, 111, True, None),
    (1, 256, 256, 8, 2, 512, 512, False, None),
]
# The kernels' language-model features: (case as above, window, softcap).
FEATURE_CASES = [
    ((1, 113, 203, 4, 2, 59, 40, True, None), (64, 0), None),
    ((1, 300, 1000, 4, 4, 64, 64, False, None), (100, 37), 30.0),
    ((1, 256, 300, 2, 1, 256, 256, True, None), None, 50.0),
    ((1, 203, 300, 4, 2, 320, 111, True, None), (128, 5), 20.0),
    ((1, 256, 256, 2, 2, 128, 128, True, Config(block_kv=128, cluster=2,
                                                lowering="warpgroup")), (17, 0), None),
    ((2, 203, 300, 4, 2, 150, 150, False, None), (100, 37), 30.0),
    # The wide kernel's earlier default: 128-column ring pieces, clusters of 4 query tiles.
    ((1, 300, 260, 2, 2, 512, 512, True, Config(block_kv=128, num_stages=2, wide=True,
                                                cluster=4, grid_order="q")), None, 30.0),
    # Persistent launches: clusters along heads, three stages, D = 256 (O in chunks of 128
    # columns beside Q), causal with the heaviest tile first.
    ((2, 300, 1000, 4, 2, 128, 128, False, Config(block_kv=128, cluster=2, cluster_axis="heads",
                                                  lowering="warpgroup", persistent=True)),
     (100, 37), 30.0),
    ((3, 203, 333, 4, 4, 64, 64, True, Config(block_kv=128, num_stages=3, persistent=True)),
     None, None),
    ((2, 1023, 113, 2, 1, 256, 256, False, Config(block_kv=64, num_stages=2, persistent=True)),
     None, 30.0),
    # The rows kernel's intra-warpgroup overlap (the built-in configs, None, take it at head
    # dims 65-256 outside persistent clusters; the explicit ones above run the serial walk):
    # persistent GQA at D = 256 without clusters, causal with a window and T < S at D = 59,
    # D = 150 (padded) with a two-sided window, GQA clusters along heads in the Warpgroup
    # lowering; rows with no visible key in the windowed ones.
    ((2, 1023, 113, 2, 1, 256, 256, False, Config(block_kv=64, num_stages=2, persistent=True,
                                                  overlap=True)), None, 30.0),
    ((1, 113, 203, 4, 2, 59, 40, True, Config(block_kv=128, overlap=True)), (64, 0), None),
    ((2, 203, 300, 4, 2, 150, 150, False, Config(block_kv=64, overlap=True)), (100, 37), 30.0),
    ((2, 300, 1000, 4, 2, 128, 128, True, Config(block_kv=128, cluster=2, cluster_axis="heads",
                                                 lowering="warpgroup", overlap=True)),
     (200, 0), None),
]


def _feature_id(case) -> str:
    (*_, d, _, _, config), window, softcap = case
    overlap = "-overlap" if config is not None and config.overlap else ""
    return f"D{d}-window{window}-softcap{softcap}{overlap}"


@pytest.mark.parametrize("case", LOWERING_CASES,
                         ids=lambda c: "B{}-T{}-S{}-H{}.{}-D{}.{}-causal{}".format(*c[:8]))
def test_kernels_lower_for_cuda(case):
    b, t, s, hq, hkv, d, dv, causal, config = case
    q, k, v = sd((b, t, hq, d), jnp.bfloat16), sd((b, s, hkv, d), jnp.bfloat16), sd(
        (b, s, hkv, dv), jnp.bfloat16)

    def f(q, k, v):
        return mosaic_attention_forward(q, k, v, scale=d ** -0.5, causal=causal,
                                        config=config, out_dtype=jnp.float32)
    text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("case", FEATURE_CASES, ids=_feature_id)
def test_kernels_with_a_window_and_a_soft_cap_lower_for_cuda(case):
    (b, t, s, hq, hkv, d, dv, causal, config), window, softcap = case
    q, k, v = sd((b, t, hq, d), jnp.bfloat16), sd((b, s, hkv, d), jnp.bfloat16), sd(
        (b, s, hkv, dv), jnp.bfloat16)

    def f(q, k, v):
        return mosaic_attention_forward(q, k, v, scale=d ** -0.5, causal=causal,
                                        config=config, out_dtype=jnp.float32, window=window,
                                        softcap=softcap)
    text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


# The backward's cases: (B, T, S, Hq, Hkv, D, Dv, causal, window, softcap): both kernels
# and the head dims each takes (D = 64 gives K a 64-byte swizzle, D = 150 pads to 192,
# whose column halves need one too), odd shapes, GQA, T > S, the features.
BACKWARD_LOWERING_CASES = [
    (1, 113, 203, 4, 2, 59, 40, True, None, None),
    (2, 256, 256, 8, 2, 128, 128, False, None, None),
    (1, 203, 113, 4, 4, 111, 100, True, None, None),
    (1, 300, 1000, 4, 4, 64, 64, False, (100, 37), 30.0),
    (1, 1, 203, 2, 1, 64, 64, True, None, None),
    (1, 113, 203, 4, 2, 256, 256, True, None, None),
    (2, 203, 300, 2, 1, 150, 150, False, (100, 37), 30.0),
]


@pytest.mark.parametrize("case", BACKWARD_LOWERING_CASES,
                         ids=lambda c: "T{}-S{}-D{}.{}-causal{}-window{}-softcap{}".format(
                             c[1], c[2], c[5], c[6], *c[7:]))
def test_backward_lowers_for_cuda(case):
    b, t, s, hq, hkv, d, dv, causal, window, softcap = case
    q, k, v = sd((b, t, hq, d), jnp.bfloat16), sd((b, s, hkv, d), jnp.bfloat16), sd(
        (b, s, hkv, dv), jnp.bfloat16)
    out, lse = sd((b, t, hq, dv), jnp.float32), sd((b, hq, t), jnp.float32)

    def f(q, k, v, out, lse, d_out, d_lse):
        return mosaic_attention_backward(Inputs(q, k, v), (out, lse), (d_out, d_lse),
                                         scale=d ** -0.5, causal=causal, window=window,
                                         softcap=softcap)
    text = jax.jit(f).trace(q, k, v, out, lse, out, lse).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("d,dv,reason", [(320, 320, "head dims above 256"),
                                          (256, 128, "head dims above 128 with D != Dv")])
def test_backward_refuses_head_dims_it_does_not_take(d, dv, reason):
    q, v = sd((1, 64, 2, d), jnp.bfloat16), sd((1, 64, 2, dv), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"does not take {reason}; got D={d}, Dv={dv}"):
        jax.eval_shape(functools.partial(mosaic_attention_backward, scale=0.1, causal=False),
                       Inputs(q, q, v), (v, sd((1, 2, 64), jnp.float32)), (v, None))


@pytest.mark.parametrize("d,dv,takes", [(40, 128, True), (129, 129, True), (200, 256, True),
                                        (256, 256, True), (150, 100, False), (257, 257, False)])
def test_backward_head_dims_after_padding(d, dv, takes):
    assert (unsupported_head_dims(d, dv) == "") is takes


@pytest.mark.parametrize("d,dv,segments,rows", [(64, 64, False, 128), (59, 40, False, 128),
                                                 (64, 64, True, 64), (65, 64, False, 64),
                                                 (128, 128, False, 64), (256, 256, False, 64)])
def test_backward_rows_per_step(d, dv, segments, rows):
    """128 query rows per step only where both head dims pad to 64 and no segment ids come
    (the measured case, docs/history.md session 23); the lowering cases above take them."""
    assert default_backward_config(d, dv, segments=segments).block_q == rows


def test_backward_refuses_rows_per_step_it_cannot_hold():
    with pytest.raises(ValueError, match="block_q=96 must be 64 or 128"):
        Config(block_q=96)
    wide_rows = Config(num_stages=2, consumer_regs=240, producer_regs=24, block_q=128)
    for d, match in ((128, "128 query rows per step need D, Dv <= 64; got D=128, Dv=128"),
                     (256, "halves_backward takes 64 query rows per step; got 128")):
        q = sd((1, 64, 2, d), jnp.bfloat16)
        with pytest.raises(ValueError, match=match):
            jax.eval_shape(functools.partial(mosaic_attention_backward, scale=0.1, causal=False,
                                             config=wide_rows),
                           Inputs(q, q, q), (q, sd((1, 2, 64), jnp.float32)), (q, None))


# Sequence lengths in the kernels (the tier serves them once the GPU test below passes):
# (B, T, S, Hq, Hkv, D, Dv, causal, window); both forward kernels and the backward.
LENGTH_CASES = [
    (3, 113, 203, 4, 2, 59, 40, True, None),
    (2, 300, 1000, 4, 4, 64, 64, False, (100, 37)),
    (2, 203, 300, 4, 2, 320, 111, True, None),
    (2, 256, 256, 2, 1, 128, 128, True, None),
]
LENGTHS = {"q": (0, 100, 77), "kv": (5, 150, 203)}  # per batch row, clipped to T and S


def _lengths(b, t, s):
    return (jnp.asarray([min(x, t) for x in LENGTHS["q"][:b]], jnp.int32),
            jnp.asarray([min(x, s) for x in LENGTHS["kv"][:b]], jnp.int32))


@pytest.mark.parametrize("case", LENGTH_CASES,
                         ids=lambda c: "B{}-T{}-S{}-D{}.{}-causal{}-window{}".format(
                             c[0], c[1], c[2], c[5], c[6], c[7], c[8]))
def test_kernels_with_sequence_lengths_lower_for_cuda(case):
    b, t, s, hq, hkv, d, dv, causal, window = case
    q, k, v = sd((b, t, hq, d), jnp.bfloat16), sd((b, s, hkv, d), jnp.bfloat16), sd(
        (b, s, hkv, dv), jnp.bfloat16)
    lens = sd((b,), jnp.int32)

    def forward(q, k, v, q_len, kv_len):
        return mosaic_attention_forward(q, k, v, scale=d ** -0.5, causal=causal,
                                        out_dtype=jnp.float32, window=window,
                                        features=FeatureArrays(q_lengths=q_len,
                                                               kv_lengths=kv_len))
    text = jax.jit(forward).trace(q, k, v, lens, lens).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    if unsupported_head_dims(d, dv):
        return
    out, lse = sd((b, t, hq, dv), jnp.float32), sd((b, hq, t), jnp.float32)

    def backward(q, k, v, q_len, kv_len, out, lse):
        inputs = Inputs(q, k, v, features=FeatureArrays(q_lengths=q_len, kv_lengths=kv_len))
        return mosaic_attention_backward(inputs, (out, lse), (out, lse), scale=d ** -0.5,
                                         causal=causal, window=window)
    text = jax.jit(backward).trace(q, k, v, lens, lens, out, lse).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def _visible(t, s, causal, window, kv_length=None, shift=None):
    """bool [T, S] by the rule of `pallas_kernels.visibility` (its own functions, on numpy
    arrays); `shift` a block's place (`FeatureArrays.positions`), None: S - T."""
    rows, cols = np.arange(t), np.arange(s)
    shift = visibility.default_shift(t, s) if shift is None else shift
    seen = np.ones((t, s), bool)
    if causal:
        seen &= visibility.causal_visible(rows, cols, shift)
    if window is not None:
        seen &= visibility.window_visible(rows, cols, window, shift)
    if kv_length is not None:
        seen &= np.asarray(visibility.feature_visible(rows, cols, shift=shift,
                                                      kv_len=kv_length))
    return np.asarray(seen)


def _key_length(rng, s):
    """None (all keys) or a random key length in [0, S] for a walk's brute-force test."""
    return None if rng.integers(3) == 0 else int(rng.integers(0, s + 1))


def _block_shift(rng, t, s):
    """None (S - T) or, half the time, the runtime shift of a block of a longer sequence
    (row 0 anywhere from before the first key to past the last)."""
    return None if rng.integers(2) else int(rng.integers(-t - 64, s + 64))


def test_key_block_walk_covers_every_visible_key_and_masks_only_what_it_must():
    """`kv_walk` against the visibility rule, brute force over groups of rows (every group
    of a problem at once: the walk's bounds are element-wise): every key a row sees lies in
    [lo, hi); the blocks [mask_lo, full_hi) are visible whole to every row of the group (no
    mask needed); blocks outside [lo, hi) hold no visible key. Half the problems are blocks
    of a longer sequence (a runtime shift, `Walk.with_positions`)."""
    rng = np.random.default_rng(0)
    for _ in range(160):
        t, s = (int(x) for x in rng.integers(1, 400, 2))
        bkv = int(rng.choice([64, 128, 256]))
        causal = bool(rng.integers(2))
        window = None if rng.integers(4) == 0 else tuple(int(x) for x in rng.integers(0, 300, 2))
        kv_length = _key_length(rng, s)
        shift = _block_shift(rng, t, s)
        walk = Walk(T=t, S=s, causal=causal, block_kv=bkv, window=window,
                    key_end=None if kv_length is None else jnp.int32(kv_length),
                    row_shift=None if shift is None else jnp.int32(shift))
        firsts = np.arange(0, t, int(rng.integers(1, 64)), dtype=np.int32)
        lasts = np.minimum(firsts + rng.integers(0, 128, firsts.size), t - 1).astype(np.int32)
        # One shape for every problem (padded by repeating the last group): the walk's jnp
        # operations compile once.
        padded = [np.pad(x, (0, 400 - x.size), mode="edge") for x in (firsts, lasts)]
        lo, mask_lo, full_hi, hi = (x[:firsts.size] for x in np.broadcast_arrays(
            padded[0], *kv_walk(walk, *map(jnp.asarray, padded)))[1:])
        where = (f"T={t} S={s} bkv={bkv} causal={causal} window={window} kv_len={kv_length} "
                 f"shift={shift}")
        assert np.all((0 <= lo) & (lo <= mask_lo) & (mask_lo <= full_hi) & (full_hi <= hi)
                      & (hi <= -(-s // bkv))), where
        # Per group and key: how many of its rows see the key (prefix sums over the rows).
        seen = np.concatenate([np.zeros((1, s), int), np.cumsum(
            _visible(t, s, causal, window, kv_length, shift), axis=0)])
        count = seen[lasts + 1] - seen[firsts]
        block = np.arange(s) // bkv
        outside = (block < lo[:, None]) | (block >= hi[:, None])
        assert not np.any((count > 0) & outside), where
        whole = (block >= mask_lo[:, None]) & (block < full_hi[:, None])
        assert np.all(~whole | (count == (lasts - firsts + 1)[:, None])), where
        assert np.all((full_hi == mask_lo) | (full_hi * bkv <= (s if kv_length is None
                                                                else kv_length))), where


def _segment_ids(rng, b, n, kind):
    """Segment ids [b, n] of one kind: "packed" (sorted runs, as packed documents), "keys"
    (a key-padding mask's ids: 1 up to a length, then 0) or "random" (unsorted ids)."""
    if kind == "packed":
        return np.sort(rng.integers(0, 4, (b, n)), axis=1).astype(np.int32)
    if kind == "keys":
        lengths = rng.integers(0, n + 1, (b, 1))
        return (np.arange(n)[None, :] < lengths).astype(np.int32)
    return rng.integers(0, 3, (b, n)).astype(np.int32)


def _random_segment_problem(rng, trial):
    """A random problem under segment ids for the walks' brute-force tests: (T, S, causal,
    window, key length, the kind of ids, q ids [T], kv ids [S], and which keys each row
    sees [T, S] by the element rule with the ids' comparison). The kind cycles with
    `trial`; key padding gives every row the id 1."""
    t, s = (int(x) for x in rng.integers(1, 700, 2))
    causal = bool(rng.integers(2))
    window = None if rng.integers(3) else tuple(int(x) for x in rng.integers(0, 400, 2))
    kv_length = _key_length(rng, s)
    kind = ("packed", "keys", "random")[trial % 3]
    q_ids = np.ones((1, t), np.int32) if kind == "keys" else _segment_ids(rng, 1, t, kind)
    kv_ids = _segment_ids(rng, 1, s, kind)
    visible = _visible(t, s, causal, window, kv_length) & (q_ids[0][:, None]
                                                           == kv_ids[0][None, :])
    return t, s, causal, window, kv_length, kind, q_ids, kv_ids, visible


# `segment_block_ranges(..., full=True)` as one compiled program per shape (its eager
# operations would compile one by one).
_full_ranges = jax.jit(functools.partial(visibility.segment_block_ranges, full=True),
                       static_argnames=("block_m", "block_n"))


def _segment_walk_record(t, s, causal, window, kv_length, block: int, ranges):
    """The kernels' `Walk` under segment ids for every group at once (element-wise, as the
    walks are), from `segment_block_ranges(..., full=True)`'s rows [groups, 4], padded to
    16 groups by repeating the last, so that the walks' jnp operations compile once."""
    ranges = jnp.asarray(np.pad(ranges, ((0, 16 - len(ranges)), (0, 0)), mode="edge"))
    return Walk(T=t, S=s, causal=causal, block_kv=block, window=window,
                key_end=None if kv_length is None else jnp.int32(kv_length), segments=True,
                segment_range=(ranges[:, 0], ranges[:, 1]),
                segment_full=(ranges[:, 2], ranges[:, 3]))


def _groups(firsts, lasts, walked):
    """The walk's (lo, mask_lo, full_hi, hi) of the groups [firsts[i], lasts[i]] (padded to
    16 as `_segment_walk_record` pads their ranges), as numpy rows of `len(firsts)`."""
    n = len(firsts)
    firsts, lasts = (jnp.asarray(np.pad(x, (0, 16 - n), mode="edge")) for x in (firsts, lasts))
    return [np.broadcast_to(np.asarray(x), (16,))[:n] for x in walked(firsts, lasts)]


def test_segment_walks_leave_unmasked_only_blocks_every_row_sees_whole():
    """The walks under segment ids with the blocks the ids leave whole
    (`segment_block_ranges(full=True)`), brute force against the element rule with the ids'
    comparison, over packed, key-padding and random ids, causal or not, windows and key
    lengths: every key a row of a tile sees lies in [lo, hi); [mask_lo, full_hi) is visible
    whole to every row of the tile; and some block is unmasked somewhere (the ids are not
    compared everywhere)."""
    rng = np.random.default_rng(2)
    unmasked = 0
    for trial in range(24):
        problem = _random_segment_problem(rng, trial)
        t, s, causal, window, kv_length, kind, q_ids, kv_ids, visible = problem
        bkv, rows = int(rng.choice([64, 128])), 128
        ranges = np.asarray(_full_ranges(q_ids, kv_ids, block_m=rows, block_n=bkv))[0]
        block = np.arange(s) // bkv
        firsts = np.arange(0, t, rows, dtype=np.int32)
        lasts = np.minimum(firsts + rows, t).astype(np.int32) - 1
        walk = _segment_walk_record(t, s, causal, window, kv_length, bkv, ranges)
        bounds = _groups(firsts, lasts, lambda f, la: kv_walk(walk, f, la))
        for tile, (first, last) in enumerate(zip(firsts, lasts)):
            lo, mask_lo, full_hi, hi = (int(x[tile]) for x in bounds)
            where = f"{kind} T={t} S={s} bkv={bkv} causal={causal} window={window} " \
                    f"kv_len={kv_length} tile={tile}"
            assert 0 <= lo <= mask_lo <= full_hi <= hi <= -(-s // bkv), where
            seen = visible[first:last + 1]
            assert not np.any(seen[:, (block < lo) | (block >= hi)]), where
            assert np.all(seen[:, (block >= mask_lo) & (block < full_hi)]), where
            unmasked += full_hi - mask_lo
    assert unmasked > 0


def test_segment_walks_of_the_backward_leave_unmasked_only_whole_blocks():
    """`q_walk` under segment ids (the backward's walk over query blocks for a group of 128
    keys) with the blocks the ids leave whole, brute force as above: every row that sees a
    key of the group lies in [lo, hi), and the rows of [mask_lo, full_hi) see every key of
    it (none of them padding)."""
    rng = np.random.default_rng(3)
    unmasked = 0
    for trial in range(24):
        problem = _random_segment_problem(rng, trial)
        t, s, causal, window, kv_length, kind, q_ids, kv_ids, visible = problem
        bq, width = int(rng.choice([64, 128])), 128
        ranges = np.asarray(_full_ranges(kv_ids, q_ids, block_m=width, block_n=bq))[0]
        block = np.arange(t) // bq
        firsts = np.arange(0, s, width, dtype=np.int32)
        lasts = (firsts + width - 1).astype(np.int32)  # may pass S - 1
        walk = _segment_walk_record(t, s, causal, window, kv_length, width, ranges)
        bounds = _groups(firsts, lasts, lambda f, la: q_walk(walk, f, la, bq))
        for group, (first, last) in enumerate(zip(firsts, lasts)):
            lo, mask_lo, full_hi, hi = (int(x[group]) for x in bounds)
            where = f"{kind} T={t} S={s} bq={bq} causal={causal} window={window} " \
                    f"kv_len={kv_length} group={group}"
            assert 0 <= lo <= mask_lo <= full_hi <= hi <= -(-t // bq), where
            seen = visible[:, first:min(last, s - 1) + 1]
            assert not np.any(seen[(block < lo) | (block >= hi)]), where
            whole = (block >= mask_lo) & (block < full_hi)
            assert last < s or not whole.any(), where
            assert np.all(seen[whole]), where
            unmasked += full_hi - mask_lo
    assert unmasked > 0


def test_query_block_walk_covers_every_row_that_sees_a_key_and_masks_only_what_it_must():
    """`q_walk` (the backward's walk over query blocks for a group of keys) against the
    visibility rule, brute force: every row that sees a key of the group lies in [lo, hi);
    the blocks [mask_lo, full_hi) see every key of the group (and none of them is padding);
    blocks outside [lo, hi) see none. Half the problems are blocks of a longer sequence (a
    runtime shift)."""
    rng = np.random.default_rng(1)
    for _ in range(160):
        t, s = (int(x) for x in rng.integers(1, 400, 2))
        bq = int(rng.choice([64, 128]))
        causal = bool(rng.integers(2))
        window = None if rng.integers(4) == 0 else tuple(int(x) for x in rng.integers(0, 300, 2))
        kv_length = _key_length(rng, s)
        shift = _block_shift(rng, t, s)
        walk = Walk(T=t, S=s, causal=causal, block_kv=128, window=window,
                    key_end=None if kv_length is None else jnp.int32(kv_length),
                    row_shift=None if shift is None else jnp.int32(shift))
        width = int(rng.choice([64, 128]))
        firsts = np.arange(0, s, width, dtype=np.int32)
        lasts = (firsts + width - 1).astype(np.int32)  # may pass S - 1: padding keys
        padded = [np.pad(x, (0, 400 - x.size), mode="edge") for x in (firsts, lasts)]
        lo, mask_lo, full_hi, hi = (x[:firsts.size] for x in np.broadcast_arrays(
            padded[0], *q_walk(walk, *map(jnp.asarray, padded), bq))[1:])
        where = (f"T={t} S={s} bq={bq} causal={causal} window={window} kv_len={kv_length} "
                 f"shift={shift}")
        assert np.all((0 <= lo) & (lo <= mask_lo) & (mask_lo <= full_hi) & (full_hi <= hi)
                      & (hi <= -(-t // bq))), where
        # Per group and row: how many of the group's keys the row sees.
        seen = np.concatenate([np.zeros((t, 1), int), np.cumsum(
            _visible(t, s, causal, window, kv_length, shift), axis=1)], axis=1)
        count = seen[:, np.minimum(lasts, s - 1) + 1] - seen[:, firsts]  # [T, groups]
        block = (np.arange(t) // bq)[:, None]
        outside = (block < lo[None]) | (block >= hi[None])
        assert not np.any((count > 0) & outside), where
        whole = (block >= mask_lo[None]) & (block < full_hi[None])
        assert np.all(~whole | (count == (lasts - firsts + 1)[None])), where


def test_soft_cap_in_raw_units_is_the_references_cap():
    """The kernels cap raw scores q·k and keep the softmax's one multiply by scale·log2(e):
    scale·soft_cap(s) = c·tanh(scale·s / c), within float32's approximation of tanh."""
    scale, cap = 0.0883883, 30.0
    s = jnp.linspace(-4000.0, 4000.0, 8001, dtype=jnp.float32)
    got = scale * soft_cap(Walk(T=1, S=1, causal=False, block_kv=64, softcap=cap,
                                scale=scale), s)
    want = cap * np.tanh(np.asarray(s, np.float64) * scale / cap)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=0, atol=4e-6 * cap)
    assert soft_cap(Walk(T=1, S=1, causal=False, block_kv=64), s) is s  # no cap: unchanged


def _mosaic_modules(fn, *args) -> list[str]:
    """The Mosaic GPU modules (without debug locations) that lowering `fn` for CUDA makes."""
    core = pytest.importorskip("jax.experimental.mosaic.gpu.core")
    if not hasattr(core, "_has_communication"):
        pytest.skip("this jax's Mosaic GPU lowering has no hook to read its modules from")
    seen, hook = [], core._has_communication

    def spy(module, **kw):
        seen.append(module.operation.get_asm(enable_debug_info=False))
        return hook(module, **kw)
    core._has_communication = spy
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    finally:
        core._has_communication = hook
    return seen


_SHARD_INPUTS = (sd((2, 96, 4, 64), jnp.bfloat16),) * 3


def _shard_local(q, k, v):
    return mosaic_attention_forward(q, k, v, scale=0.125, causal=True, config=None,
                                    out_dtype=jnp.bfloat16)[0]


@functools.cache
def _alone_modules() -> list[str]:
    return _mosaic_modules(_shard_local, *_SHARD_INPUTS)


@pytest.mark.parametrize("axis", ["b", "h", "qt", "cl", "wg", "batch"])
def test_kernels_in_a_shard_map_are_the_single_device_kernels(axis):
    """Inside a shard_map whose mesh axis has the name of a kernel axis, Mosaic GPU took the
    mesh axis for the grid's: on 2 GPUs each device computed one batch row for all of its
    own (docs/history.md, session 18). The kernels' axes have names of their own: the
    module under any mesh is the one without."""
    mesh = jax.make_mesh((1,), (axis,), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec(axis)
    sharded = jax.shard_map(_shard_local, mesh=mesh, in_specs=spec, out_specs=spec)
    assert _mosaic_modules(sharded, *_SHARD_INPUTS) == _alone_modules()


def test_outputs_vary_over_a_shard_maps_axes_as_q():
    """Mosaic GPU traces kernels with the check of varying manual axes off, so its outputs
    came out typed alike on every shard: a differentiated call inside a user's shard_map
    (check_vma on) then had its output's cotangent summed over the shards, and wrong
    gradients on 2 GPUs (docs/history.md, session 19). Out and lse vary as q does."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = jax.sharding.PartitionSpec("data")
    seen = {}

    def local(q, k, v):
        out, lse = mosaic_attention_forward(q, k, v, scale=0.125, causal=True, config=None,
                                            out_dtype=jnp.float32)
        seen.update(q=compat.varying_axes(q), out=compat.varying_axes(out),
                    lse=compat.varying_axes(lse))
        return out
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    inputs = [sd((2, 96, 4, 64), jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, spec))
              ] * 3
    with jax.set_mesh(mesh):
        jax.jit(sharded).trace(*inputs)
    assert seen == dict(q={"data"}, out={"data"}, lse={"data"})


@pytest.mark.parametrize("d,features", [(64, False), (256, True)])
def test_backward_gradients_vary_over_a_shard_maps_axes_as_q(d, features):
    """The backward inside a user's shard_map that checks varying manual axes: its launch
    (`pl.kernel` over a Mosaic mesh) takes its outputs' types as declared, and jax 0.11
    refused undeclared ones there ("manual_axis_type ... must not be None", which stopped
    every context-parallel block on the tier). dq, dk, dv vary as q,
    replicated lengths and segment ids given too."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    spec = jax.sharding.PartitionSpec("data")
    seen = {}
    lengths = jnp.asarray([200], jnp.int32) if features else None
    ids = jnp.zeros((1, 256), jnp.int32) if features else None

    def local(q, k, v, out, lse, d_out):
        f = FeatureArrays(q_segment_ids=ids, kv_segment_ids=ids, kv_lengths=lengths)
        grads = mosaic_attention_backward(Inputs(q, k, v, features=f), (out, lse),
                                          (d_out, None), scale=0.125, causal=True)
        seen.update({name: compat.varying_axes(g) for name, g in zip(("dq", "dk", "dv"),
                                                                     grads)})
        return grads
    sharded = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 6, out_specs=(spec,) * 3)
    sharding = jax.sharding.NamedSharding(mesh, spec)
    q = sd((1, 256, 4, d), jnp.bfloat16, sharding=sharding)
    inputs = [q, q, q, sd((1, 256, 4, d), jnp.float32, sharding=sharding),
              sd((1, 4, 256), jnp.float32, sharding=sharding), q]
    with jax.set_mesh(mesh):
        text = jax.jit(sharded).trace(*inputs).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert seen == dict(dq={"data"}, dk={"data"}, dv={"data"})


def test_default_configs_by_head_size():
    """The rows kernel up to D = 256 (its blocks as measured), the wide one above, with
    clusters along the heads of an even GQA group, except in persistent launches that walk
    overlapped (above D = 64 without segment ids): one CTA per cluster there."""
    assert default_config(64).block_kv == 256 and not default_config(64).wide
    assert default_config(128).lowering == "warpgroup"
    assert default_config(256).block_kv == 64
    narrow = default_config(64, gqa_group=4)
    assert narrow.persistent and (narrow.cluster, narrow.cluster_axis) == (2, "heads")
    for d, causal in ((128, False), (256, False), (256, True)):
        rows = default_config(d, gqa_group=4, causal=causal, seq_q=4096)
        assert rows.persistent and rows.overlap and rows.cluster == 1
    causal128 = default_config(128, gqa_group=4, causal=True, seq_q=4096)
    assert not causal128.persistent and causal128.overlap
    assert (causal128.cluster, causal128.cluster_axis) == (2, "heads")
    segments = default_config(256, gqa_group=4, segments=True)
    assert not segments.overlap and (segments.cluster, segments.cluster_axis) == (2, "heads")
    wide = default_config(512)
    assert wide.wide and (wide.cluster, wide.cluster_axis, wide.num_stages) == (2, "q", 3)
    assert default_config(512, gqa_group=4).cluster_axis == "heads"


def _h100(monkeypatch, jax_runs_mosaic: bool = True) -> dispatch.Device:
    monkeypatch.setattr(compat, "mosaic_gpu_runs", lambda: jax_runs_mosaic)
    monkeypatch.setenv("FFPA_SKIP_PERSIST_TUNED_CONFIG", "1")
    return dispatch.Device(nvidia_gpu=True, name="Simulated H100", compute_capability="9.0")


def _problem(d=128, dtype=jnp.bfloat16, **kw):
    q = sd((2, 512, 8, d), dtype)
    kv = sd((2, 512, 2, d), dtype)
    return Problem.of(q, kv, kv, **kw)


def test_dispatcher_runs_mosaic_where_it_runs_and_serves(monkeypatch):
    device = _h100(monkeypatch)
    explained = dispatch.explain(_problem(), device=device)
    assert (explained.forward.tier, explained.backward.tier) == ("mosaic", "mosaic")
    assert explained.plan.config("mosaic_fwd") == default_config(128, 128, gqa_group=4)
    assert explained.plan.config("mosaic_bwd") == default_backward_config(128, 128)
    # Up to D = 256 both directions; above it the chunked tier keeps both.
    for d, tiers_want in ((192, ("mosaic", "mosaic")), (256, ("mosaic", "mosaic")),
                          (512, ("chunked", "chunked"))):
        wide = dispatch.explain(_problem(d=d), device=device)
        assert (wide.forward.tier, wide.backward.tier) == tiers_want, d


H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


@pytest.mark.parametrize("gpu,d,n,causal,want,differentiated", [
    (H100, 512, 4096, True, "mosaic", None), (H100, 512, 16384, False, "mosaic", None),
    (H100, 512, 1024, False, "mosaic", "chunked"), (H100, 128, 1024, True, "mosaic", None),
    (H100, 64, 4096, False, "mosaic", None),
    (H200, 512, 4096, True, "mosaic", None), (H200, 512, 16384, False, "mosaic", None),
    (H200, 512, 1024, False, "mosaic", "chunked"), (H200, 512, 1024, True, "mosaic", "chunked"),
    (H200, 256, 16384, True, "mosaic", None)])
def test_the_tuned_files_name_the_tier_that_measured_fastest(gpu, d, n, causal, want,
                                                             differentiated, monkeypatch,
                                                             tmp_path):
    """The packaged H100 and H200 files' forward entries (the tier measurements of sessions
    24 and 25) decide the forward; at D=512 N=1024 a differentiated call's forward runs on
    the chunked tier, whose pair with the chunked backward measured faster end to end (on
    the H100 at D=128 N=1024 causal the A/B kept mosaic); without a file D = 512 runs on
    the chunked tier."""
    monkeypatch.setattr(compat, "mosaic_gpu_runs", lambda: True)
    monkeypatch.delenv("FFPA_SKIP_PERSIST_TUNED_CONFIG", raising=False)
    monkeypatch.setenv("FFPA_TUNED_CONFIG_DIR", str(tmp_path))  # empty: the packaged file
    device = dispatch.Device(nvidia_gpu=True, name=gpu, compute_capability="9.0")
    q = sd((1, n, 32, d), jnp.bfloat16)
    explained = dispatch.explain(Problem.of(q, q, q, causal=causal), device=device)
    assert explained.forward.tier == want
    assert explained.forward.why.startswith("tuned entry")
    assert explained.plan.vjp_forward_tier == differentiated
    monkeypatch.setenv("FFPA_SKIP_PERSIST_TUNED_CONFIG", "1")
    built_in = dispatch.explain(Problem.of(q, q, q, causal=causal), device=device)
    assert built_in.forward.tier == ("chunked" if d > 256 else "mosaic")


@pytest.mark.parametrize("d,dv,deterministic,want", [
    (192, 192, True, "pallas"), (256, 256, True, "chunked"), (256, 128, None, "chunked"),
    (150, 100, None, "pallas")])
def test_a_backward_the_mosaic_tier_cannot_take_goes_where_the_rules_send_it(
        d, dv, deterministic, want, monkeypatch):
    """Passed over (deterministic=True: its dQ adds in a varying order; D != Dv above 128),
    the rules pick again without the tier: the Triton kernels below D = 256, the chunked
    tier from it (the tier after mosaic in the registry would be the Triton kernels)."""
    q, v = sd((2, 512, 8, d), jnp.bfloat16), sd((2, 512, 2, dv), jnp.bfloat16)
    problem = Problem.of(q, sd((2, 512, 2, d), jnp.bfloat16), v)
    explained = dispatch.explain(problem, device=_h100(monkeypatch), deterministic=deterministic)
    assert (explained.forward.tier, explained.backward.tier) == ("mosaic", want)
    assert explained.backward.why.endswith("mosaic passed over")


@pytest.mark.parametrize("options", [
    dict(window=(300, 0), causal=True), dict(softcap=30.0),
    dict(window=(200, 100), softcap=20.0)])
def test_the_window_and_the_soft_cap_run_on_mosaic(options, monkeypatch):
    explained = dispatch.explain(_problem(**options), device=_h100(monkeypatch))
    assert (explained.forward.tier, explained.backward.tier) == ("mosaic", "mosaic")


def test_what_mosaic_lacks_goes_to_the_fused_kernels_and_says_why(monkeypatch):
    device = _h100(monkeypatch)
    explained = dispatch.explain(_problem(dropout_rate=0.1), device=device)
    assert (explained.forward.tier, explained.backward.tier) == ("pallas", "pallas")
    assert "dropout_rate" in dict(explained.passed_over)["mosaic"]


@pytest.mark.parametrize("d,want", [(128, ("mosaic", "mosaic")), (256, ("mosaic", "mosaic")),
                                    (512, ("pallas", "pallas"))])
def test_narrow_windows_run_on_the_kernels_that_skip_hidden_tiles(d, want, monkeypatch):
    """A window of at most 1/8 of the keys: the Mosaic kernels where they serve and measured
    faster (up to D = 256), the Triton kernels beyond."""
    explained = dispatch.explain(_problem(d=d, window=(16, 0), causal=True),
                                 device=_h100(monkeypatch))
    assert (explained.forward.tier, explained.backward.tier) == want
    assert "skip the hidden tiles" in explained.forward.why


@pytest.mark.parametrize("d,want", [(64, ("pallas", "pallas")), (128, ("mosaic", "pallas")),
                                    (256, ("mosaic", "mosaic")), (512, ("chunked", "chunked"))])
def test_segment_ids_run_where_they_measured_fastest(d, want, monkeypatch):
    """Packed sequences up to D = 256: the Mosaic forward from D = 128 and its backward at
    D = 256, the Triton kernels elsewhere (never the chunked tier, which walks every tile);
    above D = 256 the other rules."""
    ids = sd((2, 512), jnp.int32)
    problem = _problem(d=d, causal=True, features=FeatureArrays(ids, ids))
    explained = dispatch.explain(problem, device=_h100(monkeypatch))
    assert (explained.forward.tier, explained.backward.tier) == want
    if d <= 256:
        assert "segment ids" in explained.forward.why


def test_float32_and_other_gpus_never_take_mosaic(monkeypatch):
    device = _h100(monkeypatch)
    single = dispatch.explain(_problem(dtype=jnp.float32), device=device)
    assert (single.forward.tier, single.backward.tier) == ("pallas", "pallas")
    ampere = dispatch.Device(nvidia_gpu=True, name="Simulated A100", compute_capability="8.0")
    explained = dispatch.explain(_problem(), device=ampere)
    assert (explained.forward.tier, explained.backward.tier) == ("pallas", "pallas")
    assert dict(explained.passed_over)["mosaic"].startswith("needs an sm90 GPU")
    old_jax = _h100(monkeypatch, jax_runs_mosaic=False)
    assert dispatch.explain(_problem(), device=old_jax).forward.tier == "pallas"


def test_explicit_mosaic_runs_both_directions_where_it_serves_them(monkeypatch):
    device = _h100(monkeypatch)
    explained = dispatch.explain(_problem(), "mosaic", device=device)
    assert (explained.forward.tier, explained.backward.tier) == ("mosaic", "mosaic")
    # A backward it cannot serve goes to the rules, and says why.
    halves = dispatch.explain(_problem(d=256), "mosaic", device=device)
    assert (halves.forward.tier, halves.backward.tier) == ("mosaic", "mosaic")
    wide = dispatch.explain(_problem(d=512), "mosaic", device=device)
    assert (wide.forward.tier, wide.backward.tier) == ("mosaic", "chunked")
    assert "head dims above 256 in the backward" in wide.backward.why
    with pytest.raises(ValueError, match="does not support bias"):
        dispatch.explain(_problem(d=128).__class__.of(
            sd((1, 64, 2, 64), jnp.bfloat16), sd((1, 64, 2, 64), jnp.bfloat16),
            sd((1, 64, 2, 64), jnp.bfloat16), sd((1, 2, 64, 64), jnp.float32)),
            "mosaic", device=device)


def test_keys_that_fit_one_tile_take_the_fused_backward(monkeypatch):
    """Up to 128 keys the fused kernels' backward forms δ from its own P and dP (a row of one
    key gets dq exactly 0, as XLA's); the Mosaic forward keeps the call's forward."""
    device = _h100(monkeypatch)
    short = Problem.of(sd((1, 203, 3, 111), jnp.bfloat16), sd((1, 1, 1, 111), jnp.bfloat16),
                       sd((1, 1, 1, 111), jnp.bfloat16))
    for implementation in (None, "mosaic"):
        explained = dispatch.explain(short, implementation, device=device)
        assert (explained.forward.tier, explained.backward.tier) == ("mosaic", "pallas")
    assert "key lengths up to 128" in dispatch.explain(short, "mosaic",
                                                       device=device).backward.why


def test_deterministic_passes_over_the_mosaic_backward(monkeypatch):
    """Its dQ is added by TMA reduce-adds in a varying order: `deterministic=True` takes the
    fused kernels' backward instead, named or not; the forward stays on the tier."""
    device = _h100(monkeypatch)
    for implementation in (None, "mosaic"):
        explained = dispatch.explain(_problem(), implementation, device=device,
                                     deterministic=True)
        assert (explained.forward.tier, explained.backward.tier) == ("mosaic", "pallas")
        assert explained.plan.deterministic
    assert "varying order" in dispatch.explain(_problem(), "mosaic", device=device,
                                               deterministic=True).backward.why
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    assert dispatch.explain(_problem(), device=device).backward.tier == "pallas"


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal on a machine without an sm90 GPU")
def test_explicit_mosaic_without_an_sm90_gpu_is_refused():
    q = jnp.ones((1, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="implementation='mosaic' needs an sm90 GPU"):
        ffpa_jax.attention(q, q, q, implementation="mosaic")
    # implementation=None never picks it here.
    assert dispatch.explain(_problem()).forward.tier != "mosaic"


@pytest.mark.gpu
def test_kernels_in_a_shard_map_over_two_gpus_match_each_gpu_alone():
    """The multi-GPU run behind `test_kernels_in_a_shard_map_are_the_single_device_kernels`:
    the batch split over 2 sm90 GPUs along a mesh axis named "b" gives each GPU's own
    single-device result, bitwise (before the kernels' axes had names of their own, rows 1
    and 2 of 4 came out wrong: docs/history.md, session 18)."""
    skip_unless_sm90(count=2)
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    mesh = jax.make_mesh((2,), ("b",), devices=gpus[:2],
                         axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec("b")
    keys = jax.random.split(jax.random.key(7), 3)
    q, k, v = (jax.random.normal(key, (4, 203, 8, 64), jnp.bfloat16) for key in keys)

    def local(q, k, v):
        return mosaic_attention_forward(q, k, v, scale=0.125, causal=True, config=None,
                                        out_dtype=jnp.float32)[0]
    split = jax.device_put((q, k, v), jax.sharding.NamedSharding(mesh, spec))
    got = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec))(*split)
    for i, device in enumerate(gpus[:2]):
        rows = slice(2 * i, 2 * i + 2)
        alone = jax.jit(local)(*(jax.device_put(x[rows], device) for x in (q, k, v)))
        assert bool(jnp.all(jax.device_get(got)[rows] == jax.device_get(alone))), i


def _assert_forward_matches(shape, arrays, features, out, lse):
    """The kernels' (out, lse) of `shape`'s arrays (q, k, v, bias, mask) by the tolerance
    rule against the float64 reference with `attention`'s feature arguments `features`."""
    at.assert_forward_matches(out, lse, at.reference64(shape, *arrays, features=features),
                              at.xla_same_precision(shape, *arrays, features=features),
                              shape.dtype)


def _assert_backward_matches(shape, arrays, features, saved, kernel_features):
    """The Mosaic backward's dq, dk, dv from the forward's `saved` (out, lse), with the
    kernels' `FeatureArrays`, by the gradients' tolerance rule (3x XLA's error)."""
    q, k, v = arrays[:3]
    d_out, d_lse = at.cotangents(shape)
    grads = mosaic_attention_backward(Inputs(q, k, v, features=kernel_features), saved,
                                      (d_out, d_lse), scale=at.scale_of(shape),
                                      causal=shape.causal, window=shape.window,
                                      softcap=shape.softcap)
    ref64 = at.reference_grads(shape, *arrays, d_out, d_lse, float64=True, features=features)
    xla = at.reference_grads(shape, *arrays, d_out, d_lse, float64=False, features=features)
    for name, got, want, same in zip(("dq", "dk", "dv"), grads, ref64, xla):
        at.assert_matches_reference(name, got, want, same, shape.dtype, factor=3.0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", FEATURE_CASES, ids=_feature_id)
def test_kernels_with_a_window_and_a_soft_cap_match_the_reference_gpu(case):
    """The kernels' window and soft cap by the tolerance rule against the float64 reference
    (out, lse, and dq, dk, dv where the backward takes the head dims), rows with no visible
    key included; the check that lets the tier serve them."""
    (b, t, s, hq, hkv, d, dv, causal, config), window, softcap = case
    skip_unless_sm90()
    shape = at.Case(b=b, t=t, s=s, hq=hq, hkv=hkv, d=d, dv=dv, causal=causal,
                    window=window, softcap=softcap)
    q, k, v, bias, mask = at.make_inputs(shape)
    features = at.make_features(shape)
    out, lse = mosaic_attention_forward(q, k, v, scale=at.scale_of(shape), causal=causal,
                                        config=config, out_dtype=jnp.float32, window=window,
                                        softcap=softcap)
    _assert_forward_matches(shape, (q, k, v, bias, mask), features, out, lse)
    if unsupported_head_dims(d, dv):
        return
    _assert_backward_matches(shape, (q, k, v, bias, mask), features, (out, lse),
                             FeatureArrays())


@pytest.mark.gpu
@pytest.mark.parametrize("case", LENGTH_CASES,
                         ids=lambda c: "B{}-T{}-S{}-D{}.{}-causal{}-window{}".format(
                             c[0], c[1], c[2], c[5], c[6], c[7], c[8]))
def test_kernels_with_sequence_lengths_match_the_reference_gpu(case):
    """The kernels' sequence lengths by the tolerance rule against the float64 reference:
    out and lse (padding rows 0 and -inf, a row of key length 0 too), and, at D <= 128, the
    backward's dq, dk, dv (padding gets zero gradient); the check that lets the tier serve
    query_seq_lengths and key_value_seq_lengths."""
    b, t, s, hq, hkv, d, dv, causal, window = case
    skip_unless_sm90()
    q_len, kv_len = _lengths(b, t, s)
    shape = at.Case(b=b, t=t, s=s, hq=hq, hkv=hkv, d=d, dv=dv, causal=causal, window=window,
                    q_lengths=tuple(int(x) for x in q_len),
                    kv_lengths=tuple(int(x) for x in kv_len))
    q, k, v, bias, mask = at.make_inputs(shape)
    features = at.make_features(shape)
    out, lse = mosaic_attention_forward(q, k, v, scale=at.scale_of(shape), causal=causal,
                                        out_dtype=jnp.float32, window=window,
                                        features=FeatureArrays(q_lengths=q_len,
                                                               kv_lengths=kv_len))
    _assert_forward_matches(shape, (q, k, v, bias, mask), features, out, lse)
    if unsupported_head_dims(d, dv):
        return
    _assert_backward_matches(shape, (q, k, v, bias, mask), features, (out, lse),
                             FeatureArrays(q_lengths=q_len, kv_lengths=kv_len))


SINK_CASES = [(2, 113, 203, 4, 2, 59, 40, True), (1, 256, 300, 2, 1, 256, 256, False),
              (1, 203, 300, 4, 2, 320, 111, True)]


def test_the_forward_with_sinks_lowers_for_cuda():
    b, t, s, hq, hkv, d, dv, causal = SINK_CASES[0]
    q, k, v = sd((b, t, hq, d), jnp.bfloat16), sd((b, s, hkv, d), jnp.bfloat16), sd(
        (b, s, hkv, dv), jnp.bfloat16)

    def forward(q, k, v, sinks):
        return mosaic_attention_forward(q, k, v, scale=d ** -0.5, causal=causal,
                                        features=FeatureArrays(sinks=sinks))
    out, lse = jax.eval_shape(forward, q, k, v, sd((hq,), jnp.float32))
    assert (out.shape, out.dtype, lse.shape) == ((b, t, hq, dv), jnp.bfloat16, (b, hq, t))
    text = jax.jit(forward).trace(q, k, v, sd((hq,), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("case", SINK_CASES, ids=lambda c: "T{}-S{}-D{}.{}-causal{}".format(
    c[1], c[2], c[5], c[6], c[7]))
def test_kernels_with_sinks_match_the_reference_gpu(case):
    """Sinks joined after the kernels (float32, then one rounding) by the tolerance rule
    against float64: out and lse, and at D <= 128 the backward's dq, dk, dv from the joined
    lse (the sinks' own gradient is the caller's closed form); the check that lets the tier
    serve sinks."""
    b, t, s, hq, hkv, d, dv, causal = case
    skip_unless_sm90()
    shape = at.Case(b=b, t=t, s=s, hq=hq, hkv=hkv, d=d, dv=dv, causal=causal, sinks=True)
    q, k, v, bias, mask = at.make_inputs(shape)
    features = at.make_features(shape)
    arrays = FeatureArrays(sinks=features["sinks"])
    out, lse = mosaic_attention_forward(q, k, v, scale=at.scale_of(shape), causal=causal,
                                        out_dtype=jnp.float32, features=arrays)
    _assert_forward_matches(shape, (q, k, v, bias, mask), features, out, lse)
    if unsupported_head_dims(d, dv):
        return
    _assert_backward_matches(shape, (q, k, v, bias, mask), features, (out, lse), arrays)


# Segment ids in the "rows" forward (D, Dv <= 256): (B, T, S, Hq, Hkv, D, Dv, causal,
# window, segments per row, sorted ids, config); unsorted ids make the block ranges a
# superset, a cluster of two query tiles shares one range.
SEGMENT_CASES = [
    (2, 203, 113, 4, 2, 59, 40, True, None, 3, True, None),
    (2, 300, 1000, 4, 4, 64, 64, False, (100, 37), 4, False, None),
    (1, 1023, 1023, 2, 1, 128, 128, True, None, 8, True, None),
    (1, 1000, 700, 2, 2, 256, 256, False, None, 2, True, None),
    (2, 600, 600, 4, 2, 128, 128, True, None, 5, True,
     Config(block_kv=128, num_stages=2, cluster=2, cluster_axis="q")),
]


def _segment_case(case):
    b, t, s, hq, hkv, d, dv, causal, window, segments, sorted_ids, config = case
    shape = at.Case(b=b, t=t, s=s, hq=hq, hkv=hkv, d=d, dv=dv, causal=causal, window=window,
                    segments=segments, sorted_ids=sorted_ids)
    return shape, config


def test_the_kernels_with_segment_ids_lower_for_cuda():
    for case in SEGMENT_CASES:
        shape, config = _segment_case(case)
        q, k, v = (sd(x.shape, jnp.bfloat16) for x in at.make_inputs(shape)[:3])
        ids = (sd((shape.b, shape.t), jnp.int32), sd((shape.b, shape.s), jnp.int32))

        def forward(q, k, v, q_ids, kv_ids, shape=shape, config=config):
            return mosaic_attention_forward(
                q, k, v, scale=at.scale_of(shape), causal=shape.causal, config=config,
                window=shape.window, features=FeatureArrays(q_ids, kv_ids))
        text = jax.jit(forward).trace(q, k, v, *ids).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
        if unsupported_head_dims(shape.d, shape.head_dim_v):
            continue
        out, lse = sd((shape.b, shape.t, shape.hq, shape.head_dim_v), jnp.float32), sd(
            (shape.b, shape.hq, shape.t), jnp.float32)

        def backward(q, k, v, q_ids, kv_ids, out, lse, shape=shape):
            return mosaic_attention_backward(
                Inputs(q, k, v, features=FeatureArrays(q_ids, kv_ids)), (out, lse), (out, lse),
                scale=at.scale_of(shape), causal=shape.causal, window=shape.window)
        text = jax.jit(backward).trace(q, k, v, *ids, out, lse).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("case", SEGMENT_CASES, ids=lambda c: "T{}-S{}-D{}-seg{}{}-c{}".format(
    c[1], c[2], c[5], c[9], "" if c[10] else "u", 0 if c[11] is None else c[11].cluster))
def test_the_kernels_with_segment_ids_match_the_reference_gpu(case):
    """Segment ids in the kernels by the tolerance rule against the float64 reference (out,
    lse; rows whose segment has no key give 0 and -inf), and at D <= 128 the backward's dq,
    dk, dv (keys no row sees get zero gradient); the check that lets the tier serve them."""
    skip_unless_sm90()
    shape, config = _segment_case(case)
    q, k, v, bias, mask = at.make_inputs(shape)
    features = at.make_features(shape)
    out, lse = mosaic_attention_forward(q, k, v, scale=at.scale_of(shape), causal=shape.causal,
                                        config=config, out_dtype=jnp.float32,
                                        window=shape.window,
                                        features=at.feature_arrays(features))
    _assert_forward_matches(shape, (q, k, v, bias, mask), features, out, lse)
    if unsupported_head_dims(shape.d, shape.head_dim_v):
        return
    _assert_backward_matches(shape, (q, k, v, bias, mask), features, (out, lse),
                             at.feature_arrays(features))


# The rows kernel's overlapped walk (`Config.overlap`) against its serial walk, with every
# feature the rows kernel takes: lengths (a row of no key), segment ids, sinks, windows with
# hidden rows, the soft cap, T = 1, Dv an odd number of 64s, GQA clusters (one tile per
# CTA), persistent and causal-by-levels launches.
OVERLAP_CASES = [
    at.Case(b=3, t=203, s=333, hq=4, hkv=2, d=256, causal=True, q_lengths=(0, 100, 203),
            kv_lengths=(5, 0, 333)),
    at.Case(b=2, t=257, s=257, hq=2, hkv=2, d=40, segments=3),
    at.Case(b=2, t=600, s=600, hq=4, hkv=2, d=128, causal=True, segments=5),
    at.Case(b=1, t=1, s=1023, hq=2, hkv=2, d=111),
    at.Case(b=2, t=300, s=1000, hq=4, hkv=2, d=128, window=(100, 37), softcap=30.0,
            sinks=True),
    at.Case(b=1, t=113, s=203, hq=4, hkv=1, d=64, dv=192, window=(17, 0), causal=True),
    at.Case(b=1, t=1023, s=1023, hq=4, hkv=4, d=64, causal=True),
]


def _overlap_call(case: at.Case, overlap: bool):
    """`mosaic_attention_forward` of `case` with the built-in config, the overlap on or off."""
    q, k, v, _, _ = at.make_inputs(case)
    features = at.make_features(case)
    config = default_config(case.d, case.head_dim_v, causal=case.causal,
                            gqa_group=case.hq // case.hkv, segments=bool(case.segments),
                            window=case.window, seq_q=case.t)
    assert not (config.persistent and config.cluster > 1)  # that walk is always serial
    config = dataclasses.replace(config, overlap=overlap)

    def forward(q, k, v, arrays):
        return mosaic_attention_forward(q, k, v, scale=at.scale_of(case), causal=case.causal,
                                        config=config, window=case.window,
                                        softcap=case.softcap, features=arrays)
    return forward, (q, k, v, at.feature_arrays(features))


@pytest.mark.parametrize("case", OVERLAP_CASES, ids=lambda c: f"T{c.t}-S{c.s}-D{c.d}")
def test_the_overlapped_walk_lowers_for_cuda_with_every_feature(case):
    forward, args = _overlap_call(case, overlap=True)
    text = jax.jit(forward).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.gpu
@pytest.mark.parametrize("case", OVERLAP_CASES, ids=lambda c: f"T{c.t}-S{c.s}-D{c.d}")
def test_the_overlapped_walk_equals_the_serial_one_gpu(case):
    """The overlap reorders when the wgmmas run, not the arithmetic: each block's P, its
    rescaling of O and the row sums are the serial walk's, in the same order, so out and
    lse are bitwise equal (rows with no visible key included)."""
    skip_unless_sm90()
    serial, args = _overlap_call(case, overlap=False)
    overlapped, _ = _overlap_call(case, overlap=True)
    want, got = jax.jit(serial)(*args), jax.jit(overlapped)(*args)
    for name, w, g in zip(("out", "lse"), want, got):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                      err_msg=name)


@pytest.mark.parametrize("hq,hkv,d,dv,causal", [
    (4, 4, 512, 512, True), (6, 2, 512, 512, False), (4, 2, 320, 111, True),
    (8, 1, 512, 512, True), (8, 2, 300, 300, False)])
def test_the_wide_kernels_default_lowers_for_every_gqa_group(hq, hkv, d, dv, causal):
    """The wide forward's default (3 ring slots of 64 columns, clusters of 2: of sibling
    heads where the group is even, else of query tiles) fits shared memory and its clusters'
    constraints for even, odd and single-head groups, odd T and S."""
    q = sd((2, 203, hq, d), jnp.bfloat16)
    k, v = sd((2, 113, hkv, d), jnp.bfloat16), sd((2, 113, hkv, dv), jnp.bfloat16)
    config = default_config(d, dv, gqa_group=hq // hkv)
    assert config.wide and config.cluster == 2
    assert config.cluster_axis == ("heads" if (hq // hkv) % 2 == 0 else "q")

    def f(q, k, v):
        return mosaic_attention_forward(q, k, v, scale=d ** -0.5, causal=causal,
                                        config=config)
    text = jax.jit(f).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def _without_locations(text: str) -> str:
    """A lowered module's text without its source locations (which differ between calls)."""
    return re.sub(r"loc\([^)]*\)", "", text)


@pytest.mark.parametrize("d,differs", [(512, True), (320, True), (128, False)])
def test_a_returned_lse_lowers_the_precise_wide_kernel(d, differs):
    """A call that returns lse lowers the wide forward with its scores summed over head-dim
    tiles in float32 (another kernel than the out-only call's, whose single accumulation
    chain gave lse up to 11x XLA's error at D = 512); the rows kernel stays as it is."""
    q, kv = sd((2, 113, 4, d), jnp.bfloat16), sd((2, 203, 2, d), jnp.bfloat16)

    def lowered(return_lse: bool) -> str:
        problem = Problem.of(q, kv, kv, causal=True, return_lse=return_lse)
        plan = dispatch.plan_for_tiers(problem, "mosaic", "mosaic")
        text = jax.jit(lambda q, k, v: mosaic_tier.forward(plan, Inputs(q, k, v))).trace(
            q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text
        return _without_locations(text)

    assert (lowered(True) != lowered(False)) == differs


def _lowered_forward(config: Config) -> str:
    """The CUDA lowering of a causal GQA forward at D = 256 with `config`, locations cut."""
    q, kv = sd((1, 512, 4, 256), jnp.bfloat16), sd((1, 512, 2, 256), jnp.bfloat16)

    def f(q, k, v):
        return mosaic_attention_forward(q, k, v, scale=0.0625, causal=True, config=config)
    text = jax.jit(f).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    return _without_locations(text)


def test_persistent_clusters_walk_serially_whatever_the_overlap_field():
    """The overlapped walk hung in persistent clusters (docs/history.md, session 40): there
    the kernel walks serially whatever `Config.overlap` says (the built-in config takes no
    clusters there). Without clusters the same field changes the lowered kernel, so this
    comparison tells the two walks apart."""
    base = dataclasses.replace(default_config(256, 256, causal=True, gqa_group=2, seq_q=512),
                               cluster=2, cluster_axis="heads", overlap=False)
    assert base.persistent
    assert _lowered_forward(dataclasses.replace(base, overlap=True)) == _lowered_forward(base)
    solo = dataclasses.replace(base, cluster=1)
    assert (_lowered_forward(dataclasses.replace(solo, overlap=True))
            != _lowered_forward(solo))


# A training step's forward and backward at the shapes of the Gemma-like model's layers and
# of the issue tables' GQA and causal rows, launched many times waited for and back to back
# in a child process: the overlapped walk in persistent clusters hung there within a few
# hundred launches (docs/history.md, sessions 40-41); a hang is a timeout, not a stuck
# suite. GQA at D = 64 keeps its persistent clusters (serial walk) in the built-in config.
_MANY_STEPS_CHILD = """
import sys
import jax, jax.numpy as jnp
import ffpa_jax
B, T, HQ, HKV, D, W = (int(x) for x in sys.argv[1:7])
window = None if W == 0 else (W - 1, 0)
ks = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(ks[0], (B, T, HQ, D), jnp.bfloat16)
k = jax.random.normal(ks[1], (B, T, HKV, D), jnp.bfloat16)
v = jax.random.normal(ks[2], (B, T, HKV, D), jnp.bfloat16)
g = jax.random.normal(ks[3], (B, T, HQ, D), jnp.bfloat16)
f = lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=True, local_window_size=window,
                                       implementation="mosaic")
step = jax.jit(lambda q, k, v: jax.vjp(f, q, k, v)[1](g)[0] * 0.01 + q)
for waited in (True, False):
    x = q
    for _ in range(400):
        x = step(x, k, v)
        if waited:
            x.block_until_ready()
    x.block_until_ready()
print("done", flush=True)
"""


def _child_process(script: str, *args: str, timeout: float, **env: str):
    """`script` run by this Python in a child process from the repository root, with the
    repository on its path and `env` added to this process's environment."""
    root = pathlib.Path(__file__).resolve().parents[1]
    path = [str(root), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), **env)
    return subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=root,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 8192, 8, 4, 256, 1024), (1, 8192, 8, 4, 256, 0),
                                   (1, 8192, 8, 8, 256, 0), (1, 8192, 8, 4, 128, 0),
                                   (1, 8192, 8, 4, 64, 0)],
                         ids=lambda s: "B{}-T{}-H{}.{}-D{}-window{}".format(*s))
def test_many_training_steps_in_a_row_finish_gpu(shape):
    skip_unless_sm90()
    try:
        proc = _child_process(_MANY_STEPS_CHILD, *map(str, shape), timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail(f"800 forward+backward launches at {shape} did not finish in 240 s")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "done" in proc.stdout


_WIDE_PTXAS_CHILD = """
import jax, jax.numpy as jnp
from pallas_kernels.mosaic import mosaic_attention_forward
q = jnp.ones((1, 256, 4, 512), jnp.bfloat16)
out, _ = mosaic_attention_forward(q, q, q, scale=0.05, causal=False)
out.block_until_ready()
"""


@pytest.mark.gpu
def test_the_wide_forward_keeps_its_values_in_registers_gpu():
    """ptxas' report on the wide forward (D = 512, unmasked): no register spills. Its Q
    descriptors, hoisted out of the key loop, once took registers the consumers did not
    have (docs/history.md, session 34). The kernel is compiled in a child process with
    Mosaic GPU's ptxas report on."""
    skip_unless_sm90()
    proc = _child_process(_WIDE_PTXAS_CHILD, timeout=300, MOSAIC_GPU_DUMP_PTXAS="1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = proc.stdout + proc.stderr
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", report)]
    assert spills, f"no ptxas report in the child's output:\n{report[-2000:]}"
    assert max(spills) == 0, f"register spills: {spills}"


# Key and query masks shared by the heads reach the Mosaic kernels as segment ids.
MASKS_AS_SEGMENTS = [(2, 1, 1, 203), (1, 1, 1, 203), (2, 1, 113, 1), (1, 1, 1, 1)]


@pytest.mark.parametrize("mask_shape", MASKS_AS_SEGMENTS, ids=str)
def test_a_key_or_query_mask_is_the_segment_ids_made_of_it(mask_shape):
    """`visibility.segments_of_mask` hides exactly what the mask hides: the dense path with
    the ids equals it with the mask, fully hidden rows included (out 0 in both)."""
    keys = jax.random.split(jax.random.key(7), 4)
    q = jax.random.normal(keys[0], (2, 113, 4, 40), jnp.float32)
    k = jax.random.normal(keys[1], (2, 203, 2, 40), jnp.float32)
    v = jax.random.normal(keys[2], (2, 203, 2, 40), jnp.float32)
    mask = jax.random.bernoulli(keys[3], 0.6, mask_shape)
    if mask_shape[2] > 1:
        mask = mask.at[0, 0, 5].set(False)  # a row that sees nothing
    assert visibility.mask_is_segments(mask_shape)
    q_ids, kv_ids = visibility.segments_of_mask(mask, 2, 113, 203)
    by_mask = ffpa_jax.attention(q, k, v, mask=mask, is_causal=True, implementation="xla")
    by_ids = ffpa_jax.attention(q, k, v, is_causal=True, q_segment_ids=q_ids,
                                kv_segment_ids=kv_ids, implementation="xla")
    np.testing.assert_allclose(by_ids, by_mask, rtol=1e-6, atol=1e-6)
    if mask_shape[2] > 1:
        assert not np.any(np.asarray(by_ids[0, 5]))


@pytest.mark.parametrize("mask_shape,served", [
    ((2, 1, 1, 203), True), ((2, 1, 113, 1), True), ((1, 1, 1, 1), True),
    ((2, 4, 1, 203), False), ((2, 1, 113, 203), False)])
def test_the_tier_takes_the_masks_segment_ids_can_say(mask_shape, served, monkeypatch):
    """Named, the tier serves a key or query mask shared by the heads (not with segment ids
    given too, nor in the wide forward); by the rules such a mask goes to it (measured
    faster than the Triton kernels' masks) and any other mask to the Triton kernels."""
    device = _h100(monkeypatch)
    q, kv = sd((2, 113, 4, 128), jnp.bfloat16), sd((2, 203, 2, 128), jnp.bfloat16)
    problem = Problem.of(q, kv, kv, mask=sd(mask_shape, jnp.bool_))
    assert bool(visibility.mask_is_segments(problem.mask_shape)) == served
    if served:
        named = dispatch.explain(problem, "mosaic", device=device)
        assert (named.forward.tier, named.backward.tier) == ("mosaic", "mosaic")
        assert named.plan.config("mosaic_fwd") == default_config(128, 128, gqa_group=2,
                                                                 segments=True)
    else:
        with pytest.raises(ValueError, match="mask other than a key or query mask"):
            dispatch.explain(problem, "mosaic", device=device)
    ruled = dispatch.explain(problem, device=device)
    expected = "mosaic" if served else "pallas"
    assert (ruled.forward.tier, ruled.backward.tier) == (expected, expected)
    assert ("take it as segment ids" if served else "a mask the Mosaic tier does not take"
            ) in ruled.forward.why
    ids = sd((2, 113), jnp.int32), sd((2, 203), jnp.int32)
    both = Problem.of(q, kv, kv, mask=sd((2, 1, 1, 203), jnp.bool_),
                      features=FeatureArrays(*ids))
    assert "mask with q_segment_ids" in " ".join(mosaic_tier.unsupported(both, "forward"))
    assert dispatch.explain(both, device=device).forward.tier != "mosaic"
    decode = Problem.of(sd((2, 1, 4, 128), jnp.bfloat16), sd((2, 4096, 2, 128), jnp.bfloat16),
                        sd((2, 4096, 2, 128), jnp.bfloat16), mask=sd((2, 1, 1, 4096), jnp.bool_))
    assert dispatch.explain(decode, device=device).forward.tier == "pallas"
    wide = Problem.of(sd((2, 113, 4, 512), jnp.bfloat16), sd((2, 203, 2, 512), jnp.bfloat16),
                      sd((2, 203, 2, 512), jnp.bfloat16), mask=sd((2, 1, 1, 203), jnp.bool_))
    assert "mask with head dims above 256" in mosaic_tier.unsupported(wide, "forward")
    assert dispatch.explain(wide, device=device).forward.tier != "mosaic"


@pytest.mark.parametrize("mask_shape", MASKS_AS_SEGMENTS[:3], ids=str)
def test_the_tier_with_a_mask_lowers_for_cuda(mask_shape, monkeypatch):
    """The tier's forward and backward with a key or query mask lower for CUDA with the
    kernels' segment ids (shared memory checked while lowering)."""
    q, kv = sd((2, 113, 4, 64), jnp.bfloat16), sd((2, 203, 2, 64), jnp.bfloat16)
    mask = sd(mask_shape, jnp.bool_)
    problem = Problem.of(q, kv, kv, mask=mask, causal=True)
    plan = dispatch.plan_for_tiers(problem, "mosaic", "mosaic")

    def forward(q, k, v, mask):
        return mosaic_tier.forward(plan, Inputs(q, k, v, mask=mask))

    def backward(q, k, v, mask, out, lse, d_out):
        return mosaic_tier.backward(plan, Inputs(q, k, v, mask=mask), Saved(out, lse),
                                    Cotangents(d_out, None))
    text = jax.jit(forward).trace(q, kv, kv, mask).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    out, lse = sd((2, 113, 4, 64), jnp.float32), sd((2, 4, 113), jnp.float32)
    text = jax.jit(backward).trace(q, kv, kv, mask, out, lse, q).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("d,options", [
    (128, dict(causal=True)), (128, dict(window=(100, 30), softcap=30.0)),
    (64, dict(causal=True, features=FeatureArrays(kv_lengths=sd((2,), jnp.int32)))),
    (256, dict(causal=True)), (512, dict(causal=True))])
def test_a_block_of_a_longer_sequence_runs_on_mosaic(d, options, monkeypatch):
    """Context parallelism's blocks (`Problem.positions`): the kernels walk and mask by the
    positions' runtime shift, so the dispatcher picks the tier for them as for any problem
    (by its rules: the chunked tier above D = 256), and both directions lower for CUDA with
    the positions as one more kernel input (the backward where it takes the head dims)."""
    device = _h100(monkeypatch)
    problem = dataclasses.replace(_problem(d=d, **options), positions=True, return_lse=True)
    wide = d > 256
    assert mosaic_tier.unsupported(problem, "forward") == ()
    ruled = dispatch.explain(problem, device=device)
    assert ruled.forward.tier == ("chunked" if wide else "mosaic")
    # One tile of keys still runs the backward on mosaic: a block's δ is the whole rows'.
    assert mosaic_tier.unsupported(dataclasses.replace(problem, seq_k=64), "backward") == (
        mosaic_tier.unsupported(problem, "backward"))
    q, kv = sd((2, 512, 8, d), jnp.bfloat16), sd((2, 512, 2, d), jnp.bfloat16)
    positions = sd((3,), jnp.int32)
    lengths = sd((2,), jnp.int32) if "features" in options else None

    def inputs(q, k, v, positions, lengths):
        return Inputs(q, k, v, features=FeatureArrays(kv_lengths=lengths, positions=positions))
    plan = dataclasses.replace(dispatch.plan_for_tiers(
        problem, "mosaic", "chunked" if wide else "mosaic"), float32_out=True)

    def forward(*args):
        return tiers.forward(plan, inputs(*args))

    def backward(q, k, v, positions, lengths, out, lse, d_out):
        return tiers.backward(plan, inputs(q, k, v, positions, lengths), Saved(out, lse),
                              Cotangents(d_out, lse))
    args = (q, kv, kv, positions, lengths)
    text = jax.jit(forward).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    if wide:
        return
    out, lse = sd((2, 512, 8, d), jnp.float32), sd((2, 8, 512), jnp.float32)
    text = jax.jit(backward).trace(*args, out, lse, q).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_a_walk_takes_a_blocks_runtime_shift():
    """`Walk.with_positions`: causality and the window take the positions' shift (row 0 of
    a block sits at key `shift`), the walk's key blocks with it; without positions S - T."""
    walk = Walk(T=256, S=512, causal=True, block_kv=128)
    assert walk.shift == 256
    placed = walk.with_positions(jnp.asarray([512, 0, 512 - 0 + 0], jnp.int32))
    assert int(placed.shift) == 512
    lo, mask_lo, full_hi, hi = kv_walk(placed, 0, 63)
    assert (int(lo), int(full_hi), int(hi)) == (0, 4, 4)  # every key seen, none masked
    early = walk.with_positions(jnp.asarray([0, 256, -256], jnp.int32))
    lo, mask_lo, full_hi, hi = kv_walk(early, 0, 63)
    assert (int(lo), int(full_hi), int(hi)) == (0, 0, 0)  # rows before every key see none
    lo, mask_lo, full_hi, hi = kv_walk(early, 256, 319)
    assert (int(full_hi), int(hi)) == (0, 1)  # the diagonal's block, masked


def test_a_persistent_launch_is_refused_where_it_has_no_walk_and_skipped_where_no_room():
    """`Config(persistent=True)`: the rows kernel only, without clusters along the query
    tiles (refused, naming the knob); where separate Q and O tiles do not fit shared memory
    beside the ring, the kernel launches one CTA per tile, lowering exactly as without it."""
    with pytest.raises(ValueError, match="persistent"):
        Config(persistent=True, cluster=2, cluster_axis="q")
    with pytest.raises(ValueError, match="persistent"):
        Config(persistent=True, wide=True)
    q, kv = sd((1, 64, 2, 512), jnp.bfloat16), sd((1, 64, 2, 512), jnp.bfloat16)
    with pytest.raises(ValueError, match="the rows kernel only"):
        jax.eval_shape(functools.partial(mosaic_attention_forward, scale=0.1, causal=False,
                                         config=Config(block_kv=128, persistent=True)),
                       q, kv, kv)
    q, kv = sd((1, 300, 2, 128), jnp.bfloat16), sd((1, 300, 2, 128), jnp.bfloat16)

    def lowered(persistent):  # a ring of 3 x 128 keys leaves no room for O beside Q
        f = functools.partial(mosaic_attention_forward, scale=0.1, causal=False,
                              config=Config(block_kv=128, num_stages=3, persistent=persistent))
        return jax.jit(f).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert lowered(True) == lowered(False)


def _persistent_walks(grid):
    """Run `Grid.tiles` of a persistent launch for every CTA (vmapped over the launch's and
    the cluster's axes, as the kernel's axis indices): [CTA, round, (tile, head, batch)] of
    the tiles visited, -1 past a CTA's last, and whether every `following` named the next
    visit."""
    from pallas_kernels.mosaic.common import CLUSTER, PERSISTENT
    most = -(-grid.units // grid.clusters)

    def cta():
        def body(indices, carry, following):
            seen, i, expected, agrees = carry
            t, h, b = indices[:3]
            here = jnp.stack([t, h, b])
            agrees &= jnp.all(expected == here) | (i == 0)
            has_next, after = following
            expected = jnp.where(has_next, jnp.stack(after[:3]), -1)
            return seen.at[i].set(here), i + 1, expected, agrees
        init = (jnp.full((most, 3), -1, jnp.int32), jnp.int32(0), jnp.full((3,), -1, jnp.int32),
                jnp.bool_(True))
        seen, count, last_following, agrees = grid.tiles(body, init)
        return seen, agrees & jnp.all(last_following == -1)

    if grid.ncl > 1:
        cta = jax.vmap(cta, axis_name=CLUSTER, axis_size=grid.ncl)
    seen, agrees = jax.vmap(cta, axis_name=PERSISTENT, axis_size=grid.clusters)()
    return np.asarray(seen).reshape(-1, most, 3), bool(np.all(agrees))


@pytest.mark.parametrize("levels", [0, 1, 2, 3])
@pytest.mark.parametrize("n_q,Hq,B,ncl,clusters", [
    (3, 8, 2, 2, 7),    # 24 units: 3 rounds of 7 and 3 (an odd last round, mirrored)
    (5, 4, 3, 1, 8),    # 60 units: 7 rounds of 8 and 4
    (4, 6, 1, 1, 12),   # 24 units: 2 whole rounds
    (2, 2, 1, 1, 9),    # fewer units than CTAs
])
def test_a_persistent_launch_walks_every_tile_once(levels, n_q, Hq, B, ncl, clusters):
    """`Grid.tiles` of a persistent launch, run for every CTA: every (query tile, head,
    batch) exactly once, each CTA's `following` the tile it takes next, in both unit
    orders (query tile fastest; by levels of 1-3 tiles, the last group shorter where they
    do not divide the tiles, rounds mirrored)."""
    from pallas_kernels.mosaic.common import Grid
    grid = Grid(n_q=n_q, Hq=Hq, B=B, group=2 * ncl, ncl=ncl, cluster_axis="heads",
                grid_order="heads", reverse=True, clusters=clusters, levels=levels)
    seen, agrees = _persistent_walks(grid)
    visits = [tuple(v) for cta in seen for v in cta if v[0] >= 0]
    assert sorted(visits) == sorted((t, h, b) for t in range(n_q) for h in range(Hq)
                                    for b in range(B))
    assert agrees


@pytest.mark.parametrize("n_q,Hq,B,ncl", [
    (32, 32, 4, 1),  # causal D = 128, B = 4, H = 32, N = 4096 (one CTA per SM)
    (32, 32, 1, 1),  # causal D = 256, B = 1
    (64, 32, 1, 2),  # causal GQA 32/8, N = 8192 (clusters of two heads)
    (16, 32, 4, 1),  # causal D = 128, N = 2048
])
def test_persistent_levels_balance_causal_tiles(n_q, Hq, B, ncl):
    """Causal tiles differ in work (tile t of T = S walks t + 1 key blocks). The persistent
    launch of unbalanced tiles (`Grid.of(..., balanced=False)`, 132 multiprocessors) takes
    them by levels: each CTA's total within 4% of the mean, and a round's CTAs take 4 or
    more tiles of each head they touch on average (they share its K/V in L2). Taken query
    tile fastest in turn, the busiest CTA of the GQA launch walks 1.5x the mean (why session
    26 kept causal launches off the persistent kernel: docs/history.md)."""
    from pallas_kernels.mosaic.common import Grid

    def walk(balanced):
        config = Config(cluster=ncl, cluster_axis="heads") if ncl > 1 else Config()
        grid = Grid.of(config, n_q=n_q, Hq=Hq, B=B, group=2 * ncl, causal=True,
                       persistent=True, balanced=balanced)
        seen, _ = _persistent_walks(grid)
        work = np.where(seen[..., 0] >= 0, seen[..., 0] + 1, 0).sum(axis=1)
        sharing = [len(heads) / len(set(heads)) for heads in (
            [(h // ncl, b) for t, h, b in seen[:, i] if t >= 0] for i in range(seen.shape[1]))
            if heads]
        return work.max() / work.mean(), np.mean(sharing)

    busiest, sharing = walk(balanced=False)
    assert busiest <= 1.04
    assert sharing >= 4
    if (n_q, ncl) == (64, 2):
        assert walk(balanced=True)[0] >= 1.5


PERSISTENT_CASES = [  # (B, T, S, Hq, Hkv, D, causal, features): more tiles than CTAs
    (2, 4096, 4096, 8, 2, 128, False, ()),
    (3, 2000, 3001, 8, 8, 64, False, ("lengths",)),
    (2, 3000, 2900, 8, 4, 128, False, ("segments", "lengths")),
    (2, 2048, 1500, 8, 4, 256, True, ("lengths",)),
    (1, 4096, 4096, 8, 4, 256, True, ("window",)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PERSISTENT_CASES, ids=str)
def test_a_persistent_launch_equals_one_tile_per_cta_gpu(case):
    """A persistent launch computes each tile exactly as a CTA of its own does: out and lse
    bitwise equal to the one-tile-per-CTA launch of the same config, with clusters along
    heads (GQA), segment ids and key lengths, where every CTA walks several tiles."""
    b, t, s, hq, hkv, d, causal, extra = case
    skip_unless_sm90()
    shape = at.Case(b=b, t=t, s=s, hq=hq, hkv=hkv, d=d, dv=d, causal=causal,
                    segments=3 if "segments" in extra else 0, sorted_ids=True,
                    kv_lengths=(s // 3, s, s - 7)[:b] if "lengths" in extra else None,
                    window=(1023, 0) if "window" in extra else None)
    q, k, v, _, _ = at.make_inputs(shape)
    features = at.feature_arrays(at.make_features(shape))
    base = default_config(d, gqa_group=hq // hkv, segments=shape.segments > 0)
    results = [mosaic_attention_forward(q, k, v, scale=d ** -0.5, causal=causal,
                                        features=features, window=shape.window,
                                        config=dataclasses.replace(base, persistent=p))
               for p in (False, True)]
    for one, persistent in zip(*results):
        np.testing.assert_array_equal(np.asarray(persistent), np.asarray(one))


@pytest.mark.parametrize("d,causal,window,seq_q,segments,persistent", [
    (64, False, None, 4096, False, True), (128, False, None, 4096, False, True),
    (256, False, None, 4096, False, True), (128, False, (100, 37), 300, False, True),
    (128, True, None, 4096, False, False), (256, True, (1023, 0), 8192, False, True),
    (128, True, (1023, 0), 2048, False, False), (128, True, (511, 0), 2048, False, True),
    (64, True, None, 4096, False, True), (256, True, None, 4096, False, True),
    (256, True, (1023, 0), 2048, False, True), (128, False, None, 4096, True, False),
    (512, False, None, 4096, False, False)])
def test_the_default_launch_is_persistent_where_it_measured_faster(
        d, causal, window, seq_q, segments, persistent):
    """The built-in config walks tiles persistently where each query tile walks about as many
    key blocks (no causality, or a window reaching at most a quarter of the queries; session
    26's measurements), and under causality alone at head dims up to 64 and from 129 to 256
    (by levels, session 27), not at 65-128 causal, with segment ids, or at D = 512 (the wide
    kernel)."""
    config = default_config(d, causal=causal, window=window, seq_q=seq_q, segments=segments)
    assert config.persistent is persistent
