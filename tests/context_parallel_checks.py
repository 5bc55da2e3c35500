"""The context-parallel checks: each `CPCase` runs `ffpa_jax.attention` with the sequence
split over a mesh axis (inside a `shard_map` with context_axis, or under `jax.jit` with
sequence-sharded inputs) and compares out, lse and every gradient with the unsharded call.

tests/test_context_parallel.py runs them on fake CPU devices (one subprocess), and
scripts/cp_gpu.py on GPUs. A case's report is JSON: the worst scale-relative difference
against the unsharded call of the same tier in the same precision (float32: "rel", to be
<= 1e-5), or for 16-bit inputs the tolerance rule against the float64 reference ("rule":
None or the failure), plus what the jit cases' HLO gathers; or "skip" with the reason (a
tier that cannot place blocks of a sequence yet).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import time
import traceback
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import ffpa_jax
from ffpa_jax.layout import zigzag_order
from pallas_kernels import tiers
from pallas_kernels.problem import FeatureArrays, Inputs, Problem

AXIS = "cp"
SHARD_MAP, JIT_AUTO, JIT_EXPLICIT = "shard_map", "jit_auto", "jit_explicit"
# "shared_dropout": dropout with one mask shared by every batch row and head.
FEATURES = ("window", "window_both", "segments", "lengths", "sinks", "softcap", "bias",
            "mask", "dropout", "shared_dropout")


@dataclasses.dataclass(frozen=True)
class CPCase:
    name: str
    devices: int = 4
    layout: str = "contiguous"
    strategy: str | None = "ring"
    causal: bool = True
    b: int = 1
    t: int = 64
    hq: int = 4
    hkv: int = 2
    d: int = 16
    dtype: str = "float32"
    features: tuple[str, ...] = ()
    tier: str | None = "xla"  # None: the dispatcher's choice, block by block
    interpret: bool = False
    check_vma: bool = True
    mode: str = SHARD_MAP
    # > 1: a mesh ("data", "cp") of data × devices / data, batch split over "data" too
    # (the case's batch-indexed arrays then must not be closed over: no lengths, no mask).
    data: int = 1
    # > 0: the chunked tier's workspace budget in MiB ($FFPA_CHUNKED_BUDGET_MIB while the
    # case is traced): small blocks, so that a shard's rows and keys are walked in loops.
    chunk_budget_mib: float = 0.0
    # > 0: the ring backward's rounds (context_ring.round_bytes while the case is traced, so
    # small that these shapes go around in `ring_rounds` rounds).
    ring_rounds: int = 0

    @property
    def parts(self) -> int:
        """The size of the context axis."""
        return self.devices // self.data


# ---------------------------------------------------------------- inputs and the calls


def semantics(case: CPCase) -> CPCase:
    """What the unsharded call of a case depends on (cases that differ only in how they
    split the sequence share inputs and reference)."""
    return dataclasses.replace(case, name="", layout="", strategy=None, mode="",
                               check_vma=True, devices=0)


def _arrays(case: CPCase) -> dict:
    rng = np.random.default_rng(zlib.crc32(repr(semantics(case)).encode()))
    normal = lambda *s, dtype=case.dtype: jnp.asarray(
        rng.standard_normal(s, np.float32).astype(jnp.dtype(dtype)))
    b, t = case.b, case.t
    x = dict(q=normal(b, t, case.hq, case.d), k=normal(b, t, case.hkv, case.d),
             v=normal(b, t, case.hkv, case.d), d_out=normal(b, t, case.hq, case.d,
                                                            dtype="float32"),
             d_lse=normal(b, case.hq, t, dtype="float32"))
    f = set(case.features)
    seq, shared, diff = {}, {}, {}
    if "segments" in f:
        seq["q_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 4, (b, t)), 1), jnp.int32)
        seq["kv_segment_ids"] = jnp.asarray(np.sort(rng.integers(0, 3, (b, t)), 1), jnp.int32)
    if "lengths" in f:
        shared["query_seq_lengths"] = jnp.asarray(rng.integers(t // 2, t + 1, b), jnp.int32)
        shared["key_value_seq_lengths"] = jnp.asarray(rng.integers(t // 3, t, b), jnp.int32)
    if "sinks" in f:
        diff["sinks"] = normal(case.hq, dtype="float32")
    if "bias" in f:
        diff["bias"] = normal(1, case.hq, 1, 1, dtype="float32")
    if "mask" in f:  # broadcast over both sequence dims: batch 0 sees keys, batch 1 none
        shared["mask"] = jnp.asarray(np.arange(b) == 0).reshape(b, 1, 1, 1)
    if f & {"dropout", "shared_dropout"}:
        shared["dropout_rng"] = jax.random.key(7)
    return dict(x, seq=seq, shared=shared, diff=diff)


def _statics(case: CPCase) -> dict:
    f = set(case.features)
    kw = dict(is_causal=case.causal, return_lse=True, implementation=case.tier,
              interpret=case.interpret)
    if "window" in f:
        kw["local_window_size"] = (case.t // 6, 0)  # short of the packed segments
    if "window_both" in f:
        kw["local_window_size"] = (case.t // 8, case.t // 6)
    if "softcap" in f:
        kw["logits_soft_cap"] = 3.0
    if "dropout" in f:
        kw["dropout_rate"] = 0.25
    if "shared_dropout" in f:
        kw.update(dropout_rate=0.25, dropout_broadcast=True)
    return kw


def _loss(attn, d_out, d_lse):
    """value_and_grad over (q, k, v, diff) of <out, d_out> + <lse, d_lse> (finite lse)."""
    def loss(q, k, v, diff):
        out, lse = attn(q, k, v, diff)
        value = jnp.sum(out.astype(jnp.float32) * d_out)
        value += jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * d_lse)
        return value, (out, lse)
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)


def _unsharded(case: CPCase, a: dict):
    kw = _statics(case)
    attn = lambda q, k, v, diff: ffpa_jax.attention(q, k, v, **a["seq"], **a["shared"],
                                                    **diff, **kw)
    return jax.jit(_loss(attn, a["d_out"], a["d_lse"]))


def _mesh(case: CPCase, explicit: bool = False):
    kind = jax.sharding.AxisType.Explicit if explicit else jax.sharding.AxisType.Auto
    devices = np.array(jax.devices()[:case.devices])
    if case.data == 1:
        return jax.sharding.Mesh(devices, (AXIS,), axis_types=(kind,))
    return jax.sharding.Mesh(devices.reshape(case.data, -1), ("data", AXIS),
                             axis_types=(kind, kind))


def _split(case: CPCase, rows: bool = False) -> P:
    """The spec of a [B, T, ...] array (`rows`: of lse, [B, H, T])."""
    batch = "data" if case.data > 1 else None
    return P(batch, None, AXIS) if rows else P(batch, AXIS)


def _sharded_shard_map(case: CPCase, a: dict):
    """f(q, k, v, diff) -> the loss's value_and_grad with the call inside a shard_map. The
    inputs (and the cotangents) are put in the layout's order on the host first, and the
    results back in the natural order after (the reorder is no part of what is tested)."""
    kw = _statics(case)
    n, zig = case.parts, case.layout == "zigzag"
    order = (lambda x, axis=1: _reorder(x, n, axis)) if zig else (lambda x, axis=1: x)
    natural = (lambda x, axis=1: _reorder(x, n, axis, inverse=True)) if zig else (
        lambda x, axis=1: x)

    def local(q, k, v, seq, diff):
        return ffpa_jax.attention(q, k, v, **seq, **a["shared"], **diff, context_axis=AXIS,
                                  context_layout=case.layout,
                                  context_strategy=case.strategy, **kw)
    split = _split(case)
    mapped = jax.shard_map(local, mesh=_mesh(case), in_specs=(split, split, split, split, P()),
                           out_specs=(split, _split(case, rows=True)),
                           check_vma=case.check_vma)
    seq = {name: order(x) for name, x in a["seq"].items()}
    loss = jax.jit(_loss(lambda q, k, v, diff: mapped(q, k, v, seq, diff),
                         order(a["d_out"]), order(a["d_lse"], 2)))

    def run(q, k, v, diff):
        (value, (out, lse)), (dq, dk, dv, d_diff) = loss(order(q), order(k), order(v), diff)
        return ((value, (natural(out), natural(lse, 2))),
                (natural(dq), natural(dk), natural(dv), d_diff))
    return run


def _reorder(x, parts: int, axis: int, inverse: bool = False):
    """`ffpa_jax.zigzag` (or `unzigzag`) on the host, as one NumPy take (the eager JAX
    version would compile each of its slices for every shape)."""
    x = np.asarray(x)
    chunk = x.shape[axis] // (2 * parts)
    order = np.asarray(zigzag_order(parts))
    if inverse:
        order = np.argsort(order)
    index = (order[:, None] * chunk + np.arange(chunk)[None, :]).reshape(-1)
    return jnp.asarray(np.take(x, index, axis=axis))


def _sharded_jit(case: CPCase, a: dict):
    """(compiled loss, its arguments) of the call under jit on sequence-sharded inputs."""
    kw = _statics(case)
    if case.strategy is not None:
        kw["context_strategy"] = case.strategy
    mesh = _mesh(case, explicit=case.mode == JIT_EXPLICIT)
    split = NamedSharding(mesh, _split(case))
    seq = {name: jax.device_put(x, split) for name, x in a["seq"].items()}
    attn = lambda q, k, v, diff: ffpa_jax.attention(q, k, v, **seq, **a["shared"], **diff,
                                                    **kw)
    args = [jax.device_put(a[name], split) for name in ("q", "k", "v")]
    args.append(jax.device_put(a["diff"], NamedSharding(mesh, P())))
    with jax.set_mesh(mesh):
        compiled = jax.jit(_loss(attn, a["d_out"], a["d_lse"])).lower(*args).compile()
    return compiled, args


# ---------------------------------------------------------------- comparisons


def _rel(got, want) -> float:
    """The worst over leaves of max|got − want| / max(max|want|, 1) (−inf entries must
    match exactly)."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        bad = ~np.isfinite(y)
        if bad.any() and not np.array_equal(x[bad], y[bad]):
            return float("inf")
        x, y = np.where(bad, 0.0, x), np.where(bad, 0.0, y)
        scale = max(float(np.max(np.abs(y), initial=0.0)), 1.0)
        worst = max(worst, float(np.max(np.abs(x - y), initial=0.0)) / scale)
    return worst


