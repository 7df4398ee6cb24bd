"""`kvpush plan`, `kvpush init`, `kvpush templates`, `kvpush make-model`: nothing here touches a host."""
from __future__ import annotations

import shlex
from pathlib import Path

import typer
from pydantic import ValidationError

from kvpush.common.errors import UsageError, validation_message
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.plan.plan_model import Plan
from kvpush.deploy.plan.redact import redact_plan
from kvpush.deploy.topology.topology import TinyModelSpec, parse_topology, resolve_topology
from kvpush.templates import DEFAULT_TEMPLATE, template_names, template_summary, template_text

from .console import heading, note, out, print_json, styled, warn
from .options import FILE_ARG, FILE_OPTION, examples, topology_file
from .tables import print_table, table


def render_plan(plan: Plan) -> None:
    out.print(
        styled(
            "[bold]deployment[/bold] {}  [bold]connector[/bold] {}  [bold]platform[/bold] {}  [bold]router[/bold] {}",
            plan.deployment,
            plan.connector,
            plan.platform,
            plan.router_client_url,
        ),
        highlight=False,
    )
    for host in plan.hosts:
        who = host.address if host.is_local or host.slurm else host.describe()
        how = (
            f", slurm node {host.slurm['node'] or '(any of the allocation)'}"
            if host.slurm
            else ", local"
            if host.is_local
            else ", ssh"
        )
        heading(f"host {host.name} ({who}{how})  workdir {host.workdir}")
        for f in host.files:
            out.print(styled("  [cyan]file[/cyan] {} ({} bytes)", f.path, len(f.content)), highlight=False)
        for secret in host.secret_files:
            users = f"; read by {', '.join(secret.used_by)}" if secret.used_by else ""
            out.print(
                styled("  [cyan]secret[/cyan] {} ({}, mode 0600, written by `up`{})", secret.path, secret.kind, users),
                highlight=False,
            )
        for proc in host.processes:
            ports = f"http {proc.http_port}" + (
                f", side channel {','.join(map(str, proc.side_channel_ports))}" if proc.side_channel_ports else ""
            )
            out.print(
                styled("  [bold green]{}[/bold green] ({}) {}; log {}", proc.name, proc.role, ports, proc.log_path),
                highlight=False,
            )
            out.print(f"    cwd  {proc.cwd}", highlight=False)
            for key in sorted(proc.env):
                out.print(f"    env  {key}={shlex.quote(proc.env[key])}", highlight=False)
            if proc.env_file:
                out.print(
                    f"    env  {', '.join(proc.env_file_names)} from {proc.env_file} (values not shown)",
                    highlight=False,
                )
            out.print(f"    argv {shlex.join(proc.argv)}", highlight=False)
            out.print(f"    supervisor {shlex.join(proc.supervisor)}", highlight=False)
            out.print(f"    health {proc.health_url}", highlight=False)
            if plan.slurm is not None:
                out.print(f"    srun {plan.slurm['steps'][proc.name]}", highlight=False)
    if plan.slurm is not None:
        out.rule("sbatch script `kvpush up` submits (none inside an allocation: slurm.job_id or $SLURM_JOB_ID)")
        out.print(plan.slurm["hold_script"], highlight=False)


