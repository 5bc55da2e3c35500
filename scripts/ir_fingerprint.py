"""Fingerprint the lowered Triton IR of 168 kernel variants (no GPU needed).

A refactor that leaves every fingerprint unchanged leaves the GPU kernels
unchanged: compare before and after with
    python scripts/ir_fingerprint.py before.json   # on the old code
    python scripts/ir_fingerprint.py after.json    # on the new code
    cmp before.json after.json
A second path also fingerprints the one-pass backward (`bwd_fused_atomic`, the
deterministic=False backward) into that file, apart from the 168, so the first file stays
comparable with ones written before that kernel existed:
    python scripts/ir_fingerprint.py after.json fused.json
Source locations are left out of the IR (traceback limit 0), so moving lines
does not change a fingerprint; any change to what a kernel computes does. Only the
Triton kernels' serialized IR is hashed (the `ir = "..."` payload of each custom
call), not the XLA wrapper around it, so a changed jit signature does not count.
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
from pallas_kernels import BwdConfig, DecodeConfig, FwdConfig, decode_attention  # noqa: E402


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
        return decode_attention(q, k, v, rest[0] if bias else None,
                                rest[-1] if mask else None, scale=0.1, causal=causal,
                                config=config, num_splits=4, dropout_rate=dropout, seed=seed)
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _digest(text: str) -> str:
    kernels = re.findall(r'ir = "((?:[^"\\]|\\.)*)"', text)
    assert kernels, "no Triton kernel payload in the lowered text"
    return hashlib.sha256("\n".join(kernels).encode()).hexdigest()


def fingerprints() -> dict[str, str]:
    digest = _digest
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


def fused_fingerprints() -> dict[str, str]:
    """bwd_fused_atomic (with bwd_preproc or bwd_exact_rows, and bwd_dbias with a bias) over
    the backward's variants and configs, and with dropout."""
    out = {}
    variants = [dict(), dict(causal=True), dict(bias_shape=(1, 4, 300, 257)),
                dict(bias_shape=(2, 1, 1, 257)), dict(mask=True),
                dict(causal=True, mask=True, bias_shape=(2, 1, 300, 257)), dict(hq=8, hkv=1),
                dict(dv=40), dict(dtype=jnp.float32), dict(split_ds=True),
                dict(dropout=0.1), dict(dropout=0.1, causal=True, mask=True)]
    configs = (BwdConfig(), BwdConfig(dynamic=True, block_slice=64),
               BwdConfig(dynamic=True, split_dkdv=True, block_slice=64))
    for d in (64, 111, 512):
        for i, variant in enumerate(variants):
            for cfg in configs:
                kw = {"d": d, "dv": d, **variant}
                out[f"fused{i}-{d}-{cfg}"] = _digest(lowering.lower_fused(config=cfg, **kw))
    return out


if __name__ == "__main__":
    prints = fingerprints()
    pathlib.Path(sys.argv[1]).write_text(json.dumps(prints, indent=0, sort_keys=True))
    print(f"{len(prints)} variants fingerprinted -> {sys.argv[1]}")
    if len(sys.argv) > 2:
        fused = fused_fingerprints()
        pathlib.Path(sys.argv[2]).write_text(json.dumps(fused, indent=0, sort_keys=True))
        print(f"{len(fused)} bwd_fused_atomic variants fingerprinted -> {sys.argv[2]}")
