"""Runner over SSH (paramiko): one connection per host, reused for every call within a command."""
from __future__ import annotations

import base64
import hashlib
import logging
import os
import posixpath
import socket
import threading
import time
import uuid
from pathlib import Path

import paramiko

from .base import (CommandResult, Deadline, HostError, HttpResponse, ProcessInfo, Runner,
                   parse_proc_table, proc_table_command, signal_groups_command)
from .http import exchange, split_url
from .options import SshOptions

ACCEPT_HINT = "--accept-new-host-keys"
_known_hosts_write = threading.Lock()
# paramiko logs refused forwarding channels itself; callers get the same facts as exceptions.
logging.getLogger("paramiko.transport").setLevel(logging.CRITICAL)


def known_hosts_name(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


class _UnknownHostKey(Exception):
    pass


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown key: refuse, or record it when the user asked for trust on first use.

    A key that differs from the recorded one never reaches this policy: paramiko raises
    BadHostKeyException for it, and that is always refused.
    """

    def __init__(self, known_hosts: Path, accept_new: bool):
        self.known_hosts, self.accept_new = known_hosts, accept_new

    def missing_host_key(self, client, hostname, key):
        if not self.accept_new:
            digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
            raise _UnknownHostKey(f"{key.get_name()} SHA256:{digest}")
        with _known_hosts_write:
            self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
            with self.known_hosts.open("a") as f:
                f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


class SshRunner(Runner):
    def __init__(self, name: str, address: str, port: int = 22, user: str | None = None,
                 key: str | None = None, options: SshOptions = SshOptions()):
        self.name, self.address, self.port, self.user, self.key = name, address, port, user, key
        self.options = options
        self._client: paramiko.SSHClient | None = None
        self._sftp: paramiko.SFTPClient | None = None
        self._home: str | None = None
        self._lock = threading.RLock()

    # -- connection -------------------------------------------------------------------------

    def _where(self) -> str:
        return f"host {self.name} ({self.user + '@' if self.user else ''}{self.address}:{self.port})"

    def connect(self) -> paramiko.SSHClient:
        with self._lock:
            if self._client is not None and self._client.get_transport() and self._client.get_transport().is_active():
                return self._client
            self._client = self._open()
            return self._client

    def _open(self) -> paramiko.SSHClient:
        opts = self.options
        known_hosts = Path(os.path.expanduser(opts.known_hosts))
        client = paramiko.SSHClient()
        if known_hosts.is_file():
            client.load_host_keys(str(known_hosts))
        client.set_missing_host_key_policy(_HostKeyPolicy(known_hosts, opts.accept_new_host_keys))
        where = self._where()
        try:
            sock = socket.create_connection((self.address, self.port), timeout=opts.connect_timeout_s)
        except ConnectionRefusedError:
            raise HostError(f"{where}: connection refused; is sshd running and listening on port {self.port}?") from None
        except (socket.timeout, OSError) as exc:
            raise HostError(f"{where}: unreachable ({exc.strerror or exc}); check the address, network and firewall") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        key_file = os.path.expanduser(self.key) if self.key else None
        try:
            client.connect(
                self.address, port=self.port, username=self.user or _local_user(), sock=sock,
                key_filename=key_file, look_for_keys=key_file is None, allow_agent=key_file is None,
                timeout=opts.connect_timeout_s, banner_timeout=opts.connect_timeout_s,
                auth_timeout=opts.auth_timeout_s,
            )
        except _UnknownHostKey as exc:
            sock.close()
            raise HostError(
                f"{where}: host key unknown ({exc}), not in {opts.known_hosts}; "
                f"verify it and rerun with {ACCEPT_HINT} to record it"
            ) from None
        except paramiko.BadHostKeyException:
            sock.close()
            raise HostError(
                f"{where}: host key CHANGED from the one in {opts.known_hosts}; refusing to connect. If the host "
                f"was legitimately reinstalled, remove its entry: ssh-keygen -f {opts.known_hosts} -R "
                f"'{known_hosts_name(self.address, self.port)}'"
            ) from None
        except paramiko.AuthenticationException:
            sock.close()
            raise HostError(f"{where}: authentication failed; check 'user' and 'key' for this host in the topology") from None
        except (paramiko.SSHException, OSError, EOFError) as exc:
            sock.close()
            raise HostError(f"{where}: SSH handshake failed: {exc or type(exc).__name__}") from None
        transport = client.get_transport()
        transport.set_keepalive(15)
        return client

    def close(self) -> None:
        with self._lock:
            if self._sftp is not None:
                self._sftp.close()
            if self._client is not None:
                self._client.close()
            self._client = self._sftp = None

    def _sftp_client(self) -> paramiko.SFTPClient:
        with self._lock:
            if self._sftp is None:
                self._sftp = self.connect().open_sftp()
            return self._sftp

    @property
    def home(self) -> str:
        if self._home is None:
            self._home = self._sftp_client().normalize(".")
        return self._home

    # -- commands ---------------------------------------------------------------------------

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None) -> CommandResult:
        timeout = self.options.command_timeout_s if timeout is None else timeout
        deadline = Deadline(timeout)
        started = time.monotonic()
        try:
            chan = self.connect().get_transport().open_session(timeout=self.options.connect_timeout_s)
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
        tmp = f"{target}.{uuid.uuid4().hex[:8]}.tmp"
        with self._lock:
            sftp = self._sftp_client()
            self._makedirs(posixpath.dirname(target))
            with sftp.open(tmp, "wb") as f:
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
        chan = self.connect().get_transport().open_session(timeout=self.options.connect_timeout_s)
        chan.set_combine_stderr(True)
        chan.exec_command(command)
        buffer = b""
        with chan:
            chan.settimeout(0.2)
            while not stop.is_set():
                try:
                    chunk = chan.recv(65536)
                except socket.timeout:
                    continue
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    on_line(line.decode(errors="replace"))

    def http(self, method: str, url: str, body: bytes | None = None, timeout: float = 5.0,
             headers: dict[str, str] | None = None) -> HttpResponse:
        host, port, path = split_url(url)
        try:
            chan = self.connect().get_transport().open_channel(
                "direct-tcpip", (host, port), ("127.0.0.1", 0), timeout=timeout)
        except paramiko.ChannelException as exc:
            raise ConnectionRefusedError(f"{host}:{port} refused through {self.name}: {exc}") from None
        with chan:
            chan.settimeout(timeout)
            return exchange(chan, host, port, method, path, body, headers)


def _local_user() -> str:
    import getpass

    return getpass.getuser()


