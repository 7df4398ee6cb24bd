"""Faults under load on real vLLM 1P1D on CPU (the local-cpu shape), through `kvpush up`, `status`
and `down`: SIGKILL of prefill, of decode, of the router, and SIGSTOP/SIGCONT of prefill, and SIGKILL
of a prefill whose supervisor restarts it. The four faults that `up` repairs take the session's
pooled kvpush 1P1D (tests/pool_topologies.py `pool-kvpush`, which the connector and router tests
share): each test brings it up (a no-op while the previous test left it healthy, a revival after a
test that broke it), breaks it, repairs it and proves it healthy with the same answers as before; a
test that fails before that proof has the pool take it down, so the next test starts a fresh one.
The restart-policy fault has a deployment of its own (another topology), stopped with `down` after
which nothing of it may be left; the pool checks the same of its deployments at the end.

Per fault: 32 clients send requests of 1,500 prompt tokens and 48 output tokens back to back; the
fault hits a few seconds into that load, and the load goes on through recovery. Every request must
end (answer or clear error) within 30 s of the fault or of its own start; `status` must exit 1 and
say what happened; `up` right after, under the load, must bring the victim back without touching
the others (same PIDs), every request after it must be answered, and greedy answers (float32) must
equal those before. After `down` no process of a deployment is left and no port is held.

With KVPUSH_FAULT_RESULTS=FILE each test appends its numbers to FILE as one JSON line
(docs/faults.md is made from them). Heavy: run under `flock /tmp/kvpush-heavy.lock`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvpush.deploy.lifecycle.lifecycle import LifecycleOptions, down, up
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.plan.plan_model import Plan
from kvpush.deploy.topology.topology import Topology, parse_topology
from deployment_slot import DeploymentSlot
from e2e_instances import KV_CACHE_GIB
from fault_helpers import cli_status, hang_instance, kill_until_shown_dead, port_free, status_rows, wait_healthy
from fault_load import LOAD_BEFORE_FAULT_S, PROMPT_TOKENS, Load, completion_request
from lifecycle_helpers import kill_leftovers, processes_under
from random_prompts import full_length_prompts

AFTER_RECOVERY_S = 5.0  # clients go on sending through the fault and `up`, and this long after it
STOPPED_FOR_S = 8.0  # SIGSTOP to SIGCONT
ENDS_WITHIN_S = 30.0
UP_WITHIN_S = 120.0
PROBES = full_length_prompts(4, PROMPT_TOKENS, seed=7)  # answered before the fault and after `up`
# name -> (victim, signal, deployment): the faults `up` repairs share one deployment.
FAULTS = {
    "kill-prefill": ("prefill-0", signal.SIGKILL, "repaired-by-up"),
    "kill-decode": ("decode-0", signal.SIGKILL, "repaired-by-up"),
    "kill-router": ("router", signal.SIGKILL, "repaired-by-up"),
    "stop-prefill": ("prefill-0", signal.SIGSTOP, "repaired-by-up"),
    # prefill with `restart: on-failure`: its supervisor brings it back, nobody runs `up`
    "kill-prefill-restart-policy": ("prefill-0", signal.SIGKILL, "restart-policy"),
}
POOLED = "pool-kvpush"  # tests/pool_topologies.py: the same 1P1D, shared with the connector and router tests
PORT_BASE = {"restart-policy": 18780}
OPTIONS = LifecycleOptions(provision=False, ready_timeout_s=400, stop_timeout_s=15)
RESTART_POLICY = "{policy: on-failure, max_restarts: 3, window_s: 600}"
TOPOLOGY = """
name: {name}
platform: cpu
model: {{path: {model}, served_name: tiny, max_model_len: 2048, enforce_eager: true, dtype: float32,
         extra_args: ["--no-enable-prefix-caching"]}}
connector: {{type: kvpush, backend: UCX}}
hosts:
  local: {{address: 127.0.0.1, workdir: {workdir}}}