def _results(result):
    """(out, lse, dq, dk, dv, d_diff) of a loss's value_and_grad."""
    (_, (out, lse)), (dq, dk, dv, d_diff) = result
    return out, lse, dq, dk, dv, d_diff


def _rule(case: CPCase, a: dict, got) -> str | None:
    """The tolerance rule of attn_testing against the float64 reference, the case's features
    and dropout's keep decisions given to it as to the call (None: passed)."""
    from attn_testing import Case, assert_forward_matches, assert_matches_reference, \
        reference_vjp
    kw = _statics(case)
    ref_case = Case(b=case.b, t=case.t, s=case.t, hq=case.hq, hkv=case.hkv, d=case.d,
                    causal=case.causal, dtype=case.dtype)
    features = dict(a["seq"], **{name: a["shared"][name] for name in
                                 ("query_seq_lengths", "key_value_seq_lengths")
                                 if name in a["shared"]})
    features.update({name: kw[name] for name in ("local_window_size", "logits_soft_cap")
                     if name in kw})
    if "sinks" in a["diff"]:
        features["sinks"] = a["diff"]["sinks"]
    rate = kw.get("dropout_rate", 0.0)
    keep = None
    if rate:
        shape = (case.b, case.hq, case.t, case.t)
        keep = jnp.broadcast_to(ffpa_jax.dropout_mask(
            a["shared"]["dropout_rng"], shape, rate,
            broadcast=kw.get("dropout_broadcast", False)), shape)
    args = (ref_case, a["q"], a["k"], a["v"], a["diff"].get("bias"), a["shared"].get("mask"),
            a["d_out"], a["d_lse"])
    refs = dict(keep=keep, rate=rate, features=features)
    out64, lse64, grads64 = reference_vjp(*args, float64=True, **refs)
    out_x, lse_x, grads_x = reference_vjp(*args, float64=False, **refs)
    out, lse, dq, dk, dv, _ = got
    try:
        assert_forward_matches(out, lse, (out64, lse64), (out_x, lse_x), case.dtype)
        for name, g, g64, gx in zip(("dq", "dk", "dv"), (dq, dk, dv), grads64, grads_x):
            assert_matches_reference(name, g, g64, gx, case.dtype, factor=3.0)
    except AssertionError as e:
        return str(e)
    return None


