"""A real Slurm cluster on this machine for tests: munged, slurmctld and one slurmd per node.

Debian's slurm-wlm 22.05 is built with MULTIPLE_SLURMD, so several `slurmd -N <node>` run on one
host, each node with its own loopback NodeAddr and port. Everything (munge key and socket, state,
spool, logs, pid files) lives under one directory of the test's own, and the daemons listen on
ports of their own, so the cluster touches nothing of the machine's. `scripts/setup.sh` installs
the packages; a missing one fails the test with a message saying so, never a skip.

    with SlurmCluster(tmp_path) as cluster:
        cluster.env  # SLURM_CONF for every Slurm command the test (or kvpush) runs
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = {"munged": "/usr/sbin/munged", "slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd"}
CLIENTS = ("sbatch", "srun", "salloc", "squeue", "scontrol", "scancel", "sinfo")
PARTITION = "debug"


class SlurmMissing(RuntimeError):
    pass


def require_slurm() -> None:
    missing = [path for path in DAEMONS.values() if not os.access(path, os.X_OK)]
    missing += [name for name in CLIENTS if shutil.which(name) is None]
    if missing:
        raise SlurmMissing(f"Slurm test cluster: {', '.join(missing)} not installed; run scripts/setup.sh "
                           "(it installs slurmctld, slurmd, slurm-client and munge)")


@dataclass
class SlurmNode:
    name: str
    address: str
    port: int


@dataclass
class SlurmCluster:
    root: Path
    nodes: list[SlurmNode] = field(default_factory=lambda: [SlurmNode("n1", "127.0.0.51", 26818),
                                                            SlurmNode("n2", "127.0.0.52", 26819)])
    controller_port: int = 26817
    cpus_per_node: int = 1
    processes: list[subprocess.Popen] = field(default_factory=list, repr=False)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def command(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(list(argv), env={**os.environ, **self.env}, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def _write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=kvpushtest",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={self.controller_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge' / 'munge.socket'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "ReturnToService=2",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "KillWait=5",
            "InactiveLimit=0",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
        ]
        for n in self.nodes:
            lines.append(f"NodeName={n.name} NodeHostname={host} NodeAddr={n.address} Port={n.port} "
                         f"CPUs={self.cpus_per_node} RealMemory=10000 State=UNKNOWN")
        lines.append(f"PartitionName={PARTITION} Nodes={','.join(n.name for n in self.nodes)} Default=YES "
                     "MaxTime=INFINITE State=UP OverSubscribe=YES")
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, argv: list[str], name: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self.processes.append(subprocess.Popen(argv, env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True))
        log.close()

    def start(self, timeout_s: float = 60) -> "SlurmCluster":
        require_slurm()
        self._write_config()
        m = self.root / "munge"
        self._spawn([DAEMONS["munged"], "--foreground", "--force", f"--socket={m / 'munge.socket'}",
                     f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}",
                     f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"], "munged")
        self._wait(lambda: (m / "munge.socket").exists(), 10, "munged did not create its socket")
        self._spawn([DAEMONS["slurmctld"], "-D", "-i", "-f", str(self.conf)], "slurmctld")
        for n in self.nodes:
            self._spawn([DAEMONS["slurmd"], "-D", "-N", n.name, "-f", str(self.conf)], f"slurmd-{n.name}")
        self._wait(self._all_idle, timeout_s, "the nodes did not become idle")
        return self

    def _all_idle(self) -> bool:
        for p in self.processes:
            if p.poll() is not None:
                raise RuntimeError(f"Slurm test cluster: {' '.join(p.args[:1])} exited {p.returncode}; "
                                   f"see {self.root / 'log'}")
        result = self.command("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return result.returncode == 0 and all(states.get(n.name) == "idle" for n in self.nodes)

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        end = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > end:
                tail = ""
                log = self.root / "log" / "slurmctld.log"
                if log.exists():
                    tail = " | ".join(log.read_text().splitlines()[-5:])
                raise RuntimeError(f"Slurm test cluster: {what} within {timeout_s:.0f} s; {tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Cancel every job, then stop the daemons (slurmd first, munged last)."""
        if self.processes and self.processes[1:2] and self.processes[1].poll() is None:
            self.command("scancel", "--full", "--user", "root", check=False, timeout=10)
            end = time.monotonic() + 15
            while time.monotonic() < end and self.command("squeue", "-h", check=False, timeout=10).stdout.strip():
                time.sleep(0.3)
        for p in reversed(self.processes):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in reversed(self.processes):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        self.processes.clear()

    def __enter__(self) -> "SlurmCluster":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def slurm_topology_for(cluster: SlurmCluster, name: str, python: str, workdir: Path, *, port_base: int,
                       router_node: str = "n2", connector: str = "nixl-pull", extra: dict | None = None,
                       model_path: str = "/nonexistent-model", instance_env: dict[str, dict] | None = None):
    """A `launcher: slurm` Topology on this cluster: prefill on n1, decode on n2, ports from port_base."""
    import yaml

    from kvpush.deploy.topology.topology import parse_topology

    address = {n.name: n.address for n in cluster.nodes}
    instance_env = instance_env or {}
    hosts = {n.name: {"node": n.name, "address": n.address, "python": python, "workdir": str(workdir / n.name)}
             for n in cluster.nodes}
    doc = {
        "name": name, "platform": "cpu", "launcher": "slurm",
        "slurm": {"partition": PARTITION, "time_limit": "00:30:00"},
        "model": {"path": model_path, "served_name": "tiny"},
        "connector": {"type": connector},
        "hosts": hosts,
        "prefill": [{"name": "prefill-0", "host": "n1", "http_port": port_base, "side_channel_port": port_base + 1,
                     "env": instance_env.get("prefill-0", {})}],
        "decode": [{"name": "decode-0", "host": "n2", "http_port": port_base + 2, "side_channel_port": port_base + 3,
                    "env": instance_env.get("decode-0", {})}],
        "router": {"host": router_node, "bind": address[router_node], "port": port_base + 4},
    }
    for key, value in (extra or {}).items():
        doc[key] = {**doc[key], **value} if isinstance(doc.get(key), dict) and isinstance(value, dict) else value
    return parse_topology(yaml.safe_dump(doc, sort_keys=False), f"<test topology {name}>")
