"""The plain-JAX attention, the dense tier's computation: `pallas_kernels.reference`, the one
reference of the project (the tests', the bench's and the autotuner's too), under the name
the XLA path and the Flax adapter import it by."""

from pallas_kernels.reference import (accumulation_dtype, attention_logits, causal_keep,
                                      feature_keep, mha_reference, soft_cap, softmax)

__all__ = ["accumulation_dtype", "attention_logits", "causal_keep", "feature_keep",
           "mha_reference", "soft_cap", "softmax"]