def _gathered_shapes(compiled) -> list[str]:
    """The result shapes of the all-gathers in a compiled program."""
    shapes = []
    for line in compiled.as_text().splitlines():
        if " all-gather(" in line or "all-gather-start(" in line:
            m = re.search(r"=\s*\(?\s*([a-z0-9]+\[[0-9,]*\])", line)
            if m:
                shapes.append(m.group(1))
    return shapes


def shape_str(dtype: str, shape) -> str:
    name = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}[dtype]
    return f"{name}[{','.join(map(str, shape))}]"


def gathers_q(entry: dict) -> list[str]:
    """The all-gathers of a jit case's report whose result holds as many elements as the
    whole q (q gathered, in whatever layout the partitioner gave it)."""
    def size(shape: str) -> int:
        dims = shape[shape.index("[") + 1:-1]
        return int(np.prod([int(x) for x in dims.split(",") if x]))
    return [g for g in entry["gathered"] if size(g) == size(entry["q_shape"])]


# ---------------------------------------------------------------- tiers and positions


def tier_lacks_positions(tier: str) -> str | None:
    """Why `tier` cannot run context-parallel blocks yet (None: it can): what the tier
    registry says of placing a causal block problem (`Problem.positions`). Only what it says
    of positions counts: the probe's other traits (float32, its sizes) are no case's."""
    problem = _probe_problem()
    missing = sorted({m for d in ("forward", "backward")
                      for m in tiers.BY_NAME[tier].unsupported(problem, d) if "positions" in m})
    return f"the {tier} tier does not implement {', '.join(missing)} yet" if missing else None


