"""A/B on the GPU: one tensor-core accumulation chain over the whole head dim for q·kᵀ
("chain", what `attention` runs when lse is not returned) against a chain per head-dim
chunk summed in float32 ("per-chunk", `precise_lse`: what runs for return_lse=True;
see `pallas_kernels.common.contract_chunks`).

Prints, for both variants in one process:
- accuracy: max |lse - lse_float64| over 4 seeds for the problems of
  scripts/lse_precision.py (plus D=1024 and D=256), beside the XLA path's at the same
  precision (the tolerance rule allows 2x XLA's);
- speed: forward and forward+backward through `ffpa_jax.attention` (tuned configs)
  with return_lse False and True, bf16, timed alternately (A, B, A, B, ...), medians
  in ms.

    python scripts/chunk_rounding_ab.py [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import ffpa_jax
from ffpa_jax import pallas_path, validation
from ffpa_jax.bench.measure import time_samples
from ffpa_jax.reference import mha_reference
from lse_precision import PROBLEMS, draw

VARIANTS = {"chain": False, "per-chunk": True}  # name -> precise_lse / return_lse
ACCURACY = PROBLEMS + (  # (b, t, s, hq, hkv, d, scale, magnitude)
    (1, 64, 256, 4, 4, 1024, None, 1.0),
    (1, 64, 256, 4, 4, 256, None, 2.0),
)
SPEED = (  # (b, h, n, d, causal)
    (4, 32, 4096, 128, False),
    (4, 32, 4096, 128, True),
    (1, 32, 4096, 256, False),
    (1, 32, 4096, 512, False),
    (1, 32, 4096, 1024, False),
    (1, 32, 16384, 512, True),
)


def kernel_lse(q, k, v, scale: float, precise: bool):
    problem = validation.validate(q, k, v, None, None, scale=scale, is_causal=False,
                                  dropout_rate=0.0, dropout_rng=None, return_lse=True,
                                  implementation="pallas", interpret=False)
    return pallas_path.pallas_attention(q, k, v, None, None, problem, interpret=False,
                                        precise_lse=precise)[1]


def accuracy() -> list[dict]:
    rows = []
    for problem in ACCURACY:
        b, t, s, hq, hkv, d, _, mag = problem
        errs: dict[str, list[float]] = {}
        for seed in range(4):
            q, k, v, scale, ref = draw(problem, seed)
            got = {"xla": mha_reference(q, k, v, scale=scale)[1]}
            for name, precise in VARIANTS.items():
                got[name] = kernel_lse(q, k, v, scale, precise)
            for name, lse in got.items():
                errs.setdefault(name, []).append(
                    float(np.max(np.abs(np.asarray(lse, np.float64) - ref))))
        row = {"problem": dict(b=b, t=t, s=s, hq=hq, hkv=hkv, d=d, scale=scale, magnitude=mag),
               "max_lse_error": {n: max(e) for n, e in errs.items()},
               "per_seed": errs}
        worst_xla = row["max_lse_error"]["xla"]
        print(f"D={d} T={t} S={s} |q|~{mag}: " + ", ".join(
            f"{n} {e:.2e} ({e / worst_xla:.2f}x xla)" for n, e in row["max_lse_error"].items()),
            flush=True)
        rows.append(row)
    return rows


def speed(rounds: int) -> list[dict]:
    rows = []
    for b, h, n, d, causal in SPEED:
        keys = jax.random.split(jax.random.key(n + d), 4)
        q, k, v, do = (jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in keys)
        compiled = {}
        for name, with_lse in VARIANTS.items():
            def fwd(q, k, v, with_lse=with_lse, causal=causal):
                return ffpa_jax.attention(q, k, v, is_causal=causal, return_lse=with_lse)

            def fwdbwd(q, k, v, do, fwd=fwd, with_lse=with_lse):
                out, vjp = jax.vjp(fwd, q, k, v)
                if with_lse:
                    return vjp((do, jnp.zeros_like(out[1])))
                return vjp(do)

            compiled[("fwd", name)] = jax.jit(fwd).lower(q, k, v).compile()
            compiled[("fwdbwd", name)] = jax.jit(fwdbwd).lower(q, k, v, do).compile()
        for mode, args in (("fwd", (q, k, v)), ("fwdbwd", (q, k, v, do))):
            samples: dict[str, list[float]] = {name: [] for name in VARIANTS}
            for _ in range(rounds):
                for name in VARIANTS:
                    samples[name] += time_samples(compiled[(mode, name)], args, min_rep_s=0.05,
                                                  reps=2)
            med = {name: statistics.median(x) for name, x in samples.items()}
            row = dict(b=b, h=h, n=n, d=d, causal=causal, mode=mode, ms=med,
                       ratio=med["per-chunk"] / med["chain"])
            print(f"{mode:6s} B={b} H={h} N={n} D={d} causal={causal}: chain {med['chain']:.3f} "
                  f"ms, per-chunk {med['per-chunk']:.3f} ms ({row['ratio']:.3f}x)", flush=True)
            rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    print(jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "accuracy": accuracy(), "speed": speed(args.rounds)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
