"""`launch_config`: the one place callers get a kernel's launch parameters from."""

from __future__ import annotations

from tuning.defaults import default_config
from tuning.lookup import lookup_config


def launch_config(kernel: str, *, direction: str, dtype: str, headdim: int, seqlen_q: int,
                  seqlen_k: int, causal: bool = False, has_attn_bias: bool = False,
                  has_dropout: bool = False, nheads_q: int | None = None,
                  nheads_kv: int | None = None, bias_grad: bool | None = None,
                  device_name: str | None = None) -> dict:
    """The tuned config for this problem on this device, else the built-in default.

    Called at trace time; `lookup_config` caches, so a traced step pays nothing.
    Entries a kernel cannot launch never get this far: the file loader drops them.
    """
    tuned = lookup_config(direction, kernel, dtype=dtype, headdim=headdim, seqlen_q=seqlen_q,
                          seqlen_k=seqlen_k, causal=causal, has_attn_bias=has_attn_bias,
                          has_dropout=has_dropout, nheads_q=nheads_q, nheads_kv=nheads_kv,
                          bias_grad=bias_grad, device_name=device_name)
    if tuned is not None:
        return tuned
    return default_config(kernel, headdim=headdim, dtype=dtype, has_dropout=has_dropout)
