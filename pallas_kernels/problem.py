"""`Problem`: one attention call's static meaning, in the vocabulary every layer uses; and
`Inputs`, `Saved`, `Cotangents`: the arrays that travel with it.

q [B, T, Hq, D], k [B, S, Hkv, D], v [B, S, Hkv, Dv] (batched), a bias and a mask of 4-D
shapes [B|1, Hq|1, T|1, S|1] (or None), causal, dropout (and whether one keep-mask is shared
by every batch row and head), whether the caller returns lse, and the LLM features: a
sliding window and a logit soft cap (static: they change the code), packed-sequence segment
ids, padding lengths and attention sinks (runtime data: the problem records only that they
are given; the arrays travel in `FeatureArrays`).

It is the one record of those options: validation builds it from the caller's arrays, a
plan holds it (`plan.Plan`), the tuning lookup and the dispatcher read it, and each kernel's
static record holds it beside the kernel's own config (`static.KernelStatic`). A kernel may
see a shard of the call (batch or heads split over devices): `Problem.sized` gives the
problem of the arrays it holds.
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
    # One keep-mask shared by every batch row and head (Flax's broadcast_dropout): element
    # (b, h, i, j) keeps what the unshared mask keeps at (0, 0, i, j). False without dropout.
    dropout_broadcast: bool = False
    bias_shape: tuple[int, ...] | None = None  # 4-D, each dim 1 or full
    mask_shape: tuple[int, ...] | None = None
    # (left, right): query i sees keys [i' - left, i' + right], i' = i + (S - T).
    window: tuple[int, int] | None = None
    softcap: float | None = None  # logits = c·tanh(logits / c) after scale and bias
    segment_ids: bool = False  # q/kv segment ids [B, T] / [B, S] given
    q_lengths: bool = False  # query_seq_lengths [B] given
    kv_lengths: bool = False  # key_value_seq_lengths [B] given
    sinks: bool = False  # per-head sink logits [Hq] given
    # The arrays are a block of a longer sequence (context parallelism): runtime positions
    # place its rows and keys in the whole (`FeatureArrays.positions`).
    positions: bool = False
    # With positions: the shift (`FeatureArrays.positions[2]`) where every run of the block
    # has the same one, so that a tier may plan by it at trace time (the chunked tier skips
    # the row and key blocks causality hides); None: the shift is runtime data only.
    positions_shift: int | None = None
    # The caller returns lse: the fused forward then rounds q·kᵀ per head-dim chunk, which
    # keeps lse within XLA's error at large D and costs speed (numerics.contract_chunks).
    return_lse: bool = False

    def __post_init__(self):
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype))
        # One spelling per meaning: without dropout there is no mask to share.
        object.__setattr__(self, "dropout_broadcast",
                           bool(self.dropout_broadcast) and self.dropout_rate > 0.0)

    @classmethod
    def of(cls, q, k, v, bias=None, mask=None, *, features: "FeatureArrays | None" = None,
           **options) -> "Problem":
        """The problem of batched q/k/v and 4-D bias/mask (arrays or anything with .shape and
        .dtype) and the feature arrays `features`; `options` are the static fields (`scale`,
        default 1/sqrt(D); `causal`, `dropout_rate`, `dropout_broadcast`, `window`, `softcap`,
        `return_lse`)."""
        f = FeatureArrays() if features is None else features
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise TypeError(f"Problem.of takes the options {sorted(_OPTIONS)}; got {unknown}")
        o = {**_OPTIONS, **options}
        scale = 1.0 / math.sqrt(q.shape[3]) if o["scale"] is None else float(o["scale"])
        return cls(**_shapes(q, k, v, bias, mask), dtype=q.dtype, scale=scale,
                   causal=bool(o["causal"]), dropout_rate=float(o["dropout_rate"]),
                   dropout_broadcast=bool(o["dropout_broadcast"]),
                   window=None if o["window"] is None else tuple(o["window"]),
                   softcap=None if o["softcap"] is None else float(o["softcap"]),
                   segment_ids=f.q_segment_ids is not None,
                   q_lengths=f.q_lengths is not None, kv_lengths=f.kv_lengths is not None,
                   sinks=f.sinks is not None, positions=f.positions is not None,
                   return_lse=bool(o["return_lse"]))

    def sized(self, inputs: "Inputs") -> "Problem":
        """This problem with the shapes of `inputs` (batched q/k/v, 4-D bias/mask), which
        may be one device's shard of the call's: what the kernels that hold them compute."""
        shapes = _shapes(inputs.q, inputs.k, inputs.v, inputs.bias, inputs.mask)
        if all(getattr(self, name) == value for name, value in shapes.items()):
            return self
        return dataclasses.replace(self, **shapes)

    @property
    def static_shift(self) -> int | None:
        """Where row 0 sits among the keys, if known at trace time: S - T, or for a block of a
        longer sequence `positions_shift` (None: only at run time)."""
        return self.positions_shift if self.positions else self.seq_k - self.seq_q

    @property
    def natural(self) -> bool:
        """Whether kernels keep scores in natural-log units (float32), else log2 units."""
        return self.dtype == jnp.float32

    @property
    def lse_pair(self) -> bool:
        """Whether lse travels as an exact pair hi + lo (float32: see `plan.Plan`)."""
        return self.natural

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


# `Problem.of`'s options and their defaults.
_OPTIONS = dict(scale=None, causal=False, dropout_rate=0.0, dropout_broadcast=False,
                window=None, softcap=None, return_lse=False)


def _shapes(q, k, v, bias, mask) -> dict:
    """The `Problem` fields that batched q/k/v and 4-D bias/mask (or None) determine."""
    batch, seq_q, heads_q, head_dim = q.shape
    return dict(batch=batch, seq_q=seq_q, seq_k=k.shape[1], heads_q=heads_q,
                heads_kv=k.shape[2], head_dim=head_dim, head_dim_v=v.shape[3],
                bias_shape=None if bias is None else tuple(bias.shape),
                mask_shape=None if mask is None else tuple(mask.shape))


class FeatureArrays(NamedTuple):
    """The runtime arrays of a call's LLM features, each None when not given (batched; the
    data of what `Problem` records as given). A pytree: it travels through the custom_vjp,
    the shard-local partitioning and `jax.vmap` with the other inputs."""

    q_segment_ids: Any = None  # int32 [B, T]
    kv_segment_ids: Any = None  # int32 [B, S]; given together with q_segment_ids
    q_lengths: Any = None  # int32 [B]: rows i >= q_lengths[b] see no key
    kv_lengths: Any = None  # int32 [B]: keys j >= kv_lengths[b] are seen by no row
    sinks: Any = None  # float32 [Hq]: a logit in each row's denominator, without a value
    # int32 [3] (row0, col0, shift): the arrays' rows and keys are a block of a longer
    # sequence, local row i being global row row0 + i and local key j global key col0 + j;
    # shift = row0 - col0 + (S - T) of the whole sequence, so that row i's diagonal is local
    # key i + shift (causality and the window), and dropout draws at global indices.
    positions: Any = None

    def kernel_positions(self):
        """`positions` as kernels take them (int32 [3]), or None."""
        return None if self.positions is None else jnp.asarray(self.positions).astype(jnp.int32)

    def without_sinks(self) -> "FeatureArrays":
        """The visibility arrays alone (what the probabilities' recomputation reads: lse
        counts the sinks already)."""
        return self._replace(sinks=None)


class Inputs(NamedTuple):
    """The arrays of one call as the tiers take them (a pytree): batched q [B, T, Hq, D],
    k [B, S, Hkv, D], v [B, S, Hkv, Dv]; bias and mask 4-D (each dim 1 or full) or None; the
    dropout seed (uint32[2], or [4] with a shard's global batch and head offsets) or None;
    the feature arrays (each None when not given)."""

    q: Any
    k: Any
    v: Any
    bias: Any = None
    mask: Any = None
    seed: Any = None
    features: FeatureArrays = FeatureArrays()

    @property
    def given_features(self) -> "FeatureArrays | None":
        """`features` when it holds an array, else None."""
        return self.features if any(x is not None for x in self.features) else None


class Saved(NamedTuple):
    """What a forward leaves for its backward besides the inputs: the output (float32 in a
    differentiated call) and the row statistics, lse [B, Hq, T] and, where
    `Problem.lse_pair`, its low word (else None)."""

    out: Any
    lse: Any
    lse_lo: Any = None


class Cotangents(NamedTuple):
    """The backward's incoming cotangents: of the output and of lse."""

    d_out: Any
    d_lse: Any
