"""The benchmark CLI (`python -m ffpa_jax.bench`), its report, and the docs renderer, on CPU.

Speed is never asserted: these check what the benchmark plans to run, that a peer
which cannot run a case says why instead of crashing the run, that the error column
catches wrong results, and that the committed H200 JSON still renders as before.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from ffpa_jax.bench import cases, cli, measure as M, peers, report
from ffpa_jax.bench.cases import BenchCase, make_case

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"


def _plan(*argv: str, on_gpu: bool = False) -> list[BenchCase]:
    return cli.select_cases(cli.build_parser().parse_args(list(argv)), on_gpu)


def _key(c: BenchCase) -> tuple:
    return (c.kind, c.d, c.b, c.hq, c.hkv, c.t, c.s, c.causal, c.dropout, c.mode)


# ---------------------------------------------------------------- what is measured
def test_flops_and_bytes():
    c = BenchCase(b=4, t=4096, s=4096, hq=32, hkv=32, d=128, dv=128)
    assert c.flops() == 4 * 4 * 32 * 4096 * 4096 * 128
    assert dataclasses.replace(c, causal=True).flops() == c.flops() / 2
    assert dataclasses.replace(c, mode="fwdbwd").flops() == 3.5 * c.flops()
    assert dataclasses.replace(c, dv=64).flops() == 4 * 4 * 32 * 4096 * 4096 * 96
    dec = make_case("decode", d=128, n=8192, b=8, h=32, kv_heads=8)
    assert (dec.t, dec.s, dec.hkv, dec.mode) == (1, 8192, 8, "fwd")
    assert dec.flops() == 4 * 8 * 32 * 1 * 8192 * 128
    # bf16: q and out [8, 1, 32, 128], k and v [8, 8192, 8, 128]
    assert dec.min_bytes() == 2 * (2 * 8 * 32 * 128 + 2 * 8 * 8192 * 8 * 128)
    assert dataclasses.replace(c, mode="fwdbwd").min_bytes() is None


def test_gpu_preset_covers_the_target_shapes():
    planned = {_key(c) for c in _plan("--preset", "gpu")}
    both = ("fwd", "fwdbwd")
    for d in (64, 128):
        for mode in both:
            assert ("self", d, 4, 32, 32, 4096, 4096, False, 0.0, mode) in planned
            assert ("causal", d, 4, 32, 32, 4096, 4096, True, 0.0, mode) in planned
    for mode in both:
        assert ("self", 256, 1, 32, 32, 4096, 4096, False, 0.0, mode) in planned
        for d in (512, 1024):
            for n in (4096, 16384):
                assert ("self", d, 1, 32, 32, n, n, False, 0.0, mode) in planned
        # dropout p=0.1 and the same shapes without dropout, for the ratio
        for d, b in ((128, 4), (512, 1)):
            assert ("dropout", d, b, 32, 32, 4096, 4096, False, 0.1, mode) in planned
            assert ("self", d, b, 32, 32, 4096, 4096, False, 0.0, mode) in planned
        assert ("non-aligned", 128, 1, 32, 32, 8191, 8191, False, 0.0, mode) in planned
    assert ("decode", 128, 8, 32, 8, 1, 8192, False, 0.0, "fwd") in planned
    assert ("decode", 512, 8, 32, 8, 1, 131072, False, 0.0, "fwd") in planned
    assert not any(k[0] == "decode" and k[-1] == "fwdbwd" for k in planned)
    assert {k[0] for k in planned} == set(cases.KINDS)
    # issue 24's paged decode: page sizes 16 and 64 at S=8192, GQA 32/8, D=128, B=8
    pages = {c.page for c in _plan("--preset", "gpu") if c.kind == "paged-decode"
             and _key(c) == ("paged-decode", 128, 8, 32, 8, 1, 8192, False, 0.0, "fwd")}
    assert pages == {16, 64}
    assert len({(*_key(c), c.page) for c in _plan("--preset", "gpu")}) == len(
        _plan("--preset", "gpu"))  # no duplicates


def test_case_filter_quick_and_the_first_cli_flags():
    picked = _plan("--preset", "gpu", "--case", "decode,dropout")
    assert {c.kind for c in picked} == {"decode", "dropout"}
    quick = _plan("--preset", "gpu", "--quick", "--mode", "fwd")
    assert sorted(c.kind for c in quick) == sorted([*cases.KINDS, "self"])  # + D=512 self
    assert {c.kind for c in _plan("--quick")} == set(cases.KINDS)  # CPU preset, every kind
    # The first CLI's grid flags give the same problems, under the same labels, as the
    # committed files they produced.
    old = json.loads((DATA / "bench_gqa_H200_2026-11-21.json").read_text())
    grid = _plan("--headdims", "128", "--seqlens", "8192", "--heads", "32", "--kv-heads", "8",
                 "--mode", "fwdbwd")
    assert [c.label for c in grid] == [old["records"][0]["case"]]
    old = json.loads((DATA / "bench_large_fwdbwd_H200_2026-11-21.json").read_text())
    grid = _plan("--headdims", "512,1024", "--seqlens", "4096,16384", "--mode", "fwdbwd")
    assert [c.label for c in grid] == [r["case"] for r in old["records"] if r["impl"] == "ffpa"]
    assert all(c.causal for c in _plan("--headdims", "64", "--causal"))
    cross = _plan("--headdims", "64", "--seqlens", "1024", "--case", "cross", "--mode", "fwd")
    assert [(c.t, c.s) for c in cross] == [(1024, 512)]
    with pytest.raises(SystemExit):
        _plan("--case", "selff")


# ---------------------------------------------------------------- peers and statuses
@pytest.mark.parametrize("peer,kind,interpret,why", [
    ("pallas-mha", "gqa", False, "GQA"),
    ("pallas-mha", "attn-mask", False, "mask"),
    ("pallas-mha", "bias-grad", False, "bias"),
    ("pallas-mha", "dropout", False, "dropout"),
    ("cudnn", "dropout", False, "dropout"),
    ("cudnn", "self", True, "GPU"),
    ("pallas-mgpu", "self", True, "Hopper"),
    ("pallas-mgpu", "attn-mask", False, "mask"),
    ("pallas-mgpu", "self", False, "float16 only"),
    ("pallas-decode", "self", False, "T must be 1"),
    ("tokamax-mosaic", "self", True, "NVIDIA GPU"),
    ("tokamax-triton", "dropout", False, "no dropout"),
    ("tokamax-mosaic", "packed", False, "segment ids"),
])
def test_peers_say_why_they_decline(peer, kind, interpret, why):
    case = make_case(kind, d=64, n=128, b=1, h=4)
    with pytest.raises(peers.Unsupported, match=why):
        peers.PEERS[peer].make(case, interpret)


def test_tokamax_rows_say_when_it_is_not_installed():
    if importlib.util.find_spec("tokamax") is not None:
        pytest.skip("tokamax is installed here")
    case = make_case("self", d=64, n=128, b=1, h=4)
    for name in peers.TOKAMAX_IMPLEMENTATIONS:
        with pytest.raises(peers.Unsupported, match="not installed"):
            peers.PEERS[f"tokamax-{name}"].make(case, False)


def test_pallas_mha_declines_a_cross_backward():
    # its fused backward raises for T != S; the bench must say so, not record an error
    case = dataclasses.replace(make_case("cross", d=64, n=256, b=1, h=2), mode="fwdbwd")
    with pytest.raises(peers.Unsupported, match="same number of blocks"):
        peers.PEERS["pallas-mha"].make(case, False)
    peers.PEERS["pallas-mha"].make(dataclasses.replace(case, mode="fwd"), False)


def test_cli_names_a_shape_the_cases_cannot_take(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--case", "gqa", "--heads", "6", "--kv-heads", "4", "--list"])
    assert "heads 6 is not a multiple of kv heads 4" in capsys.readouterr().err


def test_cudnn_declines_top_left_causal_for_t_not_s():
    case = dataclasses.replace(make_case("cross", d=64, n=128, b=1, h=2), causal=True)
    with pytest.raises(peers.Unsupported, match="top-left"):
        peers.PEERS["cudnn"].make(case, False)


def _impl(name, make):
    return peers.Impl(name, make)


def _measure(case, impl):
    return M.measure(case, impl, interpret=True, min_rep_s=0.0, reps=1)


def test_a_forced_tier_that_cannot_run_here_is_unsupported_with_the_reason():
    """The dispatcher's refusal of a forced tier (mosaic without an sm90 GPU, here on the CPU)
    is the row's reason, not an error."""
    if jax.default_backend() == "gpu":
        pytest.skip("checks the rows of a machine without an sm90 GPU")
    record = _measure(make_case("self", d=32, n=32, b=1, h=1), peers.PEERS["ffpa-mosaic"])
    assert record["status"].startswith("unsupported: implementation='mosaic' needs an sm90 GPU")


