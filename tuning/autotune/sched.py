"""The autotuner's scheduler: hands tasks to free slots, writes each result at once, shows progress.

- Each slot (a GPU) runs one task at a time; the next task goes to whichever
  slot frees first.
- Every finished task is written to the output file at once (the whole file,
  atomically renamed into place by `schema.write_config_file`), so an
  interrupted run loses at most the tasks in flight. `ResultStore.open(...,
  resume=True)` continues such a file: tasks whose entry is already there are
  not run again.
- The file's header carries `autotune_status`: whether the run completed, and
  the tasks that produced no entry (no candidate compiled and passed, or the
  worker crashed / timed out). A resumed run skips the first kind and retries
  the second.
- A worker that dies or exceeds `task_timeout_s` costs its task (recorded as
  failed) and is restarted, at most `max_restarts` times per slot.
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import time
from pathlib import Path
from typing import Any, Mapping, TextIO

from tuning.autotune.tasks import Task, entries_for, entry_key
from tuning.schema import load_config_file, write_config_file

# Failures a resumed run retries (the others would fail the same way again).
RETRY_ON_RESUME = ("crashed", "timed out")
# Header fields that must agree for a file to be resumed.
_RESUME_MUST_MATCH = ("device_name", "autotune_mode", "B", "H")


class ResumeError(ValueError):
    pass


class ResultStore:
    """The output file: header, entries, failures; rewritten after every task."""

    def __init__(self, path: Path, header: dict[str, Any], entries: list[dict],
                 failed: list[dict]):
        self.path, self.header, self.entries, self.failed = Path(path), header, entries, failed

    @classmethod
    def open(cls, path: Path, header: dict[str, Any], *, resume: bool) -> "ResultStore":
        """A fresh store (written at once, replacing any file), or the file at `path` resumed."""
        path = Path(path)
        if resume and path.exists():
            loaded = load_config_file(path)
            if loaded is None:
                raise ResumeError(f"cannot resume {path}: it is not a readable tuned-config file")
            old = dict(loaded.header)
            for key in _RESUME_MUST_MATCH:
                if old.get(key) != header.get(key):
                    raise ResumeError(f"cannot resume {path}: it was made with {key}="
                                      f"{old.get(key)!r}, this run has {header.get(key)!r}")
            merged = {**old, **header}  # keeps what other tools added (the tier grid)
            grid_old, grid_new = old.get("tune_grid") or {}, header.get("tune_grid") or {}
            merged["tune_grid"] = {
                name: sorted(set(grid_old.get(name, [])) | set(grid_new.get(name, [])))
                for name in ("headdims", "seqlens")}
            merged["full_tasks"] = bool(old.get("full_tasks")) or bool(header.get("full_tasks"))
            for name in ("autotune_directions", "autotune_dtypes"):
                merged[name] = sorted(set(old.get(name, [])) | set(header.get(name, [])))
            status = old.get("autotune_status") or {}
            failed = [f for f in status.get("failed", []) if f.get("kind") not in RETRY_ON_RESUME]
            store = cls(path, merged, [dict(e) for e in loaded.entries], failed)
        else:
            store = cls(path, dict(header), [], [])
        store.write(complete=False)
        return store

    def done_keys(self) -> set[str]:
        return {entry_key(e) for e in self.entries} | {f["key"] for f in self.failed}

    def add_result(self, task: Task, result: Mapping[str, Any]) -> list[dict]:
        entries = entries_for(task, result["config"], tuned_ms=result.get("tuned_ms"),
                              default_ms=result.get("default_ms"))
        new_keys = {entry_key(e) for e in entries}
        self.entries = [e for e in self.entries if entry_key(e) not in new_keys] + entries
        self.write(complete=False)
        return entries

    def add_failure(self, task: Task, kind: str, reason: str) -> None:
        self.failed = [f for f in self.failed if f["key"] != task.key]
        self.failed.append({"key": task.key, "task": task.label(), "kind": kind,
                            "reason": reason[:1000]})
        self.write(complete=False)

    def write(self, *, complete: bool) -> None:
        header = dict(self.header)
        header.pop("generated_at", None)  # refreshed on every write
        header["autotune_status"] = {"complete": complete, "entries": len(self.entries),
                                     "failed": self.failed}
        write_config_file(self.path, header, self.entries)


class Progress:
    """One status line: tasks done, what runs now, elapsed and estimated time left.

    On a terminal the line is redrawn in place; otherwise one line per finished
    task is printed. The estimate scales the elapsed time by the rough cost
    (`Task.cost`) of what is left against what is done.
    """

    def __init__(self, tasks: list[Task], *, slots: int, stream: TextIO | None = None):
        self.total = len(tasks)
        self.total_cost = sum(t.cost() for t in tasks) or 1.0
        self.done = 0
        self.done_cost = 0.0
        self.failed = 0
        self.slots = slots
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.started = time.monotonic()
        self.running: dict[int, tuple[Task, str]] = {}

    @staticmethod
    def _clock(seconds: float) -> str:
        seconds = int(max(0, seconds))
        h, rest = divmod(seconds, 3600)
        m, s = divmod(rest, 60)
        return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"

    def time_left(self) -> float | None:
        elapsed = time.monotonic() - self.started
        if self.done_cost <= 0 or elapsed <= 0:
            return None
        return elapsed * (self.total_cost - self.done_cost) / self.done_cost

    def line(self) -> str:
        width = 24
        filled = int(width * self.done / max(1, self.total))
        bar = "#" * filled + "-" * (width - filled)
        now = ""
        if self.running:
            _slot, (task, step) = max(self.running.items())
            extra = f" +{len(self.running) - 1} more" if len(self.running) > 1 else ""
            now = f" | now: {task.label()}{f' ({step})' if step else ''}{extra}"
        left = self.time_left()
        eta = "?" if left is None else "~" + self._clock(left)
        failed = f", {self.failed} failed" if self.failed else ""
        return (f"[{bar}] {self.done}/{self.total} tasks{failed}{now} | "
                f"elapsed {self._clock(time.monotonic() - self.started)} | left {eta}")

    def _draw(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line()[:200])
            self.stream.flush()

    def started_task(self, slot: int, task: Task) -> None:
        self.running[slot] = (task, "")
        self._draw()

    def step(self, slot: int, text: str) -> None:
        if slot in self.running:
            self.running[slot] = (self.running[slot][0], text)
            self._draw()

    def finished(self, slot: int, task: Task, outcome: str) -> None:
        self.running.pop(slot, None)
        self.done += 1
        self.done_cost += task.cost()
        if outcome.startswith("FAILED"):
            self.failed += 1
        if self.tty:
            self.stream.write("\r\x1b[2K")
        self.stream.write(f"  {task.label()}: {outcome}\n")
        if not self.tty:
            self.stream.write(self.line() + "\n")
        self.stream.flush()
        self._draw()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line() + "\n")
            self.stream.flush()


@dataclasses.dataclass
class RunSummary:
    entries: int = 0
    failed: int = 0
    not_run: int = 0  # tasks left when the run was aborted
    aborted: str | None = None


def run_tasks(tasks: list[Task], executor, store: ResultStore, *, progress: Progress | None = None,
              task_timeout_s: float = 1800.0, max_restarts: int = 3,
              poll_s: float = 0.5) -> RunSummary:
    """Run `tasks` on `executor`'s slots (already started), recording each result in `store`.

    The caller marks the file complete (`store.write(complete=True)`) when the
    whole grid is done: only it knows whether `tasks` was all of it.
    """
    progress = progress or Progress(tasks, slots=executor.slots)
    pending = list(tasks)
    idle = list(range(executor.slots))
    busy: dict[int, tuple[Task, float]] = {}
    restarting: set[int] = set()
    restarts = {slot: 0 for slot in range(executor.slots)}
    summary = RunSummary()

    def fail(slot: int, task: Task, kind: str, reason: str) -> None:
        store.add_failure(task, kind, reason)
        summary.failed += 1
        progress.finished(slot, task, f"FAILED ({kind}): {reason}")

    def lose_worker(slot: int, reason: str) -> None:
        if slot in busy:
            task, _ = busy.pop(slot)
            hint = executor.log_hint(slot)
            fail(slot, task, "crashed" if "timed out" not in reason else "timed out",
                 reason + (f" (log: {hint})" if hint else ""))
        if slot in idle:
            idle.remove(slot)
        if restarts[slot] < max_restarts and executor.restart(slot):
            restarts[slot] += 1
            restarting.add(slot)

    while pending or busy:
        while idle and pending:
            slot = idle.pop(0)
            task = pending.pop(0)
            busy[slot] = (task, time.monotonic())
            progress.started_task(slot, task)
            executor.submit(slot, task.as_dict())
        if not busy and not idle and not restarting:
            summary.aborted = "every worker failed; see the logs"
            break
        try:
            slot, message = executor.events.get(timeout=poll_s)
        except queue.Empty:
            now = time.monotonic()
            for slot, (task, since) in list(busy.items()):
                if now - since > task_timeout_s:
                    lose_worker(slot, f"timed out after {task_timeout_s:.0f} s")
            continue
        kind = message.get("type")
        if kind == "progress":
            progress.step(slot, f"candidate {message['candidate']}/{message['of']}")
        elif kind == "hello":
            restarting.discard(slot)
            if slot not in busy and slot not in idle:
                idle.append(slot)
        elif kind == "exit":
            is_current = getattr(executor, "is_current", lambda s, m: True)
            if is_current(slot, message):
                restarting.discard(slot)
                lose_worker(slot, message.get("detail", "worker exited"))
        elif kind == "result":
            if slot not in busy:
                continue  # a late answer from a worker we already gave up on
            task, since = busy.pop(slot)
            idle.append(slot)
            if "error" in message:
                fail(slot, task, "error", message["error"])
                continue
            result = message["result"]
            if not result.get("config"):
                reasons = "; ".join(result.get("failures") or []) or result.get("summary", "")
                fail(slot, task, "no valid candidate", reasons or "no candidate passed")
                continue
            store.add_result(task, result)
            summary.entries += 1
            ms = result.get("tuned_ms")
            default_ms = result.get("default_ms")
            speed = ""
            if ms is not None and default_ms:
                speed = f", {default_ms / ms:.2f}x the default"
            progress.finished(slot, task, f"{ms:.3f} ms{speed} [{result.get('summary', '')}]"
                              if ms is not None else "ok")
    progress.close()
    summary.not_run = len(pending)
    return summary
