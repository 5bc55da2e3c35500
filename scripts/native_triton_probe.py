"""What a native Triton kernel could gain over the Pallas one (issue 7's other path).

Issue 7 allows a native Triton kernel behind the same API, but only with a measured
gain. Before any integration work (jax_triton, tuning schema, tests), this probe
measures the ceiling. It is a plain flash-attention forward written directly in
Triton, in four variants:

- `ptr`: pointer loads, the same primitives Pallas' Triton lowering emits;
- `tma`: host-built TMA tensor descriptors for the Q/K/V/O tiles;
- `tma+ws`: the same, with `tl.range(..., warp_specialize=True)`;
- `ptr-libdevice-exp2`: `ptr` with 2^x from libdevice's exp2f, which is what Pallas'
  Triton lowering makes of `jnp.exp2` on float32.

Each variant is timed in torch (the lent machines carry torch and triton 3.6), along
with torch's own SDPA. ffpa_jax's Pallas forward and cuDNN (through JAX) run in the
same process, on the same shapes. The Triton kernels use the [B, H, T, D] layout and JAX
uses [B, T, H, D]; both are compute-bound here. This is a measurement, not product code.

    python scripts/native_triton_probe.py --out probe.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def _fwd_ptr(Q, K, V, O, qk_scale, N_CTX, H, stride_b, stride_h, stride_t,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             LIBDEVICE_EXP2: tl.constexpr):
    """One program: BLOCK_M query rows of one (batch, head), any [B, H, N, D] strides.
    LIBDEVICE_EXP2 takes 2^x from libdevice's exp2f, as Pallas' lowering of jnp.exp2 does."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    base = (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + base + rows[:, None] * stride_t + cols[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    keys = tl.arange(0, BLOCK_N)
    for start in range(0, N_CTX, BLOCK_N):
        k = tl.load(K + base + (start + keys)[None, :] * stride_t + cols[:, None])
        s = tl.dot(q, k)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if LIBDEVICE_EXP2:
            p = libdevice.exp2(s * qk_scale - m_new[:, None])
            alpha = libdevice.exp2(m_i - m_new)
        else:
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + base + (start + keys)[:, None] * stride_t + cols[None, :])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + base + rows[:, None] * stride_t + cols[None, :], acc.to(O.dtype.element_ty))


@triton.jit
def _fwd_tma(desc_q, desc_k, desc_v, desc_o, qk_scale, N_CTX, H,
             HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             WARP_SPECIALIZE: tl.constexpr, SEQ_MAJOR: tl.constexpr):
    """The same with TMA descriptors: over [B*H*N, D] views ([B, H, N, D] data), or
    with SEQ_MAJOR over [B*N, H*D] views ([B, N, H, D] data, JAX's layout)."""
    bh = tl.program_id(1)
    if SEQ_MAJOR:
        row0 = (bh // H) * N_CTX
        col0 = (bh % H) * HEAD_DIM
    else:
        row0 = bh * N_CTX
        col0 = 0
    q_row = row0 + tl.program_id(0) * BLOCK_M
    q = desc_q.load([q_row, col0])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in tl.range(0, N_CTX, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([row0 + start, col0])
        s = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([row0 + start, col0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    acc = acc / l_i[:, None]
    desc_o.store([q_row, col0], acc.to(q.dtype))


def triton_runner(variant: str, q, k, v, *, block_m: int, block_n: int, num_warps: int,
                  num_stages: int, seq_major: bool):
    """A zero-argument launch of `variant` (returns the output). The tensors are
    [B, N, H, D] when `seq_major` (JAX's layout), else [B, H, N, D]."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if seq_major:
        b, n, h, d = q.shape
        strides = (n * h * d, d, h * d)  # batch, head, token
    else:
        b, h, n, d = q.shape
        strides = (h * n * d, n * d, d)
    o = torch.empty_like(q)
    grid = (n // block_m, b * h)
    scale = LOG2E / math.sqrt(d)
    compiled = {}
    if variant in ("ptr", "ptr-libdevice-exp2"):
        def run():
            compiled["kernel"] = _fwd_ptr[grid](
                q, k, v, o, scale, n, h, *strides, HEAD_DIM=d, BLOCK_M=block_m,
                BLOCK_N=block_n, LIBDEVICE_EXP2=variant != "ptr", num_warps=num_warps,
                num_stages=num_stages)
            return o
        run.compiled = compiled
        return run
    shape2d = (b * n, h * d) if seq_major else (b * h * n, d)
    descs = [TensorDescriptor.from_tensor(t.view(*shape2d), [blk, d]) for t, blk in
             zip((q, k, v, o), (block_m, block_n, block_n, block_m))]

    def run():
        compiled["kernel"] = _fwd_tma[grid](
            *descs, scale, n, h, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
            WARP_SPECIALIZE=variant == "tma+ws", SEQ_MAJOR=seq_major,
            num_warps=num_warps, num_stages=num_stages)
        return o
    run.compiled = compiled
    return run


def time_torch(fn, reps: int = 7) -> float:
    """Median ms of `reps` samples of back-to-back calls filling >= 50 ms each."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    inner = max(1, int(0.05 / max(time.perf_counter() - start, 1e-6)))
    samples = []
    for _ in range(reps):
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(begin.elapsed_time(end) / inner)
    return statistics.median(samples)


CONFIGS = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    64: [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 3), (128, 128, 4, 2)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 2), (128, 64, 4, 3)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2), (128, 32, 8, 2)],
}


