"""Dropout's cost: forward and forward+backward time with dropout_rate = 0.1 against
the same call without dropout, through the public API, at the dropout issue's shapes
(D=128: B4 H32 N4096; D=512: B1 H32 N4096), bf16. GPU only.

    python scripts/dropout_overhead.py --out dropout.json [--dims 128,512]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import ffpa_jax
from ffpa_jax.bench import _time_ms

SHAPES = {64: (4, 32, 4096), 128: (4, 32, 4096), 256: (1, 32, 4096), 512: (1, 32, 4096),
          1024: (1, 32, 4096)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="128,512")
    parser.add_argument("--rate", type=float, default=0.1)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results = []
    for d in (int(x) for x in args.dims.split(",")):
        b, h, n = SHAPES[d]
        ks = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in ks)
        key = jax.random.key(1)
        row = {"d": d, "b": b, "h": h, "n": n, "rate": args.rate, "causal": args.causal}
        for rate in (0.0, args.rate):
            attn = lambda q, k, v, key, rate=rate: ffpa_jax.attention(
                q, k, v, is_causal=args.causal, dropout_rate=rate,
                dropout_rng=key if rate else None)
            fwd = jax.jit(attn)

            def fwdbwd(q, k, v, key, do, attn=attn):
                out, vjp = jax.vjp(lambda q, k, v: attn(q, k, v, key), q, k, v)
                return vjp(do)
            fwdbwd = jax.jit(fwdbwd)
            tag = "drop" if rate else "plain"
            row[f"fwd_{tag}_ms"] = _time_ms(fwd, (q, k, v, key), min_rep_s=0.05, reps=7)
            row[f"fwdbwd_{tag}_ms"] = _time_ms(fwdbwd, (q, k, v, key, do), min_rep_s=0.05, reps=7)
        row["fwd_ratio"] = row["fwd_drop_ms"] / row["fwd_plain_ms"]
        row["fwdbwd_ratio"] = row["fwdbwd_drop_ms"] / row["fwdbwd_plain_ms"]
        print(json.dumps(row), flush=True)
        results.append(row)
    with open(args.out, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
