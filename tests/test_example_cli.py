"""`python examples/tiny_lm.py` as a new user runs it: --help answers, and the defaults
train (a short run here) without any set-up beyond the flax extra."""

from __future__ import annotations

import pytest

pytest.importorskip("flax")
pytest.importorskip("optax")

from example_runner import run_example
from examples import tiny_lm

# An end-to-end run: outside the default suite; CI runs it (`pytest -m slow`).
pytestmark = pytest.mark.slow


def _run(*args: str):
    return run_example("tiny_lm.py", *args)


def test_help_prints_usage_and_exits_0():
    run = _run("--help")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage: python examples/tiny_lm.py")
    for option in ("--steps", "--batch", "--mode", "--implementation", "--interpret"):
        assert option in run.stdout


def test_runs_as_a_script_and_prints_the_losses():
    run = _run("--steps", "3", "--batch", "4", "--layers", "1")
    assert run.returncode == 0, run.stderr[-2000:]
    losses = [float(line.split("loss")[1]) for line in run.stdout.splitlines()
              if line.startswith("step ")]
    assert len(losses) == 3 and all(0 < x < 10 for x in losses), run.stdout
    assert "3 steps in" in run.stdout


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps: expected a positive integer; got '0'"),
    (["--d-model", "30", "--heads", "4"], "--d-model 30 must be a multiple of --heads 4"),
    (["--dropout", "1.0"], "--dropout must be in [0, 1); got 1.0"),
    (["--mode", "vmap"], "invalid choice: 'vmap'"),
])
def test_bad_options_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        tiny_lm.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
