"""Measuring one (case, implementation): inputs, compile, error against float64, timing.

Every failure becomes the record's status ("unsupported: why" or "error: Type: what");
nothing here raises for a peer that cannot run a case.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import ffpa_jax
from ffpa_jax.bench.cases import (CONTEXT_PARALLEL, BenchCase, key_lengths, page_table,
                                  segment_ids, sink_logits, sparse_block_mask)
from ffpa_jax.bench.peers import CONTEXT_AXIS, Impl, Unsupported, context_mesh
from pallas_kernels.reference import causal_keep, rows_reference, window_keep
from tuning.timing import time_samples

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
SAMPLE_ROWS = 64  # query rows per sampled (batch, head) in the error check
SUSPECT_ERROR = 0.05  # an error above this (or NaN) flags the row as a wrong result


class NoReference(Exception):
    """The float64 reference cannot be built for this case (the message says why)."""


# ---------------------------------------------------------------- inputs
def make_inputs(case: BenchCase, seed: int = 0) -> dict:
    """Fresh random normal q, k, v (never zeros); the case's mask, bias, dropout key, for
    forward+backward a random output cotangent `do`, and for a paged case k and v's values
    as pages (`paged_inputs`)."""
    kq, kk, kv, kb, kd, kr = jax.random.split(jax.random.key(seed), 6)
    dtype = DTYPES[case.dtype]
    inputs = {
        "q": jax.random.normal(kq, (case.b, case.t, case.hq, case.d), dtype),
        "k": jax.random.normal(kk, (case.b, case.s, case.hkv, case.d), dtype),
        "v": jax.random.normal(kv, (case.b, case.s, case.hkv, case.dv), dtype),
        "bias": None, "mask": None, "rng": None, "do": None, "pages": None,
    }
    if case.bias == "heads":
        inputs["bias"] = jax.random.normal(kb, (1, case.hq, case.t, case.s), dtype)
    if case.mask == "sparse90":  # masks are 4-D: [1, 1, T, S] here, [B, 1, 1, S] below
        inputs["mask"] = jnp.asarray(sparse_block_mask(case.t, case.s,
                                                       np.random.default_rng(seed)))[None, None]
    if case.mask == "keys":
        keep = np.arange(case.s)[None, :] < key_lengths(case)[:, None]
        inputs["mask"] = jnp.asarray(keep)[:, None, None, :]
    if case.dropout:
        inputs["rng"] = kr
    if case.mode == "fwdbwd":
        inputs["do"] = jax.random.normal(kd, (case.b, case.t, case.hq, case.dv), dtype)
    if case.page:
        inputs["pages"] = paged_inputs(case, inputs["k"], inputs["v"])
    return inputs


def paged_inputs(case: BenchCase, k, v):
    """(k_pages [Hkv, P, page, D], v_pages, block_tables [B, S / page], lengths [B] = S):
    the contiguous caches' values in pages placed by `page_table` (built once, untimed)."""
    table = page_table(case)
    per_seq = table.shape[1]
    where = np.empty(table.size, np.int64)
    where[table.reshape(-1)] = np.arange(table.size)  # pool page -> (sequence, page) index

    def pool(x):
        blocks = x.reshape(case.b * per_seq, case.page, case.hkv, x.shape[-1])
        return jnp.transpose(blocks, (2, 0, 1, 3))[:, where]
    return (pool(k), pool(v), jnp.asarray(table),
            jnp.full((case.b,), case.s, jnp.int32))


ARG_ORDER = ("q", "k", "v", "bias", "mask", "rng", "do", "pages")
SEQUENCE_ARGS = ("q", "k", "v", "do")  # [B, T|S, H, D]: split along the sequence


