"""Context parallelism across processes: the same code under `jax.distributed.initialize`.

Two processes on this machine (2 fake CPU devices each, gloo collectives) form one 4-device
mesh; the sequence is split over all four, so K/V pass between the processes (the ring's
ppermute, the all-gather's all_gather and reduce-scatter). Each process checks its own
shards of out, lse and the gradients against the unsharded call it computes alone.
"""

from __future__ import annotations

import json
import pathlib
import socket
import subprocess
import sys

import pytest

from fake_devices import fake_devices_env

# An end-to-end run: outside the default suite; CI runs it (`pytest -m slow`).
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROCESSES = 2
LOCAL_DEVICES = 2


def _worker(process_id: int, port: int) -> None:
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=PROCESSES, process_id=process_id)
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import ffpa_jax

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,))
    rng = np.random.default_rng(0)
    b, t, hq, hkv, d = 1, 64, 4, 2, 16
    arrays = [rng.standard_normal(s).astype(np.float32)
              for s in ((b, t, hq, d), (b, t, hkv, d), (b, t, hkv, d), (b, t, hq, d),
                        (b, hq, t))]
    q, k, v, d_out, d_lse = arrays
    report = {"devices": n, "processes": jax.process_count()}

    def grads(attn):
        def loss(q, k, v, d_out, d_lse):
            out, lse = attn(q, k, v)
            return jnp.sum(out * d_out) + jnp.sum(lse * d_lse), (out, lse)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    with jax.default_device(jax.local_devices()[0]):
        plain = lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=True, return_lse=True)
        (_, (out, lse)), (dq, dk, dv) = grads(plain)(q, k, v, d_out, d_lse)
        want = {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}
        want = {name: np.asarray(x) for name, x in want.items()}

    for layout, strategy in (("zigzag", "ring"), ("contiguous", "all_gather")):
        zig = layout == "zigzag"
        order = (lambda x, axis=1: np.asarray(ffpa_jax.zigzag(x, n, axis))) if zig else (
            lambda x, axis=1: x)
        natural_want = {name: order(x, 2 if name == "lse" else 1) for name, x in want.items()}

        def local(q, k, v, layout=layout, strategy=strategy):
            return ffpa_jax.attention(q, k, v, is_causal=True, return_lse=True,
                                      context_axis="cp", context_layout=layout,
                                      context_strategy=strategy)
        split = P(None, "cp")
        mapped = jax.shard_map(local, mesh=mesh, in_specs=(split,) * 3,
                               out_specs=(split, P(None, None, "cp")))

        def put(x, axis=1):
            spec = P(None, None, "cp") if axis == 2 else split
            return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec),
                                                lambda index: x[index])
        (_, (out, lse)), (dq, dk, dv) = grads(mapped)(
            put(order(q)), put(order(k)), put(order(v)), put(order(d_out)),
            put(order(d_lse, 2), 2))
        worst = 0.0
        for name, got in (("out", out), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
            ref = natural_want[name]
            scale = max(float(np.max(np.abs(ref))), 1.0)
            for shard in got.addressable_shards:
                diff = np.abs(np.asarray(shard.data) - ref[shard.index])
                worst = max(worst, float(diff.max()) / scale)
        report[f"{layout}-{strategy}"] = worst
    print(json.dumps(report), flush=True)
    jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_match_the_unsharded_call():
    port = _free_port()
    env = fake_devices_env(LOCAL_DEVICES)
    procs = [subprocess.Popen([sys.executable, str(pathlib.Path(__file__).resolve()), "--worker",
                               str(i), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
             for i in range(PROCESSES)]
    outputs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"worker failed:\n{stdout[-2000:]}\n{stderr[-5000:]}"
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for report in outputs:
        assert report["devices"] == PROCESSES * LOCAL_DEVICES
        assert report["processes"] == PROCESSES
        for case in ("zigzag-ring", "contiguous-all_gather"):
            assert report[case] <= 1e-5, (case, report)


if __name__ == "__main__" and "--worker" in sys.argv:
    _worker(int(sys.argv[2]), int(sys.argv[3]))
