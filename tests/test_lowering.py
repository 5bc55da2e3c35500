"""Every kernel variant lowers to Triton for CUDA, on a machine without a GPU.

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs the Pallas
Triton lowering (TTIR generation) without compiling for a device, so an
unsupported op or a bad index shows up here instead of on the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import (BackwardRows, BwdConfig, FeatureArrays, FwdConfig, Inputs, Problem,
                            bwd_dbias, bwd_exact_rows, bwd_generic_dkdv, bwd_generic_dq,
                            bwd_preproc, fwd_generic)

sd = jax.ShapeDtypeStruct


def lower_fwd(*, d, dv, causal=False, bias=False, mask=False, hq=4, hkv=2, t=300, s=257,
              dtype=jnp.bfloat16, config=FwdConfig(), dropout=0.0, seed_words=2, scale=0.125,
              window=None, softcap=None, features=()):
    """`features`: the names of the runtime feature arrays to pass ("ids", "q_len",
    "kv_len", "sinks"), with the static `window` and `softcap`."""
    args = [sd((2, t, hq, d), dtype), sd((2, s, hkv, d), dtype), sd((2, s, hkv, dv), dtype),
            sd((seed_words,), jnp.uint32)]
    if bias:
        args.append(sd((1, hq, t, s), jnp.float32))
    if mask:
        args.append(sd((2, 1, t, s), jnp.bool_))
    feature_args = {"ids": [sd((2, t), jnp.int32), sd((2, s), jnp.int32)],
                    "q_len": [sd((2,), jnp.int32)], "kv_len": [sd((2,), jnp.int32)],
                    "sinks": [sd((hq,), jnp.float32)]}
    n_extra = (bias + mask)
    for name in features:
        args += feature_args[name]

    def f(q, k, v, seed, *rest):
        b = rest[0] if bias else None
        m = rest[n_extra - 1] if mask else None
        arrays = list(rest[n_extra:])
        given = {}
        for name in features:
            given[name] = [arrays.pop(0) for _ in feature_args[name]]
        feats = None
        if features:
            feats = FeatureArrays(*(given.get("ids") or (None, None)),
                                  *given.get("q_len", [None]), *given.get("kv_len", [None]),
                                  *given.get("sinks", [None]))
        problem = Problem.of(q, k, v, b, m, scale=scale, causal=causal, dropout_rate=dropout,
                             features=feats, window=window, softcap=softcap)
        return fwd_generic(problem, config, Inputs(q, k, v, b, m, seed,
                                                   feats or FeatureArrays()))

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # The kernel must be a Triton custom call (not something XLA expanded on its own).
    assert "__gpu$xla.gpu.triton" in text
    return text


@pytest.mark.parametrize("d", [32, 64, 128, 256, 512, 1024, 1000])
@pytest.mark.parametrize("q_mode", ["resident", "reload", "dynamic"])
def test_fwd_head_dims(d, q_mode):
    lower_fwd(d=d, dv=d, config=FwdConfig(block_m=64, block_n=64, block_d=64,
                                          block_dv=min(256, d), q_mode=q_mode))


@pytest.mark.parametrize("dtype,d,scale,bias,fast,fused", [
    (jnp.bfloat16, 64, 0.125, False, True, True),
    (jnp.float16, 256, 0.125, False, True, True),
    (jnp.bfloat16, 64, 0.125, True, True, False),    # a bias is added in score units
    (jnp.bfloat16, 64, -0.125, False, True, False),  # max(s)·scale is the min if scale < 0
    (jnp.bfloat16, 64, 0.0, False, True, False),     # -inf · 0 would be NaN
    (jnp.bfloat16, 512, 0.125, False, False, False),  # D > 256 keeps the plain softmax
    (jnp.float32, 64, 0.125, False, False, False),   # float32 keeps libdevice's exp2
])
def test_fast_softmax_only_where_it_is_exact(dtype, d, scale, bias, fast, fused):
    """The one-instruction exp2 and the fused s·scale - max (`common.fast_softmax`,
    `common.folds_scale`) appear in the kernel exactly where they are meant to."""
    text = lower_fwd(d=d, dv=d, dtype=dtype, scale=scale, bias=bias,
                     config=FwdConfig(block_m=64, block_n=64, block_d=64,
                                      block_dv=min(256, d), q_mode="dynamic" if d > 256
                                      else "resident"))
    assert ("ex2.approx.ftz.f32" in text) == fast
    assert ("fma.rn.f32" in text) == fused


# D = 1024 in float32 takes the longest to lower of the suite: with the end-to-end runs.
@pytest.mark.parametrize("d", [150, pytest.param(1024, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dynamic", [False, True])
def test_float32_head_dims(d, dynamic):
    """float32's compensated 16-wide chunk sums, unrolled and in the chunk loop (at
    D=1024: 64 chunks), in the forward and in every backward kernel with bwd_exact_rows."""
    lower_fwd(d=d, dv=d, dtype=jnp.float32,
              config=FwdConfig(block_m=64, block_n=64, block_d=64, block_dv=min(256, d),
                               q_mode="dynamic" if dynamic else "resident"))
    lower_bwd(d=d, dv=d, dtype=jnp.float32,
              config=BwdConfig(block_m=64, block_n=64, block_d=64, block_slice=min(256, d),
                               dynamic=dynamic))


@pytest.mark.parametrize("variant", [
    dict(causal=True), dict(bias=True), dict(mask=True), dict(causal=True, bias=True, mask=True),
    dict(hq=8, hkv=1), dict(dv=40), dict(dtype=jnp.float16), dict(dtype=jnp.float32),
    dict(t=1, s=5000), dict(t=5000, s=1),
], ids=lambda v: "-".join(f"{k}={getattr(x, '__name__', x)}" for k, x in v.items()))
def test_fwd_variants(variant):
    kwargs = dict(d=111, dv=111)
    kwargs.update(variant)
    lower_fwd(**kwargs)


# The language-model features (issue 24) in the forward kernel: each alone, then together
# with causality, bias, mask, dropout, GQA, float32 and the dynamic chunk loop.
FEATURE_VARIANTS = [
    dict(window=(64, 0)), dict(softcap=30.0), dict(features=("ids",)),
    dict(features=("q_len", "kv_len")), dict(features=("sinks",)),
    dict(window=(32, 8), softcap=20.0, features=("ids", "q_len", "kv_len", "sinks"),
         causal=True),
    dict(window=(16, 16), features=("ids", "sinks"), bias=True, mask=True, dropout=0.1),
    dict(softcap=50.0, features=("ids", "kv_len", "sinks"), hq=8, hkv=1, dtype=jnp.float32),
    dict(window=(100, 0), features=("ids",), causal=True, d=512, dv=512,
         config=FwdConfig(block_m=64, block_n=64, block_d=64, block_dv=256,
                          q_mode="dynamic")),
    dict(features=("ids", "sinks"), t=1, s=3000),
]


@pytest.mark.parametrize("variant", FEATURE_VARIANTS,
                         ids=lambda v: "-".join(f"{k}={getattr(x, '__name__', x)}"
                                                for k, x in v.items() if k != "config"))
def test_fwd_feature_variants(variant):
    kwargs = dict(d=111, dv=111)
    kwargs.update(variant)
    text = lower_fwd(**kwargs)
    if kwargs.get("softcap") is not None:
        assert "fma.rn.f32" not in text  # the cap bends the scaled scores: no folded scale
        # The cap's tanh: the two-instruction form where the softmax is fast (16-bit,
        # D <= 256), libdevice's tanhf elsewhere.
        fast = kwargs.get("dtype", jnp.bfloat16) != jnp.float32 and kwargs["d"] <= 256
        assert ("rcp.approx.ftz.f32" in text) == fast


def test_fwd_default_configs_lower_for_every_head_dim():
    """The configs the public API would pick (tuning defaults) lower at each size class."""
    from ffpa_jax.validation import validate
    from tuning import kernel_config

    for d in (16, 64, 128, 256, 320, 512, 768, 1024):
        q = jnp.zeros((1, 128, 2, d), jnp.bfloat16)  # shape carriers only, never computed
        problem = validate(q, q, q, None, None, scale=None, is_causal=False, dropout_rate=0.0,
                           dropout_rng=None, return_lse=False, implementation=None,
                           interpret=False).problem
        config = FwdConfig.from_tuned(kernel_config("fwd_generic", problem)[0])
        lower_fwd(d=d, dv=d, t=128, s=128, config=config)


def lower_bwd(*, d, dv, causal=False, bias_shape=None, mask=False, hq=4, hkv=2, t=300, s=257,
              dtype=jnp.bfloat16, config=BwdConfig(), dropout=0.0, seed_words=2,
              split_ds=False, own_delta=False, window=None, softcap=None, features=()):
    """Lower all four backward kernels in one jitted function (float32: with bwd_exact_rows
    in place of bwd_preproc, given the forward's lse pair (here lse itself stands for its
    low word) and passing its correction on, as the vjp does).
    `split_ds`: dq and dkdv as the vjp runs them under an lse cotangent; `own_delta`: as
    it runs them when every row fits one tile (no preproc; s <= the config's block_n).
    `window`, `softcap`, `features` as in `lower_fwd`."""
    args = [sd((2, t, hq, d), dtype), sd((2, s, hkv, d), dtype), sd((2, s, hkv, dv), dtype),
            sd((2, t, hq, dv), dtype), sd((2, t, hq, dv), dtype), sd((2, hq, t), jnp.float32),
            sd((seed_words,), jnp.uint32)]
    if bias_shape:
        args.append(sd(bias_shape, jnp.float32))
    if mask:
        args.append(sd((2, 1, t, s), jnp.bool_))
    feature_args = {"ids": [sd((2, t), jnp.int32), sd((2, s), jnp.int32)],
                    "q_len": [sd((2,), jnp.int32)], "kv_len": [sd((2,), jnp.int32)],
                    "sinks": [sd((hq,), jnp.float32)]}
    n_extra = bool(bias_shape) + mask
    for name in features:
        args += feature_args[name]

    def f(q, k, v, o, do, lse, seed, *rest):
        b = rest[0] if bias_shape else None
        m = rest[n_extra - 1] if mask else None
        arrays = list(rest[n_extra:])
        given = {name: [arrays.pop(0) for _ in feature_args[name]] for name in features}
        feats = FeatureArrays(*(given.get("ids") or (None, None)), *given.get("q_len", [None]),
                              *given.get("kv_len", [None]), *given.get("sinks", [None]))
        problem = Problem.of(q, k, v, b, m, scale=0.1, causal=causal, dropout_rate=dropout,
                             features=feats, window=window, softcap=softcap)
        inputs = Inputs(q, k, v, b, m, seed, feats)
        lse_lo = None
        if dtype == jnp.float32:  # as the vjp runs it: lse's low word from the forward
            delta, lse_lo = bwd_exact_rows(problem, config, inputs,
                                           BackwardRows(do, lse, lse, lse))
        elif own_delta:
            delta = lse  # stands for dlse
        else:
            delta = bwd_preproc(o, do, lse, config=config)
        rows = BackwardRows(do, lse, delta, lse_lo)
        kw = dict(split_ds=split_ds, own_delta=own_delta)
        outs = [bwd_generic_dq(problem, config, inputs, rows, **kw),
                *bwd_generic_dkdv(problem, config, inputs, rows, **kw)]
        if b is not None:
            outs.append(bwd_dbias(problem, config, inputs, rows, own_delta=own_delta))
        return outs

    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    kernels = 2 + (not own_delta) + bool(bias_shape)  # dq, dkdv, preproc/exact rows, dbias
    assert text.count("__gpu$xla.gpu.triton") == kernels
    return text


# The static loops at D = 1024 with `-m slow`: D = 1000 takes them (and 1024 the dynamic ones).
@pytest.mark.parametrize(("d", "dynamic", "split"), [
    pytest.param(d, *mode, marks=pytest.mark.slow) if d == 1024 and mode == (False, False)
    else (d, *mode) for mode in ((False, False), (True, False), (True, True))
    for d in (32, 64, 128, 256, 512, 1024, 1000)])
def test_bwd_head_dims(d, dynamic, split):
    lower_bwd(d=d, dv=d, config=BwdConfig(block_m=64, block_n=64, block_d=64,
                                          block_slice=min(256, d), dynamic=dynamic,
                                          split_dkdv=split))


@pytest.mark.parametrize("variant", [
    dict(causal=True), dict(bias_shape=(1, 4, 300, 257)), dict(bias_shape=(1, 1, 1, 257)),
    dict(bias_shape=(2, 4, 300, 1)), dict(mask=True), dict(causal=True, mask=True,
                                                           bias_shape=(2, 1, 300, 257)),
    dict(hq=8, hkv=1), dict(dv=40), dict(dtype=jnp.float16), dict(dtype=jnp.float32),
    dict(t=1, s=3000), dict(t=3000, s=1), dict(split_ds=True), dict(split_ds=True, d=512,
                                                                    dv=512, hq=8, hkv=1),
    dict(own_delta=True, s=57, causal=True, bias_shape=(2, 4, 300, 57), dropout=0.1),
    dict(own_delta=True, s=1, split_ds=True),
], ids=lambda v: "-".join(f"{k}={getattr(x, '__name__', x)}" for k, x in v.items()))
def test_bwd_variants(variant):
    kwargs = dict(d=111, dv=111)
    kwargs.update(variant)
    lower_bwd(**kwargs)


@pytest.mark.parametrize("variant", [
    dict(window=(64, 0)), dict(softcap=30.0, bias_shape=(1, 4, 300, 257)),
    dict(features=("ids",)), dict(features=("q_len", "kv_len")),
    dict(window=(32, 8), softcap=20.0, features=("ids", "q_len", "kv_len", "sinks"),
         causal=True, bias_shape=(2, 1, 300, 1)),
    dict(window=(16, 16), features=("ids",), mask=True, dropout=0.1, split_ds=True),
    dict(softcap=50.0, features=("ids", "sinks"), hq=8, hkv=1, dtype=jnp.float32),
    dict(own_delta=True, s=57, features=("ids", "sinks"), softcap=10.0),
    dict(window=(100, 0), features=("ids", "kv_len"), causal=True, d=512, dv=512,
         config=BwdConfig(block_m=64, block_n=64, block_d=64, block_slice=256, dynamic=True,
                          split_dkdv=True)),
], ids=lambda v: "-".join(f"{k}={getattr(x, '__name__', x)}" for k, x in v.items()
                          if k != "config"))
def test_bwd_feature_variants(variant):
    """The language-model features (issue 24) in every backward kernel."""
    kwargs = dict(d=111, dv=111)
    kwargs.update(variant)
    lower_bwd(**kwargs)


def test_bwd_default_configs_lower_for_every_head_dim():
    import dataclasses

    from ffpa_jax.validation import validate
    from tuning import plan_for_tiers

    for d in (16, 64, 128, 256, 320, 512, 768, 1024):
        q = jnp.zeros((1, 128, 2, d), jnp.bfloat16)  # shape carriers only, never computed
        problem = validate(q, q, q, None, None, scale=None, is_causal=False, dropout_rate=0.0,
                           dropout_rng=None, return_lse=False, implementation=None,
                           interpret=False).problem
        plan = plan_for_tiers(dataclasses.replace(problem, bias_shape=(1, 2, 128, 128)),
                              "pallas", "pallas")
        # Each distinct config once: two of the three kernels share one, and the same
        # config at the same shapes lowers to the same module.
        for config in dict.fromkeys(plan.config(k) for k in ("bwd_generic_dq",
                                                              "bwd_generic_dkdv",
                                                              "bwd_dbias")):
            lower_bwd(d=d, dv=d, t=128, s=128, bias_shape=(1, 2, 128, 128), config=config)


DROPOUT_VARIANTS = [dict(), dict(causal=True, bias=True, mask=True), dict(hq=8, hkv=1, dv=40),
                    dict(seed_words=4),  # a shard's seed: key words + (batch, head) offsets
                    dict(d=512, dv=512), dict(dtype=jnp.float32), dict(t=1, s=3000)]


@pytest.mark.parametrize("variant", DROPOUT_VARIANTS,
                         ids=lambda v: "-".join(f"{k}={getattr(x, '__name__', x)}"
                                                for k, x in v.items()) or "plain")
def test_dropout_variants(variant):
    """Philox (inline mul.hi.u32, tt.join interleave) lowers in every kernel."""
    kwargs = dict(d=111, dv=111, dropout=0.1)
    kwargs.update(variant)
    lower_fwd(**kwargs)
    if kwargs.pop("bias", False):
        kwargs["bias_shape"] = (1, kwargs.get("hq", 4), 1, kwargs.get("s", 257))
    lower_bwd(**kwargs)


def pretend_nvidia_gpu(monkeypatch):
    """The dispatcher plans for an NVIDIA GPU (nothing runs: the calls are only lowered)."""
    from tuning import dispatch
    monkeypatch.setattr(dispatch.Device, "current",
                        classmethod(lambda cls: cls(nvidia_gpu=True, name="Lowering GPU")))


def test_forward_and_backward_lower_with_explicit_sharding(monkeypatch):
    """Inputs sharded over an Explicit mesh axis (jax.make_mesh's default) carry the
    axis in their types; a Pallas ref of such a type rejects integer indexing, so
    the call must go through ffpa_jax's own shard_map (the jax 0.11 GPU failure of
    test_user_shard_map_with_default_check_vma_gpu's unsharded reference)."""
    import ffpa_jax

    pretend_nvidia_gpu(monkeypatch)
    mesh = jax.make_mesh((1,), ("b",), axis_types=(jax.sharding.AxisType.Explicit,))
    arg = sd((2, 96, 4, 64), jnp.bfloat16,
             sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("b")))

    def step(q, k, v):
        out, vjp = jax.vjp(lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=True),
                           q, k, v)
        return out, vjp(out)

    text = jax.jit(step).trace(arg, arg, arg).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 4  # forward, preproc, dq, dkdv


