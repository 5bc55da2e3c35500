"""Examples built on ffpa_jax (need the `flax` extra): `examples.tiny_lm`, a small causal
transformer language model trained with ffpa_jax attention under jit, pmap or a sharded jit;
`examples.gemma_like`, a decoder-only LM shaped like Gemma 4 (Flax NNX), timed with ffpa_jax's
or jax.nn's attention and checked against a reference."""
