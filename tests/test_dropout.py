"""In-kernel dropout: the keep-mask is a pure function of (seed, b, h, i, j), the same in
every kernel and in `ffpa_jax.dropout_mask`; outputs and gradients are exact for the
dropped forward; the seed is a runtime input; rate 0 compiles no dropout code."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from attn_testing import (Case, assert_forward_matches, assert_matches_reference, cotangents,
                          make_inputs, reference64, reference_grads, xla_same_precision)
from conftest import TIERS, call_kwargs, interpret_flag
from ffpa_jax.dropout import seed_from_key
from pallas_kernels import (BackwardRows, BwdConfig, FwdConfig, Inputs, Problem, bwd_generic_dkdv,
                            bwd_preproc, fwd_generic)
from pallas_kernels.dropout import keep_threshold, philox4x32

RATE = 0.3


def _keep(case: Case, key, rate=RATE, broadcast: bool = False):
    """The keep-mask [B, Hq, T, S] (the shared one broadcast to it with `broadcast`)."""
    shape = (case.b, case.hq, case.t, case.s)
    return jnp.broadcast_to(ffpa_jax.dropout_mask(key, shape, rate, broadcast=broadcast), shape)


def _identity_probe(case: Case):
    """q, k random; v = one-hot over keys (Dv = S), so out[b, i, h, j] = P'[b, h, i, j]:
    non-zero exactly where the kernel kept the (visible) probability."""
    q, k, _, _, _ = make_inputs(dataclasses.replace(case, dtype="float32"))
    eye = jnp.eye(case.s, dtype=jnp.float32)[None, :, None, :]
    v = jnp.broadcast_to(eye, (case.b, case.s, case.hkv, case.s))
    return q, k, v


def _visible(case: Case) -> np.ndarray:
    """[1, 1, T, S] bool: the scores causal leaves visible (all when not causal)."""
    rows = np.arange(case.t)[:, None]
    cols = np.arange(case.s)[None, :]
    vis = cols <= rows + (case.s - case.t) if case.causal else np.ones((case.t, case.s), bool)
    return vis[None, None]


PROBE_CASES = [
    Case(b=2, t=37, s=75, hq=4, hkv=2),
    Case(b=1, t=130, s=203, hq=3, hkv=1, causal=True),
    Case(b=1, t=1, s=300, hq=8, hkv=2),
]


@pytest.mark.parametrize("case", PROBE_CASES, ids=lambda c: f"T{c.t}-S{c.s}-H{c.hq}.{c.hkv}")
@pytest.mark.parametrize("config", [
    FwdConfig(block_m=16, block_n=16, block_d=16, block_dv=128),
    FwdConfig(block_m=64, block_n=128, block_d=32, block_dv=64, q_mode="dynamic"),
], ids=["small-blocks", "large-blocks"])
def test_forward_kernel_mask_is_dropout_mask(case, config, kernel_mode):
    """Bit-identical keep decisions, whatever the block sizes and the V slicing."""
    q, k, v = _identity_probe(case)
    key = jax.random.key(case.seed())
    def forward(q, k, v, seed, rate):
        problem = Problem.of(q, k, v, scale=0.3, causal=case.causal, dropout_rate=rate)
        return fwd_generic(problem, config, Inputs(q, k, v, seed=seed),
                           interpret=interpret_flag(kernel_mode))[:2]
    out, lse = jax.jit(forward, static_argnums=4)(q, k, v, seed_from_key(key), RATE)
    kept = np.asarray(out).transpose(0, 2, 1, 3) != 0  # [B, Hq, T, S]
    visible = _visible(case)
    expected = np.asarray(_keep(case, key)) & visible
    np.testing.assert_array_equal(kept, expected)
    # The undropped normaliser: lse equals the no-dropout forward's.
    _, lse_plain = forward(q, k, v, None, 0.0)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_plain), rtol=1e-6)


# Small tiles at the larger shape with `-m slow`: small tiles run at the smaller one, the
# larger shape with the default tiles.
@pytest.mark.parametrize("case,block_m,block_n", [
    (PROBE_CASES[0], 16, 32), (PROBE_CASES[0], 64, 64),
    pytest.param(PROBE_CASES[1], 16, 32, marks=pytest.mark.slow), (PROBE_CASES[1], 64, 64)],
    ids=lambda x: f"T{x.t}-S{x.s}" if hasattr(x, "t") else str(x))
def test_backward_kernel_replays_the_mask(case, block_m, block_n, kernel_mode):
    """dV = P'ᵀ·dO with dO = one-hot over queries gives dV[b, j, h, i] = P'[b, h, i, j]:
    the backward regenerates exactly the forward's keep decisions."""
    case = dataclasses.replace(case, hkv=case.hq)  # one query head per kv head: dV is per head
    q, k, _ = _identity_probe(case)
    v = jax.random.normal(jax.random.key(3), (case.b, case.s, case.hkv, case.t), jnp.float32)
    key = jax.random.key(case.seed() + 1)
    seed = seed_from_key(key)
    interpret = interpret_flag(kernel_mode)
    problem = Problem.of(q, k, v, scale=0.3, causal=case.causal, dropout_rate=RATE)
    inputs = Inputs(q, k, v, seed=seed)
    out, lse, lse_lo = fwd_generic(problem, FwdConfig(), inputs, interpret=interpret)
    d_out = jnp.broadcast_to(jnp.eye(case.t, dtype=jnp.float32)[None, :, None, :],
                             (case.b, case.t, case.hq, case.t))
    cfg = BwdConfig(block_m=block_m, block_n=block_n, block_d=32, block_slice=128)
    delta = bwd_preproc(out, d_out, jnp.zeros_like(lse), config=cfg, interpret=interpret)
    _, dv = bwd_generic_dkdv(problem, cfg, inputs, BackwardRows(d_out, lse, delta, lse_lo),
                             interpret=interpret)
    kept = np.asarray(dv).transpose(0, 2, 3, 1) != 0  # [B, H, T, S]
    np.testing.assert_array_equal(kept, np.asarray(_keep(case, key)) & _visible(case))


