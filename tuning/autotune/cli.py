"""`python -m tuning.autotune`: measure launch configs on this GPU and write `<device>.json`.

Same flags as FFPA's `python -m ffpa_attn.autotune`:

    python -m tuning.autotune --mode fast|max --directions forward|backward|both
        --dtypes bf16,fp16 --B 1 --H 32 [--full-tasks] [--overwrite]
        [--output-dir DIR] [--num-gpus N] [--ray-address ADDR]

plus ours: `--resume` (continue an interrupted run's file), `--headdims` and
`--seqlens` (replace the grid), `--causal both|true|false`, `--task-timeout`,
`--dry-run` (list the tasks and exit). `FFPA_AUTOTUNE_MAX_CONFIGS=N` runs only
the first N tasks (smoke runs). After the kernel tasks, each prefill problem of the
grid also gets its tiers measured (`tuning.autotune.tiers`: the "tier" field of each
direction); `--tiers-only` measures only that, into an existing or new file, and
`--no-tiers` skips it. On a GPU where the Mosaic tier runs (sm90), its two kernels
("mosaic_fwd", "mosaic_bwd") are tuned too, after every task of FFPA's grid, on the
16-bit prefill problems the tier computes (`tasks.mosaic_tasks`). See docs/tuning.md.

The file is `<output-dir>/<sanitized device name>.json`. The default output dir is the
user's tuned-config directory, `$XDG_CACHE_HOME/ffpa_jax/tuned_configs` (else
`~/.cache/ffpa_jax/tuned_configs`), which the trace-time lookup reads after
`$FFPA_TUNED_CONFIG_DIR` and before the packaged `tuning/configs/`. An existing file is
never replaced without `--overwrite` (or continued without `--resume`). The autotuner
measures on NVIDIA GPUs: without one it says so and exits (`--dry-run` works anywhere).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tuning.autotune.sched import Progress, ResultStore, ResumeError, run_tasks
from tuning.autotune.tasks import (DECODE_KERNELS, HEADDIMS, LARGE_SEQLEN,
                                   MOSAIC_BACKWARD_KERNEL, MOSAIC_FORWARD_KERNEL, SEQLENS, Task,
                                   build_tasks, grid_seqlens)
from tuning.autotune.workers import DEFAULT_BACKEND, RayExecutor, SubprocessExecutor, gpus_for
from tuning.device import sanitize_device_name
from tuning.lookup import config_dirs, user_config_dir

ENV_MAX_CONFIGS = "FFPA_AUTOTUNE_MAX_CONFIGS"
_DTYPES = ("bf16", "fp16", "fp32")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers; got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers; got {text!r}")
    return values


def _dtype_list(text: str) -> list[str]:
    values = [part.strip() for part in text.split(",") if part.strip()]
    bad = [v for v in values if v not in _DTYPES]
    if not values or bad:
        raise argparse.ArgumentTypeError(
            f"dtypes must be a comma-separated subset of {','.join(_DTYPES)}; got {text!r}")
    return list(dict.fromkeys(values))


def _gpu_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"expected the number of GPUs to use, at least 1 (one worker process per GPU; "
            f"the autotuner measures on NVIDIA GPUs and cannot run without one); got {text!r}")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tuning.autotune",
        description="Autotune ffpa_jax's kernels on this GPU and write a tuned-config file.")
    parser.add_argument("--mode", choices=("fast", "max"), default="fast",
                        help="search space: fast (<= 8 candidates per kernel) or max (>= 24)")
    parser.add_argument("--directions", choices=("forward", "backward", "both"), default="both")
    parser.add_argument("--dtypes", type=_dtype_list, default=["bf16"],
                        help="comma-separated: bf16,fp16 (fp32 also accepted); default bf16")
    parser.add_argument("--B", type=_positive, default=1, help="batch size of the tuned problems")
    parser.add_argument("--H", type=_positive, default=32, help="query heads of the tuned problems")
    parser.add_argument("--full-tasks", action="store_true",
                        help="also tune the attn-mask, dropout, gqa and mqa variants")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing file for this device")
    parser.add_argument("--resume", action="store_true",
                        help="continue an interrupted run: keep its entries, run the rest")
    default_dir = user_config_dir()
    parser.add_argument("--output-dir", type=Path, default=default_dir,
                        help=f"where <device>.json goes (default {default_dir}: the user's "
                             "directory, which the trace-time lookup reads after "
                             "$FFPA_TUNED_CONFIG_DIR and before the packaged tuning/configs/; "
                             "elsewhere, point FFPA_TUNED_CONFIG_DIR at it)")
    parser.add_argument("--num-gpus", type=_gpu_count, default=None,
                        help="worker processes, one per GPU (default 1; with --ray-address: "
                             "every GPU of the cluster)")
    parser.add_argument("--ray-address", default=None,
                        help="run the tasks on this Ray cluster (needs the 'ray' extra)")
    parser.add_argument("--headdims", type=_int_list, default=None,
                        help=f"head dims to tune (default {','.join(map(str, HEADDIMS))})")
    parser.add_argument("--seqlens", type=_int_list, default=None,
                        help="seqlens to tune; 1 adds decode tasks (default 1,512,...,8192, "
                             f"and {LARGE_SEQLEN} on GPUs with >= 48 GiB)")
    parser.add_argument("--causal", choices=("both", "true", "false"), default="both",
                        help="which causal variants of the prefill problems to tune")
    parser.add_argument("--task-timeout", type=float, default=1800.0,
                        help="seconds before a task's worker is killed and the task failed")
    parser.add_argument("--tiers-only", action="store_true",
                        help="only measure which tier runs each direction fastest (the "
                             "'tier' field), updating this device's file in place")
    parser.add_argument("--no-tiers", action="store_true",
                        help="skip the tier measurement after the kernel tasks")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the tasks (for a GPU with >= 48 GiB unless --seqlens) and exit")
    # Internal: the worker backend, 'module:attr' (tests use a fake measurement).
    parser.add_argument("--worker-backend", default=DEFAULT_BACKEND, help=argparse.SUPPRESS)
    return parser


def _max_configs() -> int | None:
    raw = os.environ.get(ENV_MAX_CONFIGS, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{ENV_MAX_CONFIGS} must be a positive integer; got {raw!r}")
    return value


def _header(args, info: dict, seqlens: list[int], headdims: list[int]) -> dict:
    directions = ["forward", "backward"] if args.directions == "both" else [args.directions]
    return {
        "device_name": info["device_name"], "compute_capability": info.get("compute_capability"),
        "autotune_mode": args.mode, "B": args.B, "H": args.H, "full_tasks": args.full_tasks,
        "tune_grid": {"headdims": headdims, "seqlens": seqlens},
        "hardware_desc": {"enable_forward_tma": False, "enable_forward_ws": False,
                          "enable_backward_tma": False, "enable_backward_ws": False,
                          "memory_gib": (None if info.get("memory_gib") is None
                                         else round(info["memory_gib"], 1))},
        "autotune_directions": directions, "autotune_dtypes": list(args.dtypes),
    }


def _tasks(args, memory_gib: float | None,
           kernels: dict) -> tuple[list[Task], list[int], list[int]]:
    """The grid's tasks; the Mosaic kernels' too where `kernels` (the workers' capabilities)
    says they run."""
    seqlens = grid_seqlens(memory_gib, args.seqlens)
    headdims = sorted(set(args.headdims or HEADDIMS))
    directions = ("forward", "backward") if args.directions == "both" else (args.directions,)
    causal = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
    mosaic = all(kernels.get(k, {"missing": "absent"})["missing"] is None
                 for k in (MOSAIC_FORWARD_KERNEL, MOSAIC_BACKWARD_KERNEL))
    tasks = build_tasks(directions=directions, dtypes=args.dtypes, batch=args.B, heads=args.H,
                        headdims=headdims, seqlens=seqlens, full_tasks=args.full_tasks,
                        causal=causal, mosaic=mosaic)
    return tasks, seqlens, headdims


def split_supported(tasks: list[Task], kernels: dict) -> tuple[list[Task], dict[str, int]]:
    """(tasks the workers can run, {reason: count} of the others)."""
    keep, skipped = [], {}
    for task in tasks:
        caps = kernels.get(task.kernel)
        reason = None
        if caps is None:
            reason = f"no autotune runner for {task.kernel}"
        elif caps.get("missing"):
            reason = caps["missing"]
            if task.kernel in DECODE_KERNELS:
                reason += " (the seqlen-1 decode grid points are tuned once it exists)"
        elif task.has_dropout and not caps.get("dropout"):
            reason = f"{task.kernel} does not take a dropout rate yet (dropout tasks skipped)"
        if reason is None:
            keep.append(task)
        else:
            skipped[reason] = skipped.get(reason, 0) + 1
    return keep, skipped


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        max_configs = _max_configs()
    except ValueError as err:
        parser.error(str(err))
    if args.dry_run:
        # This process's own GPU (if any) says whether the Mosaic kernels' tasks are listed.
        from tuning.autotune.measure import capabilities  # noqa: PLC0415 - imports JAX
        tasks, _, _ = _tasks(args, memory_gib=LARGE_SEQLEN_GIB_FOR_DRY_RUN,
                             kernels=capabilities())
        if max_configs is not None:
            tasks = tasks[:max_configs]
        for task in tasks:
            print(task.label())
        print(f"{len(tasks)} tasks", file=sys.stderr)
        return 0

    if args.tiers_only:
        return _measure_tiers(args, file=None)

    # Workers first: the file is named after the device they report.
    log_dir = Path(tempfile.mkdtemp(prefix="ffpa_autotune_logs_"))
    try:
        if args.ray_address:
            executor = RayExecutor(args.ray_address, args.mode, num_gpus=args.num_gpus,
                                   backend=args.worker_backend)
        else:
            executor = SubprocessExecutor(gpus_for(args.num_gpus or 1), args.mode,
                                          backend=args.worker_backend, log_dir=log_dir)
    except ValueError as err:
        _say(f"error: {err}")
        return 2
    try:
        return _run(args, executor, max_configs, log_dir)
    except KeyboardInterrupt:
        _say("\ninterrupted: finished tasks are in the output file; run again with --resume "
             "to continue")
        return 130
    finally:
        executor.close()


LARGE_SEQLEN_GIB_FOR_DRY_RUN = 80.0


def _run(args, executor, max_configs: int | None, log_dir: Path) -> int:
    started = time.monotonic()
    _say(f"starting {executor.slots} worker(s) (logs: {log_dir}) ...")
    try:
        infos = executor.start()
    except RuntimeError as err:
        _say(f"error: {err}")
        return 1
    names = {info.get("device_name") for info in infos}
    if len(names) != 1:
        _say(f"error: the workers see different GPUs ({sorted(map(str, names))}); a tuned-config "
             "file is per device: make only one kind of GPU visible")
        return 2
    info = infos[0]
    path = Path(args.output_dir) / f"{sanitize_device_name(info['device_name'])}.json"
    if path.exists() and not (args.overwrite or args.resume):
        _say(f"error: {path} exists; pass --overwrite to replace it or --resume to continue it")
        return 2

    tasks, seqlens, headdims = _tasks(args, info.get("memory_gib"), info.get("kernels", {}))
    tasks, skipped = split_supported(tasks, info.get("kernels", {}))
    for reason, count in skipped.items():
        _say(f"skipping {count} task(s): {reason}")
    try:
        store = ResultStore.open(path, _header(args, info, seqlens, headdims), resume=args.resume)
    except ResumeError as err:
        _say(f"error: {err}")
        return 2
    done = store.done_keys()
    todo = [t for t in tasks if t.key not in done]
    if len(todo) < len(tasks):
        _say(f"resuming {path}: {len(tasks) - len(todo)} task(s) already done")
    capped = max_configs is not None and len(todo) > max_configs
    if capped:
        _say(f"{ENV_MAX_CONFIGS}={max_configs}: running the first {max_configs} of "
             f"{len(todo)} tasks")
        todo = todo[:max_configs]
    memory = info.get("memory_gib")
    _say(f"{info['device_name']} (cc {info.get('compute_capability')}, "
         f"{'?' if memory is None else f'{memory:.0f}'} GiB): {len(todo)} task(s), "
         f"mode {args.mode}, {executor.slots} GPU(s) -> {path}")
    summary = run_tasks(todo, executor, store,
                        progress=Progress(todo, slots=executor.slots),
                        task_timeout_s=args.task_timeout)
    complete = summary.aborted is None and summary.not_run == 0 and not capped
    store.write(complete=complete)
    minutes = (time.monotonic() - started) / 60
    _say(f"wrote {path}: {len(store.entries)} entries ({summary.entries} new), "
         f"{summary.failed} task(s) failed, {minutes:.1f} min"
         + ("" if complete else "; incomplete: run again with --resume to continue"))
    _say(where_the_lookup_reads(path))
    if summary.aborted:
        _say(f"error: {summary.aborted} (logs: {log_dir})")
        return 1
    # (a test's fake worker backend measures nothing: no tiers either)
    if not args.no_tiers and args.worker_backend == DEFAULT_BACKEND:
        executor.close()  # free the GPUs for the tier measurement
        return _measure_tiers(args, file=path)
    return 0


def where_the_lookup_reads(path: Path) -> str:
    """A line on whether the trace-time lookup reads `path`, and how to make it."""
    dirs = config_dirs()
    folder = Path(path).resolve().parent
    if folder in [d.resolve() for d in dirs]:
        return (f"the tuned-config lookup reads {folder} (in this order: "
                f"{', '.join(map(str, dirs))})")
    return (f"the tuned-config lookup does not read {folder}: set "
            f"FFPA_TUNED_CONFIG_DIR={folder} to use it")


def _measure_tiers(args, *, file: Path | None) -> int:
    """Run `tuning.autotune.tiers` on the grid of `args` (one GPU, its own process)."""
    headdims = ",".join(map(str, sorted(set(args.headdims or HEADDIMS))))
    seqlens = [s for s in (args.seqlens or SEQLENS) if s > 1]
    command = [sys.executable, "-m", "tuning.autotune.tiers", "--headdims", headdims,
               "--seqlens", ",".join(map(str, seqlens)), "--causal", args.causal,
               "--dtypes", ",".join(d for d in args.dtypes if d != "fp32"),
               "--B", str(args.B), "--H", str(args.H)]
    command += ["--file", str(file)] if file else ["--output-dir", str(args.output_dir)]
    _say("measuring the tiers: " + " ".join(command[1:]))
    return subprocess.run(command, check=False).returncode

