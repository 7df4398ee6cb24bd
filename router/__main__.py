"""`python -m kvpush.router --config FILE`: runs on remote hosts, so argparse and light imports only."""
from __future__ import annotations

import argparse
import faulthandler
import logging
import sys


def run_router(config_path: str) -> int:
    """Load the config and serve until SIGINT/SIGTERM; user errors become one line and an exit code."""
    from pydantic import ValidationError

    from kvpush.deploy.errors import KvpushError

    from .app import resolve_api_key, run
    from .config import RouterConfig

    try:
        config = RouterConfig.from_file(config_path)
        run(config, resolve_api_key(config))
    except KvpushError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(file)"
        print(f"error: router config {config_path}: {where}: {first['msg']}", file=sys.stderr)
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
    args = parser.parse_args(argv)
    faulthandler.enable()  # a crash in native code (uvloop, NIXL-free but C-heavy) leaves a trace in the log
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_router(args.config)


if __name__ == "__main__":
    sys.exit(main())
