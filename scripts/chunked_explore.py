"""One-off: the chunked tier's block size against XLA's dense path, the naive composition and
the Pallas kernels, at large head dims (bf16). Writes one JSON line per measurement.

    PYTHONPATH=. python3 scripts/chunked_explore.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp

import ffpa_jax
from ffpa_jax import validation
from ffpa_jax.bench.measure import memory_mib, time_samples
from ffpa_jax.bench.peers import naive_chunked_attention
from ffpa_jax.chunked_path import chunked_attention


def problem_of(q, k, v, causal):
    return validation.validate(q, k, v, None, None, scale=None, is_causal=causal,
                               dropout_rate=0.0, dropout_rng=None, return_lse=False,
                               implementation=None, interpret=False)


def impls(causal, t, blocks_list):
    out = {
        "xla-dense": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, implementation="xla"),
        "naive-chunked": lambda q, k, v: naive_chunked_attention(
            q, k, v, scale=q.shape[-1] ** -0.5, causal=causal),
        "pallas": lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=causal,
                                                     implementation="pallas"),
    }
    for blocks in blocks_list:
        def run(q, k, v, blocks=blocks):
            problem = problem_of(q, k, v, causal)
            return chunked_attention(q, k, v, None, None, problem,
                                     blocks=None if blocks is None else (blocks, k.shape[1]))[0]
        out[f"chunked-{blocks or 'budget'}"] = run
    return out


def kernel_count(compiled) -> int:
    text = compiled.as_text()
    entry = text[text.rfind("ENTRY"):]
    return len(re.findall(r"= [^=]*(?:fusion|custom-call)\(", entry))


def measure(name, fn, q, k, v, do, mode, flops, ref=None):
    rec = {"impl": name, "mode": mode}
    try:
        if mode == "fwd":
            f = jax.jit(fn)
            args = (q, k, v)
        else:
            def fb(q, k, v, do):
                out, vjp = jax.vjp(fn, q, k, v)
                return (out, *vjp(do))
            f = jax.jit(fb)
            args = (q, k, v, do)
        t0 = time.perf_counter()
        compiled = f.lower(*args).compile()
        rec["compile_s"] = round(time.perf_counter() - t0, 2)
        rec["peak_mib"], rec["workspace_mib"] = memory_mib(compiled)
        rec["kernels"] = kernel_count(compiled)
        outs = compiled(*args)
        first = outs if mode == "fwd" else outs[0]
        if ref is not None and name in ref:
            a, b = first.astype(jnp.float32), ref[name].astype(jnp.float32)
            rec["diff_vs_dense"] = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        elif ref is not None:
            ref[name] = first
        del outs, first
        samples = time_samples(compiled, args, min_rep_s=0.1, reps=7, budget_s=4.0)
        rec["ms"] = statistics.median(samples)
        rec["spread"] = (max(samples) - min(samples)) / rec["ms"]
        rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
        rec["status"] = "ok"
    except Exception as exc:  # noqa: BLE001
        rec["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dump-hlo", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a CPU check of this script")
    args = ap.parse_args()
    # (D, N, H, Hkv, causal, block rows to try; None = the default budget)
    cases = [
        (512, 4096, 32, 32, False, [512, 1024, 2048, 4096]),
        (1024, 4096, 32, 32, False, [512, 1024, 2048, 4096]),
        (512, 4096, 32, 32, True, [512, 1024]),
        (512, 8192, 32, 8, False, [1024, None]),
        (512, 16384, 32, 32, False, [1024, None]),
        (512, 32768, 8, 8, False, [None]),
    ]
    if args.quick:
        cases = cases[:1]
    if args.tiny:
        cases = [(64, 256, 2, 2, False, [64, None]), (64, 256, 2, 1, True, [128])]
    path = os.path.join(args.out, "chunked_explore.jsonl")
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    with open(path, "w") as log:
        for d, n, h, hkv, causal, blocks_list in cases:
            key = jax.random.key(d + n)
            kq, kk, kv, kd = jax.random.split(key, 4)
            q = jax.random.normal(kq, (1, n, h, d), jnp.bfloat16)
            k = jax.random.normal(kk, (1, n, hkv, d), jnp.bfloat16)
            v = jax.random.normal(kv, (1, n, hkv, d), jnp.bfloat16)
            do = jax.random.normal(kd, (1, n, h, d), jnp.bfloat16)
            fwd_flops = 4.0 * h * n * n * d / (2 if causal else 1)
            refs = {}
            for mode in ("fwd", "fwdbwd"):
                flops = fwd_flops * (3.5 if mode == "fwdbwd" else 1)
                for name, fn in impls(causal, n, blocks_list).items():
                    if name == "xla-dense" and n >= 16384 and mode == "fwdbwd":
                        continue
                    if name == "pallas" and n >= 16384:
                        continue
                    ref = refs if mode == "fwd" and n <= 8192 else None
                    if ref is not None and "xla-dense" in ref:
                        ref = {name: ref["xla-dense"], **ref}
                    rec = measure(name, fn, q, k, v, do, mode, flops, ref)
                    rec.update(d=d, n=n, h=h, hkv=hkv, causal=causal)
                    log.write(json.dumps(rec) + "\n")
                    log.flush()
                    ms = rec.get("ms")
                    timing = "" if ms is None else f"{ms:8.3f} ms {rec['tflops']:6.1f} TF/s"
                    status = "" if rec["status"] == "ok" else rec["status"]
                    label = f"D={d} N={n} H={h}/{hkv}" + (" causal" if causal else "")
                    print(f"{label} {mode:6s} {name:16s} {timing} peak={rec.get('peak_mib')} "
                          f"k={rec.get('kernels')} c={rec.get('compile_s')} d={rec.get('diff_vs_dense')} {status}", flush=True)
            del q, k, v, do
    if args.dump_hlo:
        q = jnp.ones((1, 4096, 32, 512), jnp.bfloat16)
        fn = impls(False, 4096, [1024])["chunked-1024"]
        def fb(q, k, v, do):
            out, vjp = jax.vjp(fn, q, k, v)
            return (out, *vjp(do))
        text = jax.jit(fb).lower(q, q, q, q).compile().as_text()
        with open(os.path.join(args.out, "chunked_fwdbwd_d512.hlo.txt"), "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
