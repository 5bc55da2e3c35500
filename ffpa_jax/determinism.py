"""`deterministic=None`: whether the backward must be bitwise reproducible, from XLA's own flag.

`ffpa_jax.attention(deterministic=None)` follows `--xla_gpu_deterministic_ops` in `XLA_FLAGS`,
the switch with which a user asks XLA for reproducible GPU results: with it on, the Pallas
backward runs its deterministic kernels; with it off (XLA's default), the one-pass backward
whose dQ is summed with float32 atomic adds. The flag is read when a call is traced, as XLA
spells it (tsl's command-line flags): `--xla_gpu_deterministic_ops` alone, or with
`=true`/`=1` (case-insensitive `true`), turns it on; `=false`/`=0` turns it off; the last
occurrence wins; a value XLA would reject leaves the previous setting.
"""

from __future__ import annotations

import os
import shlex

FLAG = "xla_gpu_deterministic_ops"


def xla_deterministic_ops(flags: str | None = None) -> bool:
    """Whether `flags` (default: the `XLA_FLAGS` environment variable) turn on
    `--xla_gpu_deterministic_ops`."""
    text = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    try:
        words = shlex.split(text)  # XLA's own tokenizer also strips quotes around values
    except ValueError:  # an unbalanced quote: split on whitespace
        words = text.split()
    value = False
    for word in words:
        if not word.startswith("--" + FLAG):
            continue
        rest = word[len(FLAG) + 2:]
        if rest == "":
            value = True
        elif rest.startswith("="):
            setting = rest[1:]
            if setting.lower() == "true" or setting == "1":
                value = True
            elif setting.lower() == "false" or setting == "0":
                value = False
        # else: another flag whose name starts with this one's
    return value


def resolve(deterministic: bool | None) -> bool:
    """The backward's mode: `deterministic` when given, else XLA's deterministic-ops flag."""
    if deterministic is None:
        return xla_deterministic_ops()
    return bool(deterministic)
