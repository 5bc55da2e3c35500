"""`ffpa_jax.attention` under `jax.jit` with inputs sharded over a `Mesh`.

CPU: a subprocess with 4 fake CPU devices (XLA_FLAGS must be set before JAX starts)
runs every check below once; each test reads its part of the report. GPU (marked
`gpu`, needs >= 2 GPUs): the same checks in-process on the real kernels.

What is checked, for forward + backward (jit of value_and_grad):
- batch-sharded, head-sharded (GQA 8/4) and both (2x2 mesh): the compiled HLO
  has no all-gather and no all-to-all (the kernels run on local shards; the only
  collectives are all-reduces of the loss and of a broadcast bias's gradient),
  outputs keep the input sharding, and every result equals the unsharded call;
- control: the same call on the bare kernels (no partitioning wrapper) *does*
  all-gather, so the HLO check can fail;
- fallbacks stay correct: a sequence-sharded input, and MQA (Hkv = 1) sharded over
  heads (not divisible: replicated) give the unsharded result;
- the XLA path (GSPMD partitions plain jnp) has no all-gather either;
- dropout under batch/head sharding gives the unsharded result (same mask), also with one
  mask shared by every batch row and head (dropout_broadcast);
- inside a user's `shard_map` (check_vma=False) the result equals the unsharded one.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from fake_devices import worker_report

# One worker runs the module: its tests share one subprocess report (conftest.py).
pytestmark = pytest.mark.shared_report

GATHERS = ("all-gather", "all-to-all")
COLLECTIVES = GATHERS + ("all-reduce", "collective-permute", "reduce-scatter")


# ----------------------------------------------------------------- the checks
def _collectives(compiled) -> list[str]:
    text = compiled.as_text()
    return sorted(c for c in COLLECTIVES if c in text)


def _gather_lines(compiled) -> list[str]:
    """The HLO instructions that gather (for the failure message)."""
    return [line.strip()[:240] for line in compiled.as_text().splitlines()
            if any(f" {g}(" in line or f"{g}-start(" in line for g in GATHERS)][:6]


def _rel_diff(got, ref) -> float:
    """max over leaves of max|got - ref| / max(max|ref|, 1): relative to each leaf's scale."""
    worst = 0.0
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        scale = max(float(np.max(np.abs(y), initial=0.0)), 1.0)
        worst = max(worst, float(np.max(np.abs(x - y), initial=0.0)) / scale)
    return worst


def _spec_str(spec) -> str:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return repr(tuple(entries))


