"""Every public function under `jax.numpy_rank_promotion("raise")`, as JAX's own test suite
runs (and as strict user code may): no implicit rank promotion anywhere in our code.

With the setting raised, an operation that would promote a rank raises instead; otherwise
the program is the one traced without it, whose results the rest of the suite checks
against float64. So these tests check that each function traces (forward and gradient,
masks and biases of every rank, every language-model feature, dropout, with and without a
batch dim) and, once per tier, that a call combining them compiles and runs (the Pallas
kernels through Pallas' interpreter on a CPU) with finite, non-zero results.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ffpa_jax
from conftest import HAS_GPU, SMALL_CHUNK_BUDGET_MIB, call_kwargs
from ffpa_jax.flax_attention import flax_attention_fn

B, HQ, HKV, D = 2, 4, 2, 16

strict = functools.partial(jax.numpy_rank_promotion, "raise")


def _qkv(t: int, s: int, seed: int = 0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, t, HQ, D)), jax.random.normal(kk, (B, s, HKV, D)),
            jax.random.normal(kv, (B, s, HKV, D)))


def _features(t: int, s: int) -> dict:
    """Every language-model feature, arrays and statics."""
    return dict(q_segment_ids=jnp.asarray([[0] * (t // 2) + [1] * (t - t // 2)] * B, jnp.int32),
                kv_segment_ids=jnp.asarray([[0] * (s // 2) + [1] * (s - s // 2)] * B, jnp.int32),
                query_seq_lengths=jnp.asarray([t - 1, t], jnp.int32),
                key_value_seq_lengths=jnp.asarray([s, s - 3], jnp.int32),
                local_window_size=(s // 2, 1), logits_soft_cap=5.0,
                sinks=jnp.linspace(-1.0, 1.0, HQ))


PER_BATCH = ("q_segment_ids", "kv_segment_ids", "query_seq_lengths", "key_value_seq_lengths")


def _arrays(t: int, s: int) -> dict:
    """Masks and biases of every rank from 1 to 4 (broadcast dims of size 1 included)."""
    k = jax.random.split(jax.random.key(7), 2)
    mask = jax.random.bernoulli(k[0], 0.8, (B, HQ, t, s))
    bias = jax.random.normal(k[1], (B, HQ, t, s))
    return dict(mask1=mask[0, 0, 0], mask2=mask[0, 0], mask3=mask[0, :, :1], mask4=mask[:, :1],
                bias1=bias[0, 0, 0], bias2=bias[0, 0], bias3=bias[0, :1],
                bias4=bias[:1, :, :, :1])  # constant along the keys: the closed-form dbias


def _loss(q, k, v, bias=None, **kw):
    """A scalar of out and lse, so that the gradient runs every backward input."""
    out, lse = ffpa_jax.attention(q, k, v, bias, return_lse=True, **kw)
    return jnp.sum(out * out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))


def _grad(**kw):
    """d loss / d(q, k, v, bias)."""
    return jax.grad(functools.partial(_loss, **kw), argnums=(0, 1, 2, 3))


def _tier_kwargs(tier: str) -> dict:
    if HAS_GPU and tier == "chunked-step":
        pytest.skip("the chunked tier runs its Pallas steps on a GPU already")
    return call_kwargs(tier, "gpu" if HAS_GPU else "interpret")


DROPOUT = dict(dropout_rate=0.25, dropout_rng=jax.random.key(3))
TIERS = ("xla", "chunked", "chunked-step", "pallas")
SHAPE = (24, 40)  # (T, S): several query and key tiles of the fused kernels
# A short query block (T <= 16, S >= 128): the split-KV decode kernels on the Pallas tier.
DECODE_SHAPE = (3, 160)


@pytest.mark.parametrize("tier, t, s", [(tier, *SHAPE) for tier in TIERS]
                         + [("pallas", *DECODE_SHAPE)])
def test_attention_traces_under_strict_rank_promotion(tier, t, s):
    kw = _tier_kwargs(tier)
    q, k, v = _qkv(t, s)
    a, features = _arrays(t, s), _features(t, s)
    with strict():
        for mask, bias, extra in [
                ("mask2", "bias2", dict(is_causal=True)),
                ("mask1", "bias4", {}),
                ("mask4", "bias1", dict(is_causal=True, **DROPOUT)),
                ("mask3", "bias3", dict(is_causal=True, **features, **DROPOUT))]:
            jax.make_jaxpr(_grad(mask=a[mask], **extra, **kw))(q, k, v, a[bias])
        # without a batch dim: [T, Hq, D] inputs, ids [T] / [S], lengths scalars
        unbatched = {n: x[0] if n in PER_BATCH else x for n, x in features.items()}
        jax.make_jaxpr(_grad(mask=a["mask2"], is_causal=True, **unbatched, **DROPOUT, **kw))(
            q[0], k[0], v[0], a["bias3"][0])


# The chunked tier's interpreted Pallas step with `-m slow` (the fused kernels' interpreter
# and the chunked tier's XLA step stay; its trace stays in the test above).
@pytest.mark.parametrize("tier", [pytest.param(t, marks=pytest.mark.slow)
                                  if t == "chunked-step" else t for t in TIERS])
def test_attention_runs_under_strict_rank_promotion(tier, monkeypatch):
    """A rank-2 mask and bias, causality, every feature and dropout: forward and gradients
    compile and run with the raised setting."""
    kw = _tier_kwargs(tier)
    if tier.startswith("chunked"):  # several query and key blocks: the blocked paths
        monkeypatch.setenv("FFPA_CHUNKED_BUDGET_MIB", SMALL_CHUNK_BUDGET_MIB)
    t, s = SHAPE
    q, k, v = _qkv(t, s, seed=1)
    a = _arrays(t, s)
    fn = jax.value_and_grad(functools.partial(
        _loss, mask=a["mask2"], is_causal=True, **_features(t, s), **DROPOUT, **kw),
        argnums=(0, 1, 2, 3))
    with strict():
        got = jax.jit(fn)(q, k, v, a["bias2"])
    for x in jax.tree.leaves(got):
        assert np.all(np.isfinite(np.asarray(x))) and np.any(np.asarray(x) != 0)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_paged_attention_and_kv_update_under_strict_rank_promotion(implementation):
    page, pool = 4, 12
    q, k, v = _qkv(3, 2 * page, seed=2)
    k_pages = jax.random.normal(jax.random.key(4), (HKV, pool, page, D))
    v_pages = jax.random.normal(jax.random.key(5), (HKV, pool, page, D))
    tables = jnp.asarray([[3, 0, 7, 1], [2, 5, 6, 4]], jnp.int32)
    lengths = jnp.asarray([5, 13], jnp.int32)
    kw = dict(implementation=implementation, interpret=implementation == "pallas" and not HAS_GPU,
              local_window_size=(6, 0), logits_soft_cap=4.0, sinks=jnp.linspace(-1, 1, HQ))

    def step(q, k_pages, v_pages, k_new, v_new):
        """Two tokens per sequence written at `lengths`, one more after them (a [B, Hkv, D]
        update), then attention over the lengths + 3 keys."""
        kp, vp = ffpa_jax.update_kv_pages(k_pages, v_pages, k_new, v_new, tables, lengths)
        kp, vp = ffpa_jax.update_kv_pages(kp, vp, k_new[:, 0], v_new[:, 0], tables,
                                          lengths + 2)
        return ffpa_jax.paged_attention(q, kp, vp, tables, lengths + 3, return_lse=True,
                                        **kw)
    with strict():
        out, lse = jax.jit(step)(q[:, 0], k_pages, v_pages, k[:, :2], v[:, :2])
    for x in (out, lse):
        assert np.all(np.isfinite(np.asarray(x))) and np.any(np.asarray(x) != 0)


def test_dropout_mask_under_strict_rank_promotion():
    with strict():
        keep = ffpa_jax.dropout_mask(jax.random.key(0), (B, HQ, 24, 40), 0.3)
    assert keep.shape == (B, HQ, 24, 40) and 0.6 < float(np.mean(np.asarray(keep))) < 0.8


@pytest.mark.parametrize("t,s", [(24, 24), (24, 40)])  # causal T != S: Flax's top-left mask
def test_flax_attention_fn_under_strict_rank_promotion(t, s):
    """Two batch dims, a rank-2 mask and bias broadcast over them, causality, dropout and the
    sown weights (in a linen module)."""
    nn = pytest.importorskip("flax.linen")
    q, k, v = (x.reshape(1, *x.shape) for x in _qkv(t, s))
    a = _arrays(t, s)

    class Sow(nn.Module):
        @nn.compact
        def __call__(self, q, k, v, bias, mask):
            return flax_attention_fn(q, k, v, bias, mask, module=self, is_causal=True,
                                     broadcast_dropout=False, dropout_rate=0.2,
                                     dropout_rng=jax.random.key(1), implementation="xla")

    with strict():
        out, sown = Sow().apply({}, q, k, v, a["bias2"], a["mask2"], mutable=["intermediates"])
    weights = sown["intermediates"]["attention_weights"][0]
    assert out.shape == q.shape and weights.shape == (1, B, HQ, t, s)
    assert np.all(np.isfinite(np.asarray(out))) and np.any(np.asarray(out) != 0)