def _dropout_outputs(case: Case, mode: str, key, rate=RATE, tier: str = "pallas",
                     broadcast: bool = False):
    q, k, v, bias, mask = make_inputs(case)
    keep = _keep(case, key, rate, broadcast)
    got_out, got_lse = ffpa_jax.attention(
        q, k, v, bias, mask, scale=case.scale, is_causal=case.causal, return_lse=True,
        dropout_rate=rate, dropout_rng=key, dropout_broadcast=broadcast,
        **call_kwargs(tier, mode))
    ref_out, ref_lse = reference64(case, q, k, v, bias, mask, keep=keep, rate=rate)
    xla_out, xla_lse = xla_same_precision(case, q, k, v, bias, mask, keep=keep, rate=rate)
    return (got_out, got_lse), (ref_out, ref_lse), (xla_out, xla_lse)


FWD_CASES = [
    Case(b=1, t=113, s=203, hq=4, hkv=2, d=40),
    Case(b=1, t=203, s=113, hq=2, hkv=1, d=59, causal=True),
    Case(b=2, t=37, s=70, hq=4, hkv=2, d=111, bias_shape=(1, 4, 37, 70), mask_shape=(2, 1, 1, 70)),
    Case(b=1, t=64, s=77, hq=2, hkv=2, d=320, dv=192),
    Case(b=1, t=1, s=339, hq=8, hkv=2, d=64),
    Case(b=1, t=33, s=65, hq=2, hkv=1, d=512, dtype="float16"),
    Case(b=1, t=40, s=50, hq=1, hkv=1, d=1000),
]


@pytest.mark.parametrize("case", FWD_CASES,
                         ids=lambda c: f"T{c.t}-S{c.s}-H{c.hq}.{c.hkv}-D{c.d}-{c.dtype}")
def test_forward_matches_reference(case, kernel_mode, tier):
    key = jax.random.key(case.seed() + 5)
    (out, lse), reference, xla = _dropout_outputs(case, kernel_mode, key, tier=tier)
    assert_forward_matches(out, lse, reference, xla, case.dtype)


