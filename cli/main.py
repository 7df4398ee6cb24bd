"""Entry point: builds the typer app from the command modules and maps errors to exit codes."""
from __future__ import annotations

import inspect
import platform
import sys
from importlib.metadata import version as package_version

import typer

from kvpush.common.errors import KvpushError
from kvpush.deploy.lifecycle.host_probe import source_digest

from . import (
    bench_cmd,
    doctor_cmd,
    exec_cmd,
    lifecycle_cmd,
    ls_cmd,
    monitor_cmd,
    plan_cmd,
    request_cmd,
    router_cmd,
    schema_cmd,
    tunnel_cmd,
)
from .console import err, styled
from .options import examples, unwrapped

app = typer.Typer(
    name="kvpush",
    help="Deploy disaggregated prefill/decode vLLM with a push-mode KV connector.",
    epilog=examples(
        ("kvpush init my.yaml", "a starting topology"),
        ("kvpush up my.yaml", "start it"),
        ("kvpush ls", "every deployment here"),
        ("kvpush --install-completion", "tab completion in your shell"),
    ),
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish, PowerShell
    pretty_exceptions_enable=False,
)
plan_cmd.register(app)
request_cmd.register(app)
doctor_cmd.register(app)
router_cmd.register(app)
lifecycle_cmd.register(app)
ls_cmd.register(app)
bench_cmd.register(app)
schema_cmd.register(app)
monitor_cmd.register(app)
exec_cmd.register(app)
tunnel_cmd.register(app)
for _command in app.registered_commands:
    _command.help = unwrapped(_command.help or inspect.getdoc(_command.callback) or "")

def version_text() -> str:
    """`kvpush --version`: the package version and the digest of its source files, which `provision`
    compares with each host's (two checkouts of one version can differ)."""
    source = source_digest() or "unknown"
    return f"kvpush {package_version('kvpush')} (source {source}), Python {platform.python_version()}"


def _print_version(value: bool) -> None:
    if value:
        print(version_text())
        raise typer.Exit()


@app.callback()
def _global_options(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print kvpush's version and exit."),
) -> None:
    """--debug is read by run() from argv; declared here so --help documents it."""


def run(argv: list[str] | None = None) -> None:
    """Console-script entry: one-line errors, exit 2 for bad input, 1 for failed operations.

    typer/click handle their own usage errors (exit 2) in standalone mode; ours arrive here.
    """
    debug = "--debug" in (sys.argv if argv is None else argv)
    try:
        app(args=argv)
    except KvpushError as exc:
        if debug:
            raise
        err.print(styled("[red]error:[/red] {}", exc), highlight=False)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print(styled("[yellow]interrupted[/yellow]"))
        sys.exit(130)
    except Exception as exc:
        if debug:
            raise
        err.print(
            styled(
                "[red]error:[/red] unexpected {}: {} (rerun as `kvpush --debug <command> ...` for the traceback)",
                type(exc).__name__,
                exc,
            ),
            highlight=False,
        )
        sys.exit(1)


if __name__ == "__main__":
    run()
