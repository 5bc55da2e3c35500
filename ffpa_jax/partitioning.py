"""Shard-local Pallas kernels: `forward_kernels` / `backward_kernels` under sharded `jax.jit`.

A `pallas_call` is opaque to XLA's partitioner: left alone, `jax.jit` with
inputs sharded over a `Mesh` all-gathers q, k and v and runs the whole kernel on
every device. Attention is independent across batch and heads, so every device
can run the kernels on its own shard instead. This module does that with
`jax.experimental.custom_partitioning` (chosen over a `shard_map` wrapper
because under `jit` the inputs' shardings are only known to the partitioner,
after tracing; a `shard_map` wrapper would have to be told the mesh and specs).

How a call is partitioned, decided from the sharding the partitioner proposes for q:
- batch (dim 0 of q/k/v/out, of lse, of a bias/mask whose batch dim is full):
  kept sharded on q's batch mesh axes if they divide B;
- heads (dim 2 of q/k/v/out, dim 1 of lse and of a full-head bias/mask): kept
  sharded on q's head mesh axes if they divide both Hq and Hkv. Shards are
  contiguous, so the query heads of a shard read exactly the kv heads of the
  same shard (GQA group h // (Hq // Hkv));
- everything else (sequence, head dims, broadcast size-1 dims of bias/mask,
  the dropout seed) is replicated: the partitioner gathers a tensor sharded
  along those dims before the call rather than computing a wrong result.
- The backward's bias gradient of a bias broadcast over batch (or heads) is a
  sum over the sharded dim: each shard's partial sum is `psum`-ed.
- Dropout decisions depend on global (batch, head) indices; a shard's kernel
  sees local ones, so the wrapper hands its global offsets to `shift_seed`
  (provided by the caller) to fold them into the seed.

Sequence (dim 1 of q/k/v/out, dim 2 of lse, dim 1 of the segment ids) sharded over one
mesh axis: where the wrapper is given a `context` (a sequence split, `context_local`) that
supports the call, every device keeps its shard and runs context parallelism over that axis
(collectives between the devices of the axis: K/V around a ring, or gathered); q and the
output are never gathered. Otherwise the sequence is gathered, as above.

Explicit mesh axes (sharding in types) are not the partitioner's: there the
shardings are known at trace time, and `ShardLocal._explicit_call` runs the same
shard-local function under a `shard_map` instead.

Inside a user's `shard_map` (all mesh axes manual), under `pmap`, or on one
device, the partitioner is not involved and the kernels run as they are.
`jax.vmap` is handled by a `custom_vmap` rule (custom_partitioning has no batching
rule): where every array is per batch row (no bias, mask, dropout, sinks or positions)
the mapped axis folds into the batch, else it vmaps the plain kernels.

Sharding rules are given both ways: a Shardy rule string (default partitioner)
and `infer_sharding_from_operands` (GSPMD, `jax_use_shardy_partitioner=False`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from pallas_kernels import compat
from pallas_kernels.problem import Cotangents, FeatureArrays, Inputs, Saved

# Roles of the arrays that cross the kernel boundary (see `_spec`).
QKV = "qkv"    # [B, L, H, D]: batch dim 0, heads dim 2
BM = "bm"      # bias/mask [B|1, Hq|1, T|1, S|1]
LSE = "lse"    # [B, Hq, T]
REP = "rep"    # replicated (the dropout seed, a block's positions)
SEQ_Q = "seq_q"  # q_segment_ids [B, T]
SEQ_K = "seq_k"  # kv_segment_ids [B, S]
PER_BATCH = "per_batch"  # sequence lengths [B]
PER_HEAD = "per_head"  # sinks [Hq]
# The roles of `FeatureArrays`' fields, in its order.
FEATURE_ROLES = (SEQ_Q, SEQ_K, PER_BATCH, PER_BATCH, PER_HEAD, REP)
# The roles whose arrays have the batch first, one independent row per batch element.
BATCH_FIRST = (QKV, LSE, SEQ_Q, SEQ_K, PER_BATCH)

_NEED_REPLICATION = ("t", "s", "d", "e")


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Static description of one call: which arrays, their roles and shapes."""

    kind: str                              # "forward" or "backward"
    plan: Any                              # hashable kernel plan (static)
    present: tuple[bool, bool, bool]       # bias, mask, seed given
    in_roles: tuple[str, ...]
    in_shapes: tuple[tuple[int, ...], ...]
    out_roles: tuple[str, ...]
    out_shapes: tuple[tuple[int, ...], ...]
    # Which fields of the call's `FeatureArrays` are given (their arrays follow the seed).
    features: tuple[bool, ...] = (False,) * len(FEATURE_ROLES)

    @property
    def batch(self) -> int:
        return self.in_shapes[0][0]

    @property
    def heads_q(self) -> int:
        return self.in_shapes[0][2]

    @property
    def heads_kv(self) -> int:
        return self.in_shapes[1][2]


