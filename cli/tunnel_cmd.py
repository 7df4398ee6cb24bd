"""`kvpush tunnel`: an SSH port forward from here to the router and its /metrics, as `kubectl port-forward`."""
from __future__ import annotations

import shlex
import signal
import threading
from pathlib import Path

import typer

from kvpush.common.errors import UsageError
from kvpush.deploy.lifecycle.state import load_state
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import NAME_PATTERN, resolve_topology

from .console import err, out, styled
from .options import (
    ACCEPT,
    CONNECT_TIMEOUT,
    DEPLOYMENT,
    FILE_ARG,
    FILE_OPTION,
    KNOWN_HOSTS,
    examples,
    ssh_options,
    topology_file,
)


def register(app: typer.Typer) -> None:
    @app.command("tunnel", epilog=examples(
        ("kvpush tunnel my.yaml", "forward the router's port; prints the URL"),
        ("kvpush tunnel -d xpyd --local-port 18000", "on a port you choose"),
        ('kvpush request --file my.yaml --router-url http://127.0.0.1:18000 "hi"', "then, in another shell")))
    def tunnel_command(
        file: Path | None = FILE_ARG,
        file_option: Path | None = FILE_OPTION,
        deployment: str | None = DEPLOYMENT,
        local_port: int | None = typer.Option(None, "--local-port", min=0, max=65535, show_default=False,
                                                 help="Port on this machine's 127.0.0.1 (default: the router's port "
                                                      "where free, else any free one; 0: any free one)."),
        accept_new_host_keys: bool = ACCEPT,
        known_hosts: str | None = KNOWN_HOSTS,
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        """Forward a port on this machine's loopback to the router through SSH to its host (`ssh -L`),
        for a router only its own host or network reaches; print the local URL for `request
        --router-url`, a browser or Prometheus ( /metrics). Runs until Ctrl-C."""
        from kvpush.deploy.lifecycle.hosts_tunnel import open_tunnel, router_endpoint  # paramiko: only here

        file = topology_file(file, file_option)
        if deployment is not None and not NAME_PATTERN.match(deployment):
            raise UsageError(f"--deployment: '{deployment}' is not a deployment name; use the topology's name "
                             "(`kvpush ls` lists them)")
        plan = None
        if deployment is None or file is not None:
            topo = resolve_topology(file)[0]
            plan = build_plan(topo) if deployment in (None, topo.name) else None
            deployment = deployment or topo.name
        endpoint = router_endpoint(deployment, load_state(deployment), plan)
        forward, runner = open_tunnel(endpoint, ssh_options(accept_new_host_keys, known_hosts, connect_timeout),
                                      local_port)
        stop = threading.Event()
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
        try:
            where = f"--file {shlex.quote(str(file))}" if file else f"-d {deployment}"
            out.print(
                f"router: {forward.url}  (through SSH to host {endpoint.host}, {endpoint.url} there)", highlight=False
            )
            out.print(f"metrics: {forward.url}/metrics", highlight=False)
            out.print(f'use it: kvpush request {where} --router-url {forward.url} "hello"', highlight=False)
            err.print(styled("[dim]Ctrl-C ends the tunnel.[/dim]"), highlight=False)
            out.file.flush()
            reported = 0
            while not stop.wait(0.5):
                for line in forward.errors[reported:]:
                    err.print(styled("[yellow]tunnel:[/yellow] {}", line), highlight=False)
                reported = len(forward.errors)
        except KeyboardInterrupt:
            pass
        finally:
            signal.signal(signal.SIGTERM, previous)
            forward.close()
            runner.close()
        err.print(f"tunnel closed ({forward.connections} connection(s) carried)", highlight=False)