def test_failures_become_statuses_not_crashes():
    case = make_case("self", d=32, n=32, b=1, h=1)

    def declines(case, interpret):
        raise peers.Unsupported("cannot do this")

    def not_implemented(case, interpret):
        def run(q, k, v, bias, mask, rng):
            raise NotImplementedError("dropout is not implemented")
        return run

    def crashes(case, interpret):
        def run(q, k, v, bias, mask, rng):
            raise RuntimeError("boom\nsecond line")
        return run

    assert _measure(case, _impl("a", declines))["status"] == "unsupported: cannot do this"
    assert (_measure(case, _impl("b", not_implemented))["status"]
            == "unsupported: dropout is not implemented")
    assert _measure(case, _impl("c", crashes))["status"] == "error: RuntimeError: boom"


# ---------------------------------------------------------------- the measurement itself
def test_ffpa_interpret_forward_backward_record():
    case = make_case("gqa", d=64, n=64, b=2, h=4, kv_heads=2, mode="fwdbwd")
    r = _measure(case, peers.FFPA)
    assert r["status"] == "ok", r["status"]
    assert r["error"] < 1e-2 and r["error_dq"] < 2e-2 and not r["suspect"]
    assert r["ms"] > 0 and r["tflops"] > 0 and r["gbps"] is None
    assert 0 < r["compile_s"] <= r["first_call_s"]
    # q, k, v, do and out, dq, dk, dv are all live in the compiled call
    assert r["peak_mib"] * 2**20 >= 2 * 2 * (2 * 64 * 4 * 64 + 2 * 64 * 2 * 64) * 2


