"""`Problem`: one attention problem, in the vocabulary every layer uses.

q [B, T, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] (batched), a bias and a mask of 4-D
shapes [B|1, Hq|1, T|1, S|1] (or None), causal, dropout, and the LLM features: a sliding
window and a logit soft cap (static: they change the code), packed-sequence segment ids,
padding lengths and attention sinks (runtime data: the problem records only that they are
given; the arrays travel in `FeatureArrays`). Validation builds it from the caller's arrays,
the plan and the tuning lookup read it, the autotuner, the bench and the tests describe
their shapes with it, and the kernels' trace-time statics extend it (`common.KernelStatic`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

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
    # (left, right): query i sees keys [i' - left, i' + right], i' = i + (S - T).
    window: tuple[int, int] | None = None
    softcap: float | None = None  # logits = c·tanh(logits / c) after scale and bias
    segment_ids: bool = False  # q/kv segment ids [B, T] / [B, S] given
    q_lengths: bool = False  # query_seq_lengths [B] given
    kv_lengths: bool = False  # key_value_seq_lengths [B] given
    sinks: bool = False  # per-head sink logits [Hq] given

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))

    @classmethod
    def of(cls, q, k, v, bias=None, mask=None, *, scale: float | None = None,
           causal: bool = False, dropout_rate: float = 0.0,
           features: "FeatureArrays | None" = None, window: tuple[int, int] | None = None,
           softcap: float | None = None) -> "Problem":
        """The problem of batched q/k/v and 4-D bias/mask (arrays or anything with .shape and
        .dtype); the scale defaults to 1/sqrt(D)."""
        f = FeatureArrays() if features is None else features
        batch, seq_q, heads_q, head_dim = q.shape
        return cls(batch=batch, seq_q=seq_q, seq_k=k.shape[1], heads_q=heads_q,
                   heads_kv=k.shape[2], head_dim=head_dim, head_dim_v=v.shape[3],
                   dtype=q.dtype, scale=1.0 / math.sqrt(head_dim) if scale is None else scale,
                   causal=bool(causal), dropout_rate=float(dropout_rate),
                   bias_shape=None if bias is None else tuple(bias.shape),
                   mask_shape=None if mask is None else tuple(mask.shape),
                   window=None if window is None else tuple(window), softcap=softcap,
                   segment_ids=f.q_segment_ids is not None,
                   q_lengths=f.q_lengths is not None, kv_lengths=f.kv_lengths is not None,
                   sinks=f.sinks is not None)

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

    @property
    def window_band(self) -> int | None:
        """The most keys one query row sees under the window (left + 1 + right, right 0
        under causality); None without a window."""
        if self.window is None:
            return None
        left, right = self.window
        return left + 1 + (min(right, 0) if self.causal else right)

    @property
    def features(self) -> tuple[str, ...]:
        """The LLM features this problem uses, by their argument names."""
        names = (("local_window_size", self.window is not None),
                 ("logits_soft_cap", self.softcap is not None),
                 ("q_segment_ids", self.segment_ids),
                 ("query_seq_lengths", self.q_lengths),
                 ("key_value_seq_lengths", self.kv_lengths), ("sinks", self.sinks))
        return tuple(name for name, used in names if used)


class FeatureArrays(NamedTuple):
    """The runtime arrays of a call's LLM features, each None when not given (batched; the
    data of what `Problem` records as given). A pytree: it travels through the custom_vjp,
    the shard-local partitioning and `jax.vmap` with the other inputs."""

    q_segment_ids: Any = None  # int32 [B, T]
    kv_segment_ids: Any = None  # int32 [B, S]; given together with q_segment_ids
    q_lengths: Any = None  # int32 [B]: rows i >= q_lengths[b] see no key
    kv_lengths: Any = None  # int32 [B]: keys j >= kv_lengths[b] are seen by no row
    sinks: Any = None  # float32 [Hq]: a logit in each row's denominator, without a value

    def without_sinks(self) -> "FeatureArrays":
        """The visibility arrays alone (what the probabilities' recomputation reads: lse
        counts the sinks already)."""
        return self._replace(sinks=None)