def test_forward_and_backward_lower_inside_shard_map_with_check_vma(monkeypatch):
    """Inside a user's shard_map (default check_vma=True) every pallas_call output must
    declare the manual axes it varies over; lowering the Triton kernels checks it."""
    import ffpa_jax

    pretend_nvidia_gpu(monkeypatch)
    mesh = jax.make_mesh((1,), ("b",))
    spec = jax.sharding.PartitionSpec("b")
    arg = sd((2, 96, 4, 64), jnp.bfloat16, sharding=jax.sharding.NamedSharding(mesh, spec))
    attn = lambda q, k, v: ffpa_jax.attention(q, k, v, is_causal=True)
    smap = jax.shard_map(attn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)

    def step(q, k, v):
        out, vjp = jax.vjp(smap, q, k, v)
        return out, vjp(out)

    text = jax.jit(step).trace(arg, arg, arg).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 4  # forward, preproc, dq, dkdv


def test_layers_of_one_shape_share_their_lowered_kernels(monkeypatch):
    """A model's layers of one shape lower their kernels once: three calls of the same
    shapes (forward and backward) hold the four Triton kernels of one, and a call of
    another head dim adds its own four."""
    import ffpa_jax

    pretend_nvidia_gpu(monkeypatch)
    x, wide = sd((2, 96, 4, 64), jnp.bfloat16), sd((2, 96, 4, 128), jnp.bfloat16)

    def model(q, k, v, q2):
        h = q
        for _ in range(3):
            h = ffpa_jax.attention(h, k, v, is_causal=True)
        return jnp.sum(h.astype(jnp.float32)) + jnp.sum(
            ffpa_jax.attention(q2, q2, q2).astype(jnp.float32))

    text = jax.jit(jax.grad(model, argnums=(0, 1, 2, 3))).trace(x, x, x, wide).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 8


