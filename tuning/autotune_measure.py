"""Measure candidate launch configs of one kernel on one problem: the autotuner's core.

Used by the autotune CLI's workers (one process per GPU) and by
`ffpa_jax.runtime_autotune`. This is the one module of `tuning` that imports
JAX and `pallas_kernels`; nothing imports it at `import tuning` time.

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

Kernels are run through `RUNNERS`, a table from kernel name to a `KernelRunner`
(how to build its inputs, launch it and check it). A kernel without a runner,
or one that `pallas_kernels` does not provide yet, is reported as unsupported:
the decode kernels get their runner here once they exist (see `_decode_runner`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
import math
import os
import statistics
import time
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from pallas_kernels import BwdConfig, FwdConfig
from tuning import search_space
from tuning.autotune_tasks import DROPOUT_RATE

JNP_DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
_SEED = (0x1234ABCD, 0x0BADF00D)
_N_SAMPLES = 8  # sampled query rows / key columns per sampled head


@dataclasses.dataclass(frozen=True)
class ProblemSpec:
    """One attention problem, as the kernels see it (4-D, batched)."""

    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: str  # "bf16" | "fp16" | "fp32"
    causal: bool = False
    bias_shape: tuple[int, int, int, int] | None = None
    mask_shape: tuple[int, int, int, int] | None = None
    dropout_rate: float = 0.0

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def headdim(self) -> int:
        """The head dim configs are looked up by (as ffpa_jax.pallas_path does)."""
        return max(self.head_dim, self.head_dim_v)


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
    `delta` = rowsum(dO ∘ O) in jnp (what bwd_preproc computes, with dlse = 0).
    """

    def __init__(self, spec: ProblemSpec, *, interpret: bool):
        self.spec, self.interpret = spec, interpret
        dtype = JNP_DTYPES[spec.dtype]
        keys = jax.random.split(jax.random.key(spec.seq_q * 7919 + spec.head_dim), 5)
        s = spec
        self.q = jax.random.normal(keys[0], (s.batch, s.seq_q, s.heads_q, s.head_dim), dtype)
        self.k = jax.random.normal(keys[1], (s.batch, s.seq_k, s.heads_kv, s.head_dim), dtype)
        self.v = jax.random.normal(keys[2], (s.batch, s.seq_k, s.heads_kv, s.head_dim_v), dtype)
        self.do = jax.random.normal(keys[3], (s.batch, s.seq_q, s.heads_q, s.head_dim_v), dtype)
        self.bias = (None if s.bias_shape is None
                     else jax.random.normal(keys[4], s.bias_shape, dtype))
        # A mask for runtime autotune of masked calls: all True (every tile visited).
        self.mask = None if s.mask_shape is None else jnp.ones(s.mask_shape, bool)
        self.seed = (None if s.dropout_rate == 0.0
                     else jnp.asarray(_SEED, dtype=jnp.uint32))
        self._fwd: tuple[jax.Array, jax.Array] | None = None
        self._delta: jax.Array | None = None

    def forward_outputs(self) -> tuple[jax.Array, jax.Array]:
        if self._fwd is None:
            runner = RUNNERS["fwd_generic"]
            reasons = []
            for cfg in search_space.candidates("fwd_generic", headdim=self.spec.headdim,
                                               dtype=self.spec.dtype, mode="fast"):
                try:
                    fn = runner.launcher(cfg, self.spec, self.interpret)
                    out = jax.jit(fn)(*runner.args(self))
                    jax.block_until_ready(out)
                except Exception as exc:  # noqa: BLE001 - try the next candidate
                    reasons.append(_first_line(exc))
                    continue
                err = runner.check(out, self)
                if err is not None and err > runner.tolerance(self.spec.dtype):
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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


# ------------------------------------------------------------------ sampled float32 references


