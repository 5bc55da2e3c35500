"""pytest set-up: the `gpu` marker and the kernel execution mode.

Tests that run a Pallas kernel take the `kernel_mode` fixture: "interpret" on a
CPU machine (Pallas' interpreter), "gpu" on an NVIDIA GPU (the real Triton
kernels). Tests marked `gpu` are skipped where there is no GPU.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time

# On a machine without JAX's CUDA plugin every test runs on XLA's CPU backend, and the
# suite's time is mostly XLA compiling the interpreted kernels (each test its own shapes).
# These flags make those compiles cheaper with the same float semantics (no fast-math
# either way): less LLVM optimisation, and XLA's older CPU code generator instead of its
# fusion emitters, which spend much longer on the interpreter's large loop bodies
# (docs/history.md has the measurements; test_vmap's bit-for-bit checks pass under both).
# Every jaxlib from 0.10.2 to 0.12 knows these flags. Set before JAX starts; subprocesses
# that set XLA_FLAGS append to this value.
_CPU_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true",
                      "--xla_cpu_use_fusion_emitters=false")


def _has_cuda_plugin() -> bool:
    for name in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12",
                 "jax_plugins.xla_cuda13"):
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # a missing parent package
            continue
    return False


_CPU_ONLY = not _has_cuda_plugin()
if _CPU_ONLY:
    _given = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join(
        [_given] + [f for f in _CPU_COMPILE_FLAGS if f.split("=")[0] not in _given]).strip()

import jax  # noqa: E402  (after XLA_FLAGS)
import pytest  # noqa: E402

from pallas_kernels import tiers as _registry  # noqa: E402

# On a CPU the same program is often compiled more than once: by two tests that share a
# case (the float64 reference at a shape, a kernel variant) and by both pytest-xdist
# workers. JAX's persistent compilation cache, in a directory of this run alone (removed
# at its end), compiles each program once; lowering and running still happen every time.
_COMPILE_CACHE_MIN_SECONDS = 0.1  # smaller programs cost more to store than to compile
_COMPILE_CACHE_INPUT = "ffpa_jax_compile_cache"  # the key of the workers' `workerinput`
_COMPILE_CACHE_DIR = pytest.StashKey[str]()  # the controller's directory, removed at the end


class _ShareCompileCache:
    """The pytest-xdist hook that hands the workers the controller's cache directory."""

    def __init__(self, path: str):
        self.path = path

    def pytest_configure_node(self, node):
        node.workerinput[_COMPILE_CACHE_INPUT] = self.path


def pytest_configure(config):
    if not _CPU_ONLY:
        return
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:  # the controller, or a run without pytest-xdist
        path = tempfile.mkdtemp(prefix="ffpa_jax_test_compiles_")
        config.stash[_COMPILE_CACHE_DIR] = path
        if config.pluginmanager.hasplugin("xdist"):
            config.pluginmanager.register(_ShareCompileCache(path))
    else:
        path = workerinput.get(_COMPILE_CACHE_INPUT)
    if path:
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs",
                          _COMPILE_CACHE_MIN_SECONDS)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    path = config.stash.get(_COMPILE_CACHE_DIR, None)
    if path:
        shutil.rmtree(path, ignore_errors=True)



@pytest.fixture(autouse=True)
def _no_user_tuned_configs(monkeypatch, tmp_path_factory):
    """The tuned-config lookup also reads the user's directory (`tuning.lookup.user_config_dir`,
    the autotuner's default output), where a real autotune run on this machine may have left
    files; in-process, every test sees an empty one instead (a test of that directory puts
    the real function back)."""
    from tuning import lookup

    empty = tmp_path_factory.getbasetemp() / "no_user_tuned_configs"
    monkeypatch.setattr(lookup, "user_config_dir", lambda: empty)


def _has_gpu() -> bool:
    try:
        return jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def skip_unless_sm90(count: int = 1) -> None:
    """Skips the calling test unless `count` sm90 GPUs (H100, H200) and a jax whose Mosaic GPU
    kernels run (>= 0.11) are here: what the Mosaic tier's own GPU tests need."""
    from pallas_kernels import compat
    gpus = [d for d in jax.devices() if d.platform == "gpu"] if HAS_GPU else []
    if (len(gpus) < count or not compat.mosaic_gpu_runs()
            or not str(getattr(gpus[0], "compute_capability", "")).startswith("9")):
        pytest.skip(f"needs {'an' if count == 1 else count} sm90 GPU{'s' if count > 1 else ''} "
                    "and jax >= 0.11")


def pytest_collection_modifyitems(config, items):
    # Modules whose tests share one subprocess report (`fake_devices.worker_report` in a
    # module-scoped fixture, marked `shared_report`) would run it once in each pytest-xdist
    # worker that gets one of their tests. Their tests go first, in a row: the "load"
    # distribution hands each worker a first run of about an eighth of all tests, so one
    # worker gets them all. (The order is the same in every worker, as xdist requires.)
    items.sort(key=lambda item: item.get_closest_marker("shared_report") is None)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# A run bounded from outside (scripts/gpu_verify.sh's lanes inside one device call) sets
