"""The chunked tier's own machinery: its block rules, its workspace bound, the Pallas steps
between its GEMMs against their XLA twins, and how `implementation=None` picks a tier per
direction. Its semantics are checked by the shared matrix (test_forward, test_backward,
test_dropout, test_fuzz: the `tier` fixture)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
import tuning
from attn_testing import (Case, assert_forward_matches, assert_matches_reference, cotangents,
                          make_inputs, reference_vjp)
from pallas_kernels import blocked
from pallas_kernels import chunked as chunked_tier
from pallas_kernels import chunked_grad, chunked_plan
from pallas_kernels.blocked import GradBlock
from pallas_kernels.chunked import Block
from pallas_kernels.chunked_plan import block_sizes, bytes_per_element, groups
from pallas_kernels.dropout import keep_mask_reference
from pallas_kernels.problem import FeatureArrays, Inputs, Problem
from tuning import dispatch

sd = jax.ShapeDtypeStruct


def _problem(b=1, t=4096, s=4096, hq=32, hkv=32, d=512, dtype=jnp.bfloat16, causal=False):
    return Problem(batch=b, seq_q=t, seq_k=s, heads_q=hq, heads_kv=hkv, head_dim=d,
                   head_dim_v=d, dtype=dtype, scale=d ** -0.5, causal=causal)


PROBLEMS = [_problem(), _problem(t=16384, s=16384), _problem(t=32768, s=32768, hq=8, hkv=8),
            _problem(t=8192, s=8192, hkv=8), _problem(b=4, hq=32, hkv=8, d=128),
            _problem(t=1, s=1 << 20), _problem(t=1000, s=3, hq=4, hkv=4),
            _problem(t=37, s=70, hq=4, hkv=2, dtype=jnp.float32)]


@pytest.mark.parametrize("problem", PROBLEMS, ids=lambda p: f"T{p.seq_q}-S{p.seq_k}-H{p.heads_q}")
@pytest.mark.parametrize("direction", ["forward", "backward"])
@pytest.mark.parametrize("budget", [4 << 30, 1 << 20])
def test_blocks_fit_the_budget(problem, direction, budget):
    rows, keys = block_sizes(problem, direction, budget, max_keys=16384)
    per_element = problem.batch * problem.heads_q * bytes_per_element(problem.dtype, direction)
    assert 1 <= rows <= problem.seq_q and 1 <= keys <= problem.seq_k
    if rows > 16 or keys > 128:  # the smallest block the rule takes
        assert rows * keys * per_element <= budget
    if keys < problem.seq_k:
        assert keys & (keys - 1) == 0, "key blocks start at multiples of a power of two"
    if direction == "forward" and problem.seq_k <= 16384 and budget == 4 << 30:
        assert keys == problem.seq_k, "the forward merges no key blocks when it can help it"
    count = -(-problem.seq_q // rows)
    assert rows * (count - 1) < problem.seq_q, "the fewest blocks of that size"


@pytest.mark.parametrize("t,s", [(113, 203), (203, 113), (1, 113), (113, 1), (4096, 4096),
                                 (1000, 3000), (3000, 1000)])
@pytest.mark.parametrize("block_q", [1, 16, 100, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_groups_cover_every_row_that_sees_a_key(t, s, block_q, causal):
    planned = groups(_problem(t=t, s=s, causal=causal), block_q)
    covered = np.zeros(t, int)
    for g in planned:
        for start in g.starts:
            covered[start:start + g.rows] += 1
            last = start + g.rows - 1
            need = s if not causal else min(s, last + 1 + s - t)
            assert g.keys >= need, "a block sees fewer keys than its rows need"
    sees_a_key = np.array([not causal or i + s - t >= 0 for i in range(t)])
    assert covered.max() <= 1, "a row in two blocks"
    assert covered[sees_a_key].min(initial=1) == 1, "a row that sees a key in no block"
    # Rows left out see no key; a block may hold some such rows beside rows that do.
    first_seeing = int(np.argmax(sees_a_key)) if sees_a_key.any() else t
    assert not covered[:max(0, first_seeing - block_q)].any(), "a block of keyless rows ran"
    if causal:
        assert len(planned) <= 2 * chunked_plan.MAX_CAUSAL_GROUPS


@pytest.mark.parametrize("t,s", [(113, 203), (256, 128), (203, 113)])
@pytest.mark.parametrize("shift", [-150, -64, 0, 37])
@pytest.mark.parametrize("window", [None, (20, 0)])
def test_groups_of_a_block_with_a_known_shift_skip_what_it_hides(t, s, shift, window):
    """A block of a longer sequence whose shift is known at trace time
    (`Problem.positions_shift`) is planned by it: every key a row sees is in its block's
    keys (brute force over the element rule), no block of rows that see nothing runs, and
    causal blocks hold fewer (row, key) pairs than the runtime-shift plan's every row
    against every key."""
    block_q = 32
    problem = dataclasses.replace(_problem(t=t, s=s, causal=True), positions=True,
                                  positions_shift=shift, window=window)
    rows, cols = np.arange(t)[:, None], np.arange(s)[None, :]
    sees = cols <= rows + shift
    if window is not None:
        sees &= cols >= rows + shift - window[0]
    planned = groups(problem, block_q)
    area = 0
    covered = np.zeros((t, s), bool)
    for g in planned:
        for start in g.starts:
            first = chunked_plan.key_start(problem, g, start)
            covered[start:start + g.rows, first:first + g.keys] = True
            area += g.rows * g.keys
            assert sees[start:start + g.rows].any(), "a block of rows that see nothing ran"
    assert not (sees & ~covered).any(), "a key a row sees is outside its block"
    runtime = groups(dataclasses.replace(problem, positions_shift=None), block_q)
    runtime_area = sum(g.rows * g.count * g.keys for g in runtime)
    # (Under a window both plans read each row block's band: the known shift drops the
    # blocks that see nothing.)
    assert area < runtime_area if window is None else area <= runtime_area


@pytest.mark.parametrize("t,s,causal,window,segments,rate,expected", [
    # causal: the bands whose rows see keys from 0 only
    (1024, 1024, True, None, False, 0.0, (128, 256, [0, 128], [0, 0])),
    (300, 200, True, None, False, 0.0, (128, 200, [0, 128, 172], [0, 0, 0])),  # S < 256
    (1000, 1000, True, None, False, 0.2, (128, 296, [0, 128], [0, 0])),  # dropout's 32
    (100, 100, True, None, False, 0.0, (100, 100, [0], [0])),
    # a narrow window: every band
    (512, 512, True, (32, 0), False, 0.0, (128, 256, [0, 128, 256, 384], [0, 0, 128, 256])),
    (512, 512, False, (64, 64), False, 0.0, (128, 256, [0, 128, 256, 384], [0, 64, 192, 256])),
    # segment ids decide at run time: every band (centred without causality)
    (512, 512, False, None, True, 0.0, (128, 256, [0, 128, 256, 384], [0, 64, 192, 256])),
    (1000, 1000, True, None, True, 0.2, (128, 296, [0, 128, 256, 384, 512, 640, 768, 872],
                                         [0, 0, 64, 192, 320, 448, 576, 704])),
    (512, 512, False, None, False, 0.0, None),  # every row sees every key
    (1024, 1024, False, (300, 300), False, 0.0, None),  # no row's keys fit 256
])
def test_few_key_bands(t, s, causal, window, segments, rate, expected):
    """`few_key_bands`: bands of 128 rows (the last one moved back to end at T) against
    about twice as many keys, ending at the keys their last row can see (centred on their
    diagonal without a right limit), inside [0, S), with dropout starting at its draw's
    multiple of 32; where causality and the window alone decide, only bands with a row
    whose keys all lie in them (brute force over the element rule); none where the shift
    is known only at run time."""
    problem = dataclasses.replace(_problem(t=t, s=s, hq=2, hkv=2, d=64, causal=causal),
                                  window=window, dropout_rate=rate, segment_ids=segments)
    got = chunked_plan.few_key_bands(problem)
    assert got == expected
    if got is None:
        return
    rows, keys, row_starts, key_starts = got
    assert all(0 <= c0 <= s - keys for c0 in key_starts)
    if segments:
        assert row_starts[-1] + rows == t
    else:
        r, c = np.arange(t)[:, None], np.arange(s)[None, :]
        sees = c <= r + s - t if causal else np.ones((t, s), bool)
        if window is not None:
            sees &= (c >= r + s - t - window[0]) & (c <= r + s - t + window[1])
        for r0, c0 in zip(row_starts, key_starts, strict=True):
            band = sees[r0:r0 + rows]
            inside = band[:, c0:c0 + keys].sum(1) == band.sum(1)
            assert (inside & band.any(1)).any(), "a band where no row gains"
    runtime = dataclasses.replace(problem, positions=True, positions_shift=None)
    assert chunked_plan.few_key_bands(runtime) is None


@pytest.mark.parametrize("window", [None, (30, 0)])
def test_a_block_with_a_known_shift_computes_as_with_a_runtime_one(window, monkeypatch):
    """The chunked tier on a causal block of a longer sequence, in several row and key
    blocks: with its shift known at trace time (planned by it) and as runtime data only,
    out, lse and the gradients agree with each other and with the dense tier's (float32)."""
    monkeypatch.setenv(chunked_plan.BUDGET_ENV, "0.002")
    from pallas_kernels import tiers
    from pallas_kernels.problem import Cotangents, Saved
    rng = np.random.default_rng(11)
    t, s, shift = 96, 160, -24
    q, k, v = (jnp.asarray(rng.standard_normal(shape, np.float32))
               for shape in ((1, t, 2, 16), (1, s, 1, 16), (1, s, 1, 16)))
    d_out = jnp.asarray(rng.standard_normal((1, t, 2, 16), np.float32))
    inputs = Inputs(q, k, v, features=FeatureArrays(
        positions=jnp.asarray([200, 200 - shift, shift], jnp.int32)))
    problem = Problem(batch=1, seq_q=t, seq_k=s, heads_q=2, heads_kv=1, head_dim=16,
                      head_dim_v=16, dtype=jnp.float32, scale=0.25, causal=True,
                      window=window, positions=True, return_lse=True)
    results = []
    for tier, known in (("xla", None), ("chunked", None), ("chunked", shift)):
        plan = dataclasses.replace(
            tuning.plan_for_tiers(dataclasses.replace(problem, positions_shift=known),
                                  tier, tier), float32_out=True)
        out, lse, *_ = tiers.forward(plan, inputs)
        saved = Saved(out, lse, jnp.zeros_like(lse))
        grads = (tiers.backward(plan, inputs, saved, Cotangents(d_out, jnp.zeros_like(lse)))
                 if tier == "chunked" else None)
        results.append((out, lse, grads))
    (want_out, want_lse, _), runtime, known = results
    assert np.isneginf(np.asarray(want_lse)).any(), "no row that sees nothing: a weak case"
    for out, lse, _ in (runtime, known):
        np.testing.assert_allclose(out, want_out, atol=1e-5)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
        finite = np.isfinite(np.asarray(want_lse))
        np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite],
                                   rtol=1e-5)
    for got, want in zip(known[2][:3], runtime[2][:3], strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert np.abs(np.asarray(want)).max() > 0.1


@pytest.mark.slow
def test_workspace_stays_under_the_budget_at_16k():
    """XLA's memory analysis of the chunked tier at T = S = 16384, D = 512, H = 32 (compiled
    for the CPU: its plain-XLA step): the temporaries stay under the default budget plus
    twice the float32 size of q, k, v, out (and dO), where the dense path's logits alone
    take 32 GiB."""
    n, h, d = 16384, 32, 512
    arg = sd((1, n, h, d), jnp.bfloat16)
    f32_bytes = n * h * d * 4
    attn = lambda q, k, v: ffpa_jax.attention(q, k, v, implementation="chunked")

    def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, *vjp(do)

    dense_logits = h * n * n * 4
    for fn, args, arrays in ((attn, (arg,) * 3, 4), (fwd_bwd, (arg,) * 4, 5)):
        memory = jax.jit(fn).trace(*args).lower().compile().memory_analysis()
        temp = memory.temp_size_in_bytes
        assert temp <= chunked_plan.DEFAULT_BUDGET_BYTES + 2 * arrays * f32_bytes, temp / 2**30
        assert temp < dense_logits / 2


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_workspace_stays_under_the_budget_at_16k_gpu(causal, monkeypatch):
    """The same call compiled for the GPU (its Pallas step, the key blocks unrolled where
    their float32 parts fit the budget): the temporaries stay under the blocks' budget, the
    unrolled parts' budget and the float32 dQ, dK, dV and out. Unrolled regardless of the
    budget, the causal call held 12.6 GiB of temporaries against this bound's 12."""
    monkeypatch.delenv(chunked_plan.BUDGET_ENV, raising=False)
    n, h, d = 16384, 32, 512
    arg = sd((1, n, h, d), jnp.bfloat16)

    def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(lambda q, k, v: ffpa_jax.attention(
            q, k, v, is_causal=causal, implementation="chunked"), q, k, v)
        return out, *vjp(do)

    memory = jax.jit(fwd_bwd).trace(*(arg,) * 4).lower().compile().memory_analysis()
    bound = 2 * chunked_plan.DEFAULT_BUDGET_BYTES + 4 * n * h * d * 4
    assert memory.temp_size_in_bytes <= bound, memory.temp_size_in_bytes / 2**30


def test_budget_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(chunked_plan.BUDGET_ENV, "256")
    assert chunked_plan.budget_from_env() == 256 << 20
    for bad in ("", "lots", "-3", "0", "nan"):
        monkeypatch.setenv(chunked_plan.BUDGET_ENV, bad)
        assert chunked_plan.budget_from_env() == chunked_plan.DEFAULT_BUDGET_BYTES


# ---------------------------------------------------------------- the Pallas steps

STEP_CASES = [  # (B, Hq, rows, keys, offsets, causal, bias shape, mask shape, dropout)
    (2, 4, 37, 70, (13, 64), True, (1, 4, 90, 200), (2, 1, 90, 1), 0.2),
    (1, 2, 64, 128, (0, 0), False, None, None, 0.0),
    (2, 3, 20, 33, (70, 160), True, (2, 1, 1, 200), (1, 3, 90, 200), 0.0),
    (1, 2, 16, 300, (5, 0), False, (1, 1, 90, 1), None, 0.5),
]


# The steps see a block of the problem's (T, S) = (90, 200) at its offsets.
STEP_T, STEP_S = 90, 200


class Step:
    """One step case: the block's logits, the problem and arrays the step reads, and the
    same as the XLA twin's `chunked.Call`."""

    def __init__(self, case, seed=0, *, window=None, softcap=None, features=None,
                 broadcast=False):
        b, hq, rows, keys, offsets, causal, bias_shape, mask_shape, rate = case
        kl, kb, km, self.kd, self.kx = jax.random.split(jax.random.key(seed), 5)
        self.logits = 3.0 * jax.random.normal(kl, (b, hq, rows, keys), jnp.float32)
        bias = None if bias_shape is None else jax.random.normal(kb, bias_shape, jnp.float32)
        mask = None if mask_shape is None else jax.random.bernoulli(km, 0.7, mask_shape)
        seed_words = jnp.asarray([7, 11], jnp.uint32) if rate else None
        features = FeatureArrays() if features is None else features
        # q, k and v only give the problem's shapes: the steps read the logits.
        q = sd((b, STEP_T, hq, 8), jnp.float32)
        kv = sd((b, STEP_S, hq, 8), jnp.float32)
        self.inputs = Inputs(q, kv, kv, bias, mask, seed_words, features)
        self.problem = Problem.of(q, kv, kv, bias, mask, scale=0.3, causal=causal,
                                  dropout_rate=rate, dropout_broadcast=broadcast,
                                  features=features, window=window, softcap=softcap)
        self.blk = Block(offsets[0], rows, offsets[1], keys)
        config = chunked_plan.ChunkConfig(block_q=rows, block_k=keys)
        self.call = chunked_tier.Call(self.problem, config, True, self.inputs)

    def rows(self, out_dtype=jnp.float32):
        return blocked.softmax_rows(self.problem, self.logits, self.blk.offsets(), self.inputs,
                                    out_dtype=out_dtype, interpret=True)

    def rows_xla(self):
        return chunked_tier._softmax_xla(self.call, self.logits, self.blk, jnp.float32)

    def grad_block(self, lse, dp, delta):
        return GradBlock(self.logits, dp, lse, delta, self.blk.offsets())


@pytest.mark.parametrize("case", STEP_CASES, ids=str)
def test_softmax_rows_matches_its_xla_twin(case):
    step = Step(case)
    probs, lse = step.rows()
    ref_p, ref_lse = step.rows_xla()
    np.testing.assert_allclose(np.asarray(probs), np.asarray(ref_p), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-6, atol=1e-6)
    assert (np.asarray(lse) == -np.inf).sum() == (np.asarray(ref_lse) == -np.inf).sum()


def _grads_match(step: Step, *, own_delta: bool, split: bool):
    _, lse = step.rows_xla()
    dp = jax.random.normal(step.kd, step.logits.shape, jnp.float32).astype(jnp.bfloat16)
    delta = jax.random.normal(step.kx, lse.shape, jnp.float32)
    block = step.grad_block(lse, dp, delta)
    got = blocked.softmax_grad(step.problem, block, step.inputs, out_dtype=jnp.bfloat16,
                               split=split, with_ds32=True, own_delta=own_delta,
                               interpret=True)
    dropped, parts, ds32 = chunked_grad._softmax_grad_xla(
        step.call, block, step.blk, out_dtype=jnp.bfloat16, split=split, own_delta=own_delta)
    # float32 results agree to rounding. 16-bit ones may differ in their last bit: by one
    # unit in the last place of each element (2^-7 of it in bfloat16). Split's two words
    # (dS32's 16-bit high word and the rest) are held as their sum, to 16 bits of each
    # element plus what the two paths' float32 dS may differ by in rounding (2^-19 of its
    # largest value; the paths order its operations, the soft cap's derivative among them,
    # differently): where dS32 lies at a rounding midpoint the high words differ by one unit
    # and the low words make it up.
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    scale = float(np.abs(f32(ds32)).max())
    want = [dropped, *parts, ds32]
    for g, w in zip(got, want, strict=True):
        if g.dtype == jnp.float32 and w.dtype == jnp.float32:
            np.testing.assert_allclose(f32(g), f32(w), rtol=1e-5,
                                       atol=1e-5 * (1 + np.abs(f32(w)).max()))
        elif not (split and w is parts[1]):
            np.testing.assert_allclose(f32(g), f32(w), rtol=2.0 ** -7,
                                       atol=2.0 ** -19 * scale if split else 0)
    if split:
        got_sum, want_sum = f32(got[1]) + f32(got[2]), f32(parts[0]) + f32(parts[1])
        np.testing.assert_allclose(got_sum, want_sum, rtol=2.0 ** -15, atol=2.0 ** -19 * scale)


@pytest.mark.parametrize("case", STEP_CASES, ids=str)
@pytest.mark.parametrize("own_delta", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_softmax_grad_matches_its_xla_twin(case, own_delta, split):
    _grads_match(Step(case), own_delta=own_delta, split=split)


# (step case, window, soft cap, segment ids, q lengths, kv lengths): the LLM features of
# issue 24 in the steps, at the block's global offsets (seq_q 90, seq_k 200).
FEATURE_STEP_CASES = [
    (STEP_CASES[0], (30, 5), 1.5, True, True, True),
    (STEP_CASES[1], None, 0.8, False, False, True),
    (STEP_CASES[2], (3, 40), None, True, False, False),
    ((1, 2, 16, 128, (5, 64), False, (1, 1, 90, 1), None, 0.5), (0, 0), 2.0, True, True,
     False),
]


def _feature_step(fcase, seed=0) -> Step:
    case, window, cap, ids, q_len, kv_len = fcase
    b = case[0]
    ka, kb = jax.random.split(jax.random.key(seed + 1))
    features = FeatureArrays(
        q_segment_ids=jax.random.randint(ka, (b, STEP_T), 0, 3) if ids else None,
        kv_segment_ids=jax.random.randint(kb, (b, STEP_S), 0, 3) if ids else None,
        q_lengths=jnp.asarray([60, 90][:b], jnp.int32) if q_len else None,
        kv_lengths=jnp.asarray([150, 77][:b], jnp.int32) if kv_len else None)
    return Step(case, seed, window=window, softcap=cap, features=features)


@pytest.mark.parametrize("fcase", FEATURE_STEP_CASES, ids=str)
def test_softmax_rows_with_features_matches_its_xla_twin(fcase):
    step = _feature_step(fcase)
    probs, lse = step.rows()
    ref_p, ref_lse = step.rows_xla()
    np.testing.assert_allclose(np.asarray(probs), np.asarray(ref_p), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-6, atol=1e-6)
    assert (np.asarray(lse) == -np.inf).sum() == (np.asarray(ref_lse) == -np.inf).sum()


@pytest.mark.parametrize("fcase", FEATURE_STEP_CASES, ids=str)
@pytest.mark.parametrize("own_delta", [False, True])
def test_softmax_grad_with_features_matches_its_xla_twin(fcase, own_delta):
    _grads_match(_feature_step(fcase), own_delta=own_delta, split=True)


def test_step_seed_with_shard_offsets_draws_the_global_mask():
    """A shard's seed (words 2, 3: its global batch and head offsets) draws its slice of the
    unsharded keep-mask, in both steps."""
    step = Step((1, 2, 16, 64, (8, 0), False, None, None, 0.4))
    step.inputs = step.inputs._replace(seed=jnp.asarray([7, 11, 1, 2], jnp.uint32))
    step.call = dataclasses.replace(step.call, inputs=step.inputs)
    xla_p, _ = step.rows_xla()
    pallas_p, _ = step.rows()
    full = keep_mask_reference(jnp.asarray([7, 11], jnp.uint32), (2, 4, 90, 64), 0.4)
    np.testing.assert_array_equal(np.asarray(xla_p) != 0, np.asarray(full)[1:2, 2:4, 8:24])
    np.testing.assert_allclose(np.asarray(pallas_p), np.asarray(xla_p), rtol=2e-6, atol=1e-7)


def test_step_shared_mask_is_drawn_at_batch_0_and_head_0_on_every_shard():
    """Under `dropout_broadcast` both steps (and both directions) draw the one shared mask,
    whatever the shard's offsets in the seed's words 2 and 3."""
    step = Step((2, 3, 16, 64, (8, 64), False, None, None, 0.4), broadcast=True)
    step.inputs = step.inputs._replace(seed=jnp.asarray([7, 11, 1, 2], jnp.uint32))
    step.call = dataclasses.replace(step.call, inputs=step.inputs)
    xla_p, _ = step.rows_xla()
    pallas_p, _ = step.rows()
    shared = keep_mask_reference(jnp.asarray([7, 11], jnp.uint32), (1, 1, 90, 200), 0.4)
    np.testing.assert_array_equal(np.asarray(xla_p) != 0, np.broadcast_to(
        np.asarray(shared)[:, :, 8:24, 64:128], xla_p.shape))
    np.testing.assert_allclose(np.asarray(pallas_p), np.asarray(xla_p), rtol=2e-6, atol=1e-7)
    _grads_match(step, own_delta=False, split=False)


@pytest.mark.parametrize("interpret", [False, True], ids=["xla-step", "pallas-step"])
@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_float32_gradients_of_a_whole_row_block_normalise_their_own_probabilities(
        rate, interpret):
    """A float32 block that holds all of its rows' keys normalises its own P (XLA's softmax
    gradient does): with P from the forward's lse, large logits (|scale·q·k| ~ 70 here,
    lse rounded to a few 1e-6) put dq at 6-12x XLA's float32 error, past the rule's 3x
    (the GPU fuzz's draw of session 22: T=1, S=8, D=10/19, scale 1.912, dropout 0.5)."""
    b, t, s, hq, hkv, d, dv, scale = 2, 1, 8, 3, 1, 10, 19, 1.912
    keys = jax.random.split(jax.random.key(13), 6)
    q = 2.0 * jax.random.normal(keys[0], (b, t, hq, d), jnp.float32)
    k = 2.0 * jax.random.normal(keys[1], (b, s, hkv, d), jnp.float32)
    v = 2.0 * jax.random.normal(keys[2], (b, s, hkv, dv), jnp.float32)
    d_out = jax.random.normal(keys[3], (b, t, hq, dv), jnp.float32)
    d_lse = jax.random.normal(keys[4], (b, hq, t), jnp.float32)
    keep = ffpa_jax.dropout_mask(keys[5], (b, hq, t, s), rate) if rate else None

    def loss(f, q, k, v):
        out, lse = f(q, k, v)
        return jnp.sum(out * d_out.astype(out.dtype)) + jnp.sum(lse * d_lse.astype(lse.dtype))

    def ref(q, k, v):
        return ffpa_jax.reference.mha_reference(q, k, v, scale=scale, keep_mask=keep,
                                                dropout_rate=rate)

    def ours(q, k, v):
        return ffpa_jax.attention(q, k, v, scale=scale, dropout_rate=rate,
                                  dropout_rng=keys[5] if rate else None, return_lse=True,
                                  implementation="chunked", interpret=interpret)
    grad = lambda f, *a: jax.grad(lambda *x: loss(f, *x), argnums=(0, 1, 2))(*a)  # noqa: E731
    with jax.enable_x64(True):
        want = grad(ref, *(x.astype(jnp.float64) for x in (q, k, v)))
    got, xla = grad(ours, q, k, v), grad(ref, q, k, v)
    for name, g, x, w in zip(("dq", "dk", "dv"), got, xla, want):
        w = np.asarray(w)
        err, err_xla = (float(np.abs(np.asarray(a, np.float64) - w).max()) for a in (g, x))
        assert err <= 3.0 * err_xla + 1e-7, (name, err, err_xla)


# (B, Hq, Hkv, D, Dv, rows, keys, offsets, causal, bias shape, dropout, split, features):
# the step with its two products inside, on operands of the problem's (T, S) = (90, 200).
OPERAND_STEP_CASES = [
    (2, 4, 2, 40, 40, 37, 70, (13, 64), True, (1, 4, 90, 200), 0.2, False, False),
    (1, 3, 1, 111, 59, 64, 128, (0, 0), False, None, 0.0, True, False),
    (2, 2, 2, 72, 72, 20, 33, (70, 160), True, None, 0.0, False, True),
    (1, 2, 1, 16, 16, 90, 200, (0, 0), False, (1, 1, 90, 200), 0.0, True, True),
]


@pytest.mark.parametrize("case", OPERAND_STEP_CASES, ids=str)
def test_softmax_grad_of_operands_matches_the_step_on_library_products(case):
    """`softmax_grad_of_operands` (the logits computed inside the kernel) against
    `softmax_grad` on the logits of the unfused path's GEMM, at a block's offsets: GQA,
    head dims that are not powers of two (D != Dv), causality, a bias (and its float32
    dS), dropout, dS's two words, and the window, segment ids and lengths."""
    b, hq, hkv, d, dv, rows, keys, (r0, c0), causal, bias_shape, rate, split, feats = case
    ks = jax.random.split(jax.random.key(sum(case[:7])), 9)
    q = jax.random.normal(ks[0], (b, STEP_T, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, STEP_S, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, STEP_S, hkv, dv), jnp.bfloat16)
    d_out = jax.random.normal(ks[3], (b, STEP_T, hq, dv), jnp.bfloat16)
    bias = None if bias_shape is None else jax.random.normal(ks[4], bias_shape, jnp.float32)
    features = FeatureArrays(
        q_segment_ids=jax.random.randint(ks[5], (b, STEP_T), 0, 3),
        kv_segment_ids=jax.random.randint(ks[6], (b, STEP_S), 0, 3),
        q_lengths=jnp.asarray([60, 90][:b], jnp.int32),
        kv_lengths=jnp.asarray([190, 177][:b], jnp.int32)) if feats else FeatureArrays()
    seed = jnp.asarray([7, 11], jnp.uint32) if rate else None
    inputs = Inputs(q, k, v, bias, None, seed, features)
    problem = Problem.of(q, k, v, bias, None, scale=d ** -0.5, causal=causal,
                         dropout_rate=rate, features=features,
                         window=(30, 5) if feats else None, softcap=1.5 if feats else None)
    ops = chunked_tier.gemm_operands(inputs, d_out)
    blk = Block(r0, rows, c0, keys)
    shape4 = (b, hq, rows, keys)
    q_blk, do_blk = chunked_tier.block_rows(ops.qg, blk), chunked_tier.block_rows(ops.dog, blk)
    k_blk = chunked_tier.rows_of(ops.kk, 2, c0, keys)
    v_blk = chunked_tier.rows_of(ops.vv, 2, c0, keys)
    logits = chunked_tier.mm("bkmd,bksd->bkms", q_blk, k_blk, jnp.float32).reshape(shape4)
    dp = chunked_tier.mm("bkmd,bksd->bkms", do_blk, v_blk, jnp.bfloat16).reshape(shape4)
    lse = 0.5 * jax.random.normal(ks[7], (b, hq, rows), jnp.float32) + 4.0
    delta = jax.random.normal(ks[8], (b, hq, rows), jnp.float32)
    want = blocked.softmax_grad(problem, GradBlock(logits, dp, lse, delta, blk.offsets()),
                                inputs, out_dtype=jnp.bfloat16, split=split,
                                with_ds32=bias is not None, interpret=True)
    got = blocked.softmax_grad_of_operands(
        problem, blocked.LogitOperands(ops.qg, ops.kk),
        GradBlock(None, dp, lse, delta, blk.offsets()), inputs, out_dtype=jnp.bfloat16,
        split=split, with_ds32=bias is not None, interpret=True)
    assert len(got) == len(want)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    # The kernel's product sums the head dim in another order than the library GEMM's: the
    # logits differ by float32 roundings, which move P by a few float32 ulps (its 16-bit
    # form by at most one unit in its last place) and dS = P·(dP - δ) with it.
    p_dp = f32(got[0]) * np.abs(f32(dp)) * (1.0 / (1.0 - rate))
    for g, w in zip(got, want, strict=True):
        if g is got[0]:
            np.testing.assert_allclose(f32(g), f32(w), rtol=2.0 ** -7, atol=1e-6)
        elif g is got[-1] and bias is not None:  # dS in float32
            np.testing.assert_allclose(f32(g), f32(w), rtol=1e-4, atol=2.0 ** -7 * p_dp.max())
    ds_got, ds_want = f32(got[1]), f32(want[1])
    if split:
        ds_got, ds_want = ds_got + f32(got[2]), ds_want + f32(want[2])
    np.testing.assert_allclose(ds_got, ds_want, rtol=2.0 ** -7, atol=2.0 ** -7 * p_dp.max())
    assert np.abs(ds_want).max() > 0 and (f32(want[0]) > 0).mean() > 0.02  # a real test


# ---------------------------------------------------------------- end to end, Pallas step


# The blocked paths (several query and key blocks: the scans, causal groups, key-block
# merges and accumulation at offsets) with a 64 KiB budget; on a CPU the shared matrix runs
# the tier in one block.
BLOCKED_CASES = [
    Case(b=2, t=113, s=203, hq=6, hkv=2, d=40, causal=True, bias_shape=(1, 6, 113, 203)),
    Case(b=1, t=70, s=37, hq=4, hkv=1, d=111, mask_shape=(1, 1, 70, 37), dtype="float16"),
    Case(b=2, t=203, s=113, hq=4, hkv=2, d=59, causal=True, mask_shape=(2, 1, 203, 113),
         bias_shape=(2, 1, 203, 1)),
    Case(b=1, t=37, s=300, hq=2, hkv=1, d=320, dv=111, bias_shape=(1, 2, 1, 300),
         dtype="float32"),
]
BLOCKED_RATES = (0.0, 0.3, 0.3, 0.0)  # each case's dropout rate in the end-to-end test
SMALL_BUDGET_MIB = "0.25"


def _end_to_end(case: Case, *, interpret: bool, rate: float = 0.0):
    """out, lse and every gradient (a cotangent on both outputs) of the chunked tier against
    float64, with `rate` dropout."""
    from test_dropout import _keep
    q, k, v, bias, mask = make_inputs(case)
    key = jax.random.key(case.seed() + 3)
    keep = _keep(case, key, rate) if rate else None

    def f(q, k, v, bias):
        return ffpa_jax.attention(q, k, v, bias, mask, is_causal=case.causal, return_lse=True,
                                  dropout_rate=rate, dropout_rng=key if rate else None,
                                  implementation="chunked", interpret=interpret)
    d_out, d_lse = cotangents(case)
    d_out = d_out.astype(q.dtype).astype(jnp.float32)

    @jax.jit
    def forward_and_vjp(q, k, v, bias, d_out, d_lse):
        (out, lse), vjp = jax.vjp(f, q, k, v, bias)
        return out, lse, vjp((d_out.astype(q.dtype), d_lse))
    out, lse, got = forward_and_vjp(q, k, v, bias, d_out, d_lse)
    (*ref_forward, ref), (*xla_forward, xla) = (
        reference_vjp(case, q, k, v, bias, mask, d_out, d_lse, float64=float64, keep=keep,
                      rate=rate) for float64 in (True, False))
    assert_forward_matches(out, lse, ref_forward, xla_forward, q.dtype)
    for name, g, r, x in zip(["dq", "dk", "dv", "dbias"], got, ref, xla):
        if r is not None:
            assert_matches_reference(name, g, r, x, q.dtype, factor=3.0)


# The first case with `-m slow` (causal with a full bias): the second causal case, with dropout,
# a mask and a key-constant bias, stays.
@pytest.mark.parametrize("case,rate", [
    pytest.param(c, r, marks=pytest.mark.slow) if i == 0 else (c, r)
    for i, (c, r) in enumerate(zip(BLOCKED_CASES, BLOCKED_RATES, strict=True))],
                         ids=lambda x: x if isinstance(x, float) else
                         f"T{x.t}-S{x.s}-D{x.d}-{x.dtype}")
def test_blocked_paths_end_to_end(case, rate, monkeypatch):
    """The XLA step (the tier on a CPU) in many blocks."""
    monkeypatch.setenv(chunked_plan.BUDGET_ENV, SMALL_BUDGET_MIB)
    _end_to_end(case, interpret=False, rate=rate)


@pytest.mark.parametrize("features", ["causal", "packed", "window"])
def test_rows_that_see_few_keys_take_their_own_delta(features, monkeypatch):
    """bf16 (GQA 4/2), the backward (the XLA step) in key blocks of 128: rows
    that see few keys (the first under causality, each document's first under segment
    ids, every row under a window of 32) take δ from their own P and dP, as XLA's softmax
    gradient does, so a row of one key (dq = 0) gets XLA's dq = 0. With δ from the output,
    dP's bf16 rounding did not cancel there: the first row's dq was 1.3e-3 to 3.3e-3 of
    dq's largest entry over six seeds (causal). The gradients against float64 within the
    rule."""
    monkeypatch.setenv(chunked_plan.BUDGET_ENV, "0.5")
    t, d = 512, 64
    ks = jax.random.split(jax.random.key(5), 4)
    q = jax.random.normal(ks[0], (1, t, 4, d), jnp.float32).astype(jnp.bfloat16)
    k, v = (jax.random.normal(k_, (1, t, 2, d), jnp.float32).astype(jnp.bfloat16)
            for k_ in ks[1:3])
    d_out = jax.random.normal(ks[3], (1, t, 4, d), jnp.float32)
    kw = dict(is_causal=True)
    one_key_rows = [0]
    if features == "packed":
        seg = jnp.repeat(jnp.arange(4, dtype=jnp.int32), t // 4)[None]
        kw.update(q_segment_ids=seg, kv_segment_ids=seg)
        one_key_rows = [0, 128, 256, 384]
    elif features == "window":
        kw.update(local_window_size=(32, 0))
    problem = Problem.of(q, k, v, causal=True)
    config = chunked_plan.make_config(problem, step=chunked_plan.STEP_FUSION).for_backward()
    assert config.block_k <= 128, "not the blocks this test is about"

    def grads(fn, *args):
        return jax.grad(lambda *a: jnp.sum(fn(*a).astype(d_out.dtype) * d_out),
                        argnums=(0, 1, 2))(*args)
    got = grads(lambda *a: ffpa_jax.attention(*a, implementation="chunked", **kw), q, k, v)
    xla = grads(lambda *a: ffpa_jax.attention(*a, implementation="xla", **kw), q, k, v)
    ref_kw = {("window" if key == "local_window_size" else key): value
              for key, value in kw.items()}
    with jax.enable_x64(True):
        d_out = d_out.astype(jnp.float64)
        want = grads(lambda *a: ffpa_jax.reference.mha_reference(
            *a, scale=d ** -0.5, **ref_kw)[0], *(x.astype(jnp.float64) for x in (q, k, v)))
    dq, want_dq = np.asarray(got[0], np.float64), np.asarray(want[0])
    assert np.abs(np.asarray(xla[0], np.float64)[:, one_key_rows]).max() == 0.0
    assert np.abs(dq[:, one_key_rows]).max() <= 1e-5 * np.abs(want_dq).max()
    for name, g, w, x in zip(["dq", "dk", "dv"], got, want, xla, strict=True):
        assert_matches_reference(name, g, w, x, q.dtype, factor=3.0)


def test_pallas_step_end_to_end(monkeypatch):
    """The Pallas steps (interpreted) in many blocks."""
    monkeypatch.setenv(chunked_plan.BUDGET_ENV, SMALL_BUDGET_MIB)
    _end_to_end(BLOCKED_CASES[1], interpret=True, rate=0.2)


def _chunked_grads(args, d_out, **kw):
    """dq, dk, dv of the chunked tier (the Pallas step, interpreted) and the backward's
    jaxpr, traced afresh (the tier's constants are read at trace time)."""
    jax.clear_caches()

    def loss(q, k, v):
        out = ffpa_jax.attention(q, k, v, implementation="chunked", interpret=True, **kw)
        return jnp.sum(out * d_out)
    grad = jax.grad(loss, argnums=(0, 1, 2))
    return grad(*args), str(jax.make_jaxpr(grad)(*args))


# The unmasked case with `-m slow`: the causal case adds per key block too, the window
# keeps the traced offsets.
@pytest.mark.parametrize("causal,window", [pytest.param(False, None, marks=pytest.mark.slow),
                                           (True, None), (False, (30, 20))])
def test_key_accumulators_equal_one_array_at_traced_offsets(causal, window, monkeypatch):
    """dK and dV accumulated per key block (static starts, no dynamic_update_slice) equal
    the single array added at traced offsets, bit for bit, in 3 × 2 blocks (GQA 4:2, S not
    a multiple of the key block); a window's band moves with the rows, so it keeps the
    traced offsets, which must also take python-int starts under jax_enable_x64. (The XLA
    step keeps them too: `test_workspace_stays_under_the_budget_at_16k`.)"""
    monkeypatch.setenv(chunked_plan.BUDGET_ENV, "0.8")  # 68 rows × 128 keys a block
    ks = jax.random.split(jax.random.key(7), 4)
    args = [jax.random.normal(k_, shape, jnp.float32) for k_, shape in
            zip(ks, [(1, 203, 4, 16), (1, 203, 2, 16), (1, 203, 2, 16)])]
    d_out = jax.random.normal(ks[3], (1, 203, 4, 16), jnp.float32)
    kw = dict(is_causal=causal, local_window_size=window)
    grads, jaxpr = _chunked_grads(args, d_out, **kw)
    monkeypatch.setattr(chunked_grad, "MAX_UNROLLED_BLOCKS", 0)
    traced, traced_jaxpr = _chunked_grads(args, d_out, **kw)
    # Causal groups end their keys inside a block: that tail still adds into a slice.
    updates, traced_updates = (x.count("dynamic_update_slice") for x in (jaxpr, traced_jaxpr))
    assert traced_updates > 0
    if window is not None:
        assert updates == traced_updates
    else:
        assert updates < traced_updates and (causal or updates == 0), (updates, traced_updates)
    for g, t in zip(grads, traced):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(t))
    with jax.enable_x64(True):
        want = jax.grad(lambda *a: jnp.sum(ffpa_jax.reference.mha_reference(
            *a, scale=16 ** -0.5, is_causal=causal, window=window)[0] * d_out),
            argnums=(0, 1, 2))(*(x.astype(jnp.float64) for x in args))
        x64 = _chunked_grads(args, d_out, **kw)[0] if window is not None else grads
    for g, w in zip(x64, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5)


def test_key_blocks_unroll_only_where_their_parts_fit_the_budget(monkeypatch):
    """Unrolled key blocks hold their float32 gradient parts until one fusion sums them;
    the backward unrolls only where those fit the workspace budget. D = 512, N = 16384,
    H = 32 (one group looping over four query blocks: one query block's eight dQ parts,
    2 GiB) unrolls; causal (four groups of one query block, 20 blocks outside any loop:
    10 GiB, measured at a 17.0 GB peak unrolled against 9.5 GB looped) keeps the loop under
    the default 4 GiB and unrolls under a budget of 16 GiB."""
    monkeypatch.delenv(chunked_plan.BUDGET_ENV, raising=False)
    shape = jax.ShapeDtypeStruct((1, 16384, 32, 512), jnp.bfloat16)

    def grid(causal):
        problem = Problem.of(shape, shape, shape, causal=causal)
        config = chunked_plan.make_config(problem, step=chunked_plan.STEP_KERNEL,
                                          mosaic_step=True).for_backward()
        inputs = Inputs(shape, shape, shape)
        call = chunked_tier.call_record(problem, config, inputs, interpret=False)
        planned = groups(call.problem, config.block_q)
        assert sum(-(-g.keys // config.block_k) for g in planned) <= (
            chunked_grad.MAX_UNROLLED_BLOCKS)
        return chunked_grad._key_blocks(call, planned, inputs, 16384,
                                        operands_whole=True).grid

    assert grid(causal=False) is not None
    assert grid(causal=True) is None
    monkeypatch.setenv(chunked_plan.BUDGET_ENV, "16384")
    assert grid(causal=True) is not None


# ---------------------------------------------------------------- choosing the tier


def _plan_of(monkeypatch, q_shape, kv_shape, dtype=jnp.bfloat16, **kw):
    """The Plan `attention(implementation=None)` makes on a (simulated) GPU."""
    import ffpa_jax.api as api
    monkeypatch.setattr(dispatch.Device, "current",
                        classmethod(lambda cls: cls(nvidia_gpu=True, name="Simulated GPU")))
    plans = []
    real = api.plan_for

    def recording(*args, **kwargs):
        plans.append(real(*args, **kwargs))
        return plans[-1]
    monkeypatch.setattr(api, "plan_for", recording)
    q, kv = sd(q_shape, dtype), sd(kv_shape, dtype)
    jax.jit(lambda q, k, v: ffpa_jax.attention(q, k, v, **kw)).trace(q, kv, kv)
    return plans[-1]


@pytest.mark.parametrize("d,expected", [(64, ("pallas", "pallas")), (256, ("pallas", "chunked")),
                                        (320, ("chunked", "chunked")),
                                        (1024, ("chunked", "chunked"))])
def test_built_in_rule_picks_a_tier_per_direction(d, expected, monkeypatch):
    monkeypatch.setenv("FFPA_SKIP_PERSIST_TUNED_CONFIG", "1")
    plan = _plan_of(monkeypatch, (1, 512, 4, d), (1, 512, 4, d))
    assert (plan.forward_tier, plan.backward_tier) == expected
    has_blocks = any(c.kernel == "chunked_blocks" for c in plan.kernels)
    assert has_blocks == ("chunked" in expected)


@pytest.mark.parametrize("d,window,expected", [
    (256, (256, 0), ("pallas", "pallas")),     # band 257 <= S/8: the fused kernels
    (512, (200, 50), ("pallas", "pallas")),    # causal: the band is 201 (right side hidden)
    (256, (1024, 0), ("pallas", "chunked")),   # band 1025 > S/8: the usual rule
    (1024, (256, 0), ("chunked", "chunked")),  # above the measured head dims
])
def test_narrow_windows_run_on_the_fused_kernels(d, window, expected, monkeypatch):
    monkeypatch.setenv("FFPA_SKIP_PERSIST_TUNED_CONFIG", "1")
    plan = _plan_of(monkeypatch, (1, 4096, 4, d), (1, 4096, 4, d), is_causal=True,
                    local_window_size=window)
    assert (plan.forward_tier, plan.backward_tier) == expected


def test_windowed_blocks_take_about_the_band_in_rows():
    """The chunked tier's blocks under a window: about the band's width in rows (at least
    256), in both directions; without a window, causal blocks keep a quarter of T."""
    from pallas_kernels.chunked_plan import window_rows_cap
    base = dict(batch=1, seq_q=16384, seq_k=16384, heads_q=4, heads_kv=4, head_dim=256,
                head_dim_v=256, dtype=jnp.bfloat16, scale=0.1, causal=True)
    for direction in ("forward", "backward"):
        assert block_sizes(Problem(**base), direction)[0] == 4096
        for window, rows in (((1024, 0), 1152), ((1000, 20), 1024), ((10, 10), 256)):
            assert window_rows_cap(Problem(**base, window=window).window_band) == rows
            got, _ = block_sizes(Problem(**base, window=window), direction)
            assert got <= rows, (direction, window, got)


def test_decode_shapes_keep_the_decode_kernels(monkeypatch):
    monkeypatch.setenv("FFPA_SKIP_PERSIST_TUNED_CONFIG", "1")
    plan = _plan_of(monkeypatch, (2, 1, 8, 512), (2, 4096, 2, 512))
    assert plan.forward_tier == "pallas"
    assert plan.config("decode_fwd_stage1").num_splits >= 1


def test_float32_keeps_the_fused_kernels_by_default(monkeypatch):
    monkeypatch.setenv("FFPA_SKIP_PERSIST_TUNED_CONFIG", "1")
    plan = _plan_of(monkeypatch, (1, 512, 4, 512), (1, 512, 4, 512), dtype=jnp.float32)
    assert (plan.forward_tier, plan.backward_tier) == ("pallas", "pallas")


def test_tuned_entries_name_the_tier(tmp_path, monkeypatch):
    """A tuned file's entries carry a "tier" per direction; a file without the field, or
    with an unknown tier, keeps the built-in rule."""
    from tuning import lookup
    name = "Test_GPU"
    entries = []
    for direction, kernel, tier in (("forward", "fwd_generic", "pallas"),
                                    ("backward", "bwd_generic_dkdv", "chunked")):
        entry = {"direction": direction, "kernel": kernel, "case_name": "common", "causal": False,
                 "dtype": "bf16", "headdim": 512, "seqlen_q": 4096, "seqlen_k": 4096,
                 "seqlen_q_bucket": 4096, "seqlen_k_bucket": 4096, "nheads_q": 32,
                 "nheads_kv": 32, "has_attn_bias": False, "has_dropout": False, "tier": tier,
                 "config": tuning.default_config(kernel, headdim=512)}
        entries.append(entry)
    header = {"schema_version": 1, "device_name": name, "device_name_sanitized": name,
              "compute_capability": "9.0", "autotune_mode": "fast", "B": 1, "H": 32,
              "entries": entries}
    (tmp_path / f"{name}.json").write_text(json.dumps(header))
    monkeypatch.setenv("FFPA_TUNED_CONFIG_DIR", str(tmp_path))
    lookup.clear_cache()
    try:
        device = dispatch.Device(nvidia_gpu=True, name=name)

        def tier(direction, problem):
            return dispatch.explain(problem, device=device).choice(direction).tier
        ask = _problem()
        assert tier("forward", ask) == "pallas"  # rule: chunked
        assert tier("backward", ask) == "chunked"
        entries[1]["tier"] = "mosaic-someday"
        del entries[0]["tier"]
        (tmp_path / f"{name}.json").write_text(json.dumps(header))
        lookup.clear_cache()
        assert tier("forward", ask) == "chunked"
        assert tier("backward", ask) == "chunked"
        assert tier("backward", _problem(d=128)) == "pallas"
    finally:
        lookup.clear_cache()


def test_implementation_names_are_checked():
    q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="'chunked'"):
        ffpa_jax.attention(q, q, q, implementation="blocked")


# ---------------------------------------------------------------- lowering


@pytest.mark.parametrize("keys", [1000, 4096, 16384])
@pytest.mark.parametrize("extras", [(), ("bias",), ("bias", "mask", "seed")], ids=str)
def test_step_kernels_lower_for_cuda(keys, extras):
    args = [sd((2, 4, 96, keys), jnp.float32), sd((2,), jnp.int32)]
    if "bias" in extras:
        args.append(sd((1, 4, 500, 20000), jnp.float32))
    if "mask" in extras:
        args.append(sd((2, 1, 1, 20000), jnp.bool_))
    if "seed" in extras:
        args.append(sd((2,), jnp.uint32))
    rate = 0.1 if "seed" in extras else 0.0

    def f(logits, offsets, *rest):
        rest = list(rest)
        bias = rest.pop(0) if "bias" in extras else None
        mask = rest.pop(0) if "mask" in extras else None
        seed = rest.pop(0) if "seed" in extras else None
        q, kv = sd((2, 500, 4, 8), jnp.float32), sd((2, 20000, 4, 8), jnp.float32)
        inputs = Inputs(q, kv, kv, bias, mask, seed)
        problem = Problem.of(q, kv, kv, bias, mask, scale=0.1, causal=True, dropout_rate=rate)
        probs, lse = blocked.softmax_rows(problem, logits, offsets, inputs,
                                          out_dtype=jnp.bfloat16)
        grads = [blocked.softmax_grad(problem, GradBlock(logits, probs, lse, lse, offsets),
                                      inputs, out_dtype=jnp.bfloat16, split=split,
                                      with_ds32=bias is not None, own_delta=own)
                 for split, own in ((False, False), (True, True))]
        return probs, lse, grads

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 3


@pytest.mark.parametrize("features", [("window",), ("softcap",), ("ids", "lengths"),
                                      ("window", "softcap", "ids", "lengths")], ids=str)
def test_step_kernels_with_features_lower_for_cuda(features):
    args = [sd((2, 4, 96, 1000), jnp.float32), sd((2,), jnp.int32)]
    if "ids" in features:
        args += [sd((2, 500), jnp.int32), sd((2, 20000), jnp.int32)]
    if "lengths" in features:
        args += [sd((2,), jnp.int32), sd((2,), jnp.int32)]

    def f(logits, offsets, *rest):
        rest = list(rest)
        ids = (rest.pop(0), rest.pop(0)) if "ids" in features else (None, None)
        lens = (rest.pop(0), rest.pop(0)) if "lengths" in features else (None, None)
        feats = FeatureArrays(*ids, *lens)
        q, kv = sd((2, 500, 4, 8), jnp.float32), sd((2, 20000, 4, 8), jnp.float32)
        inputs = Inputs(q, kv, kv, features=feats)
        problem = Problem.of(q, kv, kv, scale=0.1, causal=True, features=feats,
                             window=(128, 16) if "window" in features else None,
                             softcap=30.0 if "softcap" in features else None)
        probs, lse = blocked.softmax_rows(problem, logits, offsets, inputs,
                                          out_dtype=jnp.bfloat16)
        return probs, lse, blocked.softmax_grad(
            problem, GradBlock(logits, probs, lse, lse, offsets), inputs,
            out_dtype=jnp.bfloat16, own_delta=True)

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2


@pytest.mark.parametrize(("d", "dtype", "n", "logits_in_step"), [
    (512, jnp.bfloat16, 16384, True), (1024, jnp.bfloat16, 16384, False),
    (512, jnp.float32, 16384, False), (512, jnp.bfloat16, 1024, False)])
def test_backward_blocks_take_their_logits_in_the_step_up_to_d512(d, dtype, n, logits_in_step,
                                                                  monkeypatch):
    """On a GPU (pretended: the call is only lowered), a 16-bit backward at D = 512 whose
    blocks hold part of their rows' keys computes the logits in the step's kernel; D = 1024
    (slower so on the H200), float32, and blocks that hold all of their rows' keys (N = 1024:
    they take δ from their own P and dP) keep the library GEMM and `softmax_grad`."""
    monkeypatch.setattr(dispatch.Device, "current",
                        classmethod(lambda cls: cls(nvidia_gpu=True, name="Lowering GPU")))
    arg = sd((1, n, 32, d), dtype)

    def grads(q, k, v):
        loss = lambda q, k, v: ffpa_jax.attention(  # noqa: E731
            q, k, v, implementation="chunked").astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    text = jax.jit(grads).trace(arg, arg, arg).lower(lowering_platforms=("cuda",)).as_text()
    assert ("softmax_grad_of_operands" in text) == logits_in_step
    assert ('"softmax_grad"' in text) != logits_in_step
