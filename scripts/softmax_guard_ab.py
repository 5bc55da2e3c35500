"""The forward's online softmax with its running max started at the lowest finite float
(`common.ROW_MAX_START`, shipped) against the former start at -inf with a guard that
replaced a -inf max by 0 before each subtraction (rebuilt here), timed in one process
(GPU). bf16, the issue 7 shapes, forward only; outputs compared bit for bit.

    python scripts/softmax_guard_ab.py --out guard.json [--dims 64,128,256]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import ffpa_jax
from ffpa_jax.bench import _time_ms
from pallas_kernels import common

SHAPES = {64: (4, 32, 4096), 128: (4, 32, 4096), 256: (1, 32, 4096)}


def guarded_step(s, m_i, l_i, st, *, raw_scale=None):
    """The online softmax step as it was before 2026-11-22 (session 10)."""
    if raw_scale is None:
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1))
    else:
        m_new = jnp.maximum(m_i, jnp.max(s, axis=1) * raw_scale)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    if raw_scale is None:
        p = st.exp2(st.exp2_arg(s - m_use[:, None]))
    else:
        p = st.exp2(common.fma(s, raw_scale, -m_use[:, None]))
    alpha = st.exp2(st.exp2_arg(m_i - m_use))
    return m_new, p, alpha, l_i * alpha + jnp.sum(p, axis=1)


def compiled(fn, args, *, guarded: bool):
    saved = common.online_softmax_step, common.ROW_MAX_START
    if guarded:
        common.online_softmax_step, common.ROW_MAX_START = guarded_step, float("-inf")
    try:
        return jax.jit(fn).lower(*args).compile()
    finally:
        common.online_softmax_step, common.ROW_MAX_START = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for d in (int(x) for x in args.dims.split(",")):
        b, h, n = SHAPES[d]
        ks = jax.random.split(jax.random.key(d), 3)
        qkv = tuple(jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in ks)
        for causal in (False, True):
            fn = lambda q, k, v, causal=causal: ffpa_jax.attention(q, k, v, is_causal=causal)
            new, old = (compiled(fn, qkv, guarded=g) for g in (False, True))
            row = {"d": d, "shape": [b, h, n], "causal": causal,
                   "bitwise_equal": bool(jnp.array_equal(new(*qkv), old(*qkv)))}
            for _ in range(3):  # interleaved, so drift in clocks hits both alike
                row.setdefault("guard_ms", []).append(_time_ms(old, qkv, min_rep_s=0.05, reps=5))
                row.setdefault("row_max_start_ms", []).append(
                    _time_ms(new, qkv, min_rep_s=0.05, reps=5))
            row["ratio"] = min(row["row_max_start_ms"]) / min(row["guard_ms"])
            print(json.dumps(row), flush=True)
            rows.append(row)
            with open(args.out, "w") as f:
                json.dump({"device": jax.devices()[0].device_kind, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
