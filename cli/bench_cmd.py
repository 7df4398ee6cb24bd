"""`kvpush bench`: push vs pull under load; thin over kvpush.bench."""
from __future__ import annotations

import dataclasses
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from kvpush.bench import conversation_table, handoff_table, tails_table
from kvpush.bench.modes import DEFAULT_BASELINE, MODES, parse_modes, parse_rates
from kvpush.bench.modes import DEFAULT_MODES as BENCH_DEFAULT_MODES
from kvpush.bench.options import BenchEvents, BenchOptions
from kvpush.bench.recompute import recompute
from kvpush.bench.runner import run_bench
from kvpush.bench.tails import DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS, Slo
from kvpush.common.errors import KvpushError
from kvpush.deploy.lifecycle.lifecycle import Events, LifecycleOptions
from kvpush.deploy.topology.topology import check_key_files, resolve_topology

from .bench_view import ms, print_conversations, print_handoff, print_tails, reference_mode, render
from .console import err, note, out, print_json, styled
from .options import ACCEPT, CONNECT_TIMEOUT, FILE_ARG, FILE_OPTION, KNOWN_HOSTS, examples, ssh_options, topology_file

DEFAULT_MODES = ",".join(BENCH_DEFAULT_MODES)
DEFAULT_RATES = "0.5,1,2,4"
# Sized for the whole default bench (4 modes x 4 rates) to take about 15 minutes on a 2-core
# machine: starting deployments and `vllm bench serve` processes dominates, the arrivals of 8
# prompts per rate add only ~30 s per mode (benchmarks/notes/bench-cost.md).
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 32
DEFAULT_NUM_PROMPTS = 8


class _LifecycleProgress(Events):
    def __init__(self, progress: Progress):
        self.progress = progress

    def note(self, message: str) -> None:
        self.progress.console.print(Text(f"  {message}", style="dim"), highlight=False)

    def log_tail(self, name: str, host: str, text: str) -> None:
        self.progress.console.print(Text(f"last lines of {name}'s log on {host}:", style="bold red"))
        for line in text.splitlines():
            self.progress.console.print(f"  {name} | {line}", highlight=False)


class _ProgressEvents(BenchEvents):
    def __init__(self, progress: Progress, options: BenchOptions):
        self.progress = progress
        self.task = progress.add_task(
            "bench", total=len(options.modes) * len(options.rates) * options.rounds, status=""
        )
        self.rounds = options.rounds

    def mode(self, mode: str, status: str) -> None:
        self.progress.update(self.task, description=mode, status=status)

    def rate_started(self, mode: str, rate: float, expected_s: float) -> None:
        self.progress.update(self.task, description=mode, status=f"{rate:g} req/s (~{expected_s:.0f} s of arrivals)")

    def rate_done(self, mode: str, point) -> None:
        c = point.client
        gap = point.router.handoff_gap_p50_ms
        where = f" round {point.round + 1}/{self.rounds}" if self.rounds > 1 else ""
        engine = point.engine_handoff
        engine_text = (
            f", P start -> D first p50 {ms(engine.compute_to_first['p50'])} ({engine.joined}/{engine.requests} joined)"
            if engine is not None
            else ""
        )
        self.progress.console.print(
            f"  {mode:<10} {point.rate:>5g} req/s{where}: TTFT p50 {ms(c.latency['ttft'].p50)} p90 "
            f"{ms(c.latency['ttft'].p90)}, "
            f"TPOT p50 {ms(c.latency['tpot'].p50)}, handoff p50 {ms(gap)}{engine_text}, "
            f"prefill engine {ms(point.prefill_engine_ms)}/req, failed {c.failed}",
            highlight=False,
        )
        self.progress.advance(self.task)

    def mode_failed(self, mode: str, error: str) -> None:
        self.progress.console.print(styled("[red]{} failed:[/red] {}", mode, error), highlight=False)

    def lifecycle(self) -> Events:
        return _LifecycleProgress(self.progress)


@contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """`kill`, a closed terminal or a CI timeout tear the deployments down like Ctrl-C does."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def register(app: typer.Typer) -> None:
    @app.command("bench", epilog=examples(('kvpush bench my.yaml', 'the default modes and rates'),
                      ('kvpush bench my.yaml --modes kvpush,nixl-pull --rates 1,2', 'two modes, two rates'),
                      ('kvpush bench my.yaml --rounds 4 --port-base 9000', 'modes up at once, taking turns'),
                      ('kvpush bench --recompute kvpush-bench --slo-ttft-ms 500', 'new tables from a finished bench')))
    def bench_command(
        file: Path | None = FILE_ARG,
        file_option: Path | None = FILE_OPTION,
        # The lists in the help have spaces after their commas, so a narrow terminal wraps them instead of cutting.
        modes: str = typer.Option(
            DEFAULT_MODES,
            "--modes",
            show_default=False,
            help=f"Modes to compare, comma-separated, from {', '.join(MODES)}; "
            "the -stock modes run vLLM's NIXL connectors exactly as vLLM ships them, the plain ones "
            "as kvpush tunes them for shared CPU cores (on GPU both are stock). "
            "A mode may name the router's policy after a +, e.g. kvpush+least-loaded "
            "(prefix-aware, least-loaded, round-robin; default: the topology's). "
            f"Default: {', '.join(BENCH_DEFAULT_MODES)}.",
        ),
        rates: str = typer.Option(DEFAULT_RATES, "--rates", help="Request rates (req/s, Poisson), comma-separated."),
        input_len: int = typer.Option(DEFAULT_INPUT_LEN, "--input-len", help="Prompt tokens per request."),
        prefix_len: int = typer.Option(
            0,
            "--prefix-len",
            help="Tokens every prompt of a rate starts with (the same "
            "ones), before its own --input-len: after the first request both instances' "
            "prefix caches hold them, and only the rest of the KV moves.",
        ),
        input_len_spread: float = typer.Option(
            0.0,
            "--input-len-spread",
            help="Mixed prompt lengths: each prompt's own "
            "tokens are --input-len x [1 - S, 1 + S], uniform (0 <= S < 1).",
        ),
        output_len: int = typer.Option(
            DEFAULT_OUTPUT_LEN, "--output-len", help="Output tokens per request (EOS ignored)."
        ),
        num_prompts: int = typer.Option(DEFAULT_NUM_PROMPTS, "--num-prompts", help="Requests per rate."),
        conversations: int = typer.Option(
            0,
            "--conversations",
            help="Multi-turn instead: this many conversations per "
            "rate (rates are then conversations started per second); each turn's prompt "
            "is the last turn's prompt, its answer and --turn-tokens new tokens; the first "
            "turn has --prefix-len shared and --input-len own tokens.",
        ),
        turns: int = typer.Option(1, "--turns", help="With --conversations: turns per conversation."),
        turn_tokens: int | None = typer.Option(
            None,
            "--turn-tokens",
            help="With --conversations: new tokens in each turn after the first (default: --input-len).",
        ),
        out_dir: Path = typer.Option(
            Path("kvpush-bench"), "--out", help="Directory for bench.json, PNG plots, raw results and logs."
        ),
        kv_heavy: bool = typer.Option(
            False,
            "--kv-heavy",
            help="Serve a KV-heavy tiny model (8 layers x 8 KV heads x 128: 32 KiB of KV per token, max_model_len "
                      "4096).",
        ),
        baseline: str = typer.Option(DEFAULT_BASELINE, "--baseline", help="Mode the ratios compare against."),
        port_base: int | None = typer.Option(
            None, "--port-base", help="Renumber the bench deployment's ports from here (router first)."
        ),
        rounds: int = typer.Option(
            1,
            "--rounds",
            help="Run the rates this many times with every mode's deployment up at once, "
            "the modes interleaved (needs --port-base); reports pooled figures and per-round ratios.",
        ),
        seed: int = typer.Option(0, "--seed", help="Base seed of the random prompts (each rate gets its own)."),
        tokenizer: str | None = typer.Option(
            None, "--tokenizer", help="Local tokenizer directory for the client (default: the model path)."
        ),
        client_timeout: float = typer.Option(
            900.0, "--client-timeout", help="Seconds one rate's `vllm bench serve` may take."
        ),
        ready_timeout: float = typer.Option(600.0, "--timeout", help="Seconds each process may take to become ready."),
        accept_new_host_keys: bool = ACCEPT,
        known_hosts: str = KNOWN_HOSTS,
        connect_timeout: float = CONNECT_TIMEOUT,
        slo_ttft_ms: float | None = typer.Option(
            None,
            "--slo-ttft-ms",
            help=f"Goodput counts requests whose TTFT is at most this "
            f"(default {DEFAULT_SLO_TTFT_MS:g} ms: an interactive answer starts within a second).",
        ),
        slo_tpot_ms: float | None = typer.Option(
            None,
            "--slo-tpot-ms",
            help=f"... and whose TPOT is at most this (default {DEFAULT_SLO_TPOT_MS:g} ms: 10 tokens/s or faster).",
        ),
        recompute_dir: Path | None = typer.Option(
            None,
            "--recompute",
            help="Deploy nothing: recompute the goodput and tail tables "
            "(and the engine handoff) of a finished bench from the raw per-request "
            "files and spans in this --out directory "
            "(at other SLOs or another --baseline if given).",
        ),
        no_engine_timings: bool = typer.Option(
            False,
            "--no-engine-timings",
            help="Don't have every vLLM instance send its per-request OpenTelemetry "
            "spans to the bench (loopback). By default they do, for the handoff "
            "diagnostic from the engines' own timestamps, the same for every mode "
            "(needs every instance on this machine).",
        ),
        markdown: bool = typer.Option(False, "--markdown", help="With --recompute: print the tables as Markdown."),
        json_output: bool = typer.Option(
            False, "--json", help="Print the whole result document as JSON instead of tables."
        ),
    ) -> None:
        """Compare connector modes under load with `vllm bench serve` through the router: TTFT, TPOT, ITL, E2E,
        handoff gap (at the router, and from both engines' own per-request timestamps), KV-transfer evidence;
        goodput at a TTFT/TPOT SLO and tails with 95% confidence intervals;
        writes bench.json, the raw per-request results and PNG plots."""
        file = topology_file(file, file_option)
        if recompute_dir is not None:
            _recompute(recompute_dir, slo_ttft_ms, slo_tpot_ms, baseline if baseline != DEFAULT_BASELINE else None,
                       markdown, json_output)
            return
        topo, source = resolve_topology(file)
        check_key_files(topo)
        note(f"topology: {source}")
        options = BenchOptions(
            modes=parse_modes(modes),
            rates=parse_rates(rates),
            input_len=input_len,
            output_len=output_len,
            prefix_len=prefix_len,
            input_len_spread=input_len_spread,
            num_prompts=num_prompts,
            conversations=conversations,
            turns=turns,
            turn_tokens=turn_tokens,
            out_dir=out_dir,
            kv_heavy=kv_heavy,
            baseline=baseline,
            port_base=port_base,
            rounds=rounds,
            seed=seed,
            tokenizer=tokenizer,
            client_timeout_s=client_timeout,
            slo=Slo(
                DEFAULT_SLO_TTFT_MS if slo_ttft_ms is None else slo_ttft_ms,
                DEFAULT_SLO_TPOT_MS if slo_tpot_ms is None else slo_tpot_ms,
            ),
            engine_timings=not no_engine_timings,
            lifecycle=LifecycleOptions(
                ssh=ssh_options(accept_new_host_keys, known_hosts, connect_timeout), ready_timeout_s=ready_timeout
            ),
        )
        options.validate()
        columns = [
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TextColumn("{task.fields[status]}", markup=False),
            TimeElapsedColumn(),
        ]
        with Progress(*columns, console=err, transient=True) as progress, interrupt_on_sigterm():
            report = run_bench(topo, options, _ProgressEvents(progress, options))
        if json_output:
            print_json(report.to_dict())
        else:
            render(report)
        if report.interrupted:
            raise KvpushError(f"interrupted; every deployment was stopped and the partial results are in {out_dir}")
        failed = [r.mode for r in report.runs if r.error]
        if failed:
            raise KvpushError(
                f"mode(s) {', '.join(failed)} did not complete (see above); the others' results are in {out_dir}"
            )


def _recompute(bench_dir: Path, slo_ttft_ms: float | None, slo_tpot_ms: float | None, baseline: str | None,
               markdown: bool, json_output: bool) -> None:
    slo = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        slo = Slo(DEFAULT_SLO_TTFT_MS if slo_ttft_ms is None else slo_ttft_ms,
                  DEFAULT_SLO_TPOT_MS if slo_tpot_ms is None else slo_tpot_ms)
    done = recompute(bench_dir, slo, baseline)
    handoff = done.handoff or {}
    if json_output:
        print_json(
            {
                "baseline": done.baseline,
                "slo": dataclasses.asdict(done.slo),
                "tails": {
                    m: {f"{r:g}": dataclasses.asdict(t) for r, t in by_rate.items()}
                    for m, by_rate in done.tails.items()
                },
                "engine_handoff": {
                    m: {f"{r:g}": dataclasses.asdict(h) for r, h in by_rate.items()} for m, by_rate in handoff.items()
                },
                "conversations": [dataclasses.asdict(r) for r in done.conversations or []],
            }
        )
    elif markdown:
        out.print(tails_table.markdown(done.tails, done.baseline, done.platform), markup=False, highlight=False)
        if handoff:
            out.print(handoff_table.markdown(handoff, done.platform), markup=False, highlight=False)
        if done.conversations:
            out.print(conversation_table.markdown(done.conversations, done.platform, reference_mode(done.modes)),
                      markup=False, highlight=False)
    else:
        print_tails(done.tails, done.baseline, done.platform)
        print_handoff(handoff, done.platform)
        print_conversations(done.conversations, done.platform, done.modes)
