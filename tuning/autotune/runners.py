"""How the autotuner runs each kernel: the arrays of one problem (`Inputs`), the float32
references its candidates are checked against, and `RUNNERS`, a `KernelRunner` (how to build
a kernel's inputs, launch it and check it) per kernel of `pallas_kernels.KERNEL_DESCRIPTORS`,
made by the runner of the kernel's role (`_ROLES`), and for the Mosaic tier's two kernels.
A kernel without a runner is reported as unsupported (and its tasks skipped); a kernel that
does not apply dropout has its dropout tasks skipped. A new kernel of a known role is tuned
once it has its descriptor.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import KERNEL_DESCRIPTORS, BackwardRows, BwdConfig, KernelDescriptor, reference
from pallas_kernels import problem as problem_arrays
from pallas_kernels import tiers
from pallas_kernels.mosaic import tier as mosaic_tier
from pallas_kernels.mosaic import tuned as mosaic_tuned
from pallas_kernels.mosaic.backward import mosaic_attention_backward as mosaic_backward
from pallas_kernels.mosaic.forward import mosaic_attention_forward as mosaic_forward
from pallas_kernels.numerics import capped_for_rounding
from pallas_kernels.problem import Problem
from tuning import dispatch
from tuning.autotune import search_space
from tuning.device import multiprocessor_count

_SEED = (0x1234ABCD, 0x0BADF00D)
_N_SAMPLES = 8  # sampled query rows / key columns per sampled head


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

    def forward_outputs(self) -> tuple[jax.Array, ...]:
        """(o, lse), and lse's low word in float32 (the forward's outputs)."""
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
                    reasons.append(first_line(exc))
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
            o = self.forward_outputs()[0]
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


def first_line(exc: BaseException) -> str:
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


def rel_err(got, want) -> float:
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
    o, lse = out[:2]
    pairs, rows = _head_pairs(s.batch, s.heads_q), _sample_indices(s.seq_q)
    ref_o, ref_lse = reference.sampled_forward(_arrays(inp), s=s, pairs=pairs, rows=rows)
    return max(rel_err(_take(o, pairs=pairs, rows=rows, heads_axis=2), ref_o),
               _lse_err(_take(lse, pairs=pairs, rows=rows, heads_axis=1), ref_lse))


def _arrays(inp: Inputs) -> problem_arrays.Inputs:
    return problem_arrays.Inputs(inp.q, inp.k, inp.v, inp.bias, inp.mask)


def _bwd_arrays(inp: Inputs) -> tuple:
    """(inputs, upstream) of the sampled gradients."""
    lse = inp.forward_outputs()[1]
    return _arrays(inp), reference.Upstream(inp.do, lse, inp.delta())


def _dq_reference_err(dq, inp: Inputs) -> float | None:
    s = inp.spec
    if s.dropout_rate:
        return None
    pairs, rows = _head_pairs(s.batch, s.heads_q), _sample_indices(s.seq_q)
    ref = reference.sampled_dq(*_bwd_arrays(inp), s=s, pairs=pairs, rows=rows)
    return rel_err(_take(dq, pairs=pairs, rows=rows, heads_axis=2), ref)


def _dkdv_reference_err(out, inp: Inputs) -> float | None:
    s = inp.spec
    if s.dropout_rate:
        return None
    dk, dv = out
    pairs, cols = _head_pairs(s.batch, s.heads_kv), _sample_indices(s.seq_k)
    ref_dk, ref_dv = reference.sampled_dkdv(*_bwd_arrays(inp), s=s, pairs=pairs, cols=cols)
    return max(rel_err(_take(dk, pairs=pairs, rows=cols, heads_axis=2), ref_dk),
               rel_err(_take(dv, pairs=pairs, rows=cols, heads_axis=2), ref_dv))


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
    return rel_err(got, ref)


def _preproc_reference_err(delta, inp: Inputs) -> float:
    return rel_err(delta, inp.delta())


# ------------------------------------------------------------------ runners


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
    - `dropout`: whether the kernel applies dropout (its dropout tasks are tuned).
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
    dropout: bool = True
    # Why the kernel cannot run on this machine (None: it can), asked when tuning starts;
    # `refuses(spec)`: why it does not compute `spec` (None: it does).
    requires: Callable[[], str | None] | None = None
    refuses: Callable[[Problem], str | None] | None = None

    def tolerance(self, dtype: str) -> float:
        return self.tol_fp32 if dtype == "fp32" else self.tol_16bit

    def missing(self) -> str | None:
        """Why this kernel cannot be tuned on this machine, or None."""
        if self.kernel_fn is None:
            return f"pallas_kernels has no {self.kernel} yet"
        return None if self.requires is None else self.requires()

    def unsupported(self, spec: Problem) -> str | None:
        """Why this runner cannot tune `spec` here, or None."""
        missing = self.missing() or (None if self.refuses is None else self.refuses(spec))
        if missing:
            return missing
        if spec.dropout_rate and not self.dropout:
            return f"{self.kernel} does not apply dropout"
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


def _kernel_inputs(spec: Problem, q, k, v, rest: Sequence) -> problem_arrays.Inputs:
    """The kernels' `Inputs` of the launcher's arrays (bias, mask, seed from its tail)."""
    return problem_arrays.Inputs(q, k, v, *_split_opt(spec, rest))


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
            return d.function(spec, config, _kernel_inputs(spec, q, k, v, rest),
                              interpret=interpret)
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
    o, lse = inp.forward_outputs()[:2]
    return (o, inp.do, jnp.zeros(lse.shape, jnp.float32))


def _bwd_args(inp: Inputs) -> tuple:
    lse = inp.forward_outputs()[1]
    # float32 kernels take lse as a pair: the forward's low word.
    lo = inp.forward_outputs()[2:3] if inp.spec.lse_pair else ()
    return (inp.q, inp.k, inp.v, inp.do, lse, inp.delta(), *lo, *_opt_args(inp))


def _bwd_launcher(d: KernelDescriptor) -> Callable[[dict, Problem, bool], Callable]:
    """q, k, v, do, lse, delta (bias, mask, seed) -> the kernel's gradient(s)."""
    def make(cfg: dict, spec: Problem, interpret: bool) -> Callable:
        config = d.config.from_tuned(cfg)

        def launch(q, k, v, do, lse, delta, *rest):
            lo = rest[0] if spec.lse_pair else None
            rest = rest[1:] if spec.lse_pair else rest
            rows = BackwardRows(do, lse, delta, lo)
            return d.function(spec, config, _kernel_inputs(spec, q, k, v, rest), rows,
                              interpret=interpret)
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
        return pallas_kernels.decode_attention(spec, config, _kernel_inputs(spec, q, k, v, rest),
                                               num_splits=splits, interpret=interpret)
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
            return pallas_kernels.decode_fwd_stage1(
                s, config, _kernel_inputs(s, q, k, v, rest),
                num_splits=_decode_splits(config, s), interpret=inp.interpret)
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
        check=_preproc_reference_err, fit_key=_preproc_fit, tol_16bit=1e-3, tol_fp32=1e-4,
        dropout=False),
    "dq": lambda d: _backward_runner(d, _dq_reference_err),
    "dkdv": lambda d: _backward_runner(d, _dkdv_reference_err),
    "dbias": lambda d: _backward_runner(d, _dbias_reference_err, needs_bias=True),
    "decode_stage1": lambda d: KernelRunner(
        d.name, d.direction, d.function, _decode1_launcher, args=_attention_args,
        check=_fwd_reference_err, fit_key=_decode1_fit, tol_16bit=2e-2, tol_fp32=1e-4),
    "decode_stage2": lambda d: KernelRunner(
        d.name, d.direction, d.function, _decode2_launcher, args=_decode2_args,
        check=_fwd_reference_err, fit_key=_decode2_fit, tol_16bit=2e-2, tol_fp32=1e-4,
        dropout=False),
}



