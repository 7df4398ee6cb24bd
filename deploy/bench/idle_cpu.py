"""How much CPU each instance burns while it serves nothing: evidence for busy-polling threads
(on this 2-core machine vLLM's NIXL agents were seen spinning a whole core each)."""
from __future__ import annotations

import shlex

from ..runners import Runner

SAMPLE_S = 3.0
_MARK = "--kvpush-sample--"


def sample_command(pids: list[int], seconds: float) -> str:
    """Clock ticks per second, then every process's /proc stat line, twice, `seconds` apart."""
    stats = " ".join(f"/proc/{int(p)}/stat" for p in pids)
    snap = f"cat {stats} 2>/dev/null"
    return f"getconf CLK_TCK; {snap}; echo {shlex.quote(_MARK)}; sleep {seconds:g}; {snap}"


def _ticks(block: str) -> dict[int, int]:
    out = {}
    for line in block.splitlines():
        if not line.strip():
            continue
        pid = int(line.split(" ", 1)[0])
        fields = line.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        out[pid] = int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15 of stat)
    return out


def cores_busy(output: str, seconds: float) -> dict[int, float]:
    """Per process: cores' worth of CPU it used between the two snapshots (absent if it exited)."""
    head, _, second = output.partition(_MARK)
    tick_line, _, first = head.partition("\n")
    hz = int(tick_line.strip())
    before, after = _ticks(first), _ticks(second)
    return {p: (after[p] - before[p]) / hz / seconds for p in after if p in before}


def idle_cores(runner: Runner, groups: dict[str, int], seconds: float = SAMPLE_S) -> dict[str, float]:
    """Per named process group on one host: cores its processes used together over `seconds`."""
    members = runner.group_members(list(groups.values()))
    pids = {m.pid: name for name, pgid in groups.items() for m in members.get(pgid, []) if m.state == "alive"}
    out = {name: 0.0 for name in groups}
    if not pids:
        return out
    result = runner.run(sample_command(sorted(pids), seconds), timeout=seconds + 30).check("sampling CPU use")
    for pid, cores in cores_busy(result.stdout, seconds).items():
        out[pids[pid]] += cores
    return out
