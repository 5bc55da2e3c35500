"""Runtime positions (`FeatureArrays.positions`): a block of a longer sequence on every tier.

A global problem is split into blocks of rows and blocks of keys; each block runs through
`tiers.forward`/`tiers.backward` with its positions (row0, col0, shift), the blocks' (out,
lse) merge by lse, their dq sum over key blocks and their dk/dv over row blocks (the backward
given the whole sequence's out, lse and cotangents, as context parallelism gives them). The
result must be the unsharded call's: float32 within 1e-5 relative (the float32 rule of
docs/design.md), dropout with the unsharded call's keep decisions, hidden blocks exact zeros.
The kernel tiles are small so that the fused kernels' walks and the chunked tier's blocks
skip, mask and merge within a block too.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (BackwardRows, BwdConfig, FwdConfig, bwd_dbias, bwd_exact_rows,
                            bwd_generic_dkdv, bwd_generic_dq, chunked_plan, fused, fwd_generic,
                            tiers)
from pallas_kernels.blocked import GradBlock, softmax_grad, softmax_rows
from pallas_kernels.plan import KernelChoice
from pallas_kernels.problem import Cotangents, FeatureArrays, Inputs, Problem, Saved
from tuning import dispatch

# (tier, interpret, the chunked tier's step): the XLA path, the chunked tier with its XLA
# step and with its Pallas step in the interpreter, the fused kernels in the interpreter.
TIERS = {"xla": ("xla", False, None),
         "chunked": ("chunked", False, chunked_plan.STEP_FUSION),
         "chunked-step": ("chunked", True, chunked_plan.STEP_KERNEL),
         "pallas": ("pallas", True, None)}
CHUNK_BLOCKS = (16, 32)  # the chunked tier's (rows, keys) per block
TILE = 16  # the fused kernels' tiles


@dataclasses.dataclass(frozen=True)
class Case:
    t: int
    s: int
    row_blocks: tuple[tuple[int, int], ...]  # (start, size), in the order a device holds them
    key_blocks: tuple[tuple[int, int], ...]
    b: int = 2
    hq: int = 4
    hkv: int = 2
    d: int = 16
    causal: bool = False
    window: tuple[int, int] | None = None
    rate: float = 0.0
    segments: bool = False
    lengths: bool = False
    mask: bool = False
    bias: tuple[int, ...] | None = None  # the bias's 4-D shape, dims 1 or full


def _even(n: int, size: int):
    return tuple((i, size) for i in range(0, n, size))


def _zigzag(n: int, chunks: int):
    """Device i of chunks/2 holds chunks i and chunks-1-i (non-adjacent blocks)."""
    size = n // chunks
    order = [c for i in range(chunks // 2) for c in (i, chunks - 1 - i)]
    return tuple((c * size, size) for c in order)


CASES = {
    # T != S, GQA, packed segments and lengths (the walks bounded by them, and causality),
    # a bias constant over the keys; causality hides whole blocks (rows [0, 32) see keys up
    # to 63 only).
    "causal-segments-lengths": Case(t=96, s=128, row_blocks=_even(96, 32),
                                    key_blocks=_even(128, 64), causal=True, segments=True,
                                    lengths=True, bias=(1, 1, 96, 1)),
    # Causality with a mask (the mask's block lists) and dropout, T != S, a full bias; key
    # blocks at multiples of 128.
    "causal-dropout-mask": Case(t=64, s=256, row_blocks=_even(64, 32),
                                key_blocks=_even(256, 128), causal=True, rate=0.25, mask=True,
                                bias=(1, 4, 64, 256), b=1),
    # A window on both sides with dropout (the chunked tier's bands), T != S, MQA.
    "window-dropout": Case(t=64, s=256, row_blocks=_even(64, 32), key_blocks=_even(256, 128),
                           window=(20, 12), rate=0.25, hkv=1, b=1),
    # Zigzag placement of rows and keys under causality alone (unmasked blocks first).
    "zigzag-causal": Case(t=128, s=128, row_blocks=_zigzag(128, 4),
                          key_blocks=_zigzag(128, 4), causal=True, b=1),
}
HIDDEN_BLOCKS = ("causal-segments-lengths", "zigzag-causal")  # cases with such blocks
# Each row sees its diagonal key alone (`test_dropout_draws_the_unsharded_keep_decisions`).
DIAGONAL = Case(t=96, s=256, row_blocks=_even(96, 32), key_blocks=_even(256, 128),
                window=(0, 0), rate=0.5, b=1, hq=2, hkv=1)


def _arrays(case: Case, seed: int):
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)
    b, t, s = case.b, case.t, case.s
    q, k, v = normal(b, t, case.hq, case.d), normal(b, s, case.hkv, case.d), normal(
        b, s, case.hkv, case.d)
    f = FeatureArrays()
    if case.segments:
        f = f._replace(q_segment_ids=jnp.asarray(np.sort(rng.integers(1, 4, (b, t))), jnp.int32),
                       kv_segment_ids=jnp.asarray(np.sort(rng.integers(1, 4, (b, s))),
                                                  jnp.int32))
    if case.lengths:
        f = f._replace(q_lengths=jnp.asarray([t - 7, t][:b], jnp.int32),
                       kv_lengths=jnp.asarray([s, s - 45][:b], jnp.int32))
    mask = jnp.asarray(rng.random((b, 1, t, s)) < 0.85) if case.mask else None
    bias = normal(*case.bias) if case.bias else None
    seed_words = jnp.asarray(rng.integers(1, 2**31, 2), jnp.uint32) if case.rate else None
    cot = (normal(b, t, case.hq, case.d), normal(b, case.hq, t))
    return Inputs(q, k, v, bias, mask, seed_words, f), cot


def _problem(case: Case, inputs: Inputs) -> Problem:
    return Problem.of(inputs.q, inputs.k, inputs.v, inputs.bias, inputs.mask, causal=case.causal,
                      dropout_rate=case.rate, features=inputs.features, window=case.window)


def _plan(problem: Problem, tier: str):
    name, interpret, step = TIERS[tier]
    plan = dispatch.plan_for_tiers(problem, name, name, interpret=interpret)
    if name == "chunked":
        config = chunked_plan.make_config(problem, step=step, blocks=CHUNK_BLOCKS)
        kernels = tuple(KernelChoice.of(tiers.CHUNKED_KERNEL, config, "test", direction)
                        for direction in ("forward", "backward"))
        plan = dataclasses.replace(plan, kernels=kernels)
    if name == "pallas":
        small = dict(block_m=TILE, block_n=TILE, block_d=TILE)
        kernels = tuple(dataclasses.replace(
            c, config=dataclasses.replace(c.config, **small, **(
                dict(block_dv=TILE) if isinstance(c.config, FwdConfig) else
                dict(block_slice=TILE)))) for c in plan.kernels)
        plan = dataclasses.replace(plan, kernels=kernels)
    return plan


def _sliced(x, axis: int, start: int, size: int):
    if x is None or x.shape[axis] == 1:
        return x
    return jax.lax.slice_in_dim(x, start, start + size, axis=axis)


def _block(case: Case, inputs: Inputs, rows, keys) -> Inputs:
    """The inputs of rows [r0, r0 + nr) against keys [c0, c0 + nc), with their positions."""
    (r0, nr), (c0, nc) = rows, keys
    f = inputs.features
    f = f._replace(positions=jnp.asarray([r0, c0, r0 - c0 + case.s - case.t], jnp.int32),
                   q_segment_ids=_sliced(f.q_segment_ids, 1, r0, nr),
                   kv_segment_ids=_sliced(f.kv_segment_ids, 1, c0, nc))
    bias = _sliced(_sliced(inputs.bias, 2, r0, nr), 3, c0, nc)
    mask = _sliced(_sliced(inputs.mask, 2, r0, nr), 3, c0, nc)
    return Inputs(_sliced(inputs.q, 1, r0, nr), _sliced(inputs.k, 1, c0, nc),
                  _sliced(inputs.v, 1, c0, nc), bias, mask, inputs.seed, f)


def _merge(parts):
    """(out, lse) of one row block over all key blocks, from each block's (out, lse)."""
    lses = jnp.stack([lse for _, lse in parts])
    hidden = jnp.all(lses == -jnp.inf, axis=0)
    lse = jnp.where(hidden, -jnp.inf, jax.nn.logsumexp(jnp.where(hidden, 0.0, lses), axis=0))
    out = 0.0
    for o, part_lse in parts:
        w = jnp.where(part_lse == -jnp.inf, 0.0, jnp.exp(part_lse - jnp.where(hidden, 0.0, lse)))
        out = out + o * jnp.swapaxes(w, 1, 2)[..., None]
    return out, lse


