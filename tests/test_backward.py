"""Gradients of the Pallas path (custom_vjp + backward kernels) against the gradients of
the float64 reference: odd head dims, T != S, GQA/MQA, every bias broadcast shape,
causal, fully masked rows, all dtypes; finite differences; determinism; jit/vmap."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from attn_testing import (Case, assert_forward_matches, assert_matches_reference, cotangents,
                          make_inputs, reference_vjp)
from conftest import call_kwargs, interpret_flag


def _pallas_grads(case: Case, mode: str, q, k, v, bias, mask, d_out, d_lse, *,
                  outputs: str = "both", tier: str = "pallas", eager: bool = False):
    """Gradients of <out, d_out> + <lse, d_lse>, under jax.jit (as a training step takes
    them) or, with `eager`, eagerly. With outputs="out" ("lse") the function differentiated
    returns out (lse) alone, so the other output's cotangent reaches the custom_vjp as a
    symbolic zero, as in a loss of that output only."""
    def f(q, k, v, bias):
        out, lse = ffpa_jax.attention(q, k, v, bias, mask, scale=case.scale,
                                      is_causal=case.causal, return_lse=True,
                                      **call_kwargs(tier, mode))
        return {"both": (out, lse), "out": out, "lse": lse}[outputs]

    def grads(q, k, v, bias, d_out, d_lse):
        primal, vjp = jax.vjp(f, q, k, v, bias)
        d_out = d_out.astype(q.dtype)
        return primal, vjp({"both": (d_out, d_lse), "out": d_out, "lse": d_lse}[outputs])
    return (grads if eager else jax.jit(grads))(q, k, v, bias, d_out, d_lse)


def check_grads(case: Case, mode: str, tier: str = "pallas", *, inputs=None,
                outputs: str = "both", eager: bool = False):
    q, k, v, bias, mask = make_inputs(case) if inputs is None else inputs
    d_out, d_lse = cotangents(case)
    d_out = d_out.astype(q.dtype).astype(jnp.float32)  # the cotangent as the kernel sees it
    if outputs == "out":
        d_lse = jnp.zeros_like(d_lse)
    elif outputs == "lse":
        d_out = jnp.zeros_like(d_out)
    primal, got = _pallas_grads(case, mode, q, k, v, bias, mask, d_out, d_lse,
                                outputs=outputs, tier=tier, eager=eager)
    *ref_forward, ref = reference_vjp(case, q, k, v, bias, mask, d_out, d_lse, float64=True)
    *xla_forward, xla = reference_vjp(case, q, k, v, bias, mask, d_out, d_lse, float64=False)
    # The forward that the backward differentiates (saving its residuals) is checked too.
    out, lse = {"both": primal, "out": (primal, None), "lse": (None, primal)}[outputs]
    assert out is None or out.dtype == q.dtype
    assert_forward_matches(out, lse, ref_forward, xla_forward, q.dtype)
    names = ["dq", "dk", "dv", "dbias"]
    for name, g, r, x, primal in zip(names, got, ref, xla, (q, k, v, bias)):
        if primal is None:
            assert g is None
            continue
        assert g.shape == primal.shape and g.dtype == primal.dtype, (name, g.shape, g.dtype)
        # The computation's precision is q/k/v's (a float32 bias with bf16 inputs
        # still gets a gradient computed from bf16 operands).
        assert_matches_reference(name, g, r, x, q.dtype, factor=3.0)
    return got


SHAPES = [
    Case(b=2, t=113, s=203, hq=2, hkv=2, d=40),
    Case(t=1, s=113, hq=6, hkv=2, d=59),
    Case(t=203, s=1, hq=3, hkv=1, d=111),
    Case(t=150, s=90, hq=2, hkv=1, d=32, dv=48),
    Case(t=64, s=77, hq=2, hkv=2, d=320, dv=192),
    Case(t=33, s=65, hq=2, hkv=1, d=512),
    Case(t=40, s=50, hq=1, hkv=1, d=1000),
]


# D = 1000 in bf16 with `-m slow`: its float16 and float32 twins stay (test_grad_other_dtypes).
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c.d == 1000 else c
                                  for c in SHAPES],
                         ids=lambda c: f"T{c.t}-S{c.s}-H{c.hq}.{c.hkv}-D{c.d}.{c.head_dim_v}")
def test_grad_shapes_bf16(case, kernel_mode, tier):
    check_grads(case, kernel_mode, tier)


def test_eager_gradients(kernel_mode, tier):
    """The matrix differentiates under jax.jit; eagerly, the custom_vjp's forward and
    backward run one operation at a time."""
    check_grads(Case(b=2, t=37, s=70, hq=4, hkv=2, d=48, bias_shape=(4, 1, 70),
                     mask_shape=(2, 1, 37, 70), causal=True), kernel_mode, tier, eager=True)


# D = 40 and 320 with `-m slow` (D = 59, and S = 1 at D = 111, stay).
@pytest.mark.parametrize("case,outputs", [
    pytest.param(SHAPES[0], "out", marks=pytest.mark.slow),
    pytest.param(SHAPES[0], "lse", marks=pytest.mark.slow),
    (SHAPES[2], "out"), (SHAPES[2], "lse"),
    pytest.param(SHAPES[4], "out", marks=pytest.mark.slow),
    pytest.param(SHAPES[4], "lse", marks=pytest.mark.slow),
    (Case(b=2, t=113, s=70, hq=6, hkv=2, d=59, causal=True), "out"),
    (Case(b=2, t=113, s=70, hq=6, hkv=2, d=59, causal=True), "lse"),
], ids=lambda x: x if isinstance(x, str) else f"T{x.t}-S{x.s}-H{x.hq}.{x.hkv}-D{x.d}")
def test_grad_of_one_output(case, outputs, kernel_mode, tier):
    """A loss of out alone (the lse cotangent a symbolic zero: dS enters the matmuls in one
    16-bit word) or of lse alone (the output's cotangent a symbolic zero). S=1 with out
    alone has dq exactly 0, so the rule's bound is 0 there: it failed (~1e-6, from δ =
    rowsum(dO ∘ O)) until 16-bit rows that fit one tile took δ from the tile's own P and dP."""
    check_grads(case, kernel_mode, tier, outputs=outputs)


