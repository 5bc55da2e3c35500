"""One PTX instruction per element, for what Pallas' Triton lowering does not emit itself.

Triton kernels only: the interpreter cannot run inline PTX, so callers keep a plain-JAX
path for it.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import triton as plgpu


def elementwise(asm: str, *args: jax.Array, dtype) -> jax.Array:
    """`asm` ($0 the result, $1.. the arguments, all 32-bit) on same-shape arrays."""
    shape = args[0].shape
    [out] = plgpu.elementwise_inline_asm(
        asm, args=list(args), constraints=",".join(["=r"] + ["r"] * len(args)), pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, dtype)])
    return out
