"""Where autotune tasks run: worker processes (one per GPU), in-process, or a Ray cluster.

Every executor offers the same small interface to the scheduler
(`tuning.autotune.sched`): `slots` (how many tasks run at once), `start()` (the
workers' hello: device name, memory, which kernels they can tune), `submit(slot,
task)`, an `events` queue of `(slot, message)` and `restart(slot)`.

Messages (JSON objects, also the wire format between processes):
- `{"type": "hello", "info": {...}}`: a worker is ready.
- `{"type": "progress", "candidate": i, "of": n}`: the running task's progress.
- `{"type": "result", "task": {...}, "result": {...}}` or
  `{"type": "result", "task": {...}, "error": "..."}`: a task finished.
- `{"type": "exit", "detail": "..."}`: the worker is gone (crash, kill, EOF).

Worker processes (`python -m tuning.autotune.workers --backend MODULE:ATTR`)
each see one GPU (CUDA_VISIBLE_DEVICES set by the parent) and run one task at
a time. They speak JSON lines on stdin/stdout; everything else a worker prints
(JAX, Triton, XLA) goes to its log file. A worker that crashes or hangs costs
its current task only: the parent records the failure and starts a new one.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

DEFAULT_BACKEND = "tuning.autotune.measure:MeasureBackend"
_REPO_ROOT = Path(__file__).resolve().parents[2]


def load_backend(spec: str):
    """An instance of the backend class (or factory) named 'module:attr'."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ValueError(f"backend must be 'module:attr'; got {spec!r}")
    return getattr(importlib.import_module(module), attr)()


def _error_text(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:500] if lines else ''}"


# ------------------------------------------------------------------ visible GPUs


def visible_gpus() -> list[str]:
    """IDs of the GPUs this process may use, for CUDA_VISIBLE_DEVICES of its workers.

    CUDA_VISIBLE_DEVICES when set (its entries, which may be UUIDs, up to the first that
    names no GPU, as CUDA reads it: a negative index, or an index past the GPUs
    `nvidia-smi -L` lists where it runs); else the GPUs `nvidia-smi -L` lists; else none.
    JAX is not imported: the parent process must not take GPU memory its workers need.
    """
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return _listed_gpus() or []
    entries = [part.strip() for part in env.split(",") if part.strip()]
    # nvidia-smi only where an index needs checking against the machine.
    listed = _listed_gpus() if any(part.isdigit() for part in entries) else None
    out = []
    for part in entries:
        past_the_machine = listed is not None and part.isdigit() and int(part) >= len(listed)
        if part.startswith("-") or past_the_machine:
            break
        out.append(part)
    return out


