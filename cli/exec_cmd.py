"""`kvpush exec HOST|PROCESS -- CMD`: run a command on a deployment's host, as `kubectl exec` or `ray exec`."""
from __future__ import annotations

import codecs
import sys
from pathlib import Path

import typer

from kvpush.common.errors import UsageError
from kvpush.deploy.lifecycle.hosts_exec import exec_target, run_on
from kvpush.deploy.lifecycle.state import load_state
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import NAME_PATTERN, resolve_topology

from .options import ACCEPT, CONNECT_TIMEOUT, DEPLOYMENT, FILE_OPTION, KNOWN_HOSTS, examples, ssh_options


def register(app: typer.Typer) -> None:
    @app.command("exec", epilog=examples(
        ("kvpush exec --file my.yaml gpu-1 -- nvidia-smi -L", "a command on a host"),
        ("kvpush exec --file my.yaml decode-0 -- 'ls logs | wc -l'", "one word: a shell command line"),
        ("kvpush exec -d xpyd prefill-0 -- env", "in a process's directory, with its env")))
    def exec_command(
        target: str = typer.Argument(..., help="A host or a process of the deployment (`kvpush plan` lists them)."),
        command: list[str] | None = typer.Argument(None, help="The command, after `--`."),
        file: Path | None = FILE_OPTION,
        deployment: str | None = DEPLOYMENT,
        accept_new_host_keys: bool = ACCEPT,
        known_hosts: str | None = KNOWN_HOSTS,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        """Run a command on a host of the deployment, or on a process's host in its working directory
        with the variables its plan gives it (and KVPUSH_PROCESS), over the deployment's own way in:
        SSH, this machine, or a job step in its Slurm allocation. Output streams as it comes; the
        exit status is the command's (255 where the host gives none, as with ssh). Several words
        after `--` are passed as they are; one word is a shell command line. No terminal and no
        stdin: for an interactive shell, use ssh."""
        if deployment is not None and not NAME_PATTERN.match(deployment):
            raise UsageError(f"--deployment: '{deployment}' is not a deployment name; use the topology's name "
                             "(`kvpush ls` lists them)")
        plan = None
        if deployment is None or file is not None:
            topo = resolve_topology(file)[0]
            plan = build_plan(topo) if deployment in (None, topo.name) else None
            deployment = deployment or topo.name
        state = load_state(deployment)
        chosen = exec_target(target, deployment, state, plan)
        options = ssh_options(accept_new_host_keys, known_hosts, connect_timeout)
        code = run_on(chosen, list(command or []), options, _binary(sys.stdout), _binary(sys.stderr))
        raise typer.Exit(code)


class _TextSink:
    """Bytes into a text stream that has no binary layer (a StringIO standing in for stdout)."""

    def __init__(self, stream):
        self.stream, self.decoder = stream, codecs.getincrementaldecoder("utf-8")("replace")

    def write(self, data: bytes) -> None:
        self.stream.write(self.decoder.decode(data))

    def flush(self) -> None:
        self.stream.flush()


def _binary(stream):
    stream.flush()  # what was printed before comes first
    return getattr(stream, "buffer", None) or _TextSink(stream)
