"""Tests on several (fake) CPU devices: a test file re-run as a subprocess whose XLA_FLAGS
make the host platform show `devices` devices (the test process itself has one, and JAX
fixes the count when it starts)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def fake_devices_env(devices: int) -> dict:
    """This process's environment, on the CPU with `devices` host devices and the repository
    and tests/ importable."""
    return dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
                + f" --xla_force_host_platform_device_count={devices}",
                JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))


def worker_report(test_file: str, devices: int, timeout: int, args: tuple = ()) -> dict:
    """The JSON that `python test_file --worker *args` prints last, run on `devices`
    devices."""
    proc = subprocess.run([sys.executable, str(pathlib.Path(test_file).resolve()), "--worker",
                           *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=fake_devices_env(devices))
    assert proc.returncode == 0, f"worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
