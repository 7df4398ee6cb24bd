"""Where a kvpush request's handoff goes: one timeline per request, from both legs and both connectors.

Against a running kvpush deployment on this host (`kvpush up FILE`, with `VLLM_LOGGING_LEVEL: DEBUG`
in the topology's env so the connector logs its per-transfer timestamps), this sends each request's two
legs straight to the first prefill and decode instances, as the router would (the router's own
`concurrent_legs`), and stamps them with the same monotonic clock the connector logs use. It then
joins the connector's DEBUG lines (`kvpush P offer/post/done`, `kvpush D expect/outcome`) from both
instances' logs by transfer id and prints, relative to prefill's step end (`P offer`):

    D start     decode hears a streamed WRITE begin (stream_writes), and may schedule the request
    P done      prefill's WRITE complete          D outcome   decode knows the KV is there
    P answer    prefill leg's answer received     D first     decode leg's first token received
    handoff     D first - P answer (what `kvpush bench` reports at the router)
    D path      D first - D outcome: decode's scheduling + first forward + output, no transfer in it
                (with a streamed WRITE the forward overlaps the transfer, so this is what is left of it)
    step        decode's time per token after the first

`--repeat-prompt` sends the same prompt every time, so from the second request on both instances hold
it in their prefix caches and next to nothing is transferred: its handoff is the floor that no
connector can go below on this deployment.

    python benchmarks/handoff_timeline.py FILE [--requests 4] [--rate 0] [--input-len 3000]
        [--output-len 8] [--repeat-prompt] [--json OUT]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import aiohttp

from kvpush.deploy.plan.plan import build_plan, router_config
from kvpush.deploy.lifecycle.secrets import AccessKeys, kept_secret
from kvpush.deploy.topology.topology import load_topology
from kvpush.router.protocols import concurrent_legs, new_transfer_id

CONNECTOR_LINE = re.compile(r"kvpush (?P<side>[PD]) (?P<event>\w+) (?P<tid>[0-9a-f]+)\b.*? t=(?P<t>[\d.]+)")
COLUMNS = ("D_streaming", "P_done", "D_outcome", "P_answer", "D_first")


@dataclass
class Timeline:
    """One request: monotonic timestamps by event name (client's and both connectors')."""

    index: int
    transfer_id: str
    at: dict[str, float] = field(default_factory=dict)
    tokens: int = 0

    def since_step_end(self, event: str) -> float | None:
        """Milliseconds from prefill's step end (its offer) to `event`."""
        if event not in self.at or "P_offer" not in self.at:
            return None
        return 1000 * (self.at[event] - self.at["P_offer"])

    def gap(self, later: str, earlier: str) -> float | None:
        if later not in self.at or earlier not in self.at:
            return None
        return 1000 * (self.at[later] - self.at[earlier])

    @property
    def handoff_ms(self) -> float | None:
        return self.gap("D_first", "P_answer")

    @property
    def decode_path_ms(self) -> float | None:
        return self.gap("D_first", "D_outcome")

    @property
    def step_ms(self) -> float | None:
        total = self.gap("D_end", "D_first")
        return None if total is None or self.tokens < 2 else total / (self.tokens - 1)


# With TP > 1 every rank logs each transfer: a push is done when its last rank is, and began with its first.
LAST_RANK_EVENTS = {"P_done", "D_outcome"}


def join_connector_lines(lines: Iterable[str], timelines: dict[str, Timeline]) -> int:
    """Add the connector's `kvpush P|D <event> <transfer id> ... t=<monotonic>` stamps; returns how many."""
    joined = 0
    for line in lines:
        m = CONNECTOR_LINE.search(line)
        if m is None or m["tid"] not in timelines:
            continue
        event, t, at = f"{m['side']}_{m['event']}", float(m["t"]), timelines[m["tid"]].at
        at[event] = (max if event in LAST_RANK_EVENTS else min)(at.get(event, t), t)
        joined += 1
    return joined


def summary(timelines: list[Timeline]) -> dict[str, float]:
    """Medians (ms) over the requests that have each figure."""
    figures = {f"{c} since step end": [t.since_step_end(c) for t in timelines] for c in COLUMNS}
    figures.update({"handoff": [t.handoff_ms for t in timelines], "D path": [t.decode_path_ms for t in timelines],
                    "decode step": [t.step_ms for t in timelines]})
    return {name: round(statistics.median(v), 1) for name, values in figures.items()
            if (v := [x for x in values if x is not None])}