def _probe_problem() -> Problem:
    return Problem(batch=1, seq_q=64, seq_k=128, heads_q=2, heads_kv=1, head_dim=16,
                   head_dim_v=16, dtype=jnp.float32, scale=0.25, causal=True,
                   positions=True, return_lse=True)


def positioned_block_matches_dense(tier: str, interpret: bool) -> bool:
    """Whether `tier` computes a causal block of a longer sequence (positions placing its
    diagonal off the default) as the dense tier does, bypassing what the registry says."""
    import tuning
    problem = _probe_problem()
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal(s, np.float32))
               for s in ((1, 64, 2, 16), (1, 128, 1, 16), (1, 128, 1, 16)))
    inputs = Inputs(q, k, v, features=FeatureArrays(positions=jnp.asarray([96, 0, 96],
                                                                          jnp.int32)))
    want = tiers.forward(tuning.plan_for_tiers(problem, "xla", "xla"), inputs)
    try:
        plan = tuning.plan_for_tiers(problem, tier, tier, interpret=interpret)
        got = tiers.forward(plan, inputs)
    except Exception:  # noqa: BLE001  (a tier that rejects positions does not compute them)
        return False
    return _rel(got[:2], want[:2]) <= 1e-5


@contextlib.contextmanager
def simulated_h100():
    """While inside, the dispatcher sees an H100 whose JAX runs the Mosaic kernels (tuned
    files left out), so that a call on CPU devices plans the Mosaic tier and lowers for
    CUDA; nothing runs."""
    import pytest

    from pallas_kernels import compat
    from tuning import dispatch
    device = dispatch.Device(nvidia_gpu=True, name="Simulated H100", compute_capability="9.0")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compat, "mosaic_gpu_runs", lambda: True)
        patch.setattr(dispatch.Device, "current", classmethod(lambda cls: device))
        patch.setenv("FFPA_SKIP_PERSIST_TUNED_CONFIG", "1")
        yield


