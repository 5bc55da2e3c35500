"""The implementations the benchmark runs: ffpa_jax itself and its peers.

Each maker takes (case, interpret) and returns `run(q, k, v, bias, mask, rng) -> out`
([B, T, Hq, Dv]), or raises `Unsupported` saying why the peer cannot run the case. In the
paged-decode rows a run also gets the cache as pages, `run(q, k, v, bias, mask, rng,
pages)` with pages = (k_pages, v_pages, block_tables, lengths) holding k and v's values;
only implementations marked `paged` take part there.
`interpret` is True on a machine without a GPU: Pallas kernels then run in Pallas'
interpreter, and GPU-only peers decline.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp

import ffpa_jax
from ffpa_jax.bench.cases import (CONTEXT_PARALLEL, BenchCase, feature_kwargs, key_lengths,
                                   segment_ids)
from pallas_kernels import tiers


class Unsupported(Exception):
    """This implementation cannot run this case; the message says why."""


@dataclasses.dataclass(frozen=True)
class Impl:
    name: str
    make: Callable[[BenchCase, bool], Callable]
    kinds: tuple[str, ...] | None = None  # rows only for these case kinds (None: every kind)
    doc: str = ""
    # ffpa_jax's own rows: (case, interpret) -> "forward tier/backward tier" that ran
    tiers: Callable[[BenchCase, bool], str] | None = None
    # Runs Pallas kernels, so without a GPU they run in Pallas' interpreter: its times
    # there say that the code runs, not how fast it is (the CLI marks such rows).
    pallas: bool = False
    # Takes part in the paged-decode rows (its run takes the pages as a 7th argument).
    paged: bool = False
    # Runs the context-parallel rows split over the case's devices (its inputs arrive in
    # the case's layout, sharded along the sequence: `measure.split_sequence`).
    splits_sequence: bool = False

    def runs_kind(self, kind: str) -> bool:
        """Whether this implementation has a row in cases of `kind` (the paged rows hold
        only the implementations that take pages, the context-parallel rows those that split
        the sequence and their one-device yardstick)."""
        if kind == "paged-decode":
            return self.paged
        if kind == CONTEXT_PARALLEL:
            return self.splits_sequence or (self.kinds is not None and kind in self.kinds)
        return self.kinds is None or kind in self.kinds

    def interpreted(self, interpret: bool, tier: str | None = None) -> bool:
        """Whether a run with `interpret` (no GPU) went through Pallas' interpreter; `tier`:
        the tiers ffpa_jax ran (the dense tier runs no Pallas kernel)."""
        return interpret and self.pallas and tier != tiers.XLA.name


def _scale(case: BenchCase) -> float:
    return 1.0 / math.sqrt(case.d)


# ---------------------------------------------------------------- ffpa_jax
def _ffpa_run(case: BenchCase, implementation: str | None, interpret: bool):
    def run(q, k, v, bias, mask, rng):
        return ffpa_jax.attention(q, k, v, bias=bias, mask=mask, is_causal=case.causal,
                                  dropout_rate=case.dropout,
                                  dropout_rng=rng if case.dropout else None,
                                  implementation=implementation, interpret=interpret,
                                  **feature_kwargs(case))
    return run


def _features_of(case: BenchCase) -> list[str]:
    """The case's language-model features, by the names the peers decline them with."""
    # Without articles: the reasons read "has no sliding window, logit soft cap" and
    # "no segment ids (the plain composition)".
    return [name for name, used in (("segment ids", case.segments),
                                    ("sliding window", case.window),
                                    ("logit soft cap", case.softcap),
                                    ("attention sinks", case.sinks)) if used]


CONTEXT_AXIS = "cp"  # the context-parallel rows' mesh axis


def context_mesh(case: BenchCase):
    """The mesh of the first `case.devices` devices along `CONTEXT_AXIS`."""
    return jax.make_mesh((case.devices,), (CONTEXT_AXIS,), devices=jax.devices()[:case.devices],
                         axis_types=(jax.sharding.AxisType.Auto,))


