"""`kvpush request`: one streamed completion through the deployment's router; prints answer and TTFT."""
from __future__ import annotations

from pathlib import Path

import typer

from kvpush.common.errors import KvpushError
from kvpush.deploy.lifecycle.client import stream_completion
from kvpush.deploy.lifecycle.secrets import client_api_key
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import resolve_topology

from .console import note, out, print_json, styled
from .options import EXTRA_ARGUMENTS, FILE_OPTION, examples, one_argument


def register(app: typer.Typer) -> None:
    @app.command(
        "request",
        epilog=examples(
            ('kvpush request --file my.yaml "hello"', "answer and TTFT"),
            ('kvpush request --file my.yaml -n 64 --json "hello"', "64 tokens, as JSON"),
            ('kvpush request --file my.yaml --router-url http://127.0.0.1:18000 "hi"', "through `kvpush tunnel`"),
        ),
        context_settings=EXTRA_ARGUMENTS,
    )
    def request_command(
        ctx: typer.Context,
        prompt: str = typer.Argument(..., help="Prompt text (quoted)."),
        file: Path | None = FILE_OPTION,
        max_tokens: int = typer.Option(32, "--max-tokens", "-n", help="Tokens to generate (greedy)."),
        json_output: bool = typer.Option(False, "--json", help="Print the result as JSON."),
        router_url_option: str | None = typer.Option(None, "--router-url", help="Send it here instead of the "
                                                        "router's own address, e.g. the URL `kvpush tunnel` prints."),
    ) -> None:
        """Send one streamed, greedy completion through the router; print the answer and its TTFT."""
        one_argument("request", "PROMPT", [prompt, *ctx.args], file)  # refuses a topology file or more words
        router_url = None
        try:
            topo, source = resolve_topology(file)
            plan = build_plan(topo)
            router_url = router_url_option or plan.router_url_from_here()
            result = stream_completion(router_url, plan.served_model_name, prompt, max_tokens=max_tokens,
                                       api_key=client_api_key(topo))
        except KvpushError as exc:
            if json_output:  # a script reading stdout gets a document either way; the exit code says it failed
                print_json({"ok": False, "router": router_url, "error": str(exc)})
            raise
        if json_output:
            print_json({"ok": True, "router": router_url, "text": result.text, "ttft_ms": result.ttft_s * 1e3,
                        "latency_ms": result.latency_s * 1e3, "completion_tokens": result.completion_tokens,
                        "finish_reason": result.finish_reason})
            return
        note(f"topology: {source}; router {router_url}")
        out.print(styled("[bold]prompt[/bold]  {}", prompt), highlight=False)
        out.print(styled("[bold]answer[/bold]  {}", repr(result.text)), highlight=False)
        out.print(
            styled(
                "[bold]TTFT[/bold]    {} ms   [bold]total[/bold] {} ms for {} tokens",
                f"{result.ttft_s * 1e3:.1f}",
                f"{result.latency_s * 1e3:.1f}",
                result.completion_tokens,
            ),
            highlight=False,
        )
