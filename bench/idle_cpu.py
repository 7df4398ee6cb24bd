"""How much CPU each instance burns while it serves nothing: evidence for busy-polling threads
(on this 2-core machine vLLM's NIXL agents were seen spinning a whole core each)."""
from __future__ import annotations

import shlex

from kvpush.deploy.runners import Runner

SAMPLE_S = 3.0
_MARK = "--kvpush-sample--"


def sample_command(pids: list[int], seconds: float) -> str:
    """Clock ticks per second, then the host's uptime and every process's /proc stat line, twice,
    about `seconds` apart. The uptime, read with the stat lines, times the window between them:
    starting `sleep` and the second `cat` makes it longer than `seconds` on a loaded host."""
    stats = " ".join(f"/proc/{int(p)}/stat" for p in pids)
    snap = f"cat /proc/uptime {stats} 2>/dev/null"
    return f"getconf CLK_TCK; {snap}; echo {shlex.quote(_MARK)}; sleep {seconds:g}; {snap}"


def _snapshot(block: str) -> tuple[float, dict[int, int]]:
    """(host uptime in seconds, per process CPU ticks) of one `cat` of /proc/uptime and stat lines."""
    uptime_line, _, stats = block.strip().partition("\n")
    return float(uptime_line.split()[0]), _ticks(stats)


def _ticks(block: str) -> dict[int, int]:
    out = {}
    for line in block.splitlines():
        if not line.strip():
            continue
        pid = int(line.split(" ", 1)[0])
        fields = line.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        out[pid] = int(fields[11]) + int(fields[12])  # utime + stime (fields 14 and 15 of stat)
    return out


def cores_busy(output: str) -> dict[int, float]:
    """Per process: cores' worth of CPU it used between the two snapshots (absent if it exited)."""
    head, _, second = output.partition(_MARK)
    tick_line, _, first = head.partition("\n")
    hz = int(tick_line.strip())
    (started, before), (ended, after) = _snapshot(first), _snapshot(second)
    seconds = ended - started
    return {p: (after[p] - before[p]) / hz / seconds for p in after if p in before}


def idle_cores(runner: Runner, groups: dict[str, int], seconds: float = SAMPLE_S) -> dict[str, float]:
    """Per named process group on one host: cores its processes used together over about `seconds`."""
    members = runner.group_members(list(groups.values()))
    pids = {m.pid: name for name, pgid in groups.items() for m in members.get(pgid, []) if m.state == "alive"}
    out = {name: 0.0 for name in groups}
    if not pids:
        return out
    result = runner.run(sample_command(sorted(pids), seconds), timeout=seconds + 30).check("sampling CPU use")
    for pid, cores in cores_busy(result.stdout).items():
        out[pids[pid]] += cores
    return out
