"""The price of differentiating through lse (GPU): forward+backward of sum(out·dO)
against sum(out·dO) + sum(lse·dlse), bf16, non-causal, the issue 7 shapes, timed in one
process. With an lse cotangent the 16-bit backward feeds dS to dQ's and dK's matmuls as
two bf16 words (`pallas_kernels.common.accumulate_ds`); without one nothing changes.

    python scripts/lse_grad_cost.py --out lse.json [--dims 64,128]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import ffpa_jax
from tuning.timing import median_ms

SHAPES = {64: (4, 32, 4096), 128: (4, 32, 4096), 256: (1, 32, 4096), 512: (1, 32, 4096),
          1024: (1, 32, 4096)}


def lse_row(d: int) -> dict:
    b, h, n = SHAPES[d]
    ks = jax.random.split(jax.random.key(d), 5)
    q, k, v, do = (jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in ks[:4])
    dlse = jax.random.normal(ks[4], (b, h, n), jnp.float32)

    def grads(q, k, v, do, dlse, with_lse: bool):
        def loss(q, k, v):
            out, lse = ffpa_jax.attention(q, k, v, return_lse=True)
            total = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
            return total + (jnp.sum(lse * dlse) if with_lse else 0.0)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    args = (q, k, v, do, dlse)
    plain = jax.jit(lambda *a: grads(*a, with_lse=False)).lower(*args).compile()
    split = jax.jit(lambda *a: grads(*a, with_lse=True)).lower(*args).compile()
    row = {"d": d, "shape": SHAPES[d], "causal": False}
    for _ in range(2):  # interleaved, so drift in clocks hits both alike
        row.setdefault("out_only_ms", []).append(median_ms(plain, args, min_rep_s=0.05, reps=5))
        row.setdefault("with_lse_ms", []).append(median_ms(split, args, min_rep_s=0.05, reps=5))
    row["ratio"] = min(row["with_lse_ms"]) / min(row["out_only_ms"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="64,128")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        rows.append(lse_row(d))
        print(json.dumps(rows[-1]), flush=True)
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
