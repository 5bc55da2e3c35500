"""ffpa_jax: exact, fast, memory-efficient attention for JAX on NVIDIA GPUs, any head dim up to 1024."""

from ffpa_jax.api import attention
from ffpa_jax.dropout import dropout_mask
from ffpa_jax.flax_attention import flax_attention_fn

__version__ = "0.1.0"
__all__ = ["__version__", "attention", "dropout_mask", "flax_attention_fn"]