# FFPA_TEST_DEADLINE (seconds since the epoch): tests that would start after it are skipped,
# saying so, and pytest still prints its summary. Killing pytest at a time limit instead
# loses the summary, and with pytest-xdist often the log of what ran.
_DEADLINE = float(os.environ.get("FFPA_TEST_DEADLINE") or "inf")


def pytest_runtest_setup(item):
    if time.time() > _DEADLINE:
        pytest.skip("not started: past FFPA_TEST_DEADLINE")


@pytest.fixture(params=[
    pytest.param("interpret", id="interpret"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
])
def kernel_mode(request) -> str:
    """How a Pallas kernel runs in this test: interpreted on CPU, compiled on a GPU."""
    if request.param == "interpret" and HAS_GPU:
        pytest.skip("interpret-mode duplicate of a GPU test; run on CPU")
    return request.param


def interpret_flag(mode: str) -> bool:
    return mode == "interpret"


# The tiers of `ffpa_jax.attention` that share the semantic test matrix (test_forward,
# test_backward, test_dropout, test_fuzz). On a GPU the chunked tier runs with a workspace
# budget this small, so that the test shapes split into several query blocks and key blocks
# (the scans, the causal groups, the key-block merges, the accumulation at offsets) with
# the real kernels; on a CPU it runs as users get it (one block at these shapes: each extra
# block is another scan for XLA to compile), and test_chunked.py runs the blocked paths.
# Every tier of the registry with a backward of its own (the dense tier is the reference the
# matrix compares against): a new tier joins the matrix by its registry entry.
TIERS = tuple(t.name for t in _registry.TIERS if not t.differentiated_by_jax)
SMALL_CHUNK_BUDGET_MIB = "0.0625"


@pytest.fixture(params=TIERS)
def tier(request, monkeypatch) -> str:
    """Which tier a matrix test runs (see `call_kwargs`); a tier that cannot run on this
    machine (the Mosaic tier has no interpreter) is skipped, saying why."""
    from tuning import dispatch
    reason = dispatch.runs_here(_registry.BY_NAME[request.param], dispatch.Device.current(),
                                interpret=not HAS_GPU)
    if reason is not None:
        pytest.skip(f"the {request.param} tier {reason}")
    if request.param == "chunked" and HAS_GPU:
        monkeypatch.setenv("FFPA_CHUNKED_BUDGET_MIB", SMALL_CHUNK_BUDGET_MIB)
    return request.param


# A tier that computes only part of the semantics (the Mosaic tier's forward today) refuses
# the rest when forced (`implementation=` its name): a matrix case that uses such a feature is
# reported as a skip naming it, not as a failure; every case it serves runs as usual.
_REFUSED = "does not support"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    outcome = yield
    error = outcome.excinfo[1] if outcome.excinfo else None
    params = item.callspec.params if hasattr(item, "callspec") else {}
    tier = params.get("tier") or params.get("feature_tier")
    if (isinstance(error, ValueError) and tier is not None and _REFUSED in str(error)
            and f"implementation={tier!r}" in str(error)):
        outcome.force_exception(pytest.skip.Exception(f"{tier}: {error}"))


def call_kwargs(tier: str, mode: str) -> dict:
    """`attention`'s implementation/interpret arguments for a tier in a kernel mode. The
    chunked tier on a CPU runs its plain-XLA step (what it runs there for users too); its
    Pallas step runs in interpret mode in test_chunked.py ("chunked-step" here) and for real
    on a GPU."""
    if tier == "chunked":
        return dict(implementation="chunked", interpret=False)
    if tier == "chunked-step":
        return dict(implementation="chunked", interpret=mode == "interpret")
    if tier == "xla":
        return dict(implementation="xla")
    return dict(implementation=tier, interpret=mode == "interpret")


# The tiers of the LLM features' matrix (test_features.py): the XLA path, the chunked
# tier, on a CPU the chunked tier's Pallas steps in Pallas' interpreter ("chunked-step": on
# a GPU, "chunked" runs those steps for real), the fused kernels, and the Mosaic kernels
# (sm90 GPUs only; a case using what the tier does not serve is a skip that names it).
FEATURE_TIERS = ("xla", "chunked", "chunked-step", "pallas", "mosaic")


# The interpreted Pallas step's features matrix with `-m slow`: test_chunked checks the step
# kernels with every feature against their XLA twins in the default suite, and a GPU runs
# them for real as "chunked".
@pytest.fixture(params=[pytest.param(t, marks=pytest.mark.slow) if t == "chunked-step" else t
                        for t in FEATURE_TIERS])
def feature_tier(request, monkeypatch) -> str:
    """Which tier a features matrix test runs (see `call_kwargs`)."""
    if request.param == "mosaic":
        skip_unless_sm90()
    if request.param == "chunked-step" and HAS_GPU:
        pytest.skip("the chunked tier runs its Pallas steps on a GPU already")
    if request.param == "chunked" and HAS_GPU:
        monkeypatch.setenv("FFPA_CHUNKED_BUDGET_MIB", SMALL_CHUNK_BUDGET_MIB)
    return request.param

