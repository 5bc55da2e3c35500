"""`Plan`: everything static about one attention call, and `Target`: where it runs.

A plan is the problem (`problem.Problem`, what to compute), the tier that runs each
direction, and the launch config of every kernel those tiers run (how). The dispatcher
(`tuning.dispatch`) makes it; the tiers (`tiers.TIERS`) run it. It is hashable: a jitted
call is compiled once per (problem, plan).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pallas_kernels.problem import Problem


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a plan runs, as the tiers' configs need to know it: whether the kernels are
    compiled for an NVIDIA GPU (else XLA fusions stand in for the chunked tier's Pallas
    step), whether the Pallas kernels run in Pallas' interpreter, the GPU's
    multiprocessor count (the decode kernels split keys over them), and whether Mosaic GPU
    kernels run (`sm90`: an sm90 GPU and a JAX that runs them, not interpreted; the chunked
    tier's backward step has a Mosaic kernel there)."""

    nvidia_gpu: bool = False
    interpret: bool = False
    multiprocessors: int = 132
    sm90: bool = False

    @property
    def runs_kernels(self) -> bool:
        """Whether Pallas kernels run at all (compiled, or interpreted)."""
        return self.nvidia_gpu or self.interpret


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """One kernel's launch config in a plan, the direction that runs it, and why it is that
    one (the tuned entry it came from, the built-in default, or the rule that sized it);
    `settings` is the config as a tuned file writes it (FFPA's keys), for `info`."""

    kernel: str
    config: Any
    why: str
    direction: str = "forward"
    settings: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, kernel: str, config: Any, why: str, direction: str,
           settings: dict | None = None) -> "KernelChoice":
        return cls(kernel, config, why, direction,
                   tuple((settings or {}).items()))


@dataclasses.dataclass(frozen=True)
class Plan:
    """One call's problem, the tier of each direction, and its kernels' configs."""

    problem: Problem
    forward_tier: str
    backward_tier: str
    kernels: tuple[KernelChoice, ...] = ()
    interpret: bool = False
    # The forward writes its output in float32 (the vjp's forward: a 16-bit backward's
    # δ = rowsum(dO·O) must not see O rounded to 16 bits, or gradients that cancel
    # lose the precision XLA's own gradient keeps; float32 does not read O).
    float32_out: bool = False
    # The backward's lse cotangent is not a symbolic zero (the caller differentiates
    # through lse): dS then carries d_lse·P, whose sums over heads and keys XLA keeps in
    # float32, so 16-bit kernels feed dS to dQ's and dK's matmuls as two words
    # (`numerics.accumulate_ds`: two more of the backward's 7 matmuls). Without it, no cost.
    lse_cotangent: bool = False
    # The caller asked for a bitwise-reproducible backward (`deterministic=True`): the
    # dispatcher then picks only tiers whose backward adds in one order.
    deterministic: bool = False
    # The forward's tier when JAX differentiates the call (the vjp's forward rule), where
    # it is not `forward_tier`: a forward+backward can run faster with a slower forward
    # whose work the backward shares (the chunked pair at D = 512: XLA reuses the chunked
    # forward's GEMMs in the chunked backward's recomputation). None: `forward_tier`.
    vjp_forward_tier: str | None = None

    def config(self, kernel: str):
        """The launch config of `kernel` in this plan (KeyError if the plan has none)."""
        for choice in self.kernels:
            if choice.kernel == kernel:
                return choice.config
        raise KeyError(f"the plan has no config for kernel {kernel!r}; it has "
                       f"{[c.kernel for c in self.kernels]}")

    def tier(self, direction: str) -> str:
        return self.forward_tier if direction == "forward" else self.backward_tier

    def for_vjp(self) -> "Plan":
        """The plan of the differentiated call's two rules: its forward on
        `vjp_forward_tier` where one is set, writing the output in float32."""
        return dataclasses.replace(self, forward_tier=self.vjp_forward_tier or self.forward_tier,
                                   vjp_forward_tier=None, float32_out=True)


# In float32 lse travels as an exact pair (hi, lo) between the directions: the forward
# returns hi = m + fl(log l) and its rounding error lo (the decode path: lo = 0); the
# backward takes that pair, corrects lo so that its own P sums to 1 and computes
# δ = Σ P·dP from its own P and dP (`bwd.bwd_exact_rows`), as XLA's softmax gradient
# does. From one float32 lse, every P of a row was off by up to an ulp of |lse|, ~1e-5
# relative at logits ~ 300, which gave float32 gradients several times XLA's error.
# (16-bit P is rounded to 16 bits anyway.) `Problem.lse_pair` says when.


def row_outputs(plan: Plan) -> int:
    """How many row statistics [B, Hq, T] a forward returns after out."""
    return 2 if plan.problem.lse_pair else 1
