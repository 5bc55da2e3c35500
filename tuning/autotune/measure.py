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

Kernels are run through `runners.RUNNERS`: how to build a kernel's inputs, launch it and
check it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import jax

from pallas_kernels.problem import Problem
from tuning import timing
from tuning.autotune import search_space
from tuning.autotune.runners import RUNNERS, Inputs, KernelRunner, first_line, rel_err
from tuning.autotune.tasks import Task


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
    return max(rel_err(x, y) for x, y in zip(leaves_a, leaves_b))


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
                                             dtype=spec.dtype_name, mode=mode,
                                             group=spec.group)
    inputs = inputs or Inputs(spec, interpret=interpret)
    args = runner.args(inputs)

    records: list[CandidateRecord] = []
    unique: list[dict] = []
    seen: set = set()
    for cfg in candidates:
        try:
            key = runner.fit_key(cfg, spec)
        except Exception as exc:  # noqa: BLE001 - a config the kernel cannot even take
            records.append(CandidateRecord(dict(cfg), "compile failed", detail=first_line(exc)))
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
                    records.append(CandidateRecord(cfg, "compile failed", detail=first_line(exc)))
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
        return CandidateRecord(cfg, "run failed", detail=first_line(exc)), None
    tol = runner.tolerance(inputs.spec.dtype_name)
    err = runner.check(outputs, inputs)
    if err is not None and not err <= tol:
        return CandidateRecord(cfg, "wrong result", error=err,
                               detail=f"error {err:.3g} > {tol:g} against float32 reference"), None
    if baseline is not None:
        diff = _max_rel_diff(outputs, baseline)
        if not diff <= tol:
            detail = f"differs from the baseline by {diff:.3g} > {tol:g}"
            return CandidateRecord(cfg, "wrong result", error=diff, detail=detail), None
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
        return CandidateRecord(cfg, "run failed", detail=first_line(exc)), None
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
    return {name: {"missing": runner.missing(), "dropout": runner.dropout}
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
        spec = Task.from_dict(task).problem()
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