def test_xla_and_pallas_agree_for_the_same_key(kernel_mode):
    case = Case(b=2, t=50, s=90, hq=4, hkv=2, d=32, dtype="float32", causal=True)
    q, k, v, _, _ = make_inputs(case)
    key = jax.random.key(11)
    run = lambda impl: ffpa_jax.attention(q, k, v, is_causal=True, dropout_rate=0.17,
                                          dropout_rng=key, implementation=impl,
                                          interpret=impl == "pallas" and
                                          interpret_flag(kernel_mode))
    np.testing.assert_allclose(np.asarray(run("pallas")), np.asarray(run("xla")),
                               rtol=1e-5, atol=1e-6)


def _grads(case: Case, mode: str, key, tier: str, broadcast: bool = False):
    """Gradients of <out, d_out> + <lse, d_lse>: (the tier's, the float64 reference's, the
    same-precision reference's); `broadcast`: one mask shared by batch and heads."""
    q, k, v, bias, mask = make_inputs(case)
    d_out, d_lse = cotangents(case)
    d_out = d_out.astype(q.dtype).astype(jnp.float32)

    @jax.jit  # as a training step takes them (the eager vjp: test_backward's eager test)
    def grads(q, k, v, bias, key, d_out, d_lse):
        f = lambda q, k, v, bias: ffpa_jax.attention(
            q, k, v, bias, mask, scale=case.scale, is_causal=case.causal, return_lse=True,
            dropout_rate=RATE, dropout_rng=key, dropout_broadcast=broadcast,
            **call_kwargs(tier, mode))
        (out, lse), vjp = jax.vjp(f, q, k, v, bias)
        return vjp((d_out.astype(out.dtype), d_lse))
    keep = _keep(case, key, broadcast=broadcast)
    ref, xla = (reference_grads(case, q, k, v, bias, mask, d_out, d_lse, float64=float64,
                                keep=keep, rate=RATE) for float64 in (True, False))
    return grads(q, k, v, bias, key, d_out, d_lse), ref, xla


# Interpret mode runs every program of the four backward kernels: shapes stay small.
GRAD_CASES = [
    Case(b=1, t=70, s=130, hq=4, hkv=2, d=40, causal=True),
    Case(b=2, t=37, s=70, hq=2, hkv=1, d=48, bias_shape=(1, 2, 1, 70), mask_shape=(2, 1, 37, 70)),
    Case(b=1, t=1, s=113, hq=6, hkv=2, d=59),
    Case(b=1, t=33, s=77, hq=2, hkv=1, d=320, dv=192),
    Case(b=1, t=40, s=50, hq=1, hkv=1, d=1000, dtype="float16"),
]


# D = 48 (bias and mask) and 320 with `-m slow`: D = 40 causal, T = 1 and D = 1000 stay, and
# a bias and mask with dropout in test_chunked's end-to-end case.
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.d in (48, 320)
                                  else c for c in GRAD_CASES],
                         ids=lambda c: f"T{c.t}-S{c.s}-H{c.hq}.{c.hkv}-D{c.d}-{c.dtype}")
def test_gradients_match_reference(case, kernel_mode, tier):
    key = jax.random.key(case.seed() + 7)
    got, ref, xla = _grads(case, kernel_mode, key, tier)
    q_dtype = jnp.dtype(case.dtype)
    for name, g, r, x in zip(["dq", "dk", "dv", "dbias"], got, ref, xla):
        if r is None:
            assert g is None
            continue
        assert_matches_reference(name, g, r, x, q_dtype, factor=3.0)


# ------------------------------------------------------------------ one mask, shared
# `dropout_broadcast=True` (Flax's broadcast_dropout): element (b, h, i, j) takes the decision
# of the unshared mask at (0, 0, i, j). The dense tier ("xla") draws the mask itself here.
BROADCAST_TIERS = ["xla", *TIERS]


