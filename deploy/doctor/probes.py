"""Runs the probe scripts on hosts, in parallel, each cut off at a deadline.

Doctor needs one thing from a host: run a shell command with a timeout. `CommandRunner` is that
narrow interface; kvpush.deploy.runners' Runner satisfies it, and tests can feed recorded output.
"""
from __future__ import annotations

import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Protocol, TypeVar

from kvpush.deploy.runners.base import shell_word
from kvpush.deploy.runners.fanout import fan_out

from .facts import HostFacts, NixlProbe

T = TypeVar("T")
HERE = Path(__file__).parent


class CommandOutput(Protocol):  # read-only, as a frozen CommandResult's fields are
    @property
    def exit_code(self) -> int: ...
    @property
    def stdout(self) -> str: ...
    @property
    def stderr(self) -> str: ...


class CommandRunner(Protocol):
    def run(self, command: str, timeout: float | None = None) -> CommandOutput: ...


@dataclass(frozen=True)
class ProbeFailure:
    host: str
    message: str  # one line: what failed and where
    timed_out: bool = False


def in_parallel(
    jobs: Mapping[str, Callable[[], T]], timeout: float, shown_timeout: float | None = None
) -> dict[str, T | ProbeFailure]:
    """Every job at once, each cut off at the deadline (runners' fan_out); failures as ProbeFailure."""
    results = fan_out(list(jobs), lambda key: jobs[key](), timeout_s=timeout, shown_timeout_s=shown_timeout)
    return {key: r.ok_value if r.ok else ProbeFailure(key, r.failure, timed_out=r.timed_out)
            for key, r in results.items()}


def python_command(interpreter: str, source_file: str, args: list[str], env: Mapping[str, str] | None = None,
                   no_site: bool = False) -> str:
    """Shell text running a self-contained script with the host's interpreter (python3 if it is
    missing: the probe still reports, and the software check says the interpreter is missing)."""
    source = (HERE / source_file).read_text()
    env_words = " ".join(shlex.quote(f"{k}={v}") for k, v in sorted((env or {}).items()))
    launcher = f"env {env_words} " if env_words else ""
    return (
        f'P={shell_word(interpreter)}; command -v "$P" >/dev/null 2>&1 || '
        f'{{ echo "kvpush-doctor: interpreter $P not found, used python3" >&2; P=python3; }}; '
        f'cd / && {launcher}"$P"{" -S" if no_site else ""} -c {shlex.quote(source)} '
        f'{" ".join(shlex.quote(a) for a in args)}'
    )


def run_host_probe(host: str, runner: CommandRunner, interpreter: str, request: dict, timeout: float) -> HostFacts:
    command = python_command(interpreter, "facts_probe.py", [json.dumps(request, separators=(",", ":"))], no_site=True)
    sent = time.time()
    result = runner.run(command, timeout=timeout)
    received = time.time()
    if result.exit_code != 0 or not result.stdout.strip():
        tail = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()[-1]
        raise RuntimeError(f"host {host}: probe exited {result.exit_code}: {tail}")
    try:
        raw = json.loads(result.stdout)
    except ValueError:
        raise RuntimeError(f"host {host}: probe printed no JSON: {result.stdout.strip()[:120]!r}") from None
    raw["interpreter_note"] = next((ln for ln in result.stderr.splitlines() if ln.startswith("kvpush-doctor:")), None)
    return HostFacts(host, raw, sent, received, command="python facts_probe.py (bind, listen, connect, tools)")


def run_nixl_probe(
    runner: CommandRunner, interpreter: str, backend: str, env: Mapping[str, str], timeout: float
) -> NixlProbe:
    command = python_command(interpreter, "nixl_probe.py", [backend], env)
    shown = f"{' '.join(f'{k}={v}' for k, v in sorted(env.items()))} python nixl_probe.py {backend}".strip()
    # The probe has its own budget inside the host's; a plugin that hangs on load is killed there.
    result = runner.run(f"timeout -s KILL {max(1, int(timeout))} sh -c {shlex.quote(command)}", timeout=timeout + 2)
    report = None
    for line in reversed(result.stdout.splitlines()):
        if line.startswith("{"):
            try:
                report = json.loads(line)
                break
            except ValueError:
                pass
    stderr_tail = tuple(ln for ln in result.stderr.splitlines() if ln.strip())[-4:]
    if report is None:
        why = {
            137: f"killed after {timeout:g} s (hung while loading the plugin)",
            124: f"timed out after {timeout:g} s",
        }.get(result.exit_code, f"the process died (exit {result.exit_code}) before reporting")
        return NixlProbe(backend, False, [], [], why, shown, result.exit_code, stderr_tail)
    return NixlProbe(backend, bool(report["created"]), report.get("mem_types", []), report.get("plugins", []),
                     report.get("error"), shown, result.exit_code, stderr_tail)