def split_sequence(case: BenchCase, args: tuple) -> tuple:
    """The context-parallel rows' inputs: q, k, v and the cotangent in the case's layout
    (`ffpa_jax.zigzag`), sharded along the sequence over the case's devices (before timing:
    a user's data arrives so)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    split = NamedSharding(context_mesh(case), P(None, CONTEXT_AXIS))
    placed = []
    for name, x in zip(ARG_ORDER, args):
        if name in SEQUENCE_ARGS and x is not None:
            if case.layout == "zigzag":
                x = ffpa_jax.zigzag(x, case.devices, axis=1)
            x = jax.device_put(x, split)
        placed.append(x)
    return tuple(placed)


def natural_order(case: BenchCase, outputs):
    """`outputs` (out, or out and the gradients) back in sequence order, for the error
    column."""
    if case.layout != "zigzag":
        return outputs
    back = lambda x: ffpa_jax.unzigzag(x, case.devices, axis=1)  # noqa: E731
    return back(outputs) if case.mode == "fwd" else tuple(back(x) for x in outputs)


def with_mode(case: BenchCase, forward):
    """fn(q, k, v, bias, mask, rng, do, pages): the forward's output, or for forward+backward
    (out, dq, dk, dv[, dbias]) with `do` as the output cotangent (dbias for bias-grad). The
    pages reach the forward only in the paged rows (forward only)."""
    if case.mode == "fwd":
        def fwd(q, k, v, bias, mask, rng, do, pages):
            del do
            if pages is not None:
                return forward(q, k, v, bias, mask, rng, pages)
            return forward(q, k, v, bias, mask, rng)
        return fwd

    def fwd_bwd(q, k, v, bias, mask, rng, do, pages):
        del pages
        if bias is not None:
            out, vjp = jax.vjp(lambda q, k, v, b: forward(q, k, v, b, mask, rng), q, k, v, bias)
        else:
            out, vjp = jax.vjp(lambda q, k, v: forward(q, k, v, None, mask, rng), q, k, v)
        return (out, *vjp(do))
    return fwd_bwd


# ---------------------------------------------------------------- the error column
def sample_points(case: BenchCase) -> tuple[int, np.ndarray, np.ndarray]:
    """(row step, batches, query heads): every step-th query row of up to three (b, h)
    pairs: first, middle, last (the middle one tells a GQA mapping h // G from h % Hkv)."""
    step = max(1, case.t // SAMPLE_ROWS)
    pairs = sorted({(0, 0), (case.b // 2, case.hq // 2), (case.b - 1, case.hq - 1)})
    return step, np.array([b for b, _ in pairs]), np.array([h for _, h in pairs])


@functools.partial(jax.jit, static_argnames="step")
def _rows(x, bs, hs, *, step: int):
    """x[bs[p], ::step, hs[p]] for every pair p: [P, R, last dim] (one gather, one transfer)."""
    return x[bs, ::step, hs].astype(jnp.float32)


@functools.partial(jax.jit, static_argnames="step")
def _bias_rows(bias, hs, *, step: int):
    return bias[0, hs, ::step].astype(jnp.float32)  # bias is [1, Hq, T, S]: [P, R, S]


def _host(x) -> np.ndarray:
    return np.asarray(jax.device_get(x), np.float64)


def _dropout_keep(case: BenchCase, rng, bs, hs, step: int) -> np.ndarray:
    """[P, R, S]: the keep-mask rows the kernel must have used (ffpa_jax.dropout_mask)."""
    make = getattr(ffpa_jax, "dropout_mask", None)
    if make is None:
        raise NoReference("ffpa_jax.dropout_mask is not available")
    shape = (case.b, case.hq, case.t, case.s)
    rows = jax.jit(lambda key: make(key, shape, case.dropout)[bs, hs, ::step])(rng)
    return np.asarray(jax.device_get(rows), bool)


@functools.partial(jax.jit, static_argnames=("scale", "rate", "with_dbias", "softcap"))
def _reference64(q, k, v, bias, visible, keep, do, sink, *, scale: float, rate: float,
                 with_dbias: bool = False, softcap: float | None = None):
    """float64 out [P, R, Dv], dq [P, R, D] (None without `do`) and, `with_dbias`, the
    bias rows' gradient [P, R, S] of each sampled pair (`rows_reference`, and its vjp):
    q [P, R, D], k [P, S, D], v [P, S, Dv], bias/visible/keep [P, R, S] or None, sink [P]
    (each pair's head's sink logit) or None."""
    def one(q, k, v, bias, visible, keep, do, sink):

        def ref(q_rows, bias_rows):
            return rows_reference(q_rows, k, v, bias_rows, visible, keep, scale=scale,
                                  dropout_rate=rate, softcap=softcap, sink=sink)[0]
        if do is None:
            return ref(q, bias), None, None
        if with_dbias:
            out, vjp = jax.vjp(ref, q, bias)
            dq, dbias = vjp(do)
            return out, dq, dbias
        out, vjp = jax.vjp(lambda q_rows: ref(q_rows, bias), q)
        return out, vjp(do)[0], None
    return jax.vmap(one)(q, k, v, bias, visible, keep, do, sink)


def samples_dbias(case: BenchCase, inputs: dict) -> bool:
    """Whether the bias gradient can be checked on the sampled rows: a [1, Hq, T, S] bias
    with one batch, so its gradient's row (h, i) is dS of that one row (with more batches
    it would sum the rows of every batch, and the samples hold only some)."""
    bias = inputs.get("bias")
    return (case.mode != "fwd" and bias is not None and case.b == 1
            and tuple(bias.shape) == (1, case.hq, case.t, case.s))


_REFERENCE_CACHE: dict = {}  # (case, seed) -> reference of the last case (shared by its impls)


def reference_rows(case: BenchCase, inputs: dict, seed: int):
    """float64 reference (on the host CPU) of out[b, ::step, h] and, for forward+backward,
    dq[b, ::step, h] (a query row's dq depends on that row only), for the sampled pairs;
    third, dbias[0, h, ::step] where `samples_dbias` (else None)."""
    key = (case, seed)
    if key in _REFERENCE_CACHE:
        return _REFERENCE_CACHE[key]
    step, bs, hs = sample_points(case)
    kvs = hs // case.group
    t_rows = np.arange(0, case.t, step)
    q = _host(_rows(inputs["q"], bs, hs, step=step))
    k = _host(_rows(inputs["k"], bs, kvs, step=1))
    v = _host(_rows(inputs["v"], bs, kvs, step=1))
    visible = np.ones((len(bs), len(t_rows), case.s), bool)
    if inputs["mask"] is not None:  # [B|1, 1, T|1, S] at the sampled batch rows and rows
        mask = np.asarray(jax.device_get(inputs["mask"]), bool)[:, 0]
        mask = mask[bs] if mask.shape[0] > 1 else mask
        visible &= mask[:, ::step] if mask.shape[1] > 1 else mask
    if case.causal:  # at the kept rows only
        visible &= np.asarray(causal_keep(case.t, case.s, rows=t_rows))[None]
    if case.window:
        visible &= np.asarray(window_keep(case.t, case.s, (case.window, case.s),
                                          rows=t_rows))[None]
    if case.segments:
        q_ids, kv_ids = segment_ids(case)
        visible &= (q_ids[t_rows][:, None] == kv_ids[None, :])[None]
    bias = None if inputs["bias"] is None else _host(_bias_rows(inputs["bias"], hs, step=step))
    keep = None if not case.dropout else _dropout_keep(case, inputs["rng"], bs, hs, step)
    do = None if inputs["do"] is None else _host(_rows(inputs["do"], bs, hs, step=step))
    with jax.enable_x64(True), jax.default_device(jax.devices("cpu")[0]):
        sink = np.asarray(sink_logits(case), np.float64)[hs] if case.sinks else None
        out, dq, dbias = _reference64(q, k, v, bias, visible, keep, do, sink,
                                      scale=1.0 / math.sqrt(case.d), rate=float(case.dropout),
                                      with_dbias=samples_dbias(case, inputs),
                                      softcap=case.softcap or None)
        result = tuple(None if x is None else np.asarray(x) for x in (out, dq, dbias))
    _REFERENCE_CACHE.clear()
    _REFERENCE_CACHE[key] = result
    return result


def _relative(diff: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref|; NaN when any sampled value is not finite."""
    if not (np.all(np.isfinite(diff)) and np.all(np.isfinite(ref))):
        return float("nan")
    return float(np.max(diff) / max(np.max(ref), 1e-30))


def sampled_errors(case: BenchCase, outputs, inputs: dict, seed: int = 0
                   ) -> tuple[float, float | None, float | None]:
    """(out error, dq error or None, dbias error or None): max |got - ref| / max |ref|
    over the sampled rows (dbias where `samples_dbias`)."""
    step, bs, hs = sample_points(case)
    ref_out, ref_dq, ref_dbias = reference_rows(case, inputs, seed)
    out = outputs if case.mode == "fwd" else outputs[0]
    error = _relative(np.abs(_host(_rows(out, bs, hs, step=step)) - ref_out), np.abs(ref_out))
    if case.mode == "fwd":
        return error, None, None
    got_dq = _host(_rows(outputs[1], bs, hs, step=step))
    error_dq = _relative(np.abs(got_dq - ref_dq), np.abs(ref_dq))
    if ref_dbias is None:
        return error, error_dq, None
    got_dbias = _host(_bias_rows(outputs[4], hs, step=step))
    return error, error_dq, _relative(np.abs(got_dbias - ref_dbias), np.abs(ref_dbias))


# ---------------------------------------------------------------- timing and memory
def memory_mib(compiled) -> tuple[float | None, float | None]:
    """(peak, workspace) in MiB from XLA's memory analysis of the compiled call:
    peak = arguments + outputs + temporaries - aliased; workspace = outputs + temporaries."""
    try:
        mem = compiled.memory_analysis()
        arg, out = mem.argument_size_in_bytes, mem.output_size_in_bytes
        tmp, alias = mem.temp_size_in_bytes, mem.alias_size_in_bytes
        return (arg + out + tmp - alias) / 2**20, (out + tmp) / 2**20
    except Exception:  # not every backend reports it
        return None, None


def _first_line(exc: BaseException, limit: int = 200) -> str:
    return ((str(exc).strip().splitlines() or [""])[0] or type(exc).__name__)[:limit]


# ---------------------------------------------------------------- one measurement
def measure(case: BenchCase, impl: Impl, *, interpret: bool, min_rep_s: float, reps: int,
            budget_s: float = 5.0, seed: int = 0) -> dict:
    """A record for (case, impl); its status is "ok", "unsupported: why" or "error: ..."."""
    record = {"case": case.label, **dataclasses.asdict(case), "impl": impl.name}
    try:
        if case.page and not impl.paged:
            raise Unsupported("reads no page table (the paged rows compare ffpa_jax's paged "
                              "and contiguous decode and JAX's paged attention)")
        if impl.tiers is not None:
            record["tier"] = impl.tiers(case, interpret)
        forward = impl.make(case, interpret)
        inputs = make_inputs(case, seed)
        args = tuple(inputs[name] for name in ARG_ORDER)
        split = case.kind == CONTEXT_PARALLEL and impl.splits_sequence
        if split:
            args = split_sequence(case, args)
        start = time.perf_counter()
        compiled = jax.jit(with_mode(case, forward)).lower(*args).compile()
        record["compile_s"] = time.perf_counter() - start
        record["peak_mib"], record["workspace_mib"] = memory_mib(compiled)
        outputs = compiled(*args)
        jax.block_until_ready(outputs)
        record["first_call_s"] = time.perf_counter() - start
        try:
            record["error"], record["error_dq"], record["error_dbias"] = sampled_errors(
                case, natural_order(case, outputs) if split else outputs, inputs, seed)
        except NoReference as exc:
            record["error"] = record["error_dq"] = record["error_dbias"] = None
            record["error_note"] = str(exc)
        del outputs
        if record["error"] is not None:
            errs = [e for e in (record["error"], record["error_dq"], record["error_dbias"])
                    if e is not None]
            record["suspect"] = not all(e <= SUSPECT_ERROR for e in errs)  # NaN included
        samples = time_samples(compiled, args, min_rep_s=min_rep_s, reps=reps, budget_s=budget_s)
        record["ms"] = statistics.median(samples)
        record["ms_spread"] = (max(samples) - min(samples)) / record["ms"]
        record["reps"] = len(samples)
        record["tflops"] = case.flops() / (record["ms"] * 1e-3) / 1e12
        nbytes = case.min_bytes()
        record["gbps"] = None if nbytes is None else nbytes / (record["ms"] * 1e-3) / 1e9
        record["status"] = "ok"
    except (Unsupported, NotImplementedError) as exc:
        record["status"] = f"unsupported: {_first_line(exc)}"
    except Exception as exc:  # a failing implementation is reported, the run goes on
        record["status"] = f"error: {type(exc).__name__}: {_first_line(exc)}"
    return record
