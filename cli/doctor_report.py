"""How `kvpush doctor` prints its report: a section per host, each result on one line.

A result's line is never wrapped or cut by kvpush (a terminal folds a long one), so a cause such as
`host p5en-a (ubuntu@10.0.0.1:22): connection refused; ...` reads whole at any width. A host's pair
checks (`reachability -> b`) are listed under it; checks skipped for the same reason share one line,
so a host that could not be probed takes four lines instead of one per check.
"""
from __future__ import annotations

from rich.text import Text

from kvpush.deploy.doctor import CHECK_NAMES, DoctorReport, Status
from kvpush.deploy.doctor.engine import PROBE_CHECK
from kvpush.deploy.doctor.result import TOPOLOGY_SUBJECT, CheckResult

from .console import out, styled

STYLE = {Status.OK: "green", Status.WARN: "yellow", Status.FAIL: "bold red", Status.SKIP: "dim"}
SEVERITY = [Status.FAIL, Status.WARN, Status.OK, Status.SKIP]  # a section's verdict: its worst result
EVIDENCE_LINES = 4
INDENT = "  "
DETAIL_INDENT = " " * 8


def _order(result: CheckResult) -> int:
    """The probe first (a host's other results depend on it), then the checks in doctor's order."""
    if result.check == PROBE_CHECK:
        return -1
    return CHECK_NAMES.index(result.check) if result.check in CHECK_NAMES else len(CHECK_NAMES)


def sections(report: DoctorReport) -> list[tuple[str, list[tuple[str, CheckResult]]]]:
    """(title, [(label, result)]) per host in the plan's order, then the topology-wide checks.
    A pair's result goes to its source host, labelled `check -> target`."""
    by_section: dict[str, list[tuple[str, CheckResult]]] = {f"host {h}": [] for h in report.hosts}
    for r in sorted(report.results, key=_order):
        if r.subject == TOPOLOGY_SUBJECT:
            title, label = "topology", r.check
        elif " -> " in r.subject:
            source, target = r.subject.split(" -> ", 1)
            title, label = f"host {source}", f"{r.check} -> {target}"
        else:
            title, label = f"host {r.subject}", r.check
        by_section.setdefault(title, []).append((label, r))
    return [(title, rows) for title, rows in by_section.items() if rows]


def _status(status: Status) -> Text:
    return Text(f"{status.value:<4}", style=STYLE[status])


def _line(*parts: str | Text | tuple[str, str]) -> None:
    out.print(Text.assemble(*parts), highlight=False, soft_wrap=True)


def _details(result: CheckResult, verbose: bool) -> None:
    if result.remedy and result.status in (Status.FAIL, Status.WARN):
        _line(DETAIL_INDENT, Text("fix: ", style="bold"), result.remedy)
    if not (verbose or result.status in (Status.FAIL, Status.WARN)):
        return
    for ev in result.evidence:
        exit_text = f"  (exit {ev.exit_code})" if ev.exit_code not in (None, 0) else ""
        _line(DETAIL_INDENT, Text(f"$ {ev.command}{exit_text}", style="dim"))
        for line in ev.lines[:EVIDENCE_LINES]:
            _line(DETAIL_INDENT, Text(f"  {line}", style="dim"))


def render_report(report: DoctorReport, verbose: bool = False) -> None:
    for title, rows in sections(report):
        worst = min((r.status for _, r in rows), key=SEVERITY.index)
        _line((title, "bold"), "  ", (worst.value, STYLE[worst]))
        width = max((len(label) for label, r in rows if verbose or r.status is not Status.SKIP), default=0)
        skipped: dict[str, list[str]] = {}
        for label, r in rows:
            if r.status is Status.SKIP and not verbose:
                skipped.setdefault(r.summary, []).append(label)
                continue
            _line(INDENT, _status(r.status), "  ", f"{label:<{width}}  ", r.summary)
            _details(r, verbose)
        for reason, labels in skipped.items():
            _line(INDENT, _status(Status.SKIP), "  ", Text(f"{', '.join(labels)}: {reason}", style="dim"))
    counts = report.counts()
    verdict = styled("[bold red]FAILED[/bold red]" if report.failed else "[green]ok[/green]")
    out.print(Text.assemble("doctor ", verdict, f": {counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail, "
                            f"{counts['skip']} skip on {len(report.hosts)} host(s) in {report.seconds:.1f} s"),
              highlight=False, soft_wrap=True)
