"""Which shard_map set-ups the Pallas kernels run in, on this JAX (GPU diagnostic).

JAX 0.11 types an array inside `shard_map(check_vma=True)` over an Explicit mesh
axis with that axis in its sharding spec ("bfloat16[2@b,...]"), and Pallas then
refuses integer indexing of the kernel's refs ("sharded ref can only be indexed by
slices"). This tries the combinations (mesh axis type x check_vma x a re-typing
of the inputs before the call) with ffpa_jax's kernels and with JAX's own Pallas
attention, and prints one JSON line per combination.

    python scripts/vma_probe.py
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import ffpa_jax


def _retype(x, how: str):
    if how == "none":
        return x
    if how == "reshard":
        return jax.sharding.reshard(x, P())
    if how == "reshape_out_sharding":
        return jax.lax.reshape(x, x.shape, out_sharding=P())
    raise ValueError(how)


def _jax_pallas_mha(q, k, v):
    from jax.experimental.pallas.ops.gpu import attention
    return attention.mha(q, k, v, segment_ids=None, causal=True)


def probe(axis_type, check_vma: bool, retype: str, kernel: str, closure: bool = False) -> dict:
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("b",), axis_types=(axis_type,))
    spec = P("b")
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.device_put(jax.random.normal(kk, (2 * n, 128, 4, 64), jnp.bfloat16),
                              NamedSharding(mesh, spec)) for kk in keys)
    seen = {}

    def body(q, k, v):
        q, k, v = (_retype(x, retype) for x in (q, k, v))
        seen["aval"] = str(jax.typeof(q))
        if kernel == "ffpa":
            return ffpa_jax.attention(q, k, v, is_causal=True, implementation="pallas")
        return _jax_pallas_mha(q, k, v)

    smap = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                         check_vma=check_vma)
    record = dict(axis_type=str(axis_type), check_vma=check_vma, retype=retype, kernel=kernel,
                  closure=closure)
    try:
        if closure:  # a jitted function of no arguments that closes over the arrays
            out, *grads = jax.jit(lambda: (lambda o, f: (o, *f(o)))(*jax.vjp(smap, q, k, v)))()
        else:
            out, vjp = jax.jit(lambda q, k, v: jax.vjp(smap, q, k, v))(q, k, v)
            grads = jax.jit(vjp)(out)
        want = ffpa_jax.attention(q, k, v, is_causal=True, implementation="xla")
        record["status"] = "ok"
        record["max_abs_diff"] = float(jnp.max(jnp.abs(out.astype(jnp.float32)
                                                       - want.astype(jnp.float32))))
        record["grads_finite"] = bool(all(jnp.isfinite(g.astype(jnp.float32)).all()
                                          for g in grads))
    except Exception as exc:  # noqa: BLE001 - the probe reports every outcome
        record["status"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
    record["aval_inside"] = seen.get("aval")
    return record


def main() -> None:
    print(json.dumps({"jax": jax.__version__, "devices": len(jax.devices())}))
    for kernel in ("ffpa", "jax_pallas_mha"):
        for axis_type in (AxisType.Explicit, AxisType.Auto):
            for check_vma in (True, False):
                print(json.dumps(probe(axis_type, check_vma, "none", kernel)), flush=True)
    for axis_type in (AxisType.Explicit, AxisType.Auto):
        print(json.dumps(probe(axis_type, True, "none", "ffpa", closure=True)), flush=True)
    for retype in ("reshard", "reshape_out_sharding"):
        print(json.dumps(probe(AxisType.Explicit, True, retype, "ffpa")), flush=True)


if __name__ == "__main__":
    main()