def run_checks(interpret: bool) -> dict:
    """Every check on the local devices (4 CPU devices, or >= 2 GPUs); a JSON-able report."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import ffpa_jax
    import tuning
    from ffpa_jax import validation
    from pallas_kernels import Inputs, tiers

    devices = jax.devices()
    n = len(devices)
    report: dict = {"devices": n}
    b, t, s, hq, hkv, d = 4, 16, 16, 8, 4, 16
    ks = jax.random.split(jax.random.key(0), 6)
    q = jax.random.normal(ks[0], (b, t, hq, d))
    k = jax.random.normal(ks[1], (b, s, hkv, d))
    v = jax.random.normal(ks[2], (b, s, hkv, d))
    bias = jax.random.normal(ks[3], (1, hq, t, s))          # broadcast over batch
    mask = jax.random.bernoulli(ks[4], 0.8, (b, 1, t, s))  # broadcast over heads
    pallas = dict(implementation="pallas", interpret=interpret)

    def loss_fn(**kw):
        def loss(q, k, v, bias):
            out, lse = ffpa_jax.attention(q, k, v, bias, mask, is_causal=True, return_lse=True,
                                          **kw)
            finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
            return jnp.sum(out * jnp.cos(out)) + jnp.sum(finite), out
        return jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)

    def sharded_run(fn, mesh, spec, *args):
        sh = NamedSharding(mesh, spec)
        placed = [jax.device_put(x, sh) for x in args[:3]] + list(args[3:])
        compiled = jax.jit(fn).lower(*placed).compile()
        return compiled, compiled(*placed)

    line = Mesh(np.array(devices), ("x",))
    cases = {"batch": (line, P("x")), "heads": (line, P(None, None, "x"))}
    if n >= 4:
        cases["batch_and_heads"] = (Mesh(np.array(devices[:4]).reshape(2, 2), ("d", "m")),
                                    P("d", None, "m"))
    # Explicit mesh axes (sharding in types, jax.make_mesh's default): a shard_map path.
    explicit = Mesh(np.array(devices), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    explicit_cases = {"explicit_batch": (explicit, P("x")),
                      "explicit_heads": (explicit, P(None, None, "x"))}
    for impl_name, kw in (("pallas", pallas), ("xla", dict(implementation="xla"))):
        fn = loss_fn(**kw)
        reference = jax.jit(fn)(q, k, v, bias)
        for name, (mesh, spec) in {**cases, **explicit_cases}.items():
            if impl_name == "xla" and name not in ("batch", "heads"):
                continue
            compiled, got = sharded_run(fn, mesh, spec, q, k, v, bias)
            (_, out), _ = got
            report[f"{impl_name}/{name}"] = dict(
                collectives=_collectives(compiled), gathers=_gather_lines(compiled),
                rel_diff=_rel_diff(got, reference),
                out_spec=_spec_str(out.sharding.spec), in_spec=_spec_str(spec))

    # The LLM features (issue 24) on the chunked tier: the segment ids and lengths split with
    # the batch, the sinks with the heads; dsinks' sum over batch shards is an all-reduce.
    q_ids = jnp.sort(jax.random.randint(ks[5], (b, t), 0, 3), axis=1)
    kv_ids = jnp.sort(jax.random.randint(ks[4], (b, s), 0, 3), axis=1)
    kv_len = jnp.asarray([16, 9, 12, 16], jnp.int32)[:b]
    sinks = jax.random.normal(ks[3], (hq,))

    def features_loss(q, k, v, sinks):
        out, lse = ffpa_jax.attention(
            q, k, v, is_causal=True, return_lse=True, implementation="chunked",
            q_segment_ids=q_ids, kv_segment_ids=kv_ids, key_value_seq_lengths=kv_len,
            sinks=sinks, local_window_size=(5, 0), logits_soft_cap=3.0)
        return jnp.sum(out * jnp.cos(out)) + jnp.sum(lse), out
    fn = jax.value_and_grad(features_loss, argnums=(0, 1, 2, 3), has_aux=True)
    reference = jax.jit(fn)(q, k, v, sinks)
    for name, (mesh, spec) in {**cases, **explicit_cases}.items():
        compiled, got = sharded_run(fn, mesh, spec, q, k, v, sinks)
        (_, out), _ = got
        report[f"features/{name}"] = dict(
            collectives=_collectives(compiled), gathers=_gather_lines(compiled),
            rel_diff=_rel_diff(got, reference), out_spec=_spec_str(out.sharding.spec),
            in_spec=_spec_str(spec))

    # Control: the bare kernels, not wrapped, gather under the same batch sharding.
    problem = validation.validate(q, k, v, bias, mask, scale=None, is_causal=True,
                                  dropout_rate=0.0, dropout_rng=None, return_lse=False,
                                  **pallas).problem
    plan = tuning.plan(problem, "pallas", interpret=interpret)
    bare = lambda q, k, v, bias: tiers.forward(plan, Inputs(q, k, v, bias, mask))
    compiled, _ = sharded_run(bare, line, P("x"), q, k, v, bias)
    report["control/bare_kernels"] = dict(collectives=_collectives(compiled))

    # Fallbacks: sequence-sharded inputs; MQA heads that the mesh cannot divide.
    fwd = lambda q, k, v: ffpa_jax.attention(q, k, v, bias, mask, is_causal=True, **pallas)
    compiled, got = sharded_run(fwd, line, P(None, "x"), q, k, v)
    report["fallback/sequence"] = dict(rel_diff=_rel_diff(got, jax.jit(fwd)(q, k, v)))
    k1, v1 = k[:, :, :1], v[:, :, :1]
    sh_q = NamedSharding(line, P(None, None, "x"))
    got = jax.jit(fwd)(jax.device_put(q, sh_q), k1, v1)
    report["fallback/mqa_heads"] = dict(rel_diff=_rel_diff(got, jax.jit(fwd)(q, k1, v1)))

    # Dropout: the same keep-mask whether or not the call is sharded.
    drop = lambda q, k, v, rng: ffpa_jax.attention(q, k, v, dropout_rate=0.3, dropout_rng=rng,
                                                   **pallas)
    rng = jax.random.key(7)
    reference = jax.jit(drop)(q, k, v, rng)
    for name, (mesh, spec) in {**cases, **explicit_cases}.items():
        compiled, got = sharded_run(drop, mesh, spec, q, k, v, rng)
        report[f"dropout/{name}"] = dict(rel_diff=_rel_diff(got, reference),
                                         collectives=_collectives(compiled))

    # One mask shared by every batch row and head (dropout_broadcast): each shard draws the
    # unsharded call's mask, not its slice of an unshared one; forward and backward.
    def shared_loss(q, k, v, rng):
        out = ffpa_jax.attention(q, k, v, dropout_rate=0.3, dropout_rng=rng,
                                 dropout_broadcast=True, **pallas)
        return jnp.sum(out * jnp.cos(out)), out
    shared = jax.value_and_grad(shared_loss, argnums=(0, 1, 2), has_aux=True)
    reference = jax.jit(shared)(q, k, v, rng)
    report["dropout_broadcast/unshared"] = dict(
        rel_diff=_rel_diff(reference[0][1], jax.jit(drop)(q, k, v, rng)))
    for name in ("batch", "batch_and_heads"):  # a head split's offsets: in the second
        if name in cases:
            compiled, got = sharded_run(shared, *cases[name], q, k, v, rng)
            report[f"dropout_broadcast/{name}"] = dict(rel_diff=_rel_diff(got, reference),
                                                       collectives=_collectives(compiled))

    # Inside a user's shard_map (batch split by the user).
    from jax import shard_map
    smap = shard_map(lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=True, **pallas),
                     mesh=line, in_specs=P("x"), out_specs=P("x"), check_vma=False)
    got = jax.jit(smap)(q, k, v)
    plain = jax.jit(lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=True, **pallas))
    report["shard_map"] = dict(rel_diff=_rel_diff(got, plain(q, k, v)))
    # shard_map's default check_vma=True: the kernels must type their outputs as varying.
    try:
        smap = shard_map(lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=True, **pallas),
                         mesh=line, in_specs=P("x"), out_specs=P("x"))
        got = jax.jit(smap)(q, k, v)
        report["shard_map_check_vma"] = dict(rel_diff=_rel_diff(got, plain(q, k, v)))
    except Exception as e:  # reported, asserted by the test
        report["shard_map_check_vma"] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
    return report


# ------------------------------------------------------------ CPU: subprocess
@pytest.fixture(scope="module")
def cpu_report() -> dict:
    return worker_report(__file__, devices=4, timeout=600)


def _check_shard_local(entry: dict, name: str) -> None:
    gathered = [c for c in entry["collectives"] if c in GATHERS]
    assert not gathered, f"{name}: compiled HLO contains {gathered}: {entry['gathers']}"
    assert entry["out_spec"] == entry["in_spec"], (
        f"{name}: output sharding {entry['out_spec']} != input sharding {entry['in_spec']}")
    assert entry["rel_diff"] <= 1e-5, f"{name}: {entry}"


@pytest.mark.parametrize("case", ["batch", "heads", "batch_and_heads", "explicit_batch",
                                  "explicit_heads"])
def test_pallas_sharded_call_runs_shard_local(cpu_report, case):
    assert cpu_report["devices"] == 4
    _check_shard_local(cpu_report[f"pallas/{case}"], case)


@pytest.mark.parametrize("case", ["batch", "heads", "batch_and_heads", "explicit_batch",
                                  "explicit_heads"])
def test_features_sharded_call_runs_shard_local(cpu_report, case):
    """Segment ids, lengths, sinks, window and soft cap on the chunked tier: the ids and
    lengths are split with the batch and the sinks with the heads, nothing is gathered."""
    _check_shard_local(cpu_report[f"features/{case}"], case)


@pytest.mark.parametrize("case", ["batch", "heads", "batch_and_heads", "explicit_batch",
                                  "explicit_heads"])
def test_dropout_sharded_call_runs_shard_local(cpu_report, case):
    """Each shard draws its slice of the unsharded keep-mask from its global (batch, head)
    offsets, so dropout needs no gather either."""
    entry = cpu_report[f"dropout/{case}"]
    gathered = [c for c in entry["collectives"] if c in GATHERS]
    assert not gathered, f"dropout/{case}: compiled HLO contains {gathered}"
    assert entry["rel_diff"] <= 1e-5, entry


@pytest.mark.parametrize("case", ["batch", "batch_and_heads"])
def test_shared_dropout_mask_sharded_call_matches_unsharded(cpu_report, case):
    """dropout_broadcast: every shard draws the one mask of the unsharded call (its
    batch and head offsets are not added), forward and gradients, without a gather."""
    entry = cpu_report[f"dropout_broadcast/{case}"]
    gathered = [c for c in entry["collectives"] if c in GATHERS]
    assert not gathered, f"dropout_broadcast/{case}: compiled HLO contains {gathered}"
    assert entry["rel_diff"] <= 1e-5, entry
    # The unshared masks differ: sharing is visible in the output.
    assert cpu_report["dropout_broadcast/unshared"]["rel_diff"] > 1e-2


def test_bare_kernels_gather_so_the_hlo_check_can_fail(cpu_report):
    assert "all-gather" in cpu_report["control/bare_kernels"]["collectives"]


@pytest.mark.parametrize("case", ["batch", "heads"])
def test_xla_path_sharded_call_runs_shard_local(cpu_report, case):
    _check_shard_local(cpu_report[f"xla/{case}"], case)


@pytest.mark.parametrize("case", ["fallback/sequence", "fallback/mqa_heads", "shard_map",
                                  "dropout/batch", "dropout/heads", "dropout/batch_and_heads"])
def test_fallbacks_dropout_and_shard_map_match_unsharded(cpu_report, case):
    entry = cpu_report[case]
    assert entry["rel_diff"] <= 1e-5, f"{case}: {entry}"


@pytest.mark.xfail(strict=True, reason=(
    "inside shard_map with check_vma=True (its default), JAX's own Pallas interpreter pads "
    "blocks with constants that are not marked varying (\"Primitive pad requires varying "
    "manual axes to match\", raised in jax/_src/pallas/hlo_interpreter.py); our pallas_call "
    "outputs do declare the query's axes (compat.output_struct); the compiled GPU kernels are "
    "checked by test_user_shard_map_with_default_check_vma_gpu; check_vma=False works here"))
def test_shard_map_with_check_vma(cpu_report):
    entry = cpu_report["shard_map_check_vma"]
    assert "error" not in entry, entry["error"]
    assert entry["rel_diff"] <= 1e-5, entry


# ----------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_sharded_calls():
    if len(jax.devices()) < 2:
        pytest.skip("needs >= 2 GPUs")
    report = run_checks(interpret=False)
    for case in ("batch", "heads", "batch_and_heads", "explicit_batch", "explicit_heads"):
        if f"pallas/{case}" in report:
            _check_shard_local(report[f"pallas/{case}"], case)
        if f"features/{case}" in report:
            _check_shard_local(report[f"features/{case}"], case)
    assert "all-gather" in report["control/bare_kernels"]["collectives"]
    for case in ("fallback/sequence", "fallback/mqa_heads", "shard_map", "dropout/batch",
                 "dropout_broadcast/batch"):
        entry = report[case]
        assert entry["rel_diff"] <= 1e-5, f"{case}: {entry}"


@pytest.mark.gpu
def test_user_shard_map_with_default_check_vma_gpu():
    """Inside a user's shard_map with its default check_vma=True, on however many GPUs
    there are (one is enough: the manual-axes check applies to any mesh). Every
    pallas_call output declares the query's varying axes (compat.output_struct).
    (On CPU, JAX's Pallas interpreter itself trips the check: see the xfail above.)
    The reference call outside the shard_map takes q/k/v sharded over jax.make_mesh's
    Explicit axis: the path ffpa_jax's own shard_map serves (on jax 0.11.2 the
    kernels' refs rejected those inputs before it existed)."""
    n = len(jax.devices())
    mesh = jax.make_mesh((n,), ("b",))
    spec = jax.sharding.PartitionSpec("b")
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (2 * n, 96, 4, 64)
    q, k, v, d_out = (jax.device_put(jax.random.normal(kk, shape, jnp.bfloat16),
                                     jax.sharding.NamedSharding(mesh, spec)) for kk in keys)
    attn = lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=True)
    smap = jax.shard_map(attn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)

    def grads(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out, *vjp(d_out))

    # Explicit axes ask for the mesh in context, as any JAX program over them does.
    with jax.set_mesh(mesh):
        got = jax.jit(lambda: grads(smap))()
        want = jax.jit(lambda: grads(attn))()
    for g, w in zip(got, want):
        assert _rel_diff(g, w) <= 1e-5


