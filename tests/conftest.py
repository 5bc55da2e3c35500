"""pytest set-up: the `gpu` marker and the kernel execution mode.

Tests that run a Pallas kernel take the `kernel_mode` fixture: "interpret" on a
CPU machine (Pallas' interpreter), "gpu" on an NVIDIA GPU (the real Triton
kernels). Tests marked `gpu` are skipped where there is no GPU.
"""

from __future__ import annotations

import jax
import pytest


def _has_gpu() -> bool:
    try:
        return jax.devices()[0].platform == "gpu"
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
