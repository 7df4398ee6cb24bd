"""`kvpush up | down | status | logs | provision`: thin commands over kvpush.deploy.lifecycle.lifecycle/observe."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import typer
from rich.live import Live
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvpush.common.errors import KvpushError, UsageError
from kvpush.deploy.lifecycle.lifecycle import Events, LifecycleOptions, down, up
from kvpush.deploy.lifecycle.observe import ProcessStatus, deployment_status, require_state, stream_logs
from kvpush.deploy.lifecycle.secrets import observed_keys
from kvpush.deploy.lifecycle.state import DeploymentState, load_state
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import NAME_PATTERN, check_key_files, resolve_topology

from .console import err, note, out, print_json, styled, warn
from .ls_cmd import others_hint, router_url
from .options import (
    ACCEPT,
    CONNECT_TIMEOUT,
    DEPLOYMENT,
    EXTRA_ARGUMENTS,
    FILE_ARG,
    FILE_OPTION,
    KNOWN_HOSTS,
    examples,
    one_argument,
    ssh_options,
    topology_file,
)
from .tables import fitted, print_table, table


def _deployment_name(file: Path | None, deployment: str | None) -> str:
    if deployment is None:
        return resolve_topology(file)[0].name
    if not NAME_PATTERN.match(deployment):  # it names files in the state directory
        raise UsageError(f"--deployment: '{deployment}' is not a deployment name; "
                         "use lowercase letters, digits and '-', as in the topology's name:")
    return deployment


def _recorded_state(name: str) -> DeploymentState:
    """The deployment's state; where it has none, the error also names the deployments that do."""
    try:
        return require_state(name)
    except KvpushError as exc:
        hint = others_hint(name) if load_state(name) is None else ""
        if hint:
            raise KvpushError(f"{exc}; {hint}") from None
        raise


def _status_document(name: str, rows: list[ProcessStatus], error: str | None = None, router: str | None = None) -> dict:
    document = {"deployment": name, "healthy": error is None and all(r.healthy for r in rows), "router": router,
                "processes": [r.to_dict() for r in rows]}
    return document if error is None else {**document, "error": error}


class _ProgressEvents(Events):
    def __init__(self, progress: Progress):
        self.progress, self.tasks = progress, dict[str, TaskID]()

    def note(self, message: str) -> None:
        self.progress.console.print(Text(message, style="dim"), highlight=False)

    def process(self, name: str, status: str, done: bool = False) -> None:
        if name not in self.tasks:
            self.tasks[name] = self.progress.add_task(name, total=1, status=status)
        self.progress.update(self.tasks[name], status=status, completed=1 if done else 0)

    def log_tail(self, name: str, host: str, text: str) -> None:
        self.progress.console.print(Text(f"last lines of {name}'s log on {host}:", style="bold red"))
        for line in text.splitlines():
            self.progress.console.print(f"  {name} | {line}", highlight=False)


def _status_table(rows: list[ProcessStatus]) -> Table:
    made = table(
        "process",
        "role",
        "host",
        "pid",
        "state",
        "health",
        "running",
        "waiting",
        "KV cache",
        "uptime",
        "restarts",
        right=("pid", "running", "waiting", "KV cache", "uptime", "restarts"),
    )

    def num(v: int | None) -> str:
        return "-" if v is None else f"{v:g}"

    for r in rows:
        color = "green" if r.healthy else "red"
        made.add_row(r.name, r.role, r.host, str(r.pid), Text(r.process, style=color), Text(r.health, style=color),
                      num(r.running), num(r.waiting), "-" if r.kv_usage is None else f"{r.kv_usage:.0%}",
                      "-" if r.uptime_s is None else f"{r.uptime_s:.0f} s", str(r.restarts))
    return made


