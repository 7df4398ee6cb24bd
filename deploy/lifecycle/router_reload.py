"""`up`'s side of changing the instances behind a running router without failing requests.

The router reads its instance list again on SIGHUP (kvpush.router.instances): `up` writes the list,
signals the router's process group (its supervisor passes the signal on; every router process
reloads, a signal that reaches one twice changes nothing), and reads the router's /metrics until
every router process serves the new list and the instances that left it carry nothing more.
Both waits are bounded: a router that does not confirm, or an instance whose streams run on, is
noted and `up` goes on.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from kvpush.deploy.plan.plan import ROUTER_INSTANCES_FILE
from kvpush.deploy.plan.plan_model import HostPlan, Plan, ProcessPlan
from kvpush.deploy.runners import HostError, Runner
from kvpush.router.instances import InstanceList, ReloadProgress, reload_progress

from .changes import Changes, reload_digest
from .processes import Events
from .secrets import AccessKeys
from .state import DeploymentState, ProcessRecord, save_state

RELOAD_CONFIRM_S = 15.0  # a router takes a list in milliseconds; its workers each at their own signal
POLL_S = 0.2


@dataclass
class ReloadResult:
    took: bool  # every router process serves the list
    drained: bool = True  # the instances that left it carry nothing any more
    still_busy: dict[str, float] = field(default_factory=dict)  # instance -> legs and transfers left at the bound
    seconds: float = 0.0


def router_plan(plan: Plan) -> tuple[HostPlan, ProcessPlan]:
    for host in plan.hosts:
        for proc in host.processes:
            if proc.role == "router":
                return host, proc
    raise KeyError("router")


def planned_list(plan: Plan) -> InstanceList:
    host, _ = router_plan(plan)
    text = next(f.content for f in host.files if f.path.endswith("/" + ROUTER_INSTANCES_FILE))
    return InstanceList.model_validate_json(text)


def without(listed: InstanceList, names: set[str]) -> InstanceList:
    return InstanceList(prefill=[u for u in listed.prefill if u.name not in names],
                        decode=[u for u in listed.decode if u.name not in names])


def _progress(runner: Runner, record: ProcessRecord, keys: AccessKeys) -> ReloadProgress | None:
    url = record.base_url + "/metrics"
    try:
        response = runner.http("GET", url, timeout=5, headers=keys.headers("router"))
    except (OSError, HostError):
        return None
    return reload_progress(response.text()) if response.status == 200 else None


def reload_router(runner: Runner, record: ProcessRecord, path: str, listed: InstanceList, keys: AccessKeys,
                  leaving: list[str], drain_timeout_s: float, events: Events) -> ReloadResult:
    """Write `listed` to the router's instance list file, signal the router, wait until it serves
    the list and `leaving` drained (at most drain_timeout_s for the drain)."""
    began = time.monotonic()
    runner.write_file(path, listed.model_dump_json(indent=2).encode())
    runner.signal_groups([record.pgid], "HUP")
    digest = listed.digest()
    deadline = began + RELOAD_CONFIRM_S
    progress = _progress(runner, record, keys)
    while progress is None or not progress.took(digest):
        if time.monotonic() >= deadline:
            events.note(f"the router did not confirm its new instance list within {RELOAD_CONFIRM_S:g} s "
                        f"(see `kvpush logs router`); going on")
            return ReloadResult(took=False, drained=False, seconds=time.monotonic() - began)
        time.sleep(POLL_S)
        progress = _progress(runner, record, keys)
    if leaving:
        events.note(f"router: {', '.join(leaving)} out of rotation; waiting for what they carry to finish")
    deadline = time.monotonic() + drain_timeout_s
    busy = progress.left_on(leaving)
    while busy and time.monotonic() < deadline:
        time.sleep(POLL_S)
        progress = _progress(runner, record, keys) or progress
        busy = progress.left_on(leaving)
    if busy:
        events.note(f"stopping {', '.join(f'{n} ({v:.0f} in flight)' for n, v in busy.items())} after waiting "
                    f"{drain_timeout_s:g} s for it to drain")
    return ReloadResult(took=True, drained=not busy, still_busy=busy, seconds=time.monotonic() - began)


def hand_over(runners: dict[str, Runner], plan: Plan, state: DeploymentState, changes: Changes,
              running: dict[str, bool], keys: AccessKeys, drain_timeout_s: float,
              events: Events) -> Callable[[], None]:
    """With the router running on, before anything stops: give it the planned instance list without
    the instances that restart, and wait until what it sent to those and to the removed ones has
    finished. Returns what to do once the new processes are ready: give it the whole list (and
    record that it took it; if it did not, the next `up` sends it again)."""
    router_host, router_proc = router_plan(plan)
    record = state.processes.get(router_proc.name)
    leaving = [n for n in changes.stop + changes.restart
               if state.processes[n].role != "router" and running.get(n)]
    router_stays = router_proc.name in changes.keep + changes.reload
    if record is None or not router_stays or not (leaving or changes.reload):
        return lambda: None
    runner, path = runners[record.host], router_proc.reload_files[0]
    final = planned_list(plan)
    interim = without(final, set(changes.restart))
    first = reload_router(runner, record, path, interim, keys, leaving, drain_timeout_s, events)

    def whole_list() -> None:
        last = (
            first if interim == final else reload_router(runner, record, path, final, keys, [], drain_timeout_s, events)
        )
        if last.took:
            record.reload_digest = reload_digest(router_host, router_proc)
            save_state(state)

    return whole_list
