"""Which accelerator we run on, in the terms the tuned-config files use, and the one place
that decides "is JAX's default backend an NVIDIA GPU".

Tuned-config files are named after the device (`<sanitized name>.json`) and
carry its CUDA compute capability, which is the fallback key when no file for
the exact device name exists.
"""

from __future__ import annotations

import functools
import re

# FFPA names its files with the device name where every character outside
# this set became "_"; we must produce the very same file names.
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")

# Platforms under which JAX exposes NVIDIA GPUs ("gpu" today; "cuda" is what
# some plugin builds report).
_GPU_PLATFORMS = frozenset({"gpu", "cuda"})


def sanitize_device_name(name: str) -> str:
    """`name` with every character outside `[A-Za-z0-9._-]` replaced by `_`.

    >>> sanitize_device_name("NVIDIA H100 80GB HBM3")
    'NVIDIA_H100_80GB_HBM3'
    """
    return _UNSAFE_CHARS.sub("_", str(name))


def current_device() -> tuple[str | None, str | None]:
    """`(device_kind, compute_capability)` of JAX's first device when it is a GPU.

    Returns `(None, None)` on CPU (or TPU), and when JAX cannot list its devices
    at all: lookups then simply find no tuned config. The compute capability
    is a string like "9.0", or None when the device does not report one.
    """
    try:
        import jax  # Local import: importing `tuning` must stay cheap.

        devices = jax.devices()
    except Exception:  # A broken backend must not break a trace-time lookup.
        return None, None
    if not devices:
        return None, None
    device = devices[0]
    if getattr(device, "platform", None) not in _GPU_PLATFORMS:
        return None, None
    kind = getattr(device, "device_kind", None)
    capability = getattr(device, "compute_capability", None)
    return (
        str(kind) if kind else None,
        str(capability) if capability is not None else None,
    )


# Streaming multiprocessors of an H100 SXM / H200: the count assumed where JAX does
# not report one (and on CPU, where it only shapes interpret-mode grids).
DEFAULT_MULTIPROCESSORS = 132


def multiprocessor_count() -> int:
    """Streaming multiprocessors of JAX's first GPU (for split heuristics)."""
    try:
        import jax

        count = getattr(jax.devices()[0], "core_count", None)
    except Exception:  # A broken backend must not break a trace-time decision.
        count = None
    return int(count) if isinstance(count, int) and count > 0 else DEFAULT_MULTIPROCESSORS


@functools.cache
def default_backend_is_nvidia_gpu() -> bool:
    """Whether JAX's default device is a CUDA GPU (ROCm GPUs also report platform 'gpu')."""
    import jax  # Local import: importing `tuning` must stay cheap.

    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    if device.platform != "gpu":
        return False
    version = str(getattr(device.client, "platform_version", "")).lower()
    return "rocm" not in version and "hip" not in version


def default_backend() -> str:
    """JAX's default backend's name ("cpu", "gpu", ...), for messages."""
    import jax  # Local import: importing `tuning` must stay cheap.

    try:
        return jax.default_backend()
    except RuntimeError as exc:  # no backend at all: say so rather than fail
        return f"unavailable ({exc})"
