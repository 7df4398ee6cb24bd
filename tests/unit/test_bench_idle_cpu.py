"""kvpush.bench.idle_cpu: parse two /proc stat snapshots; and one real sample of this machine."""
from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from kvpush.bench.idle_cpu import cores_busy, idle_cores, sample_command
from kvpush.deploy.runners import LocalRunner


def _stat(pid: int, comm: str, utime: int, stime: int) -> str:
    rest = ["S", "1", str(pid), "0"] + ["0"] * 7 + [str(utime), str(stime)] + ["0"] * 10
    return f"{pid} ({comm}) " + " ".join(rest)


def test_cores_busy_per_process_over_the_measured_window_ignores_ones_that_left():
    output = "\n".join([
        "100",
        "5000.25 9000.50",  # /proc/uptime
        _stat(10, "VLLM::Worker", 1000, 50), _stat(11, "odd name (x) y", 5, 5), _stat(12, "gone", 0, 0),
        "--kvpush-sample--",
        "5002.75 9004.00",  # 2.5 s later, not the 2 s slept: starting `sleep` and `cat` took the rest
        _stat(10, "VLLM::Worker", 1280, 70), _stat(11, "odd name (x) y", 25, 5),
    ])
    assert cores_busy(output) == pytest.approx({10: 300 / 100 / 2.5, 11: 20 / 100 / 2.5})


def test_sample_command_names_every_pid():
    cmd = sample_command([5, 7], 1.5)
    assert "cat /proc/uptime /proc/5/stat /proc/7/stat" in cmd and "sleep 1.5" in cmd


def test_a_real_spinning_process_uses_cpu_and_a_sleeping_one_none():
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend=time.time()+30\nwhile time.time()<end: pass"],
                               start_new_session=True)
    sleeper = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        time.sleep(0.5)
        # sleep's own start (loading, then its first instructions) takes CPU: sample only once it sleeps
        deadline = time.monotonic() + 10.0
        while psutil.Process(sleeper.pid).status() != psutil.STATUS_SLEEPING and time.monotonic() < deadline:
            time.sleep(0.01)
        runner = LocalRunner()
        # Lower bound only: on a shared 2-core machine the spinner may get a small share of a core.
        busy = idle_cores(runner, {"spinner": spinner.pid, "sleeper": sleeper.pid}, seconds=2.0)
        assert 0.0 < busy["spinner"] <= 1.1
        assert busy["sleeper"] == 0.0
    finally:
        for proc in (spinner, sleeper):
            proc.kill()
            proc.wait()