def register(app: typer.Typer) -> None:
    @app.command("up", epilog=examples(('kvpush up my.yaml', 'start or update the deployment'),
                      ('kvpush up my.yaml --rotate-secret', 'new deployment secret and keys')))
    def up_command(
        file: Path | None = FILE_ARG,
        file_option: Path | None = FILE_OPTION,
        accept_new_host_keys: bool = ACCEPT,
        known_hosts: str = KNOWN_HOSTS,
        connect_timeout: float = CONNECT_TIMEOUT,
        no_provision: bool = typer.Option(
            False, "--no-provision", help="Skip checking/installing kvpush on the hosts."
        ),
        skip_doctor: bool = typer.Option(False, "--skip-doctor", help="Launch even if doctor's fast checks fail."),
        timeout: float = typer.Option(600.0, "--timeout", help="Seconds each process may take to become ready."),
        rotate_secret: bool = typer.Option(
            False,
            "--rotate-secret",
            help="Make a new deployment secret and keys; every process that reads them restarts (docs/security.md).",
        ),
    ) -> None:
        """Start the deployment (only what changed), wait until ready, and prove KV moves through the router."""
        file = topology_file(file, file_option)
        topo, source = resolve_topology(file)
        check_key_files(topo)
        note(f"topology: {source}")
        for line in build_plan(topo).warnings:
            warn(line)
        options = LifecycleOptions(ssh=ssh_options(accept_new_host_keys, known_hosts, connect_timeout),
                                   ready_timeout_s=timeout, provision=not no_provision, doctor=not skip_doctor,
                                   rotate_secret=rotate_secret)
        columns = [
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            TextColumn("{task.fields[status]}", markup=False),
            TimeElapsedColumn(),
        ]
        with Progress(*columns, console=err, transient=False) as progress:
            result = up(topo, options, _ProgressEvents(progress))
        if result.changes.nothing_to_do:
            out.print(f"{topo.name}: up and unchanged, nothing to do ({result.total_s:.1f} s)", highlight=False)
            return
        if result.ready_s:
            slowest = max(result.ready_s.values())
            out.print(
                f"{topo.name}: ready; slowest process {slowest:.1f} s, sum of all {sum(result.ready_s.values()):.1f} "
                "s, "
                f"whole `up` {result.total_s:.1f} s",
                highlight=False,
            )
        if result.proof:
            out.print(
                f"proof: router answered {result.proof.answer!r} in {result.proof.latency_s:.2f} s; decode received "
                f"{result.proof.external_kv_tokens:.0f} prompt tokens by KV transfer",
                highlight=False,
            )
        out.print(f"router: {build_plan(topo).router_url_from_here()}", highlight=False)

    @app.command("down", epilog=examples(('kvpush down my.yaml', 'stop the deployment of this topology'),
                      ('kvpush down -d xpyd', 'stop a deployment by name (see `kvpush ls`)')))
    def down_command(
        file: Path | None = FILE_ARG,
        file_option: Path | None = FILE_OPTION,
        deployment: str | None = DEPLOYMENT,
        known_hosts: str = KNOWN_HOSTS,
        connect_timeout: float = CONNECT_TIMEOUT,
        timeout: float = typer.Option(20.0, "--timeout", help="Seconds between SIGTERM and SIGKILL."),
        forget_secret: bool = typer.Option(
            False,
            "--forget-secret",
            help="Also delete the deployment secret kept on this "
            "machine (the next `up` makes a new one, and new keys).",
        ),
    ) -> None:
        """Stop every process of the deployment (TERM, then KILL), verify nothing is left, and remove
        the deployment's secret files from its hosts. The deployment secret kept on this machine
        (in the state directory, ~/.kvpush/state/<deployment>.secret) stays, so a later `up` gives the
        same keys again; --forget-secret deletes it too."""
        file = topology_file(file, file_option)
        name = _deployment_name(file, deployment)
        options = LifecycleOptions(ssh=ssh_options(False, known_hosts, connect_timeout), stop_timeout_s=timeout)
        result = down(name, options, forget_secret=forget_secret)
        for line in result.notes:
            out.print(f"{name}: {line}", highlight=False)
        if result.stopped:
            out.print(f"{name}: stopped {', '.join(result.stopped)}", highlight=False)
        elif result.complete and not result.notes:
            out.print(
                f"{name}: nothing running (no state recorded)" if not result.had_state else f"{name}: nothing running",
                highlight=False,
            )
            hint = others_hint(name) if not result.had_state else ""
            if hint:
                out.print(f"{name}: {hint}", highlight=False)
        removed = sorted(h for h, paths in result.secrets_removed.items() if paths)
        if removed:
            out.print(f"{name}: removed its secret files on {', '.join(removed)}", highlight=False)
        if result.forgot_secret:
            out.print(f"{name}: deleted the deployment secret kept on this machine", highlight=False)
        for error in result.unreachable.values():
            err.print(
                styled(
                    "[yellow]not reached:[/yellow] {}; its processes stay recorded, rerun `kvpush down` when it is "
                    "back",
                    error,
                ),
                highlight=False,
            )
        for host, why in result.secrets_left.items():
            err.print(styled("[yellow]secret files left:[/yellow] host {}: {}", host, why), highlight=False)
        if result.left_running:
            raise KvpushError(f"{name}: still running after SIGKILL: {', '.join(result.left_running)}")
        if result.unreachable:
            raise KvpushError(f"{name}: {len(result.unreachable)} host(s) not reached; the rest is stopped")
        if result.secrets_left:
            raise KvpushError(
                f"{name}: the secret files on {', '.join(sorted(result.secrets_left))} could not be removed (see above)"
            )

    @app.command("status", epilog=examples(('kvpush status my.yaml', 'one row per process'),
                      ('kvpush status -d xpyd --watch', 'refresh every 2 s'),
                      ('kvpush status my.yaml --watch | tee s.ndjson', 'one JSON line per refresh')))
    def status_command(
        file: Path | None = FILE_ARG,
        file_option: Path | None = FILE_OPTION,
        deployment: str | None = DEPLOYMENT,
        json_output: bool = typer.Option(False, "--json", help="Print one JSON document."),
        watch: bool = typer.Option(False, "--watch", "-w", help="Refresh in place every --interval seconds."),
        interval: float = typer.Option(2.0, "--interval", help="Seconds between refreshes with --watch."),
        known_hosts: str = KNOWN_HOSTS,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        """One row per process: running | hung | restarting | dead, health, load, KV-cache use, uptime, restarts;
        for each process that is not healthy, a line on what happened and what is left of it. Exit 1 if unhealthy."""
        file = topology_file(file, file_option)
        name = _deployment_name(file, deployment)
        if interval <= 0:
            raise UsageError(f"--interval: must be more than 0 seconds (got {interval:g})")
        ssh = ssh_options(False, known_hosts, connect_timeout)
        keys = observed_keys(name, resolve_topology(file)[0] if deployment is None else None)
        # --watch into a pipe or file: one JSON document per line and refresh (a table redrawn in
        # place is for a terminal; a pipe would get nothing until the command ends)
        json_output = json_output or (watch and not out.is_terminal)
        json_indent = None if watch else 2

        router: list[str | None] = [None]  # the router's URL for clients here, from the state last read

        def current_rows() -> list[ProcessStatus]:
            try:
                state = _recorded_state(name)
                router[0] = router_url(state)
                return deployment_status(state, ssh, keys)
            except KvpushError as exc:
                if json_output:  # a script reading stdout still gets a document
                    print_json(_status_document(name, [], str(exc)), json_indent)
                raise

        if watch and json_output:
            while True:
                rows = current_rows()
                print_json(_status_document(name, rows, router=router[0]), json_indent)
                time.sleep(interval)
        if watch:
            with Live(console=out, auto_refresh=False) as live:
                while True:
                    live.update(fitted(_status_table(current_rows())), refresh=True)
                    time.sleep(interval)
        rows = current_rows()
        if json_output:
            print_json(_status_document(name, rows, router=router[0]))
        else:
            print_table(_status_table(rows))
            if router[0]:
                out.print(f"router: {router[0]}", highlight=False)
            for r in rows:
                if r.error:
                    err.print(styled("[yellow]{}:[/yellow] {}", r.name, r.error), highlight=False)
        if not all(r.healthy for r in rows):
            raise typer.Exit(1)

    @app.command("logs", epilog=examples(('kvpush logs --file my.yaml', 'the last lines of every log'),
                      ('kvpush logs --file my.yaml decode -f', 'follow the decode instances'),
                      ('kvpush logs -d xpyd router -n 100', 'a deployment by name')), context_settings=EXTRA_ARGUMENTS)
    def logs_command(
        ctx: typer.Context,
        selector: str | None = typer.Argument(
            None, help="Process name or role (prefill, decode, router); default all."
        ),
        file: Path | None = FILE_OPTION,
        deployment: str | None = DEPLOYMENT,
        follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines, like tail -f."),
        lines: int = typer.Option(20, "-n", "--lines", help="Lines of each log to print first."),
        known_hosts: str = KNOWN_HOSTS,
    ) -> None:
        """Tail logs of one process, a role, or all, across hosts; each line prefixed by its process name."""
        selector = one_argument("logs", "PROCESS", [selector, *ctx.args] if selector else [], file)
        name = _deployment_name(file, deployment)
        state = _recorded_state(name)
        width = max(len(n) for n in state.processes)
        lock = threading.Lock()

        def emit(process: str, line: str) -> None:
            with lock:
                out.print(Text.assemble((f"{process:<{width}}", "cyan"), f" | {line}"), highlight=False, soft_wrap=True)

        stream_logs(state, selector, lines, follow, ssh_options(False, known_hosts, 10.0), emit)

    @app.command("provision", epilog=examples(('kvpush provision my.yaml', 'install this kvpush on every host'),
                      ('kvpush provision my.yaml --with-vllm', "also each host's venv and vLLM")))
    def provision_command(
        file: Path | None = FILE_ARG,
        file_option: Path | None = FILE_OPTION,
        with_vllm: bool = typer.Option(
            False, "--with-vllm", help="Also create each host's venv and install the pinned CPU vLLM stack."
        ),
        accept_new_host_keys: bool = ACCEPT,
        known_hosts: str = KNOWN_HOSTS,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        """Make every host's Python import kvpush at this source version (build, upload, install a wheel)."""
        file = topology_file(file, file_option)
        from kvpush.deploy.lifecycle.provision import provision_all

        topo, source = resolve_topology(file)
        check_key_files(topo)
        note(f"topology: {source}")
        for result in provision_all(topo, ssh_options(accept_new_host_keys, known_hosts, connect_timeout), with_vllm):
            out.print(f"host {result.host}: {result.action} ({result.detail})", highlight=False)
