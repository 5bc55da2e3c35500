"""Reading, summarising, tabulating and plotting benchmark records.

Reads both JSON formats: the first one (`{"header", "records"}`, no "format" key; the
committed H200 files of 2026-11-21) and format 2 (adds "format": 2, case kinds,
peak memory, compile time, dq error, bandwidth). Records of the first format are
normalised on load (their kind inferred); the files themselves are never rewritten.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import textwrap

FORMAT = 2
COLORS = {"ffpa": "C0", "cudnn": "C1", "xla": "C2", "pallas-mha": "C3", "pallas-mgpu": "C4",
          "pallas-decode": "C5"}


def infer_kind(r: dict) -> str:
    """The case kind of a record (format-1 records have none)."""
    if r.get("kind"):
        return r["kind"]
    if r.get("mask"):
        return "attn-mask"
    if r.get("bias"):
        return "bias-grad"
    if r.get("dropout"):
        return "dropout"
    if r["t"] == 1:
        return "decode"
    if r.get("causal"):
        return "causal"
    if r["hkv"] == 1 and r["hq"] > 1:
        return "mqa"
    if r["hkv"] != r["hq"]:
        return "gqa"
    if r["t"] != r["s"]:
        return "cross"
    if r["t"] % 2:
        return "non-aligned"
    return "self"


def normalize(r: dict) -> dict:
    """A copy of a record of either format with every format-2 key present."""
    out = dict(r)
    out.setdefault("bias", None)
    out.setdefault("dropout", 0.0)
    out["kind"] = infer_kind(out)
    for key in ("ms", "tflops", "gbps", "error", "error_dq", "error_dbias", "peak_mib",
                "workspace_mib", "compile_s", "first_call_s"):
        out.setdefault(key, None)
    return out


def is_ok(r: dict) -> bool:
    return r.get("status") == "ok"


def load(path) -> dict:
    """{"format", "header", "records", "path"} of one benchmark JSON file, normalised and
    annotated (speedups and dropout overheads among the records of this one run)."""
    path = pathlib.Path(path)
    doc = json.loads(path.read_text())
    records = [normalize(r) for r in doc["records"]]
    annotate(records)
    return {"format": doc.get("format", 1), "header": doc["header"], "path": str(path),
            "records": records}


def merge(docs: list[dict], device: str | None = None) -> list[dict]:
    """Records of several files, oldest file first by header date: a later record of the
    same (case label, impl) replaces an earlier one (re-measured cases show their newest
    figure). With `device`, only the files measured on that device (the header's
    "device"): figures of two GPUs never replace each other. Each record gains "source"
    (its file name) and "date". Speedups stay those of the record's own run: never
    re-annotate merged records, which mixes runs."""
    merged: dict[tuple[str, str], dict] = {}
    if device is not None:
        docs = [d for d in docs if d["header"].get("device") == device]
    for doc in sorted(docs, key=lambda d: d["header"].get("date", "")):
        for r in doc["records"]:
            merged[(r["case"], r["impl"])] = {**r, "source": pathlib.Path(doc["path"]).name,
                                              "date": doc["header"].get("date")}
    return list(merged.values())


def annotate(records: list[dict]) -> None:
    """In place: ffpa records get "speedup" {peer: peer_ms / ffpa_ms} over the peers that ran
    the same case; dropout records get "dropout_overhead" (ms over the same problem's ms
    without dropout, same impl) when that was measured."""
    by_case: dict[str, dict[str, dict]] = {}
    for r in records:
        by_case.setdefault(r["case"], {})[r["impl"]] = r
    for impls in by_case.values():
        ours = impls.get("ffpa")
        if ours is not None and is_ok(ours):
            ours["speedup"] = {name: r["ms"] / ours["ms"] for name, r in impls.items()
                               if name != "ffpa" and is_ok(r)}
    twins = {}
    for r in records:
        if not r.get("dropout") and is_ok(r):
            twins[_problem_key(r)] = r
    for r in records:
        if r.get("dropout") and is_ok(r):
            twin = twins.get(_problem_key(r))
            r["dropout_overhead"] = None if twin is None else r["ms"] / twin["ms"]


def _problem_key(r: dict) -> tuple:
    return (r["impl"], r["b"], r["t"], r["s"], r["hq"], r["hkv"], r["d"], r["dv"], r["causal"],
            r["dtype"], r.get("mask"), r.get("bias"), r["mode"])


# ---------------------------------------------------------------- tables
WIDTH = 100  # the CLI's text fits a terminal this wide


def _f(x, fmt: str) -> str:
    """x formatted, or a dash padded to the format's width."""
    return format(x, fmt) if x is not None else format("-", ">" + fmt.split(".")[0])


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 100 else f"{x:.1f}"


