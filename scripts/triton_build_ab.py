"""Same Triton IR, two compilers: is the gap to a native Triton kernel in the IR Pallas
writes, or in the Triton build that compiles it? (issue 7; GPU, jax_triton and triton)

`jax_triton_probe.py` found a native Triton forward 2-6% faster than ours, with the same
hot-loop instruction mix (`sass_report.py`). In jax 0.11.2 Pallas hands its Triton IR to
XLA, whose own Triton compiles it; a native kernel is compiled by the `triton` package.
This script catches the IR of ffpa_jax's forward kernel as Pallas lowers it, compiles it
with the `triton` package (make_ttir first, as `kernel_resources.compile_ttir` does) and
launches that binary through jax_triton's launcher, in place of the kernel jax_triton
would compile from Python. Both builds then run on the same inputs in one process: the
outputs are compared, then timed with the bench's sampler. A measurement only: it
patches a private function of jax_triton 0.3.1 and is never imported by the package.

    python scripts/triton_build_ab.py --out triton_build_ab.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile

import jax
import jax.numpy as jnp
import triton

import kernel_resources as kr  # installs the Triton-IR hook
from ffpa_jax.bench.measure import time_samples
from pallas_kernels import FwdConfig, fwd_generic
from tuning import default_config


@triton.jit
def _five_pointers(q, k, v, o, lse):
    """Stands in for the Pallas kernel's signature (q, k, v, out, lse); never compiled."""
    pass


def _install(ttir_box: dict) -> None:
    """Make jax_triton (0.3.1) compile the caught Pallas IR instead of `_five_pointers`:
    its `compile_ttir_inplace` step is replaced; the launch around it is jax_triton's."""
    from jax_triton import triton_lib

    def compile_caught(module, backend, options, compute_capability, platform):
        del module, backend, platform  # the stand-in's IR is not used
        kernel = kr.compile_ttir(ttir_box["ttir"], options.num_warps, options.num_stages,
                                 compute_capability)
        return triton_lib.CompilationResult(
            binary=kernel.asm["ptx"], name=kernel.metadata.name,
            shared_mem_bytes=kernel.metadata.shared, ttgir=kernel.asm["ttgir"],
            llir=kernel.asm["llir"])

    triton_lib.compile_ttir_inplace = compile_caught


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--seqlen", type=int, default=4096)
    args = parser.parse_args()
    saved_cache_dir = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton

    # jax_triton drops TRITON_CACHE_DIR on import; triton.compile needs a writable one.
    os.environ["TRITON_CACHE_DIR"] = saved_cache_dir or tempfile.mkdtemp(prefix="triton_")
    ttir_box: dict = {}
    _install(ttir_box)
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
               "triton_package": triton.__version__, "records": []}
    for d in (int(x) for x in args.dims.split(",")):
        b, h, n = (4 if d <= 128 else 1), 32, args.seqlen
        keys = jax.random.split(jax.random.key(d), 3)
        q, k, v = (jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in keys)
        cfg = FwdConfig.from_tuned(default_config("fwd_generic", headdim=d))
        pallas = jax.jit(lambda q, k, v: fwd_generic(q, k, v, scale=1 / math.sqrt(d),
                                                     causal=False, config=cfg))
        kr._caught.clear()
        lowered = pallas.lower(q, k, v)
        record = {"headdim": d, "batch": b, "heads": h, "seqlen": n, **vars(cfg)}
        if len(kr._caught) != 1 or cfg.block_dv < d:
            record["status"] = f"{len(kr._caught)} kernels caught, or Dv split: not handled"
            results["records"].append(record)
            continue
        ttir_box["ttir"] = kr._caught[0]
        from jax_triton import triton_lib
        triton_lib._COMPILED_KERNEL_CACHE.clear()  # its key ignores the IR swapped in
        out_shapes = [jax.ShapeDtypeStruct((b, n, h, d), jnp.bfloat16),
                      jax.ShapeDtypeStruct((b, h, n), jnp.float32)]
        package = jax.jit(lambda q, k, v: jax_triton.triton_call(
            q, k, v, kernel=_five_pointers, out_shape=out_shapes,
            grid=(n // cfg.block_m, b * h), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages))
        try:
            compiled = {"jaxlib": lowered.compile(), "package": package.lower(q, k, v).compile()}
            outs = {name: c(q, k, v) for name, c in compiled.items()}
            record["max_abs_diff_out"] = float(jnp.max(jnp.abs(
                outs["jaxlib"][0].astype(jnp.float32) - outs["package"][0].astype(jnp.float32))))
            record["max_abs_diff_lse"] = float(jnp.max(jnp.abs(outs["jaxlib"][1]
                                                               - outs["package"][1])))
            for name, c in compiled.items():
                record[f"{name}_ms"] = statistics.median(
                    time_samples(c, (q, k, v), min_rep_s=0.05, reps=7))
            record["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - a build that fails is a finding
            record["status"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
        results["records"].append(record)
        print(json.dumps(record), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
