"""Which backend JAX runs on: the one place that decides "is this an NVIDIA GPU"."""

from __future__ import annotations

import functools

import jax


@functools.cache
def default_backend_is_nvidia_gpu() -> bool:
    """Whether JAX's default device is a CUDA GPU (ROCm GPUs also report platform 'gpu')."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    if device.platform != "gpu":
        return False
    version = str(getattr(device.client, "platform_version", "")).lower()
    return "rocm" not in version and "hip" not in version
