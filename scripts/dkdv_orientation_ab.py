"""End-to-end A/B of the dK/dV tile's orientation (`pallas_kernels.bwd.dkdv_transposed`).

Times forward+backward through `ffpa_jax.attention` (out-only loss) with the shipped
rule, and with the rule forced to the old [BLOCK_M, BLOCK_N] tile, in one process,
alternating the two in rounds so that clock drift hits both alike. The two compiled
functions differ only in the dK/dV kernel. Writes JSON records and prints the ratios.

    python scripts/dkdv_orientation_ab.py --out ab.json [--dims 64,128,256] [--causal]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import jax
import jax.numpy as jnp

import ffpa_jax
from ffpa_jax.bench.measure import time_samples
from pallas_kernels import bwd


def fwd_bwd(causal: bool):
    def loss(q, k, v):
        return ffpa_jax.attention(q, k, v, is_causal=causal).astype(jnp.float32).sum()
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def build(rule, causal, args):
    """A compiled fwd+bwd traced while `bwd.dkdv_transposed` is `rule`."""
    shipped = bwd.dkdv_transposed
    bwd.dkdv_transposed = rule
    try:
        return fwd_bwd(causal).lower(*args).compile()
    finally:
        bwd.dkdv_transposed = shipped


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    records = []
    for d in [int(x) for x in args.dims.split(",")]:
        b, h, n = (4 if d <= 128 else 1), 32, args.seqlen
        keys = jax.random.split(jax.random.key(d), 3)
        qkv = [jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in keys]
        variants = {"transposed (rule)": build(bwd.dkdv_transposed, args.causal, qkv),
                    "untransposed": build(lambda cfg, dtype: False, args.causal, qkv)}
        ref = [g.astype(jnp.float32) for g in variants["untransposed"](*qkv)]
        new = [g.astype(jnp.float32) for g in variants["transposed (rule)"](*qkv)]
        diff = max(float(jnp.max(jnp.abs(a - r)) / jnp.max(jnp.abs(r)))
                   for a, r in zip(new, ref, strict=True))
        times = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                times[name] += time_samples(fn, qkv, min_rep_s=0.05, reps=3)
        rec = {"d": d, "b": b, "h": h, "n": n, "causal": args.causal,
               "max_rel_diff_between_variants": diff,
               # the two must be different programs (no cache handed one the other's kernel)
               "same_executable": (variants["untransposed"].as_text()
                                   == variants["transposed (rule)"].as_text()),
               **{f"{name} ms": statistics.median(t) for name, t in times.items()}}
        rec["ratio"] = rec["transposed (rule) ms"] / rec["untransposed ms"]
        records.append(rec)
        print(json.dumps(rec), flush=True)
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
