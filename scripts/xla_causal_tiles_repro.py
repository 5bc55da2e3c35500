"""Stand-alone repro of the XLA miscompile behind the T=276, S=1 fuzz failure.

The block lists of a masked causal call once computed the tiles a query block can
see with this jnp expression in the jitted graph:
    q_last = min(arange(n_q) * bm + bm - 1, T - 1);  visible = k_first <= q_last + (S - T)
On the H100 with jax 0.11.2 the jitted GPU program got it wrong (the comparison came
out inverted) at q_last + (S - T) == 0 with S=1, while eager execution and the CPU
were right, and the HLO after XLA's optimizations was still correct. This script
sweeps (T, S, bm, bn) and compares, under jit, three forms against numpy: that
original one, the same without the clamp (`split`: min(a, c) + d >= x as
(a + d >= x) & (c + d >= x)), and the original with an optimization barrier between
clamp and comparison. H100, 2026-11-21: `min` 22 of 504 cases wrong, the other two
none. The library now drops the clamp, which never changes the result
(`pallas_kernels.common.block_visits`).

    python scripts/xla_causal_tiles_repro.py
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np


def _visible_min(n_q, n_kv, bm, bn, t, s):
    """The original form: the last query row of each block, clamped to T - 1."""
    q_last = jnp.minimum(jnp.arange(n_q) * bm + bm - 1, t - 1)
    return (jnp.arange(n_kv) * bn)[None, :] <= q_last[:, None] + (s - t)


def _visible_split(n_q, n_kv, bm, bn, t, s):
    """min(a, c) + d >= x  as  (a + d >= x) & (c + d >= x): no min in the graph."""
    k_first = (jnp.arange(n_kv) * bn)[None, :]
    return ((k_first <= (jnp.arange(n_q) * bm)[:, None] + (bm - 1 + s - t))
            & (k_first <= t - 1 + s - t))


def _visible_barrier(n_q, n_kv, bm, bn, t, s):
    """The original form with an optimization barrier between the clamp and the test."""
    q_last = jax.lax.optimization_barrier(jnp.minimum(jnp.arange(n_q) * bm + bm - 1, t - 1))
    return (jnp.arange(n_kv) * bn)[None, :] <= q_last[:, None] + (s - t)


FORMS = {"min": _visible_min, "split": _visible_split, "barrier": _visible_barrier}


def counts_jnp(mask, *, form: str, n_q: int, bm: int, bn: int, t: int, s: int):
    n_kv = -(-s // bn)
    visible = FORMS[form](n_q, n_kv, bm, bn, t, s)
    return (mask & visible[None, None]).sum(axis=-1, dtype=jnp.int32)


def counts_np(mask, *, n_q: int, bm: int, bn: int, t: int, s: int):
    q_last = np.minimum(np.arange(n_q) * bm + bm - 1, t - 1)
    visible = (np.arange(-(-s // bn)) * bn)[None, :] <= q_last[:, None] + (s - t)
    return (np.asarray(mask) & visible[None, None]).sum(axis=-1, dtype=np.int32)


def main() -> None:
    print(jax.devices(), jax.__version__, flush=True)
    rng = np.random.default_rng(0)
    mask = jnp.asarray(rng.random((3, 6, 1, 1)) < 0.9)
    cases = list(itertools.product((64, 113, 203, 255, 256, 257, 276, 300, 1023),
                                   (1, 2, 3, 16, 17, 100, 1000), (16, 32, 64, 128), (16, 64)))
    for form in FORMS:
        wrong = []
        for t, s, bm, bn in cases:
            kw = dict(form=form, n_q=-(-t // bm), bm=bm, bn=bn, t=t, s=s)
            jitted = np.asarray(jax.jit(lambda m, kw=kw: counts_jnp(m, **kw))(mask))
            want = counts_np(mask, **{k: v for k, v in kw.items() if k != "form"})
            if not np.array_equal(jitted, want):
                wrong.append((t, s, bm, bn))
        print(f"form {form}: {len(wrong)} of {len(cases)} (T, S, bm, bn) wrong under jit: "
              f"{wrong[:12]}", flush=True)


if __name__ == "__main__":
    main()
