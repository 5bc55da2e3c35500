"""The command line of `python -m ffpa_jax.bench` (the module docstring is its --help)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys

import jax

from ffpa_jax.bench import cases as cases_mod
from ffpa_jax.bench import report
from ffpa_jax.bench.cases import KINDS, BenchCase
from ffpa_jax.bench.measure import DTYPES, measure
from ffpa_jax.bench.peers import FFPA, PEERS
from ffpa_jax.context_blocks import STRATEGIES

COMPILE_TARGET_S = 10.0
CPU_NOTE = ("No GPU found: running small shapes through the Pallas interpreter and XLA on the "
            "CPU. These times only show that the code runs; they say nothing about GPU speed.")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown case kind(s) {unknown}; known: {', '.join(KINDS)}")
    return kinds


def build_parser() -> argparse.ArgumentParser:
    from ffpa_jax.bench import __doc__ as doc
    parser = argparse.ArgumentParser(prog="python -m ffpa_jax.bench", description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    pick = parser.add_argument_group("what to run")
    pick.add_argument("--case", type=_kinds, default=None, metavar="KIND[,KIND]",
                      help=f"case kinds to run (default: all): {', '.join(KINDS)}")
    pick.add_argument("--quick", action="store_true",
                      help="one shape per kind and 3 timing samples: a quick look")
    pick.add_argument("--preset", choices=["auto", "gpu", "cpu"], default="auto",
                      help="shape table when no shape option is given "
                           "(auto: gpu if a GPU is found)")
    pick.add_argument("--mode", choices=["fwd", "fwdbwd", "both"], default="both",
                      help="forward only, forward+backward, or both (default); "
                           "decode and paged-decode are forward only")
    pick.add_argument("--peers", default=",".join(PEERS),
                      help=f"comma list from {', '.join(PEERS)}, or 'none' (default: all)")
    pick.add_argument("--list", action="store_true", help="print the cases and exit")
    shape = parser.add_argument_group(
        "shapes", "any of these switches from the preset to a grid: every --case kind on every\n"
        "head dim x seqlen (--case defaults to 'self' there)")
    shape.add_argument("--headdims", type=_ints, help="comma list (grid default: 128)")
    shape.add_argument("--seqlens", type=_ints, help="comma list (grid default: 4096)")
    shape.add_argument("--batch", type=int, help="default: 4 for D <= 128, else 1; decode 8")
    shape.add_argument("--heads", type=int, help="query heads (default 32)")
    shape.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads; "
                       "gqa and decode: heads/4; mqa: 1)")
    shape.add_argument("--kv-seqlen", type=int, help="S of the cross case (default: seqlen/2)")
    shape.add_argument("--page-size", type=int, help="keys per page of the paged-decode case "
                       f"(default {cases_mod.PAGE_SIZE})")
    shape.add_argument("--devices", type=int, help="the context-parallel case's devices, the "
                       "sequence split over them (default: all of the process's)")
    shape.add_argument("--context-layout", choices=["zigzag", "contiguous"], default="zigzag",
                       help="the context-parallel case's layout (default zigzag)")
    shape.add_argument("--context-strategy", choices=list(STRATEGIES),
                       help="the context-parallel case's strategy (default: the rule's)")
    opts = parser.add_argument_group("options for every case")
    opts.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    opts.add_argument("--causal", action="store_true", help="make every case causal")
    opts.add_argument("--dropout", type=float, default=cases_mod.DEFAULT_DROPOUT,
                      help="rate of the dropout case (default 0.1)")
    opts.add_argument("--reps", type=int, default=7, help="timing samples (median is reported)")
    opts.add_argument("--min-rep-s", type=float, default=0.05,
                      help="each sample repeats the call to last at least this long (GPU)")
    opts.add_argument("--seed", type=int, default=0)
    out = parser.add_argument_group("output")
    out.add_argument("--json", help="write the header and every record here (rewritten after "
                     "each case, so an interrupted run keeps what it measured)")
    out.add_argument("--plot", help="draw TF/s against seqlen per head dim into this PNG")
    return parser


def _grid_mode(args) -> bool:
    return any(getattr(args, name) is not None for name in
               ("headdims", "seqlens", "batch", "heads", "kv_heads", "kv_seqlen", "page_size"))


def select_cases(args, on_gpu: bool) -> list[BenchCase]:
    """The cases this invocation runs, in order."""
    modes = ["fwd", "fwdbwd"] if args.mode == "both" else [args.mode]
    if _grid_mode(args):
        chosen = cases_mod.grid(
            args.case or ["self"], headdims=args.headdims or [128], seqlens=args.seqlens or [4096],
            batch=args.batch or 0, heads=args.heads or 32, kv_heads=args.kv_heads or 0,
            kv_seqlen=args.kv_seqlen or 0, causal=args.causal, dtype=args.dtype,
            dropout=args.dropout, page=args.page_size or cases_mod.PAGE_SIZE,
            devices=args.devices or 0, layout=args.context_layout,
            strategy=args.context_strategy or "")
    else:
        gpu = args.preset == "gpu" or (args.preset == "auto" and on_gpu)
        if gpu:
            chosen = cases_mod.gpu_quick_preset() if args.quick else cases_mod.gpu_preset()
        else:
            chosen = cases_mod.cpu_quick_preset() if args.quick else cases_mod.cpu_preset()
        if args.case:
            chosen = [c for c in chosen if c.kind in args.case]
        chosen = [dataclasses.replace(
            c, dtype=args.dtype, causal=c.causal or args.causal,
            dropout=args.dropout if c.dropout else 0.0) for c in chosen]
        chosen = [dataclasses.replace(c, devices=args.devices or 0, layout=args.context_layout,
                                      strategy=args.context_strategy or "")
                  if c.kind == cases_mod.CONTEXT_PARALLEL else c for c in chosen]
    if args.devices and args.devices > jax.device_count():
        raise ValueError(f"--devices {args.devices}: this process has {jax.device_count()}")
    chosen = cases_mod.on_devices(chosen, jax.device_count())
    return cases_mod.with_modes(chosen, modes)


def _peers(parser, text: str) -> list:
    if text == "none":
        return []
    names = [p.strip() for p in text.split(",") if p.strip()]
    for p in names:
        if p not in PEERS:
            parser.error(f"--peers: unknown peer {p!r}; known: {', '.join(PEERS)}")
    return [PEERS[p] for p in names]


def device_header(argv: list[str]) -> dict:
    dev = jax.devices()[0]
    import jaxlib
    header = {"device": getattr(dev, "device_kind", dev.platform), "platform": dev.platform,
              "jax": jax.__version__, "jaxlib": jaxlib.__version__,
              "python": platform.python_version(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python -m ffpa_jax.bench", *argv])}
    try:
        import triton
        header["triton"] = triton.__version__
    except Exception:
        pass
    try:
        header["compilation_cache_dir"] = jax.config.jax_compilation_cache_dir
    except Exception:
        pass
    return header


def _write_json(path: str, header: dict, records: list[dict]) -> None:
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"format": report.FORMAT, "header": header, "records": records}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    peers = _peers(parser, args.peers)
    on_gpu = jax.devices()[0].platform == "gpu"
    try:
        cases = select_cases(args, on_gpu)
    except ValueError as e:  # a shape the case kinds cannot take, e.g. --heads 6 --kv-heads 4
        parser.error(str(e))
    if args.list:
        for c in cases:
            print(f"{c.kind:<11} {c.label}")
        print(f"{len(cases)} cases; implementations: ffpa, {', '.join(p.name for p in peers)}")
        return 0
    reps, min_rep_s = args.reps, args.min_rep_s
    if args.quick:
        reps = min(reps, 3)
    if not on_gpu:
        print("\n".join(report.wrap(CPU_NOTE)), flush=True)
        reps, min_rep_s = min(reps, 2), 0.0
    header = device_header(argv)
    header.update(cpu_fallback=not on_gpu, reps=reps, min_rep_s=min_rep_s,
                  implementations=["ffpa", *(p.name for p in peers)],
                  error_sample=("max |out - ref| / max |ref| against mha_reference in float64 "
                                "on the host, every (T//64)-th query row of (batch, head) = "
                                "(0, 0), (B//2, Hq//2), (B-1, Hq-1); of out, dq, and dbias "
                                "(a [1, Hq, T, S] bias at B = 1)"),
                  memory="XLA memory analysis of the compiled call: peak = arguments + outputs "
                         "+ temporaries - aliased; workspace = outputs + temporaries")
    print(f"device: {header['device']}  jax {header['jax']}  jaxlib {header['jaxlib']}  "
          f"{header['date']}  ({len(cases)} cases)", flush=True)
    records: list[dict] = []
    for i, case in enumerate(cases):
        for impl in [FFPA, *peers]:
            if not impl.runs_kind(case.kind):
                continue
            record = measure(case, impl, interpret=not on_gpu, min_rep_s=min_rep_s,
                             reps=reps, seed=args.seed)
            # Whether its time came from Pallas' interpreter (the text marks such rows).
            record["interpreted"] = impl.interpreted(not on_gpu, record.get("tier"))
            records.append(record)
        report.annotate(records)
        ours = next(r for r in records if r["case"] == case.label and r["impl"] == "ffpa")
        status = ours["status"]
        if report.is_ok(ours):
            status = f"{ours['ms']:.3f} ms" + (" (interpreted)" if ours["interpreted"] else "")
        progress = f"  [{i + 1}/{len(cases)}] {case.kind:<11} {case.label}: ffpa {status}"
        if len(progress) > report.WIDTH:
            progress = progress[:report.WIDTH - 4] + " ..."
        print(progress, file=sys.stderr, flush=True)
        if args.json:
            _write_json(args.json, header, records)
    print(report.text_table(records, gpu=on_gpu))
    print(report.legend(gpu=on_gpu, interpreted_rows=any(r["interpreted"] for r in records)))
    if on_gpu:  # CPU times (interpreted, or XLA on a CPU) say nothing of dropout's cost
        for line in report.dropout_lines(records):
            print(line)
    for line in report.compile_summary(records, COMPILE_TARGET_S):
        print(line)
    if args.plot:
        title = f"{header['device']}, {header['date'][:10]}: TF/s against seqlen"
        if not on_gpu:
            title += " (CPU fallback: interpreter times, not GPU speed)"
        report.plot_tflops(records, args.plot, title=title, kinds=None)
        print(f"plot: {args.plot}")
    failed = [r for r in records if r["impl"] == "ffpa" and r["status"].startswith("error")]
    return 1 if failed else 0
