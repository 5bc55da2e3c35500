"""fwd_generic against the float64 reference: odd head dims, T != S, GQA/MQA,
every bias/mask broadcast shape, causal, fully masked rows, all dtypes.

On CPU the kernels run in Pallas' interpreter; on a GPU (marker `gpu`) for real.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from attn_testing import (Case, assert_forward_matches, make_inputs, reference64, scale_of,
                          xla_same_precision)
from conftest import call_kwargs, interpret_flag
from pallas_kernels import FwdConfig, Inputs, Problem, fwd_generic
from pallas_kernels.kernel_inputs import mask_block_lists


def run_case(case: Case, mode: str, tier: str = "pallas", *, q=None, k=None, v=None,
             bias=None, mask=None, eager: bool = False, return_lse: bool = True):
    """out and lse of `case` on `tier` against float64, called under jax.jit (as a training
    step calls it) or, with `eager`, eagerly; returns (out, lse). Without `return_lse` the
    call returns out alone (the kernels of large head dims differ: `Problem.return_lse`),
    and lse is None."""
    if q is None:
        q, k, v, bias, mask = make_inputs(case)

    def f(q, k, v, bias, mask):
        result = ffpa_jax.attention(q, k, v, bias, mask, scale=case.scale,
                                    is_causal=case.causal, return_lse=return_lse,
                                    **call_kwargs(tier, mode))
        return result if return_lse else (result, None)
    out, lse = (f if eager else jax.jit(f))(q, k, v, bias, mask)
    reference = reference64(case, q, k, v, bias, mask)
    assert out.dtype == q.dtype and out.shape == reference[0].shape
    assert lse is None or lse.dtype == jnp.float32
    assert_forward_matches(out, lse, reference, xla_same_precision(case, q, k, v, bias, mask),
                           q.dtype)
    return out, lse


SHAPES = [
    Case(b=2, t=113, s=203, hq=2, hkv=2, d=40),
    Case(t=1, s=113, hq=6, hkv=2, d=59),  # GQA 6/2, a single query
    Case(t=203, s=1, hq=3, hkv=1, d=111),  # MQA, a single key
    Case(t=1, s=1023, hq=8, hkv=2, d=111),  # a single query over many keys above D = 64
    Case(t=1023, s=113, hq=1, hkv=1, d=64),
    Case(t=113, s=1023, hq=2, hkv=1, d=32, dv=48),
    Case(t=64, s=77, hq=2, hkv=2, d=320, dv=192),
    Case(t=33, s=65, hq=2, hkv=1, d=512),
    Case(t=40, s=90, hq=1, hkv=1, d=1000),
    Case(t=17, s=33, hq=1, hkv=1, d=1024, dv=1024),
    Case(t=5, s=9, hq=4, hkv=4, d=1, dv=3),
]


@pytest.mark.parametrize("case", SHAPES, ids=lambda c: f"T{c.t}-S{c.s}-H{c.hq}.{c.hkv}-D{c.d}.{c.head_dim_v}")
def test_shapes_bf16(case, kernel_mode, tier):
    run_case(case, kernel_mode, tier)


def test_eager_calls(kernel_mode, tier):
    """The matrix calls attention under jax.jit; eagerly (a notebook's call) it runs the
    same code one operation at a time."""
    run_case(Case(b=2, t=37, s=70, hq=4, hkv=2, d=48, bias_shape=(4, 1, 70),
                  mask_shape=(2, 1, 37, 70), causal=True), kernel_mode, tier, eager=True)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("case", [SHAPES[0], SHAPES[1], SHAPES[5], SHAPES[7]],
                         ids=lambda c: f"D{c.d}")
def test_other_dtypes(case, dtype, kernel_mode, tier):
    run_case(dataclasses.replace(case, dtype=dtype), kernel_mode, tier)


@pytest.mark.parametrize("t,s", [(113, 203), (203, 113), (1, 113), (113, 1), (64, 64), (130, 129)])
def test_causal(t, s, kernel_mode, tier):
    """Bottom-right causal; with T > S the first T - S rows see no key (out 0, lse -inf)."""
    out, lse = run_case(Case(b=2, t=t, s=s, hq=6, hkv=2, d=59, causal=True), kernel_mode, tier)
    if t > s:
        assert np.all(np.asarray(lse)[:, :, : t - s] == -np.inf)
        assert np.all(np.asarray(out, np.float32)[:, : t - s] == 0.0)


# Broadcast shapes for B=2, Hq=4, T=37, S=70 (numpy rules, right-aligned): every rank, and
# each 4-D shape that `validation.as_4d` (leading 1s, before any tier) makes of them once.
BROADCAST_SHAPES = [
    (70,), (37, 70), (37, 1), (4, 1, 70), (4, 37, 70),
    (2, 1, 1, 70), (2, 1, 37, 70), (2, 4, 37, 70), (2, 4, 37, 1), (1, 1, 1, 1),
]


@pytest.mark.parametrize("shape", BROADCAST_SHAPES, ids=str)
def test_bias_broadcast(shape, kernel_mode, tier):
    run_case(Case(b=2, t=37, s=70, hq=4, hkv=2, d=48, bias_shape=shape), kernel_mode, tier)


@pytest.mark.parametrize("shape", BROADCAST_SHAPES, ids=str)
def test_mask_broadcast(shape, kernel_mode, tier):
    run_case(Case(b=2, t=37, s=70, hq=4, hkv=2, d=48, mask_shape=shape), kernel_mode, tier)


def run_at_magnitude(case: Case, magnitude: float, mode: str, tier: str, *, seed: int = 0,
                     return_lse: bool = True):
    """`run_case` on the case's inputs of `seed` with q and k scaled by `magnitude` (larger
    logits), rounded back to their dtype."""
    q, k, v, bias, mask = make_inputs(case, seed=seed)
    q, k = ((magnitude * x.astype(jnp.float32)).astype(x.dtype) for x in (q, k))
    return run_case(case, mode, tier, q=q, k=k, v=v, bias=bias, mask=mask,
                    return_lse=return_lse)


# Large logits at large head dims: where one tensor-core accumulation chain over all of
# D gave lse 3-5x XLA's error on the H200 (docs/benchmarks.md, "lse accuracy").
LARGE_LOGIT_CASES = [  # (case, magnitude of q and k)
    (Case(b=2, t=6, s=239, hq=8, hkv=4, d=768, scale=1.917), 2.0),
    (Case(t=17, s=40, hq=2, hkv=1, d=1000), 1.0),
    (Case(t=64, s=256, hq=4, hkv=4, d=512), 2.0),
    (Case(t=64, s=256, hq=4, hkv=4, d=256), 2.0),
    (Case(t=1, s=300, hq=8, hkv=2, d=512), 2.0),  # the decode kernels
    # float16, causal with T != S: the Mosaic wide kernel's single chain gave lse up to 11x
    # XLA's error here (the first is a Mosaic fuzz draw: one visible row, one key)
    (Case(b=3, t=7, s=1, hq=2, hkv=2, d=512, dtype="float16", causal=True, scale=0.925), 2.0),
    (Case(t=113, s=203, hq=2, hkv=2, d=512, dtype="float16", causal=True, scale=0.3), 2.0),
    (Case(t=113, s=203, hq=2, hkv=2, d=256, dtype="float16", causal=True, scale=0.3), 2.0),
]


@pytest.mark.parametrize("case,magnitude", LARGE_LOGIT_CASES, ids=lambda x: getattr(x, "d", x))
def test_lse_at_large_head_dims_and_logits(case, magnitude, kernel_mode, tier):
    for seed in range(4 if kernel_mode == "gpu" else 1):
        run_at_magnitude(case, magnitude, kernel_mode, tier, seed=seed)


@pytest.mark.parametrize("case,magnitude", [
    (Case(t=33, s=65, hq=2, hkv=1, d=512), 1.0),
    (Case(t=113, s=203, hq=2, hkv=2, d=512, dtype="float16", causal=True, scale=0.3), 2.0),
    (Case(t=40, s=90, hq=1, hkv=1, d=1000), 1.0),
    (Case(b=2, t=113, s=203, hq=2, hkv=2, d=40, causal=True), 1.0)],
    ids=lambda x: getattr(x, "d", x))
def test_out_without_lse(case, magnitude, kernel_mode, tier):
    """A call that returns out alone runs the forward kernels with one accumulation chain
    over the head dim (at large D, another kernel than the one that returns lse): its out
    meets the rule too."""
    run_at_magnitude(case, magnitude, kernel_mode, tier, return_lse=False)


@pytest.mark.parametrize("causal", [False, True])
def test_bias_and_mask_together(causal, kernel_mode, tier):
    run_case(Case(b=2, t=70, s=37, hq=4, hkv=1, d=111, bias_shape=(1, 4, 70, 37),
                  mask_shape=(2, 1, 70, 37), causal=causal), kernel_mode, tier)


def test_fully_masked_rows_by_mask(kernel_mode, tier):
    case = Case(b=2, t=50, s=80, hq=4, hkv=2, d=40, mask_shape=(2, 1, 50, 80))
    q, k, v, bias, mask = make_inputs(case)
    dead_rows = np.array([0, 7, 31, 49])
    mask = mask.at[:, :, dead_rows, :].set(False)
    out, lse = run_case(case, kernel_mode, tier, q=q, k=k, v=v, bias=bias, mask=mask)
    assert np.all(np.asarray(lse)[:, :, dead_rows] == -np.inf)
    assert np.all(np.asarray(out, np.float32)[:, dead_rows] == 0.0)


def test_fully_masked_rows_by_bias(kernel_mode, tier):
    case = Case(b=1, t=30, s=45, hq=2, hkv=2, d=64, bias_shape=(1, 2, 30, 45))
    q, k, v, bias, mask = make_inputs(case)
    bias = bias.at[:, 1, 3, :].set(-jnp.inf)
    out, lse = run_case(case, kernel_mode, tier, q=q, k=k, v=v, bias=bias, mask=mask)
    assert np.asarray(lse)[0, 1, 3] == -np.inf
    assert np.all(np.asarray(out, np.float32)[0, 3, 1] == 0.0)


def test_all_keys_masked(kernel_mode, tier):
    """A mask with no True at all: every row is empty, nothing is visited."""
    case = Case(b=1, t=20, s=30, hq=2, hkv=1, d=32, mask_shape=(20, 30))
    q, k, v, _, _ = make_inputs(case)
    mask = jnp.zeros((20, 30), bool)
    out, lse = run_case(case, kernel_mode, tier, q=q, k=k, v=v, mask=mask)
    assert np.all(np.asarray(out, np.float32) == 0.0) and np.all(np.asarray(lse) == -np.inf)


def test_sparse_block_mask(kernel_mode, tier):
    """A 90%-sparse block mask (the block-skipping path) is still exact."""
    case = Case(b=1, t=256, s=320, hq=2, hkv=2, d=64, mask_shape=(256, 320))
    q, k, v, _, _ = make_inputs(case)
    blocks = jax.random.bernoulli(jax.random.key(3), 0.1, (256 // 32, 320 // 32))
    blocks = blocks.at[:, 0].set(True)  # every row keeps some keys
    mask = jnp.repeat(jnp.repeat(blocks, 32, axis=0), 32, axis=1)
    run_case(case, kernel_mode, tier, q=q, k=k, v=v, mask=mask)


CONFIGS = [
    FwdConfig(block_m=16, block_n=16, block_d=16, block_dv=16, num_warps=4, num_stages=1,
              q_mode="resident"),
    FwdConfig(block_m=32, block_n=64, block_d=32, block_dv=32, num_warps=4, num_stages=2,
              q_mode="reload"),
    FwdConfig(block_m=64, block_n=32, block_d=64, block_dv=64, num_warps=8, num_stages=3,
              q_mode="dynamic", prefetch_v=True),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.q_mode}-{c.block_m}x{c.block_n}")
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_configs(cfg, causal, kernel_mode):
    """Several D chunks and V slices per program, every Q mode, directly on the kernel."""
    case = Case(b=1, t=77, s=100, hq=4, hkv=2, d=130, dv=100, causal=causal,
                bias_shape=(1, 4, 1, 100), mask_shape=(1, 1, 77, 100))
    q, k, v, bias, mask = make_inputs(case)
    inputs = Inputs(q, k, v, bias.reshape(1, 4, 1, 100), mask.reshape(1, 1, 77, 100))
    problem = Problem.of(*inputs[:5], scale=scale_of(case), causal=causal)
    out, lse = fwd_generic(problem, cfg, inputs, interpret=interpret_flag(kernel_mode))[:2]
    assert_forward_matches(out, lse, reference64(case, q, k, v, bias, mask),
                           xla_same_precision(case, q, k, v, bias, mask), q.dtype)


def _brute_force_visits(mask4, bm, bn, t, s, causal):
    """[mb, mh, n_q_blocks, n_kv_blocks]: does tile (i, j) hold a visible key?"""
    mb, mh = mask4.shape[:2]
    full = np.broadcast_to(np.asarray(mask4), (mb, mh, t, s))
    if causal:
        full = full & (np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t))
    nq, nk = -(-t // bm), -(-s // bn)
    visit = np.zeros((mb, mh, nq, nk), bool)
    for i in range(nq):
        for j in range(nk):
            visit[:, :, i, j] = full[:, :, i * bm:(i + 1) * bm, j * bn:(j + 1) * bn].any(axis=(2, 3))
    return visit


@pytest.mark.parametrize("mask_shape,causal", [((1, 1, 45, 70), False), ((2, 1, 1, 70), False),
                                               ((1, 3, 45, 1), True), ((2, 3, 45, 70), True)])
def test_mask_block_lists(mask_shape, causal):
    """The block lists name exactly the tiles holding a visible key, in ascending order."""
    t, s, bm, bn = 45, 70, 16, 32
    mask = jax.random.bernoulli(jax.random.key(7), 0.3, mask_shape)
    counts, indices = mask_block_lists(mask, block_m=bm, block_n=bn, seq_q=t, seq_k=s,
                                       causal=causal)
    counts, indices = np.asarray(counts), np.asarray(indices)
    expected = _brute_force_visits(mask, bm, bn, t, s, causal)
    if counts.shape[2] == 1:  # one list shared by all query blocks: they must agree
        assert (expected == expected[:, :, :1]).all()
        expected = expected[:, :, :1]
    assert counts.shape == expected.shape[:3]
    for idx in np.ndindex(counts.shape):
        np.testing.assert_array_equal(indices[idx][: counts[idx]], np.flatnonzero(expected[idx]))


@pytest.mark.parametrize("t,s", [(113, 1), (203, 1), (257, 1), (276, 1), (300, 1), (1023, 1),
                                 (276, 2), (257, 3), (1023, 17), (45, 70), (203, 1000)])
def test_block_lists_under_jit(t, s, kernel_mode):
    """The block lists of a masked causal call, computed under `jax.jit` on the test's
    device (the GPU when there is one), name exactly the visible tiles. An earlier
    form of the causal tile test, `0 <= min(i*bm + bm - 1, T - 1) + S - T`, came out
    inverted when XLA compiled it for the H100 (jax 0.11.2) at T=203/257/276/300 with
    S=1 (22 of 504 (T, S, bm, bn) cases); eager and CPU runs were right
    (the repro script is named in docs/history.md)."""
    del kernel_mode  # only selects the device: the GPU case is marked `gpu`
    mask = jax.random.bernoulli(jax.random.key(t + s), 0.7, (3, 6, 1, 1))
    for bm, bn in ((16, 16), (64, 32), (128, 128)):
        lists = jax.jit(functools.partial(mask_block_lists, block_m=bm, block_n=bn, seq_q=t,
                                          seq_k=s, causal=True))
        counts, indices = (np.asarray(x) for x in lists(mask))
        expected = _brute_force_visits(mask, bm, bn, t, s, True)
        np.testing.assert_array_equal(counts, expected.sum(-1), err_msg=f"bm={bm} bn={bn}")
        for idx in np.ndindex(counts.shape):
            np.testing.assert_array_equal(indices[idx][: counts[idx]],
                                          np.flatnonzero(expected[idx]))


@pytest.mark.parametrize("mask_density", [0.05, 0.9])
def test_fuzz_case_causal_one_key_many_queries(mask_density, kernel_mode):
    """Found by the GPU fuzz (docs/history.md, session 6): T=276 queries, S=1 key,
    causal (only the last row sees the key), a per-(batch, head) mask and a scalar bias.
    Under `jax.jit` on
    the GPU (jax 0.11.2) the last row came out 0 with lse -inf: XLA miscompiled the
    jnp iota arithmetic that listed the causally visible tiles (see
    `test_block_lists_under_jit`); the tiles are now computed in numpy at trace time."""
    from test_fuzz import Config, check_example
    cfg = Config(batched=True, b=3, t=276, s=1, hq=6, hkv=3, d=30, dv=100, dtype="bfloat16",
                 causal=True, bias_shape=(1, 1, 1, 1), bias_dtype="bfloat16",
                 mask_shape=(3, 6, 1, 1), scale=0.499, dropout_rate=0.0, with_grads=False)
    check_example(cfg, seed=0, magnitude=1.0, mask_density=mask_density,
                  neg_inf_bias_rows=False, impl="pallas", interpret=interpret_flag(kernel_mode))


# Three draws of the GPU fuzz (docs/history.md, session 17, lists their seeds) whose
# forward asked 246784-294912 bytes of the 232448 of shared memory: the D <= 128
# defaults pipeline 3 stages, and a [T, S] mask or bias tile, or dropout, rides along.
_SHARED_MEMORY_CASES = {
    "fp16-d72-bias-mask": dict(batched=False, b=1, t=50, s=70, hq=3, hkv=3, d=72, dv=72,
                               dtype="float16", causal=False, bias_shape=(3, 1, 70),
                               bias_dtype="float32", mask_shape=(50, 70), scale=None,
                               dropout_rate=0.0, with_grads=True),
    "fp16-d100-mask": dict(batched=True, b=3, t=69, s=226, hq=4, hkv=2, d=100, dv=100,
                           dtype="float16", causal=False, bias_shape=None,
                           bias_dtype="bfloat16", mask_shape=(1, 69, 226), scale=1.024,
                           dropout_rate=0.0, with_grads=False),
    "fp32-d81-dropout": dict(batched=True, b=1, t=63, s=70, hq=4, hkv=4, d=81, dv=81,
                             dtype="float32", causal=False, bias_shape=(1, 4, 63, 1),
                             bias_dtype="float32", mask_shape=(1, 4, 1, 1), scale=None,
                             dropout_rate=0.5, with_grads=True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(_SHARED_MEMORY_CASES))
def test_fuzz_cases_fit_shared_memory_gpu(name):
    """These compile within shared memory (fewer pipeline stages: `common.fit_stages`)
    and match the reference."""
    from test_fuzz import Config, check_example
    check_example(Config(**_SHARED_MEMORY_CASES[name]), seed=0, magnitude=1.0,
                  mask_density=0.5, neg_inf_bias_rows=False, impl="pallas", interpret=False)


def test_extra_tiles_cost_pipeline_stages_only_when_they_overflow():
    """The stage guard: the fuzz's overflowing forward configs lose a stage; plain calls
    and calls whose extra tiles fit keep the tuned count."""
    from pallas_kernels.kernel_inputs import fit_stages
    kib = 1024
    # fp16 D=100, T=69, S=226 with a [T, S] mask: Q 32 KiB resident, K + V 64 KiB/step.
    assert fit_stages(3, resident=32 * kib, per_stage=64 * kib, extra=16 * kib) == 2
    assert fit_stages(3, resident=32 * kib, per_stage=64 * kib, extra=0) == 3
    assert fit_stages(2, resident=64 * kib, per_stage=64 * kib, extra=8 * kib) == 2
    assert fit_stages(3, resident=200 * kib, per_stage=64 * kib, extra=8 * kib) == 1