prefill: [{{cpu_cores: "0", kv_cache_gib: {kv_cache_gib}, http_port: {base}, side_channel_port: {side}, restart: {restart}}}]
decode: [{{cpu_cores: "1", kv_cache_gib: {kv_cache_gib}, http_port: {decode_port}, side_channel_port: {decode_side}}}]
router: {{port: {router_port}, cpu_cores: "1"}}
env: {{UCX_MODULES: "^ib", UCX_MEM_EVENTS: "no"}}
"""
# Prefix caching off: a probe sent twice is computed (and transferred) twice, not served from cache.


@dataclass
class Outcome:
    start: float
    end: float
    status: int | None  # None: no HTTP answer (connection refused or reset, or timed out)
    text: str

    @property
    def timed_out(self) -> bool:
        return self.status is None and "timed out" in self.text


def complete(url: str, prompt: list[int], timeout_s: float = 90.0) -> Outcome:
    start = time.monotonic()
    try:
        with urllib.request.urlopen(completion_request(url, prompt), timeout=timeout_s) as response:
            text = json.loads(response.read())["choices"][0]["text"]
            return Outcome(start, time.monotonic(), response.status, text)
    except urllib.error.HTTPError as exc:
        return Outcome(start, time.monotonic(), exc.code, exc.read().decode(errors="replace")[:300])
    except (OSError, ValueError) as exc:  # refused, reset, timed out, a cut-off body
        return Outcome(start, time.monotonic(), None, f"{type(exc).__name__}: {exc}")


@dataclass(frozen=True)
class Deployment:
    topology: Topology
    plan: Plan
    workdir: Path

    @property
    def name(self) -> str:
        return self.topology.name


def _deployment(kind: str, model_dir: Path, workdir: Path) -> Deployment:
    base = PORT_BASE[kind]
    topo = parse_topology(TOPOLOGY.format(name=f"faults-{kind}", model=model_dir, workdir=workdir, base=base, side=base + 5,
                                          decode_port=base + 1, decode_side=base + 6, router_port=base + 2,
                                          restart=RESTART_POLICY, kv_cache_gib=KV_CACHE_GIB))
    return Deployment(topo, build_plan(topo), workdir)


def _stop(deployment: Deployment) -> None:
    """`down`, then nothing of the deployment may be left: no process, no port held."""
    ports = [p for proc in deployment.plan.processes() for p in [proc.http_port, *proc.side_channel_ports]]
    stopped = down(deployment.name, OPTIONS)
    left = processes_under(str(deployment.workdir))
    kill_leftovers(str(deployment.workdir))
    assert stopped.complete, stopped
    assert left == [], f"processes of the deployment left: {[p.info['cmdline'][:4] for p in left]}"
    assert [p for p in ports if not port_free(p)] == []


class PooledSlot:
    """The session's pooled kvpush 1P1D as the faults that `up` repairs use it: `shared()` hands it
    out healthy (started, or revived by `up`); `discard()` takes it down (a test left it in an
    unknown state), and the next `shared()` starts a fresh one; the pool takes it down at the end."""

    def __init__(self, pool):
        self._pool = pool

    def shared(self) -> Deployment:
        pooled = self._pool.ready(POOLED)
        return Deployment(pooled.topo, pooled.plan, pooled.workdir)

    def discard(self) -> None:
        self._pool.release(POOLED)


@pytest.fixture(scope="module")
def slots(model_dir, pool, tmp_path_factory):
    """The pooled deployment for the faults `up` repairs; the restart-policy one of this module's own."""
    workdir = tmp_path_factory.mktemp("restart-policy")
    own = DeploymentSlot("the restart-policy deployment", lambda: _deployment("restart-policy", model_dir, workdir), _stop)
    try:
        yield {"repaired-by-up": PooledSlot(pool), "restart-policy": own}
    finally:
        own.close()


