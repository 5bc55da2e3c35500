"""Dropout on the attention probabilities: the seed taken from a PRNG key, and the
keep-mask in plain JAX.

The kernels draw the keep decision of score element (b, h, i, j) from Philox
with a 64-bit seed; `seed_from_key` is the one place that seed comes from, so the
Pallas path, the XLA path and `dropout_mask` agree bit for bit for the same key.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.dropout import keep_mask_reference


def seed_from_key(rng: jax.Array) -> jax.Array:
    """The kernels' dropout seed, uint32[2], drawn from a JAX PRNG key (typed or raw)."""
    return jax.random.bits(rng, (2,), jnp.uint32)


def dropout_mask(rng: jax.Array, shape: tuple[int, int, int, int], rate: float, *,
                 broadcast: bool = False) -> jax.Array:
    """The keep-mask bool[B, Hq, T, S] (True = kept) that `attention(...,
    dropout_rate=rate, dropout_rng=rng)` applies to its probabilities, in plain JAX.

    Each element is kept with probability 1 - round(rate·2^16)/2^16 (within 2^-17
    of 1 - rate); kept probabilities are scaled by 1/(1 - rate).

    With `broadcast=True`, the mask of `attention(..., dropout_broadcast=True)`: the one
    mask bool[1, 1, T, S] every batch row and head shares (it broadcasts to `shape`), the
    [0, 0] slice of the unshared mask.
    """
    if len(shape) != 4:
        raise ValueError(f"shape must be (B, Hq, T, S); got {tuple(shape)!r}.")
    if not 0.0 < float(rate) < 1.0:
        raise ValueError(f"rate must be in (0, 1); got {rate!r}.")
    if not isinstance(broadcast, (bool, np.bool_)):
        raise TypeError(f"broadcast must be a bool; got {broadcast!r}.")
    shape = tuple(int(d) for d in shape)
    return _keep_mask(rng, (1, 1, *shape[2:]) if broadcast else shape, float(rate))


# Jitted so that an eager call compiles one program per shape and rate, not each of Philox's
# few hundred integer operations apart (inside a caller's jit it is inlined).
@functools.partial(jax.jit, static_argnames=("shape", "rate"))
def _keep_mask(rng, shape, rate):
    return keep_mask_reference(seed_from_key(rng), shape, rate)
