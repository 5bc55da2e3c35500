"""Fingerprint the lowered Triton IR of 168 kernel variants (no GPU needed).

A refactor that leaves every fingerprint unchanged leaves the GPU kernels
unchanged: compare before and after with
    python scripts/ir_fingerprint.py before.json   # on the old code
    python scripts/ir_fingerprint.py after.json    # on the new code
    cmp before.json after.json
Source locations are left out of the IR (traceback limit 0), so moving lines
does not change a fingerprint; any change to what a kernel computes does. Only the
Triton kernels' serialized IR is hashed (the `ir = "..."` payload of each custom
call), not the XLA wrapper around it, so a changed jit signature does not count.

Two sets: kernel variants called directly (`kernel_fingerprints`), and whole calls of the
public API (`api_fingerprints`: forward and backward of `ffpa_jax.attention` on the fused and
chunked tiers, every language-model feature, decode shapes, `paged_attention`), lowered as
if the default backend were an NVIDIA GPU. The API set depends on no internal signature, so
it pins the kernels across a refactor of the layers between the API and the kernels.
"""

import hashlib
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp

jax.config.update("jax_traceback_in_locations_limit", 0)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import test_lowering as lowering  # noqa: E402  (the lowering helpers the tests use)
from pallas_kernels import (BwdConfig, DecodeConfig, FwdConfig, Inputs, Problem,  # noqa: E402
                            decode_attention)


def lower_decode(*, d, dv, dtype=jnp.bfloat16, causal=False, bias=False, mask=False,
                 dropout=0.0, t=1, s=3000, hq=8, hkv=2, config=DecodeConfig()) -> str:
    """Both decode stages for CUDA, lowered as text."""
    sd = jax.ShapeDtypeStruct
    args = [sd((2, t, hq, d), dtype), sd((2, s, hkv, d), dtype), sd((2, s, hkv, dv), dtype),
            sd((2,), jnp.uint32)]
    if bias:
        args.append(sd((2, hq, t, s), jnp.float32))
    if mask:
        args.append(sd((2, 1, t, s), jnp.bool_))

    def f(q, k, v, seed, *rest):
        inputs = Inputs(q, k, v, rest[0] if bias else None, rest[-1] if mask else None, seed)
        problem = Problem.of(q, k, v, inputs.bias, inputs.mask, scale=0.1, causal=causal,
                             dropout_rate=dropout)
        return decode_attention(problem, config, inputs, num_splits=4)
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def digest(text: str) -> str:
    """sha256 of the Triton kernels' IR payloads in a lowered module, in order."""
    kernels = re.findall(r'ir = "((?:[^"\\]|\\.)*)"', text)
    assert kernels, "no Triton kernel payload in the lowered text"
    return hashlib.sha256("\n".join(kernels).encode()).hexdigest()


def kernel_fingerprints() -> dict[str, str]:
    out = {}
    fwd_variants = [dict(), dict(causal=True), dict(bias=True), dict(mask=True),
                    dict(causal=True, bias=True, mask=True), dict(hq=8, hkv=1), dict(dv=40),
                    dict(dtype=jnp.float32)]
    fwd_configs = (FwdConfig(), FwdConfig(q_mode="dynamic", block_dv=64),
                   FwdConfig(q_mode="reload", block_d=32))
    bwd_variants = [dict(), dict(causal=True), dict(bias_shape=(1, 4, 300, 257)),
                    dict(bias_shape=(2, 1, 1, 257)), dict(mask=True),
                    dict(causal=True, mask=True, bias_shape=(2, 1, 300, 257)),
                    dict(hq=8, hkv=1), dict(dv=40)]
    bwd_configs = (BwdConfig(), BwdConfig(dynamic=True, block_slice=64),
                   BwdConfig(dynamic=True, split_dkdv=True, block_slice=64))
    dropout_variants = [dict(dropout=0.1), dict(dropout=0.1, causal=True, mask=True)]
    decode_variants = [dict(), dict(causal=True, bias=True, mask=True), dict(dropout=0.1),
                       dict(dtype=jnp.float16)]
    for d in (64, 111, 512):
        for i, variant in enumerate(dropout_variants):
            out[f"dropout-fwd{i}-{d}"] = digest(lowering.lower_fwd(d=d, dv=d, **variant))
            out[f"dropout-bwd{i}-{d}"] = digest(lowering.lower_bwd(d=d, dv=d, **variant))
        for i, variant in enumerate(decode_variants):
            out[f"decode{i}-{d}"] = digest(lower_decode(d=d, dv=d, **variant))
        for i, variant in enumerate(fwd_variants):
            for cfg in fwd_configs:
                kw = {"d": d, "dv": d, **variant}
                out[f"fwd{i}-{d}-{cfg}"] = digest(lowering.lower_fwd(config=cfg, **kw))
        for i, variant in enumerate(bwd_variants):
            for cfg in bwd_configs:
                kw = {"d": d, "dv": d, **variant}
                out[f"bwd{i}-{d}-{cfg}"] = digest(lowering.lower_bwd(config=cfg, **kw))
    return out


def pretend_nvidia_gpu() -> None:
    """Make every loaded ffpa_jax/tuning module see an NVIDIA GPU as the default backend, so
    that the public API plans the GPU tiers (nothing runs: the calls are only lowered)."""
    from ffpa_jax import backend
    real = backend.default_backend_is_nvidia_gpu
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] in ("ffpa_jax", "tuning", "pallas_kernels") and module:
            for attr, value in list(vars(module).items()):
                if value is real:
                    setattr(module, attr, lambda: True)


