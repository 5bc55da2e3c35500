"""The chunked tier's window bands with dropout: a band starts where its rows' window does,
a traced key that the keep decisions' Philox chunks (32 keys each) must start at; bands
start at multiples of 32 when dropping (`chunked_plan.band_align`), so that both steps draw
the keep decisions of the dense path."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import chunked_plan, tiers
from pallas_kernels.plan import KernelChoice
from pallas_kernels.problem import Inputs, Problem
from tuning import dispatch


@pytest.mark.parametrize("step", [chunked_plan.STEP_FUSION, chunked_plan.STEP_KERNEL])
def test_window_bands_draw_the_dense_keep_decisions(step):
    rng = np.random.default_rng(3)
    q, k, v = (jnp.asarray(rng.standard_normal((1, n, 2, 16)), jnp.float32)
               for n in (128, 160, 160))
    inputs = Inputs(q, k, v, seed=jnp.asarray([11, 12], jnp.uint32))
    problem = Problem.of(q, k, v, dropout_rate=0.3, window=(20, 12))
    interpret = step == chunked_plan.STEP_KERNEL
    plan = dispatch.plan_for_tiers(problem, "chunked", "chunked", interpret=interpret)
    config = chunked_plan.make_config(problem, step=step, blocks=(16, 32))
    assert any(g.band for g in chunked_plan.groups(problem, config.block_q))
    plan = dataclasses.replace(plan, kernels=tuple(
        KernelChoice.of(tiers.CHUNKED_KERNEL, config, "test", d) for d in ("forward", "backward")))
    out = tiers.forward(plan, inputs)[0]
    want = tiers.forward(dispatch.plan_for_tiers(problem, "xla", "xla"), inputs)[0]
    err = float(jnp.max(jnp.abs(out - want)))
    assert err <= 1e-5 * max(float(jnp.max(jnp.abs(want))), 1.0), err
