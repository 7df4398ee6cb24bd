"""Faults under load with two prefill and two decode instances: real vLLM on CPU through `kvpush up`,
`status` and `down` (kvpush connector, least-loaded router, four instances sharing the two cores).

One deployment takes four faults in turn, each under its own load of 32 clients sending
completions of 1,500 prompt tokens and 48 output tokens back to back, about half of them streamed
and half not: SIGKILL of prefill-0, SIGSTOP of prefill-0 (SIGCONT after STOPPED_FOR_S), SIGKILL of
decode-0, SIGSTOP of decode-0. With a healthy peer of the same role in rotation, no request may fail
before its first streamed token, so no non-streamed request may fail at all (the router reads such
an answer whole before the client sees any of it); a request that had streamed from a killed decode
may end with an error, but every request ends within ENDS_WITHIN_S. Every answer given under the
SIGKILL of prefill-0 equals a plain vLLM server's (tests/reference_server.py). Before the faults,
a decode leg whose KV load fails (it names a prefill the connector refuses) shows that real vLLM
answers such a request as the router expects (router/vllm_errors.py), streamed and not. After each fault `up` revives the killed instance alone (the others keep their PIDs)
or, after SIGCONT, has nothing to do, and the router has all four instances in rotation again before
the next fault. Afterwards no process of the deployment is left and no port is held. Prints a table
of the outcomes per fault. Heavy: run under `flock /tmp/kvpush-heavy.lock`.
"""
from __future__ import annotations

import http.client
import json
import signal
import sys
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvpush.common.kv_params import CONSUMER, PushParams
from kvpush.common.vllm_metrics import metric_sum
from kvpush.deploy.lifecycle.lifecycle import LifecycleOptions, down, up
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.lifecycle.secrets import observed_keys
from kvpush.deploy.topology.topology import parse_topology
from kvpush.router.vllm_errors import GENERATION, classify_event, event_failure_kind, failure_kind
from fault_helpers import cli_status, hang_instance, kill_until_shown_dead, port_free, status_rows, wait_healthy
from e2e_instances import KV_CACHE_GIB
from fault_load import LOAD_BEFORE_FAULT_S, PROMPT_TOKENS, Load, completion_request
from lifecycle_helpers import kill_leftovers, processes_under
from random_prompts import full_length_prompts

STOPPED_FOR_S = 6.0  # SIGSTOP to SIGCONT
LOAD_AFTER_FAULT_S = 6.0  # after the kill or the SIGCONT, before the clients stop sending
ENDS_WITHIN_S = 30.0  # every request ends this long after the fault or after its own start
READ_TIMEOUT_S = 90.0  # a request waiting longer than this for a byte counts as hung
BASE = 18840  # ports 18840-18859: no other test uses them
NAME = "faults-2p2d"
FAULTS = [("kill-prefill", "prefill-0", signal.SIGKILL), ("stop-prefill", "prefill-0", signal.SIGSTOP),
          ("kill-decode", "decode-0", signal.SIGKILL), ("stop-decode", "decode-0", signal.SIGSTOP)]
ROUTER_COUNTS = ("kvpush_router_retries_total", "kvpush_router_fallbacks_total")  # per fault, in its result line
PROBES = full_length_prompts(2, PROMPT_TOKENS, seed=11)  # answered before the faults and after the last
TOPOLOGY = """
name: {name}
platform: cpu
model: {{path: {model}, served_name: tiny, max_model_len: 2048, enforce_eager: true, dtype: float32,
         extra_args: ["--no-enable-prefix-caching"]}}
connector: {{type: kvpush, backend: UCX}}
hosts:
  local: {{address: 127.0.0.1, workdir: {workdir}}}
prefill:
  - {{cpu_cores: "0", share_cores: true, kv_cache_gib: {kv_cache_gib}, http_port: {b0}, side_channel_port: {b10}}}
  - {{cpu_cores: "1", share_cores: true, kv_cache_gib: {kv_cache_gib}, http_port: {b1}, side_channel_port: {b11}}}
decode:
  - {{cpu_cores: "0", share_cores: true, kv_cache_gib: {kv_cache_gib}, http_port: {b2}, side_channel_port: {b12}}}
  - {{cpu_cores: "1", share_cores: true, kv_cache_gib: {kv_cache_gib}, http_port: {b3}, side_channel_port: {b13}}}
router: {{port: {b4}, cpu_cores: "0-1", policy: least-loaded}}
env: {{UCX_MODULES: "^ib", UCX_MEM_EVENTS: "no"}}
"""
# Prefix caching off: a probe sent twice is computed (and transferred) twice, not served from cache.


