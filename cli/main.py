"""Entry point: builds the typer app from the command modules and maps errors to exit codes."""
from __future__ import annotations

import sys

import typer

from kvpush.common.errors import KvpushError

from . import bench_cmd, doctor_cmd, lifecycle_cmd, ls_cmd, plan_cmd, request_cmd, router_cmd
from .console import err, styled

app = typer.Typer(
    name="kvpush",
    help="Deploy disaggregated prefill/decode vLLM with a push-mode KV connector.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
plan_cmd.register(app)
request_cmd.register(app)
doctor_cmd.register(app)
router_cmd.register(app)
lifecycle_cmd.register(app)
ls_cmd.register(app)
bench_cmd.register(app)

@app.callback()
def _global_options(
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks for errors."),
) -> None:
    """Read by run() from argv; declared here so --help documents it."""


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
        err.print(styled("[red]error:[/red] unexpected {}: {} (rerun as `kvpush --debug <command> ...` for the traceback)", type(exc).__name__, exc),
                  highlight=False)
        sys.exit(1)


if __name__ == "__main__":
    run()
