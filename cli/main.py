"""Entry point: builds the typer app from the command modules and maps errors to exit codes."""
from __future__ import annotations

import sys

import typer

from kvpush.deploy.errors import KvpushError

from . import plan_cmd
from .console import err

app = typer.Typer(
    name="kvpush",
    help="Deploy disaggregated prefill/decode vLLM with a push-mode KV connector.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
plan_cmd.register(app)

_DEBUG = {"on": False}


@app.callback()
def _global_options(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
) -> None:
    _DEBUG["on"] = debug


def run(argv: list[str] | None = None) -> None:
    """Console-script entry: one-line errors, exit 2 for bad input, 1 for failed operations."""
    try:
        app(args=argv, standalone_mode=False)
    except KvpushError as exc:
        if _DEBUG["on"] or "--debug" in (argv or sys.argv):
            raise
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted[/yellow]")
        sys.exit(130)
    except SystemExit:
        raise
    except Exception as exc:  # click usage errors and the unexpected
        import click

        if isinstance(exc, click.exceptions.Exit):
            sys.exit(exc.exit_code)
        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(2 if isinstance(exc, click.UsageError) else 1)
        if isinstance(exc, click.exceptions.Abort):
            sys.exit(130)
        if _DEBUG["on"] or "--debug" in (argv or sys.argv):
            raise
        err.print(f"[red]error:[/red] unexpected {type(exc).__name__}: {exc} (rerun with --debug for the traceback)", highlight=False)
        sys.exit(1)


if __name__ == "__main__":
    run()
