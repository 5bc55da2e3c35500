"""The `"pallas"` implementation: launch configs from `tuning`, kernels from `pallas_kernels`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import tuning
from ffpa_jax.validation import Problem
from pallas_kernels import FwdConfig, fwd_generic

_DTYPE_NAMES = {jnp.dtype(jnp.float16): "fp16", jnp.dtype(jnp.bfloat16): "bf16",
                jnp.dtype(jnp.float32): "fp32"}


def fwd_config(problem: Problem, *, has_bias: bool) -> FwdConfig:
    """fwd_generic's launch parameters for this problem (tuned entry or default)."""
    cfg = tuning.launch_config(
        "fwd_generic", direction="forward", dtype=_DTYPE_NAMES[problem.dtype],
        headdim=max(problem.head_dim, problem.head_dim_v), seqlen_q=problem.seq_q,
        seqlen_k=problem.seq_k, causal=problem.is_causal, has_attn_bias=has_bias,
        has_dropout=problem.dropout_rate > 0, nheads_q=problem.heads_q,
        nheads_kv=problem.heads_kv)
    return FwdConfig(block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"],
                     block_d=cfg["BLOCK_HEADDIM_QK"], block_dv=cfg["BLOCK_HEADDIM_V"],
                     num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                     q_mode=cfg.get("Q_MODE", "resident"))


def pallas_attention(q, k, v, bias4, mask4, problem: Problem, *, interpret: bool):
    """(out, lse) through the Pallas kernels; q/k/v batched, bias4/mask4 4-D or None."""
    config = fwd_config(problem, has_bias=bias4 is not None)
    return fwd_generic(q, k, v, bias4, mask4, scale=problem.scale, causal=problem.is_causal,
                       config=config, interpret=interpret)