def register(app: typer.Typer) -> None:
    @app.command("plan", epilog=examples(('kvpush plan my.yaml', 'per host: env, argv, ports, logs'),
                      ('kvpush plan my.yaml --json', 'the same plan for scripts'),
                      ('kvpush plan my.yaml --slurm-script > run.sbatch', 'launcher slurm: an sbatch script')))
    def plan_command(
        file: Path | None = FILE_ARG,
        file_option: Path | None = FILE_OPTION,
        json_output: bool = typer.Option(False, "--json", help="Print the plan as one JSON document."),
        slurm_script: bool = typer.Option(
            False, "--slurm-script", help="Print a standalone sbatch script that runs the deployment (launcher: slurm)."
        ),
    ) -> None:
        """Print the launch plan (per host: env, argv, ports, logs) without touching any host."""
        file = topology_file(file, file_option)
        topo, source = resolve_topology(file)
        launched = build_plan(topo)
        plan = redact_plan(launched)
        if slurm_script:
            if topo.launcher != "slurm":
                raise UsageError(
                    f"--slurm-script: {source} uses launcher {topo.launcher}; set 'launcher: slurm' (see `kvpush init "
                    "--template slurm-cpu`)"
                )
            from kvpush.deploy.plan.slurm_render import standalone_script

            # the script runs what it says: never a redacted value (it refuses secret-looking ones)
            out.print(standalone_script(topo, launched.hosts, source), highlight=False, end="")
            return
        if json_output:
            print_json(plan.to_dict())
        else:
            note(f"topology: {source}")
            render_plan(plan)
        for line in plan.warnings:
            warn(line)

    @app.command("templates", epilog=examples(('kvpush templates', 'names and what each deploys'),
                      ('kvpush init my.yaml -t xpyd', 'start from one')))
    def templates_command(
        json_output: bool = typer.Option(False, "--json", help="Print as JSON."),
    ) -> None:
        """List the topology templates shipped with kvpush."""
        names = template_names()
        if json_output:
            print_json([{"name": n, "summary": template_summary(n), "default": n == DEFAULT_TEMPLATE} for n in names])
            return
        made = table("template", "what it deploys")
        for name in names:
            made.add_row(name + (" (default)" if name == DEFAULT_TEMPLATE else ""), template_summary(name))
        print_table(made)

    @app.command("init", epilog=examples(('kvpush init my.yaml', 'the default template'),
                      ('kvpush init my.yaml --template local-cpu-tp2', 'another template (see `kvpush templates`)')))
    def init_command(
        path: Path = typer.Argument(Path("kvpush.yaml"), help="Where to write the topology."),
        template: str = typer.Option(
            DEFAULT_TEMPLATE, "--template", "-t", help="Template name (see `kvpush templates`)."
        ),
        force: bool = typer.Option(False, "--force", help="Overwrite an existing file."),
    ) -> None:
        """Write a starting topology file from a template."""
        if template not in template_names():
            raise UsageError(f"--template: unknown template '{template}'; choose one of {', '.join(template_names())}")
        if path.is_dir():
            raise UsageError(f"{path}: is a directory; give a file path such as {path / 'kvpush.yaml'}")
        if path.exists() and not force:
            raise UsageError(f"{path}: already exists; pass --force to overwrite or choose another path")
        if not path.parent.is_dir():
            raise UsageError(f"{path.parent}: no such directory; create it first or choose another path")
        text = template_text(template)
        parse_topology(text, f"<template {template}>")  # a shipped template must always validate
        try:
            path.write_text(text)
        except OSError as exc:
            raise UsageError(f"{path}: cannot write it ({exc.strerror or exc}); choose another path") from None
        out.print(f"wrote {path} from template {template}; next: `kvpush plan {path}`", highlight=False)

    @app.command(
        "make-model",
        epilog=examples(
            ("kvpush make-model ~/models/tiny", "the default tiny model"),
            ("kvpush make-model ~/models/kv-heavy --layers 8 --kv-heads 8 --head-dim 128", "32 KiB of KV per token"),
        ),
    )
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
        from kvpush.deploy.lifecycle.tiny_model import describe, make_tiny_model

        try:
            spec = TinyModelSpec(
                seed=seed, layers=layers, kv_heads=kv_heads, heads=heads, head_dim=head_dim, hidden_size=hidden_size
            )
        except ValidationError as exc:
            first = exc.errors()[0]
            option = f"--{str(first['loc'][0]).replace('_', '-')}: " if first["loc"] else ""
            raise UsageError(f"make-model: {option}{validation_message(first)}") from None
        if path.exists() and not path.is_dir():
            raise UsageError(f"{path}: is a file; give a directory for the model (created if missing)")
        made = make_tiny_model(path, spec, force=force)
        out.print(f"{'made' if made else 'kept existing'} {path}: {describe(spec)}", highlight=False)