def _sci(x) -> str:
    return "-" if x is None else ("nan" if x != x else f"{x:.1e}")


def interpreted(r: dict) -> bool:
    """Whether the record's time was taken in Pallas' interpreter (a CPU run)."""
    return bool(r.get("interpreted"))


def versus(ours_ms: float, peer_ms: float) -> str:
    """ffpa's time against a peer's, in words that cannot be misread: "2.45x faster" when
    ffpa takes 1/2.45 of the peer's time, "1.30x slower" when it takes 1.3 times as long."""
    ratio = peer_ms / ours_ms
    if round(ratio, 2) == 1.0:
        return "as fast"
    x = ratio if ratio > 1 else 1 / ratio
    return f"{x:.2f}x {'faster' if ratio > 1 else 'slower'}" if x < 100 else \
        f"{x:.0f}x {'faster' if ratio > 1 else 'slower'}"


def never_ran(records: list[dict]) -> dict[str, str]:
    """{impl: reason} of the implementations that declined every case of the run for one and
    the same reason (a GPU-only peer on a CPU, say): said once instead of once per case."""
    statuses: dict[str, set[str]] = {}
    for r in records:
        statuses.setdefault(r["impl"], set()).add(r["status"])
    return {impl: next(iter(s)).split(": ", 1)[-1] for impl, s in statuses.items()
            if impl != "ffpa" and len(s) == 1 and next(iter(s)).startswith("unsupported")}


def _columns(gpu: bool, marker: bool) -> list[tuple[str, int]]:
    cols = [("impl", -15), ("ms", 8)]
    if marker:
        cols.append(("", 1))
    if gpu:
        cols += [("TF/s", 6), ("GB/s", 5)]
    cols += [("err", 7), ("dq err", 7), ("peak MiB", 8), ("comp s", 6)]
    if gpu:
        cols.append(("ffpa is", -13))
    return cols


def _cells(cols, values: dict) -> str:
    out = []
    for name, width in cols:
        text = values.get(name, "")
        cell = f"{text:<{-width}}" if width < 0 else f"{text:>{width}}"
        out.append(" " + cell if name == "ffpa is" else cell)  # words after numbers: a gap
    return ("  " + " ".join(out)).rstrip()


