"""What the benchmark measures: one `BenchCase` per row, the case kinds, and the presets.

A case kind ("self", "gqa", "decode", ...) turns a base shape (D, N, B, H) into the
problem that kind is about; the GPU preset lists the issue's target shapes, the CPU
preset small shapes that the Pallas interpreter runs in seconds.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

KINDS = ("self", "cross", "decode", "gqa", "mqa", "causal", "attn-mask", "key-mask",
         "bias-grad", "dropout", "non-aligned", "packed", "window", "softcap", "sinks",
         "paged-decode", "context-parallel")
FORWARD_ONLY = ("decode", "paged-decode")
MODES = ("fwd", "fwdbwd")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DEFAULT_DROPOUT = 0.1
PACKED_SEGMENTS = 8  # "packed": causal LM training on this many equal documents per row
MAX_WINDOW = 1024  # "window": a causal sliding window of min(this, N / 4) keys to the left
SOFT_CAP = 50.0  # "softcap": Gemma 2's attention logit cap
PAGE_SIZE = 16  # "paged-decode": keys per page of the KV cache (the CLI's --page-size)
CONTEXT_PARALLEL = "context-parallel"


@dataclasses.dataclass(frozen=True)
class BenchCase:
    """One measured problem. Field names match the records of the first JSON format."""

    b: int
    t: int
    s: int
    hq: int
    hkv: int
    d: int
    dv: int
    causal: bool = False
    dtype: str = "bf16"
    # None | "sparse90": a 90%-sparse block mask [1, 1, T, S] | "keys": key padding [B, 1, 1, S]
    mask: str | None = None
    mode: str = "fwd"  # "fwd" | "fwdbwd" (gradients through a fixed random cotangent)
    kind: str = "self"
    bias: str | None = None  # None | "heads": a float bias [1, Hq, T, S], differentiated
    dropout: float = 0.0  # dropout rate on the probabilities
    segments: int = 0  # packed sequences: this many equal segments per row (segment ids)
    window: int = 0  # a left window of this many keys (local_window_size=(window, 0))
    softcap: float = 0.0  # logits_soft_cap (0: none)
    page: int = 0  # paged KV cache: keys per page (0: contiguous K/V)
    sinks: bool = False  # attention sinks: one logit per query head (`sink_logits`)
    # context-parallel: the sequence split over this many devices (0: the process's count,
    # set by the CLI), in this `context_layout`, by this `context_strategy` ("": the rule's)
    devices: int = 0
    layout: str = ""
    strategy: str = ""

    @property
    def label(self) -> str:
        """The first format's label, extended by bias and dropout (so old and new rows of the
        same problem share a label)."""
        heads = f"{self.hq}" if self.hq == self.hkv else f"{self.hq}/{self.hkv}"
        dims = f"{self.d}" if self.d == self.dv else f"{self.d}/{self.dv}"
        extra = (" causal" if self.causal else "") + (f" {self.mask}" if self.mask else "")
        extra += (" bias[1,H,T,S]" if self.bias == "heads" else "")
        extra += (f" dropout{self.dropout:g}" if self.dropout else "")
        extra += (f" packed{self.segments}" if self.segments else "")
        extra += (f" window{self.window}" if self.window else "")
        extra += (f" softcap{self.softcap:g}" if self.softcap else "")
        extra += (f" page{self.page}" if self.page else "")
        extra += (" sinks" if self.sinks else "")
        if self.kind == CONTEXT_PARALLEL:
            extra += f" cp{self.devices or ''}-{self.layout}" + (f"-{self.strategy}"
                                                                 if self.strategy else "")
        seq = f"{self.t}" if self.t == self.s else f"{self.t}x{self.s}"
        return f"D={dims} B={self.b} H={heads} N={seq} {self.dtype}{extra} {self.mode}"

    @property
    def group(self) -> int:
        return self.hq // self.hkv

    @property
    def mask_shape(self) -> tuple[int, int, int, int] | None:
        """The 4-D shape of the case's mask: [B, 1, 1, S] for key padding, [1, 1, T, S]
        for the sparse block mask (`measure.make_inputs` builds it)."""
        if self.mask is None:
            return None
        return (self.b, 1, 1, self.s) if self.mask == "keys" else (1, 1, self.t, self.s)

    def flops(self) -> float:
        """4·B·Hq·T·S·D (D the mean of D and Dv), halved when causal, x3.5 for fwd+bwd; with
        segments or a window, 4·B·Hq·D per (query, key) pair they leave visible."""
        if self.segments or self.window:
            work = 2.0 * self.b * self.hq * self.visible_pairs() * (self.d + self.dv)
        else:
            work = 2.0 * self.b * self.hq * self.t * self.s * (self.d + self.dv)
            work = work / 2 if self.causal else work
        return work * 3.5 if self.mode == "fwdbwd" else work

    def visible_pairs(self) -> int:
        """How many (query, key) pairs of one (batch, head) the causality, window and
        segments leave visible (counted per row, never as a [T, S] matrix)."""
        i = np.arange(self.t)
        shift = self.s - self.t
        hi = np.minimum(self.s - 1, i + shift) if self.causal else np.full(self.t, self.s - 1)
        lo = np.maximum(0, i + shift - self.window) if self.window else np.zeros(self.t, int)
        if self.segments:
            q_ids, kv_ids = segment_ids(self)
            starts = np.searchsorted(kv_ids, q_ids, side="left")
            ends = np.searchsorted(kv_ids, q_ids, side="right") - 1
            lo, hi = np.maximum(lo, starts), np.minimum(hi, ends)
        return int(np.sum(np.maximum(0, hi - lo + 1)))

    def min_bytes(self) -> float | None:
        """Fewest bytes a forward must move: q, k, v (and bias, mask) read once, out written
        once. None for forward+backward (its floor depends on the saved residuals)."""
        if self.mode != "fwd":
            return None
        item = DTYPE_BYTES[self.dtype]
        elems = (self.b * self.t * self.hq * (self.d + self.dv)  # q and out
                 + self.b * self.s * self.hkv * (self.d + self.dv))  # k and v
        extra = self.hq * self.t * self.s * item if self.bias == "heads" else 0
        extra += math.prod(self.mask_shape) if self.mask else 0  # bool, one byte each
        extra += 4 * self.b * (self.t + self.s) if self.segments else 0  # int32 ids
        return float(elems * item + extra)


def segment_ids(case: BenchCase) -> tuple[np.ndarray, np.ndarray]:
    """int32 ids [T] and [S] of `case.segments` equal segments (the same in every row of the
    batch): query i and key j share a document iff they sit in the same fraction of T and S."""
    n = max(1, case.segments)
    return ((np.arange(case.t) * n // case.t).astype(np.int32),
            (np.arange(case.s) * n // case.s).astype(np.int32))


def page_table(case: BenchCase) -> np.ndarray:
    """int32 [B, S / page]: each sequence's pages, spread over the pool in a fixed shuffled
    order (as a serving pool's pages end up), the same in every run."""
    per_seq = case.s // case.page
    order = np.random.default_rng(0).permutation(case.b * per_seq)
    return order.reshape(case.b, per_seq).astype(np.int32)


def sink_logits(case: BenchCase) -> np.ndarray:
    """float32 [Hq]: the sinks case's per-head sink logits, the same in every run."""
    return np.random.default_rng(1).standard_normal(case.hq).astype(np.float32)


def feature_kwargs(case: BenchCase) -> dict:
    """`ffpa_jax.attention`'s feature arguments for `case` (empty for the other kinds)."""
    import jax.numpy as jnp
    kw: dict = {}
    if case.segments:
        q_ids, kv_ids = segment_ids(case)
        kw["q_segment_ids"] = jnp.broadcast_to(jnp.asarray(q_ids), (case.b, case.t))
        kw["kv_segment_ids"] = jnp.broadcast_to(jnp.asarray(kv_ids), (case.b, case.s))
    if case.window:
        kw["local_window_size"] = (case.window, 0)
    if case.softcap:
        kw["logits_soft_cap"] = case.softcap
    if case.sinks:
        kw["sinks"] = jnp.asarray(sink_logits(case))
    return kw


def key_lengths(case: BenchCase) -> np.ndarray:
    """int [B]: the keys each batch row of a key-mask case keeps, cycling through S, 7S/8,
    S/2 and S/4 (padding of a batch of unequal documents)."""
    fractions = (1.0, 0.875, 0.5, 0.25)
    return np.array([max(1, int(case.s * fractions[i % 4])) for i in range(case.b)])


def sparse_block_mask(t: int, s: int, rng: np.random.Generator) -> np.ndarray:
    """[T, S] bool: 90% of (block x block) tiles off, the first key tile always on."""
    block = 128 if min(t, s) >= 1024 else 32
    tiles = rng.random((-(-t // block), -(-s // block))) < 0.1
    tiles[:, 0] = True  # every query keeps some keys
    return np.repeat(np.repeat(tiles, block, 0), block, 1)[:t, :s]


# ---------------------------------------------------------------- kinds
def make_case(kind: str, *, d: int, n: int, b: int, h: int, kv_heads: int = 0,
              kv_seqlen: int = 0, causal: bool = False, dtype: str = "bf16", mode: str = "fwd",
              dropout: float = DEFAULT_DROPOUT, page: int = PAGE_SIZE, devices: int = 0,
              layout: str = "zigzag", strategy: str = "") -> BenchCase:
    """The problem of `kind` built on a base shape: head dim d, seqlen n, batch b, heads h.

    self: T = S = n (kv_heads honoured, as the first CLI did); cross: S = kv_seqlen or n/2;
    decode: T = 1, S = n, Hkv = kv_heads or H/4 (forward only); gqa: Hkv = kv_heads or H/4;
    mqa: Hkv = 1; causal: bottom-right causal; attn-mask: a 90%-sparse block mask; key-mask:
    key padding, a [B, 1, 1, S] mask hiding each batch row's last keys (`key_lengths`);
    bias-grad: a [1, Hq, T, S] bias, differentiated in forward+backward; dropout: rate
    `dropout` on the probabilities; non-aligned: T = S = n - 1 for even n (8191 from 8192);
    packed: causal, `PACKED_SEGMENTS` equal documents per row (segment ids); window: causal,
    a left window of min(MAX_WINDOW, n / 4) keys; softcap: logits capped at SOFT_CAP; sinks:
    attention sinks (`sink_logits`);
    paged-decode: decode over a paged KV cache of `page` keys per page, each sequence's pages
    shuffled through the pool (forward only); context-parallel: causal, the sequence split
    over `devices` devices (0: all of the process's) in `layout`, by `strategy` ("": the
    rule's), inside a shard_map.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown case kind {kind!r}; known: {', '.join(KINDS)}")
    hkv = kv_heads or h
    t = s = n
    fields: dict = {}
    if kind == "cross":
        s = kv_seqlen or max(1, n // 2)
    elif kind in FORWARD_ONLY:
        t, s = 1, n
        hkv = kv_heads or max(1, h // 4)
        mode = "fwd"
        if kind == "paged-decode":
            if page < 1 or n % page:
                raise ValueError(f"paged-decode: seqlen {n} must be a multiple of the page "
                                 f"size {page}")
            fields["page"] = page
    elif kind == "gqa":
        hkv = kv_heads or max(1, h // 4)
    elif kind == "mqa":
        hkv = 1
    elif kind == "causal":
        causal = True
    elif kind == "attn-mask":
        fields["mask"] = "sparse90"
    elif kind == "key-mask":
        fields["mask"] = "keys"
    elif kind == "bias-grad":
        fields["bias"] = "heads"
    elif kind == "dropout":
        fields["dropout"] = dropout
    elif kind == "non-aligned":
        t = s = n - 1 if n % 2 == 0 else n
    elif kind == "packed":
        causal = True
        fields["segments"] = PACKED_SEGMENTS
    elif kind == "window":
        causal = True
        fields["window"] = max(1, min(MAX_WINDOW, n // 4))
    elif kind == "softcap":
        fields["softcap"] = SOFT_CAP
    elif kind == "sinks":
        fields["sinks"] = True
    elif kind == CONTEXT_PARALLEL:
        causal = True
        fields.update(devices=devices, layout=layout, strategy=strategy)
    if h % hkv:
        raise ValueError(f"{kind}: heads {h} is not a multiple of kv heads {hkv}")
    return BenchCase(b=b, t=t, s=s, hq=h, hkv=hkv, d=d, dv=d, causal=causal, dtype=dtype,
                     mode=mode, kind=kind, **fields)


def with_modes(cases: list[BenchCase], modes: list[str]) -> list[BenchCase]:
    """Each case in each mode (the decode kinds stay forward only); duplicates dropped, order
    kept."""
    out: list[BenchCase] = []
    for case in cases:
        for mode in (["fwd"] if case.kind in FORWARD_ONLY else modes):
            c = dataclasses.replace(case, mode=mode)
            if c not in out:
                out.append(c)
    return out


def _base(kind: str, d: int, n: int, b: int, h: int = 32, **kw) -> BenchCase:
    return make_case(kind, d=d, n=n, b=b, h=h, **kw)


def gpu_preset() -> list[BenchCase]:
    """The issue's target shapes (bf16), forward; `with_modes` adds forward+backward."""
    cases = [_base("self", d, 4096, 4) for d in (64, 128)]
    cases += [_base("causal", d, 4096, 4) for d in (64, 128)]
    cases += [_base("self", 256, 4096, 1)]
    cases += [_base("self", d, n, 1) for d in (512, 1024) for n in (4096, 16384)]
    cases += [_base("decode", 128, 8192, 8, kv_heads=8),
              _base("decode", 512, 131072, 8, kv_heads=8)]
    cases += [_base("dropout", 128, 4096, 4), _base("dropout", 512, 4096, 1)]
    cases += [_base("self", 512, 4096, 1)]  # the no-dropout twin of the D=512 dropout row
    cases += [_base("gqa", 128, 4096, 4), _base("mqa", 128, 4096, 4)]
    cases += [_base("cross", 128, 4096, 4)]
    cases += [_base("attn-mask", 128, 4096, 1), _base("bias-grad", 128, 4096, 1)]
    cases += [_base("key-mask", 128, 4096, 4)]
    cases += [_base("non-aligned", 128, 8192, 1)]
    cases += [_base(kind, 128, n, 4) for kind in ("packed", "window") for n in (4096, 16384)]
    cases += [_base("softcap", 128, 4096, 4), _base("softcap", 256, 4096, 1)]
    cases += [_base("sinks", 128, 4096, 4)]
    cases += [_base("paged-decode", 128, 8192, 8, kv_heads=8, page=p) for p in (16, 64)]
    cases += [_base(CONTEXT_PARALLEL, 512, 32768, 1, h=8)]
    out: list[BenchCase] = []
    for c in cases:
        if c not in out:
            out.append(c)
    return out


def gpu_quick_preset() -> list[BenchCase]:
    """One shape per kind (D=128 at B=4 / B=8 decode, plus D=512 self), for a quick look."""
    cases = [_base(kind, 128, 4096, 4 if kind not in FORWARD_ONLY else 8) for kind in KINDS]
    cases.append(_base("self", 512, 4096, 1))
    return cases


def cpu_preset() -> list[BenchCase]:
    """Small shapes the Pallas interpreter runs in seconds; one or two per kind."""
    small = dict(h=2)
    cases = [make_case("self", d=64, n=128, b=1, **small),
             make_case("self", d=512, n=64, b=1, **small),
             make_case("cross", d=64, n=96, b=1, kv_seqlen=160, **small),
             make_case("decode", d=128, n=256, b=2, h=4, kv_heads=2),
             make_case("gqa", d=64, n=128, b=2, h=4, kv_heads=2),
             make_case("mqa", d=64, n=128, b=1, h=4),
             make_case("causal", d=128, n=128, b=1, **small),
             make_case("attn-mask", d=64, n=256, b=1, **small),
             make_case("key-mask", d=64, n=128, b=2, **small),
             make_case("bias-grad", d=64, n=128, b=1, **small),
             make_case("dropout", d=64, n=128, b=1, **small),
             make_case("non-aligned", d=40, n=128, b=1, **small),
             make_case("packed", d=64, n=128, b=2, **small),
             make_case("window", d=64, n=128, b=1, **small),
             make_case("softcap", d=64, n=128, b=1, **small),
             make_case("sinks", d=64, n=128, b=1, **small),
             make_case("paged-decode", d=64, n=256, b=2, h=4, kv_heads=2),
             make_case(CONTEXT_PARALLEL, d=64, n=256, b=1, h=4, kv_heads=2)]
    return cases


def cpu_quick_preset() -> list[BenchCase]:
    """The first CPU shape of each kind."""
    seen: set[str] = set()
    out = []
    for c in cpu_preset():
        if c.kind not in seen:
            seen.add(c.kind)
            out.append(c)
    return out


def grid(kinds: list[str], *, headdims: list[int], seqlens: list[int], batch: int, heads: int,
         kv_heads: int, kv_seqlen: int, causal: bool, dtype: str,
         dropout: float, page: int = PAGE_SIZE, **context) -> list[BenchCase]:
    """Every kind on every (head dim, seqlen): the first CLI's grid, generalised. Batch
    defaults to 4 for D <= 128, else 1 (the decode kinds: 8). `context`: the
    context-parallel kind's devices, layout and strategy."""
    cases = []
    for kind in kinds:
        for d in headdims:
            for n in seqlens:
                b = batch or (8 if kind in FORWARD_ONLY else 4 if d <= 128 else 1)
                cases.append(make_case(kind, d=d, n=n, b=b, h=heads, kv_heads=kv_heads,
                                       kv_seqlen=kv_seqlen, causal=causal, dtype=dtype,
                                       dropout=dropout, page=page, **context))
    return cases


def on_devices(cases: list[BenchCase], count: int) -> list[BenchCase]:
    """The context-parallel cases that say 0 devices, on `count` (the process's)."""
    return [dataclasses.replace(c, devices=count) if c.kind == CONTEXT_PARALLEL
            and not c.devices else c for c in cases]
