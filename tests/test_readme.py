"""README.md as a new user reads it: its Python snippets run, in order, in one session, and
its set-up section gives exactly the two commands that install and run the main job and
the tests (the CI script runs the test command verbatim)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SETUP_COMMANDS = ["pip install -e . && python -m ffpa_jax.bench",
                  'pip install -e ".[test]" && python -m pytest -n 2']


def code_blocks(text: str, language: str) -> list[str]:
    """The bodies of the fenced ```<language> blocks of `text`, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```$", text, flags=re.M | re.S)


def run_snippets(snippets: list[str]) -> dict:
    """Run each snippet in one namespace, in order; a snippet that raises fails the test,
    naming it by its number and first line."""
    namespace: dict = {"__name__": "readme"}
    for i, code in enumerate(snippets, 1):
        try:
            exec(compile(code, f"README.md python snippet {i}", "exec"), namespace)
        except Exception as exc:
            first = code.strip().splitlines()[0]
            pytest.fail(f"README.md's python snippet {i} (starting {first!r}) raised "
                        f"{type(exc).__name__}: {exc}")
    return namespace


def test_readme_python_snippets_run_in_order():
    snippets = code_blocks(README, "python")
    assert len(snippets) >= 4  # attention, dropout, language-model features, paged decode
    namespace = run_snippets(snippets)
    jnp, ffpa_jax = namespace["jnp"], namespace["ffpa_jax"]
    decoded = namespace["decoded"]  # the paged decode's result
    assert decoded.shape == (namespace["B"], namespace["Hq"], namespace["D"])
    assert bool(jnp.all(jnp.isfinite(decoded)))
    # Context parallelism's two snippets (shard_map with zigzag, sharded inputs under jit)
    # give the plain call's result.
    q, k, v = (namespace[name] for name in "qkv")
    plain = ffpa_jax.attention(q, k, v, is_causal=True).astype(jnp.float32)
    for name in ("out", "out_jit"):
        got = namespace[name].astype(jnp.float32)
        assert got.shape == plain.shape
        assert float(jnp.max(jnp.abs(got - plain))) <= 1e-6 * float(jnp.max(jnp.abs(plain))), name


def test_a_snippet_that_raises_fails_the_test():
    with pytest.raises(pytest.fail.Exception, match=r"snippet 2 \(starting 'y = x \+ 1'\) "
                                                    r"raised NameError"):
        run_snippets(["import math", "y = x + 1"])


def test_readme_set_up_section_gives_the_two_commands_near_the_top():
    start = README.index("## Set up on a fresh machine")
    section = README[start:README.index("\n## ", start + 1)]
    assert code_blocks(section, "bash") == [c + "\n" for c in SETUP_COMMANDS]
    # near the top: the first section after the introduction
    assert README.index("\n## ") == start - 1
    # the CI script runs the test command verbatim, in a fresh virtual environment
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert SETUP_COMMANDS[1] in ci