def mosaic_lowering_report(devices: int = 4) -> dict:
    """Whether a context-parallel call with its blocks on the Mosaic tier lowers for CUDA
    (forward and backward, a simulated H100, `devices` CPU devices) inside a shard_map: the
    ring with zigzag, the all-gather, and the halo of a window with zigzag. Each entry: the
    number of Mosaic GPU kernel calls and of `lax.switch`es in the lowered program, or the
    error. (Under jit alone, sequence-sharded inputs are split when the program is
    partitioned, which lowering for CUDA here does not reach.)"""
    mesh = jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices],
                         axis_types=(jax.sharding.AxisType.Auto,))
    split = NamedSharding(mesh, P(None, AXIS))
    q = jax.ShapeDtypeStruct((1, 256 * devices, 8, 128), jnp.bfloat16, sharding=split)
    kv = jax.ShapeDtypeStruct((1, 256 * devices, 2, 128), jnp.bfloat16, sharding=split)

    def in_shard_map(**kw):
        return jax.shard_map(
            lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=True, context_axis=AXIS,
                                               implementation="mosaic", **kw),
            mesh=mesh, in_specs=(P(None, AXIS),) * 3, out_specs=P(None, AXIS))
    calls = dict(
        ring_zigzag=in_shard_map(context_layout="zigzag", context_strategy="ring"),
        all_gather=in_shard_map(context_strategy="all_gather"),
        halo_zigzag=in_shard_map(context_layout="zigzag", context_strategy="halo",
                                 local_window_size=(100, 0)))
    report = {}
    with simulated_h100(), jax.set_mesh(mesh):
        for name, attn in calls.items():
            def loss(q, k, v, attn=attn):
                return jnp.sum(attn(q, k, v).astype(jnp.float32))
            try:
                text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(
                    lowering_platforms=("cuda",)).as_text()
                report[name] = dict(kernels=text.count("mosaic_gpu"),
                                    switches=text.count("stablehlo.case"))
            except Exception as e:  # noqa: BLE001  (reported; the test shows it)
                report[name] = f"{type(e).__name__}: {e}"[:1500]
    return report


def permuted_keys_report(devices: int = 4) -> dict:
    """The keys (dim 1) of every array a context-parallel call's forward and backward pass
    between devices (`collective_permute` in the lowered program), per strategy: a causal
    window of 100 keys, T = 1024 per device, contiguous, on the dense tier."""
    mesh = jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices],
                         axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.ShapeDtypeStruct((1, 1024 * devices, 2, 16), jnp.float32)
    report = {}
    for strategy in ("halo", "ring"):
        attn = jax.shard_map(
            functools.partial(ffpa_jax.attention, is_causal=True, local_window_size=(100, 0),
                              implementation="xla", context_axis=AXIS,
                              context_strategy=strategy),
            mesh=mesh, in_specs=(P(None, AXIS),) * 3, out_specs=P(None, AXIS))
        loss = lambda q, k, v, attn=attn: jnp.sum(attn(q, k, v))  # noqa: E731
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower().as_text()
        report[strategy] = [int(shape.split("x")[1]) for shape in re.findall(
            r'"stablehlo.collective_permute".*: \(tensor<([0-9x]+)', text)]
    return report


