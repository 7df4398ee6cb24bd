"""Helpers shared by the SSH lifecycle tests: stand-in deployments and an orphan check."""
from __future__ import annotations

import signal
from contextlib import contextmanager

import psutil

from kvpush.deploy.lifecycle.lifecycle import Events, LifecycleOptions, down
from kvpush.deploy.runners import SshOptions
from sshd_hosts import topology_for, write_standin_python

STANDIN_PORTS = iter(range(19000, 19900, 20))  # each stand-in deployment its own block of 20 ports


class RecordingEvents(Events):
    def __init__(self):
        self.notes, self.tails = [], {}

    def note(self, message):
        self.notes.append(message)

    def log_tail(self, name, host, text):
        self.tails[name] = text


def run_cli(args, capsys) -> tuple[int, str, str]:
    """`kvpush ARGS` in this process: (exit code, stdout, stderr)."""
    from kvpush.cli.main import run as cli_run

    try:
        cli_run(args)
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def options(cluster, **kw) -> LifecycleOptions:
    kw.setdefault("ready_timeout_s", 120)  # generous: this machine is shared and often loaded
    kw.setdefault("stop_timeout_s", 5)
    kw.setdefault("provision", False)  # stand-ins run the shared dev venv: never install into it
    kw.setdefault("doctor", False)  # stand-in hosts have no vLLM: doctor's software check would refuse them
    return LifecycleOptions(ssh=SshOptions(known_hosts=str(cluster.known_hosts), connect_timeout_s=5), **kw)


def processes_under(marker: str) -> list[psutil.Process]:
    """Live (non-zombie) processes whose command line mentions marker (a test's temp dir) or that
    run in it (vLLM's engine core renames its command line to `VLLM::EngineCore`)."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status", "cwd"]):
        try:
            cwd = proc.info["cwd"] or ""
            if proc.info["status"] != psutil.STATUS_ZOMBIE and (
                    marker in " ".join(proc.info["cmdline"] or []) or cwd == marker or cwd.startswith(marker.rstrip("/") + "/")):
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


@contextmanager
def standin_deployments(cluster, tmp_path):
    """Factory for stand-in topologies on the cluster; afterwards stops them and checks for orphans."""
    python = str(write_standin_python(tmp_path / "standin-python"))
    made = []

    def make(name="t", prefill=(0,), decode=(1,), router=2, **kw):
        topo = topology_for(cluster, name, python, tmp_path, prefill=list(prefill), decode=list(decode),
                            router=router, port_base=kw.pop("port_base", None) or next(STANDIN_PORTS), **kw)
        made.append(topo.name)
        return topo

    yield make
    for host in cluster.hosts:
        if not host.running:
            cluster.restart(host)
    for name in set(made):
        down(name, options(cluster))
    left = kill_leftovers(python)
    assert not left, f"processes left behind: {[p.pid for p in left]}"


def wait_for(what: str, condition, timeout_s: float, detail=lambda: "", interval_s: float = 0.3):
    """Poll condition() until it returns something true (returned); past timeout_s, fail saying
    what was awaited and detail() (the state that would explain it)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:.0f} s for {what}; {detail()}")
        time.sleep(interval_s)
