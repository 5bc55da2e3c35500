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
    assert len(planned) == len(_plan("--preset", "gpu"))  # no duplicates


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
])
def test_peers_say_why_they_decline(peer, kind, interpret, why):
    case = make_case(kind, d=64, n=128, b=1, h=4)
    with pytest.raises(peers.Unsupported, match=why):
        peers.PEERS[peer].make(case, interpret)


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
def test_cli_on_cpu_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = cli.main(["--case", "self,decode", "--quick", "--mode", "fwd",
                   "--peers", "xla,cudnn,pallas-decode", "--json", str(out), "--plot", str(png)])
    printed = capsys.readouterr().out
    assert rc == 0
    assert cli.CPU_NOTE in printed
    doc = json.loads(out.read_text())
    assert doc["format"] == report.FORMAT and doc["header"]["cpu_fallback"] is True
    recs = {(r["kind"], r["mode"], r["impl"]): r for r in doc["records"]}
    assert len(recs) == len(doc["records"])
    # pallas-decode only gets decode rows
    decode_impls = ("ffpa", "xla", "cudnn", "pallas-decode")
    assert set(recs) == ({("self", "fwd", i) for i in ("ffpa", "xla", "cudnn")}
                         | {("decode", "fwd", i) for i in decode_impls})
    assert all(r["status"] == "ok" for (_, _, i), r in recs.items() if i != "cudnn")
    assert all("GPU" in r["status"] for (_, _, i), r in recs.items() if i == "cudnn")
    assert recs[("decode", "fwd", "ffpa")]["gbps"] > 0
    assert recs[("self", "fwd", "ffpa")]["speedup"].keys() == {"xla"}
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
    assert "unsupported: cuDNN needs an NVIDIA GPU" in printed
    # the new file renders through the docs script
    table = _docs_script().render_format2(out, plot_dir=None)
    assert table.count("\n| ") == 1 + len(doc["records"])  # the header, one row per record


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
    # the newest H200 measurement of a case wins: the tiers' run of 2026-11-25 over the
    # seqlen sweep of 2026-11-22 06:21, the preset run of 00:29, the repeat run of
    # 2026-11-21 12:58 and the 12:30 follow-up, which measured it too (an H100 record of
    # the same case replaces none of them)
    sources = {pathlib.Path(doc["path"]).name for doc in docs
               if any(r["case"] == "D=512 B=1 H=32 N=4096 bf16 fwdbwd" for r in doc["records"])}
    assert {"bench_repeat2_large_fwdbwd_H200_2026-11-21.json",
            "bench_large_fwdbwd_H200_2026-11-21.json"} <= sources
    newest = merged[("D=512 B=1 H=32 N=4096 bf16 fwdbwd", "ffpa")]
    assert newest["source"] == "bench_H200_2026-11-25_large_d.json"
    h100 = report.merge(docs, device="NVIDIA H100 80GB HBM3")
    assert h100 and {r["source"] for r in h100} == {"bench_H100_2026-11-25_large_d.json"}
    assert "bench_H200_2026-11-22_self_causal.json" in sources
    kinds = {r["kind"] for r in merged.values()}
    assert {"self", "gqa", "attn-mask"} <= kinds
    # docs/benchmarks.md's main table is still what the renderer makes of the committed file
    table = _docs_script().bench_table(DATA / "bench_H200_2026-11-21.json")
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
