"""Open an authenticated paramiko connection to an SshTarget: directly, through a ProxyCommand,
or hop by hop through ProxyJump hosts, checking host keys as OpenSSH does.

Host keys: every UserKnownHostsFile and GlobalKnownHostsFile is read. A key that differs from the
recorded one is always refused (kvpush sends secrets to its hosts; OpenSSH's
`StrictHostKeyChecking no` would let it through with some features off). An unknown key is
refused under `yes` and `ask` (kvpush never prompts) and recorded in the first UserKnownHostsFile
under `accept-new` and `no`, hashed where HashKnownHosts says so.
"""
from __future__ import annotations

import base64
import hashlib
import os
import select
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import paramiko

from .base import HostError
from .options import SshOptions
from .ssh_config import SshTarget, config_label

ACCEPT_HINT = "--accept-new-host-keys"
RECORDING_POLICIES = ("accept-new", "no")
_known_hosts_write = threading.Lock()


class _UnknownHostKey(Exception):
    pass


def _fingerprint(key: paramiko.PKey) -> str:
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    return f"{key.get_name()} SHA256:{digest}"


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Unknown key: refuse, or record it where the policy says to (trust on first use)."""

    def __init__(self, target: SshTarget, record: bool):
        self.target, self.record = target, record

    def missing_host_key(self, client, hostname, key):
        if not self.record:
            raise _UnknownHostKey(_fingerprint(key))
        path = Path(os.path.expanduser(self.target.known_hosts[0]))
        name = paramiko.HostKeys.hash_host(hostname) if self.target.hash_known_hosts else hostname
        with _known_hosts_write:
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(f"{name} {key.get_name()} {key.get_base64()}\n")
        client.get_host_keys().add(hostname, key.get_name(), key)


class ShellProxy(paramiko.ProxyCommand):
    """A ProxyCommand run as OpenSSH runs it: `exec COMMAND` through the user's shell ($SHELL, else
    /bin/sh), its stdin and stdout the connection; its stderr is kept for the error message."""

    def __init__(self, command: str):
        self.cmd = [os.environ.get("SHELL") or "/bin/sh", "-c", f"exec {command}"]
        self._stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                        bufsize=0, start_new_session=True)
        self.timeout = None
        self._last_words = ""

    def said(self) -> str:
        """How the command ended, and the last line it wrote on stderr; "" while it runs."""
        try:
            self.process.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            return ""
        lines = self._stderr_lines()
        return f"; ProxyCommand exited {self.process.returncode}" + (f" saying: {lines[-1]}" if lines else "")

    def _stderr_lines(self) -> list[str]:
        if not self._stderr.closed:
            self._stderr.seek(0)
            self._last_words = self._stderr.read().decode(errors="replace")
        return [ln.strip() for ln in self._last_words.splitlines() if ln.strip()]

    def close(self):
        if self.process.poll() is None:
            self.process.terminate()
        for stream in (self.process.stdin, self.process.stdout):
            stream.close()
        self.process.wait()
        self._stderr_lines()  # kept for said(): paramiko closes a failed connection's socket first
        self._stderr.close()

    def recv(self, size):
        """As paramiko's, but the command's end of output is the end of the connection (b""), where
        paramiko's would read the closed pipe again until its timeout."""
        end = None if self.timeout is None else time.monotonic() + self.timeout
        while True:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError()
            ready, _, _ = select.select([self.process.stdout], [], [], left)
            if ready:
                try:
                    return os.read(self.process.stdout.fileno(), size)
                except OSError as exc:
                    raise paramiko.ProxyCommandFailure(" ".join(self.cmd), exc.strerror) from None


def transport(client: paramiko.SSHClient) -> paramiko.Transport:
    """The client's open connection; paramiko drops it when the client is closed (by another thread, too)."""
    current = client.get_transport()
    if current is None:
        raise paramiko.SSHException("the SSH connection was closed")
    return current