# float16 at D = 59 and 320 with `-m slow`: their bfloat16 twins (test_grad_shapes_bf16) and
# float16 at D = 40 and 1000 stay.
@pytest.mark.parametrize(("case", "dtype"), [
    pytest.param(c, dtype, marks=pytest.mark.slow) if dtype == "float16" and c.d in (59, 320)
    else (c, dtype) for c in (SHAPES[0], SHAPES[1], SHAPES[4], SHAPES[6])
    for dtype in ("float16", "float32")], ids=lambda x: x if isinstance(x, str) else f"D{x.d}")
def test_grad_other_dtypes(case, dtype, kernel_mode, tier):
    check_grads(dataclasses.replace(case, dtype=dtype), kernel_mode, tier)


# The square (64, 64) with `-m slow`: T < S, T > S (rows without keys) and T = 1 stay.
@pytest.mark.parametrize("t,s", [(113, 203), (203, 113), (1, 113),
                                 pytest.param(64, 64, marks=pytest.mark.slow)])
def test_grad_causal(t, s, kernel_mode, tier):
    check_grads(Case(b=2, t=t, s=s, hq=6, hkv=2, d=59, causal=True), kernel_mode, tier)


# Each 4-D shape that `validation.as_4d` makes of a caller's bias once ((70,) is
# (1, 1, 1, 70) to every tier; its gradient is reshaped back to the caller's rank).
BIAS_SHAPES = [(37, 70), (70,), (2, 1, 1, 70), (1, 4, 1, 70), (1, 4, 37, 70),
               (2, 4, 37, 70), (2, 1, 37, 1), (4, 37, 1), (1, 1, 1, 1)]


# With `-m slow`: shapes whose every broadcast dim another shape of the list also takes
# ((1, 4, 37, 70) within (2, 4, 37, 70); (2, 1, 1, 70) within (1, 4, 1, 70) and (70,);
# (4, 37, 1) within (2, 1, 37, 1)).
_SLOW_BIAS_SHAPES = {(1, 4, 37, 70), (2, 1, 1, 70), (4, 37, 1)}


@pytest.mark.parametrize("shape", [pytest.param(s, marks=pytest.mark.slow)
                                   if s in _SLOW_BIAS_SHAPES else s for s in BIAS_SHAPES],
                         ids=str)
def test_grad_bias_broadcast(shape, kernel_mode, tier):
    """The bias gradient has the caller's shape, summed over its broadcast dims."""
    check_grads(Case(b=2, t=37, s=70, hq=4, hkv=2, d=48, bias_shape=shape), kernel_mode, tier)


