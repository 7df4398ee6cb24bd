"""`python -m kvpush.router --config FILE`: runs on remote hosts, so argparse and light imports only."""
from __future__ import annotations

import argparse
import faulthandler
import logging
import signal
import sys


def run_router(config_path: str, worker_fd: int | None = None) -> int:
    """Load the config and serve until SIGINT/SIGTERM; user errors become one line and an exit code.
    A worker (`worker_fd`: the listening socket its supervisor handed over) serves on that socket."""
    import socket
    from pathlib import Path

    from pydantic import ValidationError

    from kvpush.common.errors import KvpushError, validation_problem

    from .app import run
    from .config import RouterConfig
    from .keys import resolve_keys

    try:
        config = RouterConfig.from_file(config_path)
        listen_socket = socket.socket(fileno=worker_fd) if worker_fd is not None else None
        run(config, resolve_keys(config), listen_socket, run_dir_parent=Path(config_path).parent)
    except KvpushError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ValidationError as exc:
        print(f"error: router config {config_path}: {validation_problem(exc)}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"error: router config {config_path}: {exc.strerror}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: router cannot listen: {exc} (is the port taken?)", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpush.router", description="kvpush's push-aware P/D router")
    parser.add_argument("--config", required=True, help="router config JSON written by `kvpush plan`/`up`")
    parser.add_argument("--log-level", default="INFO", help="Python logging level (default INFO)")
    parser.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)  # set by the supervisor (workers.py)
    parser.add_argument("--worker-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--supervisor-pid", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # A reload request (SIGHUP) that comes while the router starts waits until it serves: by default
    # the signal would end the process.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    faulthandler.enable()  # a crash in native code (uvloop, NIXL-free but C-heavy) leaves a trace in the log
    who = "" if args.worker_index is None else f"[worker {args.worker_index}]"
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s %(levelname)s %(name)s{who}: %(message)s")
    if args.worker_fd is not None:
        from .workers import stop_with_supervisor

        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})  # inherited from the supervisor's mask
        stop_with_supervisor(args.supervisor_pid)
    return run_router(args.config, args.worker_fd)


if __name__ == "__main__":
    sys.exit(main())
