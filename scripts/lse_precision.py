"""Where the forward kernel's lse error comes from (GPU diagnostic, prints a table).

For a few large-D problems with large logits (where the GPU fuzz saw lse errors just
above the bound), the max |lse - lse_float64| of: the XLA path at the inputs'
precision; the forward kernel under several launch configs (head-dim chunk width,
chunk walk); and plain-JAX emulations of the logits (one float32 dot, or a sum of
per-chunk float32 dots) followed by a float32 logsumexp in the natural or the
log2 domain. Tells a kernel bug from the accumulation order of the tensor cores.

    python scripts/lse_precision.py
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ffpa_jax.reference import mha_reference
from pallas_kernels import FwdConfig, fwd_generic

PROBLEMS = (  # (b, t, s, hq, hkv, d, scale, magnitude)
    (2, 6, 239, 8, 4, 768, 1.917, 2.0),
    (1, 17, 40, 2, 1, 1000, None, 1.0),
    (1, 64, 256, 4, 4, 512, None, 2.0),
)
CONFIGS = {
    "default-like bd64 dynamic": FwdConfig(block_m=64, block_n=64, block_d=64, block_dv=128,
                                           num_warps=4, num_stages=2, q_mode="dynamic"),
    "bd32 dynamic": FwdConfig(block_m=64, block_n=64, block_d=32, block_dv=128, num_warps=4,
                              num_stages=2, q_mode="dynamic"),
    "bd128 dynamic": FwdConfig(block_m=64, block_n=32, block_d=128, block_dv=128,
                               num_warps=4, num_stages=2, q_mode="dynamic"),
    "bd64 reload": FwdConfig(block_m=64, block_n=64, block_d=64, block_dv=128, num_warps=4,
                             num_stages=2, q_mode="reload"),
}


def emulated_lse(q, k, scale, chunk, log2_domain):
    """lse from float32 logits summed over head-dim chunks of `chunk` (0: one dot)."""
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    kk = jnp.repeat(k, g, axis=2)
    if chunk == 0:
        s = jnp.einsum("bthd,bshd->bhts", q, kk, preferred_element_type=jnp.float32)
    else:
        s = sum(jnp.einsum("bthd,bshd->bhts", q[..., c:c + chunk], kk[..., c:c + chunk],
                           preferred_element_type=jnp.float32) for c in range(0, d, chunk))
    if log2_domain:
        s2 = s * jnp.float32(scale * math.log2(math.e))
        m = jnp.max(s2, axis=-1)
        return (m + jnp.log2(jnp.sum(jnp.exp2(s2 - m[..., None]), axis=-1))) * jnp.float32(
            math.log(2.0))
    s = s * jnp.float32(scale)
    m = jnp.max(s, axis=-1)
    return m + jnp.log(jnp.sum(jnp.exp(s - m[..., None]), axis=-1))


def draw(problem, seed: int):
    """bf16 q, k, v of one of PROBLEMS (q and k scaled by its magnitude), its scale, and
    the float64 reference lse on exactly those inputs."""
    b, t, s, hq, hkv, d, scale, mag = problem
    scale = scale or 1.0 / math.sqrt(d)
    rng = np.random.default_rng(seed)
    q = jnp.asarray(mag * rng.standard_normal((b, t, hq, d)), jnp.bfloat16)
    k = jnp.asarray(mag * rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((b, s, hkv, d)), jnp.bfloat16)
    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x, np.float64))
        ref = np.asarray(mha_reference(f64(q), f64(k), f64(v), scale=scale)[1])
    return q, k, v, scale, ref


def main() -> None:
    for problem in PROBLEMS:
        b, t, s, hq, hkv, d, _, mag = problem
        rows = {}
        for seed in range(4):
            q, k, v, scale, ref = draw(problem, seed)
            got = {"xla bf16": mha_reference(q, k, v, None, None, scale=scale)[1]}
            for name, cfg in CONFIGS.items():
                try:
                    got["kernel " + name] = fwd_generic(q, k, v, scale=scale, causal=False,
                                                        config=cfg)[1]
                except Exception as exc:  # noqa: BLE001 - report and go on
                    got["kernel " + name] = str(exc).splitlines()[0][:60]
            for chunk in (0, 64, 256):
                for log2 in (False, True):
                    got[f"emulated chunk={chunk} log2={log2}"] = emulated_lse(q, k, scale, chunk,
                                                                             log2)
            for name, x in got.items():
                err = (x if isinstance(x, str)
                       else float(np.max(np.abs(np.asarray(x, np.float64) - ref))))
                rows.setdefault(name, []).append(err)
        print(f"\nB={b} T={t} S={s} H={hq}/{hkv} D={d} scale={scale:.4g} |q|,|k|~{mag}: "
              f"max |lse| {np.max(np.abs(ref)):.1f}")
        for name, errs in rows.items():
            shown = " ".join(e if isinstance(e, str) else f"{e:.2e}" for e in errs)
            print(f"  {name:34s} {shown}")


if __name__ == "__main__":
    main()
