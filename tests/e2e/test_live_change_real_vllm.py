"""Changing a live deployment's instances under a steady load, on real vLLM on CPU through `kvpush up`:
the session's pooled kvpush 1P1D (tests/pool_topologies.py), then a second decode added, then
removed again (the deployment is left as the pool handed it out). The router takes each new instance list on
SIGHUP (it never restarts), the removed decode drains before it stops, and no request fails.
The prefill restarts with each change (its connector config names its decodes): the router takes it
out of its list first, lets its legs finish, and decode computes prompts alone until it is back.

The load: a streamed completion started every 0.5 s (2 req/s, each in its own thread), prompts of
PROMPT_TOKENS tokens, MAX_TOKENS output tokens. It prints TTFT p50/p99 before, during and after
each change (what the router's clients see). Heavy: run under `flock /tmp/kvpush-heavy.lock`.
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from kvpush.deploy.lifecycle.lifecycle import LifecycleOptions, up
from kvpush.deploy.lifecycle.observe import require_state
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import parse_topology
from lifecycle_helpers import RecordingEvents, processes_under
from pool_topologies import second_decode
from random_prompts import VOCAB
from fault_helpers import port_free, status_rows

PROMPT_TOKENS, MAX_TOKENS, EVERY_S = 400, 24, 0.5
STEADY_S = 12.0  # load before the first change, between the changes and after the last
POOLED = "pool-kvpush"  # tests/pool_topologies.py; the test leaves it as it found it (1P1D, healthy)


@dataclass
class Outcome:
    start: float
    first_token_s: float | None  # None: it failed before a first token
    status: int | None
    error: str = ""


def stream(url: str, prompt: list[int]) -> Outcome:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                       "ignore_eos": True, "stream": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    start = time.monotonic()
    first = None
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            for line in response:
                if line.startswith(b"data: {") and first is None:
                    first = time.monotonic() - start
                if b'"error"' in line:
                    return Outcome(start, first, response.status, line.decode(errors="replace")[:200])
            return Outcome(start, first, response.status)
    except urllib.error.HTTPError as exc:
        return Outcome(start, None, exc.code, exc.read().decode(errors="replace")[:200])
    except OSError as exc:
        return Outcome(start, first, None, f"{type(exc).__name__}: {exc}")


class SteadyLoad:
    """One request every EVERY_S seconds, each in a thread of its own (an open loop: a slow answer
    does not slow the load down)."""

    def __init__(self, url: str):
        self.outcomes: list[Outcome] = []
        self._lock, self._stop, self._rng = threading.Lock(), threading.Event(), random.Random(5)
        self._threads: list[threading.Thread] = []
        self._pacer = threading.Thread(target=self._pace, args=(url,), daemon=True)
        self._pacer.start()

    def _pace(self, url: str) -> None:
        while not self._stop.wait(EVERY_S):
            prompt = [self._rng.randint(10, VOCAB - 1) for _ in range(PROMPT_TOKENS)]
            t = threading.Thread(target=self._one, args=(url, prompt), daemon=True)
            t.start()
            self._threads.append(t)

    def _one(self, url: str, prompt: list[int]) -> None:
        outcome = stream(url, prompt)
        with self._lock:
            self.outcomes.append(outcome)

    def stop(self) -> list[Outcome]:
        self._stop.set()
        self._pacer.join()
        for t in self._threads:
            t.join(180)
        assert not any(t.is_alive() for t in self._threads), "a request is still waiting for an answer"
        return sorted(self.outcomes, key=lambda o: o.start)


def ttft(outcomes: list[Outcome], start: float, end: float) -> dict:
    times = sorted(o.first_token_s for o in outcomes if start <= o.start < end and o.first_token_s is not None)
    if not times:
        return {"requests": 0}
    p99 = times[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
    return {"requests": len(times), "ttft_p50_s": round(statistics.median(times), 3), "ttft_p99_s": round(p99, 3)}



def test_adding_then_removing_a_decode_under_steady_load_fails_no_request(pool):
    pooled = pool.ready(POOLED)
    one = pooled.topo
    two = parse_topology(second_decode(pooled.topology_text))
    added_ports = [p for proc in build_plan(two).processes() if proc.name == "decode-1"
                   for p in [proc.http_port, *proc.side_channel_ports]]
    options = LifecycleOptions(provision=False, ready_timeout_s=400, stop_timeout_s=15)
    numbers: dict = {"test": "tests/e2e/test_live_change_real_vllm.py"}
    load = None
    try:
        router_before = require_state(POOLED).processes["router"]
        load = SteadyLoad(pooled.router_url)
        time.sleep(STEADY_S)
        events = RecordingEvents()
        add_began = time.monotonic()
        added = up(two, options, events)
        add_done = time.monotonic()
        # prefill-0 restarts too: its connector config lists the decodes it may push to
        assert added.changes.start == ["decode-1"] and added.changes.reload == ["router"], added.changes
        assert added.changes.restart == ["prefill-0"] and added.changes.keep == ["decode-0"], added.changes
        time.sleep(STEADY_S)
        remove_began = time.monotonic()
        removed = up(one, options, events)
        remove_done = time.monotonic()
        assert removed.changes.stop == ["decode-1"] and removed.changes.reload == ["router"], removed.changes
        assert removed.changes.restart == ["prefill-0"], removed.changes
        time.sleep(STEADY_S)
        outcomes, load = load.stop(), None

        failed = [o for o in outcomes if o.status != 200 or o.error or o.first_token_s is None]
        numbers.update(
            requests=len(outcomes), failed=len(failed), add_up_s=round(add_done - add_began, 1),
            remove_up_s=round(remove_done - remove_began, 1),
            before=ttft(outcomes, 0, add_began), adding=ttft(outcomes, add_began, add_done),
            two_decodes=ttft(outcomes, add_done, remove_began), removing=ttft(outcomes, remove_began, remove_done),
            after=ttft(outcomes, remove_done, float("inf")), notes=events.notes)
        print("\nlive change result: " + json.dumps(numbers), file=sys.stderr)
        assert failed == [], failed[:5]
        assert numbers["adding"]["requests"] > 0 and numbers["removing"]["requests"] > 0
        assert not any("did not confirm" in n or "after waiting" in n for n in events.notes), events.notes
        rows = status_rows(POOLED)
        assert sorted(rows) == ["decode-0", "prefill-0", "router"] and all(r.healthy for r in rows.values()), rows
        router_after = require_state(POOLED).processes["router"]
        assert (router_after.pid, router_after.start_time) == (router_before.pid, router_before.start_time)
        # nothing of the removed decode is left: no process, no port (the pool checks the rest at its end)
        assert processes_under(f"{POOLED}.decode-1") == [] and [p for p in added_ports if not port_free(p)] == []
    finally:
        if load is not None:
            load.stop()
        if not sorted(status_rows(POOLED)) == ["decode-0", "prefill-0", "router"]:
            pool.release(POOLED)  # left in another shape: the next test starts it afresh
