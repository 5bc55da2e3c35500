"""Every call that differs between the JAX versions we support (0.10.2 and 0.11.x).

Keep version-specific code here and nowhere else.
"""

from __future__ import annotations

import inspect
import warnings

import jax
from jax.experimental.pallas import mosaic_gpu as _pl_mosaic
from jax.experimental.pallas import triton as _pl_triton

# Since JAX 0.9 Mosaic GPU is Pallas' default GPU lowering; passing Triton's
# CompilerParams is what selects the Triton lowering. (The class was called
# TritonCompilerParams before JAX 0.7; we require >= 0.10.2.)
TritonCompilerParams = _pl_triton.CompilerParams

# JAX 0.11 deprecates the Pallas Triton backend and warns (DeprecationWarning)
# each time a Triton pallas_call is lowered. Lowering happens when the user's
# outer jit compiles, after our Python frames have returned, so a filter scoped
# to our call site cannot see it. Each of our kernel wrappers therefore installs
# a filter for exactly this message (users cannot act on it); a process that
# never runs our kernels never gets it. Re-adding an identical filter is a no-op
# move to the front of the list, so calling this on every trace is cheap.
_TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


def silence_triton_deprecation() -> None:
    warnings.filterwarnings("ignore", message=_TRITON_DEPRECATION, category=DeprecationWarning)


def compiler_params(num_warps: int, num_stages: int):
    """Triton launch parameters for `pallas_call(compiler_params=...)`."""
    return TritonCompilerParams(num_warps=num_warps, num_stages=num_stages)


def _manual_axes_keyword() -> str | None:
    """The ShapeDtypeStruct keyword that declares which manual (shard_map) mesh axes an
    array varies over: `manual_axis_type` (JAX 0.10), `vma` (earlier), else None."""
    params = inspect.signature(jax.ShapeDtypeStruct).parameters
    for keyword in ("manual_axis_type", "vma"):
        if keyword in params:
            return keyword
    return None


_MANUAL_AXES_KEYWORD = _manual_axes_keyword()
_AVAL_ATTRIBUTE = {"manual_axis_type": "mat", "vma": "vma"}


def output_struct(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A pallas_call output that varies over the same shard_map axes as `like` (the
    query), as `shard_map(check_vma=True)` requires; a plain struct elsewhere."""
    keyword = _MANUAL_AXES_KEYWORD
    value = None
    if keyword is not None:
        value = getattr(jax.typeof(like), _AVAL_ATTRIBUTE[keyword], None)
    if value is None:
        return jax.ShapeDtypeStruct(shape, dtype)
    return jax.ShapeDtypeStruct(shape, dtype, **{keyword: value})


# Mosaic GPU's `load`: jax 0.10.2 requires the index argument (`()` for a whole ref); from
# 0.11 it is deprecated (indexing goes through `.at[]`) and warns when given.
_MOSAIC_LOAD_NEEDS_INDEX = (inspect.signature(_pl_mosaic.load).parameters["idx"].default
                            is inspect.Parameter.empty)


def mosaic_load(ref, *, layout):
    """A whole Mosaic GPU shared-memory ref loaded into registers in `layout`."""
    if _MOSAIC_LOAD_NEEDS_INDEX:
        return _pl_mosaic.load(ref, (), layout=layout)
    return _pl_mosaic.load(ref, layout=layout)


# Mosaic GPU's read of a wgmma accumulator that leaves the `wait_n` latest wgmma groups in
# flight (the rows kernel's `Config.overlap`): exported by jax 0.10.2; where a JAX does not
# export it, its Pallas primitives module holds it; a JAX with neither still imports (only
# that config then fails, when traced).
wgmma_accumulator_load = getattr(_pl_mosaic, "wgmma_accumulator_load", None)
if wgmma_accumulator_load is None:
    try:
        from jax._src.pallas.mosaic_gpu.primitives import wgmma_accumulator_load
    except ImportError:
        pass


def mosaic_gpu_runs() -> bool:
    """Whether this JAX runs the Mosaic tier's kernels: they were built and measured on
    jax 0.11 (they lower on 0.10.2, which never ran them on a GPU)."""
    major, minor = (int(x) for x in jax.__version__.split(".")[:2])
    return (major, minor) >= (0, 11)


# Manual (shard_map) axes an array varies over: its type's `vma`, or, where JAX names them
# so (`_manual_axes_keyword`), its `manual_axis_type.varying`.
def varying_axes(x) -> frozenset:
    """The manual mesh axes JAX types `x` as varying over (inside a `shard_map` that
    checks them; empty elsewhere)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def vary_like(x, ref):
    """`x` typed varying over every manual axis `ref` varies over. Arrays every shard
    holds alike (a replicated bias, the seed, the lengths, a fresh accumulator, a loop's
    zero carry) must be before they meet per-shard data inside a branch or a loop: there
    an implicit cast's transpose (a psum) would be a collective under a condition that
    differs between shards, and a loop's carry must keep its type."""
    if x is None:
        return x
    missing = varying_axes(ref) - varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


def _internal_refs_discharged(closed):
    """A closed jaxpr whose internally created mutable arrays are plain values (what
    `jax.jit` does before it lowers)."""
    from jax._src.interpreters import pxla
    discharge = getattr(pxla, "_discharge_internal_refs", None)
    if discharge is not None:
        return discharge(closed)
    from jax._src.state.discharge import discharge_state
    return discharge_state(closed)


def lowerable_by_custom_partitioning(fn):
    """`fn` with the mutable arrays it creates and consumes inside discharged to values.
    Pallas' kernel launchers create such arrays on JAX 0.11 (the Mosaic kernels' outputs);
    `jax.jit` discharges them where it lowers a program, but custom_partitioning lowers a
    partition's function as traced and refuses their effect ("Cannot lower jaxpr with
    effects: ... InternalMutableArrayEffect")."""
    from jax._src import core as jax_core

    def run(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        if any(isinstance(e, jax_core.InternalMutableArrayEffect) for e in closed.effects):
            closed = _internal_refs_discharged(closed)
        # (the traced program itself, not `fn` traced again: once per partition is enough)
        outs = jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *jax.tree.leaves(args))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
    return run