def jax_times(b: int, h: int, n: int, d: int) -> dict:
    """ffpa_jax's forward and cuDNN's, timed with the bench's own sampler."""
    import jax
    import jax.numpy as jnp

    import ffpa_jax
    from ffpa_jax.bench.measure import time_samples

    keys = jax.random.split(jax.random.key(d), 3)
    q, k, v = (jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in keys)
    out = {}
    for name, fn in (("ffpa", lambda q, k, v: ffpa_jax.attention(q, k, v)),
                     ("cudnn", lambda q, k, v: jax.nn.dot_product_attention(
                         q, k, v, implementation="cudnn"))):
        try:
            compiled = jax.jit(fn).lower(q, k, v).compile()
            out[name] = statistics.median(time_samples(compiled, (q, k, v), min_rep_s=0.05, reps=7))
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is a row, not a crash
            out[name] = f"error: {str(exc).splitlines()[0][:160]}"
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--seqlen", type=int, default=4096)
    args = parser.parse_args()
    results = {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
               "torch": torch.__version__, "records": []}
    for d in (int(x) for x in args.dims.split(",")):
        b, h, n = (4 if d <= 128 else 1), 32, args.seqlen
        flops = 4.0 * b * h * n * n * d
        gen = torch.Generator(device="cuda").manual_seed(d)
        qs, ks, vs = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                      for _ in range(3))  # [B, N, H, D], as JAX holds them
        q, k, v = (t.transpose(1, 2).contiguous() for t in (qs, ks, vs))  # [B, H, N, D]
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v).float()
        ref_max = ref.abs().max().item()
        record = {"headdim": d, "batch": b, "heads": h, "seqlen": n, "variants": []}
        record["torch_sdpa_ms"] = time_torch(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        for layout in ("BHND", "BNHD"):
            seq_major = layout == "BNHD"
            args3 = (qs, ks, vs) if seq_major else (q, k, v)
            for variant in ("ptr", "ptr-libdevice-exp2", "tma", "tma+ws"):
                for bm, bn, w, st in CONFIGS[d]:
                    row = {"variant": f"{variant} {layout}", "block_m": bm, "block_n": bn,
                           "num_warps": w, "num_stages": st}
                    try:
                        run = triton_runner(variant, *args3, block_m=bm, block_n=bn,
                                            num_warps=w, num_stages=st, seq_major=seq_major)
                        got = run().float()
                        got = got.transpose(1, 2) if seq_major else got
                        err = (got - ref).abs().max().item() / ref_max
                        row["rel_err"] = err
                        kernel = run.compiled.get("kernel")
                        if kernel is not None:
                            row.update(registers=getattr(kernel, "n_regs", None),
                                       spilled=getattr(kernel, "n_spills", None),
                                       shared_bytes=getattr(kernel.metadata, "shared", None))
                        if err > 2e-2:
                            row["status"] = "wrong result"
                        else:
                            row["ms"] = time_torch(run)
                            row["tflops"] = flops / row["ms"] / 1e9
                            row["status"] = "ok"
                    except Exception as exc:  # noqa: BLE001 - a variant that fails is a finding
                        row["status"] = (f"{type(exc).__name__}: "
                                         f"{str(exc).strip().splitlines()[0][:160]}")
                    record["variants"].append(row)
                    print(json.dumps({"headdim": d, **row}), flush=True)
        del q, k, v, qs, ks, vs, ref
        torch.cuda.empty_cache()
        record.update({f"{name}_ms": ms for name, ms in jax_times(b, h, n, d).items()})
        results["records"].append(record)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print("\nbest per head dim and variant (TF/s = 4·B·H·N²·D / time):")
    for r in results["records"]:
        d, flops = r["headdim"], 4.0 * r["batch"] * r["heads"] * r["seqlen"] ** 2 * r["headdim"]
        peers = "  ".join(f"{name} {r[f'{name}_ms']:.3f} ms ({flops / r[f'{name}_ms'] / 1e9:.0f})"
                          if isinstance(r.get(f"{name}_ms"), float) else f"{name} {r.get(f'{name}_ms')}"
                          for name in ("ffpa", "cudnn", "torch_sdpa"))
        print(f"D={d}: {peers}")
        for variant in sorted({x["variant"] for x in r["variants"]}):
            ok = [x for x in r["variants"] if x["variant"] == variant and x["status"] == "ok"]
            if ok:
                best = min(ok, key=lambda x: x["ms"])
                print(f"   {variant:12s} {best['ms']:.3f} ms {best['tflops']:.0f} TF/s  BM={best['block_m']} "
                      f"BN={best['block_n']} w={best['num_warps']} st={best['num_stages']}")
            else:
                print(f"   {variant:12s} none ran: " + "; ".join(
                    sorted({x['status'][:90] for x in r['variants'] if x['variant'] == variant})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