def _listed_gpus() -> list[str] | None:
    """The indices of the GPUs `nvidia-smi -L` lists, or None where it does not run."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30,
                                 check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [str(i) for i, line in enumerate(l for l in listing.splitlines()
                                            if l.startswith("GPU "))]


def gpus_for(num_gpus: int) -> list[str]:
    """The first `num_gpus` visible GPU ids; ValueError with the reason when too few."""
    if num_gpus < 1:
        raise ValueError(f"--num-gpus must be at least 1; got {num_gpus}")
    gpus = visible_gpus()
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        where = "CUDA_VISIBLE_DEVICES=" + repr(os.environ["CUDA_VISIBLE_DEVICES"])
    else:
        where = "nvidia-smi -L" if shutil.which("nvidia-smi") else "no nvidia-smi on the PATH"
    if not gpus:
        raise ValueError(f"the autotuner measures the kernels on NVIDIA GPUs, and none is "
                         f"visible here ({where}). Run it on a machine with a GPU "
                         "(--dry-run lists the tasks anywhere).")
    if len(gpus) < num_gpus:
        raise ValueError(f"--num-gpus {num_gpus} asks for {num_gpus} GPU(s), but only "
                         f"{len(gpus)} {'is' if len(gpus) == 1 else 'are'} visible ({where}). "
                         f"Pass --num-gpus {len(gpus)} or make more GPUs visible.")
    return gpus[:num_gpus]


# ------------------------------------------------------------------ worker process main


def worker_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="autotune worker (started by tuning.autotune)")
    parser.add_argument("--backend", default=DEFAULT_BACKEND)
    args = parser.parse_args(argv)
    # The protocol owns the real stdout; anything else printed to fd 1 goes to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    lock = threading.Lock()

    def send(message: dict) -> None:
        with lock:
            proto.write(json.dumps(message) + "\n")
            proto.flush()

    try:
        backend = load_backend(args.backend)
        send({"type": "hello", "info": backend.hello()})
    except Exception as exc:  # noqa: BLE001 - report and stop
        traceback.print_exc()
        send({"type": "exit", "detail": f"worker could not start: {_error_text(exc)}"})
        return 1
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        if message.get("type") == "stop":
            break
        task, mode = message["task"], message["mode"]
        progress = lambda i, n: send({"type": "progress", "candidate": i, "of": n})
        try:
            result = backend.run(task, mode=mode, progress=progress)
            send({"type": "result", "task": task, "result": result})
        except Exception as exc:  # noqa: BLE001 - one task's failure is not the worker's
            traceback.print_exc()
            send({"type": "result", "task": task, "error": _error_text(exc)})
    return 0


# ------------------------------------------------------------------ executors


class InProcessExecutor:
    """One slot, tasks run on a thread of this process (tests; no GPU isolation)."""

    def __init__(self, backend, mode: str):
        self.backend, self.mode = backend, mode
        self.slots = 1
        self.events: queue.Queue = queue.Queue()
        self.log_dir = None

    def start(self) -> list[dict]:
        return [self.backend.hello()]

    def submit(self, slot: int, task: dict) -> None:
        def work():
            progress = lambda i, n: self.events.put((slot, {"type": "progress", "candidate": i,
                                                            "of": n}))
            try:
                result = self.backend.run(task, mode=self.mode, progress=progress)
                self.events.put((slot, {"type": "result", "task": task, "result": result}))
            except Exception as exc:  # noqa: BLE001
                self.events.put((slot, {"type": "result", "task": task,
                                        "error": _error_text(exc)}))
        threading.Thread(target=work, daemon=True).start()

    def restart(self, slot: int) -> bool:
        return False  # a hung thread cannot be killed

    def log_hint(self, slot: int) -> str:
        return ""

    def close(self) -> None:
        pass


class _Worker:
    def __init__(self, slot: int, gpu: str | None, backend: str, events: queue.Queue,
                 log_path: Path, extra_env: dict[str, str] | None):
        self.slot, self.gpu, self.backend, self.events = slot, gpu, backend, events
        self.log_path = log_path
        env = dict(os.environ, **(extra_env or {}))
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        env["PYTHONPATH"] = os.pathsep.join(
            [str(_REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env.setdefault("PYTHONUNBUFFERED", "1")
        self.log = open(log_path, "a", encoding="utf-8")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tuning.autotune.workers", "--backend", backend],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
            text=True, bufsize=1, cwd=str(_REPO_ROOT))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        last_exit = None
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("type") == "exit":
                last_exit = message.get("detail")
                continue
            self.events.put((self.slot, message))
        code = self.proc.wait()
        detail = last_exit or f"worker exited with code {code}"
        self.events.put((self.slot, {"type": "exit", "detail": detail, "proc": id(self.proc)}))

    def send(self, message: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def stop(self, *, kill: bool = False) -> None:
        if self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                try:
                    self.send({"type": "stop"})
                    self.proc.stdin.close()  # type: ignore[union-attr]
                    self.proc.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired, ValueError):
                    self.proc.kill()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()


class SubprocessExecutor:
    """One worker process per GPU id (None: no CUDA_VISIBLE_DEVICES change)."""

    def __init__(self, gpus: list[str | None], mode: str, *, backend: str = DEFAULT_BACKEND,
                 log_dir: Path, extra_env: dict[str, str] | None = None,
                 hello_timeout_s: float = 600.0):
        self.gpus, self.mode, self.backend = list(gpus), mode, backend
        self.slots = len(self.gpus)
        self.events: queue.Queue = queue.Queue()
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.extra_env = extra_env
        self.hello_timeout_s = hello_timeout_s
        self.workers: dict[int, _Worker] = {}

    def _spawn(self, slot: int) -> None:
        self.workers[slot] = _Worker(slot, self.gpus[slot], self.backend, self.events,
                                     self.log_dir / f"worker{slot}.log", self.extra_env)

    def start(self) -> list[dict]:
        for slot in range(self.slots):
            self._spawn(slot)
        infos: dict[int, dict] = {}
        while len(infos) < self.slots:
            try:
                slot, message = self.events.get(timeout=self.hello_timeout_s)
            except queue.Empty:
                raise RuntimeError(f"workers did not start within {self.hello_timeout_s:.0f} s; "
                                   f"logs in {self.log_dir}") from None
            if message["type"] == "hello":
                infos[slot] = message["info"]
            elif message["type"] == "exit":
                raise RuntimeError(f"worker {slot} (GPU {self.gpus[slot]}) failed to start: "
                                   f"{message['detail']}; log: {self.log_hint(slot)}")
        return [infos[slot] for slot in range(self.slots)]

    def submit(self, slot: int, task: dict) -> None:
        self.workers[slot].send({"type": "task", "task": task, "mode": self.mode})

    def restart(self, slot: int) -> bool:
        old = self.workers.get(slot)
        if old is not None:
            old.stop(kill=True)
        self._spawn(slot)
        return True

    def is_current(self, slot: int, message: dict) -> bool:
        """Whether an exit message is about the slot's current process (not a killed one)."""
        proc = message.get("proc")
        return proc is None or proc == id(self.workers[slot].proc)

    def log_hint(self, slot: int) -> str:
        return str(self.log_dir / f"worker{slot}.log")

    def close(self) -> None:
        for worker in self.workers.values():
            worker.stop()