def _ffpa_context_parallel(case: BenchCase, interpret: bool):
    """ffpa_jax.attention(context_axis=...) inside a shard_map over the case's devices: each
    device holds its shard of the sequence (in the case's layout) and returns its shard."""
    from jax.sharding import PartitionSpec as P
    split = P(None, CONTEXT_AXIS)

    def local(q, k, v):
        return ffpa_jax.attention(q, k, v, is_causal=case.causal, context_axis=CONTEXT_AXIS,
                                  context_layout=case.layout,
                                  context_strategy=case.strategy or None, interpret=interpret,
                                  **feature_kwargs(case))
    # Pallas' interpreter pads blocks with constants that shard_map's check of varying axes
    # rejects (tests/test_sharding.py); the compiled kernels run under it.
    sharded = jax.shard_map(local, mesh=context_mesh(case), in_specs=(split,) * 3,
                            out_specs=split, check_vma=not interpret)

    def run(q, k, v, bias, mask, rng):
        del bias, mask, rng  # the kind has none
        return sharded(q, k, v)
    return run


def _ffpa(case: BenchCase, interpret: bool):
    """The tuned dispatch (implementation=None): each direction on its measured tier; in the
    paged-decode rows, `ffpa_jax.paged_attention` over the pages; in the context-parallel
    rows, the sequence split over the case's devices."""
    if case.kind == CONTEXT_PARALLEL:
        return _ffpa_context_parallel(case, interpret)
    if case.page:
        def paged(q, k, v, bias, mask, rng, pages):
            del k, v, bias, mask, rng
            out = ffpa_jax.paged_attention(q[:, 0], *pages, interpret=interpret)
            return out[:, None]
        return paged
    return _ffpa_run(case, None, interpret)


def _ffpa_dense_mask(case: BenchCase, interpret: bool):
    """ffpa_jax.attention with the packed documents as the dense [T, S] bool mask a user
    would build from the ids (what the segment ids save)."""
    import jax.numpy as jnp
    q_ids, kv_ids = (jnp.asarray(x) for x in segment_ids(case))
    kwargs = {k: x for k, x in feature_kwargs(case).items() if "segment" not in k}

    def run(q, k, v, bias, mask, rng):
        del mask, rng
        dense = q_ids[:, None] == kv_ids[None, :]
        return ffpa_jax.attention(q, k, v, bias=bias, mask=dense, is_causal=case.causal,
                                  interpret=interpret, **kwargs)
    return run


def _ffpa_contiguous(case: BenchCase, interpret: bool):
    """ffpa_jax.attention on the same cache kept contiguous: the decode kernels without
    pages (the paged rows' yardstick)."""
    run = _ffpa_run(case, None, interpret)

    def contiguous(q, k, v, bias, mask, rng, pages):
        del pages
        return run(q, k, v, bias, mask, rng)
    return contiguous


