"""Running an example script as a new user does: from the repository root, without
PYTHONPATH (each script finds its checkout's ffpa_jax by itself)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> subprocess.CompletedProcess:
    """`python examples/<name> ARGS` in the repository root; its output captured."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(ROOT / "examples" / name), *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
