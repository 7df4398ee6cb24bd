"""What one vLLM server start costs on this machine, and where the time goes: starts the decode
instance of a shipped CPU template (its plan's argv and environment, with the tiny model, eager,
and no connector) until /health answers, then stops it. Per start it prints the seconds to the
API server's first log line after its imports, to the engine core process's first line (which it
reaches after importing vLLM again: vLLM's CPU platform spawns its processes), to /health, and the
CPU seconds the whole process tree used.

    .venv/bin/python benchmarks/vllm_start_cost.py --template local-cpu --repeat 2
    .venv/bin/python benchmarks/vllm_start_cost.py --template local-cpu-tp2 --entry cli

`--entry cli` starts the same server through vLLM's CLI module (`vllm serve`) instead of the
plan's `python -m vllm.entrypoints.openai.api_server`: spawned processes import the parent's main
module again, and the CLI module is the lighter of the two.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil
import yaml

from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.lifecycle.tiny_model import make_tiny_model
from kvpush.deploy.topology.topology import TinyModelSpec, parse_topology
from kvpush.templates import template_text

PLAN_ENTRY = ["-m", "vllm.entrypoints.openai.api_server"]
CLI_ENTRY = ["-m", "vllm.entrypoints.cli.main", "serve"]
PORT = 19555
LOG_TIME = re.compile(r"^\((\w+) pid=\d+\) \w+ \d\d-\d\d (\d\d):(\d\d):(\d\d)")


def server_plan(template: str, model: Path, workdir: Path):
    """The template's decode-0 with the tiny model, eager, a small KV cache, no connector."""
    doc = yaml.safe_load(template_text(template))
    doc["model"].update({"path": str(model), "enforce_eager": True, "dtype": "float32"})
    doc["connector"] = {"type": "colocated"}
    for host in doc["hosts"].values():
        host["workdir"] = str(workdir)
    doc["prefill"] = []
    doc["decode"] = [{**doc["decode"][0], "kv_cache_gib": 0.25, "http_port": PORT}]
    return build_plan(parse_topology(yaml.safe_dump(doc))).process("decode-0")


def first_line_seconds(log_text: str, started_wall: float) -> dict[str, float]:
    """Seconds from the launch to each process kind's first timestamped log line (whole seconds)."""
    seen: dict[str, float] = {}
    day = time.localtime(started_wall)
    for line in log_text.splitlines():
        match = LOG_TIME.match(line)
        if match and match.group(1) not in seen:
            h, m, s = (int(x) for x in match.group(2, 3, 4))
            at = time.mktime((day.tm_year, day.tm_mon, day.tm_mday, h, m, s, 0, 0, -1))
            seen[match.group(1)] = round(at - started_wall, 1)
    return seen


def tree_cpu(pid: int) -> tuple[float, int]:
    """(CPU seconds used, number of processes) of the process and all its descendants."""
    root = psutil.Process(pid)
    tree = [root, *root.children(recursive=True)]
    total = 0.0
    for proc in tree:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total, len(tree)


def start_once(argv: list[str], env: dict[str, str], log_path: Path) -> dict:
    started_wall, started = time.time(), time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited ({proc.returncode}) before /health answered; see {log_path}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        healthy_s = time.monotonic() - started
        cpu_s, processes = tree_cpu(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    first = first_line_seconds(log_path.read_text(errors="replace"), started_wall)
    return {"healthy_s": round(healthy_s, 1), "tree_cpu_s": round(cpu_s, 1), "processes": processes,
            "api_server_first_line_s": first.get("APIServer"), "engine_core_first_line_s": first.get("EngineCore")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--template", default="local-cpu", help="a shipped CPU template (its decode-0 is started)")
    parser.add_argument("--entry", choices=("plan", "cli"), default="plan")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvpush-start-cost-") as tmp:
        model = Path(tmp) / "tiny"
        make_tiny_model(model, TinyModelSpec(seed=0))
        plan = server_plan(args.template, model, Path(tmp))
        argv = list(plan.argv)
        if args.entry == "cli":
            at = argv.index(PLAN_ENTRY[0])
            argv[at:at + len(PLAN_ENTRY)] = CLI_ENTRY
        for index in range(args.repeat):
            # the instance key `up` gives each instance from its env file (the middleware needs one)
            env = {**plan.env, "VLLM_API_KEY": secrets.token_hex(32)}
            result = start_once(argv, env, Path(tmp) / f"server-{index}.log")
            print(json.dumps({"template": args.template, "entry": args.entry, **result}), flush=True)


if __name__ == "__main__":
    main()