def internal_refs_report() -> dict:
    """A custom_partitioning op (4 devices) whose partition's function creates and
    consumes a mutable array inside, as Pallas' Mosaic GPU launchers do on JAX 0.11:
    lowered as traced ("as-traced") and through `compat.lowerable_by_custom_partitioning`
    ("discharged"). Each entry: the values, or the error."""
    from jax.experimental.custom_partitioning import custom_partitioning
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from pallas_kernels import compat

    def doubled(x):
        ref = jax.new_ref(jnp.zeros_like(x))
        ref[...] += 2 * x
        return ref[...]

    def build(wrap):
        op = custom_partitioning(lambda x: 2 * x)

        def partition(mesh, arg_shapes, result_shape):
            sharding = arg_shapes[0].sharding
            return sharding.mesh, wrap(doubled), sharding, (sharding,)
        op.def_partition(partition=partition, sharding_rule="i j -> i j",
                         infer_sharding_from_operands=lambda m, a, r: a[0].sharding)
        return op
    mesh = jax.make_mesh((len(jax.devices()),), ("x",),
                         axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(jnp.arange(16.0).reshape(8, 2), NamedSharding(mesh, P("x")))
    report = {}
    for name, wrap in (("as-traced", lambda f: f),
                       ("discharged", compat.lowerable_by_custom_partitioning)):
        try:
            report[name] = np.asarray(jax.jit(build(wrap))(x)).tolist()
        except Exception as e:  # reported, asserted by the test
            report[name] = f"{type(e).__name__}: {str(e)[-300:]}"
    return report


def test_a_partition_that_creates_mutable_arrays_lowers(cpu_report):
    """custom_partitioning refuses a partition function with internal mutable arrays (the
    control; where JAX's Mosaic GPU kernels made a sharded call under jit fail on GPUs);
    through `compat.lowerable_by_custom_partitioning` it lowers and computes."""
    entry = cpu_report["internal_refs"]
    assert "Cannot lower jaxpr with effects" in str(entry["as-traced"]), entry["as-traced"]
    assert entry["discharged"] == (2 * np.arange(16.0).reshape(8, 2)).tolist()


if __name__ == "__main__" and "--worker" in sys.argv:
    jnp.zeros(())  # start the backend with the XLA_FLAGS the parent set
    print(json.dumps(dict(run_checks(interpret=True), internal_refs=internal_refs_report())))
