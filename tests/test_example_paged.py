"""`python examples/paged_decode.py` as a new user runs it: --help answers, and a short
decode loop over the paged cache matches contiguous attention (the script checks itself
and exits 1 otherwise)."""

from __future__ import annotations

from example_runner import run_example


def _run(*args: str):
    return run_example("paged_decode.py", *args)


def test_help_lists_the_options():
    run = _run("--help")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage: python examples/paged_decode.py")
    for option in ("--steps", "--batch", "--page-size", "--implementation", "--interpret"):
        assert option in run.stdout


def test_a_short_loop_matches_contiguous_attention():
    # Page size 4: the sequences cross pages during the loop (new pages are allocated).
    run = _run("--steps", "3", "--batch", "2", "--page-size", "4")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and "lengths [8, 19]" in steps[-1]
    assert "largest difference from contiguous attention" in run.stdout


def test_bad_option_is_refused():
    run = _run("--steps", "0")
    assert run.returncode == 2 and "--steps must be >= 1; got 0" in run.stderr
