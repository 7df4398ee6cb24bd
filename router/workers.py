"""Several router processes on one port: the supervisor that starts, watches and stops them.

One Python process relays every token of every stream on one core, and a request's first token
waits behind whatever that loop is doing: at 64 streams that queueing is most of what the router
adds to TTFT. With `workers: N` the supervisor binds N listening sockets to the port with
SO_REUSEPORT (the kernel spreads connections over them), hands one to each worker process, and
gives the workers one Prometheus multiprocess directory, so /metrics on any of them reports all.

Each worker is a whole router (its own pools, health probes and load scrapes): selection and
ejection are per worker. SIGHUP to the supervisor is passed on to every worker, each of which reads
the instance list again (rotation.py). A worker that ends on its own stops the router as a whole (the
supervisor stops the others and exits non-zero), so `kvpush status` shows it instead of a router
serving at part speed; a worker whose supervisor dies, even by SIGKILL, stops too.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvpush.common.errors import KvpushError

from .config import RouterConfig
from .connections import LISTEN_BACKLOG
from .metrics import PROMETHEUS_DIR_ENV, WORKERS_DIR_ENV
from .process_signals import RELOAD_SIGNAL, STOP_SIGNALS, describe_process

log = logging.getLogger("kvpush.router")

FAILURE_STOP_GRACE_S = 10.0  # after a worker failed; on a stop signal the workers drain as long as they need
_PR_SET_PDEATHSIG = 1


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets listening on host:port together. The port is first bound once without
    SO_REUSEPORT, so that a listener already there (a router left from an earlier run shares the
    option and the user) is an EADDRINUSE error rather than a silent split of the traffic."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    socket.create_server(address, family=family).close()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(socket.create_server(address, family=family, backlog=LISTEN_BACKLOG, reuse_port=True))
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
            "--worker-index", str(index), "--worker-fd", str(fd), "--supervisor-pid", str(os.getpid())]


def stop_with_supervisor(supervisor_pid: int) -> None:
    """In a worker: have the kernel send SIGTERM when the supervisor dies, and stop now if it died
    before this ran (the worker was re-parented already)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        log.warning("cannot tie this worker's life to its supervisor: %s", os.strerror(ctypes.get_errno()))
    if os.getppid() != supervisor_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def supervise(config: RouterConfig, log_level: str, run_dir_parent: Path | None = None) -> None:
    """Run `config.workers` router processes until SIGINT/SIGTERM (returns once they stopped) or
    until one of them ends on its own (raises KvpushError after stopping the rest)."""
    # The workers start with this mask too: a SIGHUP that reaches one before it serves waits for it.
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS | {signal.SIGCHLD, RELOAD_SIGNAL})
    try:
        sockets = listening_sockets(config.bind, config.port, config.workers)
    except OSError as exc:
        raise KvpushError(f"router cannot listen on {config.bind}:{config.port}: {exc.strerror or exc} "
                          f"(is the port taken, e.g. by a router left running?)") from None
    workers: list[subprocess.Popen] = []
    failure: str | None = "the supervisor failed"  # until the wait below says otherwise
    with contextlib.ExitStack() as cleanup:
        for sock in sockets:
            cleanup.callback(sock.close)
        try:
            run_dir = Path(
                cleanup.enter_context(tempfile.TemporaryDirectory(prefix=".router-workers-", dir=run_dir_parent))
            )
            config_path = run_dir / "router.json"
            config_path.write_text(config.to_file_json())
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
        except OSError as exc:
            raise KvpushError(f"router supervisor cannot start its workers: {exc}") from None
        finally:  # before the run directory goes
            _stop_all(workers, None if failure is None else FAILURE_STOP_GRACE_S)
    if failure is not None:
        raise KvpushError(f"{failure}; the other router workers were stopped; see the lines above in the router log")


def _wait_for_stop_or_exit(workers: list[subprocess.Popen]) -> str | None:
    """None on a stop signal; else which worker ended on its own, and how. SIGHUP goes on to every worker."""
    while True:
        info = signal.sigtimedwait(STOP_SIGNALS | {signal.SIGCHLD, RELOAD_SIGNAL}, 1.0)
        if info is not None and info.si_signo == RELOAD_SIGNAL:
            log.info(
                "kvpush router supervisor: SIGHUP from %s, passed on to the workers", describe_process(info.si_pid)
            )
            for worker in workers:
                if worker.poll() is None:
                    worker.send_signal(RELOAD_SIGNAL)
            continue
        if info is not None and info.si_signo in STOP_SIGNALS:
            log.info("kvpush router supervisor stopping on %s from %s", signal.Signals(info.si_signo).name,
                     describe_process(info.si_pid))
            return None
        for index, worker in enumerate(workers):
            code = worker.poll()
            if code is None:
                continue
            if signal.sigpending() & STOP_SIGNALS:  # the whole group was told to stop; this one was first
                log.info("kvpush router supervisor stopping: its process group was signalled")
                return None
            return f"router worker {index} (pid {worker.pid}) ended on its own: {describe_exit(code)}"


def _stop_all(workers: list[subprocess.Popen], grace_s: float | None) -> None:
    """Stop every worker still running, waiting `grace_s` for them (None: as long as their streams
    need; `kvpush down` escalates to SIGKILL on its own timeout) before killing them."""
    for worker in workers:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
    deadline = None if grace_s is None else time.monotonic() + grace_s
    for worker in workers:
        try:
            worker.wait(timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("router worker pid %d did not stop within %g s; killing it", worker.pid, grace_s)
            worker.kill()
            worker.wait()
