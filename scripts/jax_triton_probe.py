"""The native Triton forward launched from JAX through `jax_triton` (issue 7's other path).

`native_triton_probe.py` timed a plain Triton flash forward in torch. This launches the
same kernel (`_fwd_ptr`, pointer loads, JAX's [B, T, H, D] layout) from JAX with
`jax_triton.triton_call`, and times it in one process, with the bench's own sampler,
against ffpa_jax's Pallas forward, JAX's Pallas mha and cuDNN. It answers whether the
native path would give a measured gain where JAX users call it. Forward only, non-causal;
a measurement, not product code.

    python scripts/jax_triton_probe.py --out jax_triton_probe.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import ffpa_jax  # noqa: E402
from ffpa_jax.bench.measure import time_samples  # noqa: E402

LOG2E = 1.4426950408889634
CONFIGS = {  # (BLOCK_M, BLOCK_N, num_warps, num_stages), the probe's best first
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3)],
    128: [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2)],
}


def native_forward(q, k, v, *, block_m, block_n, num_warps, num_stages):
    """`native_triton_probe._fwd_ptr` on [B, T, H, D] arrays through jax_triton."""
    import jax_triton
    from native_triton_probe import _fwd_ptr

    b, n, h, d = q.shape
    return jax_triton.triton_call(
        q, k, v, kernel=_fwd_ptr, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(n // block_m, b * h), num_warps=num_warps, num_stages=num_stages,
        qk_scale=LOG2E / math.sqrt(d), N_CTX=n, H=h, stride_b=n * h * d, stride_h=d,
        stride_t=h * d, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, LIBDEVICE_EXP2=False)


def timed(fn, argv) -> float | str:
    try:
        compiled = jax.jit(fn).lower(*argv).compile()
        return statistics.median(time_samples(compiled, argv, min_rep_s=0.05, reps=7))
    except Exception as exc:  # noqa: BLE001 - what cannot run is a row, not a crash
        return f"error: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--seqlen", type=int, default=4096)
    args = parser.parse_args()
    import jax_triton
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "jax_triton": getattr(jax_triton, "__version__", "?"), "records": []}
    for d in (int(x) for x in args.dims.split(",")):
        b, h, n = (4 if d <= 128 else 1), 32, args.seqlen
        keys = jax.random.split(jax.random.key(d), 3)
        q, k, v = (jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in keys)
        ref = ffpa_jax.attention(q, k, v, implementation="xla").astype(jnp.float32)
        scale = float(jnp.max(jnp.abs(ref)))
        record = {"headdim": d, "batch": b, "heads": h, "seqlen": n,
                  "tflops_per_ms": 4.0 * b * h * n * n * d / 1e9}
        record["ffpa_ms"] = timed(lambda q, k, v: ffpa_jax.attention(q, k, v), (q, k, v))
        record["pallas_mha_ms"] = timed(lambda q, k, v: pallas_attention.mha(
            q, k, v, segment_ids=None, sm_scale=1 / math.sqrt(d)), (q, k, v))
        record["cudnn_ms"] = timed(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn"), (q, k, v))
        record["native"] = []
        for bm, bn, w, st in CONFIGS[d]:
            row = {"block_m": bm, "block_n": bn, "num_warps": w, "num_stages": st}
            fn = lambda q, k, v, c=(bm, bn, w, st): native_forward(
                q, k, v, block_m=c[0], block_n=c[1], num_warps=c[2], num_stages=c[3])
            try:
                got = jax.jit(fn)(q, k, v).astype(jnp.float32)
                row["rel_err"] = float(jnp.max(jnp.abs(got - ref))) / scale
                row["ms"] = timed(fn, (q, k, v)) if row["rel_err"] < 2e-2 else "wrong result"
            except Exception as exc:  # noqa: BLE001
                row["ms"] = f"error: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
            record["native"].append(row)
            print(json.dumps({"headdim": d, **row}), flush=True)
        results["records"].append(record)
        print(json.dumps({k: v for k, v in record.items() if k != "native"}), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
