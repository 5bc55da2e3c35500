"""The autotuner's scheduler, result file, resume logic and worker processes, with a fake
measurement (no kernels run here: `FakeBackend` stands in for tuning.autotune.measure).

The multi-process tests start real worker processes (`python -m tuning.autotune.workers`)
that load `FakeBackend` from this module; what they did is read back from a log
file each worker appends to.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tuning.autotune import search_space
from tuning.autotune.sched import Progress, ResultStore, ResumeError, run_tasks
from tuning.autotune.tasks import Task, build_tasks, entry_key
from tuning.autotune.workers import InProcessExecutor, SubprocessExecutor, gpus_for, visible_gpus
from tuning.schema import load_config_file

TESTS_DIR = Path(__file__).resolve().parent
FAKE_BACKEND = "test_autotune_sched:FakeBackend"
FAKE_DEVICE = "Fake GPU 80GB"


class FakeBackend:
    """A worker backend whose measurement is fake: it picks the last candidate of the
    search space, logs what it did (env FAKE_LOG), and misbehaves on request:
    FAKE_CRASH_ON=<task key substring> exits the process on the first such task
    (FAKE_CRASH_MARK names a marker file so it crashes only once); FAKE_HANG_ON
    sleeps for an hour; FAKE_NO_CONFIG_ON returns no winner; FAKE_SLEEP_S sleeps
    in each task. FAKE_OUTPUT records how many entries the output file held when
    each task started (proof that earlier results were already on disk)."""

    def hello(self) -> dict:
        kernels = {name: {"missing": None, "dropout": True}
                   for name in ("fwd_generic", "bwd_preproc", "bwd_generic_dq",
                                "bwd_generic_dkdv", "bwd_dbias")}
        kernels["decode_fwd_stage1"] = {"missing": "no decode yet", "dropout": False}
        kernels["decode_fwd_stage2"] = {"missing": "no decode yet", "dropout": False}
        return {"platform": "gpu", "device_name": os.environ.get("FAKE_DEVICE", FAKE_DEVICE),
                "compute_capability": "9.0",
                "memory_gib": float(os.environ.get("FAKE_MEMORY_GIB", "80")),
                "kernels": kernels}

    def run(self, task: dict, *, mode: str, progress) -> dict:
        key = Task.from_dict(task).key
        started = time.time()
        on_disk = None
        output = os.environ.get("FAKE_OUTPUT")
        if output and Path(output).exists():
            on_disk = len(json.loads(Path(output).read_text())["entries"])
        crash = os.environ.get("FAKE_CRASH_ON")
        mark = os.environ.get("FAKE_CRASH_MARK")
        if crash and crash in key and mark and not Path(mark).exists():
            Path(mark).write_text("crashed")
            os._exit(3)
        if os.environ.get("FAKE_HANG_ON") and os.environ["FAKE_HANG_ON"] in key:
            time.sleep(3600)
        progress(1, 2)
        time.sleep(float(os.environ.get("FAKE_SLEEP_S", "0")))
        progress(2, 2)
        config = search_space.candidates(task["kernel"], headdim=task["headdim"], mode=mode)[-1]
        if os.environ.get("FAKE_NO_CONFIG_ON") and os.environ["FAKE_NO_CONFIG_ON"] in key:
            config = None
        log = os.environ.get("FAKE_LOG")
        if log:
            with open(log, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
                                    "key": key, "start": started, "end": time.time(),
                                    "on_disk": on_disk}) + "\n")
        return {"config": config, "tuned_ms": 1.0, "default_ms": 2.0, "summary": "1 ok (fake)"}


def small_tasks(**kw) -> list[Task]:
    args = dict(directions=("forward", "backward"), dtypes=("bf16",), batch=1, heads=4,
                headdims=(64, 128), seqlens=(512,), causal=(False,))
    args.update(kw)
    return build_tasks(**args)


def header(**kw) -> dict:
    h = {"device_name": FAKE_DEVICE, "compute_capability": "9.0", "autotune_mode": "fast",
         "B": 1, "H": 4, "full_tasks": False, "tune_grid": {"headdims": [64, 128], "seqlens": [512]}}
    h.update(kw)
    return h


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def fake_env(monkeypatch, tmp_path):
    """Worker processes can import this module; the fake logs to tmp_path/log.jsonl."""
    paths = [str(TESTS_DIR)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "log.jsonl"))
    for var in ("FAKE_CRASH_ON", "FAKE_HANG_ON", "FAKE_NO_CONFIG_ON", "FAKE_SLEEP_S",
                "FAKE_OUTPUT", "FAKE_CRASH_MARK"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


class Quiet:
    def write(self, _text):
        pass

    def flush(self):
        pass


# ---------------------------------------------------------------- in-process scheduler


def test_scheduler_writes_each_result_at_once_and_marks_failures(fake_env, monkeypatch):
    path = fake_env / "out" / "Fake.json"
    monkeypatch.setenv("FAKE_OUTPUT", str(path))
    tasks = small_tasks()
    no_config = tasks[2]  # bwd_generic_dq at D=64
    monkeypatch.setenv("FAKE_NO_CONFIG_ON", no_config.key)
    store = ResultStore.open(path, header(), resume=False)
    summary = run_tasks(tasks, InProcessExecutor(FakeBackend(), "fast"), store,
                        progress=Progress(tasks, slots=1, stream=Quiet()))
    assert (summary.entries, summary.failed, summary.aborted) == (len(tasks) - 1, 1, None)
    log = read_log(fake_env / "log.jsonl")
    # Task i saw every earlier success already in the file.
    assert [rec["on_disk"] for rec in log] == [0, 1, 2, 2, 3, 4, 5, 6][:len(log)]
    loaded = load_config_file(path)
    assert loaded is not None and loaded.skipped == 0
    assert len(loaded.entries) == len(tasks) - 1
    status = loaded.header["autotune_status"]
    assert status["complete"] is False  # only the caller knows the grid is done
    assert [f["key"] for f in status["failed"]] == [no_config.key]
    assert status["failed"][0]["kind"] == "no valid candidate"


def test_resume_skips_done_and_deterministic_failures_retries_crashes(tmp_path):
    path = tmp_path / "Fake.json"
    tasks = small_tasks()
    store = ResultStore.open(path, header(), resume=False)
    store.add_result(tasks[0], {"config": search_space.candidates("fwd_generic", headdim=64)[0]})
    store.add_failure(tasks[1], "no valid candidate", "all failed to compile")
    store.add_failure(tasks[2], "crashed", "worker exited with code 3")
    resumed = ResultStore.open(path, header(), resume=True)
    done = resumed.done_keys()
    assert tasks[0].key in done and tasks[1].key in done
    assert tasks[2].key not in done  # a crash is retried
    assert all(t.key not in done for t in tasks[3:])
    assert len(resumed.entries) == 1


def test_resume_refuses_a_file_made_differently(tmp_path):
    path = tmp_path / "Fake.json"
    ResultStore.open(path, header(), resume=False)
    with pytest.raises(ResumeError, match="autotune_mode"):
        ResultStore.open(path, header(autotune_mode="max"), resume=True)
    with pytest.raises(ResumeError, match="H="):
        ResultStore.open(path, header(H=8), resume=True)
    merged = ResultStore.open(path, header(tune_grid={"headdims": [256], "seqlens": [1024]}),
                              resume=True)
    assert merged.header["tune_grid"] == {"headdims": [64, 128, 256], "seqlens": [512, 1024]}


def test_fresh_store_replaces_an_existing_file(tmp_path):
    path = tmp_path / "Fake.json"
    tasks = small_tasks()
    store = ResultStore.open(path, header(), resume=False)
    store.add_result(tasks[0], {"config": search_space.candidates("fwd_generic", headdim=64)[0]})
    ResultStore.open(path, header(), resume=False)
    assert load_config_file(path).entries == ()


def test_progress_line_counts_tasks_and_estimates_time_left():
    tasks = small_tasks()
    progress = Progress(tasks, slots=1, stream=Quiet())
    assert "0/8 tasks" in progress.line() and "left ?" in progress.line()
    progress.started_task(0, tasks[0])
    progress.step(0, "candidate 3/8")
    assert "now: fwd_generic bf16 D=64 T=512 S=512 (candidate 3/8)" in progress.line()
    progress.started = time.monotonic() - 10
    progress.finished(0, tasks[0], "ok")
    assert "1/8 tasks" in progress.line()
    assert progress.time_left() is not None and progress.time_left() > 0


# ---------------------------------------------------------------- worker processes


def test_two_worker_processes_one_gpu_each_one_task_at_a_time(fake_env, monkeypatch):
    monkeypatch.setenv("FAKE_SLEEP_S", "0.15")
    tasks = small_tasks()
    store = ResultStore.open(fake_env / "Fake.json", header(), resume=False)
    executor = SubprocessExecutor(["0", "1"], "fast", backend=FAKE_BACKEND,
                                  log_dir=fake_env / "logs")
    try:
        infos = executor.start()
        assert [i["device_name"] for i in infos] == [FAKE_DEVICE, FAKE_DEVICE]
        summary = run_tasks(tasks, executor, store, progress=Progress(tasks, slots=2,
                                                                      stream=Quiet()))
    finally:
        executor.close()
    assert (summary.entries, summary.failed) == (len(tasks), 0)
    log = read_log(fake_env / "log.jsonl")
    assert sorted(r["key"] for r in log) == sorted(t.key for t in tasks)  # each task once
    by_gpu: dict[str, list[dict]] = {}
    for rec in log:
        by_gpu.setdefault(rec["gpu"], []).append(rec)
    assert set(by_gpu) == {"0", "1"}  # each worker saw exactly its one GPU, both worked
    for gpu, recs in by_gpu.items():
        assert len({r["pid"] for r in recs}) == 1
        recs.sort(key=lambda r: r["start"])
        for a, b in zip(recs, recs[1:]):
            assert b["start"] >= a["end"], f"GPU {gpu} ran two tasks at once"
    merged = load_config_file(fake_env / "Fake.json")
    assert {entry_key(e) for e in merged.entries} == {t.key for t in tasks}


def test_crashed_worker_costs_its_task_only_and_is_restarted(fake_env, monkeypatch):
    tasks = small_tasks()
    victim = tasks[3]
    monkeypatch.setenv("FAKE_CRASH_ON", victim.key)
    monkeypatch.setenv("FAKE_CRASH_MARK", str(fake_env / "crashed"))
    store = ResultStore.open(fake_env / "Fake.json", header(), resume=False)
    executor = SubprocessExecutor([None], "fast", backend=FAKE_BACKEND, log_dir=fake_env / "logs")
    try:
        executor.start()
        summary = run_tasks(tasks, executor, store, progress=Progress(tasks, slots=1,
                                                                      stream=Quiet()))
    finally:
        executor.close()
    assert (summary.entries, summary.failed) == (len(tasks) - 1, 1)
    assert [f["kind"] for f in store.failed] == ["crashed"]
    assert "code 3" in store.failed[0]["reason"]
    assert len({r["pid"] for r in read_log(fake_env / "log.jsonl")}) == 2  # a new worker
    # Resuming retries the crashed task (the marker file stops a second crash).
    resumed = ResultStore.open(fake_env / "Fake.json", header(), resume=True)
    assert [t.key for t in tasks if t.key not in resumed.done_keys()] == [victim.key]


def test_hung_task_times_out(fake_env, monkeypatch):
    tasks = small_tasks()[:2]
    monkeypatch.setenv("FAKE_HANG_ON", tasks[0].key)
    store = ResultStore.open(fake_env / "Fake.json", header(), resume=False)
    executor = SubprocessExecutor([None], "fast", backend=FAKE_BACKEND, log_dir=fake_env / "logs")
    try:
        executor.start()
        summary = run_tasks(tasks, executor, store, task_timeout_s=1.0, poll_s=0.1,
                            progress=Progress(tasks, slots=1, stream=Quiet()))
    finally:
        executor.close()
    assert (summary.entries, summary.failed) == (1, 1)
    assert store.failed[0]["kind"] == "timed out"


# ---------------------------------------------------------------- visible GPUs


def machine_of_gpus(n: int, tmp_path, monkeypatch):
    """A stand-in `nvidia-smi` first on PATH that lists `n` GPUs, so that what is visible
    does not depend on the machine the suite runs on."""
    smi = tmp_path / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i})'\n" for i in range(n))
    smi.write_text("#!/bin/sh\n" + lines)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("env, expected", [("0,1", ["0", "1"]), ("", []), ("2", ["2"]),
                                           ("0,-1,1", ["0"]), ("GPU-abc, GPU-def", ["GPU-abc", "GPU-def"])])
def test_visible_gpus_from_cuda_visible_devices(monkeypatch, tmp_path, env, expected):
    machine_of_gpus(4, tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert visible_gpus() == expected


def test_visible_gpus_stop_at_an_index_past_the_machines(monkeypatch, tmp_path):
    """CUDA_VISIBLE_DEVICES=0,1 on a machine of one GPU gives one GPU, as CUDA reads it."""
    machine_of_gpus(1, tmp_path, monkeypatch)
    for env, expected in (("0,1", ["0"]), ("1,0", []), ("0", ["0"]),
                          ("GPU-0", ["GPU-0"])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
        assert visible_gpus() == expected, env
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert visible_gpus() == ["0"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ValueError, match=r"--num-gpus 2 asks for 2 GPU\(s\), but only 1"):
        gpus_for(2)


def test_too_few_gpus_is_a_clear_error(monkeypatch, tmp_path):
    machine_of_gpus(4, tmp_path, monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert gpus_for(1) == ["3"]
    with pytest.raises(ValueError, match=r"--num-gpus 2 asks for 2 GPU\(s\), but only 1 is visible"):
        gpus_for(2)
