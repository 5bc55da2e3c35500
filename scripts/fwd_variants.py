"""Measure fwd_generic launch variants on the GPU (docs/fwd_variants.md records the results).

Each candidate is compiled, checked against XLA's dense attention on the same
inputs (a candidate that disagrees is marked, never counted), then timed. A
candidate that fails to compile (e.g. shared memory overflow) is recorded with
its error. Usage: python scripts/fwd_variants.py --out results.json [--dims 512,1024]
"""

from __future__ import annotations

import math
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels import FwdConfig, fwd_generic
from sweep_common import base_parser, measure_candidate, save


def C(bm, bn, bd, bdv, w, st, mode="resident", pv=False):
    return FwdConfig(block_m=bm, block_n=bn, block_d=bd, block_dv=bdv, num_warps=w,
                     num_stages=st, q_mode=mode, prefetch_v=pv)


def _round3(d: int) -> list[FwdConfig]:
    """Round 3 for D >= 512: around round 2's winner (BM=128, BN=128, BD=64, BDv=256, dyn)."""
    return [C(128, 128, 64, 256, 8, 3, "dynamic"), C(128, 128, 64, 256, 8, 4, "dynamic"),
            C(128, 128, 32, 256, 8, 4, "dynamic"), C(128, 128, 128, 256, 8, 3, "dynamic"),
            C(128, 128, 64, 256, 8, 3, "dynamic", True), C(128, 128, 64, 128, 8, 3, "dynamic"),
            C(128, 128, 64, 128, 4, 3, "dynamic"), C(64, 128, 64, 512, 8, 3, "dynamic"),
            C(128, 256, 64, 128, 8, 3, "dynamic"), C(128, 64, 64, 256, 8, 4, "dynamic"),
            C(256, 64, 64, 128, 8, 3, "dynamic"), C(128, 128, 64, 256, 8, 2, "dynamic")]


CANDIDATES = {
    64: [C(128, 64, 64, 64, 8, 3), C(128, 128, 64, 64, 8, 3), C(128, 128, 64, 64, 4, 4),
         C(64, 128, 64, 64, 4, 3)],
    128: [C(128, 128, 128, 128, 8, 3), C(128, 128, 128, 128, 8, 4), C(128, 128, 64, 128, 8, 4),
          C(128, 128, 128, 128, 8, 3, pv=True), C(128, 256, 128, 128, 8, 3)],
    256: [C(128, 64, 256, 256, 8, 2), C(128, 128, 64, 256, 8, 3, "dynamic"),
          C(128, 128, 128, 256, 8, 3, "dynamic"), C(128, 128, 256, 256, 8, 2),
          C(128, 64, 256, 256, 8, 3), C(128, 128, 64, 128, 8, 3, "dynamic")],
    512: _round3(512),
    1024: _round3(1024),
}


def main() -> int:
    parser = base_parser(budget_s=400.0)
    args = parser.parse_args()
    started = time.time()
    results = []
    for d in [int(x) for x in args.dims.split(",")]:
        b, h, n = (4 if d <= 128 else 1), args.heads, args.seqlen
        kq, kk, kv = jax.random.split(jax.random.key(d), 3)
        q = jax.random.normal(kq, (b, n, h, d), jnp.bfloat16)
        k = jax.random.normal(kk, (b, n, h, d), jnp.bfloat16)
        v = jax.random.normal(kv, (b, n, h, d), jnp.bfloat16)
        scale = 1.0 / math.sqrt(d)
        ref = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="xla"))(q, k, v).astype(jnp.float32)
        ref_max = float(jnp.max(jnp.abs(ref)))
        flops = 4.0 * b * h * n * n * d
        for cfg in CANDIDATES[d]:
            if time.time() - started > args.budget_s:
                print("budget exhausted", flush=True)
                break
            rec = {"d": d, "b": b, "h": h, "n": n, **cfg.__dict__}
            fn = lambda q, k, v, cfg=cfg: fwd_generic(q, k, v, scale=scale, causal=False,
                                                      config=cfg, interpret=args.interpret)[0]
            error_of = lambda out: float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref))) / ref_max
            save(results, measure_candidate(rec, fn, (q, k, v), error_of=error_of,
                                            tolerance=2e-2, flops=flops,
                                            reps=1 if args.interpret else 5), args.out)
    print("\nbest per head dim:")
    for d in sorted({r["d"] for r in results}):
        ok = [r for r in results if r["d"] == d and r["status"] == "ok"]
        for r in sorted(ok, key=lambda r: -r["tflops"])[:3]:
            print(f"D={d:5d} {r['tflops']:7.1f} TF/s  BM={r['block_m']} BN={r['block_n']} "
                  f"BD={r['block_d']} BDv={r['block_dv']} w={r['num_warps']} st={r['num_stages']} "
                  f"{r['q_mode']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