@pytest.mark.parametrize("shape", [(37, 70), (2, 1, 1, 70), (1, 4, 37, 70)], ids=str)
def test_grad_mask(shape, kernel_mode, tier):
    check_grads(Case(b=2, t=37, s=70, hq=4, hkv=2, d=48, mask_shape=shape, causal=True),
                kernel_mode, tier)


def test_grad_fully_masked_rows_are_zero(kernel_mode, tier):
    """Rows with no visible key: zero gradient into q, no NaN anywhere."""
    case = Case(b=1, t=40, s=60, hq=4, hkv=2, d=40, mask_shape=(1, 4, 40, 60),
                bias_shape=(1, 4, 40, 60))
    q, k, v, bias, mask = make_inputs(case)
    mask = mask.at[:, :, 5, :].set(False)
    bias = bias.at[:, 2, 9, :].set(-jnp.inf)
    dq, dk, dv, dbias = check_grads(case, kernel_mode, tier, inputs=(q, k, v, bias, mask))
    assert np.all(np.asarray(dq, np.float32)[0, 5] == 0.0)
    assert np.all(np.asarray(dq, np.float32)[0, 9, 2] == 0.0)
    assert np.all(np.asarray(dbias)[0, :, 5] == 0.0)
    for g in (dq, dk, dv, dbias):
        assert not np.isnan(np.asarray(g, np.float32)).any()


def test_grad_causal_more_queries_than_keys_no_nan(kernel_mode, tier):
    """T > S causal: the first T - S rows see nothing; gradients stay finite and exact."""
    dq, *_ = check_grads(Case(b=1, t=90, s=30, hq=2, hkv=1, d=64, causal=True), kernel_mode,
                         tier)
    assert np.all(np.asarray(dq, np.float32)[:, :60] == 0.0)


def test_finite_differences_float32():
    """The Pallas gradient itself (no reference involved) against central differences."""
    case = Case(b=1, t=7, s=9, hq=2, hkv=1, d=5, dv=3, dtype="float32", bias_shape=(2, 1, 9),
                causal=True)
    q, k, v, bias, _ = make_inputs(case)

    def loss(q, k, v, bias):
        out, lse = ffpa_jax.attention(q, k, v, bias, is_causal=True, return_lse=True,
                                      implementation="pallas", interpret=True)
        return jnp.sum(jnp.sin(out)) + 0.1 * jnp.sum(lse)

    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, bias)
    rng = np.random.default_rng(0)
    eps = 1e-2
    for i, x in enumerate((q, k, v, bias)):
        direction = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)
        args = [q, k, v, bias]
        plus, minus = list(args), list(args)
        plus[i] = x + eps * direction
        minus[i] = x - eps * direction
        numeric = (loss(*plus) - loss(*minus)) / (2 * eps)
        analytic = jnp.sum(grads[i] * direction)
        assert abs(float(numeric - analytic)) <= 2e-3 * max(1.0, abs(float(analytic))), \
            (i, float(numeric), float(analytic))


def test_backward_is_deterministic(kernel_mode):
    """Same inputs, same gradients, bit for bit (no atomics anywhere)."""
    case = Case(b=2, t=70, s=90, hq=6, hkv=2, d=64, bias_shape=(1, 6, 1, 90), causal=True)
    q, k, v, bias, mask = make_inputs(case)
    d_out, d_lse = cotangents(case)
    runs = 10 if kernel_mode == "gpu" else 2
    first = _pallas_grads(case, kernel_mode, q, k, v, bias, mask, d_out, d_lse)
    for _ in range(runs - 1):
        again = _pallas_grads(case, kernel_mode, q, k, v, bias, mask, d_out, d_lse)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again), strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_grad_under_jit_and_vmap_and_compile_cache(kernel_mode):
    """A Flax-style loss (params pytree, apply function) under jit(grad(...)), vmapped
    over a leading axis; the second call with new values reuses the compiled step."""
    interpret = interpret_flag(kernel_mode)
    d, heads = 32, 2

    def init(key):
        k1, k2 = jax.random.split(key)
        return {"wqkv": jax.random.normal(k1, (d, 3, heads, d)) * d ** -0.5,
                "wo": jax.random.normal(k2, (heads, d, d)) * d ** -0.5}

    def apply(params, x):
        # float32 projections at full precision (no TF32 on a GPU): the vmapped and the
        # looped steps then differ only in the order of float32 sums (and where that flips
        # a bfloat16 rounding of q, k or v; measured 2e-5 of the values on the CPU).
        qkv = jnp.einsum("btc,cnhd->nbthd", x, params["wqkv"],
                         precision="highest").astype(jnp.bfloat16)
        out = ffpa_jax.attention(qkv[0], qkv[1], qkv[2], is_causal=True,
                                 implementation="pallas", interpret=interpret)
        return jnp.einsum("bthd,hdc->btc", out.astype(jnp.float32), params["wo"],
                          precision="highest")

    def loss(params, x):
        return jnp.mean(apply(params, x) ** 2)

    params = init(jax.random.key(0))
    xs = jax.random.normal(jax.random.key(1), (3, 2, 24, d))  # 3 = vmapped axis
    step = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))
    grads = step(params, xs)
    looped = [jax.grad(loss)(params, xs[i]) for i in range(3)]
    for key in params:
        np.testing.assert_allclose(np.asarray(grads[key]), np.stack([g[key] for g in looped]),
                                   rtol=1e-3, atol=1e-5)
    step(params, xs + 1.0)
    assert step._cache_size() == 1


