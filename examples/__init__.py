"""Examples built on ffpa_jax (need the `flax` extra): `examples.tiny_lm`, a small causal
transformer language model trained with ffpa_jax attention under jit, pmap or a sharded jit."""
