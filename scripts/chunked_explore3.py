"""One-off, round 3: the chunked tier with its Pallas row step (pallas_kernels.blocked)
against the XLA-fusion step, scan against unrolled blocks, and the peers (bf16, H200).

    PYTHONPATH=. python3 scripts/chunked_explore3.py --out DIR [--tiny]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp

import ffpa_jax
from ffpa_jax import chunked_path, validation
from ffpa_jax.bench.peers import naive_chunked_attention
from ffpa_jax.chunked_path import chunked_attention

sys.path.insert(0, os.path.dirname(__file__))
from chunked_explore2 import dense, inputs, measure  # noqa: E402

_scan_over = chunked_path._over


def _unrolled_over(starts, body, carry):
    outs = []
    for start in starts:
        carry, out = body(carry, start)
        outs.append(out)
    return carry, jax.tree.map(lambda *x: jnp.stack(x), *outs)


def tier(causal, rows, step, loop="scan", rate=0.0):
    def run(q, k, v):
        chunked_path._over = _scan_over if loop == "scan" else _unrolled_over
        problem = validation.validate(q, k, v, None, None, scale=None, is_causal=causal,
                                      dropout_rate=rate,
                                      dropout_rng=jax.random.key(1) if rate else None,
                                      return_lse=False, implementation=None, interpret=False)
        seed = ffpa_jax.dropout.seed_from_key(jax.random.key(1)) if rate else None
        if isinstance(rows, str):
            blocks = tuple(int(x) for x in rows.split("x"))
        else:
            blocks = None if rows is None else (rows, k.shape[1])
        out = chunked_attention(q, k, v, None, None, problem, blocks=blocks, step=step,
                                seed=seed)[0]
        chunked_path._over = _scan_over
        return out
    return run


def ours_pallas(causal, rate=0.0):
    return lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=causal, dropout_rate=rate,
                                              dropout_rng=jax.random.key(1) if rate else None,
                                              implementation="pallas")


def xla_path(causal, rate):
    return lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=causal, dropout_rate=rate,
                                              dropout_rng=jax.random.key(1) if rate else None,
                                              implementation="xla")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tiny", action="store_true")
    opts = ap.parse_args()
    log = open(os.path.join(opts.out, "chunked_explore3.jsonl"), "w")
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)

    def emit(rec, **tags):
        rec.update(tags)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        ms = rec.get("ms")
        timing = "" if ms is None else f"{ms:8.3f} ms {rec['tflops']:6.1f} TF/s"
        status = "" if rec["status"] == "ok" else rec["status"]
        print(f"{json.dumps(tags):58s} {rec['mode']:6s} {rec['impl']:26s} {timing} "
              f"peak={rec.get('peak_mib') and round(rec['peak_mib'])} "
              f"c={rec.get('compile_s')} d={rec.get('diff_vs_dense')} {status}", flush=True)

    # (D, N, H, Hkv, causal, dropout, [(rows, step, loop)], extra peers)
    big = [
        (512, 4096, 32, 32, False, 0.0, [(4096, "pallas", "scan"), (2048, "pallas", "scan"),
                                         (1024, "pallas", "scan"), (2048, "xla", "scan")],
         ("dense", "naive")),
        (1024, 4096, 32, 32, False, 0.0, [(4096, "pallas", "scan"), (2048, "pallas", "scan")],
         ("dense", "naive")),
        (512, 4096, 32, 32, True, 0.0, [(1024, "pallas", "scan"), (2048, "pallas", "scan")],
         ("dense",)),
        (512, 8192, 32, 8, False, 0.0, [(2048, "pallas", "scan"), (1024, "pallas", "scan")],
         ("dense",)),
        (512, 4096, 32, 32, False, 0.1, [(2048, "pallas", "scan")], ()),
        (256, 4096, 32, 32, False, 0.0, [(4096, "pallas", "scan"), (2048, "pallas", "scan")],
         ("pallas",)),
        (512, 16384, 32, 32, False, 0.0, [(1024, "pallas", "scan"), ("1024x8192", "pallas", "scan"),
                                          (None, "pallas", "scan")], ()),
        (512, 32768, 8, 8, False, 0.0, [(None, "pallas", "scan")], ()),
    ]
    tiny = [(64, 256, 2, 2, False, 0.0, [(128, "pallas", "scan"), (128, "xla", "unroll")],
             ("dense", "naive")),
            (64, 256, 2, 1, True, 0.1, [(64, "pallas", "scan")], ("xla",))]
    for d, n, h, hkv, causal, rate, variants, peers in (tiny if opts.tiny else big):
        args = inputs(d, n, h, hkv, d + n)
        tag = dict(d=d, n=n, h=h, hkv=hkv, causal=causal, rate=rate)
        ref = None
        for mode in ("fwd", "fwdbwd"):
            flops = 4.0 * h * n * n * d / (2 if causal else 1) * (3.5 if mode == "fwdbwd" else 1)
            impls = []
            if "dense" in peers:
                impls.append(("xla-dense", dense(causal)))
            if "xla" in peers:
                impls.append(("ffpa-xla", xla_path(causal, rate)))
            if "naive" in peers:
                impls.append(("naive-chunked", lambda q, k, v: naive_chunked_attention(
                    q, k, v, scale=d ** -0.5, causal=causal)))
            if "naive512" in peers:
                impls.append(("naive-chunked-512", lambda q, k, v: naive_chunked_attention(
                    q, k, v, scale=d ** -0.5, causal=causal, chunk=512)))
            if "pallas" in peers:
                impls.append(("ffpa-pallas", ours_pallas(causal, rate)))
            for rows, step, loop in variants:
                impls.append((f"chunked-{rows or 'budget'}-{step}-{loop}",
                              tier(causal, rows, step, loop, rate)))
            for name, fn in impls:
                if mode == "fwd" and ref is None and n <= 8192:
                    ref = jax.jit(fn)(*args[:3])
                    rec = measure(name, fn, args, mode, flops)
                else:
                    rec = measure(name, fn, args, mode, flops,
                                  ref=ref if mode == "fwd" else None)
                emit(rec, **tag)
        del args, ref
    log.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