# A bias constant along the keys (last dim 1) only shifts lse: its exact gradient from the
# output is 0 and from lse is d_lse summed over its broadcast dims. The GPU fuzz found the
# kernel's Σ_j dS_ij off by the forward's 16-bit rounding of P there (1.5% of the value);
# these are the inputs it failed on (seed 1), with the mask, MQA and float16 bias.
@pytest.mark.parametrize("bias_shape,dropout_rate", [((1, 1, 1, 1), 0.0), ((1, 1, 1, 1), 0.3),
                                                     ((1, 3, 14, 1), 0.3), ((1,), 0.0)],
                         ids=["scalar", "scalar-drop", "per-row-drop", "rank1"])
def test_grad_of_key_constant_bias(bias_shape, dropout_rate, kernel_mode, tier):
    from test_fuzz import Config, check_example
    cfg = Config(batched=True, b=1, t=14, s=46, hq=3, hkv=1, d=54, dv=54, dtype="bfloat16",
                 causal=False, bias_shape=bias_shape, bias_dtype="float16", mask_shape=(1, 46),
                 scale=None, dropout_rate=dropout_rate, with_grads=True)
    kw = call_kwargs(tier, kernel_mode)
    check_example(cfg, seed=1, magnitude=1.0, mask_density=0.5, neg_inf_bias_rows=False,
                  impl=kw["implementation"], interpret=kw["interpret"])


def test_grad_float32_d256_small_dv(kernel_mode):
    """The GPU fuzz's shared-memory overflow (dq at float32, D=256: 238080 of 232448
    bytes), with its row-constant bias and per-head mask."""
    from test_fuzz import Config, check_example
    cfg = Config(batched=False, b=1, t=68, s=42, hq=6, hkv=2, d=256, dv=26, dtype="float32",
                 causal=False, bias_shape=(1, 68, 1), bias_dtype="float16",
                 mask_shape=(6, 1, 42), scale=None, dropout_rate=0.0, with_grads=True)
    check_example(cfg, seed=3, magnitude=1.0, mask_density=0.5, neg_inf_bias_rows=False,
                  impl="pallas", interpret=interpret_flag(kernel_mode))