API_VARIANTS = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "causal-t-gt-s": dict(is_causal=True, t=300, s=200),
    "bias-heads": dict(bias=(1, 4, 300, 257)),
    "bias-rows": dict(bias=(2, 1, 1, 257), is_causal=True),
    "mask": dict(mask=(2, 1, 300, 257)),
    "mask-2d-causal": dict(mask=(300, 257), is_causal=True),
    "mqa": dict(hkv=1),
    "dv": dict(dv=40),
    "dropout": dict(dropout_rate=0.1),
    "dropout-broadcast": dict(dropout_rate=0.1, dropout_broadcast=True, is_causal=True),
    "window": dict(local_window_size=(64, 8), is_causal=True),
    "softcap": dict(logits_soft_cap=20.0),
    "segments": dict(segments=True),
    "lengths": dict(lengths=True),
    "sinks": dict(sinks=True),
    "everything": dict(local_window_size=(64, 8), is_causal=True, logits_soft_cap=20.0,
                       segments=True, lengths=True, sinks=True, dropout_rate=0.1,
                       bias=(1, 4, 300, 257)),
    "lse": dict(return_lse=True),
    "float32": dict(dtype=jnp.float32, is_causal=True),
    "float32-features": dict(dtype=jnp.float32, local_window_size=(32, 32), sinks=True,
                             segments=True),
    "decode": dict(t=4, s=3000),
    "decode-features": dict(t=4, s=3000, local_window_size=(256, 0), logits_soft_cap=30.0,
                            lengths=True, sinks=True, segments=True),
}


def lower_api(implementation: str, *, d: int, dv: int | None = None, t: int = 300,
              s: int = 257, hq: int = 4, hkv: int = 2, dtype=jnp.bfloat16, bias=None,
              mask=None, segments=False, lengths=False, sinks=False, return_lse=False,
              **options) -> str:
    """value_and_grad of a loss of `ffpa_jax.attention` (q, k, v, the bias and the sinks
    differentiated), lowered for CUDA as text."""
    import ffpa_jax
    sd = jax.ShapeDtypeStruct
    dv = d if dv is None else dv
    arrays = dict(query=sd((2, t, hq, d), dtype), key=sd((2, s, hkv, d), dtype),
                  value=sd((2, s, hkv, dv), dtype))
    if bias is not None:
        arrays["bias"] = sd(bias, jnp.float32)
    if mask is not None:
        arrays["mask"] = sd(mask, jnp.bool_)
    if segments:
        arrays["q_segment_ids"] = sd((2, t), jnp.int32)
        arrays["kv_segment_ids"] = sd((2, s), jnp.int32)
    if lengths:
        arrays["query_seq_lengths"] = sd((2,), jnp.int32)
        arrays["key_value_seq_lengths"] = sd((2,), jnp.int32)
    if sinks:
        arrays["sinks"] = sd((hq,), jnp.float32)
    if options.get("dropout_rate"):
        options["dropout_rng"] = jax.random.key(0)
    wrt = tuple(name for name in ("query", "key", "value", "bias", "sinks") if name in arrays)

    def loss(diff, rest):
        result = ffpa_jax.attention(**diff, **rest, return_lse=return_lse,
                                    implementation=implementation, **options)
        out, lse = result if return_lse else (result, None)
        total = jnp.sum(out.astype(jnp.float32) ** 2)
        return total if lse is None else total + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))

    def step(diff, rest):
        return jax.value_and_grad(loss)(diff, rest)
    diff = {name: arrays[name] for name in wrt}
    rest = {name: x for name, x in arrays.items() if name not in wrt}
    return jax.jit(step).trace(diff, rest).lower(lowering_platforms=("cuda",)).as_text()


def lower_paged(*, d: int, features: bool) -> str:
    """`ffpa_jax.paged_attention` (the paged decode kernels) lowered for CUDA as text."""
    import ffpa_jax
    sd = jax.ShapeDtypeStruct
    args = (sd((3, 8, d), jnp.bfloat16), sd((2, 40, 16, d), jnp.bfloat16),
            sd((2, 40, 16, d), jnp.bfloat16), sd((3, 12), jnp.int32), sd((3,), jnp.int32))
    extra = dict(local_window_size=(100, 0), logits_soft_cap=30.0) if features else {}

    def f(q, kp, vp, table, lens, sinks):
        return ffpa_jax.paged_attention(q, kp, vp, table, lens, sinks=sinks if features
                                        else None, implementation="pallas", **extra)
    return jax.jit(f).trace(*args, sd((8,), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()


def api_fingerprints() -> dict[str, str]:
    pretend_nvidia_gpu()
    out = {}
    for d in (64, 111, 512):
        for name, variant in API_VARIANTS.items():
            for implementation in ("pallas", "chunked"):
                out[f"api-{implementation}-{name}-{d}"] = digest(
                    lower_api(implementation, d=d, **variant))
        for features in (False, True):
            out[f"api-paged-{features}-{d}"] = digest(lower_paged(d=d, features=features))
    return out


def fingerprints() -> dict[str, str]:
    return {**kernel_fingerprints(), **api_fingerprints()}


if __name__ == "__main__":
    prints = fingerprints()
    pathlib.Path(sys.argv[1]).write_text(json.dumps(prints, indent=0, sort_keys=True))
    print(f"{len(prints)} variants fingerprinted -> {sys.argv[1]}")
