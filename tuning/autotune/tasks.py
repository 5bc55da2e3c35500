"""The autotuner's task list: which (kernel, problem) pairs to tune, and the entries they become.

One task = one kernel on one problem; it becomes one entry of the tuned-config
file (two for decode: see `entries_for`). This module is plain Python (no JAX):
the CLI builds and schedules tasks before any GPU is touched.

Grid (FFPA's): head dims 64 … 1024, seqlens 1 (decode: Nq = 1 against every
other seqlen as Nkv), 512 … 8192, and 16384 on GPUs with at least 48 GiB.
Prefill problems are square (T = S), causal and not. `--full-tasks` adds FFPA's
single-feature variants at each square seqlen, non-causal: attn-mask (an
additive [1, 1, 1, S] bias, whose backward also tunes bwd_dbias), dropout
(p = 0.1), gqa (Hkv = the largest divisor of H not above H/4) and mqa (Hkv = 1).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Iterable, Mapping

from pallas_kernels import fused
from pallas_kernels.mosaic import tier as mosaic_tier
from pallas_kernels.mosaic import tuned as mosaic_tuned
from pallas_kernels.problem import DTYPES, Problem

HEADDIMS = (64, 128, 256, 320, 512, 640, 768, 1024)
SEQLENS = (1, 512, 1024, 2048, 4096, 8192)
LARGE_SEQLEN = 16384
LARGE_SEQLEN_MIN_GIB = 48
DROPOUT_RATE = 0.1

FORWARD_KERNELS = (fused.FWD_GENERIC.name,)
# The Mosaic tier's kernels (ours, sm90 only): tuned after every FFPA task of the grid, on
# the 16-bit prefill problems their tier serves (`mosaic_tasks`).
MOSAIC_FORWARD_KERNEL = mosaic_tuned.FORWARD_KERNEL
MOSAIC_BACKWARD_KERNEL = mosaic_tuned.BACKWARD_KERNEL
BACKWARD_KERNELS = (fused.BWD_PREPROC.name, fused.BWD_GENERIC_DQ.name,
                    fused.BWD_GENERIC_DKDV.name)
DECODE_KERNELS = (fused.DECODE_FWD_STAGE1.name, fused.DECODE_FWD_STAGE2.name)
# The relative cost of a kernel's task per unit of work (`Task.cost`).
_COST_FACTORS = {fused.FWD_GENERIC.name: 4, fused.BWD_GENERIC_DQ.name: 6,
                 fused.BWD_GENERIC_DKDV.name: 8, fused.BWD_DBIAS.name: 6,
                 fused.BWD_PREPROC.name: 0.0}


@dataclasses.dataclass(frozen=True)
class Task:
    """One kernel on one problem. Field names follow the tuned-config entry's."""

    direction: str
    kernel: str
    case_name: str
    dtype: str
    headdim: int
    seqlen_q: int
    seqlen_k: int
    causal: bool
    batch: int
    nheads_q: int
    nheads_kv: int
    has_attn_bias: bool = False
    has_dropout: bool = False

    @property
    def bias_shape(self) -> tuple[int, int, int, int] | None:
        return (1, 1, 1, self.seqlen_k) if self.has_attn_bias else None

    @property
    def dropout_rate(self) -> float:
        return DROPOUT_RATE if self.has_dropout else 0.0

    @property
    def key(self) -> str:
        return entry_key(self.as_dict())

    def label(self) -> str:
        heads = "" if self.nheads_q == self.nheads_kv else f" H{self.nheads_q}/{self.nheads_kv}"
        extra = "".join([" causal" if self.causal else "", " bias" if self.has_attn_bias else "",
                         " dropout" if self.has_dropout else ""])
        return (f"{self.kernel} {self.dtype} D={self.headdim} T={self.seqlen_q} "
                f"S={self.seqlen_k}{heads}{extra}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Task":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def problem(self) -> Problem:
        """The problem this task measures (D = Dv, the scale 1/sqrt(D))."""
        return Problem(batch=self.batch, seq_q=self.seqlen_q, seq_k=self.seqlen_k,
                       heads_q=self.nheads_q, heads_kv=self.nheads_kv, head_dim=self.headdim,
                       head_dim_v=self.headdim, dtype=DTYPES[self.dtype],
                       scale=1.0 / math.sqrt(self.headdim), causal=self.causal,
                       bias_shape=self.bias_shape, dropout_rate=self.dropout_rate)

    def cost(self) -> float:
        """A rough relative cost (seconds-like) for time-left estimates and ordering."""
        work = self.batch * self.nheads_q * self.seqlen_q * self.seqlen_k * self.headdim
        factor = _COST_FACTORS.get(self.kernel, 2)
        if self.causal:
            factor /= 2
        # ~1 s of compiling and checking per task, plus ~a dozen timed calls at ~250 TF/s.
        return 1.0 + 12 * factor * work / 2.5e14


def entry_key(entry: Mapping[str, Any]) -> str:
    """The identity of an entry (or task): what a resumed run compares."""
    bias_grad = entry.get("bias_grad")
    if entry.get("direction") == "backward" and bias_grad is None:
        bias_grad = bool(entry.get("has_attn_bias"))
    fields = [entry.get("direction"), entry.get("kernel"), entry.get("case_name"),
              entry.get("dtype"), entry.get("headdim"), entry.get("seqlen_q"),
              entry.get("seqlen_k"), bool(entry.get("causal")), entry.get("nheads_q"),
              entry.get("nheads_kv"), bool(entry.get("has_attn_bias")),
              bool(entry.get("has_dropout")),
              bias_grad if entry.get("direction") == "backward" else None]
    return json.dumps(fields)


def gqa_kv_heads(heads: int) -> int:
    """KV heads of the gqa variant: the largest divisor of H that is at most H / 4."""
    limit = max(1, heads // 4)
    return max(d for d in range(1, limit + 1) if heads % d == 0)


def grid_seqlens(memory_gib: float | None, seqlens: Iterable[int] | None = None) -> list[int]:
    """The seqlen grid: the given list, else FFPA's, with 16384 on GPUs of >= 48 GiB."""
    if seqlens is not None:
        return sorted(set(int(s) for s in seqlens))
    grid = list(SEQLENS)
    if memory_gib is not None and memory_gib >= LARGE_SEQLEN_MIN_GIB:
        grid.append(LARGE_SEQLEN)
    return grid


def build_tasks(*, directions: Iterable[str], dtypes: Iterable[str], batch: int, heads: int,
                headdims: Iterable[int], seqlens: Iterable[int], full_tasks: bool = False,
                causal: Iterable[bool] = (False, True), mosaic: bool = False) -> list[Task]:
    """Every task of the grid, grouped by problem (forward first, then its backward); with
    `mosaic` (an sm90 GPU) the Mosaic kernels' tasks after them all."""
    directions = set(directions)
    causal = tuple(causal)
    seqlens = sorted(set(seqlens))
    prefill = [s for s in seqlens if s > 1]
    tasks: list[Task] = []

    def add(direction, kernels, **fields):
        if direction in directions:
            tasks.extend(Task(direction=direction, kernel=k, **fields) for k in kernels)

    for dtype in dtypes:
        for d in headdims:
            base = dict(dtype=dtype, headdim=d, batch=batch, nheads_q=heads)
            if 1 in seqlens:
                for s_k in prefill:
                    add("forward", DECODE_KERNELS, case_name="decode-attn", seqlen_q=1,
                        seqlen_k=s_k, causal=False, nheads_kv=heads, **base)
            for s in prefill:
                sq = dict(seqlen_q=s, seqlen_k=s, **base)
                for c in causal:
                    fields = dict(case_name="common", causal=c, nheads_kv=heads, **sq)
                    add("forward", FORWARD_KERNELS, **fields)
                    # A float32 backward computes δ in bwd_exact_rows (it borrows dq's
                    # config), so bwd_preproc is not run there.
                    add("backward", tuple(k for k in BACKWARD_KERNELS
                                          if not (dtype == "fp32" and k == fused.BWD_PREPROC.name)),
                        **fields)
                if not full_tasks:
                    continue
                variants = [("attn-mask", heads, True, False), ("dropout", heads, False, True)]
                if gqa_kv_heads(heads) not in (heads, 1):
                    variants.append(("gqa", gqa_kv_heads(heads), False, False))
                if heads > 1:
                    variants.append(("mqa", 1, False, False))
                for case, kv, bias, dropout in variants:
                    fields = dict(case_name=case, causal=False, nheads_kv=kv,
                                  has_attn_bias=bias, has_dropout=dropout, **sq)
                    add("forward", FORWARD_KERNELS, **fields)
                    dbias = (fused.BWD_DBIAS.name,) if bias else ()
                    add("backward", BACKWARD_KERNELS[1:] + dbias, **fields)
    if mosaic:
        tasks += [t for t in mosaic_tasks(tasks) if t.direction in directions]
    return tasks


def mosaic_tasks(tasks: list[Task]) -> list[Task]:
    """The Mosaic kernels' tasks on the problems of `tasks` (one per problem and direction)
    that their tier computes (`pallas_kernels.mosaic.tier.unsupported`: 16-bit, no bias or
    dropout, head dims up to 512 in the forward, those its backward takes and more keys than
    one tile in the backward), decode problems (one query) aside."""
    out: list[Task] = []
    seen = set()
    for task in tasks:
        if (task.dtype == "fp32" or task.has_attn_bias or task.has_dropout
                or task.seqlen_q == 1):
            continue
        for direction, kernel in (("forward", MOSAIC_FORWARD_KERNEL),
                                  ("backward", MOSAIC_BACKWARD_KERNEL)):
            mosaic = dataclasses.replace(task, direction=direction, kernel=kernel)
            if mosaic.key not in seen and not mosaic_tier.unsupported(task.problem(),
                                                                      direction):
                seen.add(mosaic.key)
                out.append(mosaic)
    return out


def entries_for(task: Task, config: Mapping[str, Any], *, tuned_ms: float | None = None,
                default_ms: float | None = None) -> list[dict[str, Any]]:
    """The tuned-config entries one finished task becomes.

    A decode task (Nq = 1) also yields its causal twin: with one query row,
    bottom-right causality hides no key, so the causal problem is the same one.
    """
    entry: dict[str, Any] = {
        "direction": task.direction, "kernel": task.kernel, "case_name": task.case_name,
        "causal": task.causal, "dtype": task.dtype, "headdim": task.headdim,
        "seqlen_q": task.seqlen_q, "seqlen_k": task.seqlen_k,
        "seqlen_q_bucket": task.seqlen_q, "seqlen_k_bucket": task.seqlen_k,
        "nheads_q": task.nheads_q, "nheads_kv": task.nheads_kv,
        "has_attn_bias": task.has_attn_bias, "has_dropout": task.has_dropout,
        "config": dict(config),
    }
    if task.direction == "forward":
        entry.update(enable_tma=False, enable_ws=False)
    else:
        entry.update(bias_grad=task.has_attn_bias, grad_kv_storage_dtype=None)
    # Ours (readers ignore unknown keys): what the winner and the default measured.
    if tuned_ms is not None:
        entry["tuned_ms"] = round(tuned_ms, 5)
    if default_ms is not None:
        entry["default_ms"] = round(default_ms, 5)
    entries = [entry]
    if task.case_name == "decode-attn" and task.seqlen_q == 1 and not task.causal:
        entries.append(dict(entry, causal=True))
    return entries
