"""Where a test lane's wall time goes: runs one pytest lane while sampling how busy the machine's
cores are, then prints the lane's wall time, the cores' average load, how much of the time at
most one core was busy, each module's share, and how many times real vLLM servers were started.

    flock /tmp/kvpush-heavy.lock .venv/bin/python benchmarks/suite_profile.py tests/e2e --out DIR

On a 2-core machine this separates what running tests side by side could win (the time a core
idles) from what only fewer or cheaper vLLM starts can win (the time both cores are busy).
Writes DIR/profile.json (the summary), DIR/cpu.tsv (one line per sample: seconds since start,
busy fraction of all cores) and DIR/pytest.log; pytest's temporary folders go to DIR/tmp.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

SAMPLE_S = 1.0
VLLM_SERVER = ["-m", "vllm.entrypoints.openai.api_server"]  # how kvpush's plan starts a vLLM server
DURATION_LINE = re.compile(r"^([0-9.]+)s (setup|call|teardown)\s+(\S+?)::")


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all cores together, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields)
    return total - idle, total


def vllm_servers() -> set[tuple[int, str]]:
    """(pid, start time) of every vLLM API server process running now; a server loads for many
    seconds, so sampling every second sees each one."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if argv[1:3] == VLLM_SERVER:
                found.add((int(entry.name), (entry / "stat").read_text().rsplit(")", 1)[1].split()[19]))
        except (OSError, IndexError):
            continue
    return found


def sample(stop: threading.Event, samples: list[tuple[float, float]], servers: set, started: float) -> None:
    busy0, total0 = cpu_times()
    while not stop.wait(SAMPLE_S):
        busy, total = cpu_times()
        if total > total0:
            samples.append((time.monotonic() - started, (busy - busy0) / (total - total0)))
        busy0, total0 = busy, total
        servers |= vllm_servers()


def per_module(log_text: str) -> dict[str, float]:
    """Seconds per test file, from pytest's --durations=0 lines (setup + call + teardown)."""
    seconds: dict[str, float] = defaultdict(float)
    for line in log_text.splitlines():
        match = DURATION_LINE.match(line)
        if match:
            seconds[match.group(3)] += float(match.group(1))
    return dict(sorted(seconds.items(), key=lambda item: -item[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("selection", nargs="+", help="what pytest runs, e.g. tests/e2e")
    parser.add_argument("--out", type=Path, required=True, help="folder for profile.json, cpu.tsv, pytest.log")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    basetemp = args.out / "tmp"
    cores = len(os.sched_getaffinity(0))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=0",
               f"--basetemp={basetemp}", *args.selection]

    samples: list[tuple[float, float]] = []
    servers: set[tuple[int, str]] = set()
    stop = threading.Event()
    started = time.monotonic()
    sampler = threading.Thread(target=sample, args=(stop, samples, servers, started), daemon=True)
    sampler.start()
    with open(args.out / "pytest.log", "w") as log:
        code = subprocess.call(command, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - started
    stop.set()
    sampler.join()

    log_text = (args.out / "pytest.log").read_text(errors="replace")
    summary_line = next((ln for ln in reversed(log_text.splitlines()) if " in " in ln and ("passed" in ln or "failed" in ln)), "")
    busy = [fraction for _, fraction in samples]
    one_core = 1.0 / cores + 0.05  # at most one core busy, with a little room for the sampler and the kernel
    profile = {
        "command": " ".join(command),
        "exit_code": code,
        "pytest_summary": summary_line.strip(" ="),
        "cores": cores,
        "wall_s": round(wall, 1),
        "cores_busy_mean": round(sum(busy) / len(busy), 3) if busy else None,
        "share_of_time_at_most_one_core_busy": round(sum(f <= one_core for f in busy) / len(busy), 3) if busy else None,
        "vllm_server_starts": len(servers),
        "seconds_per_module": {name: round(s, 1) for name, s in per_module(log_text).items()},
    }
    (args.out / "cpu.tsv").write_text("".join(f"{t:.1f}\t{f:.3f}\n" for t, f in samples))
    (args.out / "profile.json").write_text(json.dumps(profile, indent=2) + "\n")
    print(json.dumps({k: v for k, v in profile.items() if k != "seconds_per_module"}, indent=2))
    for name, seconds in list(profile["seconds_per_module"].items())[:12]:
        print(f"{seconds:8.1f} s  {name}")
    return code


if __name__ == "__main__":
    sys.exit(main())
