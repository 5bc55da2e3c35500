"""`kernel_config`: the one place a kernel's launch parameters come from (a tuned entry for
this device and problem, else the built-in default), with why."""

from __future__ import annotations

import logging
from typing import Any

from pallas_kernels.problem import Problem
from tuning.defaults import DESCRIBED, default_config
from tuning.lookup import TunedEntry, explain_entry
from tuning.registry import KERNELS

logger = logging.getLogger("ffpa_jax.tuning")


def _padded(headdim: int) -> int:
    """The power-of-two tile width a head dim is computed in."""
    return 1 << max(0, (int(headdim) - 1).bit_length())


def _same_group(entry: dict, nheads_q: int | None, nheads_kv: int | None) -> bool:
    if nheads_q is None or nheads_kv is None:
        return True
    return entry["nheads_q"] // entry["nheads_kv"] == nheads_q // nheads_kv


def usable_config(kernel: str, found: TunedEntry, *, headdim: int, seqlen_k: int,
                  nheads_q: int | None, nheads_kv: int | None,
                  batch: int | None) -> tuple[dict[str, Any] | None, str]:
    """(the matched entry's config as this call may use it, or None for the default; why
    not, or what was changed).

    Three guards on top of the lookup rules (which pick the *nearest* stored problem):
    - The decode kernels pack the query heads of a GQA group (times T) into the rows
      of one tile: an entry tuned at another group size tiled another problem (H200,
      B=8, Hq/Hkv=32/8, D=512, S=131072: MHA-tuned entries took 1.22x the defaults).
    - A config tuned at a head dim whose padded tile is narrower than this call's
      (e.g. 256 -> 320, which pads to 512) was never compiled at this width: its
      tiles can overflow shared memory. The built-in default is used instead.
    - A tuned decode split count (NUM_SPLITS) fits the problem it was tuned on: the
      same keys, KV heads and batch. Elsewhere the split-count heuristic decides,
      with the entry's block sizes.
    """
    entry, config = found.entry, found.entry["config"]  # a fresh copy: ours to edit
    if kernel.startswith("decode") and not _same_group(entry, nheads_q, nheads_kv):
        why = (f"the entry for heads {entry['nheads_q']}/{entry['nheads_kv']} is not used for "
               f"heads {nheads_q}/{nheads_kv} (another packing of query heads into the tile)")
        logger.debug("tuned %s %s", kernel, why)
        return None, why
    if _padded(entry["headdim"]) < _padded(headdim):
        why = (f"the entry for headdim={entry['headdim']} is not used at headdim={headdim} "
               "(narrower tiles)")
        logger.debug("tuned %s %s", kernel, why)
        return None, why
    if "NUM_SPLITS" in config and not (entry["seqlen_k"] == seqlen_k
                                       and entry["nheads_kv"] == nheads_kv
                                       and found.file_batch == batch):
        del config["NUM_SPLITS"]
        return config, "its NUM_SPLITS left to the heuristic (tuned on another problem)"
    return config, ""


def lookup_fields(problem: Problem, direction: str) -> dict:
    """The tuned lookup's fields of `problem` (the tuned-config files' vocabulary)."""
    return dict(dtype=problem.dtype_name, headdim=problem.headdim, seqlen_q=problem.seq_q,
                seqlen_k=problem.seq_k, causal=problem.causal,
                has_attn_bias=problem.has_bias, has_dropout=problem.has_dropout,
                nheads_q=problem.heads_q, nheads_kv=problem.heads_kv,
                bias_grad=problem.has_bias if direction == "backward" else None)


def kernel_direction(kernel: str) -> str:
    return KERNELS[kernel].direction


def kernel_config(kernel: str, problem: Problem, *, device_name: str | None = None,
                  compute_capability: str | None = None) -> tuple[dict | None, str]:
    """(the launch config of `kernel` for `problem`, why): the tuned entry for this device
    (JAX's, or the one named) when one matches and this call may use it, else the built-in
    default, with the entry it came from or why the default applies. A kernel without a
    descriptor (the Mosaic tier's) has its default in its tier: None where no entry serves.

    Called at trace time; the lookup caches, so a traced step pays nothing. Entries a
    kernel cannot launch never get this far: the file loader drops them, and
    `usable_config` drops those tuned for a narrower head dim."""
    direction = kernel_direction(kernel)
    fields = lookup_fields(problem, direction)
    found, where = explain_entry(direction, kernel, device_name=device_name,
                                 compute_capability=compute_capability, **fields)
    if found is not None:
        tuned, note = usable_config(kernel, found, headdim=problem.headdim,
                                    seqlen_k=problem.seq_k, nheads_q=problem.heads_q,
                                    nheads_kv=problem.heads_kv, batch=problem.batch)
        if tuned is not None:
            return tuned, f"tuned entry ({where})" + (f"; {note}" if note else "")
        where = note
    if kernel not in DESCRIBED:  # the Mosaic kernels: their tier holds the default
        return None, f"no tuned entry ({where})"
    return (default_config(kernel, headdim=problem.headdim, dtype=problem.dtype_name,
                           has_dropout=problem.has_dropout),
            f"built-in default ({where})")
