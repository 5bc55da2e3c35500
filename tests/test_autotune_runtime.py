"""Runtime autotune (ffpa_jax.runtime_autotune): chosen at trace time, cached per process,
off by default, and a warned no-op without a GPU."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

from ffpa_jax import runtime_autotune as rt
from pallas_kernels.problem import Problem
from tuning.autotune import search_space


def problem(**kw) -> Problem:
    fields = dict(batch=1, seq_q=24, seq_k=40, heads_q=2, heads_kv=1, head_dim=16,
                  head_dim_v=16, dtype=jnp.bfloat16, scale=0.25, causal=True,
                  bias_shape=(1, 1, 1, 40))
    fields.update(kw)
    return Problem(**fields)


@pytest.fixture(autouse=True)
def fresh():
    rt.clear_cache()
    yield
    rt.clear_cache()


def test_off_by_default_and_bad_modes_refused():
    assert rt.autotuned_config("fwd_generic", problem(), mode=None) is None
    with pytest.raises(ValueError, match="autotune must be None, 'fast' or 'max'"):
        rt.autotuned_config("fwd_generic", problem(), mode="fastest")


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="CPU behaviour")
def test_without_gpu_falls_back_with_one_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert rt.autotuned_config("fwd_generic", problem(), mode="fast",
                                       interpret=True) is None
            assert rt.autotuned_config("bwd_generic_dq", problem(), mode="max") is None
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "autotune needs an NVIDIA GPU" in messages[0]


def test_measures_while_traced_and_caches_the_winner(monkeypatch):
    # Two candidates keep the interpreted run short; the mechanism is what is tested.
    full = search_space.candidates
    monkeypatch.setattr(search_space, "candidates", lambda *a, **k: full(*a, **k)[:2])
    seen = {}

    @jax.jit
    def traced(x):
        seen["cfg"] = rt.autotuned_config("fwd_generic", problem(), mode="fast",
                                          interpret=True, measure_interpret=True)
        return x + 1

    traced(jnp.zeros(3))
    first = seen["cfg"]
    assert first in full("fwd_generic", headdim=16)[:2]
    assert rt._stats["tuned"] == 1
    # Same shape again (a new trace): served from the cache, nothing measured.
    again = rt.autotuned_config("fwd_generic", problem(), mode="fast",
                                interpret=True, measure_interpret=True)
    assert again == first and rt._stats["tuned"] == 1
    # A kernel that cannot run this problem (no bias -> no bias gradient) is not measured.
    assert rt.autotuned_config("bwd_dbias", problem(bias_shape=None), mode="fast", interpret=True, measure_interpret=True) is None
    assert rt._stats["tuned"] == 1
    rt.release_inputs()
    assert rt._inputs == {}


def test_override_is_off_without_a_mode():
    assert rt.override(None, interpret=False) is None
    hook = rt.override("fast", interpret=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert hook("fwd_generic", problem()) is None  # no GPU here: the tuned/default config