def _xla_forward(case, q, k, v, bias, mask):
    return jax.nn.dot_product_attention(q, k, v, bias=bias,
                                        mask=None if mask is None else mask[None, None],
                                        is_causal=case.causal, implementation="xla")


def test_error_column_catches_wrong_results():
    case = make_case("gqa", d=32, n=64, b=2, h=4, kv_heads=2)

    def right(case, interpret):
        return lambda q, k, v, bias, mask, rng: _xla_forward(case, q, k, v, bias, mask)

    def tiled_heads(case, interpret):  # query head h reads kv head h % Hkv, not h // G
        def run(q, k, v, bias, mask, rng):
            g = case.hq // case.hkv
            return _xla_forward(case, q, jnp.tile(k, (1, 1, g, 1)), jnp.tile(v, (1, 1, g, 1)),
                                bias, mask)
        return run

    def last_row_dropped(case, interpret):
        def run(q, k, v, bias, mask, rng):
            return _xla_forward(case, q, k, v, bias, mask).at[:, -1].set(0)
        return run

    def nan_out(case, interpret):
        def run(q, k, v, bias, mask, rng):
            return _xla_forward(case, q, k, v, bias, mask).at[0, 0, 0, 0].set(jnp.nan)
        return run

    good = _measure(case, _impl("right", right))
    assert good["status"] == "ok" and good["error"] < 1e-2 and not good["suspect"]
    wrong = _measure(case, _impl("tiled", tiled_heads))
    assert wrong["status"] == "ok" and wrong["error"] > 0.05 and wrong["suspect"]
    # the sample holds every (T // 64)-th row: at T = 64 every row, the last one included
    dropped = _measure(case, _impl("dropped", last_row_dropped))
    assert dropped["error"] > 0.05 and dropped["suspect"]
    nan = _measure(case, _impl("nan", nan_out))
    assert np.isnan(nan["error"]) and nan["suspect"]


def test_dq_error_catches_a_wrong_gradient():
    case = make_case("self", d=32, n=64, b=1, h=2, mode="fwdbwd")

    @jax.custom_vjp
    def attend(q, k, v):
        return _xla_forward(case, q, k, v, None, None)

    def attend_fwd(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: _xla_forward(case, q, k, v, None, None), q, k, v)
        return out, vjp

    def attend_bwd(vjp, d_out):
        dq, dk, dv = vjp(d_out)
        return 2 * dq, dk, dv  # a wrong dq

    attend.defvjp(attend_fwd, attend_bwd)
    r = _measure(case, _impl("bad-dq", lambda c, i: lambda q, k, v, b, m, rng: attend(q, k, v)))
    assert r["status"] == "ok" and r["error"] < 1e-2 and r["error_dq"] > 0.3 and r["suspect"]


def test_dbias_error_catches_a_wrong_bias_gradient():
    case = make_case("bias-grad", d=32, n=64, b=1, h=2, mode="fwdbwd")

    @jax.custom_vjp
    def attend(q, k, v, bias):
        return _xla_forward(case, q, k, v, bias, None)

    def attend_fwd(q, k, v, bias):
        return jax.vjp(lambda *a: _xla_forward(case, *a, None), q, k, v, bias)

    def attend_bwd(vjp, d_out):
        dq, dk, dv, dbias = vjp(d_out)
        return dq, dk, dv, dbias.at[:, :, -1].multiply(3)  # the last query row's dbias wrong

    attend.defvjp(attend_fwd, attend_bwd)
    bad = _measure(case, _impl("bad-dbias",
                               lambda c, i: lambda q, k, v, b, m, rng: attend(q, k, v, b)))
    assert bad["status"] == "ok" and bad["error_dq"] < 1e-2
    assert bad["error_dbias"] > 0.3 and bad["suspect"]
    ours = _measure(case, peers.FFPA)
    assert ours["status"] == "ok" and ours["error_dbias"] < 1e-2 and not ours["suspect"]
    # more than one batch: a [1, H, T, S] bias's gradient sums the batches' rows, which the
    # sample does not hold, so no dbias error is claimed
    two = _measure(dataclasses.replace(case, b=2), peers.FFPA)
    assert two["status"] == "ok" and two["error_dbias"] is None


def test_dropout_row_runs_or_says_why():
    case = make_case("dropout", d=32, n=64, b=1, h=2)
    r = _measure(case, peers.FFPA)
    if r["status"].startswith("unsupported"):
        assert "dropout" in r["status"]
    else:
        assert r["status"] == "ok", r["status"]
        assert r["error"] < 1e-2 and not r["suspect"]  # same keep-mask as ffpa_jax.dropout_mask