def _record(numbers: dict) -> None:
    print("\nfault result: " + json.dumps(numbers), file=sys.stderr)
    path = os.environ.get("KVPUSH_FAULT_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(numbers) + "\n")


def _fault(name: str, victim: str, sig: int, pid: int, supervised: bool, numbers: dict) -> tuple[float, subprocess.CompletedProcess]:
    """Inject the fault; return its time and what `kvpush status` printed about it."""
    if sig == signal.SIGSTOP:
        def shown_hung() -> subprocess.CompletedProcess:
            shown = cli_status(name)
            row = status_rows(name)[victim]
            assert row.process == "hung" and row.health == "no answer", row
            return shown

        return hang_instance(pid, STOPPED_FOR_S, 2.0, shown_hung)
    if supervised:  # restarted in place: a new PID under the same supervisor
        fault_at = time.monotonic()
        os.kill(pid, sig)
        while (row := status_rows(name)[victim]).pid == pid:
            assert time.monotonic() < fault_at + 15, row
            time.sleep(0.2)
        numbers["restarted_after_s"] = round(time.monotonic() - fault_at, 1)
        return fault_at, cli_status(name)
    fault_at = kill_until_shown_dead(name, victim, pid)
    numbers["shown_dead_after_s"] = round(time.monotonic() - fault_at, 1)
    # At once, as a user would: its supervisor may still be stopping what it left (an orphaned engine core).
    shown = cli_status(name)
    assert "its supervisor is stopping what it left behind: pid" in shown.stderr or "nothing of it is left" in shown.stderr, shown.stderr
    return fault_at, shown


def _answered_again_at(outcomes: list[Outcome]) -> float | None:
    """The start of the first request from which on every request was answered; None if the last one failed."""
    again = None
    for o in outcomes:
        if o.status != 200:
            again = None
        elif again is None:
            again = o.start
    return again


@pytest.mark.parametrize("fault", list(FAULTS))
def test_fault_under_load(fault, slots):
    victim, sig, kind = FAULTS[fault]
    supervised = kind == "restart-policy"
    if kind == "repaired-by-up":
        slots["restart-policy"].close()  # one deployment under load at a time: two would share the two cores
    slot = slots[kind]
    deployment = slot.shared()
    topo, plan, name, options = deployment.topology, deployment.plan, deployment.name, OPTIONS
    numbers: dict = {"test": f"tests/e2e/test_faults_real_vllm.py::test_fault_under_load[{fault}]", "fault": fault}
    load = None
    proven = False
    try:
        up(topo, options)  # starts it, or nothing to do: the previous test left it healthy
        before = [complete(plan.router_url, p) for p in PROBES]
        assert all(o.status == 200 for o in before), before
        pids_before = {n: (r.supervisor_pid, r.pid) for n, r in status_rows(name).items()}

        load = Load(plan.router_url, seed=100 + list(FAULTS).index(fault), send=complete,  # fresh prompts per fault
                    backs_off=lambda o: o.status != 200)
        time.sleep(LOAD_BEFORE_FAULT_S)
        fault_at, shown = _fault(name, victim, sig, pids_before[victim][1], supervised, numbers)
        said = "ended (killed by SIGKILL)" if supervised else "hung" if sig == signal.SIGSTOP else "died at"
        assert shown.returncode == 1 and victim in shown.stdout, shown
        assert f"{victim}: {said}" in shown.stderr, shown.stderr
        numbers["status_says"] = next(line for line in shown.stderr.splitlines() if line.startswith(f"{victim}:"))

        if supervised:
            recovered_at = wait_healthy(name, victim, UP_WITHIN_S)
            numbers["healthy_again_after_s"] = round(recovered_at - fault_at, 1)
            assert up(topo, options).changes.nothing_to_do
        else:
            began = time.monotonic()  # `up` right away, under the same load, with doctor's gate
            result = up(topo, options)
            recovered_at = time.monotonic()
            numbers["up_s"] = round(recovered_at - began, 1)
            numbers["up_cleared_first"] = result.cleared  # what the dead process had left when `up` began
            if sig == signal.SIGSTOP:
                assert result.changes.nothing_to_do  # it runs again after SIGCONT
            else:
                assert result.changes.revive == [victim], result.changes
                assert numbers["up_s"] < UP_WITHIN_S
        time.sleep(AFTER_RECOVERY_S)
        outcomes, load = load.stop(ENDS_WITHIN_S + 30), None

        in_flight = [o for o in outcomes if o.start < fault_at < o.end]
        during = [o for o in outcomes if fault_at <= o.start < recovered_at]
        assert in_flight, "the fault hit no request in flight"
        assert not [o for o in outcomes if o.timed_out], "a request hung"
        slowest = max(o.end - max(o.start, fault_at) for o in outcomes if o.end > fault_at)
        assert slowest <= ENDS_WITHIN_S, f"a request ended {slowest:.1f} s after the fault (or after it started)"
        again = _answered_again_at(outcomes)
        assert again is not None, "requests still failed when the load ended"
        if sig != signal.SIGSTOP:
            assert again <= recovered_at, "requests failed after `up` had brought the victim back"
        errors = sorted({(o.status, o.text[:110]) for o in outcomes if o.status != 200})
        numbers.update(
            in_flight=len(in_flight), in_flight_ok=sum(o.status == 200 for o in in_flight),
            until_up_done=len(during), until_up_done_ok=sum(o.status == 200 for o in during),
            slowest_end_after_fault_s=round(slowest, 1), answered_again_after_s=round(max(0.0, again - fault_at), 1),
            errors=[f"{s or 'no HTTP answer'}: {t}" for s, t in errors][:6])

        rows = status_rows(name)
        assert all(r.healthy for r in rows.values()), rows
        for other, pids in pids_before.items():
            if other != victim or sig == signal.SIGSTOP:
                assert (rows[other].supervisor_pid, rows[other].pid) == pids, f"{other} was restarted"
        if supervised:
            assert rows[victim].supervisor_pid == pids_before[victim][0] and rows[victim].restarts == 1
        after = [complete(plan.router_url, p) for p in PROBES]
        assert [o.text for o in after] == [o.text for o in before]
        proven = True
    finally:
        if load is not None:
            load.stop(ENDS_WITHIN_S + 30)
        if not proven:
            slot.discard()  # in an unknown state: the next test starts a fresh one
    _record(numbers)
