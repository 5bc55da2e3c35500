"""`launch_config`: the one place callers get a kernel's launch parameters from."""

from __future__ import annotations

import logging

from tuning.defaults import default_config
from tuning.lookup import lookup_config
from tuning.registry import config_problem

_log = logging.getLogger("ffpa_jax.tuning")


def launch_config(kernel: str, *, direction: str, dtype: str, headdim: int, seqlen_q: int,
                  seqlen_k: int, causal: bool = False, has_attn_bias: bool = False,
                  has_dropout: bool = False, nheads_q: int | None = None,
                  nheads_kv: int | None = None, bias_grad: bool | None = None,
                  device_name: str | None = None) -> dict:
    """The tuned config for this problem on this device, else the built-in default.

    Called at trace time; `lookup_config` caches, so a traced step pays nothing.
    A tuned entry the kernel cannot launch is ignored (never an error).
    """
    tuned = lookup_config(direction, kernel, dtype=dtype, headdim=headdim, seqlen_q=seqlen_q,
                          seqlen_k=seqlen_k, causal=causal, has_attn_bias=has_attn_bias,
                          has_dropout=has_dropout, nheads_q=nheads_q, nheads_kv=nheads_kv,
                          bias_grad=bias_grad, device_name=device_name)
    if tuned is not None:
        problem = config_problem(kernel, tuned)
        if problem is None:
            return dict(tuned)
        _log.debug("ignoring tuned %s config %s: %s", kernel, tuned, problem)
    return default_config(kernel, headdim=headdim, dtype=dtype)