@pytest.mark.skipif(not hasattr(ffpa_jax, "dropout_mask"), reason="no ffpa_jax.dropout_mask yet")
def test_dropout_error_catches_another_keep_mask():
    case = make_case("dropout", d=32, n=64, b=1, h=2)

    def other_key(case, interpret):
        def run(q, k, v, bias, mask, rng):
            return ffpa_jax.attention(q, k, v, dropout_rate=case.dropout,
                                      dropout_rng=jax.random.fold_in(rng, 1), implementation="xla")
        return run

    r = _measure(case, _impl("other-key", other_key))
    assert r["status"] == "ok" and r["error"] > 0.05 and r["suspect"]


# ---------------------------------------------------------------- the CLI, end to end
@pytest.mark.slow  # the CLI end to end: CI runs it (`pytest -m slow`)
def test_context_parallel_rows_split_the_sequence_over_four_devices(tmp_path):
    """The context-parallel kind on 4 fake CPU devices (zigzag): ffpa's row runs the split
    call (its error column, against float64 in sequence order, matches the one-device
    yardstick's), only ffpa-one-device is its peer, and the label says how it split."""
    import subprocess
    import sys

    from fake_devices import fake_devices_env
    out = tmp_path / "cp.json"
    run = subprocess.run([sys.executable, "-m", "ffpa_jax.bench", "--case", "context-parallel",
                          "--mode", "fwd", "--reps", "1", "--json", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
                         env=fake_devices_env(4))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    recs = {r["impl"]: r for r in json.loads(out.read_text())["records"]}
    assert set(recs) == {"ffpa", "ffpa-one-device"}, recs.keys()
    split, whole = recs["ffpa"], recs["ffpa-one-device"]
    assert split["status"] == "ok" and whole["status"] == "ok", (split, whole)
    assert "cp4-zigzag" in split["case"] and split["devices"] == 4
    assert split["error"] < 1e-2 and abs(split["error"] - whole["error"]) < 1e-3


@pytest.mark.slow  # the CLI end to end: CI runs it (`pytest -m slow`)
def test_cli_on_cpu_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = cli.main(["--case", "self,decode", "--quick", "--mode", "fwd",
                   "--peers", "xla,cudnn,pallas-mha,pallas-decode", "--json", str(out),
                   "--plot", str(png)])
    captured = capsys.readouterr()
    printed = captured.out
    assert rc == 0
    assert cli.CPU_NOTE in " ".join(printed.split())  # wrapped to the width
    _check_cpu_text(printed, captured.err)
    doc = json.loads(out.read_text())
    assert doc["format"] == report.FORMAT and doc["header"]["cpu_fallback"] is True
    recs = {(r["kind"], r["mode"], r["impl"]): r for r in doc["records"]}
    assert len(recs) == len(doc["records"])
    # pallas-decode only gets decode rows
    decode_impls = ("ffpa", "xla", "cudnn", "pallas-mha", "pallas-decode")
    assert set(recs) == ({("self", "fwd", i) for i in ("ffpa", "xla", "cudnn", "pallas-mha")}
                         | {("decode", "fwd", i) for i in decode_impls})
    assert recs[("decode", "fwd", "pallas-mha")]["status"].startswith("unsupported: no GQA")
    assert all(r["status"] == "ok" for (k, _, i), r in recs.items()
               if i != "cudnn" and (k, i) != ("decode", "pallas-mha"))
    assert all("GPU" in r["status"] for (_, _, i), r in recs.items() if i == "cudnn")
    # the Pallas kernels ran in the interpreter here; XLA's path did not
    assert {i for (_, _, i), r in recs.items() if r["interpreted"]} == {
        "ffpa", "pallas-mha", "pallas-decode"}
    assert recs[("decode", "fwd", "ffpa")]["gbps"] > 0
    assert recs[("self", "fwd", "ffpa")]["speedup"].keys() == {"xla", "pallas-mha"}
    assert png.read_bytes()[:4] == b"\x89PNG"
    # the plot draws every kind the run measured, not only "self": one seqlen per kind
    # here, so a bar per ok record, grouped by case
    ok = [r for r in doc["records"] if r["status"] == "ok"]
    fig = report.plot_tflops(doc["records"], kinds=None)
    (ax,) = fig.axes
    assert ax.get_title() == "forward"
    assert sorted(p.get_height() for p in ax.patches) == sorted(r["tflops"] for r in ok)
    labels = [t.get_text().split("\n")[0] for t in ax.get_xticklabels()]
    assert labels == ["self", "decode"]
    # several seqlens of one kind: a line per implementation against seqlen
    sweep = [dict(r, t=r["t"] * 2, s=r["s"] * 2, tflops=r["tflops"] + 1) for r in ok
             if r["kind"] == "self"] + [r for r in ok if r["kind"] == "self"]
    fig = report.plot_tflops(sweep, kinds=None)
    lines = {line.get_label(): list(line.get_xdata()) for ax in fig.axes
             for line in ax.get_lines()}
    n = next(r["t"] for r in ok if r["kind"] == "self")
    assert lines == {r["impl"]: [n, 2 * n] for r in ok if r["kind"] == "self"}
    # the new file renders through the docs script
    table = _docs_script().render_format2(out, plot_dir=None)
    assert table.count("\n| ") == 1 + len(doc["records"])  # the header, one row per record


def _check_cpu_text(printed: str, progress: str) -> None:
    """The CPU run's text (a self and a decode case, forward; peers xla, cudnn, pallas-mha,
    pallas-decode) as a new user reads it."""
    lines = printed.splitlines()
    assert max(map(len, lines)) <= 100 and max(map(len, progress.splitlines())) <= 100
    head = next(line for line in lines if line.lstrip().startswith("impl"))
    columns = head.split()
    assert columns == ["impl", "ms", "err", "dq", "err", "peak", "MiB", "comp", "s"]
    # ...each of them explained, with its unit, in the legend
    legend = lines[lines.index("Columns:"):]
    for name in ("ms", "err", "dq err", "peak MiB", "comp s"):
        assert any(line.split(maxsplit=1)[0] == name.split()[0] and name in line
                   for line in legend), name
    assert any("milliseconds" in line for line in legend)
    assert any(line.startswith("  i ") and "interpreter" in line for line in legend)
    # the interpreted rows say so; the XLA row does not
    rows = {line.split()[0]: line for line in lines[:lines.index("Columns:")]
            if line.startswith("  ") and line.split()[0] in ("ffpa", "xla", "pallas-decode")}
    assert rows["ffpa"].split()[2] == "i" and rows["pallas-decode"].split()[2] == "i"
    assert rows["xla"].split()[2] != "i"
    # no TF/s (0.0 on a CPU), no comparison of interpreted and compiled times
    assert "TF/s" not in head and "faster" not in printed and "slower" not in printed
    assert "speedup" not in printed and not any(w.startswith("x0.") for w in printed.split())
    # the GPU-only peer is named once, with its reason; the case-specific decline as a note
    assert printed.count("cudnn") == 1
    assert "\n  cudnn: cuDNN needs an NVIDIA GPU" in printed
    assert "  not run: pallas-mha [1]" in lines
    assert "  [1] pallas-mha declined: no GQA/MQA in JAX's Pallas mha (Hq must equal Hkv)" in lines
    assert "dropout" not in printed  # no dropout case here, and never a finding from CPU times


def _rec(case: str, impl: str, ms: float | None = None, **kw) -> dict:
    r = {"case": case, "kind": "self", "impl": impl, "status": "ok" if ms else kw.pop("status"),
         "ms": ms, "tflops": 1.0, "gbps": None, "error": 1e-3, "error_dq": None,
         "peak_mib": 10.0, "compile_s": 0.5, "interpreted": False, **kw}
    return r


def _block(lines: list[str], title: str) -> dict[str, str]:
    """{impl: row} of the case that starts at the line `title`."""
    rows = {}
    for line in lines[lines.index(title) + 1:]:
        if not line.startswith("  "):
            break
        rows[line.split()[0]] = line
    return rows


def test_text_table_on_a_gpu_says_faster_or_slower_and_fits_100_columns():
    long_reason = "error: ValueError: " + "a long message from a peer's kernel " * 6
    records = [
        _rec("A", "ffpa", 2.0, tier="chunked/pallas"),
        _rec("A", "xla", 5.0),          # ffpa takes 2/5 of its time
        _rec("A", "cudnn", 1.6),        # ffpa takes 1.25 times as long
        _rec("A", "pallas-mha", 2.0),
        _rec("A", "pallas-mgpu", status="unsupported: float16 only"),
        _rec("B", "ffpa", 3.0, error_dbias=2e-3, suspect=True, error_note="x" * 60),
        _rec("B", "xla", 3.0),
        _rec("B", "cudnn", status=long_reason),
        _rec("B", "pallas-mha", status="unsupported: has no dropout"),
        _rec("B", "pallas-mgpu", status="unsupported: float16 only"),
    ]
    text = report.text_table(records, gpu=True)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 100
    assert lines[0].split() == ["impl", "ms", "TF/s", "GB/s", "err", "dq", "err", "peak", "MiB",
                                "comp", "s", "ffpa", "is"]
    a = _block(lines, "self: A   (ffpa tier chunked/pallas)")
    assert a["xla"].endswith("  2.50x faster")
    assert a["cudnn"].endswith("  1.25x slower")
    assert a["pallas-mha"].endswith("  as fast")
    assert "ffpa is" not in a["ffpa"] and not a["ffpa"].endswith("x")
    b = _block(lines, "self: B")
    assert b["xla"].endswith("  as fast")
    assert b["cudnn"].split()[1:] == ["error", "[2]"]
    assert b["not"] == "  not run: pallas-mha [3]"  # notes are numbered as they come
    assert "  [3] pallas-mha declined: has no dropout" in lines
    assert "Not run in any case of this run:" in lines and "  pallas-mgpu: float16 only" in lines
    assert text.count("pallas-mgpu") == 1  # once, not once per case
    # the notes of ffpa's row B do not fit on it: a numbered note holds them
    assert b["ffpa"].endswith("  [1]")
    assert ("[1] ffpa, self: B: dbias 2.0e-03 WRONG? no error: " + "x" * 60
            in " ".join(text.split()))
    assert any(line.startswith("  [2] cudnn: error: ValueError: a long message") for line in lines)
    # a short note stays on its row
    short = report.text_table([_rec("C", "ffpa", 1.0, error_dbias=2e-3)], gpu=True)
    assert short.splitlines()[-1].endswith("  dbias 2.0e-03")


def test_text_table_without_gpu_and_the_legends():
    records = [_rec("A", "ffpa", 2.0, interpreted=True), _rec("A", "xla", 1.0)]
    lines = report.text_table(records, gpu=False).splitlines()
    assert lines[0].split() == ["impl", "ms", "err", "dq", "err", "peak", "MiB", "comp", "s"]
    assert lines[3].split()[:3] == ["ffpa", "2.000", "i"]
    assert lines[4].split()[:3] == ["xla", "1.000", "1.0e-03"]
    for gpu in (True, False):
        head = report.text_table(records, gpu=gpu).splitlines()[0]
        legend = report.legend(gpu=gpu, interpreted_rows=not gpu)
        assert max(map(len, legend.splitlines())) <= 100
        names = ["ms", "TF/s", "GB/s", "err", "dq err", "peak MiB", "comp s", "ffpa is"]
        for name in names:
            explained = any(line[2:].startswith(name + " ") for line in legend.splitlines())
            assert explained == (name in head), name
    assert "higher is better" in report.legend(gpu=True)
    assert report.legend(gpu=True).count("lower is better") >= 4


def test_dropout_cost_is_never_read_from_interpreted_times():
    base = dict(kind="dropout", dropout=0.1, dropout_overhead=8.25)
    records = [_rec("A", "ffpa", 3.0, interpreted=True, **base), _rec("A", "xla", 2.0, **base)]
    assert report.dropout_lines(records) == [
        "dropout 0.1: xla takes 8.25x the time without dropout (A)"]


# ---------------------------------------------------------------- committed data and docs
def _docs_script():
    spec = importlib.util.spec_from_file_location("make_docs_tables",
                                                  ROOT / "scripts" / "make_docs_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_first_format_files_still_load_and_render():
    files = sorted(DATA.glob("bench_*.json"))
    assert files
    docs = [report.load(p) for p in files]
    assert any(doc["format"] == 1 for doc in docs)  # the session-1 files
    for doc in docs:
        assert doc["format"] in (1, 2) and doc["records"]
        assert all(r["kind"] in cases.KINDS for r in doc["records"])
        assert report.markdown_table(doc).count("\n| ") == 1 + len(doc["records"])
    merged = {(r["case"], r["impl"]): r for r in report.merge(docs, device="NVIDIA H200")}
    # the newest H200 measurement of a case wins: session 48's run (2026-11-28) over
    # session 47's, 46's and 45's of the same day, session 25's pairs run (2026-11-26), the tiers' run of
    # 2026-11-25, the seqlen sweep of 2026-11-22 06:21, the preset run of 00:29, the repeat
    # run of 2026-11-21 12:58 and the 12:30 follow-up, which measured it too (an H100
    # record of the same case replaces none of them)
    sources = {pathlib.Path(doc["path"]).name for doc in docs
               if any(r["case"] == "D=512 B=1 H=32 N=4096 bf16 fwdbwd" for r in doc["records"])}
    assert {"bench_repeat2_large_fwdbwd_H200_2026-11-21.json",
            "bench_large_fwdbwd_H200_2026-11-21.json"} <= sources
    newest = merged[("D=512 B=1 H=32 N=4096 bf16 fwdbwd", "ffpa")]
    assert newest["source"] == "bench_H200_2026-11-28_s48_d512.json"
    assert "bench_H200_2026-11-28_s47_d512.json" in sources
    assert "bench_H200_2026-11-28_s46_d512.json" in sources
    assert "bench_H200_2026-11-28_s45_d512.json" in sources
    assert "bench_H200_2026-11-26_s25_d512_pairs.json" in sources
    assert "bench_H200_2026-11-25_large_d.json" in sources
    h100 = report.merge(docs, device="NVIDIA H100 80GB HBM3")
    assert h100 and {r["source"] for r in h100} <= {p.name for p in DATA.glob("bench_H100_*")}
    # the newest re-run of the same cases (session 23's, after the recheck of 2026-11-25)
    # replaces the earlier H100 records' rows (per implementation)
    assert {r["source"] for r in h100 if r["case"] == "D=512 B=1 H=32 N=4096 bf16 fwdbwd"
            and r["impl"] in ("ffpa", "xla")} == {"bench_H100_2026-11-26_s23_d512.json"}
    assert "bench_H200_2026-11-22_self_causal.json" in sources
    kinds = {r["kind"] for r in merged.values()}
    assert {"self", "gqa", "attn-mask"} <= kinds
    # docs/benchmarks.md's main table is still what the renderer makes of the committed file
    table = _docs_script().bench_table(DATA / "bench_H200_2026-11-21.json")
    assert table in (ROOT / "docs" / "benchmarks.md").read_text()


def test_gemma_table_is_what_the_renderer_makes_of_the_committed_runs():
    table = _docs_script().gemma_table(DATA / "gemma_like_H100_2026-11-26.json")
    assert "| 32K | jax.nn | 1 | OOM |" in table
    assert table in (ROOT / "docs" / "benchmarks.md").read_text()


def test_benchmarks_notebook_is_committed_executed():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(ROOT / "notebooks" / "02_benchmarks.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.get("execution_count") for c in code)
    outputs = [o for c in code for o in c.get("outputs", [])]
    assert not any(o.get("output_type") == "error" for o in outputs)
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # TF/s against seqlen, and memory
    assert any("docs" in c.source and "data" in c.source for c in code)
    # the ratio table's header names every peer as a word of its own
    texts = [o.get("text", "") for o in outputs]
    header = next(line for text in texts for line in text.splitlines()
                  if line.startswith("kind ") and "ffpa ms" in line)
    assert header.split()[5:] == ["cudnn", "xla", "pallas-mha", "pallas-mgpu", "pallas-decode"]


def test_bench_help_fits_100_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps what it may; the rest is ours
    text = cli.build_parser().format_help()
    assert "--case" in text and max(map(len, text.splitlines())) <= 100


def _outside_parentheses(text: str) -> str:
    depth, kept = 0, []
    for ch in text:
        depth += ch == "("
        if depth == 0:
            kept.append(ch)
        depth -= ch == ")"
    return "".join(kept)


def test_bench_help_describes_every_case_kind():
    """--help's paragraph of case kinds names each kind of `cases.KINDS`, in that order."""
    text = cli.build_parser().format_help()
    start = text.index("Case kinds (--case): ") + len("Case kinds (--case): ")
    paragraph = " ".join(text[start:text.index(" With no shape option", start)].split())
    named = [name.strip() for name in _outside_parentheses(paragraph).rstrip(".").split(",")]
    assert named == list(cases.KINDS)


def test_decline_reasons_read_as_english():
    """Every reason a peer gives for not running a case (the run's footnotes): no "no a
    sliding window"."""
    reasons = set()
    for kind in cases.KINDS:
        case = make_case(kind, d=64, n=128, b=1, h=4)
        for impl in peers.PEERS.values():
            for interpret in (False, True):
                try:
                    impl.make(case, interpret)
                except peers.Unsupported as exc:
                    reasons.add(str(exc))
    assert any("sliding window" in r for r in reasons)  # the features' reasons are here
    bad = [r for r in reasons if re.search(r"\bno an? ", r)]
    assert not bad


@pytest.mark.parametrize("slow_s", [9.0, 12.3, 123.4])
def test_compile_summary_keeps_numbers_with_their_units(slow_s):
    """Whatever the length of the slowest case's label, no line of the summary starts with
    the unit of a number that ended the line before ("s target" alone on a line)."""
    unit_first = re.compile(r"^(s|ms|MiB|GiB)\b")
    for n in range(120):  # labels of every length modulo the width's
        label = " ".join(["D64"] * (n // 4) + ["x" * (n % 4 + 1)])
        records = [{"impl": "ffpa", "kind": "self", "case": label, "compile_s": slow_s},
                   {"impl": "ffpa", "kind": "causal", "case": "short", "compile_s": 1.0},
                   {"impl": "xla", "kind": "self", "case": "x", "compile_s": 99.0}]
        lines = report.compile_summary(records, 10.0)
        assert max(map(len, lines)) <= report.WIDTH
        assert " ".join(lines) == (
            f"ffpa trace+compile: at most {slow_s:.1f} s (self: {label}); "
            f"{int(slow_s > 10)} of 2 cases above the 10 s target")
        assert not any(unit_first.match(line) for line in lines[1:]), (n, lines)
    assert report.compile_summary([{"impl": "ffpa", "compile_s": None}], 10.0) == []


def test_wrap_keeps_comparisons_units_and_note_numbers_on_one_line():
    text = ("[2] pallas-mha declined: its fused backward needs T and S split into the same "
            "number of blocks (T == S), not run: pallas-mha [4], 4096 MiB, 10 s target")
    for width in range(30, 101):
        lines = report.wrap(text, width, subsequent_indent="    ")
        assert " ".join(line.strip() for line in lines) == text
        breaks = {(a.split()[-1], b.split()[0]) for a, b in zip(lines, lines[1:])}
        assert not breaks & {("(T", "=="), ("==", "S),"), ("pallas-mha", "[4],"),
                             ("4096", "MiB,"), ("10", "s")}, (width, lines)


# ---------------------------------------------------------------- language-model features
def test_feature_kinds_count_their_visible_pairs():
    packed = make_case("packed", d=128, n=4096, b=4, h=32)
    assert packed.causal and packed.segments == cases.PACKED_SEGMENTS
    seg = 4096 // cases.PACKED_SEGMENTS
    assert packed.visible_pairs() == cases.PACKED_SEGMENTS * seg * (seg + 1) // 2
    window = make_case("window", d=128, n=4096, b=4, h=32)
    assert window.causal and window.window == cases.MAX_WINDOW
    w = cases.MAX_WINDOW
    assert window.visible_pairs() == sum(min(i, w) + 1 for i in range(4096))
    assert window.flops() == 2.0 * 4 * 32 * window.visible_pairs() * 256
    soft = make_case("softcap", d=128, n=4096, b=4, h=32)
    assert soft.softcap == cases.SOFT_CAP and soft.flops() == 4 * 4 * 32 * 4096 * 4096 * 128
    assert f"packed{cases.PACKED_SEGMENTS}" in packed.label and "window1024" in window.label
    assert "softcap50" in soft.label


@pytest.mark.parametrize("kind", ["packed", "window", "softcap"])
def test_feature_kinds_measure_against_float64(kind):
    """ffpa (the fused kernels, interpreted) and the XLA peer (jax.nn with a dense mask or
    its window; ffpa's XLA path for the cap) meet the float64 rows check."""
    case = dataclasses.replace(make_case(kind, d=32, n=64, b=2, h=2), mode="fwdbwd")
    for impl in (peers.FFPA, peers.PEERS["xla"]):
        r = _measure(case, impl)
        assert r["status"] == "ok" and not r["suspect"], r
        assert r["error"] < 1e-2 and r["error_dq"] < 1e-2, r
    assert _measure(case, peers.FFPA)["tier"] == "pallas/pallas"


@pytest.mark.parametrize("peer,kind,why", [
    ("cudnn", "packed", "segment ids"), ("cudnn", "softcap", "soft cap"),
    ("pallas-mha", "window", "window"), ("pallas-mgpu", "packed", "segment ids"),
    ("naive-chunked", "softcap", "soft cap"),
])
def test_peers_decline_the_features_they_lack(peer, kind, why):
    case = make_case(kind, d=64, n=128, b=1, h=4)
    with pytest.raises(peers.Unsupported, match=why):
        peers.PEERS[peer].make(case, False)


def test_paged_decode_rows_run_on_the_same_values_as_the_contiguous_cache():
    """The paged case's pages hold exactly k and v's values under the shuffled table; ffpa
    (paged), ffpa-contiguous and JAX's paged attention run it (interpreted here) and match
    the float64 reference; peers that read no page table have no row."""
    case = make_case("paged-decode", d=64, n=256, b=2, h=4, kv_heads=2, page=16)
    inputs = M.make_inputs(case)
    k_pages, v_pages, table, lengths = inputs["pages"]
    assert k_pages.shape == (2, 2 * 256 // 16, 16, 64)
    assert np.array_equal(np.sort(np.asarray(table).ravel()), np.arange(32))
    assert not np.array_equal(np.asarray(table).ravel(), np.arange(32))  # really shuffled
    k, t = np.asarray(inputs["k"], np.float32), np.asarray(table)
    for b, j in ((0, 0), (1, 37), (1, 255)):
        np.testing.assert_array_equal(np.asarray(k_pages, np.float32)[:, t[b, j // 16], j % 16],
                                      k[b, j])
    np.testing.assert_array_equal(np.asarray(lengths), [256, 256])
    for impl in (peers.FFPA, peers.PEERS["ffpa-contiguous"], peers.PEERS["pallas-paged"]):
        record = _measure(case, impl)
        assert record["status"] == "ok", (impl.name, record["status"])
        assert record["error"] < 1e-2, (impl.name, record["error"])
    assert not any(p.runs_kind("paged-decode") for name, p in peers.PEERS.items()
                   if name not in ("ffpa-contiguous", "pallas-paged"))
    assert not peers.PEERS["ffpa-contiguous"].runs_kind("decode")


@pytest.mark.parametrize("mode,want", [("fwd", "mosaic"), ("fwdbwd", "chunked/chunked")])
def test_the_tier_column_names_a_differentiated_calls_own_forward(mode, want, monkeypatch,
                                                                  tmp_path):
    """On an H200 (pretended: the column is the dispatcher's answer, nothing runs), D=512
    N=1024: the forward row ran the Mosaic kernel, the forward+backward row the chunked
    pair (the H200 file's tier_differentiated), and the column says so."""
    from pallas_kernels import compat
    from tuning import dispatch

    monkeypatch.setattr(compat, "mosaic_gpu_runs", lambda: True)
    monkeypatch.delenv("FFPA_SKIP_PERSIST_TUNED_CONFIG", raising=False)
    monkeypatch.setenv("FFPA_TUNED_CONFIG_DIR", str(tmp_path))  # empty: the packaged file
    h200 = dispatch.Device(nvidia_gpu=True, name="NVIDIA H200", compute_capability="9.0")
    monkeypatch.setattr(dispatch.Device, "current", classmethod(lambda cls: h200))
    case = make_case("self", d=512, n=1024, b=1, h=32, mode=mode)
    assert peers.FFPA.tiers(case, False) == want
