"""SASS of the Pallas/Triton kernels without a GPU: opcode counts of the hot loop.

Lowers a kernel variant for CUDA on any machine (as `attention` would lower it),
catches the Triton IR Pallas builds (the hook of `kernel_resources.py`), compiles it
for sm_90a with the `triton` package (3.6, whose bundled ptxas and cuobjdump need no
GPU), and prints per kernel: registers, spills, and the opcode histogram of its
innermost hot loop (the largest backward-branch body). This is how a kernel change
is predicted before device time is spent on it (METHOD.md: count first).

    python scripts/sass_report.py --kernel fwd --headdim 128 [--dropout 0.1]
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile

import kernel_resources as kr  # installs the Triton-IR hook
from pallas_kernels import BwdConfig, FwdConfig
from tuning import default_config

_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def compile_offline(ttir: str, num_warps: int, num_stages: int, capability: int = 90) -> bytes:
    """cubin of one Triton IR module for sm_<capability> (no driver needed)."""
    return kr.compile_ttir(ttir, num_warps, num_stages, capability).asm["cubin"]


def sass_report(cubin: bytes) -> dict:
    """Registers, spill stack and the hot loop's opcode histogram of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([kr.triton_tool("cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    instrs = []  # (address, opcode, operands)
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            instrs.append((int(m.group(1), 16), m.group(3), m.group(4)))
    loops = []  # (body length, start index, end index) of each backward branch
    for i, (addr, op, rest) in enumerate(instrs):
        target = re.search(r"`?\(?\.L_x_\d+\)?|0x([0-9a-f]+)", rest)
        if op.startswith("BRA") and target and target.group(1):
            dest = int(target.group(1), 16)
            if dest < addr:
                start = next(j for j, x in enumerate(instrs) if x[0] >= dest)
                loops.append((i - start + 1, start, i))
    report = {**kr.cubin_usage(cubin), "instructions": len(instrs)}
    if loops:
        n, start, end = max(loops)
        ops = collections.Counter(op.split(".")[0] for _, op, _ in instrs[start:end + 1])
        report["loop_instructions"] = n
        report["loop_opcodes"] = dict(ops.most_common())
    return report


def lower(kernel: str, d: int, dropout: float, causal: bool, n: int, cfg=None,
          split_ds: bool = False):
    """Lower one kernel at B=1, H=32, T=S=n (its default launch config unless `cfg`);
    returns the config. The Triton IR lands in `kernel_resources._caught`."""
    if cfg is None:
        name = {"fwd": "fwd_generic", "dq": "bwd_generic_dq", "dkdv": "bwd_generic_dkdv"}[kernel]
        tuned = default_config(name, headdim=d, has_dropout=dropout > 0)
        cfg = (FwdConfig if kernel == "fwd" else BwdConfig).from_tuned(tuned)
    kr._caught.clear()
    kr.lower_variant(d, kernel, cfg, n, dropout=dropout, causal=causal, split_ds=split_ds)
    return cfg


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=("fwd", "dq", "dkdv"), default="fwd")
    parser.add_argument("--headdim", type=int, default=128)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--split-ds", action="store_true",
                        help="dq/dkdv as under an lse cotangent (dS in two 16-bit words)")
    args = parser.parse_args()
    cfg = lower(args.kernel, args.headdim, args.dropout, args.causal, args.seqlen,
                split_ds=args.split_ds)
    for ttir in kr._caught:
        report = sass_report(compile_offline(ttir, cfg.num_warps, cfg.num_stages))
        print(cfg)
        print({k: v for k, v in report.items() if k != "loop_opcodes"})
        print(report.get("loop_opcodes"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
