"""The other rank processes of this vLLM instance on this host, and a way to hear when one ends.

The ranks of an instance meet in a collective (all-reduce) in every layer. When one rank's process
dies, the others wait in their next collective, where a signal does not reach them, until vLLM
kills them: on CPU that was 9-10 s later (its 5 s grace period, then SIGTERM, 4 s, SIGKILL).
Meanwhile their side channels, served by a thread of their own, still answer decode's pings, so
decode would go on waiting for KV that cannot come. A prefill rank that hears a sibling end
fails what decode waits for at once (producer.py): like vLLM's multiprocessing executor, which
shuts an instance down when any of its ranks dies, it takes the instance for lost.

vLLM's multiprocessing executor starts every rank of an instance from the engine core process
and titles them `<VLLM_PROCESS_NAME_PREFIX>::Worker...`; siblings are the other processes with
that title and this process's parent. Ranks on other hosts, or started by another executor, are
not found; a rank then learns of a lost sibling only when vLLM ends it.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Collection


def worker_title_prefix() -> str:
    return os.environ.get("VLLM_PROCESS_NAME_PREFIX", "VLLM") + "::Worker"


def sibling_ranks(proc: Path = Path("/proc"), pid: int | None = None, parent: int | None = None,
                  title_prefix: str | None = None) -> dict[int, str]:
    """pid -> title of every other rank process of this instance on this host."""
    pid = os.getpid() if pid is None else pid
    parent = os.getppid() if parent is None else parent
    prefix = worker_title_prefix() if title_prefix is None else title_prefix
    found = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == pid:
            continue
        try:
            stat = (entry / "stat").read_text()
            title = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
        except OSError:  # ended meanwhile, or not ours to read
            continue
        if _parent_of(stat) == parent and title.startswith(prefix):
            found[int(entry.name)] = title
    return found


def _parent_of(stat: str) -> int:
    """The parent pid in a /proc/<pid>/stat line; the command name before it may hold spaces or
    parentheses, so fields are counted from its closing parenthesis."""
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else -1


def exit_handles(pids: dict[int, str]) -> tuple[dict[int, str], list[str]]:
    """(fd -> title, titles already gone): a pidfd per process, readable once it has ended. A
    process no pidfd can be opened for (before Linux 5.3, or out of descriptors) is left out."""
    handles, gone = {}, []
    for pid, title in pids.items():
        try:
            handles[os.pidfd_open(pid)] = f"{title} (pid {pid})"
        except ProcessLookupError:
            gone.append(f"{title} (pid {pid})")
        except OSError:
            continue
    return handles, gone


def yield_cores(keep_threads: Collection[int]) -> int:
    """Put every thread of this process but `keep_threads` (native thread ids) under SCHED_IDLE;
    how many were. For a rank whose instance lost a sibling: its compute thread spins in a
    collective until vLLM kills the process, and on a host where other instances share its cores
    that spin took them from their ranks for seconds. Idle-class threads run only when nothing
    else wants the core. Returns 0 where the kernel refuses."""
    moved = 0
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        tid = int(task.name)
        if tid in keep_threads:
            continue
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            moved += 1
        except OSError:  # ended meanwhile, or refused
            continue
    return moved
