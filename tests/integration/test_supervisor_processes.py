"""kvpush.deploy.lifecycle.supervise with real processes on this machine: what it does when its command ends,
when it is told to stop, and with what it passes on. (Over SSH, with killed servers and a restart
policy: tests/integration/test_recovery_ssh.py.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpush.deploy.lifecycle.supervise import supervisor_argv

# A command that records the signals it gets, starts a child that ignores SIGTERM and outlives it,
# and then exits with the code in its first argument after the seconds in its second.
COMMAND = r"""
import os, signal, subprocess, sys, time
log = open(sys.argv[3], "a", buffering=1)
signal.signal(signal.SIGHUP, lambda *a: log.write("HUP\n"))
signal.signal(signal.SIGTERM, lambda *a: (log.write("TERM\n"), sys.exit(0)))
subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
log.write(f"started {os.getpid()}\n")
time.sleep(float(sys.argv[2]))
sys.exit(int(sys.argv[1]))
"""


class Supervised:
    def __init__(self, tmp_path: Path, code: int = 0, after_s: float = 600, restart: str = "never"):
        self.status_file, self.log = tmp_path / "run" / "p.json", tmp_path / "p.log"
        script = tmp_path / "command.py"
        script.write_text(COMMAND)
        argv = supervisor_argv(sys.executable, "p", str(self.status_file), restart, 1, 60)
        self.proc = subprocess.Popen(argv + [sys.executable, str(script), str(code), str(after_s), str(self.log)],
                                     start_new_session=True, stderr=open(tmp_path / "supervisor.log", "w"))
        self.until(lambda s: s.get("state") == "running" and "started" in self.lines())

    def status(self) -> dict:
        try:
            return json.loads(self.status_file.read_text())
        except (FileNotFoundError, ValueError):
            return {}

    def lines(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def until(self, predicate, timeout_s: float = 20.0) -> dict:
        end = time.monotonic() + timeout_s
        while not predicate(status := self.status()):
            assert time.monotonic() < end, status
            time.sleep(0.05)
        return status

    def group(self) -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            try:
                stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if entry.isdigit() and int(stat[2]) == self.proc.pid and stat[0] != "Z":
                pids.append(int(entry))
        return pids

    def close(self) -> None:
        for pid in self.group():
            os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


@pytest.fixture
def supervised(tmp_path):
    made: list[Supervised] = []

    def make(**kw) -> Supervised:
        made.append(Supervised(tmp_path, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_command_that_ends_cleanly_is_not_restarted_and_what_it_left_is_killed(supervised):
    s = supervised(code=0, after_s=0.5, restart="on-failure")
    assert s.proc.wait(20) == 0
    status = s.status()
    assert status["state"] == "exited" and status["last_exit"] == "exit code 0" and status["restarts"] == 0
    assert len(status["cleaned_up"]) == 1 and s.group() == []  # its child ignored SIGTERM: it got SIGKILL


def test_a_failing_command_is_restarted_then_given_up_on(supervised):
    s = supervised(code=3, after_s=0.3, restart="on-failure")  # at most 1 restart in 60 s
    assert s.proc.wait(30) == 3
    status = s.status()
    assert status["state"] == "gave-up" and status["restarts"] == 1 and status["last_exit"] == "exit code 3"
    assert s.lines().count("started") == 2 and s.group() == []


def test_a_stop_signal_to_the_supervisor_alone_reaches_the_command_once(supervised):
    s = supervised(restart="on-failure")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(20) == 0
    assert s.status()["state"] == "stopped" and s.lines().count("TERM") == 1 and s.group() == []


def test_an_orderly_exit_ends_the_watcher_before_the_supervisor_exits(supervised):
    s = supervised(restart="on-failure")
    # Stopped, the watcher could not end itself on seeing the supervisor gone: only the supervisor can.
    os.kill(s.status()["watcher_pid"], signal.SIGSTOP)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(20) == 0
    assert s.group() == []


def test_sighup_is_passed_on_and_changes_nothing_else(supervised):
    s = supervised()
    s.proc.send_signal(signal.SIGHUP)
    s.until(lambda _: "HUP" in s.lines())
    assert s.proc.poll() is None and s.status()["state"] == "running"


def test_a_command_that_cannot_start_says_so(tmp_path):
    status_file = tmp_path / "p.json"
    done = subprocess.run(supervisor_argv(sys.executable, "p", str(status_file)) + [str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=20, start_new_session=True)
    status = json.loads(status_file.read_text())
    assert done.returncode == 127 and status["state"] == "exited"
    assert status["last_exit"] == "cannot start: No such file or directory" and "cannot start" in done.stderr