# ------------------------------------------------------------------ Ray


class _RayWorkerImpl:
    """A Ray actor holding one GPU: the same backend as a worker process."""

    def __init__(self, backend: str):
        self.backend = load_backend(backend)

    def hello(self) -> dict:
        return self.backend.hello()

    def run(self, task: dict, mode: str) -> dict:
        return self.backend.run(task, mode=mode, progress=lambda i, n: None)


class RayExecutor:
    """Tasks on a Ray cluster: one actor per GPU (num_gpus=1 each), one task at a time each.

    Ray is imported only here. Our packages travel to the cluster as py_modules,
    so the cluster's nodes need JAX with CUDA but not this checkout.
    """

    def __init__(self, address: str, mode: str, *, num_gpus: int | None,
                 backend: str = DEFAULT_BACKEND):
        try:
            import ray  # noqa: PLC0415 - optional dependency, only for --ray-address
        except ImportError as exc:
            raise ValueError("--ray-address needs Ray: pip install 'ffpa-jax[ray]' "
                             "(or pip install ray)") from exc
        self.ray = ray
        import pallas_kernels  # noqa: PLC0415
        import tuning  # noqa: PLC0415
        ray.init(address=address, ignore_reinit_error=True, runtime_env={"py_modules": [
            str(Path(tuning.__file__).parent), str(Path(pallas_kernels.__file__).parent)]})
        available = int(ray.cluster_resources().get("GPU", 0))
        if available < 1:
            raise ValueError(f"the Ray cluster at {address} has no GPUs")
        if num_gpus is not None and num_gpus > available:
            raise ValueError(f"--num-gpus {num_gpus} asks for more GPUs than the Ray cluster "
                             f"at {address} has ({available})")
        self.slots = num_gpus or available
        self.mode, self.backend = mode, backend
        self.events: queue.Queue = queue.Queue()
        self.log_dir = None
        self._actor_cls = ray.remote(num_gpus=1)(_RayWorkerImpl)
        self.actors: dict[int, Any] = {}

    def start(self) -> list[dict]:
        for slot in range(self.slots):
            self.actors[slot] = self._actor_cls.remote(self.backend)
        return self.ray.get([self.actors[s].hello.remote() for s in range(self.slots)])

    def submit(self, slot: int, task: dict) -> None:
        ref = self.actors[slot].run.remote(task, self.mode)

        def wait():
            try:
                result = self.ray.get(ref)
                self.events.put((slot, {"type": "result", "task": task, "result": result}))
            except self.ray.exceptions.RayActorError as exc:
                self.events.put((slot, {"type": "exit", "detail": _error_text(exc)}))
            except Exception as exc:  # noqa: BLE001 - the task raised inside the actor
                self.events.put((slot, {"type": "result", "task": task,
                                        "error": _error_text(exc)}))
        threading.Thread(target=wait, daemon=True).start()

    def restart(self, slot: int) -> bool:
        try:
            self.ray.kill(self.actors[slot])
        except Exception:  # noqa: BLE001 - already dead
            pass
        self.actors[slot] = self._actor_cls.remote(self.backend)
        self.events.put((slot, {"type": "hello", "info": {}}))
        return True

    def log_hint(self, slot: int) -> str:
        return "see the Ray dashboard's worker logs"

    def close(self) -> None:
        for actor in self.actors.values():
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001
                pass


if __name__ == "__main__":
    sys.exit(worker_main())
