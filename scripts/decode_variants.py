"""Decode launch variants on the GPU: stage 1 configs and split counts at the decode
issue's shapes (B=8, Hq=32, Hkv=8, T=1), timed over both stages; GB/s counts one
read of K and V. python scripts/decode_variants.py --out decode.json [--dims 128,512]
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from pallas_kernels import DecodeConfig, decode_attention, decode_num_splits
from sweep_common import base_parser, measure_candidate, save
from tuning import multiprocessor_count


def C(bn, bd, bdv, w, st, dyn=False, splits=0):
    return DecodeConfig(block_m=16, block_n=bn, block_d=bd, block_dv=bdv, num_warps=w,
                        num_stages=st, dynamic=dyn, num_splits=splits)


CANDIDATES = {
    128: [C(64, 128, 128, 4, 3), C(128, 128, 128, 4, 3), C(64, 128, 128, 4, 4),
          C(128, 128, 128, 8, 3), C(64, 128, 128, 4, 3, splits=8), C(64, 128, 128, 4, 3,
                                                                       splits=32)],
    512: [C(32, 64, 512, 4, 3, True), C(64, 64, 512, 8, 3, True), C(64, 128, 512, 8, 2, True),
          C(32, 64, 512, 8, 3, True), C(64, 64, 256, 4, 3, True), C(32, 512, 512, 8, 2),
          C(32, 64, 512, 4, 3, True, splits=16), C(64, 64, 512, 8, 3, True, splits=32)],
}


def main() -> int:
    parser = base_parser(budget_s=200.0)
    parser.set_defaults(dims="128,512", seqlen=32768)
    args = parser.parse_args()
    started = time.time()
    results = []
    b, hq, hkv = 8, 32, 8
    for d in [int(x) for x in args.dims.split(",")]:
        s = args.seqlen
        ks = jax.random.split(jax.random.key(d), 3)
        q = jax.random.normal(ks[0], (b, 1, hq, d), jnp.bfloat16)
        k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.bfloat16)
        v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.bfloat16)
        ref = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v))(q, k, v)
        for cfg in CANDIDATES[d]:
            if time.time() - started > args.budget_s:
                break
            splits = cfg.num_splits or decode_num_splits(
                batch=b, heads_kv=hkv, packed_rows=hq // hkv, seq_k=s, head_dim_v=d,
                config=cfg, multiprocessors=multiprocessor_count())
            fn = lambda q, k, v, cfg=cfg, splits=splits: decode_attention(
                q, k, v, scale=d ** -0.5, causal=False, config=cfg, num_splits=splits,
                interpret=args.interpret)[0]
            rec = {"d": d, "b": b, "hq": hq, "hkv": hkv, "s": s, "splits": splits,
                   **cfg.__dict__}
            err = lambda out: float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                                    - ref.astype(jnp.float32))))
            measure_candidate(rec, fn, (q, k, v), error_of=err, tolerance=2e-2,
                              flops=4.0 * b * hq * s * d)
            if "ms" in rec:
                rec["gbps"] = 2 * b * s * hkv * d * 2 / (rec["ms"] * 1e-3) / 1e9
            save(results, rec, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