def _sample_indices(n: int) -> np.ndarray:
    picks = {0, 1, n // 3, n // 2, (2 * n) // 3, n - 2, n - 1, (7 * n) // 8}
    return np.array(sorted(i for i in picks if 0 <= i < n))[:_N_SAMPLES]


def _head_pairs(batch: int, heads: int) -> list[tuple[int, int]]:
    return sorted({(0, 0), (batch - 1, heads - 1)})


def _f32(x):
    return x.astype(jnp.float32)


def _dot(a, b, spec: str):
    return jnp.einsum(spec, _f32(a), _f32(b), precision=jax.lax.Precision.HIGHEST)


def _visible(inp: Inputs, b: int, h: int, rows, cols) -> jax.Array:
    """bool [len(rows), len(cols)]: which (row, col) scores survive mask and causality."""
    s = inp.spec
    rows, cols = jnp.asarray(rows), jnp.asarray(cols)
    ok = jnp.ones((rows.shape[0], cols.shape[0]), bool)
    if s.causal:
        ok &= cols[None, :] <= rows[:, None] + (s.seq_k - s.seq_q)
    if inp.mask is not None:
        m = inp.mask
        mb, mh = (b if m.shape[0] > 1 else 0), (h if m.shape[1] > 1 else 0)
        mr = rows if m.shape[2] > 1 else jnp.zeros_like(rows)
        mc = cols if m.shape[3] > 1 else jnp.zeros_like(cols)
        ok &= m[mb, mh][mr[:, None], mc[None, :]]
    return ok


def _logits(inp: Inputs, b: int, h: int, rows, cols) -> jax.Array:
    """float32 scale·q·kᵀ + bias at [rows, cols] of (b, h), -inf where not visible."""
    s = inp.spec
    rows, cols = jnp.asarray(rows), jnp.asarray(cols)
    hk = h // s.group
    logits = _dot(inp.q[b, rows, h], inp.k[b, cols, hk], "rd,cd->rc") * s.scale
    if inp.bias is not None:
        bb = inp.bias
        ib, ih = (b if bb.shape[0] > 1 else 0), (h if bb.shape[1] > 1 else 0)
        br = rows if bb.shape[2] > 1 else jnp.zeros_like(rows)
        bc = cols if bb.shape[3] > 1 else jnp.zeros_like(cols)
        logits = logits + _f32(bb[ib, ih][br[:, None], bc[None, :]])
    return jnp.where(_visible(inp, b, h, rows, cols), logits, -jnp.inf)


def _probs(logits, lse):
    """exp(logits - lse) with rows of lse = -inf (no visible key) giving 0."""
    lse = lse[:, None]
    return jnp.where(jnp.isfinite(lse) & jnp.isfinite(logits), jnp.exp(logits - lse), 0.0)


def _rel_err(got, want) -> float:
    """max |got - want| / max |want| (inf when got holds a NaN or inf), on the device."""
    got, want = _f32(jnp.asarray(got)), _f32(jnp.asarray(want))
    if want.size == 0:
        return 0.0
    if not bool(jnp.all(jnp.isfinite(got))):
        return math.inf
    scale = max(float(jnp.max(jnp.abs(want))), 1e-6)
    return float(jnp.max(jnp.abs(got - want))) / scale


def _fwd_reference_err(out, inp: Inputs) -> float | None:
    """Largest error of (o, lse) at sampled rows against float32 jnp; None with dropout."""
    s = inp.spec
    if s.dropout_rate:
        return None  # the keep-mask lives in the kernel: checked against the baseline only
    o, lse = out
    rows = _sample_indices(s.seq_q)
    all_cols = np.arange(s.seq_k)
    errs = []
    for b, h in _head_pairs(s.batch, s.heads_q):
        logits = _logits(inp, b, h, rows, all_cols)
        m = jnp.max(logits, axis=1)
        m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
        total = jnp.sum(jnp.exp(logits - m_safe[:, None]), axis=1)
        ref_lse = jnp.where(total > 0, m_safe + jnp.log(jnp.where(total > 0, total, 1.0)),
                            -jnp.inf)
        p = _probs(logits, ref_lse)
        ref_o = _dot(p, inp.v[b, :, h // s.group], "rc,cd->rd")
        errs.append(_rel_err(o[b, rows, h], ref_o))
        got_lse, want_lse = np.asarray(lse[b, h, rows]), np.asarray(ref_lse)
        same_inf = np.array_equal(np.isinf(got_lse), np.isinf(want_lse))
        finite = np.isfinite(want_lse)
        lse_err = (float(np.max(np.abs(got_lse[finite] - want_lse[finite]), initial=0.0))
                   / max(1.0, float(np.max(np.abs(want_lse[finite]), initial=1.0))))
        errs.append(lse_err if same_inf else math.inf)
    return max(errs)


def _dq_reference_err(dq, inp: Inputs) -> float | None:
    s = inp.spec
    if s.dropout_rate:
        return None
    _, lse = inp.forward_outputs()
    delta = inp.delta()
    rows = _sample_indices(s.seq_q)
    all_cols = np.arange(s.seq_k)
    errs = []
    for b, h in _head_pairs(s.batch, s.heads_q):
        hk = h // s.group
        p = _probs(_logits(inp, b, h, rows, all_cols), lse[b, h, rows])
        dp = _dot(inp.do[b, rows, h], inp.v[b, :, hk], "rd,cd->rc")
        ds = p * (dp - delta[b, h, rows][:, None])
        ref = _dot(ds, inp.k[b, :, hk], "rc,cd->rd") * s.scale
        errs.append(_rel_err(dq[b, rows, h], ref))
    return max(errs)


def _column_grads(inp: Inputs, b: int, hk: int, cols):
    """(dK, dV) float32 at key columns `cols` of kv head hk, summed over its query heads."""
    s = inp.spec
    _, lse = inp.forward_outputs()
    delta = inp.delta()
    all_rows = np.arange(s.seq_q)
    dk = dv = 0.0
    for h in range(hk * s.group, (hk + 1) * s.group):
        p = _probs(_logits(inp, b, h, all_rows, cols), lse[b, h])  # [T, c]
        dp = _dot(inp.do[b, :, h], inp.v[b, cols, hk], "td,cd->tc")
        ds = p * (dp - delta[b, h][:, None])
        dv = dv + _dot(p, inp.do[b, :, h], "tc,td->cd")
        dk = dk + _dot(ds, inp.q[b, :, h], "tc,td->cd") * s.scale
    return dk, dv


def _dkdv_reference_err(out, inp: Inputs) -> float | None:
    s = inp.spec
    if s.dropout_rate:
        return None
    dk, dv = out
    cols = _sample_indices(s.seq_k)
    errs = []
    for b, hk in _head_pairs(s.batch, s.heads_kv):
        ref_dk, ref_dv = _column_grads(inp, b, hk, cols)
        errs += [_rel_err(dk[b, cols, hk], ref_dk), _rel_err(dv[b, cols, hk], ref_dv)]
    return max(errs)


def _dbias_reference_err(dbias, inp: Inputs) -> float | None:
    """dbias at sampled positions, for biases that broadcast over rows or over columns
    but not both (the CLI's [1, 1, 1, S]); None otherwise (checked against the baseline)."""
    s = inp.spec
    bshape = inp.bias.shape
    if s.dropout_rate or (bshape[2] == 1 and bshape[3] == 1):
        return None
    _, lse = inp.forward_outputs()
    delta = inp.delta()
    rows_full, cols_full = bshape[2] > 1, bshape[3] > 1
    rows = _sample_indices(s.seq_q) if rows_full else np.arange(s.seq_q)
    cols = _sample_indices(s.seq_k) if cols_full else np.arange(s.seq_k)
    sums: dict[tuple[int, int], jax.Array] = {}
    for b in range(s.batch):
        for h in range(s.heads_q):
            hk = h // s.group
            p = _probs(_logits(inp, b, h, rows, cols), lse[b, h, rows])
            dp = _dot(inp.do[b, rows, h], inp.v[b, cols, hk], "rd,cd->rc")
            ds = p * (dp - delta[b, h, rows][:, None])
            ds = ds if rows_full else jnp.sum(ds, axis=0, keepdims=True)
            ds = ds if cols_full else jnp.sum(ds, axis=1, keepdims=True)
            slot = (b if bshape[0] > 1 else 0, h if bshape[1] > 1 else 0)
            sums[slot] = sums.get(slot, 0.0) + ds
    errs = []
    for (ib, ih), ref in sums.items():
        got = dbias[ib, ih]
        got = got[rows] if rows_full else got[:1]
        got = got[:, cols] if cols_full else got[:, :1]
        errs.append(_rel_err(got, ref))
    return max(errs)


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
    launcher: Callable[[dict, ProblemSpec, bool], Callable]
    args: Callable[[Inputs], tuple]
    check: Callable[[Any, Inputs], float | None]
    fit_key: Callable[[dict, ProblemSpec], Hashable]
    tol_16bit: float
    tol_fp32: float
    needs_bias: bool = False

    @property
    def dropout(self) -> bool:
        return self.kernel_fn is not None and _accepts(self.kernel_fn, "dropout_rate")

    def tolerance(self, dtype: str) -> float:
        return self.tol_fp32 if dtype == "fp32" else self.tol_16bit

    def unsupported(self, spec: ProblemSpec) -> str | None:
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


def _split_opt(spec: ProblemSpec, rest: Sequence) -> tuple:
    """(bias, mask, seed) from the tail of the launcher's arguments."""
    rest = list(rest)
    bias = rest.pop(0) if spec.bias_shape is not None else None
    mask = rest.pop(0) if spec.mask_shape is not None else None
    seed = rest.pop(0) if spec.dropout_rate else None
    return bias, mask, seed


def _seed_kw(spec: ProblemSpec, seed) -> dict:
    return {} if not spec.dropout_rate else {"dropout_rate": spec.dropout_rate, "seed": seed}


def _fwd_launcher(cfg: dict, spec: ProblemSpec, interpret: bool) -> Callable:
    config = FwdConfig.from_tuned(cfg)

    def launch(q, k, v, *rest):
        bias, mask, seed = _split_opt(spec, rest)
        return pallas_kernels.fwd_generic(q, k, v, bias, mask, scale=spec.scale,
                                          causal=spec.causal, config=config, interpret=interpret,
                                          **_seed_kw(spec, seed))
    return launch


def _fwd_fit(cfg: dict, spec: ProblemSpec) -> Hashable:
    return FwdConfig.from_tuned(cfg).fitted(spec.seq_q, spec.seq_k, spec.head_dim,
                                            spec.head_dim_v)


def _bwd_fit(cfg: dict, spec: ProblemSpec) -> Hashable:
    return BwdConfig.from_tuned(cfg).fitted(spec.seq_q, spec.seq_k, spec.head_dim,
                                            spec.head_dim_v)


def _preproc_fit(cfg: dict, spec: ProblemSpec) -> Hashable:
    bwd = BwdConfig.from_tuned(cfg)
    fitted = bwd.fitted(spec.seq_q, spec.seq_k, spec.head_dim_v, spec.head_dim_v)
    return (fitted.block_m, fitted.block_slice, bwd.num_warps, bwd.num_stages)


def _preproc_launcher(cfg: dict, spec: ProblemSpec, interpret: bool) -> Callable:
    config = BwdConfig.from_tuned(cfg)

    def launch(o, do, dlse):
        return pallas_kernels.bwd_preproc(o, do, dlse, config=config, interpret=interpret)
    return launch


def _preproc_args(inp: Inputs) -> tuple:
    o, lse = inp.forward_outputs()
    return (o, inp.do, jnp.zeros(lse.shape, jnp.float32))


def _bwd_args(inp: Inputs) -> tuple:
    _, lse = inp.forward_outputs()
    return (inp.q, inp.k, inp.v, inp.do, lse, inp.delta(), *_opt_args(inp))


def _bwd_launcher(name: str) -> Callable[[dict, ProblemSpec, bool], Callable]:
    def make(cfg: dict, spec: ProblemSpec, interpret: bool) -> Callable:
        config = BwdConfig.from_tuned(cfg)
        fn = getattr(pallas_kernels, name)

        def launch(q, k, v, do, lse, delta, *rest):
            bias, mask, seed = _split_opt(spec, rest)
            return fn(q, k, v, do, lse, delta, bias, mask, scale=spec.scale, causal=spec.causal,
                      config=config, interpret=interpret, **_seed_kw(spec, seed))
        return launch
    return make


RUNNERS: dict[str, KernelRunner] = {
    "fwd_generic": KernelRunner(
        "fwd_generic", "forward", pallas_kernels.fwd_generic, _fwd_launcher,
        args=lambda inp: (inp.q, inp.k, inp.v, *_opt_args(inp)), check=_fwd_reference_err,
        fit_key=_fwd_fit, tol_16bit=2e-2, tol_fp32=1e-4),
    "bwd_preproc": KernelRunner(
        "bwd_preproc", "backward", pallas_kernels.bwd_preproc, _preproc_launcher,
        args=_preproc_args, check=_preproc_reference_err, fit_key=_preproc_fit,
        tol_16bit=1e-3, tol_fp32=1e-4),
    "bwd_generic_dq": KernelRunner(
        "bwd_generic_dq", "backward", pallas_kernels.bwd_generic_dq,
        _bwd_launcher("bwd_generic_dq"), args=_bwd_args, check=_dq_reference_err,
        fit_key=_bwd_fit, tol_16bit=3e-2, tol_fp32=1e-3),
    "bwd_generic_dkdv": KernelRunner(
        "bwd_generic_dkdv", "backward", pallas_kernels.bwd_generic_dkdv,
        _bwd_launcher("bwd_generic_dkdv"), args=_bwd_args, check=_dkdv_reference_err,
        fit_key=_bwd_fit, tol_16bit=3e-2, tol_fp32=1e-3),
    "bwd_dbias": KernelRunner(
        "bwd_dbias", "backward", pallas_kernels.bwd_dbias, _bwd_launcher("bwd_dbias"),
        args=_bwd_args, check=_dbias_reference_err, fit_key=_bwd_fit,
        tol_16bit=3e-2, tol_fp32=1e-3, needs_bias=True),
}


def _decode_runner(kernel: str) -> KernelRunner:
    """Placeholder rows for the decode kernels: `unsupported` says why until
    pallas_kernels provides them and a real launcher/check replaces these."""
    def missing(*_args, **_kwargs):
        raise NotImplementedError(f"no autotune runner for {kernel} yet")
    return KernelRunner(kernel, "forward", None, missing, args=missing, check=missing,
                        fit_key=lambda cfg, spec: tuple(sorted(cfg.items())),
                        tol_16bit=2e-2, tol_fp32=1e-4)


for _name in ("decode_fwd_stage1", "decode_fwd_stage2"):
    RUNNERS.setdefault(_name, _decode_runner(_name))


def unsupported(kernel: str, spec: ProblemSpec) -> str | None:
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


def _time_one(fn, args) -> float:
    start = time.perf_counter()
    _block(fn(*args))
    return time.perf_counter() - start


def _time_samples(fn, args, once: float, settings: Settings, *,
                  reps: int | None = None) -> list[float]:
    inner = max(1, min(1000, int(settings.min_sample_s / max(once, 1e-6))))
    if reps is None:
        reps = settings.reps_short if once < 0.05 else settings.reps_long
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn(*args)
        _block(out)
        samples.append((time.perf_counter() - start) / inner)
    return samples


def _compile(fn: Callable, args: tuple):
    return jax.jit(fn).lower(*args).compile()


def _max_rel_diff(a, b) -> float:
    leaves_a, leaves_b = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return max(_rel_err(x, y) for x, y in zip(leaves_a, leaves_b))


def tune(kernel: str, spec: ProblemSpec, *, mode: str = "fast",
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
        candidates = search_space.candidates(kernel, headdim=spec.headdim, dtype=spec.dtype,
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
        d_samples += _time_samples(d_fn, args, (d_rec.ms or 1.0) / 1e3, settings, reps=1)
        b_samples += _time_samples(b_fn, args, (b_rec.ms or 1.0) / 1e3, settings, reps=1)
    d_rec.ms = 1e3 * statistics.median(d_samples)
    b_rec.ms = 1e3 * statistics.median(b_samples)


def _measure_one(compiled, cfg, args, runner: KernelRunner, inputs: Inputs, baseline,
                 best_ms: float | None, settings: Settings) -> tuple[CandidateRecord, Any]:
    """(record, outputs): outputs are kept only while no baseline exists yet."""
    try:
        start = time.perf_counter()
        outputs = compiled(*args)
        _block(outputs)
        first = time.perf_counter() - start
    except Exception as exc:  # noqa: BLE001 - e.g. a launch failure
        return CandidateRecord(cfg, "run failed", detail=_first_line(exc)), None
    tol = runner.tolerance(inputs.spec.dtype)
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
        probe = _time_one(compiled, args)
        if best_ms is not None and min(probe, first) * 1e3 > settings.prune * best_ms:
            record = CandidateRecord(cfg, "pruned", ms=probe * 1e3, error=err,
                                     detail=f"probe {probe * 1e3:.3f} ms > {settings.prune:g}x best")
        else:
            samples = [probe] + _time_samples(compiled, args, probe, settings)
            record = CandidateRecord(cfg, "ok", ms=1e3 * statistics.median(samples), error=err)
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
            preallocate = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "true").lower()
            fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))
            if preallocate in ("false", "0") and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
                fraction = 1.0
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

    def _inputs_for(self, spec: ProblemSpec) -> Inputs:
        key = dataclasses.astuple(spec)
        if self._inputs_key != key:
            self._inputs = None  # free the previous problem's arrays first
            self._inputs = Inputs(spec, interpret=self.interpret)
            self._inputs_key = key
        return self._inputs

    def run(self, task: dict, *, mode: str, progress: Callable[[int, int], None]) -> dict:
        spec = ProblemSpec(
            batch=task["batch"], seq_q=task["seqlen_q"], seq_k=task["seqlen_k"],
            heads_q=task["nheads_q"], heads_kv=task["nheads_kv"], head_dim=task["headdim"],
            head_dim_v=task["headdim"], dtype=task["dtype"], causal=task["causal"],
            bias_shape=(1, 1, 1, task["seqlen_k"]) if task["has_attn_bias"] else None,
            dropout_rate=DROPOUT_RATE if task["has_dropout"] else 0.0)
        result = tune(task["kernel"], spec, mode=mode, interpret=self.interpret,
                      inputs=self._inputs_for(spec), on_progress=progress)
        return {"config": result.best, "tuned_ms": result.best_ms,
                "default_ms": result.default_ms, "summary": result.summary(),
                "elapsed_s": round(result.elapsed_s, 2),
                "failures": [f"{r.status}: {r.detail}" for r in result.records
                             if r.status not in ("ok", "pruned")][:8]}