# The Mosaic tier's kernels: a candidate is a tuned entry's config
# (`pallas_kernels.mosaic.tuned`) applied to the problem's built-in config, launched through
# the tier's entry points; the backward takes the Triton forward's output (in float32, as
# a differentiated forward leaves it) and lse, and is checked on dq, dk and dv.


def _mosaic_requires() -> str | None:
    reason = dispatch.runs_here(tiers.MOSAIC, dispatch.Device.current(), interpret=False)
    return None if reason is None else f"the Mosaic tier {reason}"


# The features the runners launch (from the problem); the others' arrays are not in `Inputs`.
_MOSAIC_TUNED_FEATURES = ("local_window_size", "logits_soft_cap")


def _mosaic_refuses(direction: str) -> Callable[[Problem], str | None]:
    def refuses(spec: Problem) -> str | None:
        missing = mosaic_tier.unsupported(spec, direction)
        if missing:
            return f"the Mosaic tier does not compute {', '.join(missing)}"
        arrays = [name for name in spec.features if name not in _MOSAIC_TUNED_FEATURES]
        return f"the autotuner does not make {', '.join(arrays)}" if arrays else None
    return refuses


def _mosaic_config(kernel: str, cfg: dict, spec: Problem):
    default = mosaic_tuned.default_for(kernel, spec.head_dim, spec.head_dim_v, group=spec.group,
                                       causal=spec.causal, window=spec.window, seq_q=spec.seq_q)
    config, why_not = mosaic_tuned.tuned_config(kernel, default, cfg, head_dim=spec.head_dim,
                                                head_dim_v=spec.head_dim_v, group=spec.group,
                                                segments=False)
    if why_not:
        raise ValueError(f"a call would not run this config: {why_not}")
    return config


