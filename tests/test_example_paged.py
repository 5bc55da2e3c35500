"""`python examples/paged_decode.py` as a new user runs it: --help answers, and a short
decode loop over the paged cache matches contiguous attention (the script checks itself
and exits 1 otherwise)."""

from __future__ import annotations

import pytest

from conftest import HAS_GPU
from example_runner import run_example

# An end-to-end run: outside the default suite; CI runs it (`pytest -m slow`).
pytestmark = pytest.mark.slow


def _run(*args: str):
    return run_example("paged_decode.py", *args)


def test_help_lists_the_options():
    run = _run("--help")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage: python examples/paged_decode.py")
    for option in ("--steps", "--batch", "--page-size", "--implementation", "--interpret"):
        assert option in run.stdout
    # every option with a value says its default
    text = " ".join(run.stdout.split())
    for default in ("tokens to decode (default: 24)", "sequences (default: 4)",
                    "keys per page (default: 16)", "(default: float32)", "(default: auto)",
                    "(default: 0)"):
        assert default in text, default


def test_a_short_loop_matches_contiguous_attention():
    # Page size 4: the sequences cross pages during the loop (new pages are allocated).
    run = _run("--steps", "3", "--batch", "2", "--page-size", "4")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and "lengths [8, 19]" in steps[-1]
    assert "largest difference from contiguous attention" in run.stdout
    # it says which implementation ran: the decode kernels on a GPU, else XLA's
    ran = "pallas" if HAS_GPU else "xla"
    assert run.stdout.splitlines()[0].startswith(f"paged_attention runs on: {ran} ")


def test_the_interpreted_kernels_say_so():
    run = _run("--steps", "1", "--batch", "1", "--page-size", "4", "--interpret", "--no-check")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    first = run.stdout.splitlines()[0]
    assert first.startswith("paged_attention runs on: pallas ") and "interpreter" in first


def test_bad_option_is_refused():
    run = _run("--steps", "0")
    assert run.returncode == 2 and "--steps must be >= 1; got 0" in run.stderr
