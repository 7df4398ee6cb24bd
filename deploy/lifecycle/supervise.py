"""`python -m kvpush.deploy.lifecycle.supervise ... -- CMD ARGS`: one small process that owns CMD's whole tree.

Any launcher (local, SSH, Slurm) starts a vLLM server or the router wrapped in it. It:
- leads its own process group, so signalling the group reaches everything (what `kvpush down` does);
- is the child subreaper of the tree: processes that lose their parent (vLLM's `VLLM::EngineCore`
  when its API server is SIGKILLed) are re-parented to it instead of to init, so it sees them;
- when CMD exits for any reason, stops every process left below it (TERM, then KILL) before it
  exits or restarts CMD, so nothing keeps a port or memory;
- forks a watcher that holds the read end of a pipe: if the supervisor itself dies, even by
  SIGKILL, the pipe closes and the watcher kills the whole process group (on an orderly exit the
  supervisor ends the watcher itself, so nothing of the group outlives it);
- with `--restart on-failure`, starts CMD again when it failed (non-zero exit or a signal), at most
  `--max-restarts` times within `--window-s` seconds, then gives up;
- passes SIGHUP, SIGUSR1 and SIGUSR2 on to CMD;
- keeps a small JSON status file (the `SupervisorStatus` below) that `kvpush status` and `up` read.

Standard library only: it runs on every host before anything else is imported.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import AbstractSet

MODULE = "kvpush.deploy.lifecycle.supervise"
RESTART_POLICIES = ("never", "on-failure")
STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}
# Passed on to the command, not acted on: e.g. a reload request. The supervisor has no terminal
# (setsid detached it from any), so a SIGHUP never means a hang-up here.
PASSED_ON = {signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}
HANDLED = STOP_SIGNALS | PASSED_ON | {signal.SIGCHLD}
_PR_SET_CHILD_SUBREAPER = 36
LEFTOVER_GRACE_S = 3.0  # TERM to KILL for what is left below a command that exited
KILL_WAIT_S = 30.0  # after KILL: a process in uninterruptible sleep (a GPU driver call) may take a while
MAX_BACKOFF_S = 30.0


@dataclass
class SupervisorStatus:
    """What the supervisor of one process says about it; written atomically at every change.

    state: running (CMD runs) | cleaning-up (CMD ended; stopping what it left) | restarting (CMD
    failed, starting it again) | stopping (a stop signal arrived) | stopped (after a stop signal) |
    exited (CMD ended, not restarted) | gave-up (CMD failed more often than the restart policy
    allows)."""

    name: str
    supervisor_pid: int
    state: str
    policy: str = "never"
    child_pid: int | None = None  # the command's PID (the last one, once it ended)
    watcher_pid: int | None = None
    child_started_at: float | None = None
    restarts: int = 0
    last_exit: str | None = None  # "killed by SIGKILL", "exit code 1"
    last_exit_at: float | None = None
    cleaned_up: list[str] = field(default_factory=list)  # "pid 12 (VLLM::EngineCor)" stopped after CMD ended
    left_alive: list[int] = field(default_factory=list)  # pids that outlived even SIGKILL
    updated_at: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SupervisorStatus | None:
        """None for text that is not a status document (a missing, empty or foreign file)."""
        try:
            data = json.loads(text)
            known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
            return cls(**known)
        except (ValueError, TypeError, AttributeError):
            return None


def supervisor_argv(python: str, name: str, status_file: str, restart: str = "never", max_restarts: int = 3,
                    window_s: float = 600.0) -> list[str]:
    """The words that go before a command to run it supervised (the command follows the `--`)."""
    argv = [python, "-m", MODULE, "--name", name, "--status-file", status_file]
    if restart != "never":
        argv += ["--restart", restart, "--max-restarts", str(max_restarts), "--window-s", f"{window_s:g}"]
    return argv + ["--"]


def describe_exit(wait_status: int) -> str:
    code = os.waitstatus_to_exitcode(wait_status)
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# -- the process table ------------------------------------------------------------------------


def _table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) for every process now."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            table[int(entry)] = (int(fields[1]), fields[0])
    return table


def descendants(root: int, exclude: AbstractSet[int] = frozenset()) -> list[int]:
    """Live (not zombie) processes below `root`, minus `exclude` and their own subtrees."""
    table = _table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(children.get(root, []))
    while todo:
        pid = todo.pop()
        if pid in exclude:
            continue
        if table[pid][1] not in ("Z", "X"):
            found.append(pid)
        todo += children.get(pid, [])
    return sorted(found)


def _command_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


# -- the supervisor ---------------------------------------------------------------------------


class Supervisor:
    def __init__(self, name: str, status_file: str, command: list[str], policy: str, max_restarts: int,
                 window_s: float):
        self.command, self.policy, self.max_restarts, self.window_s = command, policy, max_restarts, window_s
        self.status_file = status_file
        self.status = SupervisorStatus(name=name, supervisor_pid=os.getpid(), state="running", policy=policy)
        self.exited: dict[int, int] = {}  # reaped pid -> wait status
        self.watcher: int | None = None
        self.child: int | None = None  # the command while it runs
        self.stop_signal: int | None = None

    def log(self, message: str) -> None:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        sys.stderr.write(f"{stamp} kvpush supervise [{self.status.name}]: {message}\n")
        sys.stderr.flush()

    def write_status(self, **changes) -> None:
        for key, value in changes.items():
            setattr(self.status, key, value)
        self.status.updated_at = time.time()
        directory = os.path.dirname(self.status_file) or "."
        os.makedirs(directory, exist_ok=True)
        tmp = f"{self.status_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(self.status.to_json())
        os.replace(tmp, self.status_file)

    # -- children ---------------------------------------------------------------------

    def start_watcher(self) -> None:
        """A forked child that kills the whole group once the supervisor is gone (its pipe closes)."""
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(write_end)
                while os.read(read_end, 1):
                    pass
                os.killpg(os.getpgrp(), signal.SIGKILL)  # stop signals stay blocked here: only this ends it
            finally:
                os._exit(0)
        os.close(read_end)
        self._watcher_pipe = write_end  # kept open (not inherited by CMD) for the supervisor's life
        self.watcher = self.status.watcher_pid = pid

    def stop_watcher(self) -> None:
        """End the watcher before an orderly exit: the tree is already swept, and a watcher left to
        notice the closed pipe would outlive the supervisor for a moment, still in its group."""
        watcher, self.watcher = self.watcher, None
        if watcher is None:
            return
        _signal([watcher], signal.SIGKILL)
        try:
            os.waitpid(watcher, 0)
        except ChildProcessError:
            pass
        os.close(self._watcher_pipe)

    def spawn(self) -> int:
        # The child starts with no blocked signals and default dispositions, as if started by a shell.
        return os.posix_spawnp(self.command[0], self.command, os.environ, setsigmask=(),
                               setsigdef=(signal.SIGPIPE, signal.SIGXFSZ, *STOP_SIGNALS, *PASSED_ON))

    def reap(self) -> None:
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.watcher:
                self.log("the watcher process ended; starting a new one")
                os.close(self._watcher_pipe)
                self.start_watcher()
                self.write_status()
                continue
            self.exited[pid] = wait_status

    def wait_signal(self, timeout_s: float) -> int | None:
        """Wait up to timeout_s for a signal; returns a stop signal's number (noting it), else None."""
        info = signal.sigtimedwait(HANDLED, max(0.0, timeout_s))
        if info is None:
            return None
        if info.si_signo in PASSED_ON:
            if self.child is not None:
                _signal([self.child], info.si_signo)
            return None
        if info.si_signo in STOP_SIGNALS:
            if self.stop_signal is None:
                self.stop_signal = info.si_signo
            return info.si_signo
        return None

    def wait_exit(self, pid: int) -> int:
        """Wait until `pid` ended; a stop signal meanwhile is passed on to it once. Its wait status."""
        forwarded = False
        while True:
            self.reap()
            if pid in self.exited:
                return self.exited.pop(pid)
            if self.stop_signal is not None and not forwarded:
                # Signalling the group already reached it; a signal sent to the supervisor alone did not.
                self.log(f"stopping on {signal.Signals(self.stop_signal).name}: passing it to pid {pid}")
                self.write_status(state="stopping")
                _signal([pid], self.stop_signal)
                forwarded = True
            self.wait_signal(1.0)

    def clean_up(self) -> tuple[list[str], list[int]]:
        """Stop every process left below the supervisor (not the watcher): TERM, then KILL."""
        left = descendants(os.getpid(), exclude={self.watcher} if self.watcher else set())
        if not left:
            return [], []
        named = [f"pid {pid} ({_command_name(pid)})" for pid in left]
        self.log(f"stopping what the command left behind: {', '.join(named)}")
        _signal(left, signal.SIGTERM)
        _signal(left, signal.SIGCONT)  # a stopped process acts on TERM only once it runs
        for sig, wait_s in ((signal.SIGKILL, LEFTOVER_GRACE_S), (None, KILL_WAIT_S)):
            end = time.monotonic() + wait_s
            while left and time.monotonic() < end:
                self.wait_signal(0.05)
                self.reap()
                left = descendants(os.getpid(), exclude={self.watcher} if self.watcher else set())
            if left and sig is not None:
                self.log(f"still alive after {wait_s:g} s: {', '.join(map(str, left))}; sending SIGKILL")
                _signal(left, sig)
        if left:
            self.log(f"still alive {KILL_WAIT_S:g} s after SIGKILL: {', '.join(map(str, left))}")
        return named, left

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> int:
        recent: list[float] = []  # restart times within the window
        while True:
            try:
                child = self.child = self.spawn()
            except OSError as exc:
                self.log(f"cannot start {self.command[0]}: {exc.strerror or exc}")
                self.write_status(state="exited", last_exit=f"cannot start: {exc.strerror or exc}",
                                  last_exit_at=time.time())
                return 127
            self.write_status(state="running", child_pid=child, child_started_at=time.time())
            self.log(f"started pid {child}" + (f" (restart {self.status.restarts})" if self.status.restarts else ""))
            wait_status = self.wait_exit(child)
            self.child = None
            how, code = describe_exit(wait_status), os.waitstatus_to_exitcode(wait_status)
            self.log(f"pid {child} ended: {how}")
            self.write_status(last_exit=how, last_exit_at=time.time(),
                              state="stopping" if self.stop_signal else "cleaning-up")
            cleaned, left = self.clean_up()
            self.write_status(cleaned_up=cleaned, left_alive=left)
            exit_code = code if code >= 0 else 128 - code
            if self.stop_signal is not None:
                self.write_status(state="stopped")
                return 0
            if self.policy != "on-failure" or code == 0:
                self.write_status(state="exited")
                return exit_code
            now = time.monotonic()
            recent = [t for t in recent if now - t < self.window_s]
            if len(recent) >= self.max_restarts:
                self.log(f"failed {len(recent) + 1} times within {self.window_s:g} s; giving up "
                         f"(restart policy: at most {self.max_restarts} restarts in {self.window_s:g} s)")
                self.write_status(state="gave-up")
                return exit_code
            recent.append(now)
            backoff = min(MAX_BACKOFF_S, 2.0 ** (len(recent) - 1))
            self.write_status(state="restarting", restarts=self.status.restarts + 1)
            self.log(f"restarting in {backoff:g} s (restart {len(recent)} of at most {self.max_restarts} "
                     f"in {self.window_s:g} s)")
            end = time.monotonic() + backoff
            while self.stop_signal is None and time.monotonic() < end:
                self.wait_signal(end - time.monotonic())
                self.reap()
            if self.stop_signal is not None:
                self.write_status(state="stopped")
                return 0


def _take_the_group() -> None:
    if os.getpgrp() != os.getpid():
        try:
            os.setsid()
        except OSError:
            os.setpgid(0, 0)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        # Without it, orphans go to init: the group signal still reaches them, the sweep does not.
        sys.stderr.write(f"kvpush supervise: cannot become the child subreaper: {os.strerror(ctypes.get_errno())}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="the process's name in the deployment (for logs and status)")
    parser.add_argument("--status-file", required=True, help="where to keep the JSON status")
    parser.add_argument("--restart", choices=RESTART_POLICIES, default="never")
    parser.add_argument("--max-restarts", type=int, default=3, help="restarts allowed within --window-s")
    parser.add_argument("--window-s", type=float, default=600.0)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to supervise after --")
    if args.max_restarts < 1 or args.window_s <= 0:
        parser.error("--max-restarts must be at least 1 and --window-s more than 0")
    _take_the_group()
    signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
    supervisor = Supervisor(args.name, os.path.expanduser(args.status_file), command, args.restart,
                            args.max_restarts, args.window_s)
    supervisor.start_watcher()
    try:
        return supervisor.run()
    finally:
        supervisor.stop_watcher()


if __name__ == "__main__":
    sys.exit(main())
