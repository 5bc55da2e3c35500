"""What the benchmark measures: one `BenchCase` per row, the case kinds, and the presets.

A case kind ("self", "gqa", "decode", ...) turns a base shape (D, N, B, H) into the
problem that kind is about; the GPU preset lists the issue's target shapes, the CPU
preset small shapes that the Pallas interpreter runs in seconds.
"""

from __future__ import annotations

import dataclasses

import numpy as np

KINDS = ("self", "cross", "decode", "gqa", "mqa", "causal", "attn-mask", "bias-grad", "dropout",
         "non-aligned")
MODES = ("fwd", "fwdbwd")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DEFAULT_DROPOUT = 0.1


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
    mask: str | None = None  # None | "sparse90": a 90%-sparse block mask [T, S]
    mode: str = "fwd"  # "fwd" | "fwdbwd" (gradients through a fixed random cotangent)
    kind: str = "self"
    bias: str | None = None  # None | "heads": a float bias [1, Hq, T, S], differentiated
    dropout: float = 0.0  # dropout rate on the probabilities

    @property
    def label(self) -> str:
        """The first format's label, extended by bias and dropout (so old and new rows of the
        same problem share a label)."""
        heads = f"{self.hq}" if self.hq == self.hkv else f"{self.hq}/{self.hkv}"
        dims = f"{self.d}" if self.d == self.dv else f"{self.d}/{self.dv}"
        extra = (" causal" if self.causal else "") + (f" {self.mask}" if self.mask else "")
        extra += (" bias[1,H,T,S]" if self.bias == "heads" else "")
        extra += (f" dropout{self.dropout:g}" if self.dropout else "")
        seq = f"{self.t}" if self.t == self.s else f"{self.t}x{self.s}"
        return f"D={dims} B={self.b} H={heads} N={seq} {self.dtype}{extra} {self.mode}"

    @property
    def group(self) -> int:
        return self.hq // self.hkv

    def flops(self) -> float:
        """4·B·Hq·T·S·D (D the mean of D and Dv), halved when causal, x3.5 for fwd+bwd."""
        work = 2.0 * self.b * self.hq * self.t * self.s * (self.d + self.dv)
        work = work / 2 if self.causal else work
        return work * 3.5 if self.mode == "fwdbwd" else work

    def min_bytes(self) -> float | None:
        """Fewest bytes a forward must move: q, k, v (and bias, mask) read once, out written
        once. None for forward+backward (its floor depends on the saved residuals)."""
        if self.mode != "fwd":
            return None
        item = DTYPE_BYTES[self.dtype]
        elems = (self.b * self.t * self.hq * (self.d + self.dv)  # q and out
                 + self.b * self.s * self.hkv * (self.d + self.dv))  # k and v
        extra = self.hq * self.t * self.s * item if self.bias == "heads" else 0
        extra += self.t * self.s if self.mask else 0  # bool, one byte each
        return float(elems * item + extra)


def sparse_block_mask(t: int, s: int, rng: np.random.Generator) -> np.ndarray:
    """[T, S] bool: 90% of (block x block) tiles off, the first key tile always on."""
    block = 128 if min(t, s) >= 1024 else 32
    tiles = rng.random((-(-t // block), -(-s // block))) < 0.1
    tiles[:, 0] = True  # every query keeps some keys
    return np.repeat(np.repeat(tiles, block, 0), block, 1)[:t, :s]


# ---------------------------------------------------------------- kinds
def make_case(kind: str, *, d: int, n: int, b: int, h: int, kv_heads: int = 0,
              kv_seqlen: int = 0, causal: bool = False, dtype: str = "bf16", mode: str = "fwd",
              dropout: float = DEFAULT_DROPOUT) -> BenchCase:
    """The problem of `kind` built on a base shape: head dim d, seqlen n, batch b, heads h.

    self: T = S = n (kv_heads honoured, as the first CLI did); cross: S = kv_seqlen or n/2;
    decode: T = 1, S = n, Hkv = kv_heads or H/4 (forward only); gqa: Hkv = kv_heads or H/4;
    mqa: Hkv = 1; causal: bottom-right causal; attn-mask: a 90%-sparse block mask;
    bias-grad: a [1, Hq, T, S] bias, differentiated in forward+backward; dropout: rate
    `dropout` on the probabilities; non-aligned: T = S = n - 1 for even n (8191 from 8192).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown case kind {kind!r}; known: {', '.join(KINDS)}")
    hkv = kv_heads or h
    t = s = n
    fields: dict = {}
    if kind == "cross":
        s = kv_seqlen or max(1, n // 2)
    elif kind == "decode":
        t, s = 1, n
        hkv = kv_heads or max(1, h // 4)
        mode = "fwd"
    elif kind == "gqa":
        hkv = kv_heads or max(1, h // 4)
    elif kind == "mqa":
        hkv = 1
    elif kind == "causal":
        causal = True
    elif kind == "attn-mask":
        fields["mask"] = "sparse90"
    elif kind == "bias-grad":
        fields["bias"] = "heads"
    elif kind == "dropout":
        fields["dropout"] = dropout
    elif kind == "non-aligned":
        t = s = n - 1 if n % 2 == 0 else n
    if h % hkv:
        raise ValueError(f"{kind}: heads {h} is not a multiple of kv heads {hkv}")
    return BenchCase(b=b, t=t, s=s, hq=h, hkv=hkv, d=d, dv=d, causal=causal, dtype=dtype,
                     mode=mode, kind=kind, **fields)


def with_modes(cases: list[BenchCase], modes: list[str]) -> list[BenchCase]:
    """Each case in each mode (decode stays forward only); duplicates dropped, order kept."""
    out: list[BenchCase] = []
    for case in cases:
        for mode in (["fwd"] if case.kind == "decode" else modes):
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
    cases += [_base("non-aligned", 128, 8192, 1)]
    out: list[BenchCase] = []
    for c in cases:
        if c not in out:
            out.append(c)
    return out


def gpu_quick_preset() -> list[BenchCase]:
    """One shape per kind (D=128 at B=4 / B=8 decode, plus D=512 self), for a quick look."""
    cases = [_base(kind, 128, 4096, 4 if kind not in ("decode",) else 8) for kind in KINDS]
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
             make_case("bias-grad", d=64, n=128, b=1, **small),
             make_case("dropout", d=64, n=128, b=1, **small),
             make_case("non-aligned", d=40, n=128, b=1, **small)]
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
         dropout: float) -> list[BenchCase]:
    """Every kind on every (head dim, seqlen): the first CLI's grid, generalised. Batch
    defaults to 4 for D <= 128, else 1 (decode: 8)."""
    cases = []
    for kind in kinds:
        for d in headdims:
            for n in seqlens:
                b = batch or (8 if kind == "decode" else 4 if d <= 128 else 1)
                cases.append(make_case(kind, d=d, n=n, b=b, h=heads, kv_heads=kv_heads,
                                       kv_seqlen=kv_seqlen, causal=causal, dtype=dtype,
                                       dropout=dropout))
    return cases
