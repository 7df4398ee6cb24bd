"""`up` and `down`: execute the plan on the hosts, record it, wait for readiness, stop it again.

Rendering stays in the CLI: this module reports through an `Events` object.
"""
from __future__ import annotations

import json
import random
import shlex
import time
from dataclasses import dataclass, field

from . import slurm_allocation
from .changes import Changes, diff_deployment, is_running, launch_digest
from kvpush.common.errors import KvpushError
from .hosts import connected
from .plan import HostPlan, Plan, build_plan
from .provision import ProvisionResult, WheelSource, local_digest, provision_host
from .runners import Runner, SshOptions, fan_out, values_or_raise
from .secrets import AccessKeys, SecretDelivery, client_api_key, ensure_local_secret, restart_users_of
from .state import DeploymentState, HostRecord, ProcessRecord, load_state, locked, remove_state, save_state
from .tiny_model import MARKER as TINY_MODEL_MARKER
from .topology import Topology
from kvpush.common.deployment_secret import fingerprint as secret_fingerprint
from kvpush.common.vllm_metrics import external_kv_tokens

LOG_TAIL_LINES = 30
ROUTER_ROTATION_WAIT_S = 60.0


@dataclass(frozen=True)
class LifecycleOptions:
    ssh: SshOptions = field(default_factory=SshOptions)
    ready_timeout_s: float = 600.0
    stop_timeout_s: float = 20.0
    provision: bool = True
    prove: bool = True  # send one request through the router and check KV moved
    doctor: bool = True  # run doctor's fast checks first and refuse to launch on a failure
    rotate_secret: bool = False  # a new deployment secret (and keys); every process that reads one restarts


class Events:
    """What lifecycle operations tell the user; the CLI renders it. Default: silent."""

    def note(self, message: str) -> None: ...

    def process(self, name: str, status: str, done: bool = False) -> None: ...

    def log_tail(self, name: str, host: str, text: str) -> None: ...


@dataclass
class Proof:
    answer: str
    latency_s: float
    external_kv_tokens: float


@dataclass
class UpResult:
    changes: Changes
    provisioned: list[ProvisionResult] = field(default_factory=list)
    ready_s: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0
    proof: Proof | None = None


class StartFailure(KvpushError):
    pass


def _host_records(plan: Plan) -> dict[str, HostRecord]:
    return {h.name: HostRecord.from_plan(h) for h in plan.hosts}


# -- stopping ----------------------------------------------------------------------------------


def _live_members(runner: Runner, records: list[ProcessRecord]) -> dict[str, list[int]]:
    """Per process: PIDs still alive (zombies are dead) in its group, if the group is still ours."""
    members = runner.group_members([r.pgid for r in records])
    leaders = runner.inspect([r.pid for r in records])
    live: dict[str, list[int]] = {}
    for r in records:
        leader = leaders.get(r.pid)
        if leader and leader.state == "alive" and r.pid == r.pgid and not is_running(r, leader):
            continue  # PID and group id were reused by an unrelated process
        pids = [m.pid for m in members.get(r.pgid, []) if m.state == "alive"]
        if pids:
            live[r.name] = pids
    return live


def stop_processes(runner: Runner, records: list[ProcessRecord], timeout_s: float) -> list[str]:
    """TERM each process group, wait, KILL what is left; returns names still alive afterwards."""
    if not records:
        return []
    by_name = {r.name: r for r in records}
    live = _live_members(runner, records)
    if live:
        runner.signal_groups([by_name[n].pgid for n in live], "TERM")
    for sig, wait_s in (("KILL", timeout_s), (None, 5.0)):
        end = time.monotonic() + wait_s
        while live and time.monotonic() < end:
            time.sleep(0.1)
            live = _live_members(runner, [by_name[n] for n in live])
        if live and sig:
            runner.signal_groups([by_name[n].pgid for n in live], sig)
    return sorted(live)


# -- starting ----------------------------------------------------------------------------------


def _prepare_host(runner: Runner, host: HostPlan, topo: Topology) -> None:
    for f in host.files:
        runner.write_file(f.path, f.content.encode())
    if topo.model.tiny is not None and any(p.role != "router" for p in host.processes):
        model = runner.expand(topo.model.path)
        py = shlex.quote(runner.expand(host.python))
        spec = shlex.quote(topo.model.tiny.model_dump_json())
        runner.run(
            f"test -f {shlex.quote(model + '/' + TINY_MODEL_MARKER)} || "
            f"{py} -m kvpush.deploy.tiny_model {shlex.quote(model)} --spec {spec}", timeout=600,
        ).check(f"making the tiny model at {topo.model.path}")


