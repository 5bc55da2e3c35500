"""One-off: where the chunked tier's time goes, kernel by kernel (jax.profiler trace of a few
warm calls, summed per HLO op), beside the optimized HLO of each call.

    PYTHONPATH=. python3 scripts/chunked_profile.py --out DIR [--tiny]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.profiler import ProfileData

sys.path.insert(0, os.path.dirname(__file__))
from chunked_explore2 import dense, inputs  # noqa: E402
from chunked_explore3 import tier  # noqa: E402

REPS = 5


def profile(fn, args, mode):
    if mode == "fwd":
        f, call = jax.jit(fn), args[:3]
    else:
        def fb(q, k, v, do):
            out, vjp = jax.vjp(fn, q, k, v)
            return (out, *vjp(do))
        f, call = jax.jit(fb), args
    compiled = f.lower(*call).compile()
    jax.block_until_ready(compiled(*call))
    logdir = tempfile.mkdtemp()
    with jax.profiler.trace(logdir):
        for _ in range(REPS):
            jax.block_until_ready(compiled(*call))
    path = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)[0]
    totals = collections.Counter()
    counts = collections.Counter()
    for plane in ProfileData.from_file(path).planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            for ev in line.events:
                op = ev.name
                totals[op] += ev.duration_ns
                counts[op] += 1
    return compiled.as_text(), totals, counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--tiny", action="store_true")
    opts = ap.parse_args()
    configs = [
        ("d512-fwd-4096-pallas", 512, 4096, 32, 32, "fwd", tier(False, 4096, "pallas")),
        ("d512-fb-4096-pallas", 512, 4096, 32, 32, "fwdbwd", tier(False, 4096, "pallas")),
        ("d512-fb-2048-pallas", 512, 4096, 32, 32, "fwdbwd", tier(False, 2048, "pallas")),
        ("gqa-fb-2048-pallas", 512, 8192, 32, 8, "fwdbwd", tier(False, 2048, "pallas")),
        ("gqa-fb-2048-pallas", 512, 8192, 32, 8, "fwdbwd", tier(False, 2048, "pallas")),
        ("d512-fwd-dense", 512, 4096, 32, 32, "fwd", dense(False)),
    ]
    if opts.tiny:
        configs = [(n, 64, 256, 2, min(2, h), m, f) for n, _, _, _, h, m, f in configs[1::4]]
    for name, d, n, h, hkv, mode, fn in configs:
        args = inputs(d, n, h, min(h, hkv), d)
        text, totals, counts = profile(fn, args, mode)
        total = sum(totals.values()) / REPS / 1e6
        print(f"== {name}: {total:.3f} ms of kernels per call", flush=True)
        for op, ns in totals.most_common(16):
            print(f"   {ns / REPS / 1e6:8.3f} ms  x{counts[op] // REPS:<3d} {op[:100]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
