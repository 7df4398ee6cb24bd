"""`up` and `down`: execute the plan on the hosts, record it, wait for readiness, stop it again.

`up` runs as named steps: provision, look at what runs, clear what dead processes left behind,
doctor's gate, hand the instances that stop over to the others (a running router takes them out
of rotation and lets them drain), stop what is replaced, launch, wait until ready, give the router
its whole instance list, prove KV moves. Rendering stays in the CLI: this module reports through
an `Events` object.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from kvpush.common.deployment_secret import fingerprint as secret_fingerprint
from kvpush.common.errors import KvpushError
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.plan.plan_model import Plan
from kvpush.deploy.runners import Runner, SshOptions, fan_out, values_or_raise
from kvpush.deploy.topology.topology import Topology

from . import slurm_allocation
from .changes import Changes, diff_deployment
from .hosts import connected
from .process_view import ProcessView, view_deployment
from .processes import Events, StartFailure, prepare_host, start_on_host, stop_processes, stop_records, wait_ready
from .proof import Proof, prove_kv_transfer
from .provision import ProvisionResult, WheelSource, local_digest, provision_host
from .router_reload import hand_over
from .secrets import (
    AccessKeys,
    SecretDelivery,
    client_api_key,
    ensure_local_secret,
    forget_local_secret,
    read_user_secrets,
    remove_secret_files,
    restart_users_of,
)
from .state import DeploymentState, HostRecord, ProcessRecord, load_state, locked, remove_state, save_state

__all__ = ["DownResult", "Events", "LifecycleOptions", "Proof", "StartFailure", "UpResult", "down",
           "prove_kv_transfer", "stop_processes", "up"]


@dataclass(frozen=True)
class LifecycleOptions:
    ssh: SshOptions = field(default_factory=SshOptions)
    ready_timeout_s: float = 600.0
    stop_timeout_s: float = 20.0
    provision: bool = True
    prove: bool = True  # send one request through the router and check KV moved
    doctor: bool = True  # run doctor's fast checks first and refuse to launch on a failure
    rotate_secret: bool = False  # a new deployment secret (and keys); every process that reads one restarts
    drain_timeout_s: float = 60.0  # how long an instance that stops may finish what the router sent it


@dataclass
class UpResult:
    changes: Changes
    provisioned: list[ProvisionResult] = field(default_factory=list)
    ready_s: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0
    proof: Proof | None = None
    cleared: dict[str, list[str]] = field(default_factory=dict)  # process -> what it had left behind, stopped first


def _host_records(plan: Plan) -> dict[str, HostRecord]:
    return {h.name: HostRecord.from_plan(h) for h in plan.hosts}


# -- the steps of up --------------------------------------------------------------------------


def _provision(runners: dict[str, Runner], plan: Plan, events: Events) -> list[ProvisionResult]:
    digest = local_digest()
    wheel = WheelSource(digest)
    done = values_or_raise(
        fan_out(plan.hosts, lambda h: provision_host(runners[h.name], h, digest, wheel), name=lambda h: h.name)
    )
    for p in done.values():
        events.note(f"host {p.host}: {p.action} ({p.detail})")
    return list(done.values())


def _clear_leftovers(runners: dict[str, Runner], state: DeploymentState, views: dict[str, ProcessView],
                     options: LifecycleOptions, events: Events) -> dict[str, list[str]]:
    """Stop whatever is left of processes that are no longer up (an orphaned engine core, a
    supervisor still cleaning up), before doctor checks ports: what holds them is our own."""
    dead = [state.processes[n] for n, v in views.items() if not v.up and (v.leftovers or v.leader_running)]
    if not dead:
        return {}
    cleared = {r.name: [x.describe() for x in views[r.name].leftovers] for r in dead}
    for name, what in cleared.items():
        if what:
            events.note(f"stopping what {name} left behind: {'; '.join(what)}")
    _stop_or_raise(runners, dead, options.stop_timeout_s)
    return cleared


def _doctor_gate(topo: Topology, runners: dict[str, Runner], running: frozenset[str], events: Events) -> None:
    """Doctor's fast checks on every host before anything running stops or anything starts."""
    from kvpush.deploy.doctor import fast_checks

    events.process("doctor", "checking hosts")
    report = fast_checks(topo, runners, running=running)
    if report.failed:
        raise KvpushError(f"{report.first_failure_line()}; nothing was started (fix it, or pass --skip-doctor)")
    events.process("doctor", f"{len(report.results)} checks passed in {report.seconds:.1f} s", done=True)


