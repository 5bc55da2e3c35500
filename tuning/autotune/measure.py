"""Measure candidate launch configs of one kernel on one problem: the autotuner's core.

Used by the autotune CLI's workers (one process per GPU) and by
`ffpa_jax.runtime_autotune`; nothing imports it at `import tuning` time.

For each candidate (search_space order, the built-in default first):
1. Lower and compile it (in a thread pool). A candidate that fails to compile
   (shared memory overflow, a lowering error) is discarded.
2. Run it once and check its outputs against
   a. an independent float32 reference in plain jnp, evaluated at a few sampled
      query rows / key columns (cheap at any size: no [T, S] matrix), and
   b. the outputs of the first candidate that passed (normally the built-in
      default), in full.
   A candidate that disagrees with either is discarded, never timed.
3. Time it: one probe call; a candidate already `prune` times slower than the
   best so far is dropped; the others are timed over a few repetitions.
The fastest surviving candidate wins. Nothing that failed is ever returned.

Kernels are run through `RUNNERS`, a `KernelRunner` (how to build its inputs, launch
it and check it) per kernel of `pallas_kernels.KERNEL_DESCRIPTORS`, made by the runner of
the kernel's role (`_ROLES`). A kernel without a runner is reported as unsupported (and its
tasks skipped); a kernel that does not take `dropout_rate` has its dropout tasks skipped.
A new kernel of a known role is tuned once it has its descriptor.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import math
import os
import statistics
import sys
import time
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import KERNEL_DESCRIPTORS, BwdConfig, KernelDescriptor, reference
from pallas_kernels.common import capped_for_rounding
from pallas_kernels.problem import DTYPES, Problem
from tuning import timing
from tuning.autotune import search_space
from tuning.autotune.tasks import Task
from tuning.device import multiprocessor_count

_SEED = (0x1234ABCD, 0x0BADF00D)
_N_SAMPLES = 8  # sampled query rows / key columns per sampled head


@dataclasses.dataclass(frozen=True)
class Settings:
    """How hard to look. `fast` is sized so a 5×4 grid fits in a quarter hour on an H200."""

    prune: float  # drop a candidate whose probe is this many times the best so far
    min_sample_s: float  # each timing sample loops the kernel for at least this long
    reps_short: int  # timing samples for kernels under 50 ms
    reps_long: int  # timing samples for longer kernels
    task_budget_s: float  # stop trying more candidates of one task after this
    compile_workers: int
    warmup_s: float = 0.05  # run the first timed candidate this long before timing it

    @classmethod
    def for_mode(cls, mode: str) -> "Settings":
        workers = max(1, min(8, (os.cpu_count() or 2) - 1))
        if mode == "fast":
            return cls(prune=1.5, min_sample_s=0.01, reps_short=3, reps_long=1,
                       task_budget_s=90.0, compile_workers=workers)
        if mode == "max":
            return cls(prune=3.0, min_sample_s=0.05, reps_short=5, reps_long=3,
                       task_budget_s=900.0, compile_workers=workers, warmup_s=0.2)
        raise ValueError(f"mode must be 'fast' or 'max'; got {mode!r}")


# ------------------------------------------------------------------ inputs


class Inputs:
    """Device arrays of one problem, plus lazily computed forward outputs.

    `o`, `lse` come from the forward kernel under the first fast-mode candidate
    that passes the sampled reference check (normally the built-in default);
    `delta` = rowsum(dO ∘ O) in jnp (what bwd_preproc computes, with dlse = 0; a
    float32 backward takes δ from bwd_exact_rows instead, equal up to rounding, which
    does not matter for timing the dq/dkdv candidates).
    """

    def __init__(self, spec: Problem, *, interpret: bool):
        self.spec, self.interpret = spec, interpret
        key = jax.random.key(spec.seq_q * 7919 + spec.seq_k * 104729 + spec.head_dim)
        self.q, self.k, self.v, self.do, self.bias = _random_inputs(key, spec=spec)
        # A mask for runtime autotune of masked calls: all True (every tile visited).
        self.mask = None if spec.mask_shape is None else jnp.ones(spec.mask_shape, bool)
        self.seed = (None if spec.dropout_rate == 0.0
                     else jnp.asarray(_SEED, dtype=jnp.uint32))
        self._fwd: tuple[jax.Array, jax.Array] | None = None
        self._delta: jax.Array | None = None
        self._partials: tuple[jax.Array, jax.Array] | None = None  # decode stage 1's

    def forward_outputs(self) -> tuple[jax.Array, jax.Array]:
        if self._fwd is None:
            runner = RUNNERS["fwd_generic"]
            reasons = []
            for cfg in search_space.candidates("fwd_generic", headdim=self.spec.headdim,
                                               dtype=self.spec.dtype_name, mode="fast"):
                try:
                    fn = runner.launcher(cfg, self.spec, self.interpret)
                    out = jax.jit(fn)(*runner.args(self))
                    jax.block_until_ready(out)
                except Exception as exc:  # noqa: BLE001 - try the next candidate
                    reasons.append(_first_line(exc))
                    continue
                err = runner.check(out, self)
                if err is not None and err > runner.tolerance(self.spec.dtype_name):
                    reasons.append(f"forward error {err:.3g}")
                    continue
                self._fwd = out
                break
            else:
                raise RuntimeError("no forward config produced a correct output for the "
                                   f"backward's inputs: {reasons}")
        return self._fwd

    def delta(self) -> jax.Array:
        if self._delta is None:
            o, _ = self.forward_outputs()
            prod = o.astype(jnp.float32) * self.do.astype(jnp.float32)
            self._delta = jnp.transpose(jnp.sum(prod, axis=-1), (0, 2, 1))  # [B, Hq, T]
        return self._delta


@functools.partial(jax.jit, static_argnames=("spec",))
def _random_inputs(key, *, spec: Problem):
    """Standard normal q, k, v, dO (and bias) of the problem: one compiled launch."""
    dtype = spec.dtype
    s = spec
    keys = jax.random.split(key, 5)
    shapes = [(s.batch, s.seq_q, s.heads_q, s.head_dim), (s.batch, s.seq_k, s.heads_kv, s.head_dim),
              (s.batch, s.seq_k, s.heads_kv, s.head_dim_v),
              (s.batch, s.seq_q, s.heads_q, s.head_dim_v)]
    arrays = [jax.random.normal(k, shape, dtype) for k, shape in zip(keys, shapes)]
    bias = None if s.bias_shape is None else jax.random.normal(keys[4], s.bias_shape, dtype)
    return (*arrays, bias)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


# ------------------------------------------------------------------ checks against the reference
#
# The float32 references are `pallas_kernels.reference`'s sampled ones: one jitted function of
# the problem's arrays each (static: the problem and the sampled indices), so checking a
# candidate costs one small launch, and no [T, S] matrix is ever formed.


def _sample_indices(n: int) -> tuple[int, ...]:
    picks = {0, 1, n // 3, n // 2, (2 * n) // 3, n - 2, n - 1, (7 * n) // 8}
    return tuple(sorted(i for i in picks if 0 <= i < n))[:_N_SAMPLES]


def _head_pairs(batch: int, heads: int) -> tuple[tuple[int, int], ...]:
    return tuple(sorted({(0, 0), (batch - 1, heads - 1)}))


@functools.partial(jax.jit, static_argnames=("pairs", "rows", "heads_axis"))
def _take(x, *, pairs, rows, heads_axis: int):
    """x at sampled (b, h) pairs and rows: [B, T, H, D] (heads_axis 2) -> [P, R, D];
    [B, H, T] (heads_axis 1) -> [P, R]."""
    idx = np.array(rows)
    if heads_axis == 2:
        return jnp.stack([x[b, idx, h] for b, h in pairs])
    return jnp.stack([x[b, h, idx] for b, h in pairs])


@jax.jit
def _diff_stats(got, want):
    """(all finite, max |got - want|, max |want|) in float32, on the device."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return jnp.all(jnp.isfinite(got)), jnp.max(jnp.abs(got - want)), jnp.max(jnp.abs(want))


