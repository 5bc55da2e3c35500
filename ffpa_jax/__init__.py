"""ffpa_jax: exact, fast, memory-efficient attention for JAX on NVIDIA GPUs, any head dim up to 1024."""

from ffpa_jax.api import attention

__version__ = "0.1.0"
__all__ = ["attention", "__version__"]
