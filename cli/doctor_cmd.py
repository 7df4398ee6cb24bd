"""`kvpush doctor`: run the checks on every host of a topology and render them."""
from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import typer

from kvpush.common.errors import KvpushError
from kvpush.deploy.doctor import CHECK_NAMES, DoctorOptions, run_doctor
from kvpush.deploy.lifecycle.hosts import connected
from kvpush.deploy.lifecycle.process_view import deployment_pids
from kvpush.deploy.lifecycle.state import HostRecord, load_state
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import check_key_files, resolve_topology

from .console import note, print_json
from .doctor_report import render_report
from .options import ACCEPT, CONNECT_TIMEOUT, FILE_ARG, FILE_OPTION, KNOWN_HOSTS, examples, ssh_options, topology_file


def _names(value: str | None) -> frozenset[str]:
    return frozenset(n.strip() for n in (value or "").split(",") if n.strip())


def _deployment_pids(deployment: str, runners) -> dict[str, dict[int, str]]:
    """The processes of this deployment where it is up already: the ports they hold are its own.
    Nothing when it is not up, or when its processes cannot be looked at (then they count as foreign)."""
    try:
        state = load_state(deployment)
        return deployment_pids(runners, state) if state is not None and state.processes else {}
    except KvpushError:
        return {}


def register(app: typer.Typer) -> None:
    @app.command("doctor", epilog=examples(('kvpush doctor my.yaml', 'every check on every host'),
                      ('kvpush doctor my.yaml --transfer', 'also move real bytes between hosts'),
                      ('kvpush doctor my.yaml --only ports-free,reachability', 'some checks only'),
                      ('kvpush doctor my.yaml --json', 'for scripts')))
    def doctor_command(
        file: Path | None = FILE_ARG,
        file_option: Path | None = FILE_OPTION,
        json_output: bool = typer.Option(False, "--json", help="Print the results as one JSON document."),
        only: str | None = typer.Option(
            None, "--only", help=f"Run only these checks (comma-separated): {', '.join(CHECK_NAMES)}."
        ),
        skip: str | None = typer.Option(None, "--skip", help="Skip these checks (comma-separated)."),
        transfer: bool = typer.Option(
            False, "--transfer", help="Also move real bytes: one NIXL WRITE per prefill/decode host pair."
        ),
        timeout: float = typer.Option(
            20.0, "--timeout", min=1.0, help="Seconds one host's probe may take before it is reported as failed."
        ),
        accept_new_host_keys: bool = ACCEPT,
        known_hosts: str = KNOWN_HOSTS,
        connect_timeout: float = CONNECT_TIMEOUT,
        verbose: bool = typer.Option(False, "--verbose", "-v", help="Show the evidence of passing checks too."),
    ) -> None:
        """Check every host of the topology before launching: software, model, GPUs, fabric, NIXL, limits, ports."""
        file = topology_file(file, file_option)
        topo, source = resolve_topology(file)
        check_key_files(topo)
        options = DoctorOptions(only=_names(only), skip=_names(skip), transfer=transfer, timeout_s=timeout)
        ssh = ssh_options(accept_new_host_keys, known_hosts, connect_timeout)
        started = time.monotonic()  # the whole check, connecting to the hosts included
        with ExitStack() as stack:
            if topo.launcher == "slurm":  # the checks run as one job step per node of an allocation
                from kvpush.deploy.lifecycle.lifecycle import Events
                from kvpush.deploy.lifecycle.slurm_allocation import allocation_for_checks

                topo = stack.enter_context(allocation_for_checks(topo, Events()))
            hosts = {h.name: HostRecord.from_plan(h) for h in build_plan(topo).hosts}
            if not json_output:
                note(f"topology: {source}; probing {len(hosts)} host(s)")
            runners, unreachable = stack.enter_context(connected(hosts, ssh))
            options = replace(options, own_pids=_deployment_pids(topo.name, runners))
            report = run_doctor(topo, runners, options, unreachable)
        report = replace(report, seconds=time.monotonic() - started)
        if json_output:
            print_json(report.to_dict())
        else:
            render_report(report, verbose)
        if report.failed:
            raise typer.Exit(1)