@dataclass
class Outcome:
    start: float
    end: float
    first_token_at: float | None  # None: it ended before a first streamed token (always, not streamed)
    answered: bool  # HTTP 200, every token (finish_reason length), [DONE], no error event
    detail: str = ""  # the answer's text once answered, else what went wrong
    prompt: tuple[int, ...] = ()
    streamed: bool = True

    @property
    def failed_before_streaming(self) -> bool:
        return not self.answered and self.first_token_at is None

    @property
    def failed_after_streaming(self) -> bool:
        return not self.answered and self.first_token_at is not None

    @property
    def hung(self) -> bool:
        return "timed out" in self.detail


def stream(url: str, prompt: list[int]) -> Outcome:
    start, first, finish, done, text = time.monotonic(), None, None, False, ""

    def ended(answered: bool, detail: str) -> Outcome:
        return Outcome(start, time.monotonic(), first, answered, detail, tuple(prompt))

    try:
        with urllib.request.urlopen(completion_request(url, prompt, stream=True), timeout=READ_TIMEOUT_S) as response:
            for line in response:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return ended(False, f"error event: {line[:160]!r}")
                for choice in event.get("choices", []):
                    first = first or time.monotonic()
                    text += choice.get("text") or ""
                    finish = choice.get("finish_reason") or finish
        answered = done and finish == "length"  # all MAX_TOKENS tokens (ignore_eos)
        return ended(answered, text if answered else f"finish={finish}, done={done}")
    except urllib.error.HTTPError as exc:
        return ended(False, f"{exc.code}: {exc.read().decode(errors='replace')[:160]}")
    except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, reset, timed out, a cut-off stream
        return ended(False, f"{type(exc).__name__}: {exc}")


def plain(url: str, prompt: list[int]) -> Outcome:
    """A non-streamed completion: answered, or failed as a whole (it never streams)."""
    start = time.monotonic()

    def ended(answered: bool, detail: str) -> Outcome:
        return Outcome(start, time.monotonic(), None, answered, detail, tuple(prompt), streamed=False)

    try:
        with urllib.request.urlopen(completion_request(url, prompt), timeout=READ_TIMEOUT_S) as response:
            choice = json.loads(response.read())["choices"][0]
        finish = choice.get("finish_reason")
        return ended(finish == "length", choice["text"] if finish == "length" else f"finish={finish}")
    except urllib.error.HTTPError as exc:
        return ended(False, f"{exc.code}: {exc.read().decode(errors='replace')[:160]}")
    except (OSError, ValueError, LookupError, TypeError, http.client.HTTPException) as exc:
        return ended(False, f"{type(exc).__name__}: {exc}")


def either(url: str, prompt: list[int]) -> Outcome:
    """About half the requests streamed, half not (by the random prompt's first token)."""
    return stream(url, prompt) if prompt[0] % 2 else plain(url, prompt)


def reference_answers(url: str, prompts: list[tuple[int, ...]]) -> list[str]:
    """The plain vLLM server's answers to `prompts`, several at a time (it batches them)."""
    def answer(prompt: tuple[int, ...]) -> str:
        outcome = plain(url, list(prompt))
        assert outcome.answered, outcome.detail
        return outcome.detail

    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(answer, prompts))