def _pallas_paged(case: BenchCase, interpret: bool):
    """jax.experimental.pallas.ops.gpu.paged_attention (Triton), the same pages."""
    if case.d != case.dv:
        raise Unsupported("needs D == Dv")
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    def run(q, k, v, bias, mask, rng, pages):
        del k, v, bias, mask, rng
        k_pages, v_pages, tables, lengths = pages
        per_block = max(1, min(8, tables.shape[1]))
        out = jax_paged.paged_attention(q[:, 0] * _scale(case), k_pages, v_pages, tables,
                                        lengths, pages_per_compute_block=per_block,
                                        k_splits=max(1, min(16, tables.shape[1] // per_block)),
                                        interpret=interpret)
        return out.astype(q.dtype)[:, None]
    return run


def _tiers_of(implementation: str | None, *, split: bool = False):
    """(case, interpret) -> "forward tier/backward tier" of ffpa_jax's call for the case
    (`split`: of its blocks, where a context-parallel case splits the sequence)."""
    def tiers_that_ran(case: BenchCase, interpret: bool) -> str:
        import tuning
        from pallas_kernels.problem import DTYPES, Problem
        problem = Problem(batch=case.b, seq_q=case.t, seq_k=case.s, heads_q=case.hq,
                          heads_kv=case.hkv, head_dim=case.d, head_dim_v=case.dv,
                          dtype=DTYPES[case.dtype], scale=_scale(case), causal=case.causal,
                          dropout_rate=case.dropout,
                          bias_shape=(1, case.hq, case.t, case.s) if case.bias else None,
                          mask_shape=case.mask_shape,
                          window=(case.window, 0) if case.window else None,
                          softcap=case.softcap or None, segment_ids=bool(case.segments),
                          sinks=case.sinks,
                          positions=split and case.kind == CONTEXT_PARALLEL)
        try:
            explained = tuning.explain(problem, implementation, interpret=interpret)
        except ValueError as exc:  # a forced tier that cannot run here (say, mosaic on a CPU)
            raise Unsupported(str(exc)) from None
        forward, backward = explained.forward.tier, explained.backward.tier
        # The dense tier is one computation that JAX differentiates: one name.
        if case.mode == "fwd" or tiers.BY_NAME[forward].differentiated_by_jax:
            return forward
        if explained.vjp_forward is not None:  # a differentiated call's own forward
            forward = explained.vjp_forward.tier
        return f"{forward}/{backward}"
    return tiers_that_ran


def _ffpa_tier(implementation: str):
    """ffpa_jax with one tier forced in both directions (GPU rows, for the A/B of tiers)."""
    def make(case: BenchCase, interpret: bool):
        if interpret:
            raise Unsupported("tiers are compared on a GPU; the ffpa row runs here")
        return _ffpa_run(case, implementation, False)
    return make


# ---------------------------------------------------------------- jax.nn: cuDNN and XLA
def _jax_nn_run(case: BenchCase, implementation: str):
    """jax.nn.dot_product_attention; a window as its local_window_size (T == S: the same
    alignment), segment ids as the dense [T, S] mask a jax.nn user would build, key padding
    as its key_value_seq_lengths (cuDNN takes no [B, 1, 1, S] mask)."""
    window = (case.window, 0) if case.window else None
    dense = None
    if case.segments:
        q_ids, kv_ids = segment_ids(case)
        dense = q_ids[:, None] == kv_ids[None, :]
    lengths = (jnp.asarray(key_lengths(case), jnp.int32) if case.mask == "keys" else None)

    def run(q, k, v, bias, mask, rng):
        del rng
        m = None if lengths is not None else mask  # 4-D, or None
        if dense is not None:
            m = dense[None, None] if m is None else m & dense[None, None]
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=m, is_causal=case.causal,
                                            key_value_seq_lengths=lengths,
                                            local_window_size=window,
                                            implementation=implementation)
    return run


def _cudnn(case: BenchCase, interpret: bool):
    if interpret:
        raise Unsupported("cuDNN needs an NVIDIA GPU")
    if case.dropout:
        raise Unsupported("jax.nn.dot_product_attention has no dropout argument")
    if case.causal and case.t != case.s:
        raise Unsupported("jax.nn's causal mask is top-left aligned; ours (bottom-right) "
                          "differs when T != S")
    if case.segments or case.softcap or case.sinks:
        raise Unsupported("jax.nn.dot_product_attention has no segment ids, soft cap or sinks")
    return _jax_nn_run(case, "cudnn")


def _ffpa_xla_run(case: BenchCase):
    def run(q, k, v, bias, mask, rng):
        return ffpa_jax.attention(q, k, v, bias=bias, mask=mask, is_causal=case.causal,
                                  dropout_rate=case.dropout,
                                  dropout_rng=rng if case.dropout else None,
                                  implementation=tiers.XLA.name, **feature_kwargs(case))
    return run


def _xla(case: BenchCase, interpret: bool):
    """XLA's dense path: jax.nn's, or ffpa_jax's own XLA path where jax.nn has no equivalent
    (dropout; causal with T != S; the soft cap; sinks)."""
    del interpret
    if case.dropout or (case.causal and case.t != case.s) or case.softcap or case.sinks:
        return _ffpa_xla_run(case)
    return _jax_nn_run(case, "xla")


# ---------------------------------------------------------------- JAX's Pallas kernels
def _pallas_mha(case: BenchCase, interpret: bool):
    """jax.experimental.pallas.ops.gpu.attention.mha (Triton lowering), [B, T, H, D]."""
    if case.hq != case.hkv:
        raise Unsupported("no GQA/MQA in JAX's Pallas mha (Hq must equal Hkv)")
    if case.d != case.dv:
        raise Unsupported("needs D == Dv")
    if case.mask is not None:
        raise Unsupported("takes segment ids, not a boolean mask")
    if case.bias is not None:
        raise Unsupported("has no bias argument")
    if case.dropout:
        raise Unsupported("has no dropout")
    if case.causal and case.t != case.s:
        raise Unsupported("causal with T != S is top-left aligned there")
    if case.window or case.softcap or case.sinks:
        raise Unsupported("has no sliding window, soft cap or sinks")
    if case.mode == "fwdbwd" and case.t != case.s:
        raise Unsupported("its fused backward needs T and S split into the same number of "
                          "blocks (T == S)")
    for name, n in (("T", case.t), ("S", case.s)):
        if n % min(128, n):
            raise Unsupported(f"{name}={n} must be a multiple of its 128-wide block")
        if case.mode == "fwdbwd" and n % 32:
            raise Unsupported(f"its backward's 32-wide blocks need {name}={n} to be a multiple "
                              "of 32 (NaN gradients otherwise)")
    if case.segments and case.t != case.s:
        raise Unsupported("one segment-ids array for queries and keys (T == S)")
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention
    ids = feature_kwargs(case).get("q_segment_ids")

    def run(q, k, v, bias, mask, rng):
        del bias, mask, rng
        return pallas_attention.mha(q, k, v, segment_ids=ids, sm_scale=_scale(case),
                                    causal=case.causal, interpret=interpret)
    return run


def _pallas_mgpu(case: BenchCase, interpret: bool):
    """jax.experimental.pallas.ops.gpu.attention_mgpu.attention (Mosaic GPU, Hopper)."""
    if interpret:
        raise Unsupported("a Mosaic GPU kernel: needs a Hopper GPU, no interpreter")
    if _features_of(case):
        raise Unsupported(f"has no {', '.join(_features_of(case))}")
    if case.d != case.dv or case.d % 64:
        raise Unsupported("needs D == Dv and D a multiple of 64")
    if case.mask is not None or case.bias is not None or case.dropout:
        raise Unsupported("no mask, bias or dropout arguments")
    if case.causal and (case.t != case.s or case.mode == "fwdbwd"):
        raise Unsupported("causal only with T == S and forward only")
    if case.t % 128 or case.s % 128:
        raise Unsupported("T and S must be multiples of 128")
    if case.dtype != "fp16":
        # jax 0.11.2's kernel runs fp16 inputs; bf16 ones stop inside it on a bfloat16 ->
        # float16 dtype mismatch (docs/history.md, session 17).
        raise Unsupported("float16 only (jax 0.11.2's kernel fails on bf16 inputs)")
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    except Exception as exc:  # not in every jax build
        raise Unsupported(f"not importable here: {type(exc).__name__}: {exc}") from None
    config = attention_mgpu.TuningConfig(
        block_q=64, block_kv=128, max_concurrent_steps=2, causal=case.causal,
        block_q_dkv=64, block_kv_dkv=64, block_q_dq=64, block_kv_dq=64)
    scale = _scale(case)

    def run(q, k, v, bias, mask, rng):
        del bias, mask, rng
        # The kernel has no scale argument: fold 1/sqrt(D) into q (one elementwise pass).
        return attention_mgpu.attention((q * scale).astype(q.dtype), k, v, config, False)
    return run


# tokamax's attention implementations a peer row runs, by the names tokamax gives them.
TOKAMAX_IMPLEMENTATIONS = ("mosaic", "triton")


def _tokamax(implementation: str):
    """tokamax.dot_product_attention(implementation=...): jax.nn's arguments, so the same
    features as the cuDNN row (a window and the soft cap besides)."""
    def make(case: BenchCase, interpret: bool):
        if interpret:
            raise Unsupported("tokamax's kernels need an NVIDIA GPU (no interpreter here)")
        if case.dropout or case.segments or case.sinks:
            raise Unsupported("tokamax's attention has no dropout, segment ids or sinks")
        if case.causal and case.t != case.s:
            raise Unsupported("its causal mask is top-left aligned, as jax.nn's; ours "
                              "(bottom-right) differs when T != S")
        try:
            import tokamax
        except ImportError:
            raise Unsupported("tokamax is not installed (pip install tokamax)") from None
        window = (case.window, 0) if case.window else None

        def run(q, k, v, bias, mask, rng):
            del rng
            return tokamax.dot_product_attention(
                q, k, v, bias=bias, mask=mask,
                scale=_scale(case), is_causal=case.causal, local_window_size=window,
                logits_soft_cap=case.softcap or None, implementation=implementation)
        return run
    return make


def _pallas_decode(case: BenchCase, interpret: bool):
    """jax.experimental.pallas.ops.gpu.decode_attention.gqa: one query token, split keys."""
    if case.t != 1:
        raise Unsupported("a decode kernel: T must be 1")
    if _features_of(case):
        raise Unsupported(f"has no {', '.join(_features_of(case))}")
    if case.mask is not None or case.bias is not None or case.dropout:
        raise Unsupported("no mask, bias or dropout arguments")
    if case.d != case.dv:
        raise Unsupported("needs D == Dv")
    if case.s % 16 or case.s // 16 < 16:
        raise Unsupported("S must split into 16 chunks of >= 16 keys")
    if case.mode != "fwd":
        raise Unsupported("forward only")
    from jax.experimental.pallas.ops.gpu import decode_attention

    def run(q, k, v, bias, mask, rng):
        del bias, mask, rng
        out = decode_attention.gqa(q[:, 0], k, v, sm_scale=_scale(case), interpret=interpret)
        return out[:, None]
    return run


def naive_chunked_attention(q, k, v, *, scale: float, causal: bool, chunk: int = 2048):
    """The composition the chunked tier must beat: queries in chunks of `chunk` under
    `lax.map`, each chunk's logits by one float32 einsum, softmax, P·V by einsum, and
    `jax.checkpoint` per chunk so that the backward recomputes it. GQA by reshape."""
    import jax.numpy as jnp

    b, t, hq, d = q.shape
    s, hkv = k.shape[1], k.shape[2]
    chunk = chunk if t % chunk == 0 else t
    n = t // chunk
    qc = jnp.moveaxis(q.reshape(b, n, chunk, hkv, hq // hkv, d), 1, 0)

    @jax.checkpoint
    def one(args):
        qi, i = args
        logits = jnp.einsum("btkgd,bskd->bkgts", qi, k,
                            preferred_element_type=jnp.float32) * scale
        if causal:
            rows = i * chunk + jnp.arange(chunk)[:, None]
            logits = jnp.where(jnp.arange(s)[None, :] <= rows + (s - t), logits, -jnp.inf)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
        return out.astype(q.dtype)

    out = jax.lax.map(one, (qc, jnp.arange(n)))
    return jnp.moveaxis(out, 0, 1).reshape(b, t, hq, v.shape[3])


def _naive_chunked(case: BenchCase, interpret: bool):
    """The issue's floor for the chunked tier (see `naive_chunked_attention`)."""
    del interpret
    if case.mask is not None or case.bias is not None or case.dropout:
        raise Unsupported("no mask, bias or dropout (the plain composition)")
    if _features_of(case):
        raise Unsupported(f"no {', '.join(_features_of(case))} (the plain composition)")
    scale = _scale(case)

    def run(q, k, v, bias, mask, rng):
        del bias, mask, rng
        return naive_chunked_attention(q, k, v, scale=scale, causal=case.causal)
    return run


FFPA = Impl("ffpa", _ffpa, doc="ffpa_jax.attention(): each direction on its tuned tier "
            "(paged-decode: ffpa_jax.paged_attention; context-parallel: the sequence split "
            "over the case's devices)", tiers=_tiers_of(None, split=True), pallas=True,
            paged=True, splits_sequence=True)
PEERS: dict[str, Impl] = {
    # One row per tier of the registry that has kernels of its own (the A/B of tiers).
    **{f"ffpa-{t.name}": Impl(f"ffpa-{t.name}", _ffpa_tier(t.name), tiers=_tiers_of(t.name),
                              pallas=True,
                              doc=f"ffpa_jax.attention(implementation={t.name!r}): {t.summary}")
       for t in tiers.TIERS if not t.differentiated_by_jax},
    "cudnn": Impl("cudnn", _cudnn, doc="jax.nn.dot_product_attention(implementation='cudnn')"),
    "xla": Impl("xla", _xla, doc="jax.nn.dot_product_attention(implementation='xla'); "
                "ffpa_jax's XLA path for dropout and causal with T != S"),
    "pallas-mha": Impl("pallas-mha", _pallas_mha, pallas=True,
                       doc="jax.experimental.pallas.ops.gpu.attention.mha (Triton)"),
    "pallas-mgpu": Impl("pallas-mgpu", _pallas_mgpu, pallas=True,
                        doc="jax.experimental.pallas.ops.gpu.attention_mgpu (Mosaic GPU, Hopper)"),
    **{f"tokamax-{name}": Impl(f"tokamax-{name}", _tokamax(name),
                               doc=f"tokamax.dot_product_attention(implementation={name!r}) "
                                   "where tokamax is installed")
       for name in TOKAMAX_IMPLEMENTATIONS},
    "naive-chunked": Impl("naive-chunked", _naive_chunked,
                          doc="queries in chunks of 2048 under lax.map, einsum + softmax + "
                          "einsum per chunk, jax.checkpoint (the chunked tier's floor)"),
    "pallas-decode": Impl("pallas-decode", _pallas_decode, kinds=("decode",), pallas=True,
                          doc="jax.experimental.pallas.ops.gpu.decode_attention.gqa"),
    "ffpa-dense-mask": Impl("ffpa-dense-mask", _ffpa_dense_mask, kinds=("packed",),
                            tiers=_tiers_of(None), pallas=True,
                            doc="ffpa_jax.attention with the documents as a dense [T, S] mask"),
    "ffpa-contiguous": Impl("ffpa-contiguous", _ffpa_contiguous, kinds=("paged-decode",),
                            tiers=_tiers_of(None), pallas=True, paged=True,
                            doc="ffpa_jax.attention on the same cache, contiguous"),
    "ffpa-one-device": Impl("ffpa-one-device", lambda case, interpret: _ffpa_run(
        case, None, interpret), kinds=(CONTEXT_PARALLEL,), tiers=_tiers_of(None),
        pallas=True, doc="ffpa_jax.attention on one device, the whole sequence (the "
        "context-parallel rows' yardstick)"),
    "pallas-paged": Impl("pallas-paged", _pallas_paged, kinds=("paged-decode",), pallas=True,
                         paged=True,
                         doc="jax.experimental.pallas.ops.gpu.paged_attention (Triton)"),
}
