"""One-off A/B (issue 24's open targets): the sliding window's backward and the soft cap's
tanh. Prints one JSON line per variant; results are written up in docs/history.md.

Window (D=256, N=16384, B=1, H=32, causal, window 1024): the backward on the tier the tuned
file picks (chunked at D=256), on the fused kernels, and on the chunked tier with query
blocks capped near the window's width. Soft cap (D=128, N=4096, B=4, H=32, cap 50): the
libdevice tanh against tanh(x) = 1 - 2 / (exp2(2x·log2 e) + 1).
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp

from jax.experimental.pallas import triton as plgpu

import ffpa_jax
from pallas_kernels import blocked, chunked, common
from tuning.timing import median_ms

LOG2E = 1.0 / math.log(2.0)


def exp2_tanh(x):
    e = jnp.exp2(x * (2.0 * LOG2E))
    return 1.0 - 2.0 / (e + 1.0)


def _ptx(asm, x):
    [out] = plgpu.elementwise_inline_asm(
        asm, args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])
    return out


def ptx_tanh(x):
    """tanh(x) = 1 - 2 / (1 + 2^(2x·log2 e)) with the approximate ex2 and rcp (two MUFU
    operations, nothing else)."""
    e = _ptx("ex2.approx.ftz.f32 $0, $1;", x * (2.0 * LOG2E))
    return 1.0 - 2.0 * _ptx("rcp.approx.ftz.f32 $0, $1;", e + 1.0)


def inputs(b, n, h, d, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (b, n, h, d), jnp.float32).astype(dtype) for kk in ks)
    return q, k, v, do


def timed(kw, args, direction):
    q, k, v, do = args

    def fwd(q, k, v):
        return ffpa_jax.attention(q, k, v, **kw)

    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(fwd, q, k, v)
        return vjp(do)

    fn = jax.jit(fwd if direction == "fwd" else fwd_bwd)
    return median_ms(fn, (q, k, v), reps=5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--what", default="window,softcap")
    args = ap.parse_args()
    rows = []
    if "window512" in args.what:
        x = inputs(1, 16384, 32, 512)
        win = dict(is_causal=True, local_window_size=(1024, 0))
        rows.append(("d512-causal", "fwd_bwd", timed(dict(is_causal=True), x, "fwd_bwd")))
        rows.append(("d512-window-auto", "fwd_bwd", timed(win, x, "fwd_bwd")))
        rows.append(("d512-window-fused", "fwd_bwd",
                     timed(dict(win, implementation="pallas"), x, "fwd_bwd")))
        original = chunked.causal_rows_cap
        for cap in (512, 1024):
            chunked.causal_rows_cap = lambda seq_q, cap=cap: cap
            jax.clear_caches()
            rows.append((f"d512-window-chunked-rows{cap}", "fwd_bwd", timed(win, x, "fwd_bwd")))
        chunked.causal_rows_cap = original
        jax.clear_caches()
    if "window256" in args.what:
        x = inputs(1, 16384, 32, 256)
        win = dict(is_causal=True, local_window_size=(1024, 0))
        original = chunked.causal_rows_cap
        chunked.causal_rows_cap = lambda seq_q: 512
        jax.clear_caches()
        rows.append(("window-chunked-rows512", "fwd_bwd", timed(win, x, "fwd_bwd")))
        chunked.causal_rows_cap = original
        jax.clear_caches()
    if "ptxcap" in args.what:
        x = inputs(4, 4096, 32, 128)
        original_common, original_blocked = common.soft_cap, blocked._capped

        def soft_cap(s, st):
            cap = st.softcap * st.score_unit
            return cap * ptx_tanh(s * (1.0 / cap))
        common.soft_cap = soft_cap
        jax.clear_caches()
        for direction in ("fwd", "fwd_bwd"):
            rows.append(("plain", direction, timed({}, x, direction)))
            rows.append(("softcap-ptx", direction,
                         timed(dict(logits_soft_cap=50.0, implementation="pallas"), x,
                               direction)))
        common.soft_cap, blocked._capped = original_common, original_blocked
    if args.what == "window" or "window," in args.what:
        x = inputs(1, 16384, 32, 256)
        base = dict(is_causal=True)
        win = dict(is_causal=True, local_window_size=(1024, 0))
        for direction in ("fwd", "fwd_bwd"):
            rows.append(("causal", direction, timed(base, x, direction)))
            rows.append(("window-auto", direction, timed(win, x, direction)))
            rows.append(("window-fused", direction,
                         timed(dict(win, implementation="pallas"), x, direction)))
        original = chunked.causal_rows_cap
        for cap in (1024, 2048):
            chunked.causal_rows_cap = lambda seq_q, cap=cap: cap
            jax.clear_caches()
            rows.append((f"window-chunked-rows{cap}", "fwd_bwd", timed(win, x, "fwd_bwd")))
        chunked.causal_rows_cap = original
        jax.clear_caches()
    if "softcap" in args.what.split(","):
        x = inputs(4, 4096, 32, 128)
        for direction in ("fwd", "fwd_bwd"):
            rows.append(("plain", direction, timed({}, x, direction)))
            rows.append(("softcap-libdevice", direction,
                         timed(dict(logits_soft_cap=50.0), x, direction)))
        original_common, original_blocked = common.soft_cap, blocked._capped

        def soft_cap(s, st):
            cap = st.softcap * st.score_unit
            return cap * exp2_tanh(s * (1.0 / cap))

        def capped(st, s):
            if st.softcap is None:
                return s, None
            t = exp2_tanh(s / st.softcap)
            return st.softcap * t, 1.0 - t * t
        common.soft_cap, blocked._capped = soft_cap, capped
        jax.clear_caches()
        for direction in ("fwd", "fwd_bwd"):
            rows.append(("softcap-exp2", direction,
                         timed(dict(logits_soft_cap=50.0), x, direction)))
        common.soft_cap, blocked._capped = original_common, original_blocked
    for name, direction, ms in rows:
        print(json.dumps(dict(variant=name, direction=direction, ms=round(ms, 4),
                              device=jax.devices()[0].device_kind)), flush=True)


if __name__ == "__main__":
    main()
