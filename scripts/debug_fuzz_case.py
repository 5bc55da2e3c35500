"""Diagnose one GPU fuzz failure: who is wrong, the kernel or the jitted reference?

The case (H200 fuzz, 2026-11-21): B=3, T=276, S=1, Hq=6, Hkv=3, D=30, Dv=100, bf16,
causal (bottom-right: only the last query row sees the key), mask (3, 6, 1, 1),
bias (1, 1, 1, 1). Each draw's inputs come from the fuzz harness's own generator
(`check_example`'s recipe). Per draw this prints the max |difference| against a
float64 reference in plain numpy (no XLA at all) of: the Pallas path, the XLA
path, the harness's jitted float64 reference and the same reference run eagerly
(`jax.disable_jit`), and where the Pallas output differs, which (b, h, row)s.
Variants change one ingredient at a time (no bias, no mask, no causal, T=256,
D=32, Dv=32) to locate the cause.

    PYTHONPATH=.:tests python scripts/debug_fuzz_case.py [--draws 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax
import numpy as np

sys.path.insert(0, "tests")
from test_fuzz import Config, _np_normal  # noqa: E402
from test_numerics import run_attention, run_reference  # noqa: E402

BASE = Config(batched=True, b=3, t=276, s=1, hq=6, hkv=3, d=30, dv=100, dtype="bfloat16",
              causal=True, bias_shape=(1, 1, 1, 1), bias_dtype="bfloat16",
              mask_shape=(3, 6, 1, 1), scale=0.499, dropout_rate=0.0, with_grads=False)


def numpy_reference(q, k, v, bias, mask, *, scale, causal):
    """Output [B, T, Hq, Dv] and lse [B, Hq, T] in float64 numpy."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, hq, _ = q.shape
    s, hkv = k.shape[1], k.shape[2]
    kr = np.repeat(k, hq // hkv, axis=2)
    vr = np.repeat(v, hq // hkv, axis=2)
    logits = np.einsum("bthd,bshd->bhts", q, kr) * scale
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64).reshape((1,) * (4 - bias.ndim) + bias.shape)
    keep = np.ones(logits.shape, bool)
    if mask is not None:
        keep &= np.asarray(mask).reshape((1,) * (4 - mask.ndim) + mask.shape)
    if causal:
        keep &= (np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t))[None, None]
    logits = np.where(keep, logits, -np.inf)
    row_max = logits.max(-1, keepdims=True)
    row_max = np.where(np.isfinite(row_max), row_max, 0.0)
    e = np.exp(logits - row_max)
    den = e.sum(-1, keepdims=True)
    p = np.where(den > 0, e / np.where(den > 0, den, 1.0), 0.0)
    out = np.einsum("bhts,bshd->bthd", p, vr)
    lse = np.where(den[..., 0] > 0, row_max[..., 0] + np.log(np.where(den > 0, den, 1.0))[..., 0],
                   -np.inf)
    return out, lse


def draw(cfg: Config, seed: int, mask_density: float):
    rng = np.random.default_rng(seed)
    lead = (cfg.b,)
    q = _np_normal(rng, lead + (cfg.t, cfg.hq, cfg.d), cfg.dtype)
    k = _np_normal(rng, lead + (cfg.s, cfg.hkv, cfg.d), cfg.dtype)
    v = _np_normal(rng, lead + (cfg.s, cfg.hkv, cfg.dv), cfg.dtype)
    d_out = jax.numpy.asarray(_np_normal(rng, lead + (cfg.t, cfg.hq, cfg.dv), cfg.dtype),
                              jax.numpy.float32)
    d_lse = _np_normal(rng, lead + (cfg.hq, cfg.t), "float32")
    bias = mask = None
    if cfg.bias_shape is not None:
        bias = jax.numpy.asarray((2.0 * rng.standard_normal(cfg.bias_shape)).astype(np.float32)
                                 .astype(jax.numpy.dtype(cfg.bias_dtype)))
    if cfg.mask_shape is not None:
        mask = jax.numpy.asarray(rng.random(cfg.mask_shape) < mask_density)
    return q, k, v, bias, mask, d_out, d_lse


