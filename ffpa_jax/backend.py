"""What ffpa_jax says about JAX's backend: whether it is an NVIDIA GPU (decided in
`tuning.device`, where the dispatcher reads it), and what to install when the machine has
an NVIDIA GPU but the installed jaxlib cannot use it (`missing_cuda_message`), and where
its warnings find the caller's line (`caller_stacklevel`).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings


from tuning.device import default_backend_is_nvidia_gpu  # noqa: F401  (its home is tuning)

# What `pip install -e ".[cuda]"` installs (pyproject.toml); JAX's own install docs name the
# same extra for NVIDIA GPUs. jax[cuda12] is the one for drivers that support CUDA 12 only.
CUDA_INSTALL = 'pip install -U "jax[cuda13]"'
CUDA12_INSTALL = 'pip install -U "jax[cuda12]"'

# The modules of JAX's CUDA backend: the jax-cuda12/13-plugin wheels and the PJRT plugins
# they register. A jaxlib without any of them runs on the CPU only.
CUDA_PLUGIN_MODULES = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13",
                       "jax_plugins.xla_cuda12")
# Files the NVIDIA kernel driver creates on a Linux machine (or a container given a GPU):
# they say "there is an NVIDIA GPU" without starting any JAX backend, in a few stat calls.
NVIDIA_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia/version")


def nvidia_gpu_file() -> str | None:
    """The first NVIDIA driver file present on this machine, or None."""
    for path in NVIDIA_DEVICE_FILES:
        try:
            if os.path.exists(path):
                return path
        except (OSError, ValueError):
            continue
    return None


def cuda_plugin_installed() -> bool:
    """Whether any of JAX's CUDA plugin modules can be imported (found, not imported)."""
    for name in CUDA_PLUGIN_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):  # a missing parent package, or a broken entry
            continue
    return False


def _platforms_exclude_gpu() -> bool:
    """Whether the user chose platforms without a GPU (JAX_PLATFORMS=cpu, say): then a CPU
    run is what was asked for and nothing needs installing."""
    chosen = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if not chosen:
        return False
    return not any(p.strip() in ("cuda", "gpu") for p in chosen.split(","))


def missing_cuda_message() -> str | None:
    """What to install, when this machine has an NVIDIA GPU and JAX has no CUDA backend;
    None otherwise. Never raises: the check must not stop ffpa_jax from importing."""
    try:
        if _platforms_exclude_gpu():
            return None
        found = nvidia_gpu_file()
        if found is None or cuda_plugin_installed():
            return None
    except Exception:  # noqa: BLE001  (a diagnostic: never an import failure)
        return None
    return (f"ffpa_jax: this machine has an NVIDIA GPU ({found} exists), but the installed "
            "jaxlib has no CUDA backend (no jax-cuda12/13 plugin), so JAX and ffpa_jax run "
            f"on the CPU. Install JAX's CUDA build: {CUDA_INSTALL} (or, in an ffpa_jax "
            'checkout, pip install -e ".[cuda]"); where the driver supports CUDA 12 only '
            f"(nvidia-smi shows its CUDA version): {CUDA12_INSTALL}. Set JAX_PLATFORMS=cpu "
            "to run on the CPU without this warning.")


_warned_missing_cuda = False


def warn_if_cuda_missing() -> None:
    """Warn once per process with `missing_cuda_message`, at the caller's line."""
    global _warned_missing_cuda
    if _warned_missing_cuda:
        return
    message = missing_cuda_message()
    if message is None:
        return
    _warned_missing_cuda = True
    warnings.warn(message, RuntimeWarning, stacklevel=caller_stacklevel())


# Library code between a user's line and a warning: ffpa_jax's three packages, and JAX and
# Flax, through which a jitted, vmapped or Flax-module call reaches ffpa_jax.
def _library_dirs() -> tuple[str, ...]:
    dirs = []
    for name in ("ffpa_jax", "tuning", "pallas_kernels", "jax", "jaxlib", "flax"):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def _importlib_frame(filename: str) -> bool:
    # Frames that `warnings.warn` itself skips when it counts `stacklevel`.
    return "importlib" in filename and "_bootstrap" in filename


def caller_stacklevel() -> int:
    """The `stacklevel` that makes a warning raised by the function calling this point at
    the first line outside ffpa_jax (and outside JAX and Flax, through which the call may
    have come): the user's call, or the user's `import ffpa_jax`."""
    dirs = _library_dirs()
    frame = sys._getframe(1)  # the function that calls warnings.warn: stacklevel 1
    level = 1
    while frame.f_back is not None:
        frame = frame.f_back
        if _importlib_frame(frame.f_code.co_filename):
            continue
        level += 1
        if not os.path.abspath(frame.f_code.co_filename).startswith(dirs):
            break
    return level
