"""What one check says about one subject: status, evidence, remedy."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Literal

Scope = Literal["host", "pair", "topology"]
TOPOLOGY_SUBJECT = "(topology)"


class Status(str, Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True)
class Evidence:
    """A command (or file read) and the output lines that decided the result."""

    command: str
    lines: tuple[str, ...] = ()
    exit_code: int | None = None


@dataclass(frozen=True)
class CheckResult:
    check: str
    subject: str  # host name, "a -> b" for a pair, or TOPOLOGY_SUBJECT
    status: Status
    summary: str
    evidence: tuple[Evidence, ...] = ()
    remedy: str | None = None
    scope: Scope = "host"
    data: dict = field(default_factory=dict)  # structured numbers for --json (bandwidth, skew, ...)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["status"] = self.status.value
        return out


def ok(check: str, subject: str, summary: str, *evidence: Evidence, **kw) -> CheckResult:
    return CheckResult(check, subject, Status.OK, summary, tuple(evidence), None, **kw)


def warn(check: str, subject: str, summary: str, remedy: str, *evidence: Evidence, **kw) -> CheckResult:
    return CheckResult(check, subject, Status.WARN, summary, tuple(evidence), remedy, **kw)


def fail(check: str, subject: str, summary: str, remedy: str, *evidence: Evidence, **kw) -> CheckResult:
    return CheckResult(check, subject, Status.FAIL, summary, tuple(evidence), remedy, **kw)


def skip(check: str, subject: str, reason: str, **kw) -> CheckResult:
    return CheckResult(check, subject, Status.SKIP, reason, (), None, **kw)


def pair_subject(source: str, target: str) -> str:
    return f"{source} -> {target}"