def max_abs(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    both_inf = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    with np.errstate(invalid="ignore"):
        d = np.where(both_inf, 0.0, np.abs(a - b))
    return float(np.nanmax(np.where(np.isnan(d), np.inf, d)))


def run_case(name: str, cfg: Config, draws: int, mask_density: float) -> None:
    bad = 0
    for seed in range(draws):
        q, k, v, bias, mask, d_out, d_lse = draw(cfg, seed, mask_density)
        kw = dict(scale=cfg.scale, causal=cfg.causal, dropout_rate=0.0, with_grads=False)
        want_out, want_lse = numpy_reference(q, k, v, bias, mask, scale=cfg.scale,
                                             causal=cfg.causal)
        rows = {}
        rows["pallas"] = run_attention(q, k, v, bias, mask, None, d_out, d_lse, impl="pallas",
                                       interpret=False, **kw)
        rows["xla"] = run_attention(q, k, v, bias, mask, None, d_out, d_lse, impl="xla",
                                    interpret=False, **kw)
        rows["ref64_jit"] = run_reference(q, k, v, bias, mask, d_out, d_lse, float64=True, **kw)
        with jax.disable_jit():
            rows["ref64_eager"] = run_reference(q, k, v, bias, mask, d_out, d_lse, float64=True,
                                                **kw)
        line = []
        for label, got in rows.items():
            e_out = max_abs(got[0], want_out)
            e_lse = max_abs(got[1], want_lse)
            line.append(f"{label} out {e_out:.2e} lse {e_lse:.2e}")
        e_pallas = max_abs(rows["pallas"][0], want_out)
        detail = ""
        if e_pallas > 0.05:
            bad += 1
            diff = np.abs(np.asarray(rows["pallas"][0], np.float64) - want_out).max(-1)  # [B,T,H]
            where = np.argwhere(diff > 0.05)
            mask_np = None if mask is None else np.asarray(mask).reshape(-1, cfg.hq)
            detail = (f"\n    bad (b, t, h): {len(where)} e.g. {where[:6].tolist()}; "
                      f"rows t: {sorted(set(where[:, 1].tolist()))[:8]}; "
                      f"mask[b, h] of bad: "
                      f"{[] if mask_np is None else [bool(mask_np[b, h]) for b, _, h in where[:6]]}; "
                      f"pallas |out| there {np.abs(np.asarray(rows['pallas'][0], np.float64))[tuple(where[0])].max():.3g}, "
                      f"want {np.abs(want_out[tuple(where[0])]).max():.3g}")
        print(f"  [{name}] seed {seed}: " + " | ".join(line) + detail, flush=True)
    print(f"[{name}] mask_density {mask_density}: {bad}/{draws} draws with the Pallas output off",
          flush=True)


def kernel_sweep() -> None:
    """The base case (mask density 0.9, seed 0) through `fwd_generic` directly, under
    several launch configs, and the block lists the mask path computes, on this device
    and in numpy."""
    from pallas_kernels import FwdConfig, common, fwd_generic

    cfg = BASE
    q, k, v, bias, mask, _, _ = draw(cfg, 0, 0.9)
    want_out, want_lse = numpy_reference(q, k, v, bias, mask, scale=cfg.scale, causal=True)
    for bm, bn, warps, stages, q_mode in ((128, 128, 8, 3, "resident"), (128, 16, 4, 2, "resident"),
                                          (64, 16, 4, 2, "resident"), (32, 16, 4, 1, "resident"),
                                          (16, 16, 4, 1, "resident"), (64, 16, 4, 2, "dynamic"),
                                          (64, 16, 4, 2, "reload")):
        config = FwdConfig(block_m=bm, block_n=bn, block_d=32, block_dv=128, num_warps=warps,
                           num_stages=stages, q_mode=q_mode)
        for with_bias in (True, False):
            try:
                out, lse = fwd_generic(q, k, v, bias if with_bias else None, mask,
                                       scale=cfg.scale, causal=True, config=config)
                ref_out, ref_lse = numpy_reference(q, k, v, bias if with_bias else None, mask,
                                                   scale=cfg.scale, causal=True)
                bad = np.argwhere(np.abs(np.asarray(out, np.float64) - ref_out).max(-1) > 0.05)
                print(f"kernel bm={bm} bn={bn} warps={warps} stages={stages} {q_mode} "
                      f"bias={with_bias}: out err {max_abs(out, ref_out):.2e}, lse err "
                      f"{max_abs(lse, ref_lse):.2e}, bad (b,t,h) {bad[:4].tolist()}", flush=True)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"kernel bm={bm} bn={bn}: {type(exc).__name__}: {str(exc)[:200]}")
        fitted = config.fitted(cfg.t, cfg.s, cfg.d, cfg.dv)
        counts, indices = common.mask_block_lists(mask, block_m=fitted.block_m,
                                                  block_n=fitted.block_n, seq_q=cfg.t,
                                                  seq_k=cfg.s, causal=True)
        with jax.default_device(jax.devices("cpu")[0]):
            c_cpu, i_cpu = common.mask_block_lists(np.asarray(mask), block_m=fitted.block_m,
                                                   block_n=fitted.block_n, seq_q=cfg.t,
                                                   seq_k=cfg.s, causal=True)
        same = (np.array_equal(np.asarray(counts), np.asarray(c_cpu))
                and np.array_equal(np.asarray(indices), np.asarray(i_cpu)))
        print(f"  block lists (fitted bm={fitted.block_m} bn={fitted.block_n}): device == cpu: "
              f"{same}; counts[0] {np.asarray(counts)[0].tolist()}", flush=True)
    # The same kernel under jit (the block lists fused into the jitted program), and the
    # public function eagerly and under jit.
    config = FwdConfig(block_m=128, block_n=128, block_d=32, block_dv=128, num_warps=8,
                       num_stages=3)
    jitted = jax.jit(lambda q, k, v, b, m: fwd_generic(q, k, v, b, m, scale=cfg.scale,
                                                        causal=True, config=config))
    out, lse = jitted(q, k, v, bias, mask)
    print(f"jitted kernel: out err {max_abs(out, want_out):.2e}, lse err "
          f"{max_abs(lse, want_lse):.2e}", flush=True)
    import ffpa_jax

    def public(q, k, v, b, m):
        return ffpa_jax.attention(q, k, v, b, m, scale=cfg.scale, is_causal=True,
                                  return_lse=True, implementation="pallas")
    for label, fn in (("public eager", public), ("public jit", jax.jit(public))):
        out, lse = fn(q, k, v, bias, mask)
        print(f"{label}: out err {max_abs(out, want_out):.2e}, lse err "
              f"{max_abs(lse, want_lse):.2e}", flush=True)


