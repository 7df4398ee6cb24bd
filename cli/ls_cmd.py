"""`kvpush ls`: every deployment recorded on this machine, its hosts, its processes up or down, its router.

Also the hint `down`, `status` and `logs` give when the deployment they were pointed at has no
state here but others do: a user who forgot `-d NAME` learns what is still running.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import typer

from kvpush.common.errors import KvpushError
from kvpush.deploy.lifecycle.observe import ProcessStatus, deployment_status
from kvpush.deploy.lifecycle.secrets import observed_keys
from kvpush.deploy.lifecycle.state import DeploymentState, load_state, recorded_deployments
from kvpush.deploy.plan.router_address import client_router_url
from kvpush.deploy.runners import SshOptions, fan_out

from .console import out, print_json
from .options import CONNECT_TIMEOUT, KNOWN_HOSTS, examples, ssh_options
from .tables import print_table, table


@dataclass
class DeploymentSummary:
    deployment: str
    hosts: dict[str, str] = field(default_factory=dict)  # name -> how it is reached (user@address:port)
    router: str | None = None  # the router's URL from this machine
    recorded: list[str] = field(default_factory=list)  # process names, in plan order
    processes: list[ProcessStatus] | None = None  # None: not checked (--no-check) or not checkable (error)
    updated_at: float | None = None
    error: str | None = None

    @property
    def up(self) -> list[str]:
        return [p.name for p in self.processes or [] if p.healthy]

    @property
    def down(self) -> list[ProcessStatus]:
        return [p for p in self.processes or [] if not p.healthy]

    def to_dict(self) -> dict:
        checked = self.processes is not None
        processes = ([p.to_dict() for p in self.processes] if self.processes is not None
                     else [{"name": n} for n in self.recorded])
        return {"deployment": self.deployment, "hosts": self.hosts, "router": self.router,
                "processes": processes,
                "checked": checked, "up": len(self.up) if checked else None,
                "down": len(self.down) if checked else None, "updated_at": self.updated_at, "error": self.error}


def router_url(state: DeploymentState) -> str | None:
    """The recorded router's URL for a client on this machine (as `plan` gives it from here)."""
    router = next((p for p in state.processes.values() if p.role == "router"), None)
    if router is None:
        return None
    host = state.hosts.get(router.host)
    return router.base_url if host is None else client_router_url(host, router.base_url)


def summarize(deployment: str, ssh: SshOptions | None) -> DeploymentSummary:
    """What is recorded of one deployment and, with `ssh`, which of its processes answer now."""
    summary = DeploymentSummary(deployment)
    try:
        state = load_state(deployment)
    except KvpushError as exc:
        summary.error = str(exc)
        return summary
    if state is None:  # removed since it was listed: a `down` ran meanwhile
        summary.error = "no state recorded any more"
        return summary
    summary.hosts = {name: host.describe() if not host.is_local else host.address for name, host in state.hosts.items()}
    summary.router, summary.recorded, summary.updated_at = router_url(state), list(state.processes), state.updated_at
    if ssh is not None:
        try:
            summary.processes = (
                deployment_status(state, ssh, observed_keys(deployment, None)) if state.processes else []
            )
        except KvpushError as exc:
            summary.error = str(exc)
    return summary


def summarize_all(ssh: SshOptions | None) -> list[DeploymentSummary]:
    names = recorded_deployments()
    results = fan_out(names, lambda name: summarize(name, ssh))
    return [results[n].ok_value if results[n].ok else DeploymentSummary(n, error=results[n].error) for n in names]


def others_hint(deployment: str) -> str:
    """For a command that found no state for `deployment`: the deployments that have one."""
    others = [n for n in recorded_deployments() if n != deployment]
    if not others:
        return ""
    return f"recorded on this machine: {', '.join(others)} (choose one with -d NAME; `kvpush ls` shows them all)"


def _processes_text(summary: DeploymentSummary) -> str:
    if summary.error:
        return f"unknown: {summary.error}"
    if summary.processes is None:
        return f"{len(summary.recorded)} recorded (not checked)"
    down = summary.down
    text = f"{len(summary.up)}/{len(summary.processes)} up"
    return text + (f"; down: {', '.join(f'{p.name} ({p.process})' for p in down)}" if down else "")


def register(app: typer.Typer) -> None:
    @app.command("ls", epilog=examples(("kvpush ls", "hosts, processes up/down, router URL of each"),
                                        ("kvpush ls --json", "the same for scripts"),
                                        ("kvpush ls --no-check", "what is recorded, contacting no host")))
    def ls_command(
        json_output: bool = typer.Option(False, "--json", help="Print one JSON document."),
        no_check: bool = typer.Option(False, "--no-check", help="Only what is recorded here: contact no host."),
        known_hosts: str = KNOWN_HOSTS,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        """List every deployment recorded on this machine: its hosts, which processes are up, its router URL."""
        summaries = summarize_all(None if no_check else ssh_options(False, known_hosts, connect_timeout))
        if json_output:
            print_json({"deployments": [s.to_dict() for s in summaries]})
            return
        if not summaries:
            out.print("no deployments recorded on this machine; start one with `kvpush up`", highlight=False)
            return
        made = table("deployment", "hosts", "processes", "router")
        for s in summaries:
            made.add_row(s.deployment, ", ".join(f"{n} ({a})" if n != a else n for n, a in s.hosts.items()) or "-",
                         _processes_text(s), s.router or "-")
        print_table(made)