@pytest.mark.parametrize("t,d", [(128, 256), (128, 512), (100, 1000), (1, 512)],
                         ids=lambda x: str(x))
def test_returned_lse_lowers_the_precise_kernel(t, d, monkeypatch):
    """return_lse=True lowers a different forward kernel (q·kᵀ summed per head-dim chunk
    in float32) from the out-only call, at the generic and the decode forward; the
    out-only call keeps the single accumulation chain."""
    import re

    import ffpa_jax

    pretend_nvidia_gpu(monkeypatch)
    q, kv = sd((1, t, 4, d), jnp.bfloat16), sd((1, 300, 2, d), jnp.bfloat16)

    def kernels(return_lse: bool) -> list[str]:
        def f(q, k, v):
            return ffpa_jax.attention(q, k, v, return_lse=return_lse, implementation="pallas")
        text = jax.jit(f).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
        return re.findall(r'ir = "((?:[^"\\]|\\.)*)"', text)

    precise, plain = kernels(True), kernels(False)
    assert len(precise) == len(plain) >= 1
    assert precise[0] != plain[0]  # the forward (or decode stage 1) kernel


@pytest.mark.parametrize("variant", [
    dict(window=(256, 0)), dict(softcap=30.0), dict(ids=True), dict(lengths=True),
    dict(sinks=True), dict(window=(64, 8), softcap=20.0, ids=True, lengths=True, sinks=True,
                           causal=True, dtype=jnp.float32),
], ids=lambda v: "-".join(f"{k}={getattr(x, '__name__', x)}" for k, x in v.items()))
def test_decode_feature_variants(variant):
    """The language-model features (issue 24) in both decode stages (GQA 8/2, T = 4)."""
    from pallas_kernels import DecodeConfig, decode_attention
    kw = dict(variant)
    dtype = kw.pop("dtype", jnp.bfloat16)
    ids, lengths, sinks = kw.pop("ids", False), kw.pop("lengths", False), kw.pop("sinks", False)
    causal = kw.pop("causal", False)
    args = [sd((2, 4, 8, 111), dtype), sd((2, 3000, 2, 111), dtype),
            sd((2, 3000, 2, 111), dtype)]
    extra = ([sd((2, 4), jnp.int32), sd((2, 3000), jnp.int32)] if ids else []) + (
        [sd((2,), jnp.int32)] * 2 if lengths else []) + ([sd((8,), jnp.float32)] if sinks
                                                         else [])

    def f(q, k, v, *rest):
        rest = list(rest)
        q_ids, kv_ids = (rest.pop(0), rest.pop(0)) if ids else (None, None)
        q_len, kv_len = (rest.pop(0), rest.pop(0)) if lengths else (None, None)
        feats = FeatureArrays(q_ids, kv_ids, q_len, kv_len, rest.pop(0) if sinks else None)
        problem = Problem.of(q, k, v, scale=0.1, causal=causal, features=feats, **kw)
        return decode_attention(problem, DecodeConfig(), Inputs(q, k, v, features=feats),
                                num_splits=4)

    text = jax.jit(f).trace(*args, *extra).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
