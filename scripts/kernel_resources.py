"""Registers, spills and shared memory of the Pallas/Triton kernels, per launch variant.

Where the Triton lowering of Pallas is the wall for a shape, this is the measurement
that shows it (issue 7). Each variant is lowered as `attention` would lower it; the
Triton IR module Pallas builds is caught, written out as text, and compiled for this
GPU by the `triton` Python package (through make_ttir's passes, as XLA's own Triton
pipeline runs them), whose compiled kernel reports registers per thread, spilled
registers and shared memory. Nothing is launched.

Caveat: jaxlib hands the same Triton IR to the Triton inside XLA; the `triton`
package here (3.6 on the lent machines) is a separate build of the same compiler, so
its figures are those of that build. Catching the IR uses Pallas' private
`lower_jaxpr_to_triton_module`: a diagnostic script only, never the package.

    python scripts/kernel_resources.py --out resources.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import lowering as pallas_triton_lowering

from pallas_kernels import BwdConfig, FwdConfig, bwd_generic_dkdv, bwd_generic_dq, fwd_generic

# The H100/H200 limit of shared memory per block (227 KiB).
SHARED_LIMIT = 232448

_caught: list[str] = []
_lower = pallas_triton_lowering.lower_jaxpr_to_triton_module


def _lower_and_keep(*args, **kwargs):
    result = _lower(*args, **kwargs)
    _caught.append(result.module.operation.get_asm(enable_debug_info=False))
    return result


pallas_triton_lowering.lower_jaxpr_to_triton_module = _lower_and_keep


def compile_ttir(ttir: str, num_warps: int, num_stages: int, capability: int):
    """One Triton IR module compiled for sm_<capability> by the `triton` package, through
    the same passes as a kernel written in Triton: `triton.compile` skips the first
    stage's passes for an IR file, and for a .ttir file those are make_ttir's (among
    them the combine pass that folds `acc + dot(a, b)` into the dot's accumulator), so
    they are run here first. (Without them every dot here kept a zero accumulator and a
    separate float32 add, which overstated the hot loops: docs/history.md, session 17.)
    No GPU is needed to compile."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    target = GPUTarget("cuda", capability, 32)
    with tempfile.TemporaryDirectory() as tmp:
        raw, done = os.path.join(tmp, "raw.ttir"), os.path.join(tmp, "kernel.ttir")
        with open(raw, "w") as f:
            f.write(ttir)
        context = ir.context()
        ir.load_dialects(context)
        CUDABackend(target).load_dialects(context)
        module = ir.parse_mlir_module(raw, context)
        module.context = context  # make_ttir builds its pass manager on module.context
        module = CUDABackend.make_ttir(module, {}, None, capability)
        with open(done, "w") as f:
            f.write(str(module))
        return triton.compile(done, target=target,
                              options={"num_warps": num_warps, "num_stages": num_stages})


def triton_usage(ttir: str, num_warps: int, num_stages: int, *, offline: bool = False) -> dict:
    """Registers, spills and shared memory of one Triton IR module compiled for this GPU
    (read back from the loaded kernel), or with `offline` for sm_90 on any machine (read
    from the cubin by the cuobjdump bundled with triton: registers, and the local stack
    frame that holds the spills, in 4-byte words)."""
    if offline:
        kernel = compile_ttir(ttir, num_warps, num_stages, 90)
        usage = cubin_usage(kernel.asm["cubin"])
        return {"registers": usage["registers"], "spilled_registers": usage["stack_bytes"] // 4,
                "shared_bytes": kernel.metadata.shared,
                "shared_fits": kernel.metadata.shared <= SHARED_LIMIT}
    major, minor = (int(x) for x in jax.devices()[0].compute_capability.split("."))
    kernel = compile_ttir(ttir, num_warps, num_stages, 10 * major + minor)
    kernel._init_handles()
    return {"registers": kernel.n_regs, "spilled_registers": kernel.n_spills,
            "shared_bytes": kernel.metadata.shared,
            "shared_fits": kernel.metadata.shared <= SHARED_LIMIT}


def triton_tool(name: str) -> str:
    """Path of a CUDA tool bundled with the `triton` package (cuobjdump, nvdisasm, ptxas)."""
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def cubin_usage(cubin: bytes) -> dict:
    """Registers per thread and local stack bytes of a cubin (cuobjdump, no GPU)."""
    import re
    import subprocess

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([triton_tool("cuobjdump"), "--dump-resource-usage", f.name],
                              capture_output=True, text=True, check=True).stdout
    return {"registers": int(re.search(r"REG:(\d+)", text).group(1)),
            "stack_bytes": int(re.search(r"STACK:(\d+)", text).group(1))}


def F(bm, bn, bd, bdv, w, st, mode):
    return FwdConfig(block_m=bm, block_n=bn, block_d=bd, block_dv=bdv, num_warps=w,
                     num_stages=st, q_mode=mode)


def B(bm, bn, bd, sl, w, st, dyn=False, split=False):
    return BwdConfig(block_m=bm, block_n=bn, block_d=bd, block_slice=sl, num_warps=w,
                     num_stages=st, dynamic=dyn, split_dkdv=split)


# (label, head dim, kernel, config). The built-in defaults (the kernels' descriptors) first,
# then the variants docs/fwd_variants.md and docs/bwd_variants.md measured around them.
VARIANTS = [
    ("fwd default", 128, "fwd", F(128, 128, 128, 128, 8, 3, "resident")),
    ("fwd default", 256, "fwd", F(128, 64, 256, 256, 8, 2, "resident")),
    ("fwd default", 512, "fwd", F(128, 128, 64, 256, 8, 4, "dynamic")),
    ("fwd default", 1024, "fwd", F(128, 128, 64, 256, 8, 4, "dynamic")),
    ("fwd whole Dv, BM=64", 512, "fwd", F(64, 64, 128, 512, 8, 4, "dynamic")),
    ("fwd whole Dv, BM=128", 512, "fwd", F(128, 64, 64, 512, 8, 3, "dynamic")),
    ("fwd whole Dv, BM=128, BN=128", 512, "fwd", F(128, 128, 64, 512, 8, 3, "dynamic")),
    ("fwd 512-wide Dv slices, BM=128", 1024, "fwd", F(128, 128, 64, 512, 8, 3, "dynamic")),
    ("fwd static unroll (resident Q)", 512, "fwd", F(128, 64, 64, 256, 8, 2, "resident")),
    ("dq default", 128, "dq", B(128, 128, 128, 128, 8, 2)),
    ("dkdv default", 128, "dkdv", B(64, 64, 128, 128, 4, 2)),
    ("dq default", 256, "dq", B(64, 128, 64, 256, 8, 3, dyn=True)),
    ("dkdv default", 256, "dkdv", B(64, 128, 64, 256, 8, 3, dyn=True, split=True)),
    ("dq default", 512, "dq", B(64, 128, 64, 512, 8, 3, dyn=True)),
    ("dkdv default", 512, "dkdv", B(128, 64, 64, 512, 8, 3, dyn=True, split=True)),
    ("dq default", 1024, "dq", B(64, 128, 64, 512, 8, 3, dyn=True)),
    ("dkdv default", 1024, "dkdv", B(128, 64, 64, 512, 8, 3, dyn=True, split=True)),
    ("dkdv dK and dV together", 512, "dkdv", B(128, 64, 64, 512, 8, 3, dyn=True, split=False)),
    ("dq whole D, BM=128", 512, "dq", B(128, 128, 64, 512, 8, 3, dyn=True)),
    ("dkdv static unroll", 512, "dkdv", B(128, 64, 64, 512, 8, 3, dyn=False, split=True)),
]


def lower_variant(d: int, kernel: str, cfg, n: int, *, dropout: float = 0.0,
                  causal: bool = False, split_ds: bool = False) -> None:
    """Lower one kernel at B=1, H=32, T=S=n for this GPU (this runs Pallas' lowering);
    with `dropout` > 0 the kernel takes a seed input; `split_ds` (dq, dkdv) as under an
    lse cotangent."""
    shape = jax.ShapeDtypeStruct((1, n, 32, d), jnp.bfloat16)
    stats = jax.ShapeDtypeStruct((1, 32, n), jnp.float32)
    seeds = (jax.ShapeDtypeStruct((2,), jnp.uint32),) if dropout > 0 else ()
    kw = dict(scale=1.0 / math.sqrt(d), causal=causal, config=cfg, dropout_rate=dropout)
    if split_ds:
        kw["split_ds"] = True
    kernels = {"fwd": fwd_generic, "dq": bwd_generic_dq, "dkdv": bwd_generic_dkdv}
    argv = (shape,) * 3 if kernel == "fwd" else (shape,) * 4 + (stats,) * 2

    def fn(*a):
        arrays, seed = (a[:-1], a[-1]) if seeds else (a, None)
        return kernels[kernel](*arrays, seed=seed, **kw)

    jax.jit(fn).trace(*argv, *seeds).lower(lowering_platforms=("cuda",))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--offline", action="store_true",
                        help="compile for sm_90 without a GPU (figures from the cubin)")
    args = parser.parse_args()
    device = "sm_90, offline" if args.offline else jax.devices()[0].device_kind
    results = {"device": device, "jax": jax.__version__,
               "shared_limit_bytes": SHARED_LIMIT, "records": []}
    try:
        import triton
        results["triton"] = triton.__version__
    except ImportError:
        print("needs the triton package", file=sys.stderr)
        return 2
    for label, d, kernel, cfg in VARIANTS:
        record = {"label": label, "headdim": d, "kernel": kernel, **vars(cfg)}
        _caught.clear()
        try:
            lower_variant(d, kernel, cfg, args.seqlen)
            if len(_caught) != 1:
                raise RuntimeError(f"{len(_caught)} Triton modules caught, expected 1")
            record.update(triton_usage(_caught[0], cfg.num_warps, cfg.num_stages,
                                       offline=args.offline))
            record["status"] = "ok"
        except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is a finding
            record["status"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:240]
        results["records"].append(record)
        print(json.dumps(record), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print("\nlabel | D | regs/thread | spilled | shared KiB | fits | status")
    for r in results["records"]:
        shared = r.get("shared_bytes")
        print(f"{r['label']} | {r['headdim']} | {r.get('registers')} | {r.get('spilled_registers')} | "
              f"{'-' if shared is None else round(shared / 1024)} | {r.get('shared_fits')} | "
              f"{r['status'][:60]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