def text_table(records: list[dict], *, gpu: bool = True, width: int = WIDTH) -> str:
    """The CLI's table, at most `width` columns: a line per case (kind, label and the tiers
    ffpa ran), then a row per implementation that ran it. Implementations that declined
    every case for one reason are listed once below the table; others that declined a case
    are named on one line under it, with the reason in a numbered note. `gpu`: a GPU run
    (TF/s, GB/s and ffpa's time against each peer's); else those columns are left out."""
    marker = any(interpreted(r) for r in records)
    cols = _columns(gpu, marker)
    head = _cells(cols, {name: name for name, _ in cols})
    lines = [head, "-" * len(head)]
    notes: dict[str, int] = {}

    def note(text: str) -> str:
        return f"[{notes.setdefault(text, len(notes) + 1)}]"

    skipped = never_ran(records)
    by_case: dict[str, list[dict]] = {}
    for r in records:
        by_case.setdefault(r["case"], []).append(r)
    for label, rows in by_case.items():
        ours = next((r for r in rows if r["impl"] == "ffpa"), None)
        kind = rows[0].get("kind") or infer_kind(rows[0])
        title = f"{kind}: {label}"
        if ours is not None and ours.get("tier"):
            title += f"   (ffpa tier {ours['tier']})"
        lines.append(title)
        declined = []
        for r in rows:
            if r["impl"] in skipped:
                continue
            if r["status"].startswith("unsupported"):
                why = r["status"].split(": ", 1)[-1]
                declined.append(f"{r['impl']} {note(r['impl'] + ' declined: ' + why)}")
                continue
            if not is_ok(r):
                lines.append(_cells(cols[:2], {"impl": r["impl"], "ms": "error"})
                             + " " + note(f"{r['impl']}: {r['status']}"))
                continue
            values = {"impl": r["impl"], "ms": _ms(r["ms"]), "": "i" if interpreted(r) else "",
                      "TF/s": _f(r.get("tflops"), "6.1f"), "GB/s": _f(r.get("gbps"), "5.0f"),
                      "err": _sci(r.get("error")), "dq err": _sci(r.get("error_dq")),
                      "peak MiB": _f(r.get("peak_mib"), "8.0f"),
                      "comp s": _f(r.get("compile_s"), "6.1f")}
            if (gpu and r["impl"] != "ffpa" and ours is not None and is_ok(ours)
                    and not interpreted(r) and not interpreted(ours)):
                values["ffpa is"] = versus(ours["ms"], r["ms"])
            extra = []
            if r.get("error_dbias") is not None:
                extra.append(f"dbias {_sci(r['error_dbias'])}")
            if r.get("suspect"):
                extra.append("WRONG?")
            if r.get("error_note"):
                extra.append(f"no error: {r['error_note']}")
            row = _cells(cols, values)
            if extra:
                tail = " ".join(extra)
                if len(row) + 2 + len(tail) > width:
                    tail = note(f"{r['impl']}, {kind}: {label}: {tail}")
                row = f"{row}  {tail}"
            lines.append(row)
        if declined:
            lines += wrap("not run: " + ", ".join(declined), width,
                          initial_indent="  ", subsequent_indent="    ")
    if skipped:
        lines.append("Not run in any case of this run:")
        for impl, why in skipped.items():
            lines += wrap(f"{impl}: {why}", width, initial_indent="  ",
                          subsequent_indent="    ")
    if notes:
        lines.append("Notes:")
        for text, n in notes.items():
            lines += wrap(f"[{n}] {text}", width, initial_indent="  ",
                          subsequent_indent="      ")
    return "\n".join(lines)


def legend(*, gpu: bool, interpreted_rows: bool = False, width: int = WIDTH) -> str:
    """What every column of `text_table` holds, its unit, and which way is better."""
    items = [
        ("ms", "median time of a warm call (compile excluded), milliseconds; lower is better"),
    ]
    if interpreted_rows:
        items.append(("i", "ran in Pallas' interpreter on the CPU: its time shows that the code "
                           "runs, not how fast it is on a GPU"))
    if gpu:
        items += [
            ("TF/s", "teraFLOP/s, higher is better: 4·B·Hq·T·S·D per forward (D: the mean of D "
                     "and Dv), halved when causal, x3.5 for forward+backward"),
            ("GB/s", "gigabytes/s, higher is better: the forward's fewest bytes (q, k, v, out, "
                     "bias and mask once) over its time; forward rows only"),
        ]
    items += [
        ("err", "max |out - ref| / max |ref| on sampled query rows against a float64 "
                "reference; relative, lower is better"),
        ("dq err", "the same for dq (forward+backward rows); 'dbias' after a row: for the bias "
                   "gradient"),
        ("peak MiB", "peak device memory of the compiled call (XLA's memory analysis), MiB; "
                     "lower is better"),
        ("comp s", "trace + compile of the first call, seconds; lower is better"),
    ]
    if gpu:
        items.append(("ffpa is", "ffpa's time against this row's: '2.00x faster' = ffpa takes "
                                 "half this row's time, '2.00x slower' = twice"))
    items += [("WRONG?", "an error above 5e-2, or NaN: a wrong result"),
              ("ffpa tier", "the tier that ran ffpa's forward/backward: mosaic (Mosaic GPU "
                            "kernels, sm90), pallas (fused Triton kernels), chunked (blocked "
                            "GEMMs) or xla (dense)")]
    lines = ["Columns:"]
    for name, text in items:
        lines += wrap(f"{name:<10} {text}", width, initial_indent="  ",
                      subsequent_indent=" " * 13)
    if not gpu:
        lines += wrap(
            "No GPU: TF/s, GB/s and ffpa's time against each peer's are left out, as CPU "
            "times, interpreted or not, say nothing about them on a GPU.", width)
    return "\n".join(lines)


