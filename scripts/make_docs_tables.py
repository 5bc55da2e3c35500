"""Render the committed benchmark JSON (docs/data/) into markdown tables and plots.

Usage: python scripts/make_docs_tables.py [--bench FILE.json ...] [--gemma FILE.json]
(prints markdown; writes docs/*.png)
The tables in docs/benchmarks.md and docs/*_variants.md are pasted from this output,
so every figure there traces back to a JSON file written on the GPU.

Two benchmark formats: the first (the H200 files of 2026-11-21, rendered exactly as
before by `bench_table` and `plot`) and format 2 (`"format": 2`, written by the
current `python -m ffpa_jax.bench`), rendered by `ffpa_jax.bench.report`: its table,
and a plot of TF/s against seqlen per head dim next to it (docs/<file stem>.png).
Every format-2 `docs/data/bench_*.json` is rendered by default; `--bench` picks files.
`--gemma` renders the runs of examples/gemma_like.py gathered in one file (run name ->
its `--json` record, or the same fields parsed from its printout): tokens/s and peak
memory per device, and a plot of both.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
DATA = DOCS / "data"


def bench_table(path: pathlib.Path) -> str:
    doc = json.loads(path.read_text())
    header = doc["header"]
    rows = ["| case | impl | ms | TF/s | error | workspace MiB | ffpa speedup |",
            "|---|---|---|---|---|---|---|"]
    by_case: dict[str, dict] = {}
    for r in doc["records"]:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    for case, impls in by_case.items():
        ours = impls.get("ffpa")
        for name, r in impls.items():
            if r["status"] != "ok":
                reason = r["status"].split(":")[0] + ": " + r["status"].split(":", 1)[-1].strip()[:70]
                rows.append(f"| {case} | {name} | – | – | – | – | {reason} |")
                continue
            speedup = ""
            if name != "ffpa" and ours and ours["status"] == "ok":
                speedup = f"{r['ms'] / ours['ms']:.2f}×"
            rows.append(f"| {case} | {name} | {r['ms']:.3f} | {r['tflops']:.1f} | "
                        f"{r['error']:.1e} | {r['workspace_mib']:.0f} | {speedup} |")
    meta = (f"Device {header['device']}, jax {header['jax']} / jaxlib {header['jaxlib']}, "
            f"{header['date']}, command `{header['command']}`.")
    return meta + "\n\n" + "\n".join(rows)


def variant_table(path: pathlib.Path, keys: list[str]) -> str:
    recs = json.loads(path.read_text())
    rows = ["| " + " | ".join(keys + ["ms", "TF/s", "status"]) + " |",
            "|" + "---|" * (len(keys) + 3)]
    for r in recs:
        ok = r["status"] == "ok"
        status = "ok" if ok else r["status"][:60]
        cells = [str(r.get(k)) for k in keys]
        rows.append("| " + " | ".join(cells + [f"{r['ms']:.2f}" if ok else "–",
                                               f"{r['tflops']:.1f}" if ok else "–", status]) + " |")
    return "\n".join(rows)


def plot(paths: list[pathlib.Path], out: pathlib.Path) -> None:
    """Bars per case; a later file's record replaces an earlier one for the same
    (case, impl), so re-measured cases show their newest figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    merged: dict[tuple[str, str], dict] = {}
    for path in paths:
        doc = json.loads(path.read_text())
        for r in doc["records"]:
            merged[(r["case"], r["impl"])] = r
    recs = [r for r in merged.values() if r["status"] == "ok" and r["mask"] is None]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colors = {"ffpa": "C0", "cudnn": "C1", "xla": "C2", "pallas-mha": "C3"}
    for ax, mode in zip(axes, ("fwd", "fwdbwd")):
        labels = []
        for r in recs:
            if r["mode"] != mode:
                continue
            label = f"D={r['d']}\nN={r['t'] // 1024}K"
            if label not in labels:
                labels.append(label)
        width = 0.2
        for i, impl in enumerate(colors):
            xs, ys = [], []
            for r in recs:
                if r["mode"] == mode and r["impl"] == impl:
                    xs.append(labels.index(f"D={r['d']}\nN={r['t'] // 1024}K") + (i - 1.5) * width)
                    ys.append(r["tflops"])
            ax.bar(xs, ys, width, label=impl, color=colors[impl])
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_title(f"{'forward' if mode == 'fwd' else 'forward + backward'} (bf16)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("TF/s")
    axes[0].legend()
    fig.suptitle(f"{doc['header']['device']}, {doc['header']['date'][:10]}: missing bars = "
                 "unsupported or out of memory")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def _gemma_runs(path: pathlib.Path) -> dict[str, dict]:
    """The runs of a gemma_like file, each with tokens/s (None: out of memory), its devices,
    sequence length and peak GiB per device."""
    doc = json.loads(path.read_text())
    runs = {}
    for name, run in doc.items():
        if name.startswith("_"):
            continue
        attention, seq, gpus = name.rsplit("-", 2)
        peak = run.get("peak_gib")
        if peak is None and run.get("peak_memory_bytes"):
            peak = max(run["peak_memory_bytes"]) / 2**30
        runs[name] = dict(attention=attention, seq=seq.upper(), devices=int(gpus[:-3]),
                          tokens_per_s=None if run.get("out_of_memory") else run["tokens_per_s"],
                          peak_gib=peak)
    return runs


def gemma_table(path: pathlib.Path) -> str:
    runs = _gemma_runs(path)
    rows = ["| sequence | attention | GPUs | tokens/s | peak GiB per GPU | vs jax.nn, 1 GPU |",
            "|---|---|---|---|---|---|"]
    for run in runs.values():
        base = runs.get(f"jax.nn-{run['seq'].lower()}-1gpu", {}).get("tokens_per_s")
        ours = run["tokens_per_s"]
        ratio = (f"{ours / base:.2f}×" if ours and base and run["attention"] != "jax.nn"
                 else "jax.nn OOM" if ours and run["attention"] != "jax.nn" else "")
        rows.append(f"| {run['seq']} | {run['attention']} | {run['devices']} | "
                    + (f"{ours:,.0f}" if ours else "OOM") + " | "
                    + (f"{run['peak_gib']:.1f}" if run["peak_gib"] else "–") + f" | {ratio} |")
    return json.loads(path.read_text()).get("_note", "") + "\n\n" + "\n".join(rows)


def gemma_plot(path: pathlib.Path, out: pathlib.Path) -> None:
    """Tokens/s and peak memory per GPU of each run, side by side; an out-of-memory run is
    a labelled empty slot."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = list(_gemma_runs(path).values())
    labels = [f"{r['attention']}\n{r['seq']}, {r['devices']} GPU" for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = ["C0" if r["attention"] == "ffpa" else "C1" for r in runs]
    for ax, key, title in ((axes[0], "tokens_per_s", "tokens/s (training step)"),
                           (axes[1], "peak_gib", "peak memory per GPU (GiB)")):
        values = [r[key] if r["tokens_per_s"] else 0.0 for r in runs]
        ax.bar(range(len(runs)), values, color=colors)
        for i, r in enumerate(runs):
            if not r["tokens_per_s"]:
                ax.text(i, 0, "OOM", ha="center", va="bottom")
        ax.set_xticks(range(len(runs)), labels, fontsize=8)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("examples/gemma_like.py (Gemma-4-shaped, 12 layers, bf16): ffpa_jax and jax.nn")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def bench_format(path: pathlib.Path) -> int:
    """1 for the first benchmark JSON format (no "format" key), else its "format"."""
    return json.loads(path.read_text()).get("format", 1)


def _report():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from ffpa_jax.bench import report
    return report


def render_format2(path: pathlib.Path, plot_dir: pathlib.Path | None = DOCS) -> str:
    """A format-2 file's markdown table; with plot_dir, also draws plot_dir/<stem>.png
    (TF/s against seqlen per head dim, forward and forward+backward, with the peers)."""
    report = _report()
    doc = report.load(path)
    text = f"#### {path.name}\n\n" + report.markdown_table(doc)
    if plot_dir is not None:
        out = plot_dir / f"{path.stem}.png"
        header = doc["header"]
        report.plot_tflops(doc["records"], out, kinds=None,
                           title=f"{header.get('device')}, {str(header.get('date'))[:10]}: "
                                 "TF/s against seqlen (missing point: unsupported or OOM)")
        link = pathlib.Path(os.path.relpath(out, DOCS)).as_posix()
        text += f"\n\n![TF/s against seqlen]({link})"
    return text


def first_format_output(plot_dir: pathlib.Path | None = DOCS) -> None:
    """The tables and plot of the first-format files, exactly as before."""
    main_bench = DATA / "bench_H200_2026-11-21.json"
    print(bench_table(main_bench))
    followup = DATA / "bench_large_fwdbwd_H200_2026-11-21.json"
    for extra in ("bench_fwd_32k_H200_2026-11-21.json", "bench_512_32k_h8_H200_2026-11-21.json",
                  "bench_gqa_H200_2026-11-21.json", followup.name):
        print("\n" + bench_table(DATA / extra))
    if plot_dir is not None:
        plot([main_bench, followup], plot_dir / "bench_H200_2026-11-21.png")
    fwd_keys = ["d", "block_m", "block_n", "block_d", "block_dv", "num_warps", "num_stages",
                "q_mode", "prefetch_v"]
    for rnd in (1, 2, 3):
        print(f"\n### forward round {rnd}\n")
        print(variant_table(DATA / f"fwd_variants_round{rnd}_H200.json", fwd_keys))
    for rnd in (1, 2, 3, 4):
        print(f"\n### backward round {rnd}\n")
        print(variant_table(DATA / f"bwd_variants_round{rnd}_H200.json",
                            ["d", "kernel", "block_m", "block_n", "block_d", "block_slice",
                             "num_warps", "num_stages", "dynamic", "split_dkdv"]
                            + ["transposed"] * (rnd >= 4)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Render docs/data benchmark JSON as markdown.")
    parser.add_argument("--bench", nargs="+", type=pathlib.Path,
                        help="render only these benchmark files (either format); default: the "
                             "first-format tables as before, then every format-2 file in docs/data")
    parser.add_argument("--plot-dir", type=pathlib.Path, default=DOCS,
                        help="where the PNGs go (default: docs/)")
    parser.add_argument("--no-plots", action="store_true", help="tables only, write no PNG")
    parser.add_argument("--gemma", type=pathlib.Path,
                        help="render only this file of examples/gemma_like.py runs")
    args = parser.parse_args(argv)
    plot_dir = None if args.no_plots else args.plot_dir
    if args.gemma:
        print(gemma_table(args.gemma))
        if plot_dir is not None:
            gemma_plot(args.gemma, plot_dir / f"{args.gemma.stem}.png")
        return 0
    if args.bench:
        for path in args.bench:
            print(render_format2(path, plot_dir) if bench_format(path) >= 2 else bench_table(path))
            print()
        return 0
    first_format_output(plot_dir)
    for path in sorted(DATA.glob("bench_*.json")):
        if bench_format(path) >= 2:
            print("\n" + render_format2(path, plot_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