def _run_forward(case: Case, tier: str, inputs: Inputs):
    """{(row block, key block): (plan, inputs, out, lse)} and the merged (out, lse)."""
    blocks = {}
    forward = jax.jit(tiers.forward, static_argnums=0)
    for rows in case.row_blocks:
        for keys in case.key_blocks:
            block = _block(case, inputs, rows, keys)
            plan = _plan(_problem(case, block), tier)
            out, lse = forward(plan, block)[:2]
            blocks[rows, keys] = (plan, block, out, lse)
    out = jnp.zeros(inputs.q.shape[:3] + (inputs.v.shape[3],), jnp.float32)
    lse = jnp.zeros(out.shape[:1] + (case.hq, case.t), jnp.float32)
    for rows in case.row_blocks:
        o, l = _merge([blocks[rows, keys][2:] for keys in case.key_blocks])
        out = out.at[:, rows[0]:rows[0] + rows[1]].set(o)
        lse = lse.at[:, :, rows[0]:rows[0] + rows[1]].set(l)
    return blocks, out, lse


def _run_backward(case: Case, blocks, inputs: Inputs, out, lse, cot):
    """(dq, dk, dv, dbias) summed over the blocks, each block given the whole sequence's
    out, lse and cotangents at its rows."""
    grads = [jnp.zeros(x.shape, jnp.float32) for x in inputs[:3]]
    dbias = None if inputs.bias is None else jnp.zeros(inputs.bias.shape, jnp.float32)
    backward = jax.jit(tiers.backward, static_argnums=0)
    per_block = {}
    for ((r0, nr), (c0, nc)), (plan, block, _, _) in blocks.items():
        at_rows = lambda x, axis: jax.lax.slice_in_dim(x, r0, r0 + nr, axis=axis)  # noqa: E731
        lse_rows = at_rows(lse, 2)
        saved = Saved(at_rows(out, 1), lse_rows,
                      jnp.zeros_like(lse_rows) if plan.problem.lse_pair else None)
        g = backward(plan, block, saved, Cotangents(at_rows(cot[0], 1), at_rows(cot[1], 2)))
        per_block[(r0, nr), (c0, nc)] = g
        grads[0] = grads[0].at[:, r0:r0 + nr].add(g[0])
        grads[1] = grads[1].at[:, c0:c0 + nc].add(g[1])
        grads[2] = grads[2].at[:, c0:c0 + nc].add(g[2])
        if dbias is not None:
            rs = slice(r0, r0 + nr) if dbias.shape[2] != 1 else slice(None)
            cs = slice(c0, c0 + nc) if dbias.shape[3] != 1 else slice(None)
            dbias = dbias.at[:, :, rs, cs].add(g[3])
    return (*grads, dbias), per_block