# The spaces a line must not break at: between a number and its unit ("10 s", "4096 MiB"),
# around "==" ("T == S") and before a note's number ("pallas-mha [3]").
_KEEP_TOGETHER = re.compile(r"(?<=\d) (?=(?:s|ms|MiB|GiB)\b)| (?===)|(?<===) | (?=\[\d+\])")
_GLUE = "\x00"  # not whitespace to textwrap, so the glued words stay one while wrapping


def wrap(text: str, width: int = WIDTH, **kw) -> list[str]:
    """`textwrap.wrap`, except that a number is never separated from its unit, nor a
    comparison or a note's number from what it belongs to (a line that ends in "10" and a
    next line that starts with "s target" read badly), and names are not broken at their
    hyphens ("pallas-mha")."""
    glued = _KEEP_TOGETHER.sub(_GLUE, text)
    kw.setdefault("break_on_hyphens", False)
    return [line.replace(_GLUE, " ") for line in textwrap.wrap(glued, width, **kw)]


def compile_summary(records: list[dict], target_s: float, width: int = WIDTH) -> list[str]:
    """ffpa's slowest trace+compile of the run and how many cases took longer than
    `target_s` (no lines when no ffpa record has a compile time)."""
    compiles = [r for r in records if r["impl"] == "ffpa" and r.get("compile_s") is not None]
    if not compiles:
        return []
    slow = max(compiles, key=lambda r: r["compile_s"])
    over = sum(r["compile_s"] > target_s for r in compiles)
    return wrap(f"ffpa trace+compile: at most {slow['compile_s']:.1f} s ({slow['kind']}: "
                f"{slow['case']}); {over} of {len(compiles)} cases above the "
                f"{target_s:.0f} s target", width)


def dropout_lines(records: list[dict], width: int = WIDTH) -> list[str]:
    """What dropout costs each implementation (the time over the same case's without it);
    never for interpreted times, which say nothing about that cost on a GPU."""
    out = []
    for r in records:
        if (r.get("dropout") and is_ok(r) and r.get("dropout_overhead") is not None
                and not interpreted(r)):
            out += wrap(
                f"dropout {r['dropout']:g}: {r['impl']} takes {r['dropout_overhead']:.2f}x "
                f"the time without dropout ({r['case']})", width, subsequent_indent="  ")
    return out