def test_grad_float32_d44_dv107_causal_mask(kernel_mode):
    """A shared-memory overflow the GPU fuzz found (float32, D=44, Dv=107 in the
    128-wide tiles: 245760 of 232448 bytes), causal with a per-head key mask."""
    from test_fuzz import Config, check_example
    cfg = Config(batched=True, b=1, t=57, s=358, hq=4, hkv=2, d=44, dv=107, dtype="float32",
                 causal=True, bias_shape=None, bias_dtype="float32", mask_shape=(1, 4, 1, 358),
                 scale=1.217, dropout_rate=0.0, with_grads=True)
    check_example(cfg, seed=131071, magnitude=2.0, mask_density=0.9, neg_inf_bias_rows=False,
                  impl="pallas", interpret=interpret_flag(kernel_mode))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grad_single_visible_key_is_exactly_zero_dq(dtype, kernel_mode):
    """A row that sees one key has P = 1 and dS = dP - Σ P·dP = 0 exactly, as in XLA's
    softmax gradient: dq of that row is exactly 0, with dropout too. With δ taken as
    rowsum(dO ∘ O), which rounds differently from the kernels' dP, a GPU fuzz draw
    (float32, D=1024, T=1, S=10, dropout 0.9) got dq 52x XLA's error; float32
    takes δ from `bwd_exact_rows`, and 16-bit from each tile (`rows_in_one_tile`: here
    S=10 fits one)."""
    b, t, s, hq, hkv, d = 2, 3, 10, 4, 2, 256
    kq, kk, kv, ko, kr = jax.random.split(jax.random.key(11), 5)
    q = (2.0 * jax.random.normal(kq, (b, t, hq, d), jnp.float32)).astype(dtype)
    k = (2.0 * jax.random.normal(kk, (b, s, hkv, d), jnp.float32)).astype(dtype)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.float32).astype(dtype)
    d_out = jax.random.normal(ko, (b, t, hq, d), jnp.float32).astype(dtype)
    # Row 0 sees key 3 only, row 1 keys 3 and 7, row 2 every key.
    mask = np.zeros((t, s), bool)
    mask[0, 3] = True
    mask[1, [3, 7]] = True
    mask[2] = True
    interpret = interpret_flag(kernel_mode)

    def f(q):
        return ffpa_jax.attention(q, k, v, mask=jnp.asarray(mask), dropout_rate=0.5,
                                  dropout_rng=kr, interpret=interpret)
    out, vjp = jax.vjp(f, q)  # (lse's own gradient would not be 0: lse = the one logit)
    (dq,) = vjp(d_out)
    dq = np.asarray(dq)
    # Where dropout drops the one key, out and dq are 0 whatever δ is; the test needs
    # (b, h) pairs that keep it.
    assert (np.abs(np.asarray(out, np.float32)[:, 0]).max(-1) > 0).sum() >= 2
    dq = dq.astype(np.float32)
    np.testing.assert_array_equal(dq[:, 0], 0.0)
    assert np.abs(dq[:, 2]).max() > 0.0  # the row that sees every key does get a gradient


# float32 draws of the GPU fuzz whose gradients missed the rule (their fuzz seeds:
# docs/history.md, session 17), with the check_example arguments that reproduce them:
# - "d150-large-logits": inputs of magnitude 2 and scale 0.805
#   (logits ~ 170), a per-key fp16 bias; dq 3.4x XLA's float32 error (3.4x in the Pallas
#   interpreter too). The backward's P did not sum to 1 over its row (its logits were
#   rounded differently from the forward's), and that miss times |δ| ~ 27 dominated dS.
# - "d1024-one-key-dropout": T=1, S=10, dropout 0.9, keys mostly
#   masked; dq 1.66e-5 against the 1e-5 bound (XLA: 3.2e-7): δ = rowsum(dO ∘ O) did not
#   cancel the kernels' own dP (see test_grad_single_visible_key_is_exactly_zero_dq).
# - "d1024-causal-dropout" (found after both fixes below): dk 3.6x XLA's
#   error; the float32 dP was one in-order FMA chain over Dv = 1024.
# The fixes: the backward normalises its own P and takes δ = Σ P·dP
# (`pallas_kernels.bwd.bwd_exact_rows`), and float32 kernels sum 16-wide head-dim chunks
# (`common.FLOAT32_CHUNK`) exactly (`common.contract_chunks(compensated=True)`); with
# them the first draw's dq is 1.07x XLA's error in the interpreter (docs/benchmarks.md).
_FLOAT32_FUZZ_DRAWS = {
    "d150-large-logits": (
        dict(batched=True, b=1, t=10, s=208, hq=3, hkv=1, d=150, dv=150, causal=False,
             bias_shape=(208,), bias_dtype="float16", mask_shape=None, scale=0.805,
             dropout_rate=0.0),
        dict(seed=5031840, magnitude=2.0, mask_density=0.9, neg_inf_bias_rows=False)),
    "d1024-one-key-dropout": (
        dict(batched=True, b=3, t=1, s=10, hq=8, hkv=2, d=1024, dv=1024, causal=False,
             bias_shape=(3, 1, 1, 1), bias_dtype="bfloat16", mask_shape=(8, 1, 10),
             scale=None, dropout_rate=0.9),
        dict(seed=1374, magnitude=2.0, mask_density=0.05, neg_inf_bias_rows=True)),
    "d1024-causal-dropout": (
        dict(batched=True, b=3, t=7, s=40, hq=3, hkv=1, d=1024, dv=1024, causal=True,
             bias_shape=(40,), bias_dtype="float32", mask_shape=None, scale=0.315,
             dropout_rate=0.3),
        dict(seed=6549926, magnitude=2.0, mask_density=0.9, neg_inf_bias_rows=False)),
}


