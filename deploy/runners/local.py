"""Runner for the machine kvpush runs on: subprocess for commands, psutil for processes."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import BinaryIO

import psutil

from .base import CommandResult, HostError, HttpResponse, ProcessInfo, ProcessState, Runner
from .http import exchange, split_url

_STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


class LocalRunner(Runner):
    def __init__(self, name: str = "local"):
        self.name = name

    @property
    def home(self) -> str:
        return str(Path.home())

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None) -> CommandResult:
        started = time.monotonic()
        try:
            proc = subprocess.run(["bash", "-c", command], input=stdin, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise HostError(f"host {self.name}: command timed out after {timeout:.0f} s: {command[:80]}") from None
        return CommandResult(self.name, command, proc.returncode, proc.stdout.decode(errors="replace"),
                             proc.stderr.decode(errors="replace"), time.monotonic() - started)

    def stream(self, command: str, stdout: BinaryIO, stderr: BinaryIO) -> int:
        return stream_process(["bash", "-c", command], stdout, stderr)

    def read_file(self, path: str) -> bytes | None:
        try:
            return Path(self.expand(path)).read_bytes()
        except FileNotFoundError:
            return None

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        target = Path(self.expand(path))
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.chmod(tmp, mode)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def upload(self, local_path: str, remote_path: str) -> None:
        target = Path(self.expand(remote_path))
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
        os.close(fd)
        shutil.copyfile(local_path, tmp)
        os.replace(tmp, target)

    def inspect(self, pids: list[int]) -> dict[int, ProcessInfo]:
        infos = {}
        for pid in pids:
            try:
                proc = psutil.Process(pid)
                with proc.oneshot():
                    status = proc.status()
                    state: ProcessState = "zombie" if status == psutil.STATUS_ZOMBIE else "alive"
                    infos[pid] = ProcessInfo(pid, state, round(proc.create_time(), 2), os.getpgid(pid),
                                             stopped=status in _STOPPED, command=proc.name())
            except (psutil.NoSuchProcess, ProcessLookupError):
                infos[pid] = ProcessInfo(pid, "dead")
        return infos

    def group_members(self, pgids: list[int]) -> dict[int, list[ProcessInfo]]:
        wanted = {int(g) for g in pgids}
        members: dict[int, list[ProcessInfo]] = {g: [] for g in wanted}
        for proc in psutil.process_iter(["pid", "status", "name"]):
            try:
                pgid = os.getpgid(proc.pid)
            except (ProcessLookupError, PermissionError):
                continue
            if pgid in wanted:
                status = proc.info["status"]
                state: ProcessState = "zombie" if status == psutil.STATUS_ZOMBIE else "alive"
                members[pgid].append(ProcessInfo(proc.pid, state, None, pgid, stopped=status in _STOPPED,
                                                 command=proc.info["name"]))
        return members

    def follow(self, command: str, on_line, stop) -> None:
        proc = subprocess.Popen(["bash", "-c", command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        assert proc.stdout is not None  # stdout=PIPE

        def end_when_stopped() -> None:
            stop.wait()
            _terminate(proc)

        watcher = threading.Thread(target=end_when_stopped, daemon=True)
        watcher.start()
        try:
            for raw in proc.stdout:
                if stop.is_set():
                    break
                on_line(raw.decode(errors="replace").rstrip("\n"))
        finally:
            _terminate(proc)

    def signal_groups(self, pgids: list[int], signal_name: str) -> None:
        sig = getattr(signal, f"SIG{signal_name}")
        for pgid in pgids:
            if pgid > 1:
                try:
                    os.killpg(pgid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def http(self, method: str, url: str, body: bytes | None = None, timeout: float = 5.0,
             headers: dict[str, str] | None = None) -> HttpResponse:
        host, port, path = split_url(url)
        with socket.create_connection((host, port), timeout=timeout) as sock:
            return exchange(sock, host, port, method, path, body, headers)


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        proc.wait()


def stream_process(argv: list[str], stdout: BinaryIO, stderr: BinaryIO) -> int:
    """Run argv (stdin closed), copying its stdout and stderr to the given streams chunk by chunk
    as they come; its exit status (128 + N for a process killed by signal N, as a shell says)."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def copy(source, target) -> None:
        while chunk := source.read1(65536):
            target.write(chunk)
            target.flush()

    copier = threading.Thread(target=copy, args=(proc.stderr, stderr), daemon=True)
    copier.start()
    try:
        copy(proc.stdout, stdout)
        copier.join()
        code = proc.wait()
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C): end the command too
            proc.terminate()
            proc.wait()
    return 128 - code if code < 0 else code