def _start_on_host(runner: Runner, host: HostPlan, names: list[str]) -> dict[str, ProcessRecord]:
    started = {}
    for proc in host.processes:
        if proc.name in names:
            s = runner.start_detached(proc.argv, proc.env, proc.cwd, proc.log_path, env_file=proc.env_file)
            started[proc.name] = ProcessRecord(
                name=proc.name, role=proc.role, host=host.name, pid=s.pid, pgid=s.pgid, start_time=s.start_time,
                http_port=proc.http_port, health_url=proc.health_url, log_path=proc.log_path,
                digest=launch_digest(host, proc), started_at=time.time(),
            )
    return started


def _probe_health(runner: Runner, records: list[ProcessRecord], keys: AccessKeys = AccessKeys()) -> dict[str, str]:
    """Per process: 'ready', 'dead', or a short waiting reason."""
    infos = runner.inspect([r.pid for r in records])
    out = {}
    for r in records:
        info = infos.get(r.pid)
        if not is_running(r, info):
            out[r.name] = "dead: " + _why_not_running(r, info)
            continue
        try:
            status = runner.http("GET", r.health_url, timeout=3, headers=keys.headers(r.role)).status
            out[r.name] = "ready" if status == 200 else f"health answers {status}"
        except OSError as exc:  # refused while the server is still loading; anything else is shown
            out[r.name] = "starting" if isinstance(exc, ConnectionError) else f"waiting ({exc or type(exc).__name__})"
    return out


def _why_not_running(record: ProcessRecord, info) -> str:
    if info is None or info.state == "dead":
        return f"pid {record.pid} is gone"
    if info.state != "alive":
        return f"pid {record.pid} is a {info.state}"
    return f"pid {record.pid} now belongs to a process started at {info.start_time}, not {record.start_time}"


def _wait_ready(runners: dict[str, Runner], records: list[ProcessRecord], timeout_s: float, events: Events,
                since: float, keys: AccessKeys = AccessKeys()) -> dict[str, float]:
    pending = {r.name: r for r in records}
    ready: dict[str, float] = {}
    end = time.monotonic() + timeout_s
    while pending:
        by_host: dict[str, list[ProcessRecord]] = {}
        for r in pending.values():
            by_host.setdefault(r.host, []).append(r)
        results = values_or_raise(fan_out(list(by_host), lambda h: _probe_health(runners[h], by_host[h], keys)))
        for host_states in results.values():
            for name, status in host_states.items():
                record = pending[name]
                if status.startswith("dead"):
                    events.log_tail(name, record.host, runners[record.host].tail(record.log_path, LOG_TAIL_LINES))
                    raise StartFailure(f"process {name} on host {record.host} exited before it became ready "
                                       f"({status[len('dead: '):]}); its log is {record.log_path} (last lines above)")
                if status == "ready":
                    ready[name] = time.monotonic() - since
                    events.process(name, f"ready after {ready[name]:.1f} s", done=True)
                    del pending[name]
                else:
                    events.process(name, status)
        if pending and time.monotonic() > end:
            name, record = next(iter(pending.items()))
            events.log_tail(name, record.host, runners[record.host].tail(record.log_path, LOG_TAIL_LINES))
            raise StartFailure(f"process {name} on host {record.host} was not ready within {timeout_s:.0f} s "
                               f"({record.health_url}); its log is {record.log_path} (last lines above); raise --timeout if it is just slow")
        if pending:
            time.sleep(0.5)
    return ready


# -- proof -------------------------------------------------------------------------------------


def _decode_kv_tokens(runners: dict[str, Runner], plan: Plan, keys: AccessKeys) -> float:
    total = 0.0
    for proc in plan.processes():
        if proc.role == "decode":
            url = proc.health_url.rsplit("/", 1)[0] + "/metrics"
            total += external_kv_tokens(runners[proc.host].http("GET", url, timeout=10, headers=keys.headers(proc.role)).text())
    return total


def _proof_body(model: str) -> bytes:
    rng = random.Random()
    # Fresh words every time: a prefix-cache hit on decode would hide the transfer.
    prompt = " ".join(rng.choice(["kv", "push", "block", "cache", "token", "layer", "remote", "write"]) + str(rng.randint(0, 999))
                      for _ in range(200))
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()


