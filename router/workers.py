"""Several router processes on one port: the supervisor that starts, watches and stops them.

One Python process relays every token of every stream on one core, and a request's first token
waits behind whatever that loop is doing: at 64 streams that queueing is most of what the router
adds to TTFT. With `workers: N` the supervisor binds N listening sockets to the port with
SO_REUSEPORT (the kernel spreads connections over them), hands one to each worker process, and
gives the workers one Prometheus multiprocess directory, so /metrics on any of them reports all.

Each worker is a whole router (its own pools, health probes and load scrapes): selection and
ejection are per worker. A worker that dies stops the router as a whole (the supervisor stops the
others and exits non-zero), so `kvpush status` shows it instead of a router serving at part speed.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpush.deploy.errors import KvpushError

from .config import RouterConfig
from .metrics import PROMETHEUS_DIR_ENV, WORKERS_DIR_ENV

log = logging.getLogger("kvpush.router")

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
STOP_GRACE_S = 10.0
LISTEN_BACKLOG = 1024


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets listening on host:port together. The port is first bound once without
    SO_REUSEPORT, so that a listener already there (a router left from an earlier run shares the
    option and the user) is an EADDRINUSE error rather than a silent split of the traffic."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            sock.listen(LISTEN_BACKLOG)
            sock.set_inheritable(True)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


def worker_argv(config_path: Path, index: int, fd: int, log_level: str) -> list[str]:
    return [sys.executable, "-m", "kvpush.router", "--config", str(config_path), "--log-level", log_level,
            "--worker-index", str(index), "--worker-fd", str(fd)]


def supervise(config: RouterConfig, log_level: str) -> None:
    """Run `config.workers` router processes until SIGINT/SIGTERM (returns) or until one of them
    exits on its own (raises KvpushError after stopping the rest). Binding errors raise OSError
    before anything starts."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS | {signal.SIGCHLD})
    sockets = listening_sockets(config.bind, config.port, config.workers)
    run_dir = Path(tempfile.mkdtemp(prefix="kvpush-router-"))
    workers: list[subprocess.Popen] = []
    failure: str | None = None
    try:
        config_path = run_dir / "router.json"
        config_path.write_text(config.model_dump_json())
        metrics_dir = run_dir / "metrics"
        metrics_dir.mkdir()
        env = {**os.environ, PROMETHEUS_DIR_ENV: str(metrics_dir), WORKERS_DIR_ENV: str(metrics_dir)}
        for index, sock in enumerate(sockets):
            workers.append(subprocess.Popen(worker_argv(config_path, index, sock.fileno(), log_level),
                                            env=env, pass_fds=(sock.fileno(),)))
        for sock in sockets:
            sock.close()  # the workers hold them now
        log.info("kvpush router supervisor: %d workers on http://%s:%d (pids %s)", len(workers), config.bind,
                 config.port, ", ".join(str(w.pid) for w in workers))
        failure = _wait_for_stop_or_exit(workers)
    finally:
        for sock in sockets:
            sock.close()
        _stop_all(workers)
        shutil.rmtree(run_dir, ignore_errors=True)
    if failure is not None:
        raise KvpushError(f"{failure}; the other router workers were stopped; see the lines above in the router log")


def _wait_for_stop_or_exit(workers: list[subprocess.Popen]) -> str | None:
    """None on a stop signal (or a worker that was told to stop, exiting 0); else what went wrong."""
    while True:
        info = signal.sigtimedwait(STOP_SIGNALS | {signal.SIGCHLD}, 1.0)
        if info is not None and info.si_signo in STOP_SIGNALS:
            log.info("kvpush router supervisor stopping on %s", signal.Signals(info.si_signo).name)
            return None
        for index, worker in enumerate(workers):
            code = worker.poll()
            if code == 0:  # a worker stops cleanly only when signalled, e.g. with its process group
                return None
            if code is not None:
                return f"router worker {index} (pid {worker.pid}) ended on its own: {describe_exit(code)}"


def _stop_all(workers: list[subprocess.Popen]) -> None:
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for worker in workers:
        try:
            worker.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("router worker pid %d did not stop within %g s; killing it", worker.pid, STOP_GRACE_S)
            worker.kill()
            worker.wait()