def _axes_tuple(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def _spec_entry(axes: tuple[str, ...]):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _axes_size(mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def choose_axes(layout: _Layout, q_sharding) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(batch mesh axes, head mesh axes) the kernels are split over, from q's sharding.

    Axes that do not divide the dim they shard are dropped (that dim is then
    replicated); head axes must divide both Hq and Hkv."""
    if not isinstance(q_sharding, NamedSharding):
        return (), ()
    mesh = q_sharding.mesh
    spec = tuple(q_sharding.spec) + (None,) * (4 - len(q_sharding.spec))
    batch_axes, head_axes = _axes_tuple(spec[0]), _axes_tuple(spec[2])
    if batch_axes and layout.batch % _axes_size(mesh, batch_axes):
        batch_axes = ()
    if head_axes:
        n = _axes_size(mesh, head_axes)
        if layout.heads_q % n or layout.heads_kv % n:
            head_axes = ()
    return batch_axes, head_axes


def seq_axis(q_sharding) -> tuple[str | None, int]:
    """(the one mesh axis q's sequence dim is sharded over, its size), or (None, 1)."""
    if not isinstance(q_sharding, NamedSharding):
        return None, 1
    spec = tuple(q_sharding.spec) + (None,) * (4 - len(q_sharding.spec))
    axes = _axes_tuple(spec[1])
    if len(axes) != 1:
        return None, 1
    return axes[0], q_sharding.mesh.shape[axes[0]]


def _spec(role: str, shape: tuple[int, ...], batch_axes, head_axes,
          seq: str | None = None) -> PartitionSpec:
    b, h = _spec_entry(batch_axes), _spec_entry(head_axes)
    if role == QKV:
        return PartitionSpec(b, seq, h, None)
    if role == LSE:
        return PartitionSpec(b, h, seq)
    if role == BM:
        return PartitionSpec(b if shape[0] != 1 else None, h if shape[1] != 1 else None,
                             None, None)
    if role in (SEQ_Q, SEQ_K):
        return PartitionSpec(b, seq)
    if role == PER_BATCH:
        return PartitionSpec(b)
    if role == PER_HEAD:
        return PartitionSpec(h)
    return PartitionSpec(*(None,) * len(shape))


def _specs(roles, shapes, batch_axes, head_axes, seq=None) -> tuple[PartitionSpec, ...]:
    return tuple(_spec(r, s, batch_axes, head_axes, seq)
                 for r, s in zip(roles, shapes, strict=True))


def _shardings(mesh, roles, shapes, batch_axes, head_axes, seq=None):
    return tuple(NamedSharding(mesh, spec)
                 for spec in _specs(roles, shapes, batch_axes, head_axes, seq))


def _sharding_rule(layout: _Layout, split_sequence: bool = False) -> tuple[str, dict]:
    """The Shardy rule: q/k/v/out share the batch factor `b`; query heads are the
    compound (k g) of kv heads k and group g so that only the kv-head part can
    carry a mesh axis; size-1 broadcast dims get factors of their own."""
    b, hq, hkv = layout.batch, layout.heads_q, layout.heads_kv
    group = hq // hkv
    compound = group > 1 and hkv > 1  # Shardy rejects a size-1 factor inside a compound
    heads_q = "(k g)" if compound else ("h" if group > 1 else "k")
    heads_kv = "k" if hkv > 1 or group == 1 else "kv1"  # MQA: kv heads are a size-1 dim
    t = layout.in_shapes[0][1]
    s = layout.in_shapes[1][1]
    fresh = iter(f"u{i}" for i in range(64))

    def bm_mapping(shape):
        names = []
        for size, full, name in zip(shape, (b, hq, t, s), ("b", heads_q, "t", "s"), strict=True):
            names.append(name if size == full else next(fresh))
        return " ".join(names)

    def mapping(role, shape, which):
        if role == QKV:
            if which == "q":
                return f"b t {heads_q} d"
            if which == "k":
                return f"b s {heads_kv} d"
            if which == "v":
                return f"b s {heads_kv} e"
            return f"b t {heads_q} e"  # out / d_out
        if role == LSE:
            return f"b {heads_q} t"
        if role == BM:
            return bm_mapping(shape)
        if role == SEQ_Q:
            return "b t"
        if role == SEQ_K:
            return "b s"
        if role == PER_BATCH:
            return "b"
        if role == PER_HEAD:
            return heads_q
        return " ".join(next(fresh) for _ in shape) if shape else ""

    has_bias, has_mask, has_seed = layout.present
    in_names = ["q", "k", "v"] + ["bias"] * has_bias + ["mask"] * has_mask + ["seed"] * has_seed
    in_names += ["feature"] * sum(layout.features)
    n_fixed = len(in_names)
    if layout.kind == "backward":
        in_names += ["out" if role == QKV else "lse" for role in layout.in_roles[n_fixed:]]
        out_names = ["q", "k", "v"] + ["bias"] * has_bias
    else:
        out_names = ["out" if role == QKV else "lse" for role in layout.out_roles]
    bias_mapping = None
    operands = []
    for name, role, shape in zip(in_names, layout.in_roles, layout.in_shapes, strict=True):
        m = mapping(role, shape, name)
        if name == "bias":
            bias_mapping = m
        operands.append(m)
    results = []
    for name, role, shape in zip(out_names, layout.out_roles, layout.out_shapes, strict=True):
        results.append(bias_mapping if name == "bias" else mapping(role, shape, name))
    rule = ", ".join(operands) + " -> " + ", ".join(results)
    # Shardy wants the special factors in the order in which they first appear.
    order = [w for w in rule.replace("(", " ").replace(")", " ").replace(",", " ").split()
             if w != "->"]
    # A wrapper that can split the sequence (`ShardLocal.context`) lets its factors keep
    # their sharding: the partition callback then sees it and decides.
    kept = ("t", "s") if split_sequence else ()
    special = tuple(f for f in _NEED_REPLICATION if f not in kept) + (("g",) if compound else ())
    special = tuple(sorted(special, key=order.index))
    kwargs: dict = {"need_replication_factors": special}
    if compound:
        kwargs["g"] = group
    return rule, kwargs


def _explicit_spec(x) -> list[set]:
    """For each dim of x's sharding spec, the Explicit mesh axes it is split over (empty
    when x's type carries no sharding)."""
    try:
        sharding = jax.typeof(x).sharding
        mesh = sharding.mesh
        explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                    if kind == jax.sharding.AxisType.Explicit}
        return [set(_axes_tuple(entry)) & explicit for entry in sharding.spec]
    except (AttributeError, TypeError):
        return []


def _explicit_axes(x) -> bool:
    """Does x's type name an Explicit mesh axis in its sharding spec?"""
    return any(_explicit_spec(x))


def explicit_sequence(x) -> bool:
    """Whether x's type shards its sequence dim (dim 1) over an Explicit mesh axis."""
    spec = _explicit_spec(x)
    return len(spec) > 1 and bool(spec[1])


class ShardLocal:
    """Wraps a plan's forward or backward (`pallas_kernels.tiers`) so that it runs
    shard-locally.

    forward:  fn(plan, inputs) -> (out, *row statistics)
    backward: fn(plan, inputs, saved, cotangents) -> (dq, dk, dv, dbias or None)
    with `inputs` a `problem.Inputs`, `saved` a `problem.Saved` and `cotangents` a
    `problem.Cotangents`. The feature arrays are split with the batch (ids, lengths) and the
    heads (sinks) like the other inputs.

    `row_outputs(plan)` is how many [B, Hq, T] arrays the forward returns after out.
    `shift_seed(seed, batch_offset, head_offset) -> seed` (traced int32 offsets of
    the shard's first batch element and first query head) makes the dropout mask
    of a shard equal to that slice of the unsharded one. Without it, a call with
    a seed is not split over batch or heads (it runs replicated: correct, not
    shard-local).

    `context`, when given, splits the sequence: `context.supports(plan, parts)` says
    whether a call can run over `parts` shards of its sequence, and `context(plan, axis,
    parts, inputs[, saved, cotangents])` is what a shard runs then (like `kernels`, with
    collectives over the mesh axis `axis`; its dbias is the shard's part of the sum).
    """

    def __init__(self, kernels: Callable, kind: str,
                 shift_seed: Callable | None = None,
                 row_outputs: Callable[[Any], int] = lambda plan: 1,
                 context: Any = None):
        if kind not in ("forward", "backward"):
            raise ValueError(f"kind must be 'forward' or 'backward'; got {kind!r}")
        self.kernels = kernels
        self.kind = kind
        self.shift_seed = shift_seed
        self.row_outputs = row_outputs
        self.context = context
        self._cache = functools.lru_cache(maxsize=256)(self._build)

    # -- packing: None-free positional arrays <-> the records ------------------
    def _layout(self, plan, inputs: Inputs, extra) -> tuple[_Layout, list]:
        """The call's layout and its arrays: those of `inputs` that are given, then `extra`
        (the backward's saved output and row statistics, and the cotangents)."""
        q, k, v, bias, mask, seed, features = inputs
        present = (bias is not None, mask is not None, seed is not None)
        given = tuple(x is not None for x in features)
        ins = ([q, k, v] + [x for x in (bias, mask, seed) if x is not None]
               + [x for x in features if x is not None] + list(extra))
        in_roles = [QKV, QKV, QKV] + [BM] * present[0] + [BM] * present[1] + [REP] * present[2]
        in_roles += [role for role, g in zip(FEATURE_ROLES, given) if g]
        if self.kind == "forward":
            # out, then `row_outputs(plan)` row statistics [B, Hq, T] (lse, or its parts).
            n_rows = self.row_outputs(plan)
            out_roles = (QKV,) + (LSE,) * n_rows
            out_shapes = ((*q.shape[:3], v.shape[3]),) + (
                (q.shape[0], q.shape[2], q.shape[1]),) * n_rows
        else:
            # The residuals and cotangents: [B, T, Hq, Dv] arrays and [B, Hq, T] rows.
            in_roles += [QKV if x.ndim == 4 else LSE for x in extra]
            out_roles = (QKV, QKV, QKV) + ((BM,) if present[0] else ())
            out_shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape)) + (
                (tuple(bias.shape),) if present[0] else ())
        return _Layout(kind=self.kind, plan=plan, present=present, in_roles=tuple(in_roles),
                       in_shapes=tuple(tuple(x.shape) for x in ins), out_roles=out_roles,
                       out_shapes=out_shapes, features=given), ins

    def _call_kernels(self, layout: _Layout, arrays, seed_offsets=None, seq=None):
        """The kernels on (local) arrays, returning a flat tuple of arrays; `seq` (axis,
        parts): the sequence is split over that mesh axis (`context`)."""
        arrays = list(arrays)
        q, k, v = arrays[:3]
        rest = arrays[3:]
        opt = []
        for given in layout.present:
            opt.append(rest.pop(0) if given else None)
        bias, mask, seed = opt
        if seed is not None and seed_offsets is not None:
            seed = self.shift_seed(seed, *seed_offsets)
        features = FeatureArrays(*(rest.pop(0) if g else None for g in layout.features))
        inputs = Inputs(q, k, v, bias, mask, seed, features)
        run = (self.kernels if seq is None
               else functools.partial(self.context, layout.plan, *seq))
        if self.kind == "forward":
            return tuple(run(inputs) if seq else run(layout.plan, inputs))
        # out, the row statistics (lse and, for a pair, its low word), d_out, d_lse
        out, lse, *lo, d_out, d_lse = rest
        saved = Saved(out, lse, lo[0] if lo else None)
        args = (inputs, saved, Cotangents(d_out, d_lse))
        dq, dk, dv, dbias = run(*args) if seq else run(layout.plan, *args)
        return (dq, dk, dv) + ((dbias,) if layout.present[0] else ())

    def __call__(self, plan, inputs: Inputs, saved: Saved | None = None,
                 cotangents: Cotangents | None = None):
        extra = ()
        if self.kind == "backward":
            extra = (saved.out, saved.lse) + (() if saved.lse_lo is None else (saved.lse_lo,))
            extra += tuple(cotangents)
        layout, arrays = self._layout(plan, inputs, extra)
        if any(_explicit_axes(x) for x in arrays):
            outs = self._explicit_call(layout, arrays)
        else:
            outs = self._cache(layout)(*arrays)
        if self.kind == "backward":
            dbias = outs[3] if layout.present[0] else None
            return outs[0], outs[1], outs[2], dbias
        return tuple(outs)

    def _split_axes(self, layout: _Layout, q_sharding):
        """(batch axes, head axes, (sequence axis, its size) or None) to split over; no
        batch or head axes for a seed that cannot be shifted; the sequence axis where
        `context` supports the call over that many shards."""
        batch_axes, head_axes = choose_axes(layout, q_sharding)
        if layout.present[2] and (batch_axes or head_axes) and self.shift_seed is None:
            batch_axes, head_axes = (), ()
        axis, parts = seq_axis(q_sharding)
        if (self.context is None or axis is None or axis in batch_axes + head_axes
                or not self.context.supports(layout.plan, parts)):
            return batch_axes, head_axes, None
        return batch_axes, head_axes, (axis, parts)

    # -- inputs whose types carry Explicit mesh axes (sharding in types) ---------
    def _explicit_call(self, layout: _Layout, arrays):
        """The kernels under a `shard_map` over q's batch/head axes.

        With Explicit mesh axes the sharding is part of each array's type, and a
        Pallas kernel ref of a sharded type rejects the integer (batch, head)
        indexing the kernels do; custom_partitioning does not apply either (it is
        for the partitioner's, i.e. Auto, axes). The shardings are known at trace
        time here, so a `shard_map` gives each device its shard. Dims other than
        batch and heads, and broadcast dims, are made replicated first with
        `jax.sharding.reshard` (explicit data movement, visible in the user's
        types, as Explicit mode intends)."""
        q_sharding = jax.typeof(arrays[0]).sharding
        batch_axes, head_axes, seq = self._split_axes(layout, q_sharding)
        axis = None if seq is None else seq[0]
        in_specs = _specs(layout.in_roles, layout.in_shapes, batch_axes, head_axes, axis)
        out_specs = _specs(layout.out_roles, layout.out_shapes, batch_axes, head_axes, axis)
        mesh = q_sharding.mesh
        arrays = [jax.sharding.reshard(x, NamedSharding(mesh, spec))
                  for x, spec in zip(arrays, in_specs, strict=True)]
        if not (batch_axes or head_axes or seq):
            return self._cache(layout)(*arrays)  # all replicated now: nothing to split
        local = functools.partial(self._local, layout, batch_axes, head_axes, seq)
        # check_vma=False: out_specs above are exact, and Pallas' CPU interpreter
        # cannot run under check_vma (see tests/test_sharding.py).
        return jax.shard_map(lambda *xs: tuple(local(*xs)), mesh=mesh,
                             in_specs=in_specs, out_specs=out_specs, check_vma=False)(*arrays)

    # -- the custom_partitioning op for one layout ------------------------------
    def _build(self, layout: _Layout):
        n_out = len(layout.out_roles)
        # Under jit, so that the calls of one layout in a program (a model's layers) share
        # one traced and lowered function: JAX lowers a jitted function's jaxpr once per
        # program, where the kernels of every call would be lowered anew.
        kernels = jax.jit(lambda *arrays: self._call_kernels(layout, arrays))

        def plain(*arrays):
            return kernels(*arrays)

        def shardings_for(mesh, batch_axes, head_axes, seq):
            seq = None if seq is None else seq[0]
            ins = _shardings(mesh, layout.in_roles, layout.in_shapes, batch_axes, head_axes,
                             seq)
            outs = _shardings(mesh, layout.out_roles, layout.out_shapes, batch_axes,
                              head_axes, seq)
            return ins, outs

        def decide(arg_shapes):
            return self._split_axes(layout, arg_shapes[0].sharding)

        def partition(mesh, arg_shapes, result_shape):
            q_sharding = arg_shapes[0].sharding
            if isinstance(q_sharding, NamedSharding):
                mesh = q_sharding.mesh
            batch_axes, head_axes, seq = decide(arg_shapes)
            in_shardings, out_shardings = shardings_for(mesh, batch_axes, head_axes, seq)
            lower = compat.lowerable_by_custom_partitioning(
                functools.partial(self._local, layout, batch_axes, head_axes, seq))
            return mesh, lower, out_shardings, in_shardings

        def infer(mesh, arg_shapes, result_shape):
            q_sharding = arg_shapes[0].sharding
            if isinstance(q_sharding, NamedSharding):
                mesh = q_sharding.mesh
            return shardings_for(mesh, *decide(arg_shapes))[1]

        op = custom_partitioning(plain)
        rule, rule_kwargs = _sharding_rule(layout, split_sequence=self.context is not None)
        op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                         sharding_rule=rule, **rule_kwargs)

        batched = jax.custom_batching.custom_vmap(lambda *arrays: tuple(op(*arrays)))

        @batched.def_vmap
        def _vmap_rule(axis_size, in_batched, *arrays):
            if all(role in BATCH_FIRST for role in layout.in_roles + layout.out_roles):
                # Every array has the batch first and its rows are independent (no bias,
                # mask, dropout, sinks or positions): the mapped axis folds into the batch,
                # one launch for every element (the Mosaic backward has no batching rule).
                whole = [x if flag else jnp.broadcast_to(x, (axis_size,) + x.shape)
                         for x, flag in zip(arrays, in_batched)]
                outs = plain(*(x.reshape((-1,) + x.shape[2:]) for x in whole))
                return (tuple(x.reshape((axis_size, -1) + x.shape[1:]) for x in outs),
                        (True,) * n_out)
            in_axes = tuple(0 if flag else None for flag in in_batched)
            outs = jax.vmap(plain, in_axes=in_axes)(*arrays)
            return tuple(outs), (True,) * n_out

        return batched

    def _local(self, layout: _Layout, batch_axes, head_axes, seq, *arrays):
        """What one device runs: the kernels on its shard (context parallelism where `seq`,
        (mesh axis, size), is given), plus the reductions that a sharded batch, head or
        sequence dim needs for a broadcast bias's gradient."""
        seed_offsets = None
        if layout.present[2] and (batch_axes or head_axes):
            q = arrays[0]
            b0 = (jax.lax.axis_index(batch_axes) * q.shape[0]) if batch_axes else 0
            h0 = (jax.lax.axis_index(head_axes) * q.shape[2]) if head_axes else 0
            seed_offsets = (jnp.asarray(b0, jnp.int32), jnp.asarray(h0, jnp.int32))
        outs = self._call_kernels(layout, arrays, seed_offsets, seq)
        if layout.kind == "backward" and layout.present[0]:
            bias_shape = layout.in_shapes[3]
            reduce_axes = ()
            if batch_axes and bias_shape[0] == 1:
                reduce_axes += batch_axes
            if head_axes and bias_shape[1] == 1:
                reduce_axes += head_axes
            if seq is not None:  # a bias is broadcast over the sequence under a split
                reduce_axes += (seq[0],)
            if reduce_axes:  # sum the shards' partial sums in float32
                partial = outs[3]
                dbias = jax.lax.psum(partial.astype(jnp.float32), reduce_axes)
                outs = outs[:3] + (dbias.astype(partial.dtype),)
        return outs
