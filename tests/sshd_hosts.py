"""Real sshd test hosts on loopback addresses (127.0.0.2, 127.0.0.3, ...), for tests and benchmarks.

Each host: its own host key, sshd_config, PidFile and AuthorizedKeysFile (one shared test client
key), `UsePAM no`, `StrictModes no`, internal sftp. All hosts share this machine's filesystem and
users, so what one "host" writes, the others can see; tests use distinct work directories.

    with SshdCluster(3, first_address="127.0.0.2") as cluster:
        cluster.hosts[0].address, cluster.client_key, cluster.known_hosts
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml

SSHD = "/usr/sbin/sshd"


@dataclass
class SshdHost:
    name: str
    address: str
    port: int
    directory: Path
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def host_key(self) -> Path:
        return self.directory / "host_ed25519_key"

    @property
    def config(self) -> Path:
        return self.directory / "sshd_config"

    def known_hosts_line(self) -> str:
        key = (self.directory / "host_ed25519_key.pub").read_text().split()
        return f"[{self.address}]:{self.port} {key[0]} {key[1]}\n"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)], check=True)


def _wait_listening(address: str, port: int, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((address, port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > end:
                raise RuntimeError(f"sshd on {address}:{port} did not start listening within {timeout} s")
            time.sleep(0.02)


class SshdCluster:
    def __init__(self, count: int, first_address: str = "127.0.0.2", port: int = 2222, root: Path | None = None,
                 skip_shell_rc: bool = True):
        # This machine's root ~/.bashrc runs `pyenv init` (~150 ms per command). bash skips ~/.bashrc
        # for sshd sessions when SHLVL shows it is nested, so skip_shell_rc sets SHLVL=1 for sessions.
        self.skip_shell_rc = skip_shell_rc
        self.root = Path(root or tempfile.mkdtemp(prefix="kvpush-sshd-"))
        self._own_root = root is None
        first = ipaddress.ip_address(first_address)
        self.hosts = [
            SshdHost(f"h{i}", str(first + i), port, self.root / f"h{i}") for i in range(count)
        ]
        self.client_key = self.root / "client_ed25519"
        self.known_hosts = self.root / "known_hosts"
        self.authorized_keys = self.root / "authorized_keys"

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> "SshdCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def start(self) -> None:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # sshd's privilege-separation dir
        self.root.mkdir(parents=True, exist_ok=True)
        _keygen(self.client_key, "kvpush-test-client")
        shutil.copyfile(f"{self.client_key}.pub", self.authorized_keys)
        try:
            for host in self.hosts:
                host.directory.mkdir(parents=True, exist_ok=True)
                _keygen(host.host_key, host.name)
                host.config.write_text(self._config(host))
                self._spawn(host)
            for host in self.hosts:
                _wait_listening(host.address, host.port)
        except BaseException:
            self.stop_all()
            raise
        self.write_known_hosts()

    def _config(self, host: SshdHost) -> str:
        return "\n".join([
            f"ListenAddress {host.address}:{host.port}",
            f"HostKey {host.host_key}",
            f"PidFile {host.directory / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.authorized_keys}",
            "UsePAM no", "StrictModes no", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PermitRootLogin prohibit-password", "PubkeyAuthentication yes", "AllowTcpForwarding yes",
            "Subsystem sftp internal-sftp", "MaxSessions 100", "MaxStartups 200", "UseDNS no",
            "PrintMotd no", "LogLevel ERROR",
        ] + (["SetEnv SHLVL=1"] if self.skip_shell_rc else []) + [""])

    def _spawn(self, host: SshdHost) -> None:
        log = open(host.directory / "sshd.log", "ab")
        host.process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(host.config)], stdout=log, stderr=log,
                                        stdin=subprocess.DEVNULL)
        log.close()

    def write_known_hosts(self, hosts: list[SshdHost] | None = None) -> None:
        """(Re)write known_hosts with the given hosts' keys (default: all)."""
        self.known_hosts.write_text("".join(h.known_hosts_line() for h in (hosts if hosts is not None else self.hosts)))

    def stop(self, host: SshdHost) -> None:
        """Stop a host's sshd and its open sessions (processes started detached keep running)."""
        if host.process is None:
            return
        try:
            children = psutil.Process(host.process.pid).children(recursive=False)
        except psutil.NoSuchProcess:
            children = []
        host.process.terminate()
        for child in children:
            try:
                child.terminate()
            except psutil.NoSuchProcess:
                pass
        try:
            host.process.wait(5)
        except subprocess.TimeoutExpired:
            host.process.kill()
            host.process.wait()
        psutil.wait_procs(children, timeout=3)
        host.process = None

    def restart(self, host: SshdHost) -> None:
        self.stop(host)
        self._spawn(host)
        _wait_listening(host.address, host.port)

    def rekey(self, host: SshdHost) -> None:
        """Give a host a new host key (so the recorded known_hosts entry no longer matches)."""
        for suffix in ("", ".pub"):
            Path(f"{host.host_key}{suffix}").unlink(missing_ok=True)
        _keygen(host.host_key, host.name)
        self.restart(host)

    def stop_all(self) -> None:
        for host in self.hosts:
            self.stop(host)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- for topologies ---------------------------------------------------------------------

    def host_address(self, host: SshdHost):
        """How kvpush reaches `host` (root, with the test client key)."""
        from kvpush.deploy.topology.host_address import HostAddress

        return HostAddress(address=host.address, ssh_port=host.port, user="root", key=str(self.client_key))

    def host_yaml(self, host: SshdHost, **extra: str) -> dict:
        entry = {"address": host.address, "ssh_port": host.port, "user": os.environ.get("USER", "root"),
                 "key": str(self.client_key)}
        entry.update(extra)
        return entry


