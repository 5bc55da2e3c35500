"""The Mosaic tier's launch configs in the tuned-config files.

An entry of kernel "mosaic_fwd" or "mosaic_bwd" carries some fields of `Config` (`FIELDS`);
`config_problem` says why an entry's config cannot launch (a file written by hand or by
another version is skipped, never raised on); `tuned_config` applies an entry to a call:
the built-in default with the entry's fields, unless the entry was tuned for a problem the
call's kernels cannot take it from (then the default, and why). `as_fields` is the inverse,
and `candidate_fields` the autotuner's candidates around a call's default.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Mapping

from pallas_kernels.mosaic.config import (Config, default_backward_config, default_config,
                                          round_up, uses_wide_kernel)

FORWARD_KERNEL = "mosaic_fwd"
BACKWARD_KERNEL = "mosaic_bwd"
# The fields an entry may set, and their types. "wide" records which forward kernel the
# entry was tuned on: its ring and clusters mean something else to the other kernel.
FIELDS: dict[str, dict[str, type]] = {
    FORWARD_KERNEL: {"block_kv": int, "num_stages": int, "cluster": int, "cluster_axis": str,
                     "grid_order": str, "lowering": str, "wide_piece": int, "wide": bool,
                     "persistent": bool, "overlap": bool},
    BACKWARD_KERNEL: {"num_stages": int, "block_q": int},
}
MAX_STAGES = 6
WIDE_MIN_BLOCK_KV = 128  # 64 key columns per consumer warpgroup
BACKWARD_WIDE_ROWS_MAX_HEAD_DIM = 64  # 128 query rows per backward step fit the registers


def default_for(kernel: str, head_dim: int, head_dim_v: int, *, group: int = 1,
                segments: bool = False, causal: bool = False,
                window: tuple[int, int] | None = None, seq_q: int | None = None) -> Config:
    """`kernel`'s built-in config for these head dims, GQA group, segment ids, causality,
    window and query length (what a call runs without an entry, and where the autotuner's
    candidates start)."""
    if kernel == BACKWARD_KERNEL:
        return default_backward_config(head_dim, head_dim_v, segments=segments)
    return default_config(head_dim, head_dim_v, causal=causal, gqa_group=group,
                          segments=segments, window=window, seq_q=seq_q)


def config_problem(kernel: str, config: Any) -> str | None:
    """Why `config` cannot be a tuned config of `kernel`, or None when it can."""
    fields = FIELDS.get(kernel)
    if fields is None:
        return f"unknown kernel {kernel!r}"
    if not isinstance(config, Mapping):
        return f"config is {type(config).__name__}, expected a dict"
    for key, value in config.items():
        if key not in fields:
            return f"{key!r} is not a field of {kernel}'s config (one of {sorted(fields)})"
        if type(value) is not fields[key]:
            return f"{key}={value!r} is not {fields[key].__name__}"
    if not 1 <= config.get("num_stages", 2) <= MAX_STAGES:
        return f"num_stages={config['num_stages']} not in 1..{MAX_STAGES}"
    try:
        Config(**config)
    except ValueError as err:
        return str(err)
    return None


def as_fields(kernel: str, config: Config) -> dict:
    """`config`'s fields that an entry of `kernel` carries."""
    fields = {key: getattr(config, key) for key in FIELDS[kernel]}
    if "wide" in fields:
        fields["wide"] = bool(config.wide)
    return fields


def tuned_config(kernel: str, default: Config, tuned: Mapping | None, *, head_dim: int,
                 head_dim_v: int, group: int, segments: bool) -> tuple[Config, str]:
    """(the config a call runs, "" or why the entry `tuned` was not used). `default` is the
    call's built-in config; `tuned` an entry's config (None: no entry)."""
    if tuned is None:
        return default, ""
    if segments:
        return default, ("not with segment ids (the entry was tuned without them, and their "
                         "tiles take shared memory)")
    fields = dict(tuned)
    if kernel == FORWARD_KERNEL:
        # An entry without these fields was measured on one CTA per tile, without the
        # overlap.
        fields.setdefault("persistent", False)
        fields.setdefault("overlap", False)
    wide = uses_wide_kernel(head_dim, head_dim_v)
    if fields.pop("wide", wide) != wide:
        return default, ("the entry was tuned on the "
                         + ("rows" if wide else "wide") + " kernel")
    config = dataclasses.replace(default, **fields)
    if wide and config.block_kv < WIDE_MIN_BLOCK_KV:
        return default, f"the wide kernel takes at least {WIDE_MIN_BLOCK_KV} keys per step"
    if config.cluster > 1 and config.cluster_axis == "heads" and group % config.cluster:
        return default, (f"its clusters of {config.cluster} query heads do not divide the "
                         f"GQA group of {group}")
    widest = max(round_up(head_dim, 64), round_up(head_dim_v, 64))
    if config.block_q != 64 and widest > BACKWARD_WIDE_ROWS_MAX_HEAD_DIM:
        return default, (f"{config.block_q} query rows per step fit only head dims up to "
                         f"{BACKWARD_WIDE_ROWS_MAX_HEAD_DIM}")
    return config, ""


# The autotuner's knobs per kernel (each a field and the values it tries), the most
# telling first: the ring and keys per step, the rows kernel's overlap, then clusters and the
# grid's order.
_ROWS_KNOBS = (("block_kv", (64, 128, 256)), ("num_stages", (2, 3, 4)),
               ("overlap", (False, True)), ("lowering", ("lane", "warpgroup")), ("cluster", (1, 2)),
               ("grid_order", ("heads", "q")), ("persistent", (False, True)))
_WIDE_KNOBS = (("num_stages", (2, 3, 4)), ("wide_piece", (64, 128)), ("cluster", (1, 2, 4)),
               ("grid_order", ("heads", "q")), ("block_kv", (128, 256)))
_BACKWARD_KNOBS = (("block_q", (64, 128)), ("num_stages", (2, 3)))


def candidate_fields(kernel: str, default: Config, *, head_dim: int, head_dim_v: int,
                     group: int, limit: int, grid: bool) -> list[dict]:
    """Up to `limit` candidate entries of `kernel` around the call's built-in `default`:
    the default's own fields first, then each knob's other values one at a time, then
    (`grid`) every combination. Only candidates `tuned_config` would run are kept (clusters
    along heads that divide the group, 128 query rows only at small head dims); whether
    one fits shared memory is for the measurement to find out."""
    if kernel == BACKWARD_KERNEL:
        knobs = _BACKWARD_KNOBS
    else:
        knobs = _WIDE_KNOBS if uses_wide_kernel(head_dim, head_dim_v) else _ROWS_KNOBS
    base = as_fields(kernel, default)
    out: list[dict] = []

    def add(fields: dict) -> None:
        if fields.get("cluster", 1) > 1 and "cluster_axis" in fields:
            fields["cluster_axis"] = "heads" if group % fields["cluster"] == 0 else "q"
            if fields["cluster_axis"] == "q":
                fields["persistent"] = False  # a persistent launch's clusters are heads
        if len(out) >= limit or fields in out or config_problem(kernel, fields):
            return
        if not tuned_config(kernel, default, fields, head_dim=head_dim, head_dim_v=head_dim_v,
                            group=group, segments=False)[1]:
            out.append(fields)

    add(dict(base))
    for name, values in knobs:
        for value in values:
            add(dict(base, **{name: value}))
    if grid:
        for combination in itertools.product(*(values for _, values in knobs)):
            add(dict(base, **dict(zip((name for name, _ in knobs), combination))))
    return out
