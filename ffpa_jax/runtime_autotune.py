"""Runtime autotune: `ffpa_jax.attention(..., autotune="fast" | "max")`, for experiments.

When a call is traced with `autotune` set, each of its kernels' candidate
configs (`tuning.search_space`, the built-in default first) is compiled, checked
against a float32 reference and timed on the current GPU, for this exact shape
(batch, sequence lengths, heads, head dims, dtype, causal, bias and mask
shapes), and the fastest is used. The winner is cached for the process: later
traces of the same shape pay a dict probe. Off by default (`autotune=None`),
where the tuned-config files and the built-in defaults decide.

Notes:
- It runs while JAX traces the call (inside `jax.jit` too). It allocates its own
  random inputs of the call's shapes (the caller's values are tracers), so it
  needs about as much free device memory again as q, k, v and the output; they
  are freed by `release_inputs()` (api.plan_for calls it once a plan is made).
- A masked call is benchmarked with an all-True mask of the same shape (every
  tile visited); dropout calls with the call's rate and a fixed seed.
- Without a GPU (Pallas' interpreter, `interpret=True`, or a CPU backend) it
  returns None after one warning per process: timings of interpreted kernels
  mean nothing, so the tuned/default config is used instead.
- A call that runs the XLA path (the dense tier, or implementation=None without an NVIDIA
  GPU) has no launch configs to tune: `autotune` is ignored there, with one
  warning per process (`warn_ignored_on_xla`).
- Every warning points at the caller's line (the user's call of
  `ffpa_jax.attention`, through jit, vmap or a Flax module), not at ffpa_jax's.
- The winners are not written anywhere: for persistent configs use
  `python -m tuning.autotune` (docs/tuning.md).
"""

from __future__ import annotations

import logging
import threading
import warnings
from typing import Any

import jax

from ffpa_jax.backend import caller_stacklevel, default_backend_is_nvidia_gpu
from ffpa_jax.validation import check_autotune
from pallas_kernels import tiers
from pallas_kernels.problem import Problem

logger = logging.getLogger("ffpa_jax.tuning")


_lock = threading.RLock()
_cache: dict[tuple, dict | None] = {}
_inputs: dict[str, Any] = {}  # {"key": spec, "value": Inputs} of the problem being tuned
_warned: set[str] = set()
_stats = {"tuned": 0}  # kernels measured (not served from the cache), for tests


def _warn_once(key: str, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=caller_stacklevel())


def warn_ignored_on_xla(mode: str | None, implementation: str | None) -> None:
    """One warning per process: `autotune=mode` on a call that runs the XLA path, where
    there is no kernel to tune (`implementation` as the caller passed it)."""
    if mode is None:
        return
    if implementation == tiers.XLA.name:
        why = f"the call runs the XLA path (implementation={implementation!r})"
        kernels = [t.name for t in tiers.TIERS if not t.differentiated_by_jax]
        fix = (f"pass autotune=None, or implementation=None or one of {kernels} on an "
               "NVIDIA GPU")
    else:
        why = (f"implementation={implementation!r} runs the XLA path here (JAX's default "
               f"backend is {jax.default_backend()!r}, not an NVIDIA GPU)")
        fix = "autotune needs an NVIDIA GPU; pass autotune=None here"
    _warn_once("xla-path", f"ffpa_jax.attention: autotune={mode!r} is ignored: {why}, which "
               f"has no Pallas kernel launch configs to tune; {fix}.")


def autotuned_config(kernel: str, problem: Problem, *, mode: str | None,
                     interpret: bool = False, measure_interpret: bool = False) -> dict | None:
    """The fastest correct config of `kernel` for `problem` on this GPU (FFPA keys), or None.

    None means "use the tuned/default config": autotune off, no GPU (one
    warning per process), or no candidate passed. `measure_interpret=True` runs
    the measurement on interpreted kernels anyway (tests of the mechanism only;
    the timings are meaningless).
    """
    mode = check_autotune(mode)
    if mode is None:
        return None
    if (interpret or not default_backend_is_nvidia_gpu()) and not measure_interpret:
        _warn_once("no-gpu", "ffpa_jax: autotune needs an NVIDIA GPU running the compiled "
                   "kernels (not interpret mode); using the tuned or built-in configs instead.")
        return None
    from tuning.autotune import measure as autotune_measure  # noqa: PLC0415
    from tuning.autotune import runners  # noqa: PLC0415

    device = str(getattr(jax.devices()[0], "device_kind", "?"))
    key = (kernel, problem, mode, device, bool(interpret))
    with _lock:
        if key in _cache:
            cached = _cache[key]
            return None if cached is None else dict(cached)
        if runners.unsupported(kernel, problem) is not None:
            _cache[key] = None
            return None
        # Concrete computation while the caller is being traced.
        with jax.ensure_compile_time_eval():
            if _inputs.get("key") != problem:
                _inputs.clear()
                _inputs.update(key=problem, value=runners.Inputs(problem,
                                                                 interpret=interpret))
            result = autotune_measure.tune(kernel, problem, mode=mode, interpret=interpret,
                                           inputs=_inputs["value"])
        _stats["tuned"] += 1
        _cache[key] = result.best
    if result.best is None:
        _warn_once(f"none-{kernel}", f"ffpa_jax: autotune found no working config of {kernel} "
                   f"for {problem} ({result.summary()}); using the tuned or built-in config.")
        return None
    logger.info("autotune %s %s: %s, %.4f ms (default %s ms) [%s]", kernel, problem,
                result.best, result.best_ms,
                "n/a" if result.default_ms is None else f"{result.default_ms:.4f}",
                result.summary())
    return dict(result.best)


def override(mode: str | None, interpret: bool):
    """The plan's config override for a call with `autotune=mode` (tuning.dispatch.Override), or
    None when autotune is off."""
    if mode is None:
        return None
    return lambda kernel, problem: autotuned_config(kernel, problem, mode=mode,
                                                    interpret=interpret)


def release_inputs() -> None:
    """Free the random inputs kept while one problem's kernels are tuned."""
    with _lock:
        _inputs.clear()


def clear_cache() -> None:
    """Forget every winner (the next trace measures again) and the warnings given."""
    with _lock:
        _cache.clear()
        _inputs.clear()
        _warned.clear()