def _vjp(fn, inputs: Inputs, cot):
    """(fn's (out, lse), their vjp at `cot` for q, k, v and the bias), in one program."""
    def run(inputs, cot):
        def call(q, k, v, bias):
            return fn(inputs._replace(q=q, k=k, v=v, bias=bias))
        primals, vjp = jax.vjp(call, *inputs[:4])
        return primals, vjp(cot)
    return jax.jit(run)(inputs, cot)


def _merged_vjp(case: Case, inputs: Inputs, cot):
    """The XLA tier, differentiated by JAX through the blocks and their merge."""
    return _vjp(lambda x: _run_forward(case, "xla", x)[1:], inputs, cot)


@functools.cache
def _unsharded(name: str):
    """The inputs and cotangents of case `name` (or "diagonal-dropout": `DIAGONAL`), and
    the (out, lse) and (dq, dk, dv, dbias) of its whole problem on the XLA tier."""
    case = DIAGONAL if name == "diagonal-dropout" else CASES[name]
    inputs, cot = _arrays(case, seed=len(name))
    plan = _plan(_problem(case, inputs), "xla")
    return inputs, cot, *_vjp(lambda x: tuple(tiers.forward(plan, x)[:2]), inputs, cot)


def assert_close(name: str, got, want):
    """float32: non-finite entries equal, the rest within 1e-5 of max(|want|, 1)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape}, expected {want.shape}"
    finite = np.isfinite(want)
    np.testing.assert_array_equal(got[~finite], want[~finite], err_msg=f"{name}: -inf differ")
    err = float(np.max(np.abs(np.where(finite, got, 0.0) - np.where(finite, want, 0.0)),
                       initial=0.0))
    bound = 1e-5 * max(float(np.max(np.abs(np.where(finite, want, 0.0)), initial=0.0)), 1.0)
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"


def _hidden(case: Case, rows, keys) -> bool:
    """Whether causality hides every key of the block from every row."""
    (r0, nr), (c0, _) = rows, keys
    return case.causal and c0 > r0 + nr - 1 + case.s - case.t


# The interpreted Pallas kernels with dropout and a mask, and the zigzag pieces, are the
# slowest of the matrix; the Pallas tier's blocks keep their other cases here, and
# tests/test_context_parallel.py's.
_SLOW_POSITIONS = {("causal-dropout-mask", "pallas"), ("zigzag-causal", "pallas")}


@pytest.mark.parametrize("name,tier", [
    pytest.param(name, tier, id=f"{name}-{tier}",
                 marks=[pytest.mark.slow] if (name, tier) in _SLOW_POSITIONS else [])
    for tier in TIERS for name in CASES])
def test_blocks_merge_to_the_unsharded_call(name, tier):
    case = CASES[name]
    inputs, cot, (want_out, want_lse), want_grads = _unsharded(name)
    if tier == "xla":
        (out, lse), grads = _merged_vjp(case, inputs, cot)
        blocks, per_block = {}, {}
    else:
        blocks, out, lse = _run_forward(case, tier, inputs)
        grads, per_block = _run_backward(case, blocks, inputs, out, lse, cot)
    assert_close("out", out, want_out)
    assert_close("lse", lse, want_lse)
    for grad_name, got, want in zip(("dq", "dk", "dv", "dbias"), grads, want_grads):
        if want is not None:
            assert_close(grad_name, got, want)
    hidden = [pair for pair in per_block if _hidden(case, *pair)]
    assert hidden or name not in HIDDEN_BLOCKS or tier == "xla"
    for pair in hidden:  # a block that causality hides: exact zeros and lse -inf
        _, _, block_out, block_lse = blocks[pair]
        assert not np.any(np.asarray(block_out)) and np.all(np.asarray(block_lse) == -np.inf)
        for g in per_block[pair][:3]:
            assert not np.any(np.asarray(g))


@pytest.mark.parametrize("tier", list(TIERS))
def test_dropout_draws_the_unsharded_keep_decisions(tier):
    """Each row sees its diagonal key alone (window (0, 0)): out is v/(1 - rate) or 0
    exactly, in the blocks as in the unsharded call, so the keep decisions must be equal
    bit for bit, at every (row, key) the blocks place."""
    case = DIAGONAL
    inputs, _, (want_out, _), _ = _unsharded("diagonal-dropout")
    out = _run_forward(case, tier, inputs)[1]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
    kept = np.asarray(out != 0).mean()
    assert 0.3 < kept < 0.7  # the test draws: about half are kept


def _one_block(**features):
    q = jnp.ones((1, 8, 1, 16), jnp.float32)
    f = FeatureArrays(**features)
    return Inputs(q, q, q, None, None, jnp.asarray([1, 2], jnp.uint32), f), f


def test_positions_errors_name_the_rule():
    inputs, f = _one_block(positions=jnp.asarray([0, 64, 0], jnp.int32))
    problem = Problem.of(inputs.q, inputs.k, inputs.v, dropout_rate=0.1, features=f)
    plan = dispatch.plan_for_tiers(problem, "xla", "xla")
    with pytest.raises(ValueError, match=r"col0 \(positions\[1\]\) to be a multiple of "
                                         r"128.*got col0 = 64"):
        tiers.forward(plan, inputs)
    inputs, f = _one_block(positions=jnp.asarray([0, 0, 0], jnp.int32),
                           sinks=jnp.ones((1,), jnp.float32))
    plan = dispatch.plan_for_tiers(Problem.of(inputs.q, inputs.k, inputs.v, features=f),
                                   "xla", "xla")
    with pytest.raises(ValueError, match="sinks cannot be given with positions"):
        tiers.forward(plan, inputs)
    plain = dispatch.plan_for_tiers(Problem.of(inputs.q, inputs.k, inputs.v), "xla", "xla")
    with pytest.raises(ValueError, match="Problem.positions is False but"):
        tiers.forward(plain, inputs._replace(features=FeatureArrays(positions=f.positions)))


def test_decode_shapes_with_positions_run_the_generic_forward():
    sd = jax.ShapeDtypeStruct
    q, k = sd((1, 4, 8, 64), jnp.bfloat16), sd((1, 4096, 2, 64), jnp.bfloat16)
    positions = sd((3,), jnp.int32)
    problem = Problem.of(q, k, k, features=FeatureArrays(positions=positions), causal=True)
    assert not fused.uses_decode(problem)
    assert fused.uses_decode(dataclasses.replace(problem, positions=False))
    gpu = dispatch.Device(nvidia_gpu=True, name="NVIDIA H100 80GB HBM3",
                          compute_capability="9.0")
    explained = dispatch.explain(problem, device=gpu)
    kernels = [c.kernel for c in explained.plan.kernels if c.direction == "forward"]
    assert "decode" not in " ".join(kernels)


def test_kernels_with_positions_lower_for_cuda():
    """Every fused kernel and the chunked tier's Pallas steps, with positions and every
    feature they read them with, lower to Triton for CUDA."""
    sd = jax.ShapeDtypeStruct
    b, t, s, hq, hkv, d = 2, 96, 160, 4, 2, 64
    args = dict(q=sd((b, t, hq, d), jnp.float32), k=sd((b, s, hkv, d), jnp.float32),
                v=sd((b, s, hkv, d), jnp.float32), bias=sd((1, hq, t, s), jnp.float32),
                mask=sd((b, 1, t, s), jnp.bool_), seed=sd((2,), jnp.uint32),
                ids=(sd((b, t), jnp.int32), sd((b, s), jnp.int32)),
                lengths=(sd((b,), jnp.int32), sd((b,), jnp.int32)),
                positions=sd((3,), jnp.int32), rows=sd((b, hq, t), jnp.float32))

    def kernels(q, k, v, bias, mask, seed, ids, lengths, positions, rows):
        f = FeatureArrays(*ids, *lengths, positions=positions)
        inputs = Inputs(q, k, v, bias, mask, seed, f)
        problem = Problem.of(q, k, v, bias, mask, causal=True, dropout_rate=0.1, features=f,
                             window=(40, 8))
        back = BackwardRows(q, rows, rows, rows)
        fwd = FwdConfig(block_m=32, block_n=32, block_d=32, block_dv=32)
        bwd = BwdConfig(block_m=32, block_n=32, block_d=32, block_slice=32)
        logits = jnp.zeros((b, hq, 32, 64), jnp.float32)
        offsets = jnp.asarray([32, 64], jnp.int32)
        return (fwd_generic(problem, fwd, inputs), bwd_exact_rows(problem, bwd, inputs, back),
                bwd_generic_dq(problem, bwd, inputs, back),
                bwd_generic_dkdv(problem, bwd, inputs, back),
                bwd_dbias(problem, bwd, inputs, back),
                softmax_rows(problem, logits, offsets, inputs, out_dtype=jnp.float32),
                softmax_grad(problem, GradBlock(logits, logits, rows[:, :, :32],
                                                rows[:, :, :32], offsets), inputs,
                             out_dtype=jnp.float32))

    text = jax.jit(kernels).trace(**args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") >= 7
