"""`kvpush bench`: push vs pull under load; thin over kvpush.bench."""
from __future__ import annotations

import dataclasses
import signal
import statistics
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from kvpush.bench import conversation_table, handoff_table, tails_table
from kvpush.bench.modes import DEFAULT_BASELINE, MODES, parse_modes, parse_rates
from kvpush.bench.modes import DEFAULT_MODES as BENCH_DEFAULT_MODES
from kvpush.bench.options import BenchEvents, BenchOptions
from kvpush.bench.raw import read_text
from kvpush.bench.recompute import recompute
from kvpush.bench.report import BenchReport
from kvpush.bench.results import ModeRun, figure, paired_ratios, point_at, rates_of, ratio
from kvpush.bench.runner import run_bench
from kvpush.bench.tails import CONFIDENCE, DEFAULT_SLO_TPOT_MS, DEFAULT_SLO_TTFT_MS, Slo
from kvpush.common.errors import KvpushError
from kvpush.deploy.lifecycle.lifecycle import Events, LifecycleOptions
from kvpush.deploy.topology.topology import check_key_files, resolve_topology

from .console import err, note, out, print_json, styled
from .options import ACCEPT, CONNECT_TIMEOUT, FILE_ARG, FILE_OPTION, KNOWN_HOSTS, examples, ssh_options, topology_file
from .tables import print_table
from .tables import table as make_table

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
            f", P start -> D first p50 {_ms(engine.compute_to_first['p50'])} ({engine.joined}/{engine.requests} joined)"
            if engine is not None
            else ""
        )
        self.progress.console.print(
            f"  {mode:<10} {point.rate:>5g} req/s{where}: TTFT p50 {_ms(c.latency['ttft'].p50)} p90 "
            f"{_ms(c.latency['ttft'].p90)}, "
            f"TPOT p50 {_ms(c.latency['tpot'].p50)}, handoff p50 {_ms(gap)}{engine_text}, "
            f"prefill engine {_ms(point.prefill_engine_ms)}/req, failed {c.failed}",
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


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _ratio_text(value: float | None) -> Text:
    if value is None:
        return Text("-")
    color = "green" if value < 0.97 else "red" if value > 1.03 else "white"
    return Text(f"{value:.2f}x", style=color)


def rate_table(runs: list[ModeRun], rate: float, baseline: str) -> Table:
    columns = ("mode", "TTFT p50", "TTFT p90", "TTFT p99", "TPOT p50", "ITL p50", "E2E p50", "handoff p50/p90",
               "req/s", "failed", "KV tokens in", "TTFT p50 ratio", "TTFT p90 ratio", "TPOT ratio")
    table = make_table(*columns, title=f"{rate:g} req/s (ratios vs {baseline})", right=columns[1:])
    base = next((r for r in runs if r.mode == baseline), None)
    base_point = point_at(base, rate) if base else None
    for run in runs:
        p = point_at(run, rate)
        if p is None:
            table.add_row(run.mode, *(["-"] * 13))
            continue

        def rel(name: str, p=p) -> Text:  # this row's point, not the loop's last
            return _ratio_text(ratio(figure(p, name), figure(base_point, name) if base_point else None))

        table.add_row(
            run.mode, _ms(figure(p, "ttft_p50")), _ms(figure(p, "ttft_p90")), _ms(figure(p, "ttft_p99")),
            _ms(figure(p, "tpot_p50")), _ms(figure(p, "itl_p50")), _ms(figure(p, "e2el_p50")),
            f"{_ms(figure(p, 'handoff_p50'))}/{_ms(figure(p, 'handoff_p90'))}",
            f"{p.client.request_throughput:.2f}", str(p.client.failed), f"{p.prompt_tokens_external:.0f}",
            rel("ttft_p50"), rel("ttft_p90"), rel("tpot_p50"),
        )
    return table


def paired_lines(runs: list[ModeRun], baseline: str) -> list[str]:
    """With --rounds: per mode and rate, the median and range of the per-round ratios to the baseline."""
    lines = []
    for mode, by_rate in paired_ratios(runs, baseline).items():
        if mode == baseline:
            continue
        for rate, figures in sorted(by_rate.items()):
            parts = []
            for name, label in (("ttft_p50", "TTFT p50"), ("ttft_p99", "TTFT p99"), ("tpot_p50", "TPOT p50"),
                                ("goodput", "goodput")):
                values = sorted(figures.get(name, []))
                if values:
                    below = sum(v < 1 for v in values)
                    parts.append(f"{label} {statistics.median(values):.2f}x ({values[0]:.2f}-{values[-1]:.2f}, "
                                 f"lower in {below} of {len(values)})")
            if parts:
                lines.append(f"{mode} vs {baseline} at {rate:g} req/s, per round: {'; '.join(parts)}")
    return lines


def phases_text(phases_s: dict[str, float]) -> str:
    """Where a mode's wall time went, e.g. 'up 92 s, prove 1.2 s, rate 0.5 17 s, ..., down 4.1 s (134 s)'."""
    parts = [
        f"{name} {seconds:.0f} s" if seconds >= 10 else f"{name} {seconds:.1f} s" for name, seconds in phases_s.items()
    ]
    return f"{', '.join(parts)} ({sum(phases_s.values()):.0f} s)"


def print_tails(table: tails_table.TailsTable, baseline: str, platform: str) -> None:
    """The headline tables: goodput and tails with 95% intervals, ratios to the baseline."""
    for rate in tails_table.rates_in(table):
        t = make_table(
            *tails_table.COLUMNS, title=tails_table.caption(table, rate, baseline), right=tails_table.COLUMNS[1:]
        )
        for row in tails_table.rows(table, rate, baseline, platform):
            t.add_row(*row)
        print_table(t)
    note(f"[low, high]: {CONFIDENCE:.0%} confidence intervals (percentiles: order statistics, distribution-free; "
         f"goodput: Wilson interval of the good fraction); '?': too few requests to bound that side")


def print_handoff(table: handoff_table.HandoffTable, platform: str) -> None:
    """The engines' handoff per rate (only where the bench took their spans)."""
    if not table:
        return
    for rate in handoff_table.rates_in(table):
        t = make_table(*handoff_table.COLUMNS, title=handoff_table.caption(rate), right=handoff_table.COLUMNS[1:])
        for row in handoff_table.rows(table, rate, platform):
            t.add_row(*row)
        print_table(t)
    note(handoff_table.DEFINITION)


SPINNING_IDLE_CORES = 0.5  # an instance using this much CPU with no request in flight loads its host's other work


def spinning_lines(runs: list[ModeRun], rounds: int) -> list[str]:
    """Modes whose instances burn CPU while idle; with --rounds they stay up beside every other mode."""
    lines = []
    for run in runs:
        busy = {name: cores for name, cores in run.idle_cores.items() if cores >= SPINNING_IDLE_CORES}
        if busy:
            where = ", ".join(f"{name} {cores:.2f}" for name, cores in busy.items())
            lines.append(f"{run.mode} used CPU with no request in flight ({where} cores)"
                         + ("; with --rounds it stayed up while every other mode was measured, on the same hosts"
                            if rounds > 1 else ""))
    return lines


def _reference(modes: list[str]) -> str | None:
    return conversation_table.REFERENCE_MODE if conversation_table.REFERENCE_MODE in modes else None


def print_conversations(rows: list[conversation_table.ConversationRow] | None, platform: str, modes: list[str]) -> None:
    """A multi-turn bench's table: KV moved per turn against the turn's new tokens, TTFT by turn, answers."""
    if not rows:
        return
    reference = _reference(modes)
    t = make_table(*conversation_table.COLUMNS, title="multi-turn: prompt tokens per completed turn"
                   + (f", answers compared with {reference}'s" if reference else ""),
                   right=conversation_table.COLUMNS[1:])
    for row in rows:
        t.add_row(*conversation_table.row_cells(row, platform))
    print_table(t)


def render(report: BenchReport) -> None:
    platform = report.configuration.get("topology", {}).get("platform", "cpu")
    print_tails(tails_table.tails_of(report.runs), report.options.baseline, platform)
    print_handoff(handoff_table.handoff_of(report.runs), platform)
    if report.options.workload() is not None:
        out_dir = report.options.out_dir
        print_conversations(
            conversation_table.conversation_rows(report.to_dict(), lambda name: read_text(out_dir / name)),
            platform,
            report.options.modes,
        )
    engine = report.configuration.get("engine_timings") or {}
    if engine and not engine.get("taken"):
        note(f"engine handoff not measured: {engine.get('why_not')}")
    for rate in rates_of(report.runs):
        print_table(rate_table(report.runs, rate, report.options.baseline))
    if report.options.rounds > 1:
        uneven = report.options.rounds % len(report.options.modes)
        note(f"{report.options.rounds} rounds, modes interleaved; the tables pool every round's requests"
             + (" (rounds not a multiple of the modes: some modes went first more often)" if uneven else ""))
        for line in paired_lines(report.runs, report.options.baseline):
            note(line)
    for line in spinning_lines(report.runs, report.options.rounds):
        err.print(styled("[yellow]{}[/yellow]", line), highlight=False)
    for run in report.runs:
        if run.idle_cores:
            idle = ", ".join(f"{name} {cores:.2f}" for name, cores in run.idle_cores.items())
            note(f"{run.mode}: started in {run.up_s or 0:.0f} s; CPU while idle (cores): {idle}")
        if run.phases_s:
            note(f"{run.mode}: {phases_text(run.phases_s)}")
        if run.error:
            err.print(styled("[red]{}:[/red] {}", run.mode, run.error), highlight=False)
    model = report.configuration["model"]
    if model.get("description"):
        note(f"model: {model['description']}")
    note("times in ms; handoff = prefill leg's answer to decode's first token, at the router "
         "(estimated from the router's histogram buckets; not the same interval in every mode: see the engine handoff)")
    if report.finished_at is not None:
        note(f"whole bench: {(report.finished_at - report.started_at) / 60:.1f} min")
    for path in report.files:
        out.print(f"wrote {path}", highlight=False)


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
            out.print(conversation_table.markdown(done.conversations, done.platform, _reference(done.modes)),
                      markup=False, highlight=False)
    else:
        print_tails(done.tails, done.baseline, done.platform)
        print_handoff(handoff, done.platform)
        print_conversations(done.conversations, done.platform, done.modes)
