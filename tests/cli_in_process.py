"""Run the kvpush CLI inside the test process, as `kvpush ARGS` would run: the same entry point
(kvpush.cli.main.run), its exit code, and what it wrote to stdout and stderr. A subprocess costs
the interpreter's start and kvpush's imports (about a second on a loaded 2-core machine) for
every call; the tests that are about the process itself (a pipe, the console script) still start one."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

from kvpush.cli.main import run


@contextlib.contextmanager
def _environment(cwd: str | Path | None, env: dict[str, str] | None):
    old_cwd, old_env = os.getcwd(), dict(os.environ)
    try:
        if cwd is not None:
            os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        yield
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)


def run_cli(*args: str, cwd: str | Path | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    stdout, stderr = io.StringIO(), io.StringIO()
    code = 0
    with _environment(cwd, env), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            run(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return subprocess.CompletedProcess(["kvpush", *args], code, stdout.getvalue(), stderr.getvalue())


def run_cli_process(*args: str, cwd: str | Path | None = None, env: dict[str, str] | None = None,
                    timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpush.cli.main", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=timeout)
