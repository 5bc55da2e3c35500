"""ffpa_jax: exact, fast, memory-efficient attention for JAX on NVIDIA GPUs, any head dim up
to 1024."""

from ffpa_jax import backend as _backend
from ffpa_jax.api import attention
from ffpa_jax.dropout import dropout_mask
from ffpa_jax.flax_attention import flax_attention_fn
from ffpa_jax.layout import unzigzag, zigzag
from ffpa_jax.paged import gather_pages, paged_attention, update_kv_pages

__version__ = "0.1.0"
__all__ = ["__version__", "attention", "dropout_mask", "flax_attention_fn", "gather_pages",
           "paged_attention", "unzigzag", "update_kv_pages", "zigzag"]

# On a machine with an NVIDIA GPU whose jaxlib has no CUDA backend, everything would
# quietly run on the CPU: say what to install, once, at the user's import line. Only
# file checks, no backend start: the import stays as fast as before.
_backend.warn_if_cuda_missing()
