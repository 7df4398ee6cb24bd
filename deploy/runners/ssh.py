"""Runner over SSH (paramiko): one connection per host, reused for every call within a command."""
from __future__ import annotations

import logging
import posixpath
import threading
import time
import uuid
from typing import BinaryIO

import paramiko

from kvpush.deploy.topology.host_address import HostAddress

from .base import (
    CommandResult,
    Deadline,
    HostError,
    HttpResponse,
    ProcessInfo,
    Runner,
    parse_proc_table,
    proc_table_command,
    signal_groups_command,
)
from .http import exchange, split_url
from .options import SshOptions
from .ssh_config import SshTarget, resolve
from .ssh_connect import ACCEPT_HINT, open_chain, transport

__all__ = ["ACCEPT_HINT", "SshRunner"]
# paramiko logs refused forwarding channels itself; callers get the same facts as exceptions.
logging.getLogger("paramiko.transport").setLevel(logging.CRITICAL)


class SshRunner(Runner):
    def __init__(self, name: str, host: HostAddress, options: SshOptions = SshOptions()):
        self.name, self.host, self.options = name, host, options
        self._target: SshTarget | None = None  # resolved through ~/.ssh/config at the first connect
        self._client: paramiko.SSHClient | None = None
        self._hops: list[paramiko.SSHClient] = []  # ProxyJump hosts, first hop first
        self._sftp: paramiko.SFTPClient | None = None
        self._home: str | None = None
        self._lock = threading.RLock()

    # -- connection -------------------------------------------------------------------------

    def _where(self) -> str:
        return f"host {self.name} ({self._target.describe() if self._target else self.host.describe()})"

    def connect(self) -> None:
        self._connected()

    def _connected(self) -> paramiko.SSHClient:
        with self._lock:
            if self._client is not None and (current := self._client.get_transport()) and current.is_active():
                return self._client
            self._close_clients()
            self._client = self._open()
            return self._client

    def _open(self) -> paramiko.SSHClient:
        self._target = resolve(self.host, self.options)
        *self._hops, client = open_chain(self._target, self.options, self._where())
        return client

    def _close_clients(self) -> None:
        for client in [self._client, *reversed(self._hops)]:
            if client is not None:
                client.close()
        self._client, self._hops = None, []

    def close(self) -> None:
        with self._lock:
            if self._sftp is not None:
                self._sftp.close()
            self._sftp = None
            self._close_clients()

    def _sftp_client(self) -> paramiko.SFTPClient:
        with self._lock:
            if self._sftp is None:
                self._sftp = self._connected().open_sftp()
            return self._sftp

    @property
    def home(self) -> str:
        if self._home is None:
            self._home = self._sftp_client().normalize(".")
        return self._home

    # -- commands ---------------------------------------------------------------------------

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None) -> CommandResult:
        timeout = self.options.command_timeout_s if timeout is None else timeout
        try:
            # The connect and the channel open are bounded by connect_timeout_s; this timeout covers the command alone.
            chan = transport(self._connected()).open_session(timeout=self.options.connect_timeout_s)
            deadline = Deadline(timeout)
            started = time.monotonic()
            chan.exec_command(command)
            if stdin is not None:
                chan.sendall(stdin)
            chan.shutdown_write()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise HostError(f"{self._where()}: SSH session failed: {exc or type(exc).__name__}") from None
        out, err = bytearray(), bytearray()
        with chan:
            while True:
                while chan.recv_ready():
                    out += chan.recv(65536)
                while chan.recv_stderr_ready():
                    err += chan.recv_stderr(65536)
                # Done at end of output, not at the exit status: sshd may send the status before
                # the last of stdout (an inspect that lost its last line read a live process as gone).
                if chan.eof_received and not chan.recv_ready() and not chan.recv_stderr_ready():
                    break
                if deadline.expired():
                    raise HostError(f"{self._where()}: command timed out after {timeout:.0f} s: {command[:80]}")
                # Quick commands answer within milliseconds; long ones (pip) need no tight polling.
                chan.status_event.wait(0.005 if time.monotonic() - started < 0.5 else 0.05)
            code = chan.recv_exit_status()
        return CommandResult(self.name, command, code, out.decode(errors="replace"),
                             err.decode(errors="replace"), time.monotonic() - started)

    def stream(self, command: str, stdout: BinaryIO, stderr: BinaryIO) -> int:
        try:
            chan = transport(self._connected()).open_session(timeout=self.options.connect_timeout_s)
            chan.exec_command(command)
            chan.shutdown_write()
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise HostError(f"{self._where()}: SSH session failed: {exc or type(exc).__name__}") from None
        with chan:
            while True:
                got = False
                while chan.recv_ready():
                    stdout.write(chan.recv(65536))
                    got = True
                while chan.recv_stderr_ready():
                    stderr.write(chan.recv_stderr(65536))
                    got = True
                if got:
                    stdout.flush()
                    stderr.flush()
                elif chan.eof_received or chan.closed:  # end of output, as in run()
                    break
                else:
                    time.sleep(0.01)
            code = chan.recv_exit_status()
        return 255 if code < 0 else code

    # -- files ------------------------------------------------------------------------------

    def _makedirs(self, directory: str) -> None:
        sftp = self._sftp_client()
        missing = []
        while directory not in ("", "/"):
            try:
                sftp.stat(directory)
                break
            except FileNotFoundError:
                missing.append(directory)
                directory = posixpath.dirname(directory)
        for d in reversed(missing):
            try:
                sftp.mkdir(d)
            except OSError:
                sftp.stat(d)  # created meanwhile by someone else is fine; anything else raises

    def read_file(self, path: str) -> bytes | None:
        with self._lock:
            try:
                with self._sftp_client().open(self.expand(path), "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        target = self.expand(path)
        tmp = f"{target}.{uuid.uuid4().hex}.tmp"
        with self._lock:
            sftp = self._sftp_client()
            self._makedirs(posixpath.dirname(target))
            with sftp.open(tmp, "wxb") as f:  # exclusive: never through a file or link someone put there
                f.write(data)
            sftp.chmod(tmp, mode)
            sftp.posix_rename(tmp, target)

    def upload(self, local_path: str, remote_path: str) -> None:
        target = self.expand(remote_path)
        tmp = f"{target}.{uuid.uuid4().hex[:8]}.part"
        with self._lock:
            sftp = self._sftp_client()
            self._makedirs(posixpath.dirname(target))
            sftp.put(local_path, tmp)
            sftp.posix_rename(tmp, target)

    # -- processes and HTTP -----------------------------------------------------------------

    def inspect(self, pids: list[int]) -> dict[int, ProcessInfo]:
        result = self.run(proc_table_command(pids), timeout=30).check("reading the process table")
        return parse_proc_table(pids, result.stdout)

    def signal_groups(self, pgids: list[int], signal_name: str) -> None:
        self.run(signal_groups_command(pgids, signal_name), timeout=30)

    def follow(self, command: str, on_line, stop) -> None:
        chan = transport(self._connected()).open_session(timeout=self.options.connect_timeout_s)
        chan.set_combine_stderr(True)
        chan.exec_command(command)
        buffer = b""
        with chan:
            chan.settimeout(0.2)
            while not stop.is_set():
                try:
                    chunk = chan.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    on_line(line.decode(errors="replace"))

    def channel_to(
        self, host: str, port: int, timeout: float, origin: tuple[str, int] = ("127.0.0.1", 0)
    ) -> paramiko.Channel:
        """A TCP connection the host makes to host:port, as a channel of this connection (ssh -L, -W)."""
        try:
            return transport(self._connected()).open_channel("direct-tcpip", (host, port), origin, timeout=timeout)
        except paramiko.ChannelException as exc:
            raise ConnectionRefusedError(f"{host}:{port} refused through {self.name}: {exc}") from None

    def http(self, method: str, url: str, body: bytes | None = None, timeout: float = 5.0,
             headers: dict[str, str] | None = None) -> HttpResponse:
        host, port, path = split_url(url)
        with self.channel_to(host, port, timeout) as chan:
            chan.settimeout(timeout)
            return exchange(chan, host, port, method, path, body, headers)
