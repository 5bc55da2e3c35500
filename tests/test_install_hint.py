"""The missing-CUDA message: on a machine with an NVIDIA GPU whose jaxlib has no CUDA
backend, `import ffpa_jax` warns once with the command that installs JAX's CUDA build.

The GPU machine is simulated: the NVIDIA driver's files are made to exist, and JAX's
CUDA plugin modules to be missing (this CPU machine has neither; a GPU CI machine has both).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import warnings

import pytest

from ffpa_jax import backend

ROOT = pathlib.Path(__file__).resolve().parents[1]
INSTALL = 'pip install -U "jax[cuda13]"'


@pytest.fixture
def gpu_without_cuda_jaxlib(monkeypatch, tmp_path):
    """A machine with the NVIDIA driver's files and no CUDA plugin; the warning not yet given."""
    driver = tmp_path / "nvidiactl"
    driver.write_text("")
    monkeypatch.setattr(backend, "NVIDIA_DEVICE_FILES", ("/nonexistent/nvidia0", str(driver)))
    monkeypatch.setattr(backend, "CUDA_PLUGIN_MODULES", ("no_such_jax_cuda_plugin",
                                                         "jax_plugins.no_such_cuda"))
    monkeypatch.setattr(backend, "_warned_missing_cuda", False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    return driver


def _caught(fn) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return caught


def test_warns_once_with_the_install_command_at_the_callers_line(gpu_without_cuda_jaxlib):
    caught = _caught(backend.warn_if_cuda_missing)
    assert len(caught) == 1
    message = str(caught[0].message)
    assert INSTALL in message and 'pip install -e ".[cuda]"' in message
    assert 'pip install -U "jax[cuda12]"' in message
    assert str(gpu_without_cuda_jaxlib) in message  # says why it thinks there is a GPU
    assert caught[0].category is RuntimeWarning
    assert caught[0].filename == __file__
    assert _caught(backend.warn_if_cuda_missing) == []  # once per process


def test_no_warning_where_nothing_needs_installing(gpu_without_cuda_jaxlib, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # a CPU run was asked for
    assert backend.missing_cuda_message() is None
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert INSTALL in backend.missing_cuda_message()
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(backend, "CUDA_PLUGIN_MODULES", ("no_such_jax_cuda_plugin", "json"))
    assert backend.missing_cuda_message() is None  # a CUDA plugin is installed
    monkeypatch.setattr(backend, "CUDA_PLUGIN_MODULES", ("no_such_jax_cuda_plugin",))
    monkeypatch.setattr(backend, "NVIDIA_DEVICE_FILES", ("/nonexistent/nvidiactl",))
    assert backend.missing_cuda_message() is None  # no NVIDIA GPU
    assert _caught(backend.warn_if_cuda_missing) == []


def test_a_failing_check_never_stops_the_import(gpu_without_cuda_jaxlib, monkeypatch):
    def broken(name):
        raise RuntimeError("a broken site-packages entry")

    monkeypatch.setattr(backend.importlib.util, "find_spec", broken)
    assert backend.missing_cuda_message() is None


IMPORT_ON_A_SIMULATED_GPU_MACHINE = """\
import importlib.util, os, warnings
_exists, _find_spec = os.path.exists, importlib.util.find_spec
os.path.exists = lambda p: p == "/dev/nvidiactl" or _exists(p)
importlib.util.find_spec = lambda name, *a: None if "cuda" in name else _find_spec(name, *a)
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import ffpa_jax
import jax.numpy as jnp
q = jnp.ones((1, 8, 2, 16))
assert ffpa_jax.attention(q, q, q).shape == (1, 8, 2, 16)  # and it still runs, on the CPU
for w in caught:
    if "ffpa_jax" in str(w.message):
        print(f"{w.filename}:{w.lineno}: {w.category.__name__}: {w.message}")
"""


def test_importing_ffpa_jax_on_a_gpu_machine_without_cuda_jaxlib_says_what_to_install():
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="")
    run = subprocess.run([sys.executable, "-c", IMPORT_ON_A_SIMULATED_GPU_MACHINE],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert len(lines) == 1, run.stdout  # one warning
    # it points at the `import ffpa_jax` line (7) of the user's code, not into ffpa_jax
    assert lines[0].startswith("<string>:7: RuntimeWarning: ffpa_jax: this machine has an "
                               "NVIDIA GPU (/dev/nvidiactl exists)")
    assert INSTALL in lines[0]
