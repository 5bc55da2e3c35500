"""Where dropout's time goes: the forward kernel timed with variants of the keep-mask
generator swapped in (GPU; docs/benchmarks.md records the results). Variants:

  none         no dropout (the floor)
  current      the shipped generator: Philox-4x32-10, one call per 8 columns that one
               thread holds (see pallas_kernels/dropout.py), mul.hi.u32 PTX, counters
               broadcast only where a round needs it
  neighbours   the generator shipped before 2026-11-22: one call per 8 neighbouring
               columns (spread over 4 threads: the interleave crosses threads) and the
               counters broadcast to the tile before round 0
  limbs        `current` with mul.hi built from 16-bit limbs
  per_element  one Philox call per element (no interleave; 8x the Philox work)
  join_only    the interleave with a trivial generator (the layout cost alone)
  select_only  a trivial per-element pattern (the cost of applying any mask)
  bytes8       8-bit draws, 16 neighbouring columns per call (half the Philox work,
               1/256 resolution)
  bytes8_lanes 8-bit draws, one call per 16 columns that one thread holds
               (64c + 8a + 2q + p, a in 0..7; tiles of 64 columns or more)

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


def _mulhilo(on_gpu):
    return dropout.mulhilo_ptx if on_gpu else dropout.mulhilo_limbs


def _words(c0, rows, h, b, seed_ref, on_gpu, *, eager=False):
    c = [c0[None, :], rows.astype(jnp.int32)[:, None], h, b]
    if eager:
        shape = (rows.shape[0], c0.shape[0])
        c = [jnp.broadcast_to(dropout.as_bits(x), shape) for x in c]
    return dropout.philox4x32(*c, seed_ref[0], seed_ref[1], mulhilo=_mulhilo(on_gpu))


def _neighbours(seed_ref, b, h, rows, col_start, n_cols, *, rate, on_gpu):
    """The mask before 2026-11-22: a call per 8 neighbouring columns, eager broadcast."""
    groups = n_cols // 8
    c0 = jnp.asarray(col_start, jnp.int32) // 8 + jnp.arange(groups, dtype=jnp.int32)
    w = _words(c0, rows, h, b, seed_ref, on_gpu, eager=True)
    j = dropout._join_last
    words = j(j(w[0], w[2]), j(w[1], w[3]))
    halves = j(words & dropout._c(0xFFFF), dropout._shr(words, 16))
    return halves.reshape(rows.shape[0], n_cols) >= dropout.keep_threshold(rate)


def _per_element(seed_ref, b, h, rows, col_start, n_cols, *, rate, on_gpu):
    cols = jnp.asarray(col_start, jnp.int32) + jnp.arange(n_cols, dtype=jnp.int32)
    w = dropout.philox4x32(cols[None, :], rows[:, None], h, b, seed_ref[0], seed_ref[1],
                           mulhilo=_mulhilo(on_gpu))
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
    w = _words(c0, rows, h, b, seed_ref, on_gpu)
    j = dropout._join_last
    words = j(j(w[0], w[2]), j(w[1], w[3]))
    by = [dropout._shr(words, 8 * i) & 0xFF for i in range(4)]
    draws = j(j(by[0], by[2]), j(by[1], by[3])).reshape(rows.shape[0], n_cols)
    return draws >= round(rate * 256)


def _bytes8_lanes(seed_ref, b, h, rows, col_start, n_cols, *, rate, on_gpu):
    chunks = n_cols // 64
    c0 = jnp.asarray(col_start, jnp.int32) // 16 + jnp.arange(4 * chunks, dtype=jnp.int32)
    w = _words(c0, rows, h, b, seed_ref, on_gpu)
    thr = round(rate * 256)
    m = rows.shape[0]
    j = dropout._join_last
    # Word k, byte 2·a_lo + p: [m, c, q, p, a_lo]; a = 2k + a_lo.
    x = [j(j((wk & 0xFF) >= thr, (dropout._shr(wk, 8) & 0xFF) >= thr),
           j((dropout._shr(wk, 16) & 0xFF) >= thr, dropout._shr(wk, 24) >= thr))
         .reshape(m, chunks, 4, 2, 2) for wk in w]
    y = j(j(x[0], x[1]), j(x[2], x[3]))  # [m, c, q, p, a_lo, k_lo, k_hi]
    return jnp.transpose(y, (0, 1, 6, 5, 4, 2, 3)).reshape(m, n_cols)


VARIANTS = {
    "none": None, "current": _current,
    "neighbours": _neighbours,
    "limbs": lambda *a, on_gpu, **kw: _current(*a, on_gpu=False, **kw),
    "per_element": _per_element, "join_only": _join_only, "select_only": _select_only,
    "bytes8": _bytes8,
    "bytes8_lanes": _bytes8_lanes,
}


def main() -> int:
    parser = base_parser(budget_s=240.0)
    parser.set_defaults(dims="128,512")
    parser.add_argument("--stages", type=int, default=0, help="override num_stages (0: default)")
    parser.add_argument("--variants", default="none,current,neighbours,bytes8_lanes",
                        help="comma-separated, from: " + ",".join(VARIANTS))
    args = parser.parse_args()
    started = time.time()
    results = []
    for d in [int(x) for x in args.dims.split(",")]:
        b, h, n = (4 if d <= 128 else 1), args.heads, args.seqlen
        ks = jax.random.split(jax.random.key(d), 3)
        q, k, v = (jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in ks)
        seed = jax.random.bits(jax.random.key(1), (2,), jnp.uint32)
        flops = 4.0 * b * h * n * n * d
        for name in args.variants.split(","):
            variant = VARIANTS[name]
            if time.time() - started > args.budget_s:
                break
            dropout.keep_tile = variant or _current
            rate = 0.1 if variant else 0.0
            # Each variant runs in the launch config `attention` would give it.
            cfg = FwdConfig.from_tuned(default_config("fwd_generic", headdim=d,
                                                      has_dropout=rate > 0))
            if args.stages:
                cfg = FwdConfig(**{**cfg.__dict__, "num_stages": args.stages})
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
