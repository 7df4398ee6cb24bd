"""`kvpush plan`, `kvpush init`, `kvpush templates`, `kvpush make-model`: nothing here touches a host."""
from __future__ import annotations

import shlex
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from kvpush.deploy.errors import UsageError
from kvpush.deploy.plan import Plan, build_plan
from kvpush.deploy.topology import TinyModelSpec, parse_topology, resolve_topology
from kvpush.templates import DEFAULT_TEMPLATE, template_names, template_summary, template_text

from .console import note, out, print_json

FILE_ARG = typer.Argument(None, help="Topology file (default: ./kvpush.yaml, else the built-in local-cpu).")


def render_plan(plan: Plan) -> None:
    out.print(
        f"[bold]deployment[/bold] {plan.deployment}  [bold]connector[/bold] {plan.connector}  "
        f"[bold]platform[/bold] {plan.platform}  [bold]router[/bold] {plan.router_url}",
        highlight=False,
    )
    for host in plan.hosts:
        who = f"{host.user + '@' if host.user else ''}{host.address}" + ("" if host.is_local else f":{host.ssh_port}")
        out.rule(f"host {host.name} ({who}{', local' if host.is_local else ', ssh'})  workdir {host.workdir}")
        for f in host.files:
            out.print(f"  [cyan]file[/cyan] {f.path} ({len(f.content)} bytes)", highlight=False)
        for proc in host.processes:
            ports = f"http {proc.http_port}" + (f", side channel {','.join(map(str, proc.side_channel_ports))}" if proc.side_channel_ports else "")
            out.print(f"  [bold green]{proc.name}[/bold green] ({proc.role}) {ports}; log {proc.log_path}", highlight=False)
            out.print(f"    cwd  {proc.cwd}", highlight=False)
            for key in sorted(proc.env):
                out.print(f"    env  {key}={shlex.quote(proc.env[key])}", highlight=False)
            out.print(f"    argv {shlex.join(proc.argv)}", highlight=False)
            out.print(f"    health {proc.health_url}", highlight=False)


def register(app: typer.Typer) -> None:
    @app.command("plan")
    def plan_command(
        file: Optional[Path] = FILE_ARG,
        json_output: bool = typer.Option(False, "--json", help="Print the plan as one JSON document."),
    ) -> None:
        """Print the launch plan (per host: env, argv, ports, logs) without touching any host."""
        topo, source = resolve_topology(file)
        plan = build_plan(topo)
        if json_output:
            print_json(plan.to_dict())
        else:
            note(f"topology: {source}")
            render_plan(plan)

    @app.command("templates")
    def templates_command(
        json_output: bool = typer.Option(False, "--json", help="Print as JSON."),
    ) -> None:
        """List the topology templates shipped with kvpush."""
        names = template_names()
        if json_output:
            print_json([{"name": n, "summary": template_summary(n), "default": n == DEFAULT_TEMPLATE} for n in names])
            return
        table = Table("template", "what it deploys")
        for name in names:
            table.add_row(name + (" (default)" if name == DEFAULT_TEMPLATE else ""), template_summary(name))
        out.print(table)

    @app.command("init")
    def init_command(
        path: Path = typer.Argument(Path("kvpush.yaml"), help="Where to write the topology."),
        template: str = typer.Option(DEFAULT_TEMPLATE, "--template", "-t", help="Template name (see `kvpush templates`)."),
        force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
    ) -> None:
        """Write a starting topology file from a template."""
        if template not in template_names():
            raise UsageError(f"--template: unknown template '{template}'; choose one of {', '.join(template_names())}")
        if path.exists() and not force:
            raise UsageError(f"{path}: already exists; pass --force to overwrite or choose another path")
        text = template_text(template)
        parse_topology(text, f"<template {template}>")  # a shipped template must always validate
        path.write_text(text)
        out.print(f"wrote {path} from template {template}; next: `kvpush plan {path}`", highlight=False)

    @app.command("make-model")
    def make_model_command(
        path: Path = typer.Argument(..., help="Directory to create the model in."),
        seed: int = typer.Option(0, help="Seed for weights and tokenizer corpus: same seed, same bytes."),
        layers: int = typer.Option(2, help="Decoder layers."),
        kv_heads: int = typer.Option(2, help="Key/value heads (more = more KV bytes per token)."),
        heads: int = typer.Option(4, help="Attention heads."),
        head_dim: int = typer.Option(64, help="Head dimension."),
        hidden_size: int = typer.Option(256, help="Hidden size."),
        force: bool = typer.Option(False, "--force", help="Overwrite an existing model directory."),
    ) -> None:
        """Make a tiny random-weight causal LM with a locally trained tokenizer (no model hub)."""
        from kvpush.deploy.tiny_model import describe, make_tiny_model

        spec = TinyModelSpec(seed=seed, layers=layers, kv_heads=kv_heads, heads=heads, head_dim=head_dim, hidden_size=hidden_size)
        made = make_tiny_model(path, spec, force=force)
        out.print(f"{'made' if made else 'kept existing'} {path}: {describe(spec)}", highlight=False)