def _stop_or_raise(runners: dict[str, Runner], records: list[ProcessRecord], timeout_s: float) -> None:
    left = stop_records(runners, records, timeout_s)
    if any(left.values()):
        raise KvpushError(
            f"could not stop {', '.join(n for names in left.values() for n in names)}; stop them by hand, then rerun"
        )


def _launch(runners: dict[str, Runner], plan: Plan, topo: Topology, state: DeploymentState, names: list[str],
            restarts: dict[str, int], options: LifecycleOptions, events: Events, result: UpResult,
            keys: AccessKeys, when_ready: Callable[[], None] = lambda: None) -> None:
    """Start `names`, record them, wait until ready, call `when_ready`, prove KV moves; on a failure
    stop what this started."""
    launch = set(names)
    launch_hosts = [h for h in plan.hosts if launch & {p.name for p in h.processes}]
    values_or_raise(fan_out(launch_hosts, lambda h: prepare_host(runners[h.name], h, topo), name=lambda h: h.name))
    started_at = time.monotonic()
    for name in launch:
        events.process(name, "starting")
    outcomes = fan_out(launch_hosts, lambda h: start_on_host(runners[h.name], h, sorted(launch)), name=lambda h: h.name)
    started = {n: r for o in outcomes.values() if o.ok for n, r in o.ok_value.items()}
    new_records = {p.name: started[p.name] for p in plan.processes() if p.name in started}
    for name, record in new_records.items():
        record.restarts = restarts.get(name, 0)
    state.processes.update(new_records)
    save_state(state)
    try:
        values_or_raise(outcomes)
        result.ready_s = wait_ready(
            runners, list(new_records.values()), options.ready_timeout_s, events, started_at, keys
        )
        when_ready()
        if options.prove and plan.connector != "colocated":
            events.process("proof", "one request through the router")
            result.proof = prove_kv_transfer(runners, plan, keys=keys)
            events.process("proof", f"KV moved: {result.proof.external_kv_tokens:.0f} prompt tokens", done=True)
    except KvpushError:
        events.note(f"stopping the {len(new_records)} process(es) this `up` started")
        stop_records(runners, list(new_records.values()), options.stop_timeout_s)
        for name in new_records:
            state.processes.pop(name, None)
        save_state(state)
        raise


# -- up / down ---------------------------------------------------------------------------------


def up(topo: Topology, options: LifecycleOptions = LifecycleOptions(), events: Events = Events()) -> UpResult:
    try:
        return _up(topo, options, events)
    except KvpushError:
        if topo.launcher == "slurm":  # a job this `up` submitted and nothing runs in: not left held
            with locked(topo.name):
                note = slurm_allocation.release_if_idle(topo.name)
            if note:
                events.note(note)
        raise


def _up(topo: Topology, options: LifecycleOptions, events: Events) -> UpResult:
    begun = time.monotonic()
    plan = build_plan(topo)
    client_key = client_api_key(topo)  # an unset variable is bad input: refused before anything is touched
    user_secrets = read_user_secrets(topo.secrets)  # likewise
    with locked(plan.deployment):
        secret, new_secret = ensure_local_secret(plan.deployment, options.rotate_secret)
        keys = AccessKeys.of(secret, client_key)
        delivery = SecretDelivery(plan, secret, keys, user_secrets)
        if new_secret:
            events.note(f"deployment secret: made a new one (fingerprint {secret_fingerprint(secret)})")
        state = load_state(plan.deployment) or DeploymentState(plan.deployment)
        if topo.launcher == "slurm":  # the hosts are the nodes of a running job, found or submitted
            topo = slurm_allocation.allocate(topo, state, events)
            plan = build_plan(topo)
            delivery = SecretDelivery(plan, secret, keys, user_secrets)
        hosts = _host_records(plan)
        # Hosts that only the old state knows still need connecting: their processes may have to stop.
        all_hosts = {**state.hosts, **hosts}
        with connected(all_hosts, options.ssh) as (runners, unreachable):
            if unreachable:
                raise KvpushError("cannot reach every host, nothing was started: " + "; ".join(unreachable.values()))
            result = UpResult(changes=Changes())
            if options.provision:
                result.provisioned = _provision(runners, plan, events)

            views = view_deployment(runners, state)
            running = {name: view.up for name, view in views.items()}
            changes = result.changes = diff_deployment(plan, state, running)
            stale = delivery.stale(runners)
            restart_users_of(stale, changes)  # a new secret or key reaches a process only at its start
            if changes.nothing_to_do:
                delivery.write(runners, stale)  # files that no running process reads
                events.note(f"deployment {plan.deployment} is up and unchanged; nothing to do")
                result.total_s = time.monotonic() - begun
                return result
            for line in changes.lines():
                events.note(line)
            result.cleared = _clear_leftovers(runners, state, views, options, events)
            if options.doctor:
                _doctor_gate(topo, runners, frozenset(n for n, alive in running.items() if alive), events)
            when_ready = hand_over(runners, plan, state, changes, running, keys, options.drain_timeout_s, events)

            # Stop what is removed or changed (what died is stopped already), and forget them.
            old = [state.processes[n] for n in changes.stop + changes.restart + changes.revive]
            _stop_or_raise(runners, [r for r in old if running.get(r.name)], options.stop_timeout_s)
            restarts = {
                n: state.processes[n].restarts + views[n].supervisor_restarts + 1
                for n in changes.restart + changes.revive
            }
            for r in old:
                del state.processes[r.name]
            state.hosts = {**{n: h for n, h in state.hosts.items() if state.processes_on(n)}, **hosts}
            state.plan_hash = plan.topology_digest
            save_state(state)
            delivery.write(runners, stale)
            _launch(runners, plan, topo, state, changes.to_launch, restarts, options, events, result, keys, when_ready)
    result.total_s = time.monotonic() - begun
    return result