def prove_kv_transfer(runners: dict[str, Runner], plan: Plan, timeout_s: float = 120.0,
                      keys: AccessKeys = AccessKeys()) -> Proof:
    """One real completion through the router; decode must report prompt tokens received by KV transfer."""
    router = next(p for p in plan.processes() if p.role == "router")
    url = plan.router_url + "/v1/completions"
    give_up = time.monotonic() + ROUTER_ROTATION_WAIT_S
    while True:
        before = _decode_kv_tokens(runners, plan, keys)
        started = time.monotonic()
        try:
            response = runners[router.host].http("POST", url, _proof_body(plan.served_model_name), timeout=timeout_s,
                                                 headers=keys.headers("router"))
        except OSError as exc:
            raise KvpushError(f"proof request to the router {url} failed: {exc}; see `kvpush logs router`") from None
        latency = time.monotonic() - started
        # The router may have ejected an instance it probed while that instance was still loading,
        # and takes it back only at its next probe (each router worker at its own). Until then it
        # answers 503 (no decode instance), or lets decode compute the prompt itself (no prefill
        # instance): an answer that moved no KV. Either way, ask again with a fresh prompt.
        if response.status == 503 and time.monotonic() < give_up:
            time.sleep(1.0)
            continue
        if response.status != 200:
            raise KvpushError(f"proof request to the router {url} answered HTTP {response.status}: {response.text()[:200]}; see `kvpush logs`")
        try:
            answer = json.loads(response.body)["choices"][0]["text"]
        except (ValueError, KeyError, IndexError):
            raise KvpushError(f"proof request to the router {url} answered no completion: {response.text()[:200]}") from None
        moved = _decode_kv_tokens(runners, plan, keys) - before
        if moved > 0:
            return Proof(answer, latency, moved)
        if time.monotonic() >= give_up:
            raise KvpushError("the proof request was answered, but no decode instance received prompt tokens by KV transfer "
                              "(vllm:prompt_tokens_by_source_total{source=\"external_kv_transfer\"} did not grow); "
                              "check the connector settings and `kvpush logs`")
        time.sleep(1.0)


# -- up / down ---------------------------------------------------------------------------------


def _doctor_gate(topo: Topology, runners: dict[str, Runner], running: frozenset[str], events: Events) -> None:
    """Doctor's fast checks on every host before anything stops or starts."""
    from .doctor import fast_checks

    events.process("doctor", "checking hosts")
    report = fast_checks(topo, runners, running=running)
    if report.failed:
        raise KvpushError(f"{report.first_failure_line()}; nothing was started (fix it, or pass --skip-doctor)")
    events.process("doctor", f"{len(report.results)} checks passed in {report.seconds:.1f} s", done=True)


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
    with locked(plan.deployment):
        secret, new_secret = ensure_local_secret(plan.deployment, options.rotate_secret)
        keys = AccessKeys.of(secret, client_key)
        delivery = SecretDelivery(plan, secret, keys)
        if new_secret:
            events.note(f"deployment secret: made a new one (fingerprint {secret_fingerprint(secret)})")
        state = load_state(plan.deployment) or DeploymentState(plan.deployment)
        if topo.launcher == "slurm":  # the hosts are the nodes of a running job, found or submitted
            topo = slurm_allocation.allocate(topo, state, events)
            plan = build_plan(topo)
        hosts = _host_records(plan)
        # Hosts that only the old state knows still need connecting: their processes may have to stop.
        all_hosts = {**state.hosts, **hosts}
        with connected(all_hosts, options.ssh) as (runners, unreachable):
            if unreachable:
                raise KvpushError("cannot reach every host, nothing was started: " + "; ".join(unreachable.values()))
            result = UpResult(changes=Changes())
            if options.provision:
                digest = local_digest()
                wheel = WheelSource(digest)
                done = values_or_raise(fan_out(plan.hosts, lambda h: provision_host(runners[h.name], h, digest, wheel),
                                               name=lambda h: h.name))
                result.provisioned = list(done.values())
                for p in result.provisioned:
                    events.note(f"host {p.host}: {p.action} ({p.detail})")

            running = _running_processes(runners, state)
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
            if options.doctor:
                _doctor_gate(topo, runners, frozenset(n for n, alive in running.items() if alive), events)

            # Stop what is removed or changed, and clear records of processes that died.
            old = [state.processes[n] for n in changes.stop + changes.restart + changes.revive]
            by_host: dict[str, list[ProcessRecord]] = {}
            for r in old:
                by_host.setdefault(r.host, []).append(r)
            left = values_or_raise(fan_out(list(by_host), lambda h: stop_processes(runners[h], by_host[h], options.stop_timeout_s)))
            if any(left.values()):
                raise KvpushError(f"could not stop {', '.join(n for names in left.values() for n in names)}; stop them by hand, then rerun")
            restarts = {n: state.processes[n].restarts + 1 for n in changes.restart + changes.revive}
            for r in old:
                del state.processes[r.name]
            state.hosts = {**{n: h for n, h in state.hosts.items() if state.processes_on(n)}, **hosts}
            state.plan_hash = plan.topology_digest
            save_state(state)

            delivery.write(runners, stale)
            launch = set(changes.to_launch)
            launch_hosts = [h for h in plan.hosts if launch & {p.name for p in h.processes}]
            values_or_raise(fan_out(launch_hosts, lambda h: _prepare_host(runners[h.name], h, topo), name=lambda h: h.name))
            started_at = time.monotonic()
            for name in launch:
                events.process(name, "starting")
            outcomes = fan_out(launch_hosts, lambda h: _start_on_host(runners[h.name], h, sorted(launch)), name=lambda h: h.name)
            started = {n: r for o in outcomes.values() if o.ok for n, r in o.value.items()}
            new_records = {p.name: started[p.name] for p in plan.processes() if p.name in started}
            for name, record in new_records.items():
                record.restarts = restarts.get(name, 0)
            state.processes.update(new_records)
            save_state(state)
            try:
                values_or_raise(outcomes)
                result.ready_s = _wait_ready(runners, list(new_records.values()), options.ready_timeout_s, events, started_at, keys)
                if options.prove and plan.connector != "colocated":
                    events.process("proof", "one request through the router")
                    result.proof = prove_kv_transfer(runners, plan, keys=keys)
                    events.process("proof", f"KV moved: {result.proof.external_kv_tokens:.0f} prompt tokens", done=True)
            except KvpushError:
                events.note(f"stopping the {len(new_records)} process(es) this `up` started")
                _stop_records(runners, list(new_records.values()), options.stop_timeout_s)
                for name in new_records:
                    state.processes.pop(name, None)
                save_state(state)
                raise
    result.total_s = time.monotonic() - begun
    return result