def test_shared_mask_is_the_first_slice_of_the_unshared_one():
    shape, rate = (3, 4, 37, 203), RATE
    key = jax.random.key(31)
    full = np.asarray(ffpa_jax.dropout_mask(key, shape, rate))
    shared = np.asarray(ffpa_jax.dropout_mask(key, shape, rate, broadcast=True))
    assert shared.shape == (1, 1, 37, 203)
    np.testing.assert_array_equal(shared, full[:1, :1])
    # The unshared mask differs between batch rows and heads (independent draws disagree
    # on 2·rate·(1 - rate) of the elements), so sharing it changes what is kept.
    disagree = float(np.mean(full[1:, 1:] != shared))
    assert abs(disagree - 2 * rate * (1 - rate)) <= 0.01, disagree


@pytest.mark.parametrize("tier", BROADCAST_TIERS, indirect=True)
@pytest.mark.parametrize("case", [PROBE_CASES[0], Case(b=2, t=1, s=300, hq=8, hkv=2)],
                         ids=lambda c: f"T{c.t}-S{c.s}-H{c.hq}.{c.hkv}")
def test_shared_mask_is_what_every_batch_row_and_head_keeps(case, tier, kernel_mode):
    """The identity probe (out = the dropped P) through `attention`: every (b, h) keeps
    exactly the shared mask (T = 1 runs the fused tier's decode kernels)."""
    q, k, v = _identity_probe(case)
    key = jax.random.key(case.seed() + 2)
    out = ffpa_jax.attention(q, k, v, scale=0.3, is_causal=case.causal, dropout_rate=RATE,
                             dropout_rng=key, dropout_broadcast=True,
                             **call_kwargs(tier, kernel_mode))
    kept = np.asarray(out).transpose(0, 2, 1, 3) != 0  # [B, Hq, T, S]
    shared = np.asarray(ffpa_jax.dropout_mask(key, kept.shape, RATE, broadcast=True))
    np.testing.assert_array_equal(kept, np.broadcast_to(shared & _visible(case), kept.shape))


BROADCAST_CASES = [
    Case(b=2, t=113, s=203, hq=4, hkv=2, d=40),
    Case(b=2, t=37, s=70, hq=4, hkv=2, d=59, causal=True, dtype="float16",
         bias_shape=(1, 4, 37, 70), mask_shape=(2, 1, 1, 70)),
]


@pytest.mark.parametrize("tier", BROADCAST_TIERS, indirect=True)
@pytest.mark.parametrize("case", BROADCAST_CASES,
                         ids=lambda c: f"T{c.t}-S{c.s}-H{c.hq}.{c.hkv}-D{c.d}-{c.dtype}")
def test_shared_mask_forward_matches_reference(case, kernel_mode, tier):
    key = jax.random.key(case.seed() + 13)
    (out, lse), reference, xla = _dropout_outputs(case, kernel_mode, key, tier=tier,
                                                  broadcast=True)
    assert_forward_matches(out, lse, reference, xla, case.dtype)


@pytest.mark.parametrize("tier", BROADCAST_TIERS, indirect=True)
def test_shared_mask_gradients_match_reference(kernel_mode, tier):
    """The backward replays the shared mask (dbias of a bias broadcast over the batch sums
    the batch rows' shares)."""
    case = Case(b=2, t=45, s=113, hq=4, hkv=2, d=59, causal=True, bias_shape=(1, 4, 45, 113))
    got, ref, xla = _grads(case, kernel_mode, jax.random.key(case.seed() + 17), tier,
                           broadcast=True)
    for name, g, r, x in zip(["dq", "dk", "dv", "dbias"], got, ref, xla):
        assert_matches_reference(name, g, r, x, jnp.dtype(case.dtype), factor=3.0)


def test_dropout_broadcast_must_be_a_bool():
    q = jnp.ones((1, 8, 1, 16), jnp.bfloat16)
    with pytest.raises(TypeError, match="dropout_broadcast"):
        ffpa_jax.attention(q, q, q, dropout_rate=0.1, dropout_rng=jax.random.key(0),
                           dropout_broadcast="yes")
    with pytest.raises(TypeError, match="broadcast"):
        ffpa_jax.dropout_mask(jax.random.key(0), (1, 1, 4, 4), 0.1, broadcast=1)