@dataclass
class DownResult:
    stopped: list[str] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)  # host -> error (processes still recorded there)
    left_running: list[str] = field(default_factory=list)
    had_state: bool = True
    notes: list[str] = field(default_factory=list)  # e.g. the Slurm job it found ended or cancelled
    secrets_removed: dict[str, list[str]] = field(default_factory=dict)  # host -> the secret files removed there
    secrets_left: dict[str, str] = field(default_factory=dict)  # host -> why its secret files are still there
    forgot_secret: bool = False  # the secret kept on this machine was deleted (forget_secret)

    @property
    def complete(self) -> bool:
        return not self.unreachable and not self.left_running and not self.secrets_left


def down(deployment: str, options: LifecycleOptions = LifecycleOptions(), events: Events = Events(),
         forget_secret: bool = False) -> DownResult:
    """Stop every process, remove the deployment's secret files from every host where nothing of
    it runs any more, then forget it (and, with forget_secret, the secret kept on this machine)."""
    with locked(deployment):
        state = load_state(deployment)
        result = _down(deployment, state, options)
        if forget_secret and load_state(deployment) is None:  # kept while anything of it is still recorded
            result.forgot_secret = forget_local_secret(deployment)
        return result


def _down(deployment: str, state: DeploymentState | None, options: LifecycleOptions) -> DownResult:
    if state is None:
        return DownResult(had_state=False)
    ended = slurm_allocation.ended_message(state)
    if ended is not None:  # nothing of it can run, and no job reaches its nodes: forget it
        remove_state(deployment)
        where = "; ".join(f"{r.workdir} on {h}" for h, r in state.hosts.items())
        return DownResult(had_state=True, notes=[ended] + ([f"its secret files remain in {where} (no job reaches those "
                                                             "nodes now); remove them by hand"] if where else []))
    result = DownResult()
    with connected(state.hosts, options.ssh) as (runners, unreachable):
        left = stop_records(runners, [r for r in state.processes.values() if r.host in runners], options.stop_timeout_s)
        for names in left.values():
            result.left_running += names
        for r in list(state.processes.values()):
            if r.host in runners and r.name not in result.left_running:
                result.stopped.append(r.name)
                del state.processes[r.name]
        result.unreachable = {h: e for h, e in unreachable.items() if state.processes_on(h)}
        result.secrets_left = {h: f"not reached ({e}); remove its secret files in {state.hosts[h].workdir} by hand"
                               for h, e in unreachable.items() if not state.processes_on(h)}
        clear = [h for h in runners if not state.processes_on(h)]  # a process still there may read them yet
        for host, outcome in fan_out(clear, lambda h: remove_secret_files(runners[h], state.hosts[h].workdir)).items():
            if outcome.ok:
                result.secrets_removed[host] = outcome.ok_value
            else:
                result.secrets_left[host] = str(outcome.error)
    if state.processes:
        save_state(state)  # what could not be stopped stays recorded for the next `down`
    else:
        released = slurm_allocation.release(state)
        result.notes += [released] if released else []
        remove_state(deployment)
    return result
