"""Measure bwd_generic_dq / bwd_generic_dkdv launch variants on the GPU.

For each head dim: one forward (default config) gives o and lse; each candidate
config of dq and of dkdv is compiled, checked against XLA's gradients (dense
path, same inputs) and timed on its own. Results: docs/bwd_variants.md.
Usage: python scripts/bwd_variants.py --out results.json [--dims 128,512]
"""

from __future__ import annotations

import math
import sys
import time

import jax
import jax.numpy as jnp

from pallas_kernels import (BwdConfig, FwdConfig, bwd_generic_dkdv, bwd_generic_dq, bwd_preproc,
                            fwd_generic)
from sweep_common import base_parser, measure_candidate, save
from tuning import default_config


def C(bm, bn, bd, sl, w, st, dyn=False, split=False):
    return BwdConfig(block_m=bm, block_n=bn, block_d=bd, block_slice=sl, num_warps=w,
                     num_stages=st, dynamic=dyn, split_dkdv=split)


def _small(d):
    return {
        "dq": [C(128, 64, d, d, 8, 2), C(64, 64, d, d, 4, 2), C(128, 64, d, d, 8, 3),
               C(64, 128, d, d, 8, 2), C(128, 32, d, d, 4, 3), C(128, 128, d, d, 8, 2),
               C(64, 64, d, d, 4, 3)],
        "dkdv": [C(64, 128, d, d, 8, 2), C(64, 64, d, d, 4, 2), C(32, 128, d, d, 4, 3),
                 C(64, 128, d, d, 8, 3), C(128, 128, d, d, 8, 2), C(64, 64, d, d, 4, 3),
                 C(32, 64, d, d, 4, 2), C(128, 64, d, d, 8, 2)],
    }


def _large(d):
    return {
        "dq": [C(64, 64, 64, 256, 8, 3, True), C(64, 64, 128, 256, 8, 3, True),
               C(128, 64, 64, 256, 8, 3, True), C(64, 64, 64, 512, 8, 3, True),
               C(128, 128, 64, 256, 8, 3, True), C(64, 128, 64, 256, 8, 3, True),
               C(128, 64, 64, 128, 8, 3, True), C(64, 64, 64, 256, 4, 3, True)],
        "dkdv": [C(64, 64, 64, 256, 8, 3, True, True), C(64, 64, 128, 256, 8, 3, True, True),
                 C(64, 128, 64, 256, 8, 3, True, True), C(64, 64, 64, 512, 8, 3, True, True),
                 C(128, 128, 64, 256, 8, 3, True, True), C(64, 64, 64, 128, 8, 3, True, False),
                 C(64, 128, 64, 128, 8, 3, True, False), C(128, 64, 64, 256, 8, 3, True, True)],
    }


CANDIDATES = {
    64: _small(64),
    128: _small(128),
    256: {
        "dq": [C(64, 64, 64, 256, 8, 2), C(64, 64, 256, 256, 8, 2), C(128, 64, 64, 256, 8, 2),
               C(64, 64, 64, 256, 8, 3, True), C(128, 64, 64, 128, 8, 2),
               C(128, 64, 128, 256, 8, 2), C(64, 128, 64, 256, 8, 3, True)],
        "dkdv": [C(64, 64, 64, 256, 8, 2, split=True), C(64, 64, 64, 128, 8, 2),
                 C(64, 64, 64, 256, 8, 2), C(64, 64, 64, 256, 8, 3, True, True),
                 C(64, 128, 64, 256, 8, 3, True, True), C(64, 128, 64, 128, 8, 2),
                 C(128, 64, 64, 256, 8, 2, split=True)],
    },
    512: _large(512),
    1024: _large(1024),
}


def _round2(d):
    """Round 2 for D >= 256: around round 1's winners (512-wide slices, dynamic chunks)."""
    sl = min(d, 512)
    return {
        "dq": [C(64, 64, 64, sl, 8, 4, True), C(64, 64, 128, sl, 8, 3, True),
               C(64, 32, 64, sl, 8, 3, True), C(64, 64, 64, sl, 4, 3, True),
               C(64, 128, 64, sl, 8, 3, True), C(32, 64, 64, sl, 4, 3, True)],
        "dkdv": [C(64, 64, 64, sl, 8, 4, True, True), C(64, 64, 128, sl, 8, 3, True, True),
                 C(32, 64, 64, sl, 4, 3, True, True), C(128, 64, 64, sl, 8, 3, True, True),
                 C(64, 32, 64, sl, 8, 3, True, True), C(32, 64, 64, sl, 8, 4, True, True)],
    }