@pytest.mark.slow  # replays of fuzz draws: with the CPU fuzz (-m slow), and on the GPU
@pytest.mark.parametrize("draw", sorted(_FLOAT32_FUZZ_DRAWS))
def test_grad_float32_fuzz_draws(draw, kernel_mode):
    from test_fuzz import Config, check_example
    config, example = _FLOAT32_FUZZ_DRAWS[draw]
    cfg = Config(dtype="float32", with_grads=True, **config)
    check_example(cfg, impl="pallas", interpret=interpret_flag(kernel_mode), **example)


def _inner_jaxprs(eqn):
    """The jaxprs nested in an equation's parameters (loop bodies, branches, calls)."""
    for p in eqn.params.values():
        inner = getattr(p, "jaxpr", None)
        if inner is not None and hasattr(inner, "eqns"):
            yield inner
        elif hasattr(p, "eqns"):
            yield p


def _kernel_dots(jaxpr, kernel_name: str) -> list[int]:
    """How many dot_generals each pallas_call named `kernel_name` in `jaxpr` (searched
    through nested jaxprs) holds in its kernel body."""
    def count(j) -> int:
        return sum((eqn.primitive.name == "dot_general") + sum(map(count, _inner_jaxprs(eqn)))
                   for eqn in j.eqns)

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "pallas_call":
                meta = eqn.params.get("name_and_src_info") or eqn.params.get("name")
                if kernel_name in str(meta):
                    yield count(eqn.params["jaxpr"])
            else:
                for inner in _inner_jaxprs(eqn):
                    yield from walk(inner)
    return list(walk(jaxpr))


def test_lse_cotangent_adds_the_split_ds_products_only_when_lse_is_differentiated():
    """Differentiating only the output leaves the lse cotangent a symbolic zero: dq and
    dK/dV keep one dS product each. Differentiating through lse feeds dS as two 16-bit
    words (one more product in each); float32 kernels take dS as it is either way."""
    q = jax.random.normal(jax.random.key(0), (1, 40, 2, 32), jnp.bfloat16)

    def dots(loss, dtype):
        x = q.astype(dtype)
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, x).jaxpr
        return _kernel_dots(jaxpr, "bwd_generic_dq"), _kernel_dots(jaxpr, "bwd_generic_dkdv")

    def out_only(q, k):
        return jnp.sum(ffpa_jax.attention(q, k, k, implementation="pallas", interpret=True)
                       .astype(jnp.float32))

    def with_lse(q, k):
        out, lse = ffpa_jax.attention(q, k, k, return_lse=True, implementation="pallas",
                                      interpret=True)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.sin(lse))

    plain_dq, plain_dkdv = dots(out_only, jnp.bfloat16)
    split_dq, split_dkdv = dots(with_lse, jnp.bfloat16)
    assert len(plain_dq) == len(split_dq) == 1 and len(plain_dkdv) == len(split_dkdv) == 1
    assert split_dq[0] == plain_dq[0] + 1, (plain_dq, split_dq)
    assert split_dkdv[0] == plain_dkdv[0] + 1, (plain_dkdv, split_dkdv)
    assert dots(with_lse, jnp.float32) == dots(out_only, jnp.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_split_words_carry_twice_the_bits(dtype):
    """dS's two 16-bit words (`common.split_words`): hi is dS rounded to nearest (exactly
    astype, but for ties), and hi + lo carries about twice the word's significant bits."""
    from pallas_kernels.numerics import split_words
    # magnitudes over 2^-20..2^12 (float16: 2^-2..2^6, where its residual stays normal)
    low, high = (-20, 12) if dtype == jnp.bfloat16 else (-2, 6)
    sign = jnp.where(jax.random.bernoulli(jax.random.key(3), 0.5, (4096,)), 1.0, -1.0)
    x = sign * jnp.exp2(jax.random.uniform(jax.random.key(4), (4096,), jnp.float32, low, high))
    hi, lo = split_words(x, dtype)
    assert hi.dtype == lo.dtype == dtype
    x64, hi64, lo64 = (np.asarray(a, np.float64) for a in (x, hi, lo))
    rounded = np.asarray(x.astype(dtype), np.float64)
    ties = np.abs(x64 - rounded) == np.abs(x64 - hi64)
    assert np.all((hi64 == rounded) | ties)
    # hi + lo against x: lo is at most half a word-ulp of hi, rounded to a word's bits again
    bits = jnp.finfo(dtype).nmant + 1
    np.testing.assert_array_less(np.abs(x64 - (hi64 + lo64)), 2.0 ** (-2 * bits) * np.abs(x64))
