"""Determinism: with `deterministic=True` the forward and backward are bitwise identical over
reruns (20 on the GPU) and across two processes (GPU); with `deterministic=False` only dQ
(summed with atomic adds) may vary, and every rerun meets the tolerance rule; `None` follows
XLA's --xla_gpu_deterministic_ops. Cases cover what could break it: GQA (dK/dV of a KV head
summed over its query heads), causal, a bias with broadcast dims (its gradient is summed
over them), a mask, dropout (the keep-mask replayed in the backward), a large head dim
(split-D tiles), and the decode path (split-KV, merged by lse).

On CPU the same checks run in interpret mode with 2 reruns (a cheap smoke test; the
cross-process check is GPU only).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from conftest import interpret_flag

TESTS_DIR = Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parent

# name: (B, T, S, Hq, Hkv, D, Dv, dtype, causal, bias shape, mask shape, dropout, grads)
GPU_CASES = {
    "gqa-causal-bias-mask-dropout": (2, 1000, 1000, 8, 2, 128, 128, "bfloat16", True,
                                     (1, 8, 1, 1000), (2, 1, 1000, 1000), 0.2, True),
    "large-d-fp16": (1, 700, 900, 4, 1, 512, 320, "float16", False, (700, 900), None, 0.0,
                     True),
    "full-bias-grad": (2, 513, 257, 4, 4, 64, 64, "bfloat16", True, (2, 4, 513, 257), None,
                       0.1, True),
    "decode": (4, 4, 8192, 32, 8, 128, 128, "bfloat16", False, None, (4, 1, 1, 8192), 0.0,
               False),
}
CPU_CASES = {
    "gqa-causal-bias-mask-dropout": (2, 40, 56, 4, 2, 32, 32, "bfloat16", True,
                                     (1, 4, 1, 56), (2, 1, 40, 56), 0.2, True),
    "decode": (1, 2, 160, 4, 1, 16, 16, "float16", False, None, (1, 1, 1, 160), 0.0, False),
}


def inputs(case, seed=0):
    """Fixed pseudo-random inputs (numpy: identical in every process)."""
    b, t, s, hq, hkv, d, dv, dtype, causal, bias_shape, mask_shape, rate, grads = case
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)

    def normal(shape):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32).astype(dt))

    q, k, v = normal((b, t, hq, d)), normal((b, s, hkv, d)), normal((b, s, hkv, dv))
    d_out, d_lse = normal((b, t, hq, dv)), jnp.asarray(rng.standard_normal((b, hq, t)),
                                                         jnp.float32)
    bias = None if bias_shape is None else jnp.asarray(rng.standard_normal(bias_shape),
                                                       jnp.float32)
    mask = None if mask_shape is None else jnp.asarray(rng.random(mask_shape) < 0.8)
    return q, k, v, bias, mask, d_out, d_lse


def make_step(case, interpret: bool, deterministic: bool = True):
    """A jitted forward+backward (or forward) of `case`, returning a dict of arrays."""
    b, t, s, hq, hkv, d, dv, dtype, causal, bias_shape, mask_shape, rate, grads = case

    @jax.jit
    def step(q, k, v, bias, mask, d_out, d_lse, rng):
        def f(q, k, v, bias):
            return ffpa_jax.attention(q, k, v, bias, mask, is_causal=causal, dropout_rate=rate,
                                      dropout_rng=rng if rate > 0 else None, return_lse=True,
                                      deterministic=deterministic, implementation="pallas",
                                      interpret=interpret)
        if not grads:
            out, lse = f(q, k, v, bias)
            return {"out": out, "lse": lse}
        (out, lse), vjp = jax.vjp(f, q, k, v, bias)
        dq, dk, dv_, dbias = vjp((d_out, d_lse))
        result = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv_}
        if dbias is not None:
            result["dbias"] = dbias
        return result

    return step


def compute(case, interpret: bool, reruns: int = 1, deterministic: bool = True):
    """Results of `reruns` calls of the same compiled step, as numpy arrays."""
    step = make_step(case, interpret, deterministic)
    args = inputs(case)
    rng = jax.random.key(1234)
    return [{name: np.asarray(x) for name, x in step(*args, rng).items()}
            for _ in range(reruns)]


def _assert_bitwise_equal(a: dict, b: dict, what: str):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape
        # Compare the bytes: NaN == NaN and -0.0 != 0.0 here, as bitwise identity means.
        same = np.array_equal(a[name].view(np.uint8), b[name].view(np.uint8))
        if not same:
            diff = np.abs(a[name].astype(np.float64) - b[name].astype(np.float64))
            raise AssertionError(f"{what}: {name} differs (max abs diff {np.nanmax(diff):.3e}, "
                                 f"{int(np.sum(diff != 0))} elements)")


def _cases(mode):
    return GPU_CASES if mode == "gpu" else CPU_CASES


@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_reruns_are_bitwise_identical(kernel_mode, name):
    cases = _cases(kernel_mode)
    if name not in cases:
        pytest.skip("GPU-only case")
    reruns = 20 if kernel_mode == "gpu" else 2
    results = compute(cases[name], interpret_flag(kernel_mode), reruns)
    for out in results:  # (lse is -inf on rows without keys: causal with T > S)
        assert not any(np.isnan(x).any() for x in out.values()), "a NaN"
    for i, again in enumerate(results[1:], start=2):
        _assert_bitwise_equal(results[0], again, f"{name}: rerun {i} vs rerun 1")


def test_a_new_dropout_key_changes_the_result(kernel_mode):
    """Guards the rerun test against a vacuous pass: the step really depends on its inputs
    (a different dropout key gives a different output)."""
    case = _cases(kernel_mode)["gqa-causal-bias-mask-dropout"]
    step = make_step(case, interpret_flag(kernel_mode))
    args = inputs(case)
    a = np.asarray(step(*args, jax.random.key(1234))["out"])
    b = np.asarray(step(*args, jax.random.key(1235))["out"])
    assert not np.array_equal(a, b)


_CHILD = """
import sys
import numpy as np
sys.path.insert(0, {tests!r})
sys.path.insert(0, {root!r})
import test_determinism as t
result = t.compute(t.GPU_CASES[{name!r}], interpret=False)[0]
t.save_raw({path!r}, result)
"""


def save_raw(path, result: dict) -> None:
    """Save arrays as their raw bits plus dtype names (np.savez cannot store bfloat16)."""
    raw = {name: x.view(f"u{x.dtype.itemsize}") for name, x in result.items()}
    raw.update({f"{name}.dtype": np.asarray(x.dtype.name) for name, x in result.items()})
    np.savez(path, **raw)


def load_raw(path) -> dict:
    data = np.load(path)
    names = [n for n in data.files if not n.endswith(".dtype")]
    return {n: data[n].view(jnp.dtype(str(data[f"{n}.dtype"]))) for n in names}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_CASES))
def test_two_processes_agree_bitwise(tmp_path, name):
    """A fresh process (its own compilation, autotuning state, allocator) computes the very
    same bits."""
    path = tmp_path / f"{name}.npz"
    script = _CHILD.format(tests=str(TESTS_DIR), root=str(REPO_ROOT), name=name, path=str(path))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # this process already holds most memory
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    child = load_raw(path)
    here = compute(GPU_CASES[name], interpret=False)[0]
    _assert_bitwise_equal(here, child, f"{name}: this process vs a child process")
    print(json.dumps({k: v.shape for k, v in here.items()}, default=str))


# ---------------------------------------------------------------- deterministic=False


# (B, T, S, Hq, Hkv, D, dtype, causal, bias shape, mask shape): GQA, causal, a bias with
# broadcast dims, a mask (its block lists), T != S.
FAST_GPU_CASE = (2, 1000, 1200, 8, 2, 128, "bfloat16", True, (1, 8, 1, 1200), (2, 1, 1000, 1200))
FAST_CPU_CASE = (1, 40, 56, 4, 2, 32, "bfloat16", True, (1, 4, 1, 56), (1, 1, 40, 56))


def test_fast_backward_reruns_differ_only_in_dq_within_the_tolerance_rule(kernel_mode):
    """deterministic=False, 20 reruns on the GPU (2 interpreted): out, lse, dK, dV and dbias
    are bitwise identical (reduced inside their programs); dQ, summed with float32 atomic
    adds, may differ in its last bits, and every rerun's gradients meet the tolerance rule
    against the float64 reference. Prints the largest rerun-to-rerun |Δ| of dQ."""
    from attn_testing import Case, assert_matches_reference, make_inputs
    from test_backward import _cotangents, _reference_grads

    b, t, s, hq, hkv, d, dtype, causal, bias_shape, mask_shape = (
        FAST_GPU_CASE if kernel_mode == "gpu" else FAST_CPU_CASE)
    case = Case(b=b, t=t, s=s, hq=hq, hkv=hkv, d=d, dtype=dtype, causal=causal,
                bias_shape=bias_shape, mask_shape=mask_shape, mask_density=0.8)
    q, k, v, bias, mask = make_inputs(case)
    d_out, d_lse = _cotangents(case)
    d_out = d_out.astype(q.dtype).astype(jnp.float32)
    interpret = interpret_flag(kernel_mode)

    @jax.jit
    def step(q, k, v, bias, d_out, d_lse):
        def f(q, k, v, bias):
            return ffpa_jax.attention(q, k, v, bias, mask, is_causal=causal, return_lse=True,
                                      deterministic=False, implementation="pallas",
                                      interpret=interpret)
        (out, lse), vjp = jax.vjp(f, q, k, v, bias)
        return (out, lse, *vjp((d_out.astype(out.dtype), d_lse)))

    reruns = 20 if kernel_mode == "gpu" else 2
    results = [[np.asarray(x) for x in step(q, k, v, bias, d_out, d_lse)]
               for _ in range(reruns)]
    names = ["out", "lse", "dq", "dk", "dv", "dbias"]
    for again in results[1:]:
        for name, x, y in zip(names, results[0], again):
            if name != "dq":
                assert np.array_equal(x.view(np.uint8), y.view(np.uint8)), name
    dqs = np.stack([r[2].astype(np.float32) for r in results])
    spread = float(np.max(np.abs(dqs - dqs[0])))
    magnitude = float(np.max(np.abs(dqs[0])))
    ref = _reference_grads(case, q, k, v, bias, mask, d_out, d_lse, float64=True)
    xla = _reference_grads(case, q, k, v, bias, mask, d_out, d_lse, float64=False)
    for i, r in enumerate(results):
        for name, got, want, same in zip(names[2:], r[2:], ref, xla):
            assert_matches_reference(f"rerun {i + 1} {name}", got, want, same, q.dtype,
                                     factor=3.0)
    print(json.dumps({"fast_backward_reruns": reruns, "case": case.__repr__(),
                      "max_abs_delta_dq": spread, "max_abs_dq": magnitude,
                      "dq_elements_that_vary": int(np.sum(np.any(dqs != dqs[0], axis=0)))}))
    # Beyond the rule: reruns differ by a few roundings of dQ's float32 sums to 16 bits.
    assert spread <= 4 * float(jnp.finfo(q.dtype).eps) * max(magnitude, 1e-30)


@pytest.mark.parametrize("flags,expected", [
    ("", False),
    ("--xla_gpu_deterministic_ops", True),
    ("--xla_gpu_deterministic_ops=true", True),
    ("--xla_gpu_deterministic_ops=True", True),
    ("--xla_gpu_deterministic_ops=TRUE", True),
    ("--xla_gpu_deterministic_ops=1", True),
    ("--xla_gpu_deterministic_ops=false", False),
    ("--xla_gpu_deterministic_ops=0", False),
    ("--xla_gpu_deterministic_ops='true'", True),
    ('--xla_dump_to=/tmp/x --xla_gpu_deterministic_ops=true --xla_backend_optimization_level=0',
     True),
    ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=false", False),
    ("--xla_gpu_deterministic_ops=false --xla_gpu_deterministic_ops", True),
    ("--xla_gpu_deterministic_ops=yes", False),  # XLA rejects it: not set
    ("--xla_gpu_deterministic_ops_something=true", False),  # another flag
    ("-xla_gpu_deterministic_ops=true", False),  # XLA's flags take two dashes
    ("--xla_gpu_exclude_nondeterministic_ops=true", False),
])
def test_xla_flags_decide_none(flags, expected):
    from ffpa_jax import determinism
    assert determinism.xla_deterministic_ops(flags) is expected


def _backward_kernels(monkeypatch, xla_flags: str | None, deterministic, *, flax=False) -> set:
    """The backward kernels a traced gradient launches under XLA_FLAGS = `xla_flags`."""
    from ffpa_jax.flax_attention import flax_attention_fn

    if xla_flags is None:
        monkeypatch.delenv("XLA_FLAGS", raising=False)
    else:
        monkeypatch.setenv("XLA_FLAGS", xla_flags)
    q = jnp.ones((1, 40, 2, 32), jnp.bfloat16)

    def loss(q):
        if flax:
            out = flax_attention_fn(q, q, q, deterministic_backward=deterministic,
                                    implementation="pallas", interpret=True)
        else:
            out = ffpa_jax.attention(q, q, q, deterministic=deterministic,
                                     implementation="pallas", interpret=True)
        return jnp.sum(out.astype(jnp.float32))

    text = str(jax.make_jaxpr(jax.grad(loss))(q))
    return {name for name in ("bwd_generic_dq", "bwd_generic_dkdv", "bwd_fused_atomic")
            if name in text}


@pytest.mark.parametrize("flax", [False, True], ids=["attention", "flax_attention_fn"])
def test_deterministic_argument_picks_the_backward(monkeypatch, flax):
    """None follows XLA_FLAGS (read when the call is traced); True and False override it.
    The Flax adapter passes its `deterministic_backward` through (Flax's own
    `deterministic` keeps meaning "no dropout")."""
    slow, fast = {"bwd_generic_dq", "bwd_generic_dkdv"}, {"bwd_fused_atomic"}
    on = "--xla_backend_optimization_level=0 --xla_gpu_deterministic_ops=true"
    assert _backward_kernels(monkeypatch, None, None, flax=flax) == fast
    assert _backward_kernels(monkeypatch, on, None, flax=flax) == slow
    assert _backward_kernels(monkeypatch, "--xla_gpu_deterministic_ops=0", None,
                             flax=flax) == fast
    assert _backward_kernels(monkeypatch, on, False, flax=flax) == fast
    assert _backward_kernels(monkeypatch, None, True, flax=flax) == slow


def test_deterministic_must_be_none_or_a_bool():
    q = jnp.ones((1, 8, 2, 16), jnp.bfloat16)
    with pytest.raises(TypeError, match="deterministic must be None"):
        ffpa_jax.attention(q, q, q, deterministic="yes")
