"""Where a training step's time goes, from a JAX profiler trace of a few steps (the one
`examples/gemma_like.py --profile DIR` writes): per device track, the kernel time per step
by name, the time the device was busy and idle over the traced span, its largest idle
gaps; and the host's busiest events per step.

    python scripts/step_profile.py DIR [--steps 3] [--top 25] [--json FILE]

Kernels on different streams of one device may overlap (a collective beside the compute):
"busy" is their union's length, the kernel times their sum.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import sys


def trace_events(directory: pathlib.Path) -> list[dict]:
    """The events of the newest Perfetto trace (`*.trace.json.gz`) under `directory`."""
    found = sorted(directory.rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit(f"no *.trace.json.gz under {directory}: was the trace written with "
                         "create_perfetto_trace=True (the example's --profile does)?")
    doc = json.load(gzip.open(found[-1]))
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def process_names(events: list[dict]) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}


def busy_and_gaps(spans: list[tuple[float, float, str]]):
    """(busy µs, [(gap µs, the event before, the event after)]) of [start, end) spans."""
    spans = sorted(spans)
    busy, gaps = 0.0, []
    start, end, last = spans[0]
    for s0, s1, name in spans[1:]:
        if s0 > end:
            busy += end - start
            gaps.append((s0 - end, last, name))
            start = s0
        if s1 > end:
            end, last = s1, name
    return busy + (end - start), gaps


def summarize(events: list[dict], steps: int, top: int) -> dict:
    """Per process (device or host): time per step by event name, and for devices the busy
    and idle time over the traced span and the largest gaps."""
    names = process_names(events)
    by_pid = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            by_pid[e["pid"]].append(e)
    out = {}
    for pid, evs in sorted(by_pid.items()):
        name = names.get(pid, str(pid))
        total, count = collections.Counter(), collections.Counter()
        for e in evs:
            total[e["name"]] += e["dur"]
            count[e["name"]] += 1
        entry = {"events_per_step": [(n, round(t / steps, 1), round(count[n] / steps, 2))
                                     for n, t in total.most_common(top)]}
        if "host" not in name.lower():
            spans = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in evs]
            busy, gaps = busy_and_gaps(spans)
            span = max(s1 for _, s1, _ in spans) - min(s0 for s0, _, _ in spans)
            entry.update(span_us_per_step=round(span / steps, 1),
                         busy_us_per_step=round(busy / steps, 1),
                         kernel_us_per_step=round(sum(total.values()) / steps, 1),
                         largest_gaps=[(round(g, 1), a, b) for g, a, b in
                                       sorted(gaps, reverse=True)[:top]])
        out[name] = entry
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=pathlib.Path)
    parser.add_argument("--steps", type=int, default=3, help="steps the trace holds")
    parser.add_argument("--top", type=int, default=25, help="rows per table")
    parser.add_argument("--json", type=pathlib.Path, help="also write the summary here")
    args = parser.parse_args(argv)
    summary = summarize(trace_events(args.directory), args.steps, args.top)
    for process, entry in summary.items():
        print(f"== {process}")
        if "busy_us_per_step" in entry:
            print(f"per step: span {entry['span_us_per_step'] / 1e3:.2f} ms, busy "
                  f"{entry['busy_us_per_step'] / 1e3:.2f} ms, kernels "
                  f"{entry['kernel_us_per_step'] / 1e3:.2f} ms (summed over streams)")
        for name, us, calls in entry["events_per_step"]:
            print(f"  {us / 1e3:9.3f} ms  x{calls:<7g} {name[:100]}")
        for gap, before, after in entry.get("largest_gaps", [])[:5]:
            print(f"  idle {gap / 1e3:.3f} ms after {before[:40]} before {after[:40]}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
