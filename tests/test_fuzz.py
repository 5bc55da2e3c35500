"""Property-based fuzzing (hypothesis) of `ffpa_jax.attention`: the Pallas path (interpret
mode on CPU, the real kernels under the `gpu` marker) and the XLA path against the float64
reference, forward (out, lse) and gradients (q, k, v, bias), under the tolerance rule of
docs/design.md.

What is drawn:
- a static configuration: batched or not, B, T, S (1 to a few hundred), Hq/Hkv (GQA and
  MQA ratios), D (1..160, plus a few large ones up to 1024), Dv (= D or not), dtype,
  causal, a bias of any numpy-broadcastable shape and any float dtype, a mask of any
  broadcastable shape, a scale, a dropout rate, and whether gradients are checked;
- per example: fresh random inputs, their magnitude, the mask density (0 = every key
  masked), bias rows of -inf, and the dropout key.

Every distinct static configuration costs a compile (seconds in interpret mode), so the
static configurations come from a pool drawn once per run from the seed (a few
hand-picked edge cases, then random draws); hypothesis draws a configuration from the
pool plus everything dynamic. CPU (CI): 200 examples over a pool of 16 configurations
with ranges small enough for the interpreter (T, S <= 160; D <= 160, or up to 1000 with
T, S <= 48). GPU (marker `gpu`): 2000 examples over 200 configurations drawn
from the full ranges (T, S <= 400; D <= 160, or up to 1024), in four parts that
pytest-xdist runs side by side; and 300 examples with the Mosaic tier forced (sm90), over
that pool as the tier serves it (16-bit, no bias, mask or dropout, D <= 512).

Reproduce: the seed is printed at the start (pytest shows it with a failure); rerun with
FFPA_FUZZ_SEED=<seed> (a GPU part prints its own rerun command). FFPA_FUZZ_EXAMPLES and
FFPA_FUZZ_POOL override the example count and pool size (e.g. a longer GPU sweep),
FFPA_FUZZ_MOSAIC_EXAMPLES the Mosaic fuzz's. The CPU run uses seed 0 unless told otherwise, so
CI is deterministic; the GPU run draws a fresh seed each time.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, note, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

import ffpa_jax
from conftest import HAS_GPU, interpret_flag, skip_unless_sm90
from test_numerics import compare_all, run_attention, run_reference
from pallas_kernels.visibility import mask_is_segments

# Hypothesis draws over the whole matrix: outside the default suite; CI runs them
# (`pytest -m slow`).
pytestmark = pytest.mark.slow

DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class Limits:
    max_seq: int
    max_batch: int
    max_heads_q: int
    large_dims: tuple[int, ...]
    max_seq_large_dim: int


CPU_LIMITS = Limits(max_seq=160, max_batch=2, max_heads_q=4,
                    large_dims=(192, 256, 320, 512, 1000), max_seq_large_dim=48)
GPU_LIMITS = Limits(max_seq=400, max_batch=3, max_heads_q=8,
                    large_dims=(192, 256, 320, 384, 448, 512, 640, 768, 900, 1000, 1024),
                    max_seq_large_dim=400)


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything static about one attention call (what a compile depends on)."""

    batched: bool
    b: int
    t: int
    s: int
    hq: int
    hkv: int
    d: int
    dv: int
    dtype: str
    causal: bool
    bias_shape: tuple[int, ...] | None
    bias_dtype: str
    mask_shape: tuple[int, ...] | None
    scale: float | None
    dropout_rate: float
    with_grads: bool

    @property
    def target(self) -> tuple[int, ...]:
        """What bias and mask broadcast to: [B, Hq, T, S] or [Hq, T, S]."""
        full = (self.b, self.hq, self.t, self.s)
        return full if self.batched else full[1:]


# --------------------------------------------------------------------- drawing configurations


