"""The scripts of benchmarks/ (not a package) in tests: imported as a module for their unit tests,
or run as a user runs them for their CPU tests."""
from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
# NIXL over UCX on CPU memory: no InfiniBand transports to probe, no memory-event hooks
NIXL_ON_CPU_ENV = {"UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN", "PYTHONUNBUFFERED": "1"}


def load_benchmark(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def run_benchmark(name: str, args: list[str], timeout_s: float) -> tuple[int, str]:
    """`python benchmarks/NAME.py ARGS` from the repository with NIXL on CPU memory: its exit code
    and its stdout and stderr together. It runs in a session of its own, so on a timeout it goes
    down with every process it started (pytest then reports the timeout)."""
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / f"{name}.py"), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=dict(os.environ, **NIXL_ON_CPU_ENV),
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, stdout


def failure_excerpt(output: str, tail_chars: int = 2000) -> str:
    """What a failed run said: every traceback it printed (the cause may be far above the end),
    then the end of its output."""
    tracebacks = re.findall(r"Traceback \(most recent call last\):\n(?:[ \t].*\n)*.*", output)
    return "\n".join([*tracebacks, "--- end of the output:", output[-tail_chars:]])