def _rel_err(got, want) -> float:
    """max |got - want| / max |want| (inf when got holds a NaN or inf)."""
    if np.size(want) == 0:
        return 0.0
    finite, diff, scale = (np.asarray(x) for x in _diff_stats(got, want))
    if not finite:
        return math.inf
    return float(diff) / max(float(scale), 1e-6)


def _lse_err(got, want) -> float:
    """Error of an lse against its reference: -inf exactly where the reference has it,
    elsewhere the absolute difference relative to max(1, |lse|)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if not np.array_equal(np.isneginf(got), np.isneginf(want)):
        return math.inf
    finite = np.isfinite(want)
    if not np.all(np.isfinite(got[finite])):
        return math.inf
    if not finite.any():
        return 0.0
    return float(np.max(np.abs(got[finite] - want[finite]))) / max(
        1.0, float(np.max(np.abs(want[finite]))))


def _fwd_reference_err(out, inp: Inputs) -> float | None:
    """Largest error of (o, lse) at sampled rows against float32 jnp; None with dropout
    (the keep-mask lives in the kernels: such candidates are checked against the baseline)."""
    s = inp.spec
    if s.dropout_rate:
        return None
    o, lse = out
    pairs, rows = _head_pairs(s.batch, s.heads_q), _sample_indices(s.seq_q)
    ref_o, ref_lse = reference.sampled_forward(inp.q, inp.k, inp.v, inp.bias, inp.mask, s=s,
                                               pairs=pairs, rows=rows)
    return max(_rel_err(_take(o, pairs=pairs, rows=rows, heads_axis=2), ref_o),
               _lse_err(_take(lse, pairs=pairs, rows=rows, heads_axis=1), ref_lse))


def _bwd_arrays(inp: Inputs) -> tuple:
    _, lse = inp.forward_outputs()
    return (inp.q, inp.k, inp.v, inp.do, lse, inp.delta(), inp.bias, inp.mask)


def _dq_reference_err(dq, inp: Inputs) -> float | None:
    s = inp.spec
    if s.dropout_rate:
        return None
    pairs, rows = _head_pairs(s.batch, s.heads_q), _sample_indices(s.seq_q)
    ref = reference.sampled_dq(*_bwd_arrays(inp), s=s, pairs=pairs, rows=rows)
    return _rel_err(_take(dq, pairs=pairs, rows=rows, heads_axis=2), ref)


def _dkdv_reference_err(out, inp: Inputs) -> float | None:
    s = inp.spec
    if s.dropout_rate:
        return None
    dk, dv = out
    pairs, cols = _head_pairs(s.batch, s.heads_kv), _sample_indices(s.seq_k)
    ref_dk, ref_dv = reference.sampled_dkdv(*_bwd_arrays(inp), s=s, pairs=pairs, cols=cols)
    return max(_rel_err(_take(dk, pairs=pairs, rows=cols, heads_axis=2), ref_dk),
               _rel_err(_take(dv, pairs=pairs, rows=cols, heads_axis=2), ref_dv))


def _dqdkdv_reference_err(out, inp: Inputs) -> float | None:
    """The fused backward's (dq, dk, dv), each checked as its own kernel's output is."""
    dq, dk, dv = out
    errs = (_dq_reference_err(dq, inp), _dkdv_reference_err((dk, dv), inp))
    return None if None in errs else max(errs)


def _dbias_reference_err(dbias, inp: Inputs) -> float | None:
    """dbias at sampled positions, for biases that do not broadcast over both rows and
    columns (the CLI's [1, 1, 1, S] does not); None otherwise: baseline check only."""
    s = inp.spec
    bshape = inp.bias.shape
    if s.dropout_rate or (bshape[2] == 1 and bshape[3] == 1):
        return None
    rows, cols = _sample_indices(s.seq_q), _sample_indices(s.seq_k)
    ref = reference.sampled_dbias(*_bwd_arrays(inp), s=s, rows=rows, cols=cols)
    got = dbias
    got = got[:, :, np.array(rows)] if bshape[2] > 1 else got
    got = got[:, :, :, np.array(cols)] if bshape[3] > 1 else got
    return _rel_err(got, ref)


def _preproc_reference_err(delta, inp: Inputs) -> float:
    return _rel_err(delta, inp.delta())


# ------------------------------------------------------------------ runners


def _accepts(fn: Callable, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


@dataclasses.dataclass(frozen=True)
class KernelRunner:
    """How the autotuner runs one kernel.

    - `kernel_fn`: the pallas_kernels function (None: not provided yet).
    - `launcher(config, spec, interpret)`: a function of `args(inputs)` that
      launches the kernel under `config` (FFPA keys) and returns its outputs.
    - `args(inputs)`: the arrays the launcher takes (jit arguments: never
      captured as constants).
    - `check(outputs, inputs)`: relative error against the sampled float32
      reference, or None where no independent reference applies.
    - `fit_key(config, spec)`: candidates with equal keys launch the same kernel.
    - `dropout`: whether the kernel takes `dropout_rate` / `seed` yet.
    """

    kernel: str
    direction: str
    kernel_fn: Callable | None
    launcher: Callable[[dict, Problem, bool], Callable]
    args: Callable[[Inputs], tuple]
    check: Callable[[Any, Inputs], float | None]
    fit_key: Callable[[dict, Problem], Hashable]
    tol_16bit: float
    tol_fp32: float
    needs_bias: bool = False

    @property
    def dropout(self) -> bool:
        return self.kernel_fn is not None and _accepts(self.kernel_fn, "dropout_rate")

    def tolerance(self, dtype: str) -> float:
        return self.tol_fp32 if dtype == "fp32" else self.tol_16bit

    def unsupported(self, spec: Problem) -> str | None:
        """Why this runner cannot tune `spec` here, or None."""
        if self.kernel_fn is None:
            return f"pallas_kernels has no {self.kernel} yet"
        if spec.dropout_rate and not self.dropout:
            return f"{self.kernel} does not take dropout_rate yet"
        if self.needs_bias and spec.bias_shape is None:
            return f"{self.kernel} needs a bias"
        return None


def _opt_args(inp: Inputs, *, with_mask: bool = True) -> list:
    extra = [inp.bias] if inp.bias is not None else []
    if with_mask and inp.mask is not None:
        extra.append(inp.mask)
    if inp.seed is not None:
        extra.append(inp.seed)
    return extra


def _split_opt(spec: Problem, rest: Sequence) -> tuple:
    """(bias, mask, seed) from the tail of the launcher's arguments."""
    rest = list(rest)
    bias = rest.pop(0) if spec.bias_shape is not None else None
    mask = rest.pop(0) if spec.mask_shape is not None else None
    seed = rest.pop(0) if spec.dropout_rate else None
    return bias, mask, seed


def _seed_kw(spec: Problem, seed) -> dict:
    return {} if not spec.dropout_rate else {"dropout_rate": spec.dropout_rate, "seed": seed}


def _tile_fit(config_class: type) -> Callable[[dict, Problem], Hashable]:
    """The fit key of a kernel whose config class fits its tiles to (T, S, D, Dv)."""
    def fit(cfg: dict, spec: Problem) -> Hashable:
        fitted = config_class.from_tuned(cfg).fitted(spec.seq_q, spec.seq_k, spec.head_dim,
                                                     spec.head_dim_v)
        return capped_for_rounding(fitted, spec.dtype)[0]
    return fit


def _attention_launcher(d: KernelDescriptor) -> Callable[[dict, Problem, bool], Callable]:
    """q, k, v (bias, mask, seed) -> (o, lse)."""
    def make(cfg: dict, spec: Problem, interpret: bool) -> Callable:
        config = d.config.from_tuned(cfg)

        def launch(q, k, v, *rest):
            bias, mask, seed = _split_opt(spec, rest)
            return d.function(q, k, v, bias, mask, scale=spec.scale, causal=spec.causal,
                              config=config, interpret=interpret, **_seed_kw(spec, seed))
        return launch
    return make


def _attention_args(inp: Inputs) -> tuple:
    return (inp.q, inp.k, inp.v, *_opt_args(inp))


def _preproc_fit(cfg: dict, spec: Problem) -> Hashable:
    bwd = BwdConfig.from_tuned(cfg)
    fitted = bwd.fitted(spec.seq_q, spec.seq_k, spec.head_dim_v, spec.head_dim_v)
    return (fitted.block_m, fitted.block_slice, bwd.num_warps, bwd.num_stages)


def _preproc_launcher(d: KernelDescriptor) -> Callable[[dict, Problem, bool], Callable]:
    """o, do, dlse -> delta."""
    def make(cfg: dict, spec: Problem, interpret: bool) -> Callable:
        config = d.config.from_tuned(cfg)

        def launch(o, do, dlse):
            return d.function(o, do, dlse, config=config, interpret=interpret)
        return launch
    return make


def _preproc_args(inp: Inputs) -> tuple:
    o, lse = inp.forward_outputs()
    return (o, inp.do, jnp.zeros(lse.shape, jnp.float32))


def _bwd_args(inp: Inputs) -> tuple:
    _, lse = inp.forward_outputs()
    return (inp.q, inp.k, inp.v, inp.do, lse, inp.delta(), *_opt_args(inp))


def _bwd_launcher(d: KernelDescriptor) -> Callable[[dict, Problem, bool], Callable]:
    """q, k, v, do, lse, delta (bias, mask, seed) -> the kernel's gradient(s)."""
    def make(cfg: dict, spec: Problem, interpret: bool) -> Callable:
        config = d.config.from_tuned(cfg)

        def launch(q, k, v, do, lse, delta, *rest):
            bias, mask, seed = _split_opt(spec, rest)
            return d.function(q, k, v, do, lse, delta, bias, mask, scale=spec.scale,
                              causal=spec.causal, config=config, interpret=interpret,
                              **_seed_kw(spec, seed))
        return launch
    return make


def _backward_runner(d: KernelDescriptor, check, *, needs_bias: bool = False) -> KernelRunner:
    return KernelRunner(d.name, d.direction, d.function, _bwd_launcher(d), args=_bwd_args,
                        check=check, fit_key=_tile_fit(d.config), tol_16bit=3e-2,
                        tol_fp32=1e-3, needs_bias=needs_bias)


# Decode: stage 1 is tuned with stage 2 at its default and timed together with it
# (what a decode call costs); stage 2 is tuned on stage 1's partials under stage 1's
# default, timed alone. Both are checked like the forward: (out, lse) at sampled rows.


def _decode_config(stage1: dict, stage2: dict | None = None):
    return pallas_kernels.DecodeConfig.from_tuned(stage1, stage2)


def _decode_splits(config, spec: Problem) -> int:
    return config.num_splits or pallas_kernels.decode_num_splits(
        batch=spec.batch, heads_kv=spec.heads_kv, packed_rows=spec.group * spec.seq_q,
        seq_k=spec.seq_k, head_dim_v=spec.head_dim_v, config=config,
        multiprocessors=multiprocessor_count())


def _decode_default(kernel: str, spec: Problem) -> dict:
    return search_space.candidates(kernel, headdim=spec.headdim, dtype=spec.dtype_name,
                                   mode="fast")[0]


def _decode1_launcher(cfg: dict, spec: Problem, interpret: bool) -> Callable:
    config = _decode_config(cfg, _decode_default("decode_fwd_stage2", spec))
    splits = _decode_splits(config, spec)

    def launch(q, k, v, *rest):
        bias, mask, seed = _split_opt(spec, rest)
        return pallas_kernels.decode_attention(q, k, v, bias, mask, scale=spec.scale,
                                               causal=spec.causal, config=config,
                                               num_splits=splits, interpret=interpret,
                                               **_seed_kw(spec, seed))
    return launch


def _decode1_fit(cfg: dict, spec: Problem) -> Hashable:
    config = _decode_config(cfg)
    fitted = config.fitted(spec.group * spec.seq_q, spec.seq_k, spec.head_dim, spec.head_dim_v)
    return (dataclasses.replace(fitted, num_splits=0), _decode_splits(config, spec))


def _decode2_launcher(cfg: dict, spec: Problem, interpret: bool) -> Callable:
    config = _decode_config(_decode_default("decode_fwd_stage1", spec), cfg)

    def launch(o_part, lse_part):
        return pallas_kernels.decode_fwd_stage2(o_part, lse_part, seq_q=spec.seq_q,
                                                heads_q=spec.heads_q,
                                                dtype=spec.dtype, config=config,
                                                interpret=interpret)
    return launch


def _decode2_args(inp: Inputs) -> tuple:
    """Stage 1's partials under its default config (computed once per problem)."""
    if inp._partials is None:
        s = inp.spec
        config = _decode_config(_decode_default("decode_fwd_stage1", s))

        def stage1(q, k, v, *rest):
            bias, mask, seed = _split_opt(s, rest)
            return pallas_kernels.decode_fwd_stage1(
                q, k, v, bias, mask, scale=s.scale, causal=s.causal, config=config,
                num_splits=_decode_splits(config, s), interpret=inp.interpret,
                **_seed_kw(s, seed))
        inp._partials = jax.jit(stage1)(inp.q, inp.k, inp.v, *_opt_args(inp))
    return inp._partials


def _decode2_fit(cfg: dict, spec: Problem) -> Hashable:
    fitted = _decode_config(_decode_default("decode_fwd_stage1", spec), cfg).fitted(
        spec.group * spec.seq_q, spec.seq_k, spec.head_dim, spec.head_dim_v)
    return (fitted.stage2_block_dv, fitted.stage2_num_warps)


# How the autotuner runs a kernel of each role (`KernelDescriptor.role`): a new kernel of a
# known role needs nothing here.
_ROLES: dict[str, Callable[[KernelDescriptor], KernelRunner]] = {
    "attention": lambda d: KernelRunner(
        d.name, d.direction, d.function, _attention_launcher(d), args=_attention_args,
        check=_fwd_reference_err, fit_key=_tile_fit(d.config), tol_16bit=2e-2, tol_fp32=1e-4),
    "delta": lambda d: KernelRunner(
        d.name, d.direction, d.function, _preproc_launcher(d), args=_preproc_args,
        check=_preproc_reference_err, fit_key=_preproc_fit, tol_16bit=1e-3, tol_fp32=1e-4),
    "dq": lambda d: _backward_runner(d, _dq_reference_err),
    "dkdv": lambda d: _backward_runner(d, _dkdv_reference_err),
    "dqdkdv": lambda d: _backward_runner(d, _dqdkdv_reference_err),
    "dbias": lambda d: _backward_runner(d, _dbias_reference_err, needs_bias=True),
    "decode_stage1": lambda d: KernelRunner(
        d.name, d.direction, d.function, _decode1_launcher, args=_attention_args,
        check=_fwd_reference_err, fit_key=_decode1_fit, tol_16bit=2e-2, tol_fp32=1e-4),
    "decode_stage2": lambda d: KernelRunner(
        d.name, d.direction, d.function, _decode2_launcher, args=_decode2_args,
        check=_fwd_reference_err, fit_key=_decode2_fit, tol_16bit=2e-2, tol_fp32=1e-4),
}

RUNNERS: dict[str, KernelRunner] = {d.name: _ROLES[d.role](d) for d in KERNEL_DESCRIPTORS}


def unsupported(kernel: str, spec: Problem) -> str | None:
    """Why `kernel` cannot be tuned on `spec` in this checkout, or None."""
    runner = RUNNERS.get(kernel)
    if runner is None:
        return f"no autotune runner for {kernel!r}"
    return runner.unsupported(spec)


# ------------------------------------------------------------------ measuring


@dataclasses.dataclass
class CandidateRecord:
    config: dict
    status: str  # "ok" | "compile failed" | "run failed" | "wrong result" | "pruned" | ...
    ms: float | None = None
    error: float | None = None
    detail: str = ""


@dataclasses.dataclass
class TuneResult:
    kernel: str
    best: dict | None  # the winning config (FFPA keys) or None when nothing passed
    best_ms: float | None
    default_ms: float | None  # time of the first candidate (the built-in default) if it passed
    records: list[CandidateRecord]
    elapsed_s: float

    def summary(self) -> str:
        counts: dict[str, int] = {}
        for r in self.records:
            counts[r.status] = counts.get(r.status, 0) + 1
        return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


def _block(x):
    return jax.block_until_ready(x)


def _samples_ms(fn, args, once_ms: float, settings: Settings, *,
                reps: int | None = None) -> list[float]:
    """Per-call milliseconds of a warm compiled candidate (`tuning.timing`): each sample loops
    it for at least `settings.min_sample_s` (at most 1000 calls), given one call's time."""
    once_s = once_ms / 1e3
    if reps is None:
        reps = settings.reps_short if once_s < 0.05 else settings.reps_long
    inner = timing.calls_per_sample(once_s, settings.min_sample_s, most=1000)
    return timing.looped_samples(fn, args, inner=inner, reps=reps)


def _compile(fn: Callable, args: tuple):
    return jax.jit(fn).lower(*args).compile()


def _max_rel_diff(a, b) -> float:
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return max(_rel_err(x, y) for x, y in zip(leaves_a, leaves_b))


def tune(kernel: str, spec: Problem, *, mode: str = "fast",
         candidates: Sequence[dict] | None = None, interpret: bool = False,
         settings: Settings | None = None, inputs: Inputs | None = None,
         on_progress: Callable[[int, int], None] | None = None,
         runner: KernelRunner | None = None) -> TuneResult:
    """Measure the candidates of `kernel` on `spec`; see the module docstring.

    `candidates` defaults to `search_space.candidates(kernel, ...)` (default
    first). `inputs` lets callers reuse one problem's arrays across kernels.
    `runner` overrides `RUNNERS[kernel]` (tests inject a broken launcher).
    """
    started = time.perf_counter()
    runner = runner or RUNNERS[kernel]
    reason = runner.unsupported(spec)
    if reason is not None:
        raise ValueError(f"cannot tune {kernel}: {reason}")
    settings = settings or Settings.for_mode(mode)
    if candidates is None:
        candidates = search_space.candidates(kernel, headdim=spec.headdim,
                                             dtype=spec.dtype_name,
                                             mode=mode)
    inputs = inputs or Inputs(spec, interpret=interpret)
    args = runner.args(inputs)

    records: list[CandidateRecord] = []
    unique: list[dict] = []
    seen: set = set()
    for cfg in candidates:
        try:
            key = runner.fit_key(cfg, spec)
        except Exception as exc:  # noqa: BLE001 - a config the kernel cannot even take
            records.append(CandidateRecord(dict(cfg), "compile failed", detail=_first_line(exc)))
            continue
        if key in seen:
            continue
        seen.add(key)
        unique.append(dict(cfg))

    def lower_and_compile(cfg):
        return _compile(runner.launcher(cfg, spec, interpret), args)

    baseline = None
    best_ms: float | None = None
    default_record: CandidateRecord | None = None
    # Executables of the default and of the best so far, for the confirming round.
    finalists: dict[str, tuple[Any, CandidateRecord]] = {}
    total = len(unique)
    chunk = max(1, settings.compile_workers)
    with concurrent.futures.ThreadPoolExecutor(max_workers=settings.compile_workers) as pool:
        for start in range(0, total, chunk):
            if time.perf_counter() - started > settings.task_budget_s and best_ms is not None:
                records += [CandidateRecord(c, "skipped: task budget") for c in unique[start:]]
                break
            batch = unique[start:start + chunk]
            futures = [pool.submit(lower_and_compile, cfg) for cfg in batch]
            for offset, (cfg, fut) in enumerate(zip(batch, futures)):
                index = start + offset
                if on_progress is not None:
                    on_progress(index + 1, total)
                try:
                    compiled = fut.result()
                except Exception as exc:  # noqa: BLE001 - e.g. shared memory overflow
                    records.append(CandidateRecord(cfg, "compile failed", detail=_first_line(exc)))
                    continue
                record, outputs = _measure_one(compiled, cfg, args, runner, inputs, baseline,
                                               best_ms, settings)
                records.append(record)
                if record.status == "ok":
                    if baseline is None:
                        baseline = outputs
                    if index == 0:
                        default_record = record
                        finalists["default"] = (compiled, record)
                    if best_ms is None or record.ms < best_ms:
                        best_ms = record.ms
                        finalists["best"] = (compiled, record)
                del compiled
    _confirm(finalists, args, settings)
    ok = [r for r in records if r.status == "ok"]
    best = min(ok, key=lambda r: r.ms) if ok else None
    return TuneResult(kernel, None if best is None else dict(best.config),
                      None if best is None else best.ms,
                      None if default_record is None else default_record.ms, records,
                      time.perf_counter() - started)


def _confirm(finalists: dict, args, settings: Settings) -> None:
    """Re-time the default and the best so far, interleaved, and keep those figures.

    The default is measured first, when clocks and caches may still be warming
    up; timing the two finalists alternately removes that bias from the choice.
    """
    if "default" not in finalists or "best" not in finalists:
        return
    (d_fn, d_rec), (b_fn, b_rec) = finalists["default"], finalists["best"]
    if d_rec is b_rec:
        return
    d_samples, b_samples = [], []
    for _ in range(max(2, settings.reps_short if (b_rec.ms or 0) < 50 else settings.reps_long)):
        d_samples += _samples_ms(d_fn, args, d_rec.ms or 1.0, settings, reps=1)
        b_samples += _samples_ms(b_fn, args, b_rec.ms or 1.0, settings, reps=1)
    d_rec.ms = statistics.median(d_samples)
    b_rec.ms = statistics.median(b_samples)


def _measure_one(compiled, cfg, args, runner: KernelRunner, inputs: Inputs, baseline,
                 best_ms: float | None, settings: Settings) -> tuple[CandidateRecord, Any]:
    """(record, outputs): outputs are kept only while no baseline exists yet."""
    try:
        start = time.perf_counter()
        outputs = compiled(*args)
        _block(outputs)
        first_ms = 1e3 * (time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - e.g. a launch failure
        return CandidateRecord(cfg, "run failed", detail=_first_line(exc)), None
    tol = runner.tolerance(inputs.spec.dtype_name)
    err = runner.check(outputs, inputs)
    if err is not None and not err <= tol:
        return CandidateRecord(cfg, "wrong result", error=err,
                               detail=f"error {err:.3g} > {tol:g} against float32 reference"), None
    if baseline is not None:
        diff = _max_rel_diff(outputs, baseline)
        if not diff <= tol:
            return CandidateRecord(cfg, "wrong result", error=diff,
                                   detail=f"differs from the baseline by {diff:.3g} > {tol:g}"), None
        outputs = None  # only the baseline's outputs are kept
    try:
        if best_ms is None:  # the first candidate timed: warm the device up first
            deadline = time.perf_counter() + settings.warmup_s
            while time.perf_counter() < deadline:
                _block(compiled(*args))
        # One sample timed like the others (short kernels looped, so launch overhead
        # does not decide), compared with the best so far before spending more time.
        probe = _samples_ms(compiled, args, first_ms, settings, reps=1)[0]
        if best_ms is not None and probe > settings.prune * best_ms:
            record = CandidateRecord(cfg, "pruned", ms=probe, error=err,
                                     detail=f"probe {probe:.3f} ms > {settings.prune:g}x best")
        else:
            samples = [probe] + _samples_ms(compiled, args, probe, settings)
            record = CandidateRecord(cfg, "ok", ms=statistics.median(samples), error=err)
    except Exception as exc:  # noqa: BLE001
        return CandidateRecord(cfg, "run failed", detail=_first_line(exc)), None
    return record, outputs


# ------------------------------------------------------------------ the CLI workers' backend


def _device_info() -> dict:
    device = jax.devices()[0]
    memory_gib = None
    try:
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        if limit:
            # JAX's allocator is limited to XLA_PYTHON_CLIENT_MEM_FRACTION (0.75 by
            # default) of the device: undo that to report the device's memory.
            fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
            memory_gib = limit / fraction / 2**30
    except Exception:  # noqa: BLE001 - not every backend reports memory
        memory_gib = None
    capability = getattr(device, "compute_capability", None)
    return {"platform": device.platform, "device_name": str(device.device_kind),
            "compute_capability": None if capability is None else str(capability),
            "memory_gib": memory_gib}


def capabilities() -> dict[str, dict]:
    """Per kernel: {"missing": why it cannot be tuned here or None, "dropout": bool}."""
    return {name: {"missing": (None if runner.kernel_fn is not None
                               else f"pallas_kernels has no {name} yet"),
                   "dropout": runner.dropout}
            for name, runner in RUNNERS.items()}


class MeasureBackend:
    """What a CLI worker process runs: real kernels on its one GPU.

    `interpret=True` (env FFPA_AUTOTUNE_INTERPRET=1) runs the kernels in Pallas'
    interpreter instead: only for exercising the pipeline on a CPU.
    """

    def __init__(self, *, interpret: bool | None = None):
        if interpret is None:
            interpret = os.environ.get("FFPA_AUTOTUNE_INTERPRET", "") == "1"
        self.interpret = interpret
        self._inputs: Inputs | None = None
        self._inputs_key: tuple | None = None

    def hello(self) -> dict:
        info = _device_info()
        if info["platform"] not in ("gpu", "cuda") and not self.interpret:
            raise RuntimeError(f"the autotuner needs an NVIDIA GPU; JAX's device is "
                               f"{info['platform']!r}")
        return dict(info, kernels=capabilities())

    def _inputs_for(self, spec: Problem) -> Inputs:
        key = dataclasses.astuple(spec)
        if self._inputs_key != key:
            self._inputs = None  # free the previous problem's arrays first
            self._inputs = Inputs(spec, interpret=self.interpret)
            self._inputs_key = key
        return self._inputs

    def run(self, task: dict, *, mode: str, progress: Callable[[int, int], None]) -> dict:
        t = Task.from_dict(task)
        spec = Problem(batch=t.batch, seq_q=t.seqlen_q, seq_k=t.seqlen_k, heads_q=t.nheads_q,
                       heads_kv=t.nheads_kv, head_dim=t.headdim, head_dim_v=t.headdim,
                       dtype=DTYPES[t.dtype], scale=1.0 / math.sqrt(t.headdim),
                       causal=t.causal, bias_shape=t.bias_shape, dropout_rate=t.dropout_rate)
        result = tune(task["kernel"], spec, mode=mode, interpret=self.interpret,
                      inputs=self._inputs_for(spec), on_progress=progress)
        # The worker's stderr is its log file: one line per candidate, for diagnosis.
        print(f"== {task['kernel']} {spec} ({result.elapsed_s:.1f} s)", file=sys.stderr)
        for r in result.records:
            ms = "" if r.ms is None else f"{r.ms:.4f} ms"
            print(f"   {r.status:16s} {ms:>14s} {r.config} {r.detail}", file=sys.stderr)
        return {"config": result.best, "tuned_ms": result.best_ms,
                "default_ms": result.default_ms, "summary": result.summary(),
                "elapsed_s": round(result.elapsed_s, 2),
                "failures": [f"{r.status}: {r.detail}" for r in result.records
                             if r.status not in ("ok", "pruned")][:8]}