# -- topologies over these hosts --------------------------------------------------------------

STANDIN_SERVER = Path(__file__).with_name("standin_server.py")


def write_standin_python(path: Path, python: str | None = None) -> Path:
    """An executable "python" for a host: serves stand-in vLLM/router, else runs the real python."""
    import sys

    # --marker puts this wrapper's path on the server's command line, so tests can find orphans.
    path.write_text(f"#!/bin/sh\nexec {python or sys.executable} {STANDIN_SERVER} --marker {path} \"$@\"\n")
    path.chmod(0o755)
    return path


def topology_for(cluster: SshdCluster, name: str, python: str, workdir: Path, *, prefill: list[int],
                 decode: list[int], router: int, port_base: int, connector: str = "nixl-pull",
                 model_path: str = "/nonexistent-model", instance_env: dict[str, dict] | None = None,
                 instance_extra: dict[str, dict] | None = None, extra: dict | None = None):
    """A Topology whose hosts are this cluster's hosts (by index), with ports from port_base up.

    Every host gets its own workdir under `workdir` because all test hosts share one filesystem.
    """
    from kvpush.deploy.topology.topology import parse_topology

    used = sorted(set(prefill) | set(decode) | {router})
    hosts = {f"h{i}": {**cluster.host_yaml(cluster.hosts[i]), "python": python, "workdir": str(workdir / f"h{i}")} for i in used}
    port = iter(range(port_base, port_base + 1000))
    instance_env = instance_env or {}

    def instance(role: str, index: int, host: int) -> dict:
        name_ = f"{role}-{index}"
        return {"name": name_, "host": f"h{host}", "http_port": next(port), "side_channel_port": next(port),
                "env": instance_env.get(name_, {}), **(instance_extra or {}).get(name_, {})}

    doc = {
        "name": name, "platform": "cpu",
        "model": {"path": model_path, "served_name": "tiny"},
        "connector": {"type": connector},
        "hosts": hosts,
        "prefill": [instance("prefill", i, h) for i, h in enumerate(prefill)],
        "decode": [instance("decode", i, h) for i, h in enumerate(decode)],
        "router": {"host": f"h{router}", "bind": cluster.hosts[router].address, "port": next(port)},
    }
    for key, value in (extra or {}).items():
        doc[key] = {**doc[key], **value} if isinstance(doc.get(key), dict) and isinstance(value, dict) else value
    return parse_topology(yaml.safe_dump(doc, sort_keys=False), f"<test topology {name}>")