# Round 3 (2026-11-22), D=256 dK/dV: dK and dV in one program (dynamic chunks), which
# recomputes S and dP once per tile instead of in both programs (4 matmuls per step
# against 5); offline it spills 0-32 bytes at BLOCK_N = 64, against the split default's
# 248. The shipped default comes first, for reference.
ROUND3 = {256: {"dkdv": [C(64, 128, 64, 256, 8, 3, True, True), C(64, 64, 64, 256, 8, 3, True),
                         C(64, 64, 64, 256, 8, 2, True), C(32, 64, 64, 256, 8, 3, True),
                         C(64, 64, 128, 256, 8, 2, True), C(32, 64, 64, 256, 8, 4, True)]}}

ROUNDS = {1: CANDIDATES, 2: {256: _round2(256), 512: _round2(512), 1024: _round2(1024)},
          3: ROUND3}


def main() -> int:
    parser = base_parser(budget_s=300.0)
    parser.add_argument("--round", type=int, default=1, choices=sorted(ROUNDS))
    args = parser.parse_args()
    started = time.time()
    results = []
    for d in [int(x) for x in args.dims.split(",")]:
        b, h, n = (4 if d <= 128 else 1), args.heads, args.seqlen
        ks = jax.random.split(jax.random.key(d), 4)
        q, k, v, do = (jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in ks)
        scale = 1.0 / math.sqrt(d)
        fwd_cfg = FwdConfig.from_tuned(default_config("fwd_generic", headdim=d))
        o, lse = jax.jit(lambda q, k, v: fwd_generic(q, k, v, scale=scale, causal=False,
                                                      config=fwd_cfg, interpret=args.interpret))(q, k, v)
        delta = jax.jit(lambda o, do, dlse: bwd_preproc(o, do, dlse, config=BwdConfig(),
                                                        interpret=args.interpret))(
            o, do, jnp.zeros(lse.shape, jnp.float32))
        @jax.jit
        def xla_grads(q, k, v, do):  # arrays are arguments: nothing captured as a constant
            _, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, implementation="xla"), q, k, v)
            return [g.astype(jnp.float32) for g in vjp(do)]
        ref = xla_grads(q, k, v, do)
        unit = 2.0 * b * h * n * n * d  # one [T, S, D] matmul
        for kernel, cands in ROUNDS[args.round][d].items():
            for cfg in cands:
                if time.time() - started > args.budget_s:
                    print("budget exhausted", flush=True)
                    break
                rec = {"d": d, "b": b, "h": h, "n": n, "kernel": kernel, **cfg.__dict__}
                kw = dict(scale=scale, causal=False, config=cfg, interpret=args.interpret)
                if kernel == "dq":
                    fn = lambda *a, kw=kw: (bwd_generic_dq(*a, **kw),)
                    refs, flops = ref[:1], 3 * unit
                else:
                    fn = lambda *a, kw=kw: bwd_generic_dkdv(*a, **kw)
                    refs, flops = ref[1:], 4 * unit

                def error_of(outs, refs=refs):
                    return max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / jnp.max(jnp.abs(r)))
                               for g, r in zip(outs, refs))
                save(results, measure_candidate(rec, fn, (q, k, v, do, lse, delta),
                                                error_of=error_of, tolerance=3e-2, flops=flops,
                                                reps=1 if args.interpret else 5), args.out)
    print("\nbest per head dim and kernel (TF/s counts the kernel's own matmuls):")
    for d in sorted({r["d"] for r in results}):
        for kernel in ("dq", "dkdv"):
            ok = [r for r in results if r["d"] == d and r["kernel"] == kernel and r["status"] == "ok"]
            for r in sorted(ok, key=lambda r: r["ms"])[:2]:
                print(f"D={d:5d} {kernel:5s} {r['ms']:8.2f} ms {r['tflops']:6.1f} TF/s BM={r['block_m']} "
                      f"BN={r['block_n']} BD={r['block_d']} slice={r['block_slice']} w={r['num_warps']} "
                      f"st={r['num_stages']} dyn={r['dynamic']} split={r['split_dkdv']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
