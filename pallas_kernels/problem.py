"""`Problem`: one attention problem, in the vocabulary every layer uses.

q [B, T, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] (batched), a bias and a mask of 4-D
shapes [B|1, Hq|1, T|1, S|1] (or None), causal, dropout. Validation builds it from the
caller's arrays, the plan and the tuning lookup read it, the autotuner, the bench and the
tests describe their shapes with it, and the kernels' trace-time statics extend it
(`common.KernelStatic`).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

# The dtype spellings of the tuned-config files (FFPA's).
DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
DTYPES = {name: jnp.dtype(dtype) for dtype, name in DTYPE_NAMES.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
    batch: int
    seq_q: int
    seq_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    dtype: jnp.dtype
    scale: float
    causal: bool = False
    dropout_rate: float = 0.0
    bias_shape: tuple[int, ...] | None = None  # 4-D, each dim 1 or full
    mask_shape: tuple[int, ...] | None = None

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

    @classmethod
    def of(cls, q, k, v, bias=None, mask=None, *, scale: float | None = None,
           causal: bool = False, dropout_rate: float = 0.0) -> "Problem":
        """The problem of batched q/k/v and 4-D bias/mask (arrays or anything with .shape and
        .dtype); the scale defaults to 1/sqrt(D)."""
        batch, seq_q, heads_q, head_dim = q.shape
        return cls(batch=batch, seq_q=seq_q, seq_k=k.shape[1], heads_q=heads_q,
                   heads_kv=k.shape[2], head_dim=head_dim, head_dim_v=v.shape[3],
                   dtype=q.dtype, scale=1.0 / math.sqrt(head_dim) if scale is None else scale,
                   causal=bool(causal), dropout_rate=float(dropout_rate),
                   bias_shape=None if bias is None else tuple(bias.shape),
                   mask_shape=None if mask is None else tuple(mask.shape))

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA/MQA)."""
        return self.heads_q // self.heads_kv

    @property
    def headdim(self) -> int:
        """The head dim tuned configs are stored under: max(D, Dv)."""
        return max(self.head_dim, self.head_dim_v)

    @property
    def dtype_name(self) -> str:
        """"bf16", "fp16" or "fp32" (the tuned-config files' spelling)."""
        return DTYPE_NAMES.get(self.dtype.name, self.dtype.name)

    @property
    def has_bias(self) -> bool:
        return self.bias_shape is not None

    @property
    def has_dropout(self) -> bool:
        return self.dropout_rate > 0.0
