"""Accuracy and speed of split QKᵀ accumulation chains (GPU A/B, prints JSON lines).

`pallas_kernels.common.CHAIN_DEPTH` caps how deep one tensor-core accumulation
chain of a head-dim contraction may be. This script traces the kernels twice,
with the cap (the shipped kernels) and without it (one chain, the old kernels),
and reports for each:
- the max |lse - lse_float64| on the large-logit problems of scripts/lse_precision.py,
  next to the XLA path's error at the same precision (the tolerance rule allows 2x);
- the median time of the forward and of forward+backward at B=1, H=32, S=4096.

    python scripts/chain_ab.py --out chain_ab.json
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

import ffpa_jax
from ffpa_jax import pallas_path
from ffpa_jax.bench import _time_ms
from ffpa_jax.reference import mha_reference
from pallas_kernels import common

ACCURACY_PROBLEMS = (  # (b, t, s, hq, hkv, d, scale, magnitude)
    (2, 6, 239, 8, 4, 768, 1.917, 2.0),
    (1, 17, 40, 2, 1, 1000, None, 1.0),
    (1, 64, 256, 4, 4, 512, None, 2.0),
    (1, 33, 300, 2, 2, 1024, 0.5, 1.5),
)
UNCAPPED = 1 << 20
INTERPRET = False  # --interpret: a CPU smoke run through Pallas' interpreter


def use_chain_depth(depth: int) -> None:
    """Trace the kernels anew with this cap (the kernel wrappers cache their ops)."""
    common.CHAIN_DEPTH = depth
    pallas_path._forward._cache.cache_clear()
    pallas_path._backward._cache.cache_clear()
    jax.clear_caches()


def lse_errors(depth: int, seeds: int) -> list[dict]:
    use_chain_depth(depth)
    rows = []
    for b, t, s, hq, hkv, d, scale, mag in ACCURACY_PROBLEMS:
        scale = scale or 1.0 / math.sqrt(d)
        kernel_errs, xla_errs = [], []
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            q = jnp.asarray(mag * rng.standard_normal((b, t, hq, d)), jnp.bfloat16)
            k = jnp.asarray(mag * rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
            v = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
            with jax.enable_x64(True):
                to64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
                ref = np.asarray(mha_reference(to64(q), to64(k), to64(v), None, None,
                                               scale=scale)[1])
            fn = jax.jit(lambda q, k, v: ffpa_jax.attention(
                q, k, v, scale=scale, return_lse=True, implementation="pallas", interpret=INTERPRET)[1])
            got = np.asarray(fn(q, k, v), np.float64)
            xla = np.asarray(mha_reference(q, k, v, None, None, scale=scale)[1], np.float64)
            kernel_errs.append(float(np.max(np.abs(got - ref))))
            xla_errs.append(float(np.max(np.abs(xla - ref))))
        rows.append(dict(d=d, s=s, scale=scale, kernel=kernel_errs, xla=xla_errs,
                         worst_ratio=max(g / x for g, x in zip(kernel_errs, xla_errs))))
    return rows


def timings(depth: int, dims, seqlen: int, heads: int, causal: bool) -> list[dict]:
    use_chain_depth(depth)
    rows = []
    for d in dims:
        keys = jax.random.split(jax.random.key(d), 4)
        q, k, v, do = (jax.random.normal(kk, (1, seqlen, heads, d), jnp.bfloat16)
                       for kk in keys)
        attn = lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=causal,
                                                  implementation="pallas", interpret=INTERPRET)
        fwd = jax.jit(attn)

        def fwd_bwd(q, k, v, do):
            out, vjp = jax.vjp(attn, q, k, v)
            return vjp(do)
        both = jax.jit(fwd_bwd)
        rows.append(dict(d=d, s=seqlen, causal=causal,
                         fwd_ms=_time_ms(fwd, (q, k, v), min_rep_s=0.1, reps=7),
                         fwd_bwd_ms=_time_ms(both, (q, k, v, do), min_rep_s=0.1, reps=7)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="512,768,1024")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seeds", type=int, default=4)
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    global INTERPRET
    INTERPRET = args.interpret
    dims = [int(d) for d in args.dims.split(",")]
    shipped = common.CHAIN_DEPTH
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    for label, depth in (("chains", shipped), ("one_chain", UNCAPPED)):
        result[label] = dict(depth=depth, lse=lse_errors(depth, args.seeds),
                             time=timings(depth, dims, args.seqlen, args.heads, False)
                             + timings(depth, dims, args.seqlen, args.heads, True))
        print(json.dumps({label: result[label]}), flush=True)
    use_chain_depth(shipped)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
