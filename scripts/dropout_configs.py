"""Launch configs for dropout: with a keep-mask to generate per score element the best
tiles differ from the no-dropout ones (register pressure; fewer output slices mean
fewer regenerations). Each candidate runs with dropout_rate=0.1 and is checked
against the same kernel under its default config (identical mask), then timed. The
forward is timed as training runs it (the vjp's forward writes a float32 output): at
D=512, BM=64 with 4 warps took 6.06 ms with a bf16 output and 9.60 with float32.
    python scripts/dropout_configs.py --out dropout_configs.json [--dims 128,512]
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp

from pallas_kernels import (BwdConfig, FwdConfig, bwd_generic_dkdv, bwd_generic_dq, bwd_preproc,
                            fwd_generic)
from sweep_common import base_parser, measure_candidate, save
from tuning import default_config


def F(bm, bn, bd, bdv, w, st, mode="resident"):
    return FwdConfig(block_m=bm, block_n=bn, block_d=bd, block_dv=bdv, num_warps=w,
                     num_stages=st, q_mode=mode)


def B(bm, bn, bd, sl, w, st, dyn=False, split=False):
    return BwdConfig(block_m=bm, block_n=bn, block_d=bd, block_slice=sl, num_warps=w,
                     num_stages=st, dynamic=dyn, split_dkdv=split)


CANDIDATES = {
    128: {"fwd": [F(128, 128, 128, 128, 8, 2), F(128, 64, 128, 128, 8, 3),
                  F(128, 64, 128, 128, 4, 3), F(64, 128, 128, 128, 4, 3),
                  F(128, 128, 64, 128, 8, 3), F(64, 64, 128, 128, 4, 3)],
          "dq": [B(128, 128, 128, 128, 8, 2), B(128, 64, 128, 128, 8, 3),
                 B(64, 128, 128, 128, 4, 3), B(64, 64, 128, 128, 4, 3)],
          "dkdv": [B(64, 64, 128, 128, 4, 2), B(128, 64, 128, 128, 8, 2),
                   B(64, 128, 128, 128, 8, 2), B(64, 64, 128, 128, 4, 3)]},
    512: {"fwd": [F(128, 64, 64, 256, 8, 3, "dynamic"), F(128, 64, 128, 256, 8, 3, "dynamic"),
                  F(128, 128, 64, 256, 8, 3, "dynamic"), F(128, 64, 64, 256, 8, 4, "dynamic"),
                  F(128, 128, 64, 256, 8, 4, "dynamic"), F(64, 128, 64, 256, 8, 3, "dynamic"),
                  F(64, 128, 64, 512, 8, 3, "dynamic"), F(64, 128, 64, 256, 4, 3, "dynamic")],
          "dq": [B(64, 128, 128, 512, 8, 3, True), B(64, 128, 64, 512, 8, 3, True),
                 B(64, 128, 64, 512, 8, 2, True), B(64, 128, 64, 512, 4, 3, True),
                 B(128, 128, 64, 512, 8, 2, True), B(64, 64, 64, 512, 8, 3, True)],
          "dkdv": [B(64, 64, 64, 512, 8, 3, True, True), B(64, 64, 64, 512, 8, 2, True, True),
                   B(64, 128, 64, 512, 8, 3, True, True), B(64, 64, 64, 512, 4, 3, True, True),
                   B(64, 64, 128, 512, 8, 3, True, True), B(128, 64, 64, 512, 8, 3, True, True),
                   B(64, 64, 64, 256, 8, 3, True, True), B(32, 64, 64, 512, 4, 3, True, True),
                   B(64, 32, 64, 512, 8, 3, True, True)]},
    1024: {"dq": [B(64, 128, 64, 512, 8, 3, True), B(64, 128, 128, 512, 8, 3, True)]},
}


def main() -> int:
    parser = base_parser(budget_s=300.0)
    parser.set_defaults(dims="128,512")
    args = parser.parse_args()
    started = time.time()
    results = []
    rate = 0.1
    for d in [int(x) for x in args.dims.split(",")]:
        b, h, n = (4 if d <= 128 else 1), args.heads, args.seqlen
        ks = jax.random.split(jax.random.key(d), 4)
        q, k, v, do = (jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in ks)
        seed = jax.random.bits(jax.random.key(1), (2,), jnp.uint32)
        scale = 1.0 / math.sqrt(d)
        common = {"scale": scale, "causal": False, "interpret": args.interpret,
                  "dropout_rate": rate, "seed": seed}
        fwd0 = FwdConfig.from_tuned(default_config("fwd_generic", headdim=d, has_dropout=True))
        o, lse = jax.jit(lambda q, k, v: fwd_generic(q, k, v, config=fwd0, out_dtype=jnp.float32,
                                                     **common))(q, k, v)
        delta = jax.jit(lambda o, do: bwd_preproc(o.astype(q.dtype), do, jnp.zeros(lse.shape, jnp.float32),
                                                  config=BwdConfig(),
                                                  interpret=args.interpret))(o, do)
        dq0 = BwdConfig.from_tuned(default_config("bwd_generic_dq", headdim=d, has_dropout=True))
        dkdv0 = BwdConfig.from_tuned(default_config("bwd_generic_dkdv", headdim=d, has_dropout=True))
        refs = {"fwd": [o],
                "dq": [jax.jit(lambda *a: bwd_generic_dq(*a, config=dq0, **common))(
                    q, k, v, do, lse, delta)],
                "dkdv": list(jax.jit(lambda *a: bwd_generic_dkdv(*a, config=dkdv0, **common))(
                    q, k, v, do, lse, delta))}
        unit = 2.0 * b * h * n * n * d
        for kernel, cands in CANDIDATES[d].items():
            for cfg in cands:
                if time.time() - started > args.budget_s:
                    break
                rec = {"d": d, "b": b, "h": h, "n": n, "kernel": kernel, "dropout": rate,
                       **cfg.__dict__}
                if kernel == "fwd":
                    fn = lambda q, k, v, cfg=cfg: (fwd_generic(q, k, v, config=cfg, **common,
                                                               out_dtype=jnp.float32)[0],)
                    argv, flops = (q, k, v), 2 * unit
                elif kernel == "dq":
                    fn = lambda *a, cfg=cfg: (bwd_generic_dq(*a, config=cfg, **common),)
                    argv, flops = (q, k, v, do, lse, delta), 3 * unit
                else:
                    fn = lambda *a, cfg=cfg: bwd_generic_dkdv(*a, config=cfg, **common)
                    argv, flops = (q, k, v, do, lse, delta), 4 * unit

                def error_of(outs, ref=refs[kernel]):
                    return max(float(jnp.max(jnp.abs(g.astype(jnp.float32)
                                                     - r.astype(jnp.float32)))
                                     / jnp.max(jnp.abs(r.astype(jnp.float32))))
                               for g, r in zip(outs, ref))
                save(results, measure_candidate(rec, fn, argv, error_of=error_of,
                                                tolerance=2e-2, flops=flops,
                                                reps=1 if args.interpret else 5), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
