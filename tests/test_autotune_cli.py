"""`python -m tuning.autotune`: arguments, the task grid, overwrite refusal, resume, several
GPUs, and that what it writes is read back by tuning.load_config_file / lookup_config.

Workers are real processes running the fake measurement of test_autotune_sched.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from test_autotune_sched import FAKE_BACKEND, FAKE_DEVICE, TESTS_DIR, read_log
from tuning.autotune import cli as autotune_cli
from tuning.autotune import search_space
from tuning.autotune.tasks import LARGE_SEQLEN, build_tasks, gqa_kv_heads, grid_seqlens
from tuning import lookup as lookup_mod
from tuning.lookup import clear_cache, lookup_config
from tuning.lookup import user_config_dir as real_user_config_dir
from tuning.schema import load_config_file

# An end-to-end run: outside the default suite; CI runs it (`pytest -m slow`).
pytestmark = pytest.mark.slow

REPO = TESTS_DIR.parent
FILE_NAME = "Fake_GPU_80GB.json"


@pytest.fixture
def env(monkeypatch, tmp_path):
    paths = [str(REPO), str(TESTS_DIR)]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "log.jsonl"))
    # The default output directory (the user's) inside this test's folder.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    for var in ("FFPA_AUTOTUNE_MAX_CONFIGS", "FAKE_CRASH_ON", "FAKE_HANG_ON",
                "FAKE_NO_CONFIG_ON", "FAKE_SLEEP_S", "FAKE_OUTPUT", "FFPA_TUNED_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def cli(*args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tuning.autotune", *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=dict(os.environ, **(env_extra or {})))


def _exit_code(argv: list[str]) -> int:
    """`autotune_cli.main(argv)`'s exit status in this process (argparse's refusals raise
    SystemExit), as `python -m tuning.autotune` would exit with it: a subprocess costs a
    Python and JAX start-up, so the tests run the command itself once each."""
    try:
        return autotune_cli.main(argv)
    except SystemExit as exit_:
        return exit_.code


SMALL = ("--headdims", "64,128", "--seqlens", "1,512", "--H", "4",
         "--worker-backend", FAKE_BACKEND)


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize("argv, message", [
    (["--mode", "slow"], "invalid choice: 'slow'"),
    (["--directions", "sideways"], "invalid choice: 'sideways'"),
    (["--dtypes", "bf16,int8"], "dtypes must be a comma-separated subset"),
    (["--B", "0"], "expected a positive integer"),
    (["--headdims", "64,x"], "expected comma-separated integers"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        autotune_cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_match_ffpa():
    args = autotune_cli.build_parser().parse_args([])
    assert (args.mode, args.directions, args.dtypes, args.B, args.H) == ("fast", "both",
                                                                        ["bf16"], 1, 32)
    assert not args.full_tasks and not args.overwrite and not args.resume


def test_default_output_is_the_users_directory_not_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    args = autotune_cli.build_parser().parse_args([])
    assert args.output_dir == tmp_path / "xdg" / "ffpa_jax" / "tuned_configs"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    args = autotune_cli.build_parser().parse_args([])
    assert args.output_dir == tmp_path / "home" / ".cache" / "ffpa_jax" / "tuned_configs"


def test_bad_max_configs_env_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("FFPA_AUTOTUNE_MAX_CONFIGS", "lots")
    with pytest.raises(SystemExit):
        autotune_cli.main(["--dry-run"])
    assert "FFPA_AUTOTUNE_MAX_CONFIGS must be a positive integer" in capsys.readouterr().err


def dry_run(capsys, *argv) -> list[str]:
    assert autotune_cli.main(["--dry-run", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_dry_run_grid_and_cap(capsys, monkeypatch):
    monkeypatch.delenv("FFPA_AUTOTUNE_MAX_CONFIGS", raising=False)
    lines = dry_run(capsys, "--directions", "forward", "--headdims", "64", "--seqlens", "1,512,1024")
    # decode: 2 kernels x Nkv in {512, 1024}; prefill: fwd_generic x 2 seqlens x causal/not.
    assert len(lines) == 4 + 4
    assert sum("decode_fwd_stage1" in line for line in lines) == 2
    full = dry_run(capsys, "--directions", "both", "--headdims", "64", "--seqlens", "512",
                   "--full-tasks", "--causal", "false")
    # common: fwd + 3 bwd; attn-mask: fwd + dq, dkdv, dbias; dropout, gqa, mqa: fwd + dq, dkdv.
    assert len(full) == 4 + 4 + 3 * 3
    assert any("H32/8" in line for line in full) and any("H32/1" in line for line in full)
    monkeypatch.setenv("FFPA_AUTOTUNE_MAX_CONFIGS", "3")
    assert len(dry_run(capsys, "--headdims", "64")) == 3


def test_default_grid_is_ffpas():
    tasks = build_tasks(directions=("forward",), dtypes=("bf16",), batch=1, heads=32,
                        headdims=autotune_cli.HEADDIMS, seqlens=grid_seqlens(80.0))
    assert sorted({t.headdim for t in tasks}) == [64, 128, 256, 320, 512, 640, 768, 1024]
    assert sorted({t.seqlen_q for t in tasks}) == [1, 512, 1024, 2048, 4096, 8192, LARGE_SEQLEN]
    assert LARGE_SEQLEN not in grid_seqlens(47.5) and LARGE_SEQLEN not in grid_seqlens(None)
    assert grid_seqlens(80.0, [4096, 1]) == [1, 4096]
    assert (gqa_kv_heads(32), gqa_kv_heads(12), gqa_kv_heads(2)) == (8, 3, 1)


# ---------------------------------------------------------------- runs


def test_end_to_end_two_gpus_cap_resume_refuse_overwrite(env, capsys):
    out = env / "configs"
    path = out / FILE_NAME
    # 1. A capped run (FFPA_AUTOTUNE_MAX_CONFIGS) on two worker processes.
    first = cli("--num-gpus", "2", "--output-dir", str(out), *SMALL,
                env_extra={"FFPA_AUTOTUNE_MAX_CONFIGS": "3"})
    assert first.returncode == 0, first.stderr
    # decode: 2 kernels x 2 head dims x Nkv = 512, skipped with the backend's reason.
    assert "skipping 4 task(s): no decode yet" in first.stderr
    assert "running the first 3 of 16 tasks" in first.stderr
    partial = load_config_file(path)
    assert len(partial.entries) == 3 and partial.header["autotune_status"]["complete"] is False
    assert "--resume" in first.stderr
    # 2. Without --overwrite or --resume an existing file is never touched.
    before = path.read_bytes()
    capsys.readouterr()
    assert _exit_code(["--output-dir", str(out), *SMALL]) == 2
    assert ("exists; pass --overwrite to replace it or --resume to continue it"
            in capsys.readouterr().err)
    assert path.read_bytes() == before
    # 3. --resume runs exactly the rest.
    resumed = cli("--num-gpus", "2", "--resume", "--output-dir", str(out), *SMALL)
    assert resumed.returncode == 0, resumed.stderr
    log = read_log(env / "log.jsonl")
    tasks = [t for t in build_tasks(directions=("forward", "backward"), dtypes=("bf16",),
                                    batch=1, heads=4, headdims=(64, 128), seqlens=(1, 512))
             if not t.kernel.startswith("decode")]
    assert sorted(r["key"] for r in log) == sorted(t.key for t in tasks)  # each once
    assert {r["gpu"] for r in log} == {"0", "1"}
    done = load_config_file(path)
    assert done.skipped == 0 and len(done.entries) == len(tasks)
    assert done.header["autotune_status"]["complete"] is True
    assert done.header["device_name_sanitized"] == "Fake_GPU_80GB"
    assert (done.header["B"], done.header["H"], done.header["autotune_mode"]) == (1, 4, "fast")
    assert done.header["tune_grid"] == {"headdims": [64, 128], "seqlens": [1, 512]}
    # 4. The file is what lookups read: D=100 -> 128 stored, T=S=300 -> 512 stored.
    os.environ["FFPA_TUNED_CONFIG_DIR"] = str(out)
    clear_cache()
    try:
        for direction, kernel in (("forward", "fwd_generic"), ("backward", "bwd_generic_dkdv")):
            found = lookup_config(direction, kernel, dtype="bf16", headdim=100, seqlen_q=300,
                                  seqlen_k=300, device_name=FAKE_DEVICE,
                                  bias_grad=False if direction == "backward" else None)
            assert found == search_space.candidates(kernel, headdim=128)[-1]
    finally:
        del os.environ["FFPA_TUNED_CONFIG_DIR"]
        clear_cache()
    # 5. --overwrite starts again from nothing.
    again = cli("--overwrite", "--output-dir", str(out), *SMALL,
                env_extra={"FFPA_AUTOTUNE_MAX_CONFIGS": "1"})
    assert again.returncode == 0, again.stderr
    assert len(load_config_file(path).entries) == 1


def test_too_few_visible_gpus_fails_clearly(env, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert autotune_cli.main(["--num-gpus", "2", "--output-dir", str(env), *SMALL]) == 2
    err = capsys.readouterr().err
    assert "--num-gpus 2 asks for 2 GPU(s), but only 1 is visible" in err
    assert not list(env.glob("*.json"))


def test_no_gpu_says_a_gpu_is_needed(env, monkeypatch, capsys):
    """Without a visible GPU the CLI says plainly that it needs one, instead of advising a
    smaller --num-gpus; --num-gpus 0 is refused with the same reason. (The real command
    once; the argument refusals and the dry run in this process, through the same `main`:
    each subprocess costs a Python and JAX start-up.)"""
    plain = cli("--output-dir", str(env), env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert plain.returncode == 2
    assert "measures the kernels on NVIDIA GPUs, and none is visible here" in plain.stderr
    assert "Lower --num-gpus" not in plain.stderr and "Pass --num-gpus" not in plain.stderr
    assert _exit_code(["--num-gpus", "0", "--output-dir", str(env)]) == 2
    zero = capsys.readouterr().err
    assert "at least 1" in zero and "cannot run without one" in zero
    for bad in ("-1", "two"):
        assert _exit_code(["--num-gpus", bad]) == 2
    assert not list(env.rglob("*.json"))
    # What runs anywhere still runs.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _exit_code(["--dry-run", "--headdims", "64", "--seqlens", "512"]) == 0


def test_default_output_directory_is_what_the_lookup_reads(env, monkeypatch, capsys):
    """A run without --output-dir writes into the user's directory ($XDG_CACHE_HOME here),
    says that the lookup reads it, and the lookup finds the file there."""
    run = cli("--headdims", "64", "--seqlens", "512", "--H", "4", "--directions", "forward",
              "--causal", "false", "--worker-backend", FAKE_BACKEND,
              env_extra={"CUDA_VISIBLE_DEVICES": "0"})
    assert run.returncode == 0, run.stderr
    folder = env / "cache" / "ffpa_jax" / "tuned_configs"
    assert (folder / FILE_NAME).is_file()
    assert f"the tuned-config lookup reads {folder}" in run.stderr
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    capsys.readouterr()
    assert _exit_code(["--headdims", "64", "--seqlens", "512", "--H", "4", "--directions",
                       "forward", "--causal", "false", "--worker-backend", FAKE_BACKEND,
                       "--output-dir", str(env / "elsewhere")]) == 0  # in this process
    assert f"set FFPA_TUNED_CONFIG_DIR={env / 'elsewhere'}" in capsys.readouterr().err
    monkeypatch.setattr(lookup_mod, "user_config_dir", real_user_config_dir)
    clear_cache()
    try:
        found = lookup_config("forward", "fwd_generic", dtype="bf16", headdim=64, seqlen_q=512,
                              seqlen_k=512, device_name=FAKE_DEVICE)
    finally:
        clear_cache()
    assert found == search_space.candidates("fwd_generic", headdim=64)[-1]


def _has_ray() -> bool:
    """Whether Ray is installed (found, not imported: the next test checks that nothing
    imports it unasked). It is not in the `test` extra; `pip install -e ".[ray]"` adds it."""
    import importlib.util

    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


def test_ray_only_imported_for_ray_address(env, capsys):
    assert autotune_cli.main(["--output-dir", str(env), *SMALL]) == 0
    assert "ray" not in sys.modules
    if "ray" in sys.modules or _has_ray():
        pytest.skip("ray is installed: the missing-ray message cannot be shown")
    assert autotune_cli.main(["--ray-address", "127.0.0.1:6379", "--output-dir", str(env),
                          *SMALL]) == 2
    assert "--ray-address needs Ray" in capsys.readouterr().err


@pytest.mark.skipif(not _has_ray(), reason='Ray is not installed (pip install -e ".[ray]")')
def test_ray_cluster_runs_the_same_tasks_one_actor_per_gpu(env):
    """--ray-address against a real local Ray cluster (a head started with two GPU
    resources; the measurement is the fake one, so no GPU is needed): every task runs
    once, on actors that each hold one GPU, and the merged file is complete."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    started = subprocess.run(
        [*ray_cli, "start", "--head", "--port", str(port), "--num-cpus", "2", "--num-gpus", "2",
         "--include-dashboard=false", "--disable-usage-stats"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        out = env / "configs"
        run = cli("--ray-address", f"127.0.0.1:{port}", "--output-dir", str(out), *SMALL)
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        subprocess.run([*ray_cli, "stop", "--force"], capture_output=True, timeout=120)
    log = read_log(env / "log.jsonl")
    tasks = [t for t in build_tasks(directions=("forward", "backward"), dtypes=("bf16",),
                                    batch=1, heads=4, headdims=(64, 128), seqlens=(1, 512))
             if not t.kernel.startswith("decode")]
    assert sorted(r["key"] for r in log) == sorted(t.key for t in tasks)  # each task once
    assert {r["gpu"] for r in log} == {"0", "1"}  # Ray gave each actor its own GPU
    assert len({r["pid"] for r in log}) == 2  # one actor per GPU
    merged = load_config_file(out / FILE_NAME)
    assert len(merged.entries) == len(tasks)
