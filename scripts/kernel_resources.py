"""Registers, spills and shared memory of the Pallas/Triton kernels, per launch variant.

Where the Triton lowering of Pallas is the wall for a shape, this is the measurement
that shows it (issue 7): for each variant it lowers the kernel for this GPU, catches
the PTX and the shared-memory size Triton compiled it with, and runs `ptxas -v` on
that PTX for the registers per thread and the spill traffic. Nothing is launched, so
variants whose shared memory exceeds the limit are listed too (they could not run).

Needs a GPU machine with jax >= 0.11 (there `pallas_call` compiles Triton in
process through `jax._src.lib.triton.compile`, which this script wraps; jax 0.10
hands the Triton IR to XLA instead, and then no PTX is caught). The private hook is
used here only, in a diagnostic script, never in the package.

    python scripts/kernel_resources.py --out resources.json
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from pallas_kernels import BwdConfig, FwdConfig, bwd_generic_dkdv, bwd_generic_dq, fwd_generic

# The H100/H200 per-block limit of dynamic shared memory (227 KiB).
SHARED_LIMIT = 232448

_caught: list[dict] = []


def _install_hook() -> bool:
    """Wrap jaxlib's Triton compile so each kernel's PTX and shared memory are kept."""
    try:
        from jax._src.lib import triton as triton_lib
    except ImportError:
        return False
    original = triton_lib.compile

    def compile_and_keep(platform, module, arch_name, **kwargs):
        result = original(platform, module, arch_name, **kwargs)
        _caught.append({"ptx": getattr(result, "asm", ""), "smem": int(result.smem_bytes),
                        "num_warps": kwargs.get("num_warps"), "num_stages": kwargs.get("num_stages")})
        return result

    triton_lib.compile = compile_and_keep
    return True


def _ptxas() -> str | None:
    """A ptxas binary: on PATH, from the triton package, or from the CUDA pip wheels."""
    found = shutil.which("ptxas")
    if found:
        return found
    candidates = []
    try:
        import triton
        candidates += glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia",
                                             "bin", "ptxas"))
    except ImportError:
        pass
    for path in sys.path:
        candidates += glob.glob(os.path.join(path, "nvidia", "cuda_nvcc", "bin", "ptxas"))
    return candidates[0] if candidates else None


def ptxas_usage(ptx: str, ptxas: str) -> dict:
    """Registers per thread and spill bytes of `ptx`, from `ptxas -v`."""
    target = re.search(r"^\.target\s+(\S+)", ptx, re.M)
    arch = target.group(1).rstrip(",") if target else "sm_90a"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        proc = subprocess.run([ptxas, f"-arch={arch}", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True, timeout=600)
    text = proc.stdout + proc.stderr
    usage = {"arch": arch}
    for key, pattern in (("registers", r"Used (\d+) registers"),
                         ("spill_store_bytes", r"(\d+) bytes spill stores"),
                         ("spill_load_bytes", r"(\d+) bytes spill loads"),
                         ("stack_frame_bytes", r"(\d+) bytes stack frame")):
        match = re.search(pattern, text)
        usage[key] = int(match.group(1)) if match else None
    if proc.returncode != 0:
        usage["ptxas_error"] = text.strip().splitlines()[-1][:200] if text.strip() else "failed"
    return usage


def F(bm, bn, bd, bdv, w, st, mode):
    return FwdConfig(block_m=bm, block_n=bn, block_d=bd, block_dv=bdv, num_warps=w,
                     num_stages=st, q_mode=mode)


def B(bm, bn, bd, sl, w, st, dyn=False, split=False):
    return BwdConfig(block_m=bm, block_n=bn, block_d=bd, block_slice=sl, num_warps=w,
                     num_stages=st, dynamic=dyn, split_dkdv=split)


# (label, head dim, kernel, config). The defaults of tuning/defaults.py first, then the
# variants docs/fwd_variants.md and docs/bwd_variants.md measured around them.
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


def lower_variant(d: int, kernel: str, cfg, n: int) -> None:
    """Trace and lower one kernel at B=1, H=32, T=S=n (lowering compiles the Triton)."""
    shape = jax.ShapeDtypeStruct((1, n, 32, d), jnp.bfloat16)
    stats = jax.ShapeDtypeStruct((1, 32, n), jnp.float32)
    kw = dict(scale=1.0 / math.sqrt(d), causal=False, config=cfg)
    if kernel == "fwd":
        fn, argv = (lambda q, k, v: fwd_generic(q, k, v, **kw)), (shape,) * 3
    elif kernel == "dq":
        fn, argv = (lambda *a: bwd_generic_dq(*a, **kw)), (shape,) * 4 + (stats,) * 2
    else:
        fn, argv = (lambda *a: bwd_generic_dkdv(*a, **kw)), (shape,) * 4 + (stats,) * 2
    jax.jit(fn).trace(*argv).lower(lowering_platforms=("cuda",))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seqlen", type=int, default=4096)
    args = parser.parse_args()
    if not _install_hook():
        print("this jax has no in-process Triton compile hook", file=sys.stderr)
        return 2
    ptxas = _ptxas()
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "ptxas": ptxas,
               "shared_limit_bytes": SHARED_LIMIT, "records": []}
    for label, d, kernel, cfg in VARIANTS:
        record = {"label": label, "headdim": d, "kernel": kernel, **dataclass_dict(cfg)}
        _caught.clear()
        try:
            lower_variant(d, kernel, cfg, args.seqlen)
        except Exception as exc:  # noqa: BLE001 - a variant that fails to lower is a finding
            record["status"] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        kernels = []
        for item in _caught:
            name = re.search(r"^\.(?:visible\s+)?\.entry\s+(\w+)", item["ptx"], re.M)
            entry = {"name": name.group(1) if name else "?", "smem_bytes": item["smem"],
                     "fits": item["smem"] <= SHARED_LIMIT}
            if ptxas and item["ptx"]:
                entry.update(ptxas_usage(item["ptx"], ptxas))
            kernels.append(entry)
        record["kernels"] = kernels
        record.setdefault("status", "lowered" if kernels else "no kernel caught")
        results["records"].append(record)
        print(json.dumps(record), flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    print("\nlabel | D | kernel | regs/thread | spill st/ld B | smem KiB | fits")
    for r in results["records"]:
        for k in r["kernels"]:
            print(f"{r['label']} | {r['headdim']} | {k['name'][:28]} | {k.get('registers')} | "
                  f"{k.get('spill_store_bytes')}/{k.get('spill_load_bytes')} | "
                  f"{k['smem_bytes'] / 1024:.0f} | {k['fits']}")
        if not r["kernels"]:
            print(f"{r['label']} | {r['headdim']} | {r['status']}")
    return 0


def dataclass_dict(cfg) -> dict:
    return {k: v for k, v in vars(cfg).items()}


if __name__ == "__main__":
    sys.exit(main())
