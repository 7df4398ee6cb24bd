"""What `kvpush bench` prints of a report: the per-rate tables, paired ratios, tails, engine handoff
and conversation tables, on the terminal (rich)."""
from __future__ import annotations

import statistics

from rich.table import Table
from rich.text import Text

from kvpush.bench import conversation_table, handoff_table, tails_table
from kvpush.bench.raw import read_text
from kvpush.bench.report import BenchReport
from kvpush.bench.results import ModeRun, figure, paired_ratios, point_at, rates_of, ratio
from kvpush.bench.tails import CONFIDENCE

from .console import err, note, out, styled
from .tables import print_table
from .tables import table as make_table


def ms(value: float | None) -> str:
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
            run.mode, ms(figure(p, "ttft_p50")), ms(figure(p, "ttft_p90")), ms(figure(p, "ttft_p99")),
            ms(figure(p, "tpot_p50")), ms(figure(p, "itl_p50")), ms(figure(p, "e2el_p50")),
            f"{ms(figure(p, 'handoff_p50'))}/{ms(figure(p, 'handoff_p90'))}",
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


def reference_mode(modes: list[str]) -> str | None:
    return conversation_table.REFERENCE_MODE if conversation_table.REFERENCE_MODE in modes else None


def print_conversations(rows: list[conversation_table.ConversationRow] | None, platform: str, modes: list[str]) -> None:
    """A multi-turn bench's table: KV moved per turn against the turn's new tokens, TTFT by turn, answers."""
    if not rows:
        return
    reference = reference_mode(modes)
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
