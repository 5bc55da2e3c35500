"""Where dropout's time goes: the forward kernel timed with variants of the keep-mask
generator swapped in (GPU; docs/benchmarks.md records the results). Variants:

  none         no dropout (the floor)
  current      Philox-4x32-10, 8 columns per call, tt.join interleave, mul.hi.u32 PTX
  limbs        the same with mul.hi built from 16-bit limbs
  per_element  one Philox call per element (no interleave; 8x the Philox work)
  join_only    the interleave with a trivial generator (the layout cost alone)
  select_only  a trivial per-element pattern (the cost of applying any mask)
  bytes8       8-bit draws, 16 columns per call (half the Philox work, 1/256 resolution)

Only `current` is a real dropout; the others exist to split its cost.
    python scripts/dropout_variants.py --out dropout_variants.json [--dims 128,512]
"""

from __future__ import annotations

import json
import math
import time

import jax
import jax.numpy as jnp

from pallas_kernels import FwdConfig, dropout, fwd_generic
from sweep_common import base_parser, measure_candidate, save
from tuning import default_config

_current = dropout.keep_tile


def _per_element(seed_ref, b, h, rows, col_start, n_cols, *, rate, on_gpu):
    cols = jnp.asarray(col_start, jnp.int32) + jnp.arange(n_cols, dtype=jnp.int32)
    w = dropout.philox4x32(cols[None, :], rows[:, None], h, b, seed_ref[0], seed_ref[1],
                           mulhi=dropout.mulhi_ptx if on_gpu else dropout.mulhi_limbs)
    return (w[0] & 0xFFFF) >= dropout.keep_threshold(rate)


def _join_only(seed_ref, b, h, rows, col_start, n_cols, *, rate, on_gpu):
    groups = n_cols // 8
    c0 = jnp.asarray(col_start, jnp.int32) // 8 + jnp.arange(groups, dtype=jnp.int32)
    w = [c0[None, :] * (i + 3) + rows[:, None] * 7919 + seed_ref[0] for i in range(4)]
    j = dropout._join_last
    words = j(j(w[0], w[2]), j(w[1], w[3]))
    halves = j(words & 0xFFFF, dropout._shr(words, 16)).reshape(rows.shape[0], n_cols)
    return halves >= dropout.keep_threshold(rate)


def _select_only(seed_ref, b, h, rows, col_start, n_cols, *, rate, on_gpu):
    cols = jnp.asarray(col_start, jnp.int32) + jnp.arange(n_cols, dtype=jnp.int32)
    return ((cols[None, :] * 40503 + rows[:, None] * 7919 + seed_ref[0]) & 0xFFFF) >= \
        dropout.keep_threshold(rate)


def _bytes8(seed_ref, b, h, rows, col_start, n_cols, *, rate, on_gpu):
    groups = n_cols // 16
    c0 = jnp.asarray(col_start, jnp.int32) // 16 + jnp.arange(groups, dtype=jnp.int32)
    w = dropout.philox4x32(c0[None, :], rows[:, None], h, b, seed_ref[0], seed_ref[1],
                           mulhi=dropout.mulhi_ptx if on_gpu else dropout.mulhi_limbs)
    j = dropout._join_last
    words = j(j(w[0], w[2]), j(w[1], w[3]))
    by = [dropout._shr(words, 8 * i) & 0xFF for i in range(4)]
    draws = j(j(by[0], by[2]), j(by[1], by[3])).reshape(rows.shape[0], n_cols)
    return draws >= round(rate * 256)


VARIANTS = {
    "none": None, "current": _current,
    "limbs": lambda *a, on_gpu, **kw: _current(*a, on_gpu=False, **kw),
    "per_element": _per_element, "join_only": _join_only, "select_only": _select_only,
    "bytes8": _bytes8,
}


def main() -> int:
    parser = base_parser(budget_s=240.0)
    parser.set_defaults(dims="128,512")
    parser.add_argument("--stages", type=int, default=0, help="override num_stages (0: default)")
    args = parser.parse_args()
    started = time.time()
    results = []
    for d in [int(x) for x in args.dims.split(",")]:
        b, h, n = (4 if d <= 128 else 1), args.heads, args.seqlen
        ks = jax.random.split(jax.random.key(d), 3)
        q, k, v = (jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in ks)
        seed = jax.random.bits(jax.random.key(1), (2,), jnp.uint32)
        cfg = FwdConfig.from_tuned(default_config("fwd_generic", headdim=d))
        if args.stages:
            cfg = FwdConfig(**{**cfg.__dict__, "num_stages": args.stages})
        flops = 4.0 * b * h * n * n * d
        for name, variant in VARIANTS.items():
            if time.time() - started > args.budget_s:
                break
            dropout.keep_tile = variant or _current
            rate = 0.1 if variant else 0.0
            fn = lambda q, k, v, seed, rate=rate, cfg=cfg: fwd_generic(
                q, k, v, scale=1 / math.sqrt(d), causal=False, config=cfg, dropout_rate=rate,
                seed=seed, interpret=args.interpret)
            rec = {"d": d, "b": b, "h": h, "n": n, "variant": name, **cfg.__dict__}
            measure_candidate(rec, fn, (q, k, v, seed), error_of=lambda out: 0.0,
                              tolerance=1.0, flops=flops)
            save(results, rec, args.out)
    dropout.keep_tile = _current
    print(json.dumps({"done": len(results)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
