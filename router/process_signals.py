"""The signals a router process answers, shared by the one-process server (app.py) and the
supervisor of several (workers.py)."""
from __future__ import annotations

import signal
from pathlib import Path

STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
RELOAD_SIGNAL = signal.SIGHUP  # read the instance list again (`kvpush up` sends it after rewriting the file)


def describe_process(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmdline = "already gone"
    return f"pid {pid} ({cmdline[:200]})"