def switches_report(devices: int = 4) -> dict:
    """The `lax.switch`es (`stablehlo.case`) in the lowered forward and backward of a causal
    zigzag call over `devices` CPU devices, per tier and strategy (the ring; the halo of a
    window of 100 keys): the interpreted fused kernels (which skip by a block's runtime
    shift) and the dense tier (which does not)."""
    mesh = jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices],
                         axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.ShapeDtypeStruct((1, 256 * devices, 2, 16), jnp.float32)
    report = {}
    for tier, interpret in (("pallas", True), ("xla", False)):
        for strategy, window in (("ring", None), ("halo", (100, 0))):
            attn = jax.shard_map(
                functools.partial(ffpa_jax.attention, is_causal=True, local_window_size=window,
                                  implementation=tier, interpret=interpret, context_axis=AXIS,
                                  context_layout="zigzag", context_strategy=strategy),
                mesh=mesh, in_specs=(P(None, AXIS),) * 3, out_specs=P(None, AXIS),
                check_vma=False)
            loss = lambda q, k, v, attn=attn: jnp.sum(attn(q, k, v))  # noqa: E731
            text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x).lower().as_text()
            report[f"{tier}/{strategy}"] = text.count("stablehlo.case")
    return report


def ring_rounds_memory_report(devices: int = 4, rounds=(1, 4)) -> dict:
    """XLA's planned temporaries (MiB per device, CPU) of a context-parallel ring's forward
    and backward on the chunked tier (zigzag, causal, bf16, T = 512 per device, H = 8,
    D = 512: the float32 dK and dV of a shard, "accumulators", dominate) with the backward
    in each number of `rounds`."""
    from ffpa_jax import context_ring
    mesh = jax.make_mesh((devices,), (AXIS,), devices=jax.devices()[:devices],
                         axis_types=(jax.sharding.AxisType.Auto,))
    split = NamedSharding(mesh, P(None, AXIS))
    t, h, d = 512 * devices, 8, 512
    x = jax.ShapeDtypeStruct((1, t, h, d), jnp.bfloat16, sharding=split)
    accumulators = 4 * (t // devices) * h * 2 * d
    attn = jax.shard_map(
        lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=True, context_axis=AXIS,
                                           context_layout="zigzag", context_strategy="ring",
                                           implementation="chunked"),
        mesh=mesh, in_specs=(P(None, AXIS),) * 3, out_specs=P(None, AXIS))

    def loss(q, k, v, d_out):
        return jnp.sum(attn(q, k, v).astype(jnp.float32) * d_out)
    report = {"accumulators": accumulators / 2**20}
    before = context_ring.round_bytes
    try:
        for count in rounds:
            context_ring.round_bytes = lambda count=count: accumulators // count
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(x, x, x, x).lower(
                ).compile()
            report[str(count)] = compiled.memory_analysis().temp_size_in_bytes / 2**20
    finally:
        context_ring.round_bytes = before
    return report


@contextlib.contextmanager
def standin_tier(name: str = "chunked"):
    """The tier `name` replaced, while inside, by a stand-in for a tier with a backward of
    its own that places blocks of a sequence: the dense forward, and a backward that takes
    the merged out and lse as `Saved` (the contract of a positioned block's backward,
    docs/context_parallel.md), here through JAX's vjp of the dense forward. It runs the
    paths that only such tiers take (the ring's `tiers.backward` of a block, the planned
    call's own sequence split under jit) whatever the kernels support yet."""
    from ffpa_jax import context_blocks
    from pallas_kernels import dense

    def forward(plan, inputs):
        out, lse = dense.forward(plan, inputs)
        return (out, lse, jnp.zeros_like(lse)) if plan.problem.lse_pair else (out, lse)

    def backward(plan, inputs, saved, cotangents):
        # `tiers.backward` made the lengths the block's own already: the vjp's forward
        # must not do it again.
        real = tiers.forward
        tiers.forward = lambda plan, inputs: tiers.BY_NAME[plan.forward_tier].forward(
            plan, inputs)
        try:
            return context_blocks._vjp_backward(plan, inputs, saved, cotangents)
        finally:
            tiers.forward = real
    original = tiers.BY_NAME[name]
    tiers.BY_NAME[name] = dataclasses.replace(original, forward=forward, backward=backward,
                                              unsupported=lambda problem, direction: ())
    context_blocks._plan.cache_clear()
    try:
        yield
    finally:
        tiers.BY_NAME[name] = original
        context_blocks._plan.cache_clear()