def _mosaic_forward_launcher(cfg: dict, spec: Problem, interpret: bool) -> Callable:
    """q, k, v -> (o, lse)."""
    del interpret  # the Mosaic kernels have no interpreter (`requires`)
    config = _mosaic_config(mosaic_tuned.FORWARD_KERNEL, cfg, spec)

    def launch(q, k, v):
        return mosaic_forward(q, k, v, scale=spec.scale, causal=spec.causal, config=config,
                              window=spec.window, softcap=spec.softcap)
    return launch


def _mosaic_backward_args(inp: Inputs) -> tuple:
    o, lse = inp.forward_outputs()[:2]
    return (inp.q, inp.k, inp.v, o.astype(jnp.float32), lse, inp.do)


def _mosaic_backward_launcher(cfg: dict, spec: Problem, interpret: bool) -> Callable:
    """q, k, v, o (float32), lse, do -> (dq, dk, dv)."""
    del interpret
    config = _mosaic_config(mosaic_tuned.BACKWARD_KERNEL, cfg, spec)

    def launch(q, k, v, o, lse, do):
        return mosaic_backward(problem_arrays.Inputs(q, k, v), problem_arrays.Saved(o, lse),
                               problem_arrays.Cotangents(do, None), scale=spec.scale,
                               causal=spec.causal, config=config, window=spec.window,
                               softcap=spec.softcap)
    return launch


def _mosaic_backward_err(grads, inp: Inputs) -> float | None:
    dq, dk, dv = grads
    return max(_dq_reference_err(dq, inp), _dkdv_reference_err((dk, dv), inp))


def _mosaic_fit(kernel: str) -> Callable[[dict, Problem], Hashable]:
    return lambda cfg, spec: _mosaic_config(kernel, cfg, spec)


_MOSAIC_RUNNERS = (
    KernelRunner(mosaic_tuned.FORWARD_KERNEL, "forward", mosaic_forward,
                 _mosaic_forward_launcher, args=lambda inp: (inp.q, inp.k, inp.v),
                 check=_fwd_reference_err, fit_key=_mosaic_fit(mosaic_tuned.FORWARD_KERNEL),
                 tol_16bit=2e-2, tol_fp32=0.0, dropout=False, requires=_mosaic_requires,
                 refuses=_mosaic_refuses("forward")),
    KernelRunner(mosaic_tuned.BACKWARD_KERNEL, "backward", mosaic_backward,
                 _mosaic_backward_launcher, args=_mosaic_backward_args,
                 check=_mosaic_backward_err, fit_key=_mosaic_fit(mosaic_tuned.BACKWARD_KERNEL),
                 tol_16bit=3e-2, tol_fp32=0.0, dropout=False, requires=_mosaic_requires,
                 refuses=_mosaic_refuses("backward")),
)

RUNNERS: dict[str, KernelRunner] = {
    **{d.name: _ROLES[d.role](d) for d in KERNEL_DESCRIPTORS},
    **{runner.kernel: runner for runner in _MOSAIC_RUNNERS}}


def unsupported(kernel: str, spec: Problem) -> str | None:
    """Why `kernel` cannot be tuned on `spec` in this checkout, or None."""
    runner = RUNNERS.get(kernel)
    if runner is None:
        return f"no autotune runner for {kernel!r}"
    return runner.unsupported(spec)
