"""Helpers shared by the SSH lifecycle tests: stand-in deployments and an orphan check."""
from __future__ import annotations

import signal

import psutil

from kvpush.deploy.lifecycle import Events, LifecycleOptions
from kvpush.deploy.runners import SshOptions


class RecordingEvents(Events):
    def __init__(self):
        self.notes, self.tails = [], {}

    def note(self, message):
        self.notes.append(message)

    def log_tail(self, name, host, text):
        self.tails[name] = text


def options(cluster, **kw) -> LifecycleOptions:
    kw.setdefault("ready_timeout_s", 120)  # generous: this machine is shared and often loaded
    kw.setdefault("stop_timeout_s", 5)
    kw.setdefault("provision", False)  # stand-ins run the shared dev venv: never install into it
    kw.setdefault("doctor", False)  # stand-in hosts have no vLLM: doctor's software check would refuse them
    return LifecycleOptions(ssh=SshOptions(known_hosts=str(cluster.known_hosts), connect_timeout_s=5), **kw)


def processes_under(marker: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose command line mentions marker (a test's temp dir)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        try:
            if proc.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(proc.info["cmdline"] or []):
                found.append(proc)
        except psutil.Error:
            pass
    return found


def kill_leftovers(marker: str) -> list[psutil.Process]:
    """Safety net for failed tests: kill whatever still runs from this test's temp dir."""
    left = processes_under(marker)
    for proc in left:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=3)
    return left
