"""The chaos suite's faults: one process of a prefill or decode instance (its API server, its engine
core, a TP worker) SIGSTOPped for a while, or SIGKILLed and its instance brought back by `up`.

One fault at a time, so with two instances of a role one of them is always untouched. A fault
lasts until the router has every instance in rotation again: after a stop, its SIGCONT and the
router's probes; after a kill, the instance ending, `up` (which starts only what is down) and the
probes. Between faults the deployment runs undisturbed for a random gap.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from typing import Callable

from fault_helpers import instance_pids, status_rows
from kvpush.common.vllm_metrics import metric_sum
from kvpush.deploy.lifecycle.lifecycle import LifecycleOptions, up
from kvpush.deploy.topology.topology import Topology

IN_ROTATION = "kvpush_router_instance_in_rotation"


def vllm_processes(api_server_pid: int) -> dict[str, int]:
    """The processes of one vLLM instance by what they are: `api_server` (with a TP 1 engine run in
    it, as kvpush plans TP 1 instances), `engine_core` and `worker_tp<rank>` (vLLM titles them
    VLLM::EngineCore and VLLM::Worker_TP<rank>; the kernel's comm cuts the rank, the command line
    has it). Other children (e.g. a resource tracker) are no fault target."""
    found = {"api_server": api_server_pid}
    for pid in instance_pids(api_server_pid)[1:]:
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                title = f.read().split("\0")[0].strip()
        except OSError:
            continue
        if title.startswith("VLLM::EngineCore"):
            found["engine_core"] = pid
        elif title.startswith("VLLM::Worker_TP"):
            found[f"worker_tp{title.removeprefix('VLLM::Worker_TP')}"] = pid
    return found


@dataclass(frozen=True)
class ChaosSettings:
    stop_s: tuple[float, float] = (0.2, 3.0)  # how long a SIGSTOP lasts (uniform)
    gap_s: tuple[float, float] = (1.0, 5.0)  # undisturbed time between two faults (uniform)
    kill_every: int = 4  # every kill_every-th fault is a SIGKILL, the others SIGSTOPs (0: no kills)
    max_kills: int | None = None  # after this many SIGKILLs, SIGSTOPs only
    dies_within_s: float = 45.0  # a killed engine core or TP worker ends its instance within this
    rotation_within_s: float = 120.0  # the router has every instance back in rotation within this
    first_gap_s: float = 3.0  # the load runs undisturbed this long first


@dataclass
class Fault:
    id: str
    kind: str  # stop | kill
    instance: str
    role: str  # prefill | decode
    process: str  # api_server | engine_core | worker_tp<rank>
    pid: int
    start: float  # time.monotonic() of the signal
    end: float | None = None  # every instance in rotation again (None: never, within rotation_within_s)
    resumed: float | None = None  # stop: its SIGCONT
    shown_dead_s: float | None = None  # kill: from the signal until `status` saw the instance dead
    up_s: float | None = None
    up_revived: list[str] = field(default_factory=list)
    up_ready_s: dict[str, float] = field(default_factory=dict)  # from `up`'s launch until each process was ready
    notes: list[str] = field(default_factory=list)  # anything unexpected, in words

    def to_json(self, epoch: float) -> dict:
        row = asdict(self)
        for key in ("start", "end", "resumed"):
            if row[key] is not None:
                row[key] = round(row[key] - epoch, 3)
        for key in ("shown_dead_s", "up_s"):
            if row[key] is not None:
                row[key] = round(row[key], 1)
        return row


class ChaosDeploymentError(RuntimeError):
    """The deployment could not be brought back: the run cannot go on."""


class Chaos:
    """A thread injecting faults into the prefill and decode instances of a running deployment
    until stop(); `after_up(fault)` runs after each revival (e.g. to keep the dead process's log)."""

    def __init__(self, topo: Topology, router_url: str, options: LifecycleOptions, settings: ChaosSettings, seed: int,
                 after_up: Callable[[Fault], None] = lambda fault: None, log: Callable[[str], None] = print):
        self._topo, self._router_url, self._options, self._settings = topo, router_url, options, settings
        self._rng, self._after_up, self._log = random.Random(seed), after_up, log
        self._roles = {**{i.name: "prefill" for i in topo.prefill}, **{i.name: "decode" for i in topo.decode}}
        self.faults: list[Fault] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos", daemon=True)

    @property
    def instances(self) -> dict[str, str]:
        """name -> role"""
        return dict(self._roles)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 900) -> list[Fault]:
        """Stop after the fault under way has been recovered from; raises what ended the thread."""
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise ChaosDeploymentError(f"the fault under way was not recovered from within {timeout_s:g} s")
        if self.error is not None:
            raise self.error
        return self.faults

    def _run(self) -> None:
        try:
            self._stop.wait(self._settings.first_gap_s)
            while not self._stop.is_set():
                self._inject(len(self.faults) + 1)
                self._stop.wait(self._rng.uniform(*self._settings.gap_s))
        except BaseException as exc:  # noqa: BLE001 - handed to stop()'s caller
            self.error = exc

    def _inject(self, n: int) -> None:
        s = self._settings
        instance = self._rng.choice(sorted(self._roles))
        processes = vllm_processes(status_rows(self._topo.name)[instance].pid)
        process = self._rng.choice(sorted(processes))
        kills = sum(f.kind == "kill" for f in self.faults)
        may_kill = s.kill_every and n % s.kill_every == 0 and (s.max_kills is None or kills < s.max_kills)
        kind = "kill" if may_kill else "stop"
        fault = Fault(f"f{n:04d}", kind, instance, self._roles[instance], process, processes[process], time.monotonic())
        self.faults.append(fault)
        if kind == "stop":
            stopped_for = self._rng.uniform(*s.stop_s)
            os.kill(fault.pid, signal.SIGSTOP)
            try:
                time.sleep(stopped_for)
            finally:
                os.kill(fault.pid, signal.SIGCONT)
                fault.resumed = time.monotonic()
        else:
            os.kill(fault.pid, signal.SIGKILL)
            self._revive(fault)
        self._log(f"chaos {fault.id}: {kind} of {instance}'s {process} (pid {fault.pid})"
                  + (f", `up` {fault.up_s:.1f} s" if fault.up_s is not None else ""))
        fault.end = self._wait_in_rotation(fault)

    def _revive(self, fault: Fault) -> None:
        s = self._settings
        deadline, forced = fault.start + s.dies_within_s, False
        while (row := status_rows(self._topo.name)[fault.instance]).process not in ("dead", "zombie"):
            if time.monotonic() > deadline:
                if forced:
                    raise ChaosDeploymentError(f"{fault.instance} did not end even after its API server was killed")
                fault.notes.append(f"still {row.process} {s.dies_within_s:g} s after its {fault.process} was killed; "
                                   "killed its API server")
                os.kill(row.pid, signal.SIGKILL)
                deadline, forced = time.monotonic() + 15, True
            time.sleep(0.2)
        fault.shown_dead_s = time.monotonic() - fault.start
        began = time.monotonic()
        for attempt in (1, 2):
            try:
                result = up(self._topo, self._options)
                fault.up_revived = result.changes.revive
                fault.up_ready_s = {name: round(t, 1) for name, t in result.ready_s.items()}
                break
            except Exception as exc:  # noqa: BLE001 - recorded; a second failure ends the run
                fault.notes.append(f"`up` attempt {attempt} failed: {type(exc).__name__}: {exc}"[:500])
                if attempt == 2:
                    raise ChaosDeploymentError(f"`up` failed twice after {fault.id}: {exc}") from exc
                time.sleep(5)
        fault.up_s = time.monotonic() - began
        self._after_up(fault)

    def _wait_in_rotation(self, fault: Fault) -> float | None:
        deadline = time.monotonic() + self._settings.rotation_within_s
        while time.monotonic() < deadline:
            if self.in_rotation() == len(self._roles):
                return time.monotonic()
            time.sleep(0.2)
        fault.notes.append(f"not every instance in rotation {self._settings.rotation_within_s:g} s after recovery")
        return None

    def in_rotation(self) -> int:
        try:
            with urllib.request.urlopen(self._router_url + "/metrics", timeout=10) as r:
                return int(metric_sum(r.read().decode(), IN_ROTATION) or 0)
        except OSError:
            return 0


def attribute(records, faults: list[Fault], instances: dict[str, str], run_end: float) -> None:
    """Tell each request which faults were under way during it, and whether each role kept an
    instance that no fault touched during it."""
    per_role: dict[str, int] = {}
    for role in instances.values():
        per_role[role] = per_role.get(role, 0) + 1
    for record in records:
        active = [f for f in faults if f.start < record.end and (f.end or run_end) > record.start]
        record.faults = [f.id for f in active]
        hit = {(f.role, f.instance) for f in active}
        record.healthy_peer = all(sum(1 for r, _ in hit if r == role) < count for role, count in per_role.items())