def failed_load_as_real_vllm_answers(decode_url: str, headers: dict[str, str]) -> None:
    """A decode leg whose KV load fails at once (it names a prefill the connector does not allow):
    real vLLM answers it, not streamed and streamed, as the router reads a failed KV load."""
    params = PushParams(CONSUMER, f"load-probe-{uuid.uuid4().hex}", "not-a-prefill", "127.0.0.1", 1).to_dict()
    body = {"model": "tiny", "prompt": PROBES[0][:32], "max_tokens": 4, "temperature": 0.0, "kv_transfer_params": params}

    def request(b: dict) -> urllib.request.Request:
        return urllib.request.Request(decode_url + "/v1/completions", json.dumps(b).encode(),
                                      {"Content-Type": "application/json", **headers})

    try:
        with urllib.request.urlopen(request(body), timeout=60) as response:
            raise AssertionError(f"a failed KV load was answered {response.status}: {response.read()[:300]!r}")
    except urllib.error.HTTPError as exc:
        answer = exc.read()
        assert failure_kind(exc.code, answer) == GENERATION, (exc.code, answer)
    body = {**body, "stream": True, "kv_transfer_params": {**params, "transfer_id": f"load-probe-{uuid.uuid4().hex}"}}
    with urllib.request.urlopen(request(body), timeout=60) as response:
        assert response.status == 200
        events = [e for e in response.read().split(b"\n\n") if e.startswith(b"data: ")]
    errors = [e for e in events if classify_event(e) == "error"]
    assert errors and event_failure_kind(errors[0]) == GENERATION, events
    assert not [e for e in events if classify_event(e) == "token"], events


def _router_metric(router_url: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(router_url + "/metrics", timeout=10) as r:
        return metric_sum(r.read().decode(), name, **labels) or 0.0


def _all_in_rotation(router_url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (n := _router_metric(router_url, "kvpush_router_instance_in_rotation")) != 4:
        assert time.monotonic() < deadline, f"{n:.0f} of 4 instances in rotation"
        time.sleep(0.5)


def _inject(victim: str, sig: int, pid: int) -> float:
    """The fault; returns when it hit. SIGSTOP stops the whole instance (API server and engine core,
    as a hung GPU would) for STOPPED_FOR_S, checks `status` shows it hung, then SIGCONTs it."""
    if sig == signal.SIGKILL:
        fault_at = kill_until_shown_dead(NAME, victim, pid)
        shown = cli_status(NAME)
        assert shown.returncode == 1 and f"{victim}: died at" in shown.stderr, shown
        return fault_at

    def shown_hung() -> None:
        row = status_rows(NAME)[victim]
        assert row.process == "hung", row

    return hang_instance(pid, STOPPED_FOR_S, 2.5, shown_hung)[0]


def _table(results: list[dict]) -> str:
    head = ["fault", "requests", "answered", "not streamed (answered)", "failed before 1st token",
            "failed after streaming", "victim legs at fault", "all ended after fault (s)", "`up` (s)"]
    rows = [[r["fault"], r["requests"], r["answered"], f'{r["not_streamed"]} ({r["not_streamed_answered"]})',
             r["failed_before_streaming"], r["failed_after_streaming"], r["victim_legs_at_fault"],
             r["all_ended_after_fault_s"], r.get("up_s", "-")] for r in results]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(x).rjust(w) for x, w in zip(row, widths)) for row in [head, *rows])


