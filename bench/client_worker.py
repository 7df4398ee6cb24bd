"""One warm process that runs vLLM's `vllm bench serve` entry point once per job.

Importing vLLM's benchmark client costs 15-50 s of CPU on a loaded 2-core machine; a bench runs it
16 times. This process imports it once and then, for each JSON line on stdin
(`{"argv": ["vllm", "bench", "serve", ...], "log": PATH, "env": {NAME: VALUE or null}}`), runs
vLLM's own CLI `main()` with that argv and environment (null: unset; the router's API key travels
this way, never in an argv), its stdout and stderr going to PATH, and answers one JSON line
(`{"rc": N}`) on its original stdout. It prints `{"ready": true}` once the import is done. A job whose argv starts with
`kvpush-conversations` runs the multi-turn client (conversation_client.py) instead. Run as
`python -m kvpush.bench.client_worker`.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Callable, TextIO

READY = {"ready": True}


def run_job(
    entry: Callable[[], object], argv: list[str], log_path: str, env: dict[str, str | None] | None = None
) -> int:
    """Run `entry` as if started with `argv` and `env` set, fds 1 and 2 sent to log_path; its exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    previous = sys.argv, sys.stdout, sys.stderr
    previous_env = {name: os.environ.get(name) for name in env or {}}
    _set_env(env or {})
    try:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        sys.argv = list(argv)
        # Streams replaced by a host (pytest) would bypass fds 1 and 2.
        sys.stdout = open(1, "w", closefd=False)
        sys.stderr = open(2, "w", closefd=False)
        try:
            entry()
            return 0
        except SystemExit as exc:  # argparse errors, sys.exit() inside the client
            code = exc.code
            if code is None:
                return 0
            if not isinstance(code, int):
                print(code)
                return 1
            return code
        except Exception:
            traceback.print_exc()
            return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.argv, sys.stdout, sys.stderr = previous
        _set_env(previous_env)
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, log_fd):
            os.close(fd)


def _set_env(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def serve(entry: Callable[[], object], jobs: TextIO, answers: TextIO,
          others: dict[str, Callable[[], object]] | None = None) -> None:
    """Answer each job line until stdin closes; a job whose argv[0] names one of `others` runs that."""
    answers.write(json.dumps(READY) + "\n")
    answers.flush()
    for line in jobs:
        if not line.strip():
            continue
        job = json.loads(line)
        runs = (others or {}).get(job["argv"][0] if job["argv"] else "", entry)
        rc = run_job(runs, job["argv"], job["log"], job.get("env"))
        answers.write(json.dumps({"rc": rc}) + "\n")
        answers.flush()


def _vllm_entry() -> Callable[[], object]:
    # What `vllm bench serve` imports on its first run, done before the first job's clock starts.
    import vllm.benchmarks.serve  # noqa: F401
    import vllm.entrypoints.cli.benchmark.main  # noqa: F401
    import vllm.entrypoints.cli.benchmark.serve  # noqa: F401
    from vllm.entrypoints.cli.main import main
    return main


def main() -> None:
    # Answers go on a private copy of stdout: anything vLLM prints lands in the jobs' logs.
    answers = os.fdopen(os.dup(1), "w")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    try:
        entry = _vllm_entry()
    except Exception as exc:  # reported to the bench as one line
        answers.write(
            json.dumps({"error": f"cannot import vLLM's benchmark client: {type(exc).__name__}: {exc}"}) + "\n"
        )
        answers.flush()
        raise SystemExit(1) from None
    from . import conversation_client

    serve(entry, sys.stdin, answers, {conversation_client.PROGRAM: conversation_client.main})


if __name__ == "__main__":
    main()
