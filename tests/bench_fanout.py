"""SSH fan-out benchmark: 32 real sshd hosts on loopback; prints numbers against the targets below.

    python tests/bench_fanout.py [--hosts 32] [--first-address 127.0.0.2] [--port 2222] [--with-shell-rc]

Measures, each from fresh SSH connections:
  - starting one stand-in process per host (connect + detached start), target < 3 s;
  - `up` of a stand-in deployment with one process per host (start + readiness + proof request);
  - `status` over all hosts (connect, process table, /health and /metrics per process), target < 2 s,
    in-process and as a `kvpush status --json` command;
  - `down` (TERM, wait, verify).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from kvpush.deploy.lifecycle.hosts import connected  # noqa: E402
from kvpush.deploy.lifecycle.lifecycle import LifecycleOptions, down, up  # noqa: E402
from kvpush.deploy.lifecycle.observe import deployment_status, require_state  # noqa: E402
from kvpush.deploy.runners import SshOptions, fan_out, values_or_raise  # noqa: E402
from kvpush.deploy.lifecycle.state import HostRecord  # noqa: E402
from lifecycle_helpers import kill_leftovers  # noqa: E402
from sshd_hosts import SshdCluster, topology_for, write_standin_python  # noqa: E402


def timed(label: str, fn, target: float | None = None):
    started = time.monotonic()
    value = fn()
    elapsed = time.monotonic() - started
    verdict = "" if target is None else (f"  (target < {target:g} s: {'met' if elapsed < target else 'MISSED'})")
    print(f"{label:<58} {elapsed:6.2f} s{verdict}", flush=True)
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=32)
    parser.add_argument("--first-address", default="127.0.0.2")
    parser.add_argument("--port", type=int, default=2222)
    parser.add_argument("--port-base", type=int, default=19400, help="first HTTP port for stand-in processes")
    parser.add_argument("--with-shell-rc", action="store_true",
                        help="let sessions run root's ~/.bashrc (here: `pyenv init`, ~150 ms per command)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvpush-bench-"))
    os.environ["KVPUSH_STATE_DIR"] = str(work / "state")
    n = args.hosts
    with SshdCluster(n, first_address=args.first_address, port=args.port, root=work / "sshd",
                     skip_shell_rc=not args.with_shell_rc) as cluster:
        print(f"{n} sshd hosts {cluster.hosts[0].address}..{cluster.hosts[-1].address}:{args.port}; "
              f"{os.cpu_count()} CPU cores; shell rc {'on' if args.with_shell_rc else 'skipped'}", flush=True)
        ssh = SshOptions(known_hosts=str(cluster.known_hosts))
        python = str(write_standin_python(work / "standin-python"))
        records = {h.name: HostRecord(**cluster.host_address(h).address_fields(), workdir=str(work / h.name))
                   for h in cluster.hosts}
        try:
            def start_everywhere():
                with connected(records, ssh) as (runners, unreachable):
                    assert not unreachable, unreachable
                    return values_or_raise(fan_out(list(runners), lambda name: runners[name].start_detached(
                        [python, "-m", "vllm.entrypoints.openai.api_server", "--host", records[name].address,
                         "--port", str(args.port_base + 999)], {}, str(work / name),
                        str(work / name / "sleep.log"))))

            started = timed(f"start a stand-in process on {n} hosts (fresh connections)", start_everywhere, 3.0)

            def stop_them():
                with connected(records, ssh) as (runners, _):
                    values_or_raise(fan_out(list(runners), lambda name: runners[name].signal_groups([started[name].pgid], "KILL")))

            timed(f"kill them ({n} hosts)", stop_them)

            half = (n - 1) // 2
            topo = topology_for(cluster, "bench", python, work, prefill=list(range(half)),
                                decode=list(range(half, n - 1)), router=n - 1, port_base=args.port_base)
            options = LifecycleOptions(ssh=ssh, provision=False, doctor=False, ready_timeout_s=60, stop_timeout_s=10)
            result = timed(f"up: {n} stand-in processes on {n} hosts, ready + proof", lambda: up(topo, options))
            print(f"{'  slowest process ready after':<58} {max(result.ready_s.values()):6.2f} s", flush=True)
            for attempt in (1, 2, 3):
                rows = timed(f"status over {n} hosts (in-process) #{attempt}",
                             lambda: deployment_status(require_state("bench"), ssh), 2.0)
            assert all(r.healthy for r in rows), [r for r in rows if not r.healthy]
            env = {**os.environ, "KVPUSH_KNOWN_HOSTS": str(cluster.known_hosts)}
            timed(f"`kvpush status --json` over {n} hosts (new process)", lambda: subprocess.run(
                ["kvpush", "status", "-d", "bench", "--json"], env=env, check=True, capture_output=True), 2.0)
            timed(f"up again, unchanged ({n} hosts)", lambda: up(topo, options))
            timed(f"down ({n} processes on {n} hosts)", lambda: down("bench", options))
        finally:
            left = kill_leftovers(python)
            if left:
                print(f"killed {len(left)} leftover processes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
