"""Time `kvpush doctor` (without --transfer) over N loopback sshd hosts (default 32).

Half the hosts run a prefill instance, half a decode instance (CPU topology, kvpush connector, a
tiny local model), the router sits on the first host. Each round builds fresh SSH runners, as the
CLI does, so connection set-up is inside the time. sshd start-up and the model are not.

    python benchmarks/doctor_hosts.py [--hosts 32] [--rounds 3] [--first-address 127.0.1.2] [--port-base 16500]

Note: all hosts are this one machine, so the NIXL backend probe runs once per distinct
machine/interpreter/env (here: once) and its answer is shared, as it would be for any hosts that
are the same machine; on N real hosts it runs N times in parallel (~0.5 s each).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from sshd_hosts import SshdCluster  # noqa: E402

from kvpush.deploy.doctor import DoctorOptions, run_doctor  # noqa: E402
from kvpush.deploy.plan.plan import build_plan  # noqa: E402
from kvpush.deploy.runners import SshOptions, SshRunner  # noqa: E402
from kvpush.deploy.lifecycle.tiny_model import make_tiny_model  # noqa: E402
from kvpush.deploy.topology.topology import TinyModelSpec, parse_topology  # noqa: E402


def topology(cluster: SshdCluster, model: Path, workdir: Path, port_base: int):
    n = len(cluster.hosts)
    hosts = {f"h{i}": {**cluster.host_yaml(h), "python": sys.executable, "workdir": str(workdir / f"h{i}")}
             for i, h in enumerate(cluster.hosts)}
    half = n // 2
    doc = {
        "name": "doctor-bench", "platform": "cpu",
        "model": {"path": str(model), "served_name": "tiny"},
        "connector": {"type": "kvpush", "backend": "UCX"},
        "hosts": hosts,
        "prefill": [{"host": f"h{i}", "http_port": port_base, "side_channel_port": port_base + 1, "kv_cache_gib": 1}
                    for i in range(half)],
        "decode": [{"host": f"h{i}", "http_port": port_base + 2, "side_channel_port": port_base + 3, "kv_cache_gib": 1}
                   for i in range(half, n)],
        "router": {"host": "h0", "bind": cluster.hosts[0].address, "port": port_base + 4},
        "env": {"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"},
    }
    return parse_topology(yaml.safe_dump(doc), "<doctor benchmark>")


def cpu_seconds(cluster: SshdCluster) -> tuple[float, float]:
    """CPU used so far by (this process, every finished SSH session): sshd reaps the session,
    which reaped the shell and the probe, so their time lands in sshd's children times."""
    own = psutil.Process().cpu_times()
    remote = 0.0
    for host in cluster.hosts:
        t = psutil.Process(host.process.pid).cpu_times()
        remote += t.children_user + t.children_system
    return own.user + own.system, remote


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--first-address", default="127.0.1.2")
    parser.add_argument("--port-base", type=int, default=16500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpush-doctor-bench-") as tmp:
        root = Path(tmp)
        model = root / "model"
        make_tiny_model(model, TinyModelSpec())
        with SshdCluster(args.hosts, first_address=args.first_address, port=2222, root=root / "sshd") as cluster:
            topo = topology(cluster, model, root / "work", args.port_base)
            times, cpus = [], []
            for round_ in range(args.rounds):
                runners = {h.name: SshRunner(h.name, h, SshOptions(known_hosts=str(cluster.known_hosts)))
                           for h in build_plan(topo).hosts}
                load = os.getloadavg()[0]
                cpu_before = cpu_seconds(cluster)
                started = time.perf_counter()
                report = run_doctor(topo, runners, DoctorOptions())
                elapsed = time.perf_counter() - started
                for r in runners.values():
                    r.close()
                time.sleep(0.5)  # let sshd reap the sessions so their CPU is counted
                cpu_after = cpu_seconds(cluster)
                here, there = cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1]
                cpu = here + there
                times.append(elapsed)
                cpus.append(cpu)
                counts = report.counts()
                print(f"round {round_ + 1}: {elapsed:.2f} s wall, {cpu:.2f} CPU-s ({here:.2f} here, {there:.2f} in sessions; load avg before {load:.1f}; "
                      f"{len(report.results)} results: {counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail, "
                      f"{counts['skip']} skip)", flush=True)
                for failure in report.failures()[:5]:
                    print(f"  fail {failure.check} {failure.subject}: {failure.summary}")
            print(f"doctor over {args.hosts} sshd hosts without --transfer: median {statistics.median(times):.2f} s, "
                  f"best {min(times):.2f} s (target < 5 s); CPU {statistics.median(cpus):.2f} s per run, i.e. >= "
                  f"{statistics.median(cpus) / (os.cpu_count() or 1):.2f} s on {os.cpu_count()} idle cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
