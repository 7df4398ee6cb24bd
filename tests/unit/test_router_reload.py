"""`up`'s side of a live instance change: the list written, SIGHUP sent, the router's word awaited."""
from __future__ import annotations

import pytest

from kvpush.deploy.lifecycle import router_reload
from kvpush.deploy.lifecycle.changes import diff_deployment, launch_digest, reload_digest
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.lifecycle.router_reload import hand_over, planned_list, reload_router, without
from kvpush.deploy.runners.base import HttpResponse
from kvpush.deploy.lifecycle.secrets import AccessKeys
from kvpush.deploy.lifecycle.state import DeploymentState, ProcessRecord
from kvpush.deploy.topology.topology import parse_topology
from kvpush.router.instances import InstanceList

TOPOLOGY = """
name: t
model: {path: /m, served_name: tiny}
connector: {type: nixl-pull}
hosts: {a: {address: 10.0.0.1}, b: {address: 10.0.0.2}}
prefill: [{host: a}]
decode: [{host: b}]
router: {host: a}
"""
TWO_DECODES = TOPOLOGY.replace("decode: [{host: b}]", "decode: [{host: b}, {host: b, name: decode-1}]")


class RouterHost:
    """A host whose router takes a written list after `confirm_after` reads of its /metrics, and
    whose removed instances carry `busy[name]` legs for that many reads more."""

    def __init__(self, confirm_after: int = 1, busy: dict[str, int] | None = None, answers: bool = True):
        self.written: list[tuple[str, InstanceList]] = []
        self.signals: list[tuple[list[int], str]] = []
        self.actions: list[str] = []
        self.serving: str | None = None
        self.confirm_after, self.busy, self.answers = confirm_after, dict(busy or {}), answers
        self.reads_since_signal = 0

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.written.append((path, InstanceList.model_validate_json(data)))
        self.actions.append("write")

    def signal_groups(self, pgids: list[int], signal_name: str) -> None:
        self.signals.append((pgids, signal_name))
        self.actions.append(signal_name)
        self.reads_since_signal = 0

    def http(self, method, url, body=None, timeout=5.0, headers=None) -> HttpResponse:
        assert url == "http://10.0.0.1:8000/metrics"
        if not self.answers:
            raise OSError("connection refused")
        self.reads_since_signal += 1
        if self.reads_since_signal >= self.confirm_after and self.signals:
            self.serving = self.written[-1][1].digest()
        lines = [f'kvpush_router_instance_list{{digest="{self.serving}"}} 1.0'] if self.serving else []
        for name in list(self.busy):
            lines.append(f'kvpush_router_draining{{instance="{name}",role="decode"}} {float(min(self.busy[name], 1))}')
            self.busy[name] = max(0, self.busy[name] - 1)
        return HttpResponse(200, ("\n".join(lines) + "\n").encode())


class Notes:
    def __init__(self):
        self.lines: list[str] = []

    def note(self, message: str) -> None:
        self.lines.append(message)

    def process(self, name, status, done=False) -> None: ...


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    monkeypatch.setattr(router_reload, "POLL_S", 0.0)


def router_record() -> ProcessRecord:
    return ProcessRecord(name="router", role="router", host="a", pid=7, pgid=7, start_time=1.0, http_port=8000,
                         health_url="http://10.0.0.1:8000/health", log_path="r.log", digest="d", started_at=0.0)


def listed(*decodes: str) -> InstanceList:
    full = planned_list(build_plan(parse_topology(TWO_DECODES)))
    return InstanceList(prefill=full.prefill, decode=[u for u in full.decode if u.name in decodes])


def test_the_list_is_written_before_the_routers_group_is_signalled_and_its_word_awaited():
    host, notes = RouterHost(confirm_after=3), Notes()
    result = reload_router(host, router_record(), "~/w/router-instances.json", listed("decode-0"), AccessKeys(), [], 5, notes)
    assert host.actions == ["write", "HUP"] and host.signals == [([7], "HUP")]
    assert host.written[0][0] == "~/w/router-instances.json"
    assert result.took and result.drained and host.reads_since_signal == 3


def test_an_instance_that_leaves_is_waited_for_until_it_carries_nothing():
    host, notes = RouterHost(busy={"decode-1": 4}), Notes()
    result = reload_router(host, router_record(), "f", listed("decode-0"), AccessKeys(), ["decode-1"], 60, notes)
    assert result.took and result.drained and host.busy == {"decode-1": 0}
    assert any("decode-1 out of rotation" in line for line in notes.lines)


def test_the_drain_wait_is_bounded_and_says_what_was_still_in_flight():
    host, notes = RouterHost(busy={"decode-1": 10**6}), Notes()
    result = reload_router(host, router_record(), "f", listed("decode-0"), AccessKeys(), ["decode-1"], 0.0, notes)
    assert result.took and not result.drained and result.still_busy == {"decode-1": 1.0}
    assert "stopping decode-1 (1 in flight) after waiting 0 s" in notes.lines[-1]


