"""One-off, round 2: why the chunked forward trails XLA's dense forward, and the scan-based
tier's speed and memory. Forward variants are standalone (no mask/bias/causal):
softmax formulation, GEMM precision, block rows (incl. L2-sized blocks), a GEMM-only floor.

    PYTHONPATH=. python3 scripts/chunked_explore2.py --out DIR [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from ffpa_jax import validation
from ffpa_jax.bench.measure import memory_mib, time_samples
from ffpa_jax.bench.peers import naive_chunked_attention
from ffpa_jax.chunked_path import chunked_attention

F32 = jnp.float32


def variant_forward(q, k, v, *, rows, precision, softmax, out_dtype):
    """Non-causal, unmasked chunked forward (MHA/GQA) under a scan over row blocks."""
    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    scale = d ** -0.5
    prec = jax.lax.Precision.HIGHEST if precision == "highest" else None

    def block(r0):
        qb = jax.lax.dynamic_slice_in_dim(q, r0, rows, axis=1).reshape(b, rows, hkv, g, d)
        logits = jnp.einsum("btkgd,bskd->bkgts", qb, k, preferred_element_type=F32,
                            precision=prec)
        if softmax == "none":
            p = logits.astype(v.dtype)
        else:
            logits = logits * scale
            m = jnp.max(logits, axis=-1, keepdims=True)
            if softmax == "guarded":
                m = jnp.where(m == -jnp.inf, 0.0, m)
                e = jnp.exp(logits - m)
                l = jnp.sum(e, axis=-1, keepdims=True)
                p = e / jnp.where(l > 0, l, 1.0)
            elif softmax == "plain":
                e = jnp.exp(logits - m)
                p = e / jnp.sum(e, axis=-1, keepdims=True)
            elif softmax == "lse":
                lse = m + jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1, keepdims=True))
                p = jnp.exp(logits - lse)
            elif softmax == "nn":
                p = jax.nn.softmax(logits, axis=-1)
            p = p.astype(v.dtype)
        o = jnp.einsum("bkgts,bskd->btkgd", p, v,
                       preferred_element_type=F32 if out_dtype == "f32" else None,
                       precision=prec)
        return o.reshape(b, rows, hq, -1)

    n = t // rows
    if n == 1:
        return block(0).astype(q.dtype)
    _, outs = jax.lax.scan(lambda c, r0: (c, block(r0)), None,
                           jnp.arange(n, dtype=jnp.int32) * rows)
    return jnp.moveaxis(outs, 0, 1).reshape(b, t, hq, -1).astype(q.dtype)


def product(causal, rows):
    def run(q, k, v):
        problem = validation.validate(q, k, v, None, None, scale=None, is_causal=causal,
                                      dropout_rate=0.0, dropout_rng=None, return_lse=False,
                                      implementation=None, interpret=False)
        blocks = None if rows is None else (rows, k.shape[1])
        return chunked_attention(q, k, v, None, None, problem, blocks=blocks)[0]
    return run


def dense(causal):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation="xla")


def measure(name, fn, args, mode, flops, ref=None, hlo_path=None):
    rec = {"impl": name, "mode": mode}
    try:
        if mode == "fwd":
            f = jax.jit(fn)
            call_args = args[:3]
        else:
            def fb(q, k, v, do):
                out, vjp = jax.vjp(fn, q, k, v)
                return (out, *vjp(do))
            f = jax.jit(fb)
            call_args = args
        t0 = time.perf_counter()
        compiled = f.lower(*call_args).compile()
        rec["compile_s"] = round(time.perf_counter() - t0, 2)
        rec["peak_mib"], rec["workspace_mib"] = memory_mib(compiled)
        if hlo_path:
            with open(hlo_path, "w") as fh:
                fh.write(compiled.as_text())
        outs = compiled(*call_args)
        first = outs if mode == "fwd" else outs[0]
        if ref is not None:
            a, r = first.astype(F32), ref.astype(F32)
            rec["diff_vs_dense"] = float(jnp.max(jnp.abs(a - r)) / jnp.max(jnp.abs(r)))
        del outs, first
        samples = time_samples(compiled, call_args, min_rep_s=0.1, reps=7, budget_s=4.0)
        rec["ms"] = statistics.median(samples)
        rec["spread"] = (max(samples) - min(samples)) / rec["ms"]
        rec["tflops"] = flops / (rec["ms"] * 1e-3) / 1e12
        rec["status"] = "ok"
    except Exception as exc:  # noqa: BLE001
        rec["status"] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return rec


def inputs(d, n, h, hkv, seed):
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(kq, (1, n, h, d), jnp.bfloat16),
            jax.random.normal(kk, (1, n, hkv, d), jnp.bfloat16),
            jax.random.normal(kv, (1, n, hkv, d), jnp.bfloat16),
            jax.random.normal(kd, (1, n, h, d), jnp.bfloat16))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tiny", action="store_true")
    opts = ap.parse_args()
    log = open(os.path.join(opts.out, "chunked_explore2.jsonl"), "w")
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)

    def emit(rec, **tags):
        rec.update(tags)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        ms = rec.get("ms")
        timing = "" if ms is None else f"{ms:8.3f} ms {rec['tflops']:6.1f} TF/s"
        status = "" if rec["status"] == "ok" else rec["status"]
        print(f"{json.dumps(tags):60s} {rec['mode']:6s} {rec['impl']:28s} {timing} "
              f"peak={rec.get('peak_mib') and round(rec['peak_mib'])} "
              f"c={rec.get('compile_s')} d={rec.get('diff_vs_dense')} {status}", flush=True)

    # A. forward variants, D = 512 and 1024, N = 4096, H = 32.
    dims = [(64, 256, 2)] if opts.tiny else [(512, 4096, 32), (1024, 4096, 32)]
    for d, n, h in dims:
        args = inputs(d, n, h, h, d)
        flops = 4.0 * h * n * n * d
        ref = jax.jit(dense(False))(*args[:3])
        tag = dict(d=d, n=n, h=h)
        emit(measure("xla-dense", dense(False), args, "fwd", flops,
                     hlo_path=os.path.join(opts.out, f"dense_fwd_d{d}.hlo.txt")
                     if d == dims[0][0] else None), **tag)
        rows_list = [n] if opts.tiny else [4096, 2048]
        for rows in rows_list:
            for prec in ("highest", "default"):
                for sm in ("guarded", "plain", "lse", "nn", "none"):
                    if prec == "highest" and sm in ("lse", "nn"):
                        continue
                    name = f"var-r{rows}-{prec}-{sm}"
                    hlo = (os.path.join(opts.out, f"var_fwd_d{d}_{prec}_{sm}.hlo.txt")
                           if rows == n and d == dims[0][0] and (prec, sm) in (
                               ("highest", "guarded"), ("default", "plain")) else None)
                    fn = lambda q, k, v, rows=rows, prec=prec, sm=sm: variant_forward(
                        q, k, v, rows=rows, precision=prec, softmax=sm, out_dtype="bf16")
                    emit(measure(name, fn, args, "fwd", flops, ref=ref, hlo_path=hlo), **tag)
        for rows in ([64] if opts.tiny else [1024, 512, 256, 128, 64]):
            fn = lambda q, k, v, rows=rows: variant_forward(
                q, k, v, rows=rows, precision="default", softmax="plain", out_dtype="bf16")
            emit(measure(f"var-r{rows}-default-plain", fn, args, "fwd", flops, ref=ref), **tag)
        del ref, args

    # B. the product tier (scan) forward and forward+backward.
    cases = ([(64, 256, 2, 2, False, [64, None]), (64, 256, 2, 1, True, [64])] if opts.tiny else
             [(512, 4096, 32, 32, False, [4096, 2048]), (1024, 4096, 32, 32, False, [4096, 2048]),
              (512, 4096, 32, 32, True, [2048, 1024, 512]), (512, 8192, 32, 8, False, [2048]),
              (512, 16384, 32, 32, False, [1024, 512]), (512, 32768, 8, 8, False, [1024, 512])])
    for d, n, h, hkv, causal, rows_list in cases:
        args = inputs(d, n, h, hkv, d + n)
        tag = dict(d=d, n=n, h=h, hkv=hkv, causal=causal)
        for mode in ("fwd", "fwdbwd"):
            flops = 4.0 * h * n * n * d / (2 if causal else 1) * (3.5 if mode == "fwdbwd" else 1)
            if n <= 8192:
                emit(measure("xla-dense", dense(causal), args, mode, flops), **tag)
            if n >= 16384 and not opts.tiny:
                emit(measure("naive-chunked", lambda q, k, v: naive_chunked_attention(
                    q, k, v, scale=d ** -0.5, causal=causal, chunk=512), args, mode, flops), **tag)
            for rows in rows_list:
                emit(measure(f"chunked-{rows or 'budget'}", product(causal, rows), args, mode,
                             flops), **tag)
        del args
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
