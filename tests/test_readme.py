"""README.md as a new user reads it: its Python snippets run, in order, in one session, and
its set-up section gives exactly the two commands that install and run the main job and
the tests (the CI script runs the test command verbatim)."""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

from attn_testing import assert_matches_reference

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
    # compute the plain call's attention by the tolerance rule (a ring merges blocks by lse
    # in float32, so its bfloat16 output may round apart from the plain call's by an ulp).
    q, k, v = (namespace[name] for name in "qkv")
    plain = ffpa_jax.attention(q, k, v, is_causal=True, implementation="xla")
    reference = _causal_attention_float64(q, k, v)
    for name in ("out", "out_jit"):
        assert_matches_reference(name, namespace[name], reference, plain, q.dtype)


def _causal_attention_float64(q, k, v):
    """Causal GQA attention of [B, T, H, D] arrays in numpy float64."""
    q, k, v = (np.asarray(np.asarray(x, np.float32), np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    logits = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[3])
    t, s = logits.shape[2:]
    logits = np.where(np.tril(np.ones((t, s), bool), s - t), logits, -np.inf)
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v)


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
