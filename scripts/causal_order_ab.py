"""Causal forward and dQ programs taking their query blocks longest-first
(`pallas_kernels.common.heavy_first`) against the launch order, timed in one process by
compiling each call once with `heavy_first` replaced by the identity (GPU). Causal, bf16,
the issue 7 shapes. (The run of this experiment also timed the lse cotangent's price,
now scripts/lse_grad_cost.py.)

    python scripts/causal_order_ab.py --out ab.json [--dims 64,128] [--what order,lse]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import ffpa_jax
from ffpa_jax.bench import _time_ms
from pallas_kernels import common

SHAPES = {64: (4, 32, 4096), 128: (4, 32, 4096), 256: (1, 32, 4096), 512: (1, 32, 4096),
          1024: (1, 32, 4096)}


def _inputs(d: int):
    b, h, n = SHAPES[d]
    ks = jax.random.split(jax.random.key(d), 5)
    q, k, v, do = (jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in ks[:4])
    dlse = jax.random.normal(ks[4], (b, h, n), jnp.float32)
    return q, k, v, do, dlse


def _compiled(fn, args, *, launch_order: bool):
    """`fn` compiled with the longest-first order (default) or with the launch order."""
    original = common.heavy_first
    if launch_order:
        common.heavy_first = lambda block, n_blocks, causal: block
    try:
        return jax.jit(fn).lower(*args).compile()
    finally:
        common.heavy_first = original


def order_rows(d: int) -> dict:
    q, k, v, do, _ = _inputs(d)
    attn = lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=True)

    def fwdbwd(q, k, v, do):
        _, vjp = jax.vjp(attn, q, k, v)
        return vjp(do)
    row = {"what": "order", "d": d, "shape": SHAPES[d], "causal": True}
    for name, fn, args in (("fwd", attn, (q, k, v)), ("fwdbwd", fwdbwd, (q, k, v, do))):
        heavy = _compiled(fn, args, launch_order=False)
        plain = _compiled(fn, args, launch_order=True)
        same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), heavy(*args), plain(*args))
        row[f"{name}_bitwise_equal"] = all(jax.tree.leaves(same))
        # Interleaved repeats, so drift in clocks hits both alike.
        for rep in range(2):
            row.setdefault(f"{name}_launch_order_ms", []).append(
                _time_ms(plain, args, min_rep_s=0.05, reps=5))
            row.setdefault(f"{name}_heavy_first_ms", []).append(
                _time_ms(heavy, args, min_rep_s=0.05, reps=5))
        row[f"{name}_ratio"] = min(row[f"{name}_heavy_first_ms"]) / min(
            row[f"{name}_launch_order_ms"])
    return row


def lse_rows(d: int) -> dict:
    q, k, v, do, dlse = _inputs(d)

    def grads(q, k, v, do, dlse, with_lse: bool):
        def loss(q, k, v):
            out, lse = ffpa_jax.attention(q, k, v, return_lse=True)
            total = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32))
            return total + (jnp.sum(lse * dlse) if with_lse else 0.0)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    args = (q, k, v, do, dlse)
    plain = jax.jit(lambda *a: grads(*a, with_lse=False)).lower(*args).compile()
    split = jax.jit(lambda *a: grads(*a, with_lse=True)).lower(*args).compile()
    row = {"what": "lse", "d": d, "shape": SHAPES[d], "causal": False}
    for rep in range(2):
        row.setdefault("out_only_ms", []).append(_time_ms(plain, args, min_rep_s=0.05, reps=5))
        row.setdefault("with_lse_ms", []).append(_time_ms(split, args, min_rep_s=0.05, reps=5))
    row["ratio"] = min(row["with_lse_ms"]) / min(row["out_only_ms"])
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--what", default="order,lse")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for what in args.what.split(","):
        for d in (int(x) for x in args.dims.split(",")):
            row = order_rows(d) if what == "order" else lse_rows(d)
            print(json.dumps(row), flush=True)
            rows.append(row)
            with open(args.out, "w") as f:
                json.dump({"device": jax.devices()[0].device_kind, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
