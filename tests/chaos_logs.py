"""The logs of a chaos run: kept before `up` starts a dead instance again (it keeps one previous log
only), searched for what they say about the requests that failed, and for transfers decode gave up
on because prefill went silent."""
from __future__ import annotations

import gzip
import re
import shutil
from collections import defaultdict
from pathlib import Path

# decode's words for a prefill it judged dead or hung from its silence ("no answer for 1 s", "no
# answer on the side channel for 1 s")
SILENCE = re.compile(r"no answer (?:on the side channel )?for")
TRANSFER_FAILED = re.compile(r"kvpush: (?:\d+ )?transfer")


def keep_log(log: Path, into: Path, name: str) -> Path | None:
    """Copy `log` compressed to into/name.gz (None when there is no such log)."""
    if not log.exists():
        return None
    into.mkdir(parents=True, exist_ok=True)
    target = into / f"{name}.gz"
    with open(log, "rb") as src, gzip.open(target, "wb") as dst:
        shutil.copyfileobj(src, dst)
    return target


def _lines(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", errors="replace") as f:
        yield from f


def evidence(request_ids: set[str], logs: list[Path], per_request: int = 6) -> dict[str, list[str]]:
    """For each request id, the first log lines that name it, as `log: line`. vLLM's request ids
    start with the client's X-Request-Id (the router passes it on), so one pattern finds both legs."""
    if not request_ids:
        return {}
    pattern = re.compile("|".join(re.escape(i) for i in sorted(request_ids, key=len, reverse=True)))
    found: dict[str, list[str]] = defaultdict(list)
    for log in logs:
        for line in _lines(log):
            for match in set(pattern.findall(line)):
                if len(found[match]) < per_request:
                    found[match].append(f"{log.name}: {line.strip()[:400]}")
    return dict(found)


def transfer_failures(logs: list[Path]) -> dict[str, list[str]]:
    """Per log, its lines about failed transfers."""
    out: dict[str, list[str]] = {}
    for log in logs:
        lines = [line.strip()[:400] for line in _lines(log) if TRANSFER_FAILED.search(line) and "fail" in line]
        if lines:
            out[log.name] = lines
    return out


def silence_failures(logs: list[Path]) -> int:
    """Transfers failed because prefill was silent, as decode's logs count them."""
    total = 0
    for lines in transfer_failures(logs).values():
        for line in lines:
            if SILENCE.search(line):
                m = re.search(r"kvpush: (\d+) transfer\(s\)", line)
                total += int(m.group(1)) if m else 1
    return total