def format_row(t: Timeline) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:7.1f}"
    cells = [ms(t.since_step_end(c)) for c in COLUMNS] + [ms(t.handoff_ms), ms(t.decode_path_ms), ms(t.step_ms)]
    return f"{t.index:3d} " + " ".join(f"{c:>9}" for c in cells)


HEADER = "  # " + " ".join(f"{h:>9}" for h in ("D start", "P done", "D outcome", "P answer", "D first", "handoff", "D path",
                                                 "step"))


async def send_request(session: aiohttp.ClientSession, prefill_url: str, decode_url: str, legs, timeline: Timeline) -> None:
    async def prefill_leg() -> None:
        async with session.post(f"{prefill_url}/v1/completions", json=legs.prefill) as resp:
            await resp.read()
            resp.raise_for_status()
            timeline.at["P_answer"] = time.monotonic()

    async def decode_leg() -> None:
        async with session.post(f"{decode_url}/v1/completions", json=legs.decode) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    timeline.at.setdefault("D_first", time.monotonic())
                    timeline.tokens += 1
            timeline.at["D_end"] = time.monotonic()

    timeline.at["sent"] = time.monotonic()
    await asyncio.gather(prefill_leg(), decode_leg())


async def run_requests(args: argparse.Namespace) -> list[Timeline]:
    topo = load_topology(args.topology)
    if topo.connector.type != "kvpush":
        raise SystemExit(f"{args.topology}: connector.type is {topo.connector.type}; this tool times kvpush deployments")
    config = router_config(topo)
    prefill, decode = config.prefill[0], config.decode[0]
    rng = random.Random(args.seed)
    fixed_prompt = [rng.randrange(100, 2000) for _ in range(args.input_len)]
    timelines, tasks = [], []
    # The instances `kvpush up` started take the deployment's instance key (docs/security.md).
    headers = AccessKeys.of(kept_secret(topo.name), None).headers("prefill")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.timeout_s), headers=headers) as session:
        for i in range(args.requests):
            prompt = fixed_prompt if args.repeat_prompt else [rng.randrange(100, 2000) for _ in range(args.input_len)]
            body = {"model": topo.model.name, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0,
                    "stream": True, "ignore_eos": True}
            timeline = Timeline(i, new_transfer_id())
            legs = concurrent_legs("kvpush", body, False, timeline.transfer_id, prefill, decode)
            timelines.append(timeline)
            tasks.append(asyncio.create_task(send_request(session, prefill.url, decode.url, legs, timeline)))
            if args.rate > 0:
                await asyncio.sleep(rng.expovariate(args.rate))
            elif args.repeat_prompt:
                await tasks[-1]  # one at a time, so the cache holds the prompt before the next one
        await asyncio.gather(*tasks)
    logs = [build_plan(topo).process(spec.name).log_path for spec in (topo.prefill[0], topo.decode[0])]
    by_id = {t.transfer_id: t for t in timelines}
    for log in logs:
        with open(os.path.expanduser(log), errors="replace") as f:
            if not join_connector_lines(f, by_id):
                print(f"note: no kvpush DEBUG lines for these requests in {log}; set VLLM_LOGGING_LEVEL: DEBUG in "
                      f"the topology's env and run `kvpush up` again", file=sys.stderr)
    return timelines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("topology")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second; 0 sends all at once")
    ap.add_argument("--input-len", type=int, default=3000)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--repeat-prompt", action="store_true", help="same prompt each time, one at a time: the no-transfer floor")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--json", type=Path, help="write every timestamp here")
    args = ap.parse_args(argv)
    if args.repeat_prompt and args.rate > 0:
        ap.error("--repeat-prompt sends one request at a time (each must find the last one cached); drop --rate")
    timelines = asyncio.run(run_requests(args))
    print("ms since prefill's step end (its offer); handoff = D first - P answer; D path = D first - D outcome")
    print(HEADER)
    for t in timelines:
        print(format_row(t))
    # with a repeated prompt the first request still moves everything: the floor is the others'
    medians = summary(timelines[1:] if args.repeat_prompt and len(timelines) > 1 else timelines)
    print("median: " + ", ".join(f"{k} {v}" for k, v in medians.items()))
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "median_ms": medians,
                                         "requests": [{"transfer_id": t.transfer_id, "tokens": t.tokens, **t.at} for t in timelines]},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
