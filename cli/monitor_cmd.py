"""`kvpush monitor`: a Prometheus scrape config and a Grafana dashboard for a deployment."""
from __future__ import annotations

from pathlib import Path

import typer

from kvpush.deploy.topology.topology import check_key_files, resolve_topology

from .console import note, out
from .options import FILE_ARG, FILE_OPTION, examples, topology_file


def register(app: typer.Typer) -> None:
    @app.command("monitor", epilog=examples(
        ("kvpush monitor my.yaml", "write ./kvpush-monitor/<deployment>/"),
        ("kvpush monitor my.yaml --out /etc/prometheus/kvpush", "somewhere else"),
        ("kvpush monitor my.yaml --router-url http://127.0.0.1:8000", "through `kvpush tunnel`"),
        ("prometheus --config.file=kvpush-monitor/xpyd/prometheus.yml", "then scrape with it")))
    def monitor_command(
        file: Path | None = FILE_ARG,
        file_option: Path | None = FILE_OPTION,
        out_dir: Path | None = typer.Option(
            None, "--out", help="Directory to write into (default: ./kvpush-monitor/<deployment>)."
        ),
        router_url: str | None = typer.Option(
            None,
            "--router-url",
            help="Scrape the router here instead of where the plan puts it, e.g. the URL `kvpush tunnel` prints.",
        ),
    ) -> None:
        """Write a Prometheus scrape config for the router's and every instance's /metrics (with the keys
        they need, as 0600 files beside it) and a Grafana dashboard for the router and connector metrics."""
        from kvpush.deploy.lifecycle.monitor_files import write_monitor_files

        file = topology_file(file, file_option)
        topo, source = resolve_topology(file)
        check_key_files(topo)
        note(f"topology: {source}")
        written = write_monitor_files(topo, out_dir or Path("kvpush-monitor") / topo.name, router_url)
        out.print(f"wrote {written.scrape_config} ({len(written.targets)} targets: "
                  f"{', '.join(f'{t.process} {t.address}' for t in written.targets)})", highlight=False)
        for kind, path in written.key_files.items():
            out.print(f"  {kind} key read from {path}", highlight=False)
        out.print(f"wrote {written.dashboard} (Grafana: Dashboards > New > Import)", highlight=False)
        out.print(f"next: prometheus --config.file={written.scrape_config}", highlight=False)