def test_a_router_that_never_confirms_is_noted_and_up_goes_on(monkeypatch):
    monkeypatch.setattr(router_reload, "RELOAD_CONFIRM_S", 0.0)
    host, notes = RouterHost(answers=False), Notes()
    result = reload_router(host, router_record(), "f", listed("decode-0"), AccessKeys(), ["decode-1"], 60, notes)
    assert not result.took and not result.drained
    assert "did not confirm its new instance list" in notes.lines[-1]


def _deployed(text: str) -> DeploymentState:
    plan = build_plan(parse_topology(text))
    state = DeploymentState(plan.deployment)
    for host in plan.hosts:
        for proc in host.processes:
            state.processes[proc.name] = ProcessRecord(
                name=proc.name, role=proc.role, host=host.name, pid=100, pgid=100, start_time=1000.0,
                http_port=proc.http_port, health_url=proc.health_url, log_path=proc.log_path,
                digest=launch_digest(host, proc), started_at=0.0, reload_digest=reload_digest(host, proc))
    state.processes["router"].health_url = "http://10.0.0.1:8000/health"
    return state


def _change(before: str, after: str, tmp_path, monkeypatch):
    monkeypatch.setenv("KVPUSH_STATE_DIR", str(tmp_path))
    state = _deployed(before)
    plan = build_plan(parse_topology(after))
    running = {n: True for n in state.processes}
    return plan, state, diff_deployment(plan, state, running), running


def test_an_added_instance_enters_the_routers_list_with_no_drain_and_the_reload_is_recorded(tmp_path, monkeypatch):
    plan, state, changes, running = _change(TOPOLOGY, TWO_DECODES, tmp_path, monkeypatch)
    host = RouterHost()
    when_ready = hand_over({"a": host, "b": None}, plan, state, changes, running, AccessKeys(), 60, Notes())
    assert [n for n in (u.name for u in host.written[0][1].decode)] == ["decode-0", "decode-1"]
    assert state.processes["router"].reload_digest != reload_digest(plan.hosts[0], plan.process("router"))
    when_ready()
    assert len(host.written) == 1  # the list it took already was the whole one
    router_host = next(h for h in plan.hosts if h.name == "a")
    assert state.processes["router"].reload_digest == reload_digest(router_host, plan.process("router"))


def test_a_removed_instance_leaves_the_list_and_drains_before_anything_stops(tmp_path, monkeypatch):
    plan, state, changes, running = _change(TWO_DECODES, TOPOLOGY, tmp_path, monkeypatch)
    assert changes.stop == ["decode-1"]
    host = RouterHost(busy={"decode-1": 3})
    hand_over({"a": host, "b": None}, plan, state, changes, running, AccessKeys(), 60, Notes())
    assert [u.name for u in host.written[0][1].decode] == ["decode-0"] and host.busy == {"decode-1": 0}


def test_a_restarted_instance_leaves_the_list_and_comes_back_once_it_is_ready(tmp_path, monkeypatch):
    changed = TOPOLOGY.replace("decode: [{host: b}]", "decode: [{host: b, env: {X: '1'}}]")
    plan, state, changes, running = _change(TWO_DECODES, changed.replace(
        "decode: [{host: b, env: {X: '1'}}]", "decode: [{host: b, env: {X: '1'}}, {host: b, name: decode-1}]"),
        tmp_path, monkeypatch)
    assert changes.restart == ["decode-0"] and sorted(changes.keep) == ["decode-1", "prefill-0", "router"]
    host = RouterHost(busy={"decode-0": 2})
    when_ready = hand_over({"a": host, "b": None}, plan, state, changes, running, AccessKeys(), 60, Notes())
    assert [u.name for u in host.written[0][1].decode] == ["decode-1"] and host.busy == {"decode-0": 0}
    when_ready()
    assert [u.name for u in host.written[1][1].decode] == ["decode-0", "decode-1"]
    assert host.signals == [([100], "HUP"), ([100], "HUP")]


def test_nothing_is_sent_when_the_router_itself_restarts_or_nothing_concerns_it(tmp_path, monkeypatch):
    plan, state, changes, running = _change(TOPOLOGY, TWO_DECODES.replace("router: {host: a}", "router: {host: a, workers: 2}"),
                                            tmp_path, monkeypatch)
    assert "router" in changes.restart
    host = RouterHost()
    hand_over({"a": host}, plan, state, changes, running, AccessKeys(), 60, Notes())()
    plan, state, changes, running = _change(TOPOLOGY, TOPOLOGY, tmp_path, monkeypatch)
    hand_over({"a": host}, plan, state, changes, running, AccessKeys(), 60, Notes())()
    assert host.actions == []


def test_without_drops_named_instances_of_either_role():
    full = listed("decode-0", "decode-1")
    assert [u.name for u in without(full, {"prefill-0", "decode-1"}).decode] == ["decode-0"]
    assert without(full, {"prefill-0"}).prefill == []
