"""`python -m ffpa_jax.bench`: ffpa_jax against its peers, measured side by side in one run.

Peers: cuDNN (`jax.nn.dot_product_attention(implementation="cudnn")`), XLA's dense
path (`jax.nn.dot_product_attention(implementation="xla")`, or ffpa_jax's own XLA
path where jax.nn's semantics differ, e.g. causal with T != S), and JAX's Pallas
attention (`jax.experimental.pallas.ops.gpu.attention.mha`).

Columns: median time of a warm call (compile excluded), TF/s (4·B·Hq·T·S·D for
the forward with D the mean of D and Dv, halved when causal, x3.5 for
forward+backward), our speedup
against each peer, the max error against a float64 reference on sampled rows
(relative to the reference's max magnitude), and the compiled call's device
workspace (XLA's memory analysis: temporaries plus outputs).

Without a GPU it runs a small table through the Pallas interpreter and XLA on
the CPU, says so, and the times mean nothing but that the code runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

import ffpa_jax
from ffpa_jax.reference import mha_reference

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
SAMPLE_ROWS = 64


@dataclasses.dataclass(frozen=True)
class BenchCase:
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
    mode: str = "fwd"  # "fwd" | "fwdbwd" (gradients of q, k, v through a random cotangent)

    @property
    def label(self) -> str:
        heads = f"{self.hq}" if self.hq == self.hkv else f"{self.hq}/{self.hkv}"
        dims = f"{self.d}" if self.d == self.dv else f"{self.d}/{self.dv}"
        extra = (" causal" if self.causal else "") + (f" {self.mask}" if self.mask else "")
        seq = f"{self.t}" if self.t == self.s else f"{self.t}x{self.s}"
        return f"D={dims} B={self.b} H={heads} N={seq} {self.dtype}{extra} {self.mode}"

    def flops(self) -> float:
        """4·B·Hq·T·S·D (D the mean of D and Dv), halved when causal, x3.5 for fwd+bwd."""
        work = 2.0 * self.b * self.hq * self.t * self.s * (self.d + self.dv)
        work = work / 2 if self.causal else work
        return work * 3.5 if self.mode == "fwdbwd" else work


def _inputs(case: BenchCase, seed: int = 0):
    kq, kk, kv, km = jax.random.split(jax.random.key(seed), 4)
    dtype = DTYPES[case.dtype]
    q = jax.random.normal(kq, (case.b, case.t, case.hq, case.d), dtype)
    k = jax.random.normal(kk, (case.b, case.s, case.hkv, case.d), dtype)
    v = jax.random.normal(kv, (case.b, case.s, case.hkv, case.dv), dtype)
    mask = None
    if case.mask == "sparse90":
        block = 128
        tiles = jax.random.bernoulli(km, 0.1, (-(-case.t // block), -(-case.s // block)))
        tiles = tiles.at[:, 0].set(True)  # every query keeps some keys
        mask = jnp.repeat(jnp.repeat(tiles, block, 0), block, 1)[: case.t, : case.s]
    return q, k, v, mask


# ---------------------------------------------------------------- implementations
def _with_mode(case: BenchCase, forward):
    """The forward itself, or forward+backward: (out, dq, dk, dv) for a fixed cotangent."""
    if case.mode == "fwd":
        return forward

    def forward_backward(q, k, v, mask):
        out, vjp = jax.vjp(lambda q, k, v: forward(q, k, v, mask), q, k, v)
        cotangent = jnp.cos(out.astype(jnp.float32)).astype(out.dtype)  # data-dependent, not zeros
        return (out, *vjp(cotangent))
    return forward_backward


def _ffpa(case: BenchCase, interpret: bool):
    def run(q, k, v, mask):
        return ffpa_jax.attention(q, k, v, mask=mask, is_causal=case.causal,
                                  implementation="pallas", interpret=interpret)
    return run


def _jax_nn(implementation: str):
    def make(case: BenchCase):
        if case.causal and case.t != case.s:
            raise NotImplementedError("jax.nn's causal mask is top-left aligned; T != S differs")

        def run(q, k, v, mask):
            m = None if mask is None else mask[None, None]
            return jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=case.causal,
                                                implementation=implementation)
        return run
    return make


def _xla(case: BenchCase):
    if not (case.causal and case.t != case.s):
        return _jax_nn("xla")(case)

    def run(q, k, v, mask):  # same semantics as ours: bottom-right causal
        return ffpa_jax.attention(q, k, v, mask=mask, is_causal=True, implementation="xla")
    return run


def _pallas_mha(case: BenchCase):
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    if case.hq != case.hkv:
        raise NotImplementedError("no GQA/MQA in JAX's Pallas mha")
    if case.d != case.dv:
        raise NotImplementedError("needs D == Dv")
    if case.mask is not None:
        raise NotImplementedError("takes segment ids, not a boolean mask")
    if case.causal and case.t != case.s:
        raise NotImplementedError("causal with T != S is not bottom-right aligned there")

    def run(q, k, v, mask):
        del mask
        return pallas_attention.mha(q, k, v, segment_ids=None, sm_scale=1.0 / math.sqrt(case.d),
                                    causal=case.causal)
    return run


PEERS: dict[str, Callable] = {"cudnn": _jax_nn("cudnn"), "xla": _xla, "pallas-mha": _pallas_mha}


# ---------------------------------------------------------------- measuring
def _time_ms(fn, args, *, min_rep_s: float, reps: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    once = max(time.perf_counter() - start, 1e-6)
    inner = max(1, int(min_rep_s / once))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / inner)
    return 1e3 * statistics.median(samples)


def _workspace_mib(compiled) -> float | None:
    try:
        mem = compiled.memory_analysis()
        return (mem.temp_size_in_bytes + mem.output_size_in_bytes) / 2**20
    except Exception:  # not every backend reports it
        return None


def _sampled_error(case: BenchCase, out, q, k, v, mask) -> float:
    """Max |out - ref| / max |ref| over sampled rows of batch 0, head 0 (and its kv head)."""
    rows = np.unique(np.linspace(0, case.t - 1, min(case.t, SAMPLE_ROWS)).astype(int))
    cpu = jax.devices("cpu")[0]
    with jax.enable_x64(True), jax.default_device(cpu):
        to64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
        qs = to64(np.asarray(q[0, :, :1].astype(jnp.float32)))  # [T, 1, D]
        ks = to64(np.asarray(k[0, :, :1].astype(jnp.float32)))
        vs = to64(np.asarray(v[0, :, :1].astype(jnp.float32)))
        m = None if mask is None else jnp.asarray(np.asarray(mask))[None, None]
        ref, _ = mha_reference(qs[None], ks[None], vs[None], None, m,
                               scale=1.0 / math.sqrt(case.d), is_causal=case.causal)
        ref = np.asarray(ref)[0, rows, 0]
    got = np.asarray(out[0, rows, 0].astype(jnp.float32), np.float64)
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))


def measure(case: BenchCase, name: str, make, *, min_rep_s: float, reps: int) -> dict:
    record = {"case": case.label, **dataclasses.asdict(case), "impl": name}
    try:
        q, k, v, mask = _inputs(case)
        fn = jax.jit(_with_mode(case, make(case)))
        compiled = fn.lower(q, k, v, mask).compile()
        record["workspace_mib"] = _workspace_mib(compiled)
        out = compiled(q, k, v, mask)
        out = out[0] if case.mode == "fwdbwd" else out
        record["error"] = _sampled_error(case, out, q, k, v, mask)  # of the forward output
        del out
        record["ms"] = _time_ms(compiled, (q, k, v, mask), min_rep_s=min_rep_s, reps=reps)
        record["tflops"] = case.flops() / (record["ms"] * 1e-3) / 1e12
        record["status"] = "ok"
    except Exception as exc:  # a peer that cannot run a case says why, the run goes on
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        record["status"] = f"{type(exc).__name__}: {first_line[:160]}"
    return record


# ---------------------------------------------------------------- presets and CLI
def _modes(mode: str) -> list[str]:
    return ["fwd", "fwdbwd"] if mode == "both" else [mode]


def gpu_cases(args) -> list[BenchCase]:
    cases = []
    for d in args.headdims:
        for n in args.seqlens:
            b = args.batch if args.batch else (4 if d <= 128 else 1)
            for mode in _modes(args.mode):
                cases.append(BenchCase(b=b, t=n, s=n, hq=args.heads, hkv=args.kv_heads or args.heads,
                                       d=d, dv=d,
                                       causal=args.causal, dtype=args.dtype, mode=mode))
    return cases


def default_gpu_cases(mode: str) -> list[BenchCase]:
    shapes = [BenchCase(4, 4096, 4096, 32, 32, d, d) for d in (64, 128)]
    shapes += [BenchCase(1, n, n, 32, 32, d, d) for d in (256, 512, 1024) for n in (4096, 16384)]
    shapes += [BenchCase(1, 4096, 4096, 32, 32, 128, 128, mask="sparse90")]
    return [dataclasses.replace(c, mode=m) for c in shapes for m in _modes(mode)]


def cpu_cases(mode: str) -> list[BenchCase]:
    shapes = [BenchCase(1, 128, 128, 2, 2, 64, 64),
              BenchCase(1, 96, 160, 4, 2, 128, 128, causal=True),
              BenchCase(1, 64, 64, 2, 2, 512, 512)]
    return [dataclasses.replace(c, mode=m) for c in shapes for m in _modes(mode)]


def _device_description() -> dict:
    dev = jax.devices()[0]
    import jaxlib
    return {"device": getattr(dev, "device_kind", dev.platform), "platform": dev.platform,
            "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python -m ffpa_jax.bench", *sys.argv[1:]])}


def _print_table(records: list[dict]) -> None:
    by_case: dict[str, dict[str, dict]] = {}
    for r in records:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    head = f"{'case':<41} {'impl':<11} {'ms':>9} {'TF/s':>7} {'err':>9} {'MiB':>8}  ffpa speedup / status"
    print(head)
    print("-" * len(head))
    for label, impls in by_case.items():
        ours = impls.get("ffpa")
        for name, r in impls.items():
            if r["status"] != "ok":
                print(f"{label:<41} {name:<11} {'-':>9} {'-':>7} {'-':>9} {'-':>8}  {r['status']}")
                continue
            mem = "-" if r.get("workspace_mib") is None else f"{r['workspace_mib']:.0f}"
            note = ""
            if name != "ffpa" and ours is not None and ours["status"] == "ok":
                note = f"x{r['ms'] / ours['ms']:.2f}"
            print(f"{label:<41} {name:<11} {r['ms']:>9.3f} {r['tflops']:>7.1f} "
                  f"{r['error']:>9.2e} {mem:>8}  {note}")
            label = ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ffpa_jax.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--headdims", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--seqlens", type=lambda s: [int(x) for x in s.split(",")], default=[4096])
    parser.add_argument("--batch", type=int, default=0, help="default: 4 for D <= 128, else 1")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=0, help="GQA/MQA: default = --heads")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--mode", choices=["fwd", "fwdbwd", "both"], default="both",
                        help="forward only, forward+backward, or both (default)")
    parser.add_argument("--peers", default="cudnn,xla,pallas-mha",
                        help=f"comma list from {sorted(PEERS)}, or 'none'")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", help="write all records and the device header here")
    args = parser.parse_args(argv)

    on_gpu = jax.devices()[0].platform == "gpu"
    peers = [] if args.peers == "none" else [p for p in args.peers.split(",") if p]
    for p in peers:
        if p not in PEERS:
            parser.error(f"--peers: unknown peer {p!r}; known: {sorted(PEERS)}")
    if on_gpu:
        cases = gpu_cases(args) if args.headdims else default_gpu_cases(args.mode)
        min_rep_s = 0.05
    else:
        print("No GPU found: running small shapes through the Pallas interpreter and XLA on the "
              "CPU. These times only show that the code runs; they say nothing about GPU speed.")
        cases, min_rep_s = cpu_cases(args.mode), 0.0
        peers = [p for p in peers if p == "xla"]
        args.reps = min(args.reps, 2)
    header = _device_description()
    print(f"device: {header['device']}  jax {header['jax']}  jaxlib {header['jaxlib']}  "
          f"{header['date']}")
    records = []
    for case in cases:
        records.append(measure(case, "ffpa", lambda c: _ffpa(c, interpret=not on_gpu),
                               min_rep_s=min_rep_s, reps=args.reps))
        for p in peers:
            records.append(measure(case, p, PEERS[p], min_rep_s=min_rep_s, reps=args.reps))
        print(f"  measured {case.label}", file=sys.stderr, flush=True)
    _print_table(records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "records": records}, f, indent=1)
    return 0 if all(r["status"] == "ok" for r in records if r["impl"] == "ffpa") else 1


if __name__ == "__main__":
    sys.exit(main())