def _running_processes(runners: dict[str, Runner], state: DeploymentState) -> dict[str, bool]:
    by_host: dict[str, list[ProcessRecord]] = {}
    for r in state.processes.values():
        by_host.setdefault(r.host, []).append(r)

    def check(host: str) -> dict[str, bool]:
        infos = runners[host].inspect([r.pid for r in by_host[host]])
        return {r.name: is_running(r, infos.get(r.pid)) for r in by_host[host]}

    running: dict[str, bool] = {}
    for values in values_or_raise(fan_out(list(by_host), check)).values():
        running.update(values)
    return running


def _stop_records(runners: dict[str, Runner], records: list[ProcessRecord], timeout_s: float) -> dict[str, list[str]]:
    by_host: dict[str, list[ProcessRecord]] = {}
    for r in records:
        by_host.setdefault(r.host, []).append(r)
    results = fan_out([h for h in by_host if h in runners], lambda h: stop_processes(runners[h], by_host[h], timeout_s))
    return {h: (r.value if r.ok else [p.name for p in by_host[h]]) for h, r in results.items()}


@dataclass
class DownResult:
    stopped: list[str] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)  # host -> error
    left_running: list[str] = field(default_factory=list)
    had_state: bool = True
    notes: list[str] = field(default_factory=list)  # e.g. the Slurm job it found ended or cancelled

    @property
    def complete(self) -> bool:
        return not self.unreachable and not self.left_running


def down(deployment: str, options: LifecycleOptions = LifecycleOptions(), events: Events = Events()) -> DownResult:
    with locked(deployment):
        state = load_state(deployment)
        ended = slurm_allocation.ended_message(state)
        if ended is not None:  # nothing of it can run: forget it
            remove_state(deployment)
            return DownResult(had_state=True, notes=[ended])
        if state is None or not state.processes:
            released = slurm_allocation.release(state)
            remove_state(deployment)
            return DownResult(had_state=state is not None, notes=[released] if released else [])
        result = DownResult()
        hosts = {n: h for n, h in state.hosts.items() if state.processes_on(n)}
        with connected(hosts, options.ssh) as (runners, unreachable):
            result.unreachable = unreachable
            left = _stop_records(runners, [r for r in state.processes.values() if r.host in runners], options.stop_timeout_s)
        for host, names in left.items():
            result.left_running += names
        for r in list(state.processes.values()):
            if r.host in runners and r.name not in result.left_running:
                result.stopped.append(r.name)
                del state.processes[r.name]
        if state.processes:
            save_state(state)  # what could not be stopped stays recorded for the next `down`
        else:
            released = slurm_allocation.release(state)
            result.notes += [released] if released else []
            remove_state(deployment)
        return result
