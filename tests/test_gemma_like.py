"""`python examples/gemma_like.py` as a new user runs it on a CPU (its "ci" preset): --help
lists the options with their defaults; a short run with ffpa_jax's Pallas kernels
(interpreted) prints its timings and what each layer kind ran, and passes the loss check,
which trains both attention choices and the float64 reference (the script exits 1 when the
check fails); a short run with jax.nn's attention; the sequence split over 4 (fake CPU)
devices gives one device's losses, and --json records the run. In process: the check fails for an
attention whose window is one token too wide; the tolerance rule on given losses; the
layer pattern and the partial RoPE."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

from example_runner import ROOT, run_example
from examples import gemma_like
from fake_devices import fake_devices_env

# An end-to-end run: outside the default suite; CI runs it (`pytest -m slow`).
pytestmark = pytest.mark.slow


def _run(*args: str):
    return run_example("gemma_like.py", *args)


def _check_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("  step ")]


def test_help_lists_the_options_and_their_defaults():
    run = _run("--help")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage: python examples/gemma_like.py")
    for option in ("--attention", "--seq-len", "--steps", "--layers", "--check",
                   "--check-steps", "--ffpa-implementation", "--interpret",
                   "--jaxnn-implementation", "--devices", "--json"):
        assert option in run.stdout
    text = " ".join(run.stdout.split())  # argparse wraps the help at the terminal's width
    assert "(default: ffpa)" in text
    assert "(default: gpu preset 8192, ci preset 64)" in text


def test_ffpa_on_the_interpreted_kernels_trains_and_passes_the_loss_check(tmp_path):
    record = tmp_path / "run.json"
    run = _run("--attention", "ffpa", "--ffpa-implementation", "pallas", "--interpret",
               "--steps", "3", "--check-steps", "1", "--json", str(record))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "model: 2 layers LG" in out
    assert out.count("attention: ffpa_jax pallas in both directions (interpreted)") == 2
    for report in ("trace and compile: ", "step time: median ", "tokens/s: ",
                   "peak device memory: n/a on CPU"):
        assert report in out, out
    assert "3/3 loss" in run.stderr  # the progress bar's last line
    steps = _check_lines(out)
    assert len(steps) == 1 and steps[0].endswith(" ok"), out
    assert "loss check: passed" in out
    check = json.loads(record.read_text())["loss_check"]
    assert check["passed"] is True and len(check["steps"]) == 1


def test_jaxnn_trains():
    run = _run("--attention", "jax.nn", "--steps", "2", "--no-check")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("attention: jax.nn implementation='xla' (no GPU)") == 2
    assert "step time: median " in run.stdout and "loss check" not in run.stdout


def test_the_sequence_split_over_four_devices_gives_one_devices_losses(tmp_path):
    """The ci preset at 64 tokens, 2 steps, on 4 fake CPU devices and on 1: the same losses
    (float32 rounding), and each run's --json record. (The loss check runs on one device
    whatever --devices says: the interpreted run's test covers it.)"""
    records, outputs = {}, {}
    for devices, layout in ((1, "zigzag"), (4, "zigzag"), (4, "contiguous")):
        path = tmp_path / f"run{devices}{layout}.json"
        run = subprocess.run([sys.executable, str(ROOT / "examples" / "gemma_like.py"),
                              "--devices", str(devices), "--seq-len", "64", "--steps", "2",
                              "--context-layout", layout, "--json", str(path), "--no-check"],
                             capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
                             env=fake_devices_env(4))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        records[devices, layout] = json.loads(path.read_text())
        outputs[devices, layout] = run.stdout
    for layout in ("zigzag", "contiguous"):
        assert (f"4 x cpu (cpu), the sequence sharded over the 4 devices ({layout})"
                in outputs[4, layout])
        assert records[4, layout]["context_layout"] == layout
    one, four, four_contiguous = records[1, "zigzag"], records[4, "zigzag"], records[
        4, "contiguous"]
    assert (one["devices"], four["devices"]) == (1, 4) and one["context_layout"] is None
    np.testing.assert_allclose(four["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(four_contiguous["losses"], one["losses"], rtol=1e-5)
    for record in (one, four, four_contiguous):
        assert record["tokens_per_s"] > 0 and len(record["step_s"]) == 1
        assert record["tokens_per_s_back_to_back"] > 0
        assert record["back_to_back_step_s"] > 0
        assert all(math.isfinite(loss) for loss in record["losses"])
        assert record["peak_memory_bytes"] is None and record["out_of_memory"] is False
        assert record["layer_attention"] == {"local": "ffpa_jax xla in both directions",
                                             "global": "ffpa_jax xla in both directions"}
    assert all(r["loss_check"] is None for r in (one, four, four_contiguous))


def test_profile_writes_a_trace_that_step_profile_sums(tmp_path):
    """--profile DIR traces three waited-for steps; scripts/step_profile.py reads the trace
    and sums its events per step (on a CPU only the host's)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import step_profile
    assert gemma_like.main(["--steps", "5", "--no-check", "--profile", str(tmp_path)]) == 0
    summary = step_profile.summarize(step_profile.trace_events(tmp_path), steps=3, top=50)
    host = [entry for name, entry in summary.items() if "host" in name.lower()]
    assert host and host[0]["events_per_step"], summary
    assert any("step" in name for name, _, _ in host[0]["events_per_step"]), host


def test_step_profile_busy_time_is_the_union_of_the_kernels():
    sys.path.insert(0, str(ROOT / "scripts"))
    import step_profile
    busy, gaps = step_profile.busy_and_gaps([(5, 12, "b"), (0, 10, "a"), (20, 25, "c"),
                                             (21, 22, "d")])
    assert busy == 17 and gaps == [(8, "b", "c")]


def test_an_out_of_memory_run_is_recorded(tmp_path):
    path = tmp_path / "oom.json"
    error = RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 1 bytes\nmore")
    code = gemma_like.out_of_memory_exit(error, "ffpa at 1 x 8 tokens", str(path),
                                         {"devices": 2})
    assert code == gemma_like.EXIT_OUT_OF_MEMORY
    record = json.loads(path.read_text())
    assert record["out_of_memory"] is True and record["devices"] == 2
    assert record["error"] == "RESOURCE_EXHAUSTED: Out of memory allocating 1 bytes"


def _tiny_config() -> gemma_like.GemmaLikeConfig:
    local, global_ = gemma_like.gemma4_kinds(heads_q=4, window=8)
    return gemma_like.GemmaLikeConfig(vocab=64, d_model=32, mlp_dim=64, layers=2, heads_q=4,
                                      local=local, global_=global_,
                                      ffpa_implementation="chunked")


def test_the_step_gives_its_outputs_back_in_the_buffers_it_was_given():
    # A CUDA graph re-records every command whose buffers moved since the last step: the
    # step's outputs (and what XLA placed in their buffers) must not move from step to step.
    import optax
    cfg = _tiny_config()
    graphdef, params = gemma_like.initial_params(cfg, gemma_like.float32_init(cfg, 0))
    tx = optax.adam(1e-3)
    leaves, treedef = jax.tree.flatten((params, tx.init(params)))
    step = gemma_like.make_train_step(graphdef, tx, treedef)
    tokens = gemma_like.synthetic_tokens(jax.random.key(1), batch=2, length=17, vocab=cfg.vocab)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    outputs = gemma_like.first_outputs(step, leaves, inputs, targets)
    # The first call may copy: the initial parameters share memory with host numpy arrays.
    leaves, outputs = step(leaves, outputs, inputs, targets)
    for _ in range(2):
        given = [x.unsafe_buffer_pointer() for x in jax.tree.leaves((leaves, outputs))]
        leaves, outputs = step(leaves, outputs, inputs, targets)
        assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves((leaves, outputs))] == given
    loss, per_token = outputs
    assert np.isfinite(float(loss)) and per_token.shape == (2, 16)
    np.testing.assert_allclose(float(loss), np.asarray(per_token, np.float64).mean(), rtol=1e-6)


def test_the_loss_check_fails_for_a_window_one_token_too_wide(monkeypatch):
    correct = gemma_like.attend

    def ffpa_sees_one_key_more(q, k, v, kind, cfg):
        if cfg.attention == "ffpa" and kind.window is not None:
            kind = dataclasses.replace(kind, window=kind.window + 1)
        return correct(q, k, v, kind, cfg)

    monkeypatch.setattr(gemma_like, "attend", ffpa_sees_one_key_more)
    cfg = _tiny_config()
    verdicts = gemma_like.check_losses(cfg, gemma_like.float32_init(cfg, 0),
                                       jax.random.key(0), steps=1, batch=2, seq_len=32)
    assert len(verdicts) == 1 and not verdicts[0].ok, verdicts
    # jax.nn stayed within the rounding of the reference; ffpa is far outside.
    assert verdicts[0].err_jaxnn < 1e-4 < verdicts[0].err_ffpa


def test_the_rule_is_twice_jaxnns_error_plus_four_ulps():
    ref = np.full((1, 2, 3), 5.0)
    ulp = gemma_like.ulp(5.0, np.float32)  # 2**-21
    judge = lambda ffpa, jaxnn: gemma_like.judge_losses(ffpa, jaxnn, ref, np.float32)[0]
    assert judge(ref + 2e-3, ref + 1e-3).ok
    assert not judge(ref + 2e-3 + 5 * ulp, ref + 1e-3).ok
    assert judge(ref + 4 * ulp, ref).ok        # jax.nn exact: the floor
    assert not judge(ref + 5 * ulp, ref).ok
    off = ref.copy()
    off[0, 1, 2] += 1e-2                       # one token is enough
    assert not judge(off, ref + 1e-3).ok


def test_the_layer_pattern_is_gemma4s():
    cfg = _tiny_config()
    pattern = lambda layers: "".join(
        "G" if kind.name == "global" else "L"
        for kind in gemma_like.layer_kinds(dataclasses.replace(cfg, layers=layers)))
    assert pattern(12) == "LLLLLGLLLLLG"
    assert pattern(8) == "LLLLLGLG"  # the last layer is always global
    assert pattern(1) == "G"


def test_the_global_layers_rotate_a_quarter_of_the_frequency_pairs():
    local, global_ = gemma_like.gemma4_kinds(heads_q=8, window=1024)
    assert (local.head_dim, local.kv_heads, global_.head_dim, global_.kv_heads) == (256, 4,
                                                                                    512, 1)
    freqs = gemma_like.rope_frequencies(global_)
    assert freqs.shape == (256,) and np.all(freqs[:64] > 0) and np.all(freqs[64:] == 0)
    np.testing.assert_allclose(freqs[1], 1e6 ** (-2 / 512))
    np.testing.assert_allclose(gemma_like.rope_frequencies(local)[1], 1e4 ** (-2 / 256))


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps: expected a positive integer; got '0'"),
    (["--heads", "5"], "--heads 5 is not a multiple of the local layers' 2 KV heads"),
    (["--lr", "0"], "--lr must be positive; got 0.0"),
    (["--attention", "flash"], "invalid choice: 'flash'"),
    (["--devices", "2", "--seq-len", "63"], "--seq-len 63 is not a multiple of --devices 2"),
    (["--devices", "64", "--context-layout", "contiguous"], "--devices 64: there are "),
    (["--attention", "jax.nn", "--context-layout", "zigzag"],
     "--context-layout zigzag needs --attention ffpa"),
    (["--profile", "dir", "--steps", "4"], "--profile traces steps 3 to 5: pass --steps 5"),
    (["--devices", "2", "--seq-len", "66"],
     "--seq-len 66 is not a multiple of 2 x --devices 2"),
])
def test_bad_options_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        gemma_like.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_pallas_without_a_gpu_needs_the_interpreter(capsys):
    if jax.default_backend() == "gpu":
        pytest.skip("there is a GPU")
    with pytest.raises(SystemExit):
        gemma_like.main(["--ffpa-implementation", "pallas"])
    assert "--ffpa-implementation pallas needs an NVIDIA GPU, or --interpret" in (
        capsys.readouterr().err)