def test_dropout_broadcast_without_dropout_is_the_plain_problem():
    """No mask, nothing to share: the call's problem (and so its compiled program) is the
    one without the flag."""
    from ffpa_jax import validation
    q = jax.ShapeDtypeStruct((1, 8, 2, 16), jnp.bfloat16)
    problems = [validation.validate(q, q, q, None, None, scale=None, is_causal=False,
                                    dropout_rate=0.0, dropout_rng=None, return_lse=False,
                                    implementation=None, interpret=False,
                                    dropout_broadcast=flag).problem for flag in (False, True)]
    assert problems[0] == problems[1] and not problems[1].dropout_broadcast


# ----------------------------------------------------------------------------- statistics
@pytest.mark.parametrize("rate", [0.1, 0.17, 0.5])
def test_kept_fraction(rate):
    keep = np.asarray(ffpa_jax.dropout_mask(jax.random.key(1), (2, 4, 256, 520), rate))
    assert keep.size >= 1_000_000
    assert abs(keep.mean() - (1 - rate)) <= 0.01, keep.mean()
    # The exact keep probability is 1 - round(rate·2^16)/2^16: check tighter, 5 sigma.
    p_keep = 1 - keep_threshold(rate) / 2**16
    sigma = np.sqrt(p_keep * (1 - p_keep) / keep.size)
    assert abs(keep.mean() - p_keep) <= 5 * sigma


def test_same_key_same_mask_new_key_new_mask():
    shape, rate = (2, 4, 256, 520), 0.17
    a = np.asarray(ffpa_jax.dropout_mask(jax.random.key(5), shape, rate))
    np.testing.assert_array_equal(a, np.asarray(ffpa_jax.dropout_mask(jax.random.key(5), shape,
                                                                      rate)))
    b = np.asarray(ffpa_jax.dropout_mask(jax.random.key(6), shape, rate))
    disagree = float(np.mean(a != b))
    assert abs(disagree - 2 * rate * (1 - rate)) <= 0.005, disagree
    # Raw (old-style) keys give the same mask as the typed key they wrap.
    raw = jax.random.key_data(jax.random.key(5))
    np.testing.assert_array_equal(a, np.asarray(ffpa_jax.dropout_mask(
        jax.random.wrap_key_data(raw), shape, rate)))


@pytest.mark.parametrize("axis,offset", [(3, 1), (3, 2), (3, 7), (3, 8), (3, 9), (2, 1), (1, 1),
                                         (0, 1)], ids=lambda x: str(x))
def test_no_correlation_between_neighbours(axis, offset):
    """Pearson correlation of keep decisions offset along columns (within one Philox
    call, across calls), rows, heads and batch: |r| below 5 standard errors."""
    keep = np.asarray(ffpa_jax.dropout_mask(jax.random.key(9), (4, 8, 128, 512), 0.5),
                      np.float64)
    a = np.take(keep, np.arange(keep.shape[axis] - offset), axis=axis).ravel()
    b = np.take(keep, np.arange(offset, keep.shape[axis]), axis=axis).ravel()
    r = np.corrcoef(a, b)[0, 1]
    assert abs(r) < 5 / np.sqrt(a.size), r


# ----------------------------------------------------------------------------- compilation
def test_new_key_reuses_the_compiled_kernel():
    case = Case(b=1, t=40, s=48, hq=2, hkv=2, d=16, dtype="float32")
    q, k, v, _, _ = make_inputs(case)
    traces = []

    @jax.jit
    def f(q, k, v, key):
        traces.append(1)
        return ffpa_jax.attention(q, k, v, dropout_rate=0.2, dropout_rng=key,
                                  implementation="pallas", interpret=True)

    a = f(q, k, v, jax.random.key(0))
    b = f(q, k, v, jax.random.key(1))
    assert len(traces) == 1 and f._cache_size() == 1
    assert not np.array_equal(np.asarray(a), np.asarray(b))  # the new seed did arrive


