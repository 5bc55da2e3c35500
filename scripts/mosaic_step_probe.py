"""(Run from the repository root, under a timeout: a barrier bug hangs.) The Mosaic backward step (logits + softmax gradient) against the Triton one and the
unfused library GEMM + softmax_grad, on one block of the chunked backward at D = 512."""
import functools, json, os, sys, time, traceback
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels import blocked
from pallas_kernels.blocked import GradBlock, LogitOperands
from pallas_kernels.mosaic.common import Walk, LOG2E
from pallas_kernels.mosaic.grad_step import logits_grad_step
from pallas_kernels.mosaic.grad_step_persistent import logits_grad_step_persistent
from pallas_kernels.problem import Inputs, Problem
from tuning import timing

OUT = os.environ.get("OUT", "/tmp")
res = {"device": jax.devices()[0].device_kind, "rows": []}
B, H, N, D, R, K = 1, 32, 16384, 512, 4096, 2048
sd = jax.ShapeDtypeStruct
ks = jax.random.split(jax.random.key(0), 5)
q5 = jax.random.normal(ks[0], (B, H, 1, N, D), jnp.bfloat16)
k4 = jax.random.normal(ks[1], (B, H, N, D), jnp.bfloat16)
dp = jax.random.normal(ks[2], (B, H, R, K), jnp.bfloat16)
delta = jax.random.normal(ks[3], (B, H, R), jnp.float32)
scale = D ** -0.5

for causal, offs in ((False, (4096, 2048)), (True, (4096, 4096))):
    offsets = jnp.asarray(offs, jnp.int32)
    qb = q5[:, :, 0, offs[0]:offs[0] + R]
    kb = k4[:, :, offs[1]:offs[1] + K]
    logits = jnp.einsum("bhmd,bhsd->bhms", qb, kb, preferred_element_type=jnp.float32)
    s = logits * scale
    if causal:
        vis = (jnp.arange(K)[None, :] + offs[1]) <= (jnp.arange(R)[:, None] + offs[0])
        s = jnp.where(vis, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    lse = jnp.where(jnp.isfinite(lse), lse, -jnp.inf)
    lse2 = jnp.where(jnp.isfinite(lse), lse * LOG2E, jnp.inf)
    qs, kvs = sd((B, N, H, D), jnp.bfloat16), sd((B, N, H, D), jnp.bfloat16)
    problem = Problem.of(qs, kvs, kvs, scale=scale, causal=causal)
    inputs = Inputs(qs, kvs, kvs)
    triton = jax.jit(lambda q5, k4, dp, l, d, o: blocked.softmax_grad_of_operands(
        problem, LogitOperands(q5, k4), GradBlock(None, dp, l, d, o), inputs,
        out_dtype=jnp.bfloat16))
    def unfused(q5, k4, dp, l, d, o):
        qb = jax.lax.dynamic_slice_in_dim(q5[:, :, 0], o[0], R, 2)
        kb = jax.lax.dynamic_slice_in_dim(k4, o[1], K, 2)
        lg = jnp.einsum("bhmd,bhsd->bhms", qb, kb, preferred_element_type=jnp.float32)
        return blocked.softmax_grad(problem, GradBlock(lg, dp, l, d, o), inputs,
                                    out_dtype=jnp.bfloat16)
    unfused = jax.jit(unfused)
    walk = Walk(T=N, S=N, causal=causal, block_kv=128, scale=scale)
    want = triton(q5, k4, dp, lse, delta, offsets)
    row = dict(causal=causal, offsets=offs)
    fl = 2 * B * H * R * K * D
    for name, fn, args in (("triton", triton, (q5, k4, dp, lse, delta, offsets)),
                           ("unfused", unfused, (q5, k4, dp, lse, delta, offsets))):
        ms = timing.median_ms(fn, args, reps=7)
        row[name + "_ms"] = ms
        print(causal, name, round(ms, 3), "ms", round(fl / ms / 1e9), "TF/s", flush=True)
    variants = [(f"mosaic_c2_s{st}", functools.partial(logits_grad_step, stages=st))
                for st in (3, 4)]
    variants += [(f"persistent_s{st}", functools.partial(logits_grad_step_persistent, stages=st))
                 for st in (3, 4)]
    for name, step in variants:
        try:
            fn = jax.jit(lambda q5, k4, dp, l, d, o, step=step: step(q5, k4, dp, l, d, o, walk))
            got = fn(q5, k4, dp, lse2, delta, offsets)
            jax.block_until_ready(got)
            f32 = lambda x: np.asarray(x, np.float32)
            errs = [float(np.abs(f32(g) - f32(w)).max()) for g, w in zip(got, want[:2])]
            scale_ = [float(np.abs(f32(w)).max()) for w in want[:2]]
            ms = timing.median_ms(fn, (q5, k4, dp, lse2, delta, offsets), reps=7)
            row[name] = dict(ms=ms, max_abs_diff=errs, max_abs=scale_)
            print(causal, name, round(ms, 3), "ms", round(fl / ms / 1e9), "TF/s", "diff", errs,
                  "of", scale_, flush=True)
        except Exception:
            row[name] = dict(error=traceback.format_exc()[-3000:])
            print(causal, name, "FAILED", traceback.format_exc()[-2500:], flush=True)
    res["rows"].append(row)
json.dump(res, open(os.path.join(OUT, "step_probe.json"), "w"), indent=1)