def jit_probe() -> None:
    """The failing jitted call with its block lists returned beside (out, lse), for S=1
    (fails) and S=2 (passes): are the lists the kernel saw the eager ones? Then the same
    jitted kernel with the lists computed outside and passed in as arguments, and with an
    optimization barrier between the lists and the kernel: which ingredient of the jitted
    graph turns the result wrong. Run with XLA_FLAGS=--xla_dump_to=DIR to keep the
    optimized HLO of every variant."""
    from pallas_kernels import FwdConfig, common, fwd_generic

    config = FwdConfig(block_m=128, block_n=128, block_d=32, block_dv=128, num_warps=8,
                       num_stages=3)
    real_mask_inputs = common.mask_inputs
    for s in (1, 2):
        cfg = dataclasses.replace(BASE, s=s)
        q, k, v, bias, mask, _, _ = draw(cfg, 0, 0.9)
        fitted = config.fitted(cfg.t, cfg.s, cfg.d, cfg.dv)
        lists = dict(block_m=fitted.block_m, block_n=fitted.block_n, seq_q=cfg.t, seq_k=s,
                     causal=True)
        want_out, want_lse = numpy_reference(q, k, v, bias, mask, scale=cfg.scale, causal=True)

        def report(label, out, lse):
            bad = np.argwhere(np.abs(np.asarray(out, np.float64) - want_out).max(-1) > 0.05)
            print(f"S={s} {label}: out err {max_abs(out, want_out):.2e}, lse err "
                  f"{max_abs(lse, want_lse):.2e}, bad (b,t,h) {bad[:4].tolist()}", flush=True)
            return out

        def f(q, k, v, b, m, lists=lists, scale=cfg.scale):
            out, lse = fwd_generic(q, k, v, b, m, scale=scale, causal=True, config=config)
            return out, lse, *common.mask_block_lists(m, **lists)
        out, lse, counts, indices = jax.jit(f)(q, k, v, bias, mask)
        c_eager, i_eager = common.mask_block_lists(mask, **lists)
        report("jit, lists inside", out, lse)
        print(f"  jitted lists == eager: {np.array_equal(np.asarray(counts), np.asarray(c_eager))}"
              f" {np.array_equal(np.asarray(indices), np.asarray(i_eager))}", flush=True)
        out2, _, _, _ = jax.jit(f)(q, k, v, bias, mask)
        print(f"  rerun identical: {np.array_equal(np.asarray(out2), np.asarray(out))}",
              flush=True)

        def with_lists(q, k, v, b, m, c, i, scale=cfg.scale):
            common.mask_inputs = lambda m4, **kw: ([m4, c, i], c.shape[2])
            try:
                return fwd_generic(q, k, v, b, m, scale=scale, causal=True, config=config)
            finally:
                common.mask_inputs = real_mask_inputs
        report("jit, lists as arguments", *jax.jit(with_lists)(q, k, v, bias, mask, c_eager,
                                                                i_eager))

        def barrier(q, k, v, b, m, scale=cfg.scale):
            def fenced(m4, **kw):
                args, outer = real_mask_inputs(m4, **kw)
                return list(jax.lax.optimization_barrier(tuple(args))), outer
            common.mask_inputs = fenced
            try:
                return fwd_generic(q, k, v, b, m, scale=scale, causal=True, config=config)
            finally:
                common.mask_inputs = real_mask_inputs
        report("jit, barrier before kernel", *jax.jit(barrier)(q, k, v, bias, mask))

        def mask_copy(q, k, v, b, m, scale=cfg.scale):
            m = jax.lax.optimization_barrier(m.astype(jax.numpy.int8)) != 0
            return fwd_generic(q, k, v, b, m, scale=scale, causal=True, config=config)
        report("jit, mask recomputed in-graph", *jax.jit(mask_copy)(q, k, v, bias, mask))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=8)
    parser.add_argument("--kernel-sweep", action="store_true",
                        help="only the launch-config sweep of the base case")
    parser.add_argument("--jit-probe", action="store_true",
                        help="only the jitted call with its block lists (see jit_probe)")
    args = parser.parse_args()
    print(jax.devices(), flush=True)
    if args.kernel_sweep:
        kernel_sweep()
        return
    if args.jit_probe:
        jit_probe()
        return
    variants = {
        "base": BASE,
        "no-bias": dataclasses.replace(BASE, bias_shape=None),
        "no-mask": dataclasses.replace(BASE, mask_shape=None),
        "not-causal": dataclasses.replace(BASE, causal=False),
        "T=256": dataclasses.replace(BASE, t=256),
        "T=64": dataclasses.replace(BASE, t=64),
        "D=32,Dv=32": dataclasses.replace(BASE, d=32, dv=32),
        "S=2": dataclasses.replace(BASE, s=2),
        "no-gqa": dataclasses.replace(BASE, hkv=6),
    }
    for density in (0.9, 0.05):
        for name, cfg in variants.items():
            run_case(name, cfg, args.draws, density)


if __name__ == "__main__":
    main()