def open_chain(target: SshTarget, options: SshOptions, where: str) -> list[paramiko.SSHClient]:
    """Authenticated clients: each jump host's, first hop first, then the target's (last).
    On failure every client opened so far is closed and a HostError names the hop that failed."""
    clients: list[paramiko.SSHClient] = []
    sock = None
    try:
        for hop, after in zip(target.jumps, [*target.jumps[1:], target]):
            hop_where = f"{where}: jump host {hop.name} ({hop.user}@{hop.hostname}:{hop.port})"
            clients.append(handshake(hop, options, sock, hop_where))
            try:
                sock = transport(clients[-1]).open_channel(
                    "direct-tcpip", (after.hostname, after.port), ("127.0.0.1", 0), timeout=options.connect_timeout_s)
            except (paramiko.SSHException, OSError, EOFError) as exc:
                raise HostError(f"{where}: jump host {hop.name} could not connect to {after.hostname}:{after.port} "
                                f"({exc or type(exc).__name__}); check that it reaches the host and allows TCP "
                                "forwarding") from None
        clients.append(handshake(target, options, sock, where))
        return clients
    except BaseException:
        for client in reversed(clients):
            client.close()
        raise


def _socket(target: SshTarget, options: SshOptions, where: str):
    if target.proxy_command:
        try:
            return ShellProxy(target.proxy_command)
        except OSError as exc:
            raise HostError(
                f"{where}: ProxyCommand could not start ({exc}); fix it in {config_label(options)}"
            ) from None
    try:
        sock = socket.create_connection((target.hostname, target.port), timeout=options.connect_timeout_s)
    except ConnectionRefusedError:
        raise HostError(f"{where}: connection refused; is sshd running and listening on port {target.port}?") from None
    except (TimeoutError, OSError) as exc:
        raise HostError(f"{where}: unreachable ({getattr(exc, 'strerror', None) or exc}); check the address, "
                        "network and firewall") from None
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _load_known_hosts(client: paramiko.SSHClient, target: SshTarget, where: str) -> None:
    for files, load in ((target.global_known_hosts, client.load_system_host_keys),
                        (target.known_hosts, client.load_host_keys)):
        for name in files:
            path = Path(os.path.expanduser(name))
            if path.is_file():
                try:
                    load(str(path))
                except (OSError, paramiko.SSHException) as exc:
                    raise HostError(f"{where}: cannot read known hosts file {path} ({exc}); fix or remove it") from None


def handshake(target: SshTarget, options: SshOptions, sock, where: str) -> paramiko.SSHClient:
    """An authenticated client for `target`, over `sock` (a hop's channel) or its own connection."""
    client = paramiko.SSHClient()
    _load_known_hosts(client, target, where)
    policy = "accept-new" if options.accept_new_host_keys else target.strict_host_key_checking
    client.set_missing_host_key_policy(_HostKeyPolicy(target, policy in RECORDING_POLICIES))
    sock = sock if sock is not None else _socket(target, options, where)
    # paramiko looks the key up under `hostname` ([hostname]:port off port 22); a HostKeyAlias is
    # looked up alone, as OpenSSH does. The port is used for nothing else: the socket is open.
    lookup_name, lookup_port = (target.host_key_alias, 22) if target.host_key_alias else (target.hostname, target.port)
    known = " ".join(target.known_hosts)
    try:
        client.connect(
            lookup_name, port=lookup_port, username=target.user, sock=sock,
            # paramiko takes a list of key files (its own docs); its type stub says one str
            key_filename=list(target.key_files) or None,  # type: ignore[arg-type]
            look_for_keys=not target.key_files,
            allow_agent=target.agent, timeout=options.connect_timeout_s, banner_timeout=options.connect_timeout_s,
            auth_timeout=options.auth_timeout_s,
        )
    except _UnknownHostKey as exc:
        sock.close()
        raise HostError(f"{where}: host key unknown ({exc}), not in {known}; verify it and rerun with {ACCEPT_HINT} "
                        "to record it") from None
    except paramiko.BadHostKeyException as exc:
        sock.close()
        raise HostError(
            f"{where}: host key CHANGED ({_fingerprint(exc.key)}) from the one in {known}; refusing to connect. If the "
            f"host was legitimately reinstalled, remove its entry: ssh-keygen -f {target.known_hosts[0]} -R "
            f"'{target.known_hosts_name}'") from None
    except paramiko.AuthenticationException:
        sock.close()
        raise HostError(f"{where}: authentication failed; check 'user' and 'key' for this host in the topology "
                        f"or {config_label(options)}") from None
    except (paramiko.SSHException, OSError, EOFError) as exc:
        said = sock.said() if isinstance(sock, ShellProxy) else ""
        sock.close()
        raise HostError(f"{where}: SSH handshake failed: {exc or type(exc).__name__}{said}") from None
    transport(client).set_keepalive(15)
    return client