def test_losing_one_prefill_then_one_decode_under_load_fails_no_request_not_yet_streaming(model_dir, reference_server,
                                                                                          tmp_path, state_dir):
    ports = {f"b{i}": BASE + i for i in range(20)}
    topo = parse_topology(TOPOLOGY.format(name=NAME, model=model_dir, workdir=tmp_path, kv_cache_gib=KV_CACHE_GIB, **ports))
    plan = build_plan(topo)
    used = [p for proc in plan.processes() for p in [proc.http_port, *proc.side_channel_ports]]
    options = LifecycleOptions(provision=False, ready_timeout_s=600, stop_timeout_s=15)
    results: list[dict] = []
    compared: list[Outcome] = []  # the answers given under the SIGKILL of prefill-0
    load = None
    try:
        up(topo, options)
        _all_in_rotation(plan.router_url)
        before = [stream(plan.router_url, p) for p in PROBES]
        assert all(o.answered for o in before), before
        failed_load_as_real_vllm_answers(plan.process("decode-0").base_url, observed_keys(NAME, topo).headers("decode"))
        for n, (fault, victim, sig) in enumerate(FAULTS):
            pids_before = {name: (r.supervisor_pid, r.pid) for name, r in status_rows(NAME).items()}
            counted_before = {m: _router_metric(plan.router_url, m) for m in ROUTER_COUNTS}
            load = Load(plan.router_url, seed=BASE + n, send=either)
            time.sleep(LOAD_BEFORE_FAULT_S)
            victim_legs = _router_metric(plan.router_url, "kvpush_router_inflight", instance=victim)
            fault_at = _inject(victim, sig, pids_before[victim][1])
            time.sleep(LOAD_AFTER_FAULT_S)
            outcomes, load = load.stop(ENDS_WITHIN_S + READ_TIMEOUT_S), None
            counted = {m: int(_router_metric(plan.router_url, m) - counted_before[m]) for m in ROUTER_COUNTS}

            in_flight = [o for o in outcomes if o.start < fault_at < o.end]
            errors = sorted({o.detail[:120] for o in outcomes if not o.answered})
            result = {
                "fault": fault, "requests": len(outcomes), "answered": sum(o.answered for o in outcomes),
                "failed_before_streaming": sum(o.failed_before_streaming for o in outcomes),
                "failed_after_streaming": sum(o.failed_after_streaming for o in outcomes),
                "not_streamed": sum(not o.streamed for o in outcomes),
                "not_streamed_answered": sum(o.answered and not o.streamed for o in outcomes),
                "in_flight_at_fault": len(in_flight), "victim_legs_at_fault": int(victim_legs),
                "all_ended_after_fault_s": round(max(o.end for o in outcomes) - fault_at, 1),
                "slowest_end_after_fault_s": round(max(o.end - max(o.start, fault_at) for o in outcomes if o.end > fault_at), 1),
                "router_retries": counted["kvpush_router_retries_total"],
                "router_fallbacks": counted["kvpush_router_fallbacks_total"], "errors": errors[:4]}
            results.append(result)
            print(f"\n2p2d fault result: {json.dumps(result)}", file=sys.stderr)
            assert in_flight, f"{fault}: the fault hit no request in flight"
            assert not [o for o in outcomes if o.hung], f"{fault}: a request hung"
            assert result["failed_before_streaming"] == 0, (fault, errors)
            assert result["slowest_end_after_fault_s"] <= ENDS_WITHIN_S, result
            if fault == "kill-prefill":
                compared = [o for o in outcomes if o.answered]

            began = time.monotonic()
            if sig == signal.SIGSTOP:
                wait_healthy(NAME, victim, 60)
            changes = up(topo, options).changes
            result["up_s"] = round(time.monotonic() - began, 1)
            if sig == signal.SIGSTOP:
                assert changes.nothing_to_do, changes
            else:
                assert changes.revive == [victim] and not (changes.start or changes.restart or changes.stop), changes
            rows = status_rows(NAME)
            assert all(r.healthy for r in rows.values()), rows
            for other, pids in pids_before.items():
                if other != victim or sig == signal.SIGSTOP:
                    assert (rows[other].supervisor_pid, rows[other].pid) == pids, f"{fault}: `up` restarted {other}"
            _all_in_rotation(plan.router_url)
        after = [stream(plan.router_url, p) for p in PROBES]
        assert [o.detail for o in after] == [o.detail for o in before]
    finally:
        if load is not None:
            load.stop(ENDS_WITHIN_S + READ_TIMEOUT_S)
        stopped = down(NAME, options)
        if results:
            print("\n" + _table(results), file=sys.stderr)
    assert stopped.complete, stopped
    left = processes_under(str(tmp_path))
    kill_leftovers(str(tmp_path))
    assert left == [], f"processes of the deployment left: {[p.info['cmdline'][:4] for p in left]}"
    assert [p for p in used if not port_free(p)] == []
    reference = reference_server.url_for(plan.process("decode-0"))  # started now: the deployment is down
    expected = reference_answers(reference, [o.prompt for o in compared])
    differing = [(o.streamed, o.detail[:60], e[:60]) for o, e in zip(compared, expected) if o.detail != e]
    assert not differing, f"{len(differing)} of {len(compared)} answers differ from the plain server's: {differing[:3]}"