def _primitive_names(jaxpr, inside_kernel: bool = False) -> set[str]:
    """Primitives used inside pallas_call kernels anywhere in `jaxpr` (recursively)."""
    names = set()
    for eqn in jaxpr.eqns:
        if inside_kernel:
            names.add(eqn.primitive.name)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    names |= _primitive_names(
                        sub, inside_kernel or eqn.primitive.name == "pallas_call")
    return names


def _kernel_primitives(rate: float) -> set[str]:
    q = jax.ShapeDtypeStruct((1, 32, 2, 16), jnp.bfloat16)
    key = jax.random.key(0)
    jaxpr = jax.make_jaxpr(lambda q, k, v: ffpa_jax.attention(
        q, k, v, dropout_rate=rate, dropout_rng=key if rate else None,
        implementation="pallas", interpret=True))(q, q, q)
    return _primitive_names(jaxpr.jaxpr)


def test_rate_zero_compiles_no_dropout_code():
    """Philox's logical shifts appear in the kernel only when dropping."""
    plain = _kernel_primitives(0.0)
    assert "dot_general" in plain  # the walk did reach the kernel body
    assert "shift_right_logical" not in plain
    assert "shift_right_logical" in _kernel_primitives(0.25)


def test_rate_and_key_errors():
    q = jnp.ones((1, 8, 1, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="dropout_rng"):
        ffpa_jax.attention(q, q, q, dropout_rate=0.1)
    for bad in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="dropout_rate"):
            ffpa_jax.attention(q, q, q, dropout_rate=bad, dropout_rng=jax.random.key(0))
    with pytest.raises(ValueError, match="rate"):
        ffpa_jax.dropout_mask(jax.random.key(0), (1, 1, 4, 4), 1.0)


def test_vmap_over_a_leading_axis_matches_a_loop(kernel_mode):
    case = Case(b=1, t=24, s=40, hq=2, hkv=1, d=16, dtype="float32")
    q, k, v, _, _ = make_inputs(case)
    qs = jnp.stack([q, q * 0.5 + 0.1, -q])
    key = jax.random.key(4)
    f = lambda q: ffpa_jax.attention(q, k, v, dropout_rate=0.3, dropout_rng=key,
                                     implementation="pallas", interpret=interpret_flag(kernel_mode))
    batched = jax.vmap(f)(qs)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(f(qs[i])), rtol=1e-6,
                                   atol=1e-7)


# Random123's known-answer vectors for Philox-4x32-10 (kat_vectors in the Random123
# distribution): (counter, key) -> output words.
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_matches_random123_known_answers(counter, key, expected):
    words = philox4x32(*(np.uint32(x) for x in counter), *(np.uint32(x) for x in key))
    got = tuple(int(np.asarray(w).view(np.uint32)) for w in words)
    assert got == expected


def test_mask_follows_the_documented_counter_layout():
    """Element (b, h, i, j) with j = 32c + 8a + 2q + p is half p of word a of the Philox
    call at counter (4c + q, i, h, b): computed here one element at a time from that
    formula, against the whole mask of `dropout_mask`."""
    shape, rate = (2, 3, 9, 77), 0.37
    key = jax.random.key(20261122)
    mask = np.asarray(ffpa_jax.dropout_mask(key, shape, rate))
    seed = np.asarray(seed_from_key(key))
    rng = np.random.default_rng(5)
    for _ in range(40):
        b, h, i, j = (int(rng.integers(n)) for n in shape)
        c, a, q, p = j // 32, (j % 32) // 8, (j % 8) // 2, j % 2
        words = philox4x32(np.uint32(4 * c + q), np.uint32(i), np.uint32(h), np.uint32(b),
                           seed[0], seed[1])
        half = (int(np.asarray(words[a]).view(np.uint32)) >> (16 * p)) & 0xFFFF
        assert mask[b, h, i, j] == (half >= keep_threshold(rate)), (b, h, i, j)