def _size(rng: random.Random, max_size: int) -> int:
    """1 often, small sizes often, up to max_size sometimes; odd sizes welcome."""
    bucket = rng.random()
    if bucket < 0.15:
        return 1
    if bucket < 0.55:
        return rng.randint(2, min(16, max_size))
    if bucket < 0.85:
        return rng.randint(2, min(72, max_size))
    return rng.randint(2, max_size)


def _broadcast_shape(rng: random.Random, target: tuple[int, ...]) -> tuple[int, ...]:
    """A numpy-broadcastable shape for `target`: any rank up to len(target), each dim 1 or
    full (the trailing dims full more often)."""
    rank = rng.choice([len(target)] * 3 + list(range(len(target))))
    dims = target[len(target) - rank:]
    return tuple(d if rng.random() < 0.6 else 1 for d in dims)


def draw_config(rng: random.Random, limits: Limits) -> Config:
    batched = rng.random() < 0.85
    b = rng.randint(1, limits.max_batch) if batched else 1
    hkv = rng.randint(1, max(1, limits.max_heads_q // 2))
    group = rng.choice([g for g in (1, 2, 3, 4, 8) if g * hkv <= limits.max_heads_q])
    hq = hkv * group
    if rng.random() < 0.12:
        d = rng.choice(limits.large_dims)
        t = min(_size(rng, limits.max_seq_large_dim), limits.max_seq_large_dim)
        s = min(_size(rng, limits.max_seq_large_dim), limits.max_seq_large_dim)
        dv = d if rng.random() < 0.6 else rng.choice((d, rng.randint(1, 160)))
    else:
        d = 1 if rng.random() < 0.05 else rng.randint(1, 160)
        t, s = _size(rng, limits.max_seq), _size(rng, limits.max_seq)
        dv = d if rng.random() < 0.6 else rng.randint(1, 160)
    dtype = rng.choices(DTYPES, weights=(45, 35, 20))[0]
    full = (b, hq, t, s)
    target = full if batched else full[1:]
    bias_shape = _broadcast_shape(rng, target) if rng.random() < 0.4 else None
    bias_dtype = rng.choice(("float32", dtype, "bfloat16", "float16"))
    mask_shape = _broadcast_shape(rng, target) if rng.random() < 0.4 else None
    scale = None if rng.random() < 0.6 else round(rng.uniform(0.02, 2.0), 3)
    dropout_rate = 0.0 if rng.random() < 0.75 else rng.choice((0.1, 0.3, 0.5, 0.9))
    return Config(batched=batched, b=b, t=t, s=s, hq=hq, hkv=hkv, d=d, dv=dv, dtype=dtype,
                  causal=rng.random() < 0.35, bias_shape=bias_shape, bias_dtype=bias_dtype,
                  mask_shape=mask_shape, scale=scale, dropout_rate=dropout_rate,
                  with_grads=rng.random() < 0.8)


# Edge cases every pool starts with: a single query against 113 keys with GQA 6/2 and
# dropout; a single key, MQA, float16; D = 1 with Dv = 3, float32, causal T > S and a mask;
# a large head dim; an unbatched call with a 3-D bias; the decode path.
EDGE_CONFIGS = (
    Config(True, 2, 1, 113, 6, 2, 59, 59, "bfloat16", False, (2, 1, 1, 113), "float32", None,
           None, 0.3, True),
    Config(True, 1, 37, 1, 4, 1, 40, 24, "float16", True, (37, 1), "float16", (1, 4, 37, 1),
           0.5, 0.0, True),
    Config(True, 2, 21, 9, 2, 2, 1, 3, "float32", True, None, "float32", (2, 1, 21, 9), None,
           0.0, True),
    Config(True, 1, 17, 40, 2, 1, 1000, 1000, "bfloat16", True, (1, 2, 17, 40), "float32",
           (17, 40), None, 0.1, True),
    Config(False, 1, 50, 70, 3, 3, 72, 72, "float16", False, (3, 1, 70), "float32",
           (50, 70), None, 0.0, True),
    # The decode path (T <= 16 queries, S >= 128 keys): GQA 4/1, causal, bias, mask, dropout.
    Config(True, 2, 3, 150, 4, 1, 64, 48, "bfloat16", True, (2, 1, 1, 150), "float32",
           (2, 1, 3, 150), None, 0.1, True),
)


def make_pool(seed: int, size: int, limits: Limits) -> list[Config]:
    rng = random.Random(seed)
    pool = list(EDGE_CONFIGS)
    while len(pool) < size:
        pool.append(draw_config(rng, limits))
    return pool[:max(size, 1)]


MOSAIC_MAX_HEAD_DIM = 512  # the Mosaic forward's (its backward hands larger ones on)


MOSAIC_MASK_MAX_HEAD_DIM = 256  # masks become segment ids: the "rows" forward's


def _mosaic_mask(cfg: Config, d: int, dv: int):
    """`cfg`'s mask where the Mosaic tier takes it (a key or query mask shared by the heads,
    head dims up to 256 once padded to 64), else None."""
    if cfg.mask_shape is None or max(-(-d // 64), -(-dv // 64)) * 64 > MOSAIC_MASK_MAX_HEAD_DIM:
        return None
    shape = (1,) * (4 - len(cfg.mask_shape)) + tuple(cfg.mask_shape)
    return cfg.mask_shape if mask_is_segments(shape) else None


def mosaic_config(cfg: Config) -> Config:
    """`cfg` as the Mosaic tier serves it: 16-bit, no bias or dropout, a mask only where it
    is a key or query mask shared by the heads (at head dims up to 256), head dims up to 512
    (a larger one drawn becomes 512). Its backward takes part of these (D, Dv <= 128, or
    D = Dv <= 256, more than 128 keys); forcing the tier leaves the rest of the backward to
    the rules' tier, so such draws check the pair."""
    d, dv = min(cfg.d, MOSAIC_MAX_HEAD_DIM), min(cfg.dv, MOSAIC_MAX_HEAD_DIM)
    return dataclasses.replace(
        cfg, dtype="bfloat16" if cfg.dtype == "float32" else cfg.dtype, bias_shape=None,
        mask_shape=_mosaic_mask(cfg, d, dv), dropout_rate=0.0, d=d, dv=dv)


def make_mosaic_pool(seed: int, size: int) -> list[Config]:
    """The GPU pool (edge cases first) as the Mosaic tier serves it, duplicates dropped."""
    return list(dict.fromkeys(mosaic_config(c) for c in make_pool(seed, size, GPU_LIMITS)))


# --------------------------------------------------------------------- one example


def _np_normal(rng: np.random.Generator, shape, dtype, magnitude=1.0):
    """Fresh random normals rounded to `dtype` (bf16/fp16 through ml_dtypes: no compile)."""
    x = (magnitude * rng.standard_normal(shape)).astype(np.float32)
    return jnp.asarray(x.astype(jnp.dtype(dtype)))


def check_example(cfg: Config, *, seed: int, magnitude: float, mask_density: float,
                  neg_inf_bias_rows: bool, impl: str, interpret: bool):
    rng = np.random.default_rng(seed)
    lead = (cfg.b,) if cfg.batched else ()
    q = _np_normal(rng, lead + (cfg.t, cfg.hq, cfg.d), cfg.dtype, magnitude)
    k = _np_normal(rng, lead + (cfg.s, cfg.hkv, cfg.d), cfg.dtype, magnitude)
    v = _np_normal(rng, lead + (cfg.s, cfg.hkv, cfg.dv), cfg.dtype)
    # The output cotangent as the kernel sees it: rounded to the output's dtype.
    d_out = jnp.asarray(_np_normal(rng, lead + (cfg.t, cfg.hq, cfg.dv), cfg.dtype), jnp.float32)
    d_lse = _np_normal(rng, lead + (cfg.hq, cfg.t), "float32")
    bias = mask = None
    if cfg.bias_shape is not None:
        bias_np = 2.0 * rng.standard_normal(cfg.bias_shape)
        if neg_inf_bias_rows and len(cfg.bias_shape) >= 2:
            rows = rng.random(cfg.bias_shape[:-1]) < 0.3
            bias_np[rows] = -np.inf
        bias = jnp.asarray(bias_np.astype(np.float32).astype(jnp.dtype(cfg.bias_dtype)))
    if cfg.mask_shape is not None:
        mask = jnp.asarray(rng.random(cfg.mask_shape) < mask_density)
    drop_key = keep = None
    if cfg.dropout_rate > 0.0:
        drop_key = jax.random.key(int(rng.integers(2**31)))
        keep = ffpa_jax.dropout_mask(drop_key, (cfg.b, cfg.hq, cfg.t, cfg.s), cfg.dropout_rate)
        if not cfg.batched:
            keep = keep[0]

    kw = dict(scale=cfg.scale, causal=cfg.causal, dropout_rate=cfg.dropout_rate,
              with_grads=cfg.with_grads)
    got = run_attention(q, k, v, bias, mask, drop_key, d_out, d_lse, impl=impl,
                        interpret=interpret, **kw)
    ref = run_reference(q, k, v, bias, mask, d_out, d_lse, float64=True, keep=keep, **kw)
    xla = run_reference(q, k, v, bias, mask, d_out, d_lse, float64=False, keep=keep, **kw)
    out_shape = lead + (cfg.t, cfg.hq, cfg.dv)
    assert got[0].shape == out_shape, (got[0].shape, out_shape)
    assert got[1].shape == lead + (cfg.hq, cfg.t), got[1].shape
    compare_all(got, ref, xla, q, bias, with_grads=cfg.with_grads)
    if cfg.with_grads and bias is not None:
        assert got[2][3].shape == bias.shape


# --------------------------------------------------------------------- the tests


_GPU_BASE_SEED = random.SystemRandom().randrange(2**31)  # per process; each part prints it


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def _fuzz_test(*, examples: int, seed: int, impls, limits: Limits | None = None,
               pool_size: int = 0, pool: list[Config] | None = None,
               rerun: str | None = None):
    pool = make_pool(seed, pool_size, limits) if pool is None else pool

    @settings(max_examples=examples, deadline=None, database=None, print_blob=True,
              phases=(Phase.explicit, Phase.generate),  # no shrinking: every step compiles
              suppress_health_check=list(HealthCheck))
    @hypothesis_seed(seed)
    @given(index=st.integers(0, len(pool) - 1),
           data_seed=st.integers(0, 2**31 - 1),
           magnitude=st.sampled_from((0.5, 1.0, 2.0)),
           mask_density=st.sampled_from((0.0, 0.05, 0.5, 0.9, 1.0)),
           neg_inf_bias_rows=st.booleans(),
           impl=st.sampled_from(impls))
    def run(index, data_seed, magnitude, mask_density, neg_inf_bias_rows, impl):
        cfg = pool[index]
        note(f"{rerun} pool[{index}] = {cfg}")
        try:
            check_example(cfg, seed=data_seed, magnitude=magnitude, mask_density=mask_density,
                          neg_inf_bias_rows=neg_inf_bias_rows, impl=impl[0],
                          interpret=impl[1])
        except AssertionError as error:
            # The rerun command first: pytest's one-line summary of a failure keeps only the
            # start of its message, and the seed is drawn per process.
            raise AssertionError(f"[{rerun}; pool[{index}], data seed {data_seed}, "
                                 f"magnitude {magnitude}, mask density {mask_density}] "
                                 f"{error}") from error

    rerun = rerun or f"FFPA_FUZZ_SEED={seed}"
    print(f"fuzz seed: {seed} (rerun with {rerun}); {examples} examples over "
          f"a pool of {len(pool)} configurations")
    run()


def test_a_failing_example_names_its_rerun_command_first(monkeypatch):
    """A failure's message starts with the seed's rerun command and the example's draws,
    which pytest's one-line summary keeps (the seed is drawn per process)."""
    def wrong(*args, **kwargs):
        raise AssertionError("lse: max error 1.0 above the rule's 0.1")

    monkeypatch.setattr(sys.modules[__name__], "check_example", wrong)
    with pytest.raises(AssertionError) as raised:
        _fuzz_test(examples=1, seed=7, impls=(("xla", False),), pool=[EDGE_CONFIGS[0]],
                   rerun="FFPA_FUZZ_SEED=7 pytest -k test_fuzz")
    message = str(raised.value)
    assert message.startswith("[FFPA_FUZZ_SEED=7 pytest -k test_fuzz; pool[0], data seed ")
    assert message.endswith("lse: max error 1.0 above the rule's 0.1")


def test_pool_covers_the_ranges():
    """The drawn pools cover what the issue asks for (a check on the generator itself)."""
    for limits, size in ((CPU_LIMITS, 16), (GPU_LIMITS, 200)):
        pool = make_pool(0, size, limits) + make_pool(1, size, limits)
        assert len(set(pool)) >= 0.9 * (len(pool) - len(EDGE_CONFIGS))  # the edges repeat
        assert {c.dtype for c in pool} == set(DTYPES)
        assert any(c.causal for c in pool) and any(not c.batched for c in pool)
        assert any(c.hq // c.hkv > 1 and c.hkv > 1 for c in pool)  # GQA
        assert any(c.hkv == 1 and c.hq > 1 for c in pool)  # MQA
        assert any(c.dropout_rate > 0 for c in pool)
        assert any(c.bias_shape is not None and c.bias_dtype != c.dtype for c in pool)
        assert any(c.mask_shape is not None for c in pool)
        assert any(c.d > 256 for c in pool) and any(c.d != c.dv for c in pool)
        assert any(c.t == 1 for c in pool) and any(c.s == 1 for c in pool)
        assert any(c.causal and c.t > c.s for c in pool)
    gpu_pool = [c for part in range(GPU_PARTS) for c in make_pool(part, 200 // GPU_PARTS,
                                                                   GPU_LIMITS)]
    assert max(c.t for c in gpu_pool) > 200 and max(c.s for c in gpu_pool) > 200
    assert any(c.d == 1 for c in gpu_pool) and max(c.d for c in gpu_pool if c.d <= 160) > 140
    assert any(c.d >= 900 for c in gpu_pool)
    for cfg in make_pool(0, 16, CPU_LIMITS):  # what the interpreter can afford
        assert max(cfg.t, cfg.s) <= CPU_LIMITS.max_seq
        assert max(cfg.t, cfg.s) <= CPU_LIMITS.max_seq_large_dim or cfg.d <= 160


@pytest.mark.skipif(HAS_GPU, reason="interpret-mode run; the GPU runs test_fuzz_gpu")
@pytest.mark.parametrize("part", [0, 1])
def test_fuzz_cpu(part):
    """CI: 2 x 100 examples (Pallas in interpret mode, the chunked tier's XLA step and the
    XLA path) against float64;
    two halves with their own seeds and shape pools so pytest-xdist runs them side by side."""
    _fuzz_test(limits=CPU_LIMITS, pool_size=_env_int("FFPA_FUZZ_POOL", 8),
               examples=_env_int("FFPA_FUZZ_EXAMPLES", 100),
               seed=_env_int("FFPA_FUZZ_SEED", 0) + part,
               impls=(("pallas", True), ("pallas", True), ("pallas", True), ("xla", False),
                      ("chunked", False)))


GPU_PARTS = 4  # pytest-xdist runs the parts side by side: compiling dominates


@pytest.mark.gpu
@pytest.mark.parametrize("part", range(GPU_PARTS))
def test_fuzz_gpu(part):
    """The larger sweep on the real kernels: 2000 examples over the full ranges, in four
    parts of 500 examples over 50 configurations each, seeded base + part; each part
    prints the command that reruns it (pytest-xdist workers draw their own base)."""
    base = _env_int("FFPA_FUZZ_SEED", _GPU_BASE_SEED)
    _fuzz_test(limits=GPU_LIMITS, pool_size=_env_int("FFPA_FUZZ_POOL", 200) // GPU_PARTS,
               examples=_env_int("FFPA_FUZZ_EXAMPLES", 2000) // GPU_PARTS,
               seed=base + part, impls=(("pallas", False), ("chunked", False)),
               rerun=f"FFPA_FUZZ_SEED={base} pytest -m gpu -k 'test_fuzz_gpu[{part}]'")


@pytest.mark.gpu
def test_fuzz_mosaic_gpu():
    """The Mosaic tier forced (sm90), over the GPU pool as the tier serves it: 300 examples
    over 50 configurations; prints its seed and rerun command."""
    skip_unless_sm90()
    base = _env_int("FFPA_FUZZ_SEED", _GPU_BASE_SEED)
    pool = make_mosaic_pool(base, _env_int("FFPA_FUZZ_POOL", 200) // GPU_PARTS)
    _fuzz_test(pool=pool, examples=_env_int("FFPA_FUZZ_MOSAIC_EXAMPLES", 300), seed=base,
               impls=(("mosaic", False),),
               rerun=f"FFPA_FUZZ_SEED={base} pytest -m gpu -k test_fuzz_mosaic_gpu")


def test_the_mosaic_pool_is_what_the_tier_serves():
    """The Mosaic fuzz's pool: 16-bit, no bias or dropout, key and query masks shared by the
    heads (up to D = 256), head dims up to 512, and still GQA, causal, T = 1, T > S, odd and
    large head dims, gradients."""
    pool = make_mosaic_pool(0, 50) + make_mosaic_pool(1, 50)
    assert all(c.dtype in ("bfloat16", "float16") and c.bias_shape is None
               and c.dropout_rate == 0.0 for c in pool)
    masked = [c for c in pool if c.mask_shape is not None]
    assert masked and all(max(c.d, c.dv) <= MOSAIC_MASK_MAX_HEAD_DIM for c in masked)
    assert all(mask_is_segments((1,) * (4 - len(c.mask_shape)) + tuple(c.mask_shape))
               for c in masked)
    assert max(max(c.d, c.dv) for c in pool) == MOSAIC_MAX_HEAD_DIM
    assert any(c.d % 64 and c.d > 64 for c in pool) and any(c.d != c.dv for c in pool)
    assert any(c.causal and c.t > c.s for c in pool) and any(c.t == 1 for c in pool)
    assert any(c.hq > c.hkv for c in pool) and any(c.with_grads for c in pool)
    assert len(pool) >= 90


# Found by the GPU fuzz (docs/history.md, sessions 9 and 17, give its seed), and reproduced
# in interpret mode. MQA (8 query heads on one key head), S=1,
# D=1, with a random lse cotangent: dk sums scale·q·d_lse over the 8 heads, terms up to
# 2.9 that cancel to 0.046. With dS fed to the tensor cores in bf16, dk carried
# ~eps·Σ|term| (1.0e-2 against the same-precision XLA reference's 2.2e-5, which keeps
# the lse path in float32). dS now enters as two bf16 words when lse is differentiated.
LSE_CANCELLATION_CASE = Config(batched=False, b=1, t=11, s=1, hq=8, hkv=1, d=1, dv=1,
                               dtype="bfloat16", causal=True, bias_shape=(8, 11, 1),
                               bias_dtype="float32", mask_shape=None, scale=1.092,
                               dropout_rate=0.0, with_grads=True)


def test_lse_cotangent_cancelling_across_heads(kernel_mode):
    check_example(LSE_CANCELLATION_CASE, seed=21, magnitude=1.0, mask_density=0.05,
                  neg_inf_bias_rows=False, impl="pallas", interpret=interpret_flag(kernel_mode))