def _md(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def markdown_table(doc: dict) -> str:
    """A format-2 file (or any normalised doc) as a markdown table with its header line."""
    header = doc["header"]
    records = [dict(r) for r in doc["records"]]
    annotate(records)
    rows = ["| kind | case | impl | ms | TF/s | GB/s | error | dq error | peak MiB | "
            "compile s | ffpa speedup |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    by_case: dict[str, list[dict]] = {}
    for r in records:
        by_case.setdefault(r["case"], []).append(r)
    for label, group in by_case.items():
        ours = next((r for r in group if r["impl"] == "ffpa"), None)
        for r in group:
            if not is_ok(r):
                status = r["status"].replace("|", "/")[:90]
                rows.append(f"| {r['kind']} | {label} | {r['impl']} | – | – | – | – | – | – | – "
                            f"| {status} |")
                continue
            note = ""
            if r["impl"] != "ffpa" and ours is not None and is_ok(ours):
                note = f"{r['ms'] / ours['ms']:.2f}×"
            if r.get("dropout_overhead") is not None:
                note += f" dropout ×{r['dropout_overhead']:.2f}"
            if r.get("error_dbias") is not None:
                note += f" dbias error {r['error_dbias']:.1e}"
            if r.get("suspect"):
                note += " wrong result? (error > 5e-2 or NaN)"
            rows.append(f"| {r['kind']} | {label} | {r['impl']} | {r['ms']:.3f} | "
                        f"{r['tflops']:.1f} | {_md(r.get('gbps'), '.0f')} | "
                        f"{_md(r.get('error'), '.1e')} | {_md(r.get('error_dq'), '.1e')} | "
                        f"{_md(r.get('peak_mib'), '.0f')} | {_md(r.get('compile_s'), '.1f')} | "
                        f"{note.strip()} |")
    meta = (f"Device {header.get('device')}, jax {header.get('jax')} / jaxlib "
            f"{header.get('jaxlib')}, {header.get('date')}, command `{header.get('command')}`.")
    if header.get("cpu_fallback"):
        meta += (" CPU fallback: Pallas interpreter and XLA on the CPU; times say nothing of "
                 "GPU speed.")
    return meta + "\n\n" + "\n".join(rows)


# ---------------------------------------------------------------- plots
def _plot_group(r: dict) -> str:
    """The panel row a record is drawn in: its case kind, marked when a run made it causal
    (`--causal`)."""
    kind = r.get("kind") or infer_kind(r)
    return f"{kind}, causal" if r.get("causal") and kind != "causal" else kind


def impls_of(recs: list[dict]) -> list[str]:
    """The implementations in `recs`: ours and the known peers first, in COLORS' order."""
    impls = [i for i in COLORS if any(r["impl"] == i for r in recs)]
    return impls + sorted({r["impl"] for r in recs} - set(impls))


def _plot_bars(recs: list[dict], groups: list[str], impls: list[str], path, title: str):
    """TF/s as bars, a panel per mode, a group of bars per (kind, head dim, seqlen)."""
    import matplotlib.pyplot as plt
    modes = [m for m in ("fwd", "fwdbwd") if any(r["mode"] == m for r in recs)]
    fig, axes = plt.subplots(len(modes), 1, figsize=(12, 3.6 * len(modes)), squeeze=False)
    width = 0.8 / max(1, len(impls))

    def case_key(r):  # one group of bars: (kind's position, head dim, T, S)
        return groups.index(_plot_group(r)), r["d"], r["t"], r["s"]

    for ax, mode in zip(axes[:, 0], modes, strict=True):
        keys = sorted({case_key(r) for r in recs if r["mode"] == mode})
        for j, impl in enumerate(impls):
            by_key = {case_key(r): r["tflops"]
                      for r in recs if r["mode"] == mode and r["impl"] == impl}
            xs = [i + (j - (len(impls) - 1) / 2) * width
                  for i, key in enumerate(keys) if key in by_key]
            ax.bar(xs, [by_key[key] for key in keys if key in by_key], width, label=impl,
                   color=COLORS.get(impl))
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels([f"{groups[g]}\nD={d} T={t}" + (f" S={s}" if s != t else "")
                            for g, d, t, s in keys], fontsize=7)
        ax.set_title("forward" if mode == "fwd" else "forward + backward", fontsize=9)
        ax.set_ylabel("TF/s")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=8, ncol=len(impls))
    fig.suptitle(textwrap.fill(title.replace("against seqlen", "per case")
                               .replace("missing point", "missing bar"), width=190),
                 fontsize=10)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


def plot_tflops(records: list[dict], path=None, *, title: str | None = None,
                kinds: tuple[str, ...] | None = ("self",), heads: int | None = None,
                dtype: str | None = None):
    """TF/s against seqlen: a row of panels per (case kind, mode) present, forward above
    forward+backward, a panel per head dim, a line per implementation. Only ok records
    of `kinds` (default: plain self-attention; None: every kind in `records`, in the order
    of `cases.KINDS`), optionally only `heads` query heads and one dtype (default: the
    most common). The x axis is T (S for decode). Where several kinds are drawn and each
    was measured at one seqlen only, bars per case replace the lines. Returns the figure;
    saves it when `path` is given."""
    import matplotlib
    if path is not None and "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")  # a file only: no display needed
    import matplotlib.pyplot as plt

    from ffpa_jax.bench.cases import KINDS

    recs = [r for r in records if is_ok(r)
            and (kinds is None or (r.get("kind") or infer_kind(r)) in kinds)
            and (heads is None or r["hq"] == heads)]
    if dtype is None and recs:
        counts: dict[str, int] = {}
        for r in recs:
            counts[r["dtype"]] = counts.get(r["dtype"], 0) + 1
        dtype = max(counts, key=counts.get)
    recs = [r for r in recs if r["dtype"] == dtype]
    order = {k: i for i, k in enumerate(KINDS)}
    groups = sorted({_plot_group(r) for r in recs},
                    key=lambda g: (order.get(g.split(",")[0], len(order)), g))
    rows = [(g, mode) for g in groups or ["self"] for mode in ("fwd", "fwdbwd")
            if not recs or any(_plot_group(r) == g and r["mode"] == mode for r in recs)]
    dims = sorted({r["d"] for r in recs}) or [0]
    title = title or (f"TF/s against seqlen ({dtype}); a missing point: unsupported, "
                      "out of memory or not measured")
    seqlens = {}
    for r in recs:
        seqlens.setdefault((_plot_group(r), r["d"]), set()).add(r["t"])
    if len(groups) > 1 and all(len(ns) == 1 for ns in seqlens.values()):
        # one seqlen per kind and head dim: lines would be lone dots, so draw bars
        return _plot_bars(recs, groups, impls_of(recs), path, title)
    width = 3.2 * len(dims) + 1
    fig, axes = plt.subplots(len(rows), len(dims), figsize=(width, 3.2 * len(rows)),
                             squeeze=False, sharey="row")
    impls = impls_of(recs)
    for row, (group, mode) in enumerate(rows):
        for col, d in enumerate(dims):
            ax = axes[row][col]
            drawn = False
            for impl in impls:
                pts = sorted((r["s"] if r["t"] == 1 else r["t"], r["tflops"]) for r in recs
                             if _plot_group(r) == group and r["mode"] == mode and r["d"] == d
                             and r["impl"] == impl)
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, "o-", label=impl, color=COLORS.get(impl))
                    drawn = True
            if not drawn:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{group}: {'forward' if mode == 'fwd' else 'fwd + bwd'}, D={d}",
                         fontsize=9)
            ax.grid(alpha=0.3)
            if row == len(rows) - 1:
                ax.set_xlabel("seqlen T (S for decode)")
            if col == 0:
                ax.set_ylabel("TF/s")
    handles = {}
    for ax in axes.flat:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    for ax in axes.flat:
        ax.set_ylim(bottom=0)
    if handles:
        fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=len(handles),
                   fontsize=8, frameon=False)
    fig.suptitle(textwrap.fill(title, width=int(11 * width)), fontsize=10)
    height = 3.2 * len(rows)  # inches; room for the legend below and the title above
    fig.tight_layout(rect=(0, 0.4 / height, 1, 1 - 0.5 / height))
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig
