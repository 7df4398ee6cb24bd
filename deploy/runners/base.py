"""The one interface every host is driven through, and the shell snippets both runners share.

A plan keeps `~/...` paths literally; a runner expands a leading `~/` to its host's home.
"""
from __future__ import annotations

import shlex
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import BinaryIO, Callable, Literal

from kvpush.common.errors import KvpushError

from .env_file import checked_source_command

ProcessState = Literal["alive", "zombie", "dead"]


class HostError(KvpushError):
    """One host could not do what was asked; str() names the host."""


@dataclass(frozen=True)
class CommandResult:
    host: str
    command: str
    exit_code: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def check(self, what: str) -> CommandResult:
        if not self.ok:
            detail = (self.stderr.strip() or self.stdout.strip()).splitlines()[-1:] or ["no output"]
            raise HostError(f"host {self.host}: {what} failed (exit {self.exit_code}): {detail[0]}")
        return self


@dataclass(frozen=True)
class Started:
    pid: int
    pgid: int
    start_time: float | None  # seconds since the epoch, from the host's process table


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    state: ProcessState
    start_time: float | None = None
    pgid: int | None = None
    stopped: bool = False  # alive but stopped (SIGSTOP, a debugger): it runs no code until SIGCONT
    command: str | None = None  # the short command name (/proc/PID/comm), where known


@dataclass(frozen=True)
class HttpResponse:
    status: int
    body: bytes

    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class Runner(ABC):
    """Drives one host. Methods raise HostError (one line naming the host) on failure."""

    name: str

    @property
    @abstractmethod
    def home(self) -> str: ...

    @abstractmethod
    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None) -> CommandResult:
        """Run a shell command; a timeout raises HostError."""

    @abstractmethod
    def read_file(self, path: str) -> bytes | None:
        """The file's bytes, or None when it does not exist."""

    @abstractmethod
    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write atomically (temporary file + rename), creating parent directories."""

    @abstractmethod
    def upload(self, local_path: str, remote_path: str) -> None: ...

    @abstractmethod
    def inspect(self, pids: list[int]) -> dict[int, ProcessInfo]: ...

    @abstractmethod
    def signal_groups(self, pgids: list[int], signal_name: str) -> None:
        """Send TERM/KILL/... to each process group; groups already gone are ignored."""

    @abstractmethod
    def http(self, method: str, url: str, body: bytes | None = None, timeout: float = 5.0,
             headers: dict[str, str] | None = None) -> HttpResponse:
        """An HTTP request made from the host itself (so host-local binds are reachable)."""

    @abstractmethod
    def follow(self, command: str, on_line: Callable[[str], None], stop: threading.Event) -> None:
        """Run a long command (e.g. `tail -F`), calling on_line per output line until stop is set."""

    def stream(self, command: str, stdout: BinaryIO, stderr: BinaryIO) -> int:
        """Run a shell command, writing its output to stdout/stderr as it comes; its exit status
        (255 where the host gives none, as `ssh` does). No timeout: it runs until it ends."""
        result = self.run(command, timeout=None)
        stdout.write(result.stdout.encode())
        stderr.write(result.stderr.encode())
        return result.exit_code

    def group_members(self, pgids: list[int]) -> dict[int, list[ProcessInfo]]:
        """Every process (zombies included) currently in each process group."""
        wanted = {int(g) for g in pgids}
        result = self.run("ps -e -o pid=,pgid=,stat=,comm=", timeout=30).check("listing processes")
        members: dict[int, list[ProcessInfo]] = {g: [] for g in wanted}
        for line in result.stdout.splitlines():
            pid, pgid, stat, *command = line.split(None, 3)
            if int(pgid) in wanted:
                members[int(pgid)].append(
                    ProcessInfo(
                        int(pid),
                        "zombie" if stat.startswith("Z") else "alive",
                        None,
                        int(pgid),
                        stopped=stat[:1] in ("T", "t"),
                        command=" ".join(command) or None,
                    )
                )
        return members

    def listening_ports(self, pids: list[int]) -> dict[int, list[int]]:
        """Per PID: the TCP ports its sockets listen on (none for a PID that is gone)."""
        if not pids:
            return {}
        result = self.run(listening_ports_command(pids), timeout=30).check("listing the ports processes hold")
        return parse_listening_ports(pids, result.stdout)

    def connect(self) -> None:  # noqa: B027 (optional: a runner without a connection keeps the no-op)
        """Open the host's connection now (fan-out connects all hosts in parallel); no-op locally."""

    def close(self) -> None:  # noqa: B027 (optional, as connect)
        pass

    def expand(self, value: str) -> str:
        if value == "~":
            return self.home
        return self.home + value[1:] if value.startswith("~/") else value

    def start_detached(self, argv: list[str], env: dict[str, str], cwd: str, log_path: str,
                       env_file: str | None = None) -> Started:
        """Start a process that outlives this connection: own session and process group, log file;
        with env_file, the variables in that file too (secrets: never on a command line)."""
        result = self.run(detached_start_command(
            [self.expand(a) for a in argv], {k: self.expand(v) for k, v in env.items()},
            self.expand(cwd), self.expand(log_path), self.expand(env_file) if env_file else None), timeout=30)
        result.check(f"starting {shlex.join(argv[:3])}")
        try:
            pid = int(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise HostError(
                f"host {self.name}: starting {argv[0]} printed no PID: {result.stdout!r} {result.stderr!r}"
            ) from None
        # `echo $!` can run before the child reached setsid(): wait until it leads its own group.
        deadline = Deadline(3.0)
        info = self.inspect([pid])[pid]
        while info.state == "alive" and info.pgid != pid and not deadline.expired():
            time.sleep(0.01)
            info = self.inspect([pid])[pid]
        return Started(pid=pid, pgid=pid, start_time=info.start_time)

    def tail(self, path: str, lines: int = 30) -> str:
        result = self.run(f"tail -n {int(lines)} {shlex.quote(self.expand(path))} 2>/dev/null", timeout=15)
        return result.stdout


def shell_word(value: str) -> str:
    """A word for the host's shell; a leading ~/ becomes that host's $HOME (the shell expands it
    where the command runs, so it needs no runner's `home`)."""
    if value == "~":
        return '"$HOME"'
    if value.startswith("~/"):
        return '"$HOME"/' + shlex.quote(value[2:])
    return shlex.quote(value)


def detached_start_command(argv: list[str], env: dict[str, str], cwd: str, log_path: str,
                           env_file: str | None = None) -> str:
    """Shell text that starts argv detached and prints its PID.

    The backgrounded command must be one simple command so `$!` is its PID (`a && b &` would
    background a subshell), and every std stream is redirected so the SSH channel can close.
    setsid gives it its own session and process group, so signalling the group stops it all.
    env_file's variables are exported by this shell (`set -a`) and so inherited: their values
    never appear in an argv (`ps`), where `env K=V` words would. The file is checked first (owner,
    mode, who may write its directories: env_file.py); a failed check is one line on stderr.
    """
    log_dir = log_path.rsplit("/", 1)[0] if "/" in log_path else "."
    q = shlex.quote
    env_words = " ".join(q(f"{k}={v}") for k, v in sorted(env.items()))
    source = checked_source_command(env_file, q) if env_file else ""
    return (
        f"mkdir -p {q(cwd)} {q(log_dir)} || exit 1; cd {q(cwd)} || exit 1; {source}"
        f"if [ -f {q(log_path)} ]; then mv -f {q(log_path)} {q(log_path + '.1')}; fi; "
        f"env {env_words} nohup setsid {shlex.join(argv)} >{q(log_path)} 2>&1 </dev/null & echo $!"
    )


def proc_table_command(pids: list[int]) -> str:
    """Prints btime, CLK_TCK, then one `PID <stat line>` per live PID (none for missing ones)."""
    pid_words = " ".join(str(int(p)) for p in pids)
    return (
        "grep '^btime' /proc/stat; getconf CLK_TCK; "
        f"for p in {pid_words}; do s=$(cat /proc/$p/stat 2>/dev/null) && echo \"$p $s\"; done; true"
    )


def parse_proc_table(pids: list[int], text: str) -> dict[int, ProcessInfo]:
    lines = text.splitlines()
    btime = float(lines[0].split()[1])
    ticks = float(lines[1])
    found: dict[int, ProcessInfo] = {}
    for line in lines[2:]:
        pid_text, stat = line.split(" ", 1)
        # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
        rest = stat[stat.rindex(")") + 2 :].split()
        state_letter, pgid, start_ticks = rest[0], int(rest[2]), int(rest[19])
        state: ProcessState = "zombie" if state_letter in ("Z", "X") else "alive"
        command = stat[stat.index("(") + 1 : stat.rindex(")")]
        found[int(pid_text)] = ProcessInfo(int(pid_text), state, round(btime + start_ticks / ticks, 2), pgid,
                                           stopped=state_letter in ("T", "t"), command=command)
    return {p: found.get(p, ProcessInfo(p, "dead")) for p in pids}


SOCKET_FDS = "ls -l /proc/$p/fd 2>/dev/null | sed -n \"s/.*socket:\\[\\([0-9]*\\)\\]/$p \\1/p\""
TCP_TABLES = "cat /proc/net/tcp /proc/net/tcp6 2>/dev/null"


def listening_ports_command(pids: list[int]) -> str:
    """Prints `PID <fd listing>` lines for each PID's socket fds, then `==`, then the kernel's TCP tables."""
    pid_words = " ".join(str(int(p)) for p in pids)
    return f"for p in {pid_words}; do {SOCKET_FDS}; done; echo ==; {TCP_TABLES}; true"


def port_holders_command() -> str:
    """listening_ports_command for every process this user may look into, then `==` and each
    process's command name (`/proc/PID/comm:NAME` lines)."""
    return (f"for d in /proc/[0-9]*; do p=${{d#/proc/}}; {SOCKET_FDS}; done; echo ==; {TCP_TABLES}; echo ==; "
            "grep -H . /proc/[0-9]*/comm 2>/dev/null; true")


TCP_LISTEN = "0A"


def _listening(owned: str, tables: str) -> dict[int, set[int]]:
    """PID -> the TCP ports its sockets listen on, from `PID INODE` lines and the kernel's tables."""
    inode_owner: dict[str, int] = {}
    for line in owned.splitlines():
        pid, _, inode = line.partition(" ")
        if inode:
            inode_owner[inode.strip()] = int(pid)
    ports: dict[int, set[int]] = {}
    for line in tables.splitlines():
        fields = line.split()
        # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
        if len(fields) > 9 and fields[3] == TCP_LISTEN and fields[9] in inode_owner:
            ports.setdefault(inode_owner[fields[9]], set()).add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def parse_listening_ports(pids: list[int], text: str) -> dict[int, list[int]]:
    owned, _, tables = text.partition("==\n")
    found = _listening(owned, tables)
    return {int(pid): sorted(found.get(int(pid), ())) for pid in pids}


def parse_port_holders(ports: list[int], text: str) -> dict[int, list[ProcessInfo]]:
    """Per port: the live processes listening on it (with their command names), from port_holders_command."""
    owned, _, rest = text.partition("==\n")
    tables, _, comms = rest.partition("==\n")
    names: dict[int, str] = {}
    for line in comms.splitlines():
        path, _, name = line.partition(":")
        pid = path.removeprefix("/proc/").removesuffix("/comm")
        if pid.isdigit():
            names[int(pid)] = name.strip()
    found = _listening(owned, tables)
    return {port: [ProcessInfo(pid, "alive", command=names.get(pid)) for pid in sorted(found) if port in found[pid]]
            for port in ports}


def signal_groups_command(pgids: list[int], signal_name: str) -> str:
    words = " ".join(f"-{int(g)}" for g in pgids if int(g) > 1)
    return f"kill -s {shlex.quote(signal_name)} -- {words} 2>/dev/null; true" if words else "true"


class Deadline:
    def __init__(self, seconds: float | None):
        self.end = None if seconds is None else time.monotonic() + seconds

    def left(self) -> float | None:
        return None if self.end is None else max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return self.end is not None and time.monotonic() >= self.end