# ---------------------------------------------------------------- one case


def run_case(case: CPCase, references: dict | None = None) -> dict:
    """The report of one case (see the module docstring). `references` caches the
    unsharded results by their semantics (cases that differ in layout or strategy only
    share one)."""
    start = time.time()
    lacking = None if case.tier in ("xla", None) else tier_lacks_positions(case.tier)
    if lacking:
        return dict(skip=lacking)
    try:
        with _chunk_budget(case.chunk_budget_mib), _ring_rounds(case):
            return _run_case(case, references, start)
    except Exception as e:  # noqa: BLE001  (reported; the test shows it)
        return dict(error=f"{type(e).__name__}: {e}"[:2000], trace=traceback.format_exc()[-3000:])


@contextlib.contextmanager
def _chunk_budget(mib: float):
    if not mib:
        yield
        return
    from pallas_kernels.chunked_plan import BUDGET_ENV
    before = os.environ.get(BUDGET_ENV)
    os.environ[BUDGET_ENV] = str(mib)
    try:
        yield
    finally:
        if before is None:
            del os.environ[BUDGET_ENV]
        else:
            os.environ[BUDGET_ENV] = before


@contextlib.contextmanager
def _ring_rounds(case: CPCase):
    """context_ring.round_bytes such that the case's float32 dK, dV per shard go around in
    `case.ring_rounds` rounds (the rule then halves the key pieces that many times: the
    case's pieces must divide)."""
    from ffpa_jax import context_ring
    if not case.ring_rounds:
        yield
        return
    local = case.t // case.parts
    accumulators = 4 * case.b * local * case.hkv * 2 * case.d
    before, rule = context_ring.round_bytes, context_ring.rounds
    context_ring.round_bytes = lambda: accumulators // case.ring_rounds

    def recorded(call):
        count = rule(call)
        ROUNDS_SEEN.append(count)
        return count
    context_ring.rounds = recorded
    try:
        yield
    finally:
        context_ring.round_bytes, context_ring.rounds = before, rule


ROUNDS_SEEN: list[int] = []  # the rounds of the backwards traced under `_ring_rounds`


def _run_case(case: CPCase, references: dict | None, start: float) -> dict:
    a = _arrays(case)
    args = (a["q"], a["k"], a["v"], a["diff"])
    key = semantics(case)
    references = {} if references is None else references
    report: dict = {}
    if case.mode == SHARD_MAP:
        got = _results(_sharded_shard_map(case, a)(*args))
    else:
        compiled, jit_args = _sharded_jit(case, a)
        result = compiled(*jit_args)
        got = _results(result)
        report["gathered"] = _gathered_shapes(compiled)
        report["q_shape"] = shape_str(case.dtype, a["q"].shape)
        report["out_spec"] = str(tuple(result[0][1][0].sharding.spec))
    if case.dtype == "float32":
        if key not in references:
            references[key] = _results(_unsharded(case, a)(*args))
        report["rel"] = _rel(got, references[key])
    else:
        report["rule"] = _rule(case, a, got)
    if case.ring_rounds:
        report["rounds"] = sorted(set(ROUNDS_SEEN))
        ROUNDS_SEEN.clear()
    report["seconds"] = round(time.time() - start, 1)
    return report

