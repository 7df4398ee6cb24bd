"""The e2e session's pool of deployments: each brought up through `up` exactly as a user's (deployment
secret, instance key, doctor's gate, the proof request), shared by every test that asks for it.

`ready(name)` hands a deployment out: it runs `up`, which is a no-op while the deployment is healthy
and otherwise revives whatever an earlier test broke (killed, stopped, left behind), then checks
every process healthy through `status`. So a test may break its deployment and leave it broken:
the next test's `ready` brings it back, and that recovery is under test each time. A deployment
whose `up` or health check failed is taken down and fails the tests after it at once.

At most `capacity` deployments run at once (each instance holds a few GiB and its cores); the one
used longest ago is taken down to make room. `close()` takes every one down and fails if anything
of one is left (a process, a port held). It is also called at exit, and SIGTERM/SIGHUP unwind the
session as Ctrl-C does (tests/conftest.py), so a suite stopped half-way (Ctrl-C, a CI timeout)
leaves no server behind.
"""
from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import pytest

from fault_helpers import instance_pids, port_free, status_rows
from kvpush.common import deployment_secret as ds
from kvpush.common.kv_params import DEFAULT_TTL_S, PushParams
from kvpush.common.vllm_metrics import metric_sum
from kvpush.deploy.lifecycle.lifecycle import LifecycleOptions, UpResult, down, up
from kvpush.deploy.lifecycle.secrets import AccessKeys, kept_secret, observed_keys
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.plan.plan_model import Plan
from kvpush.deploy.topology.topology import Topology, parse_topology
from lifecycle_helpers import kill_leftovers, processes_under

# provision off: the instances run this checkout's venv; doctor's gate and the proof on, as a user's `up`
OPTIONS = LifecycleOptions(provision=False, ready_timeout_s=600, stop_timeout_s=15)


@contextmanager
def state_dir_of(path: Path) -> Iterator[None]:
    """KVPUSH_STATE_DIR set to the pool's for the duration (a test may have set its own)."""
    before = os.environ.get("KVPUSH_STATE_DIR")
    os.environ["KVPUSH_STATE_DIR"] = str(path)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("KVPUSH_STATE_DIR", None)
        else:
            os.environ["KVPUSH_STATE_DIR"] = before


class Member:
    """One process of a pooled deployment (an instance or the router), as a test uses it: its URL,
    its log, its metrics, and the faults a test inflicts on it."""

    def __init__(self, deployment: "PooledDeployment", name: str):
        self.deployment, self.name = deployment, name
        proc = deployment.plan.process(name)
        self.url = proc.base_url
        self.log_path = Path(os.path.expanduser(proc.log_path))
        self.role = proc.role if hasattr(proc, "role") else name.split("-")[0]

    @property
    def pid(self) -> int:
        """The process now (under its supervisor); it changes when `up` revives it."""
        return self.deployment.rows()[self.name].pid

    def headers(self) -> dict[str, str]:
        return self.deployment.keys.headers("router" if self.name == "router" else "decode")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:  # open without a key
            return r.read().decode()

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(self.metrics(), name, **labels) or 0.0

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
            return True
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the process and everything below it at once (vLLM's API server and its engine core
        or TP workers) at once, as a crashed machine would; returns at once. Its supervisor sees it end,
        and the next `ready` has `up` revive it."""
        for p in instance_pids(self.pid):
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass


@dataclass
class PooledDeployment:
    name: str
    topology_text: str
    state_dir: Path
    workdir: Path
    topo: Topology = field(init=False)
    plan: Plan = field(init=False)
    last_up: UpResult | None = None
    ups: int = 0  # `up` calls that started or revived something

    def __post_init__(self):
        self.topo = parse_topology(self.topology_text)
        self.plan = build_plan(self.topo)

    def __getitem__(self, name: str) -> Member:
        return Member(self, name)

    @property
    def router(self) -> Member:
        return Member(self, "router")

    @property
    def router_url(self) -> str:
        return self.plan.router_url

    @property
    def keys(self) -> AccessKeys:
        with state_dir_of(self.state_dir):
            return observed_keys(self.name, self.topo)

    def signed_leg(self, params: PushParams, instance: str, prompt_ids: list[int] | None = None) -> dict:
        """A leg's kvpush kv_transfer_params for `instance`, signed as the deployment's router signs
        them (the key `up` derives from the deployment secret), for a test that sends legs itself."""
        with state_dir_of(self.state_dir):
            secret = kept_secret(self.name)
        key = bytes.fromhex(ds.derive_token(secret, ds.TRANSFER_PARAMS))
        return params.signed(key, f"{self.name}.{instance}", int(time.time() + DEFAULT_TTL_S), prompt_ids).to_dict()

    def rows(self) -> dict:
        with state_dir_of(self.state_dir):
            return status_rows(self.name)

    def up(self) -> UpResult:
        with state_dir_of(self.state_dir):
            result = up(self.topo, OPTIONS)
        self.last_up = result
        if not result.changes.nothing_to_do:
            self.ups += 1
        return result

    def ports(self) -> list[int]:
        return [p for proc in self.plan.processes() for p in [proc.http_port, *proc.side_channel_ports]]

    def down(self) -> list[str]:
        """`down`, then what is wrong: processes left (killed), ports still held."""
        with state_dir_of(self.state_dir):
            stopped = down(self.name, OPTIONS)
        left = processes_under(str(self.workdir))
        kill_leftovers(str(self.workdir))
        problems = [] if stopped.complete else [f"{self.name}: `down` incomplete: {stopped}"]
        problems += [f"{self.name}: left running: {' '.join((p.info['cmdline'] or [])[:3])}" for p in left]
        deadline = time.monotonic() + 10
        while (held := [p for p in self.ports() if not port_free(p)]) and time.monotonic() < deadline:
            time.sleep(0.2)
        return problems + [f"{self.name}: port {p} still held" for p in held]


class DeploymentPool:
    def __init__(self, root: Path, topologies: dict[str, Callable[[Path, Path], str]], capacity: int = 2):
        """topologies: deployment name -> text(model dir, workdir)."""
        self._root, self._topologies, self._capacity = root, topologies, capacity
        self._made: dict[str, PooledDeployment] = {}
        self._up: list[str] = []  # up now, the one used longest ago first
        self._failed: dict[str, str] = {}
        self._model: Callable[[], Path] | None = None
        self._lock = threading.Lock()
        self.state_dir = root / "state"
        self.problems: list[str] = []

    def set_model(self, model: Callable[[], Path]) -> None:
        self._model = model

    def get(self, name: str) -> PooledDeployment:
        if name not in self._made:
            workdir = self._root / name
            workdir.mkdir(parents=True, exist_ok=True)
            self._made[name] = PooledDeployment(name, self._topologies[name](self._model(), workdir), self.state_dir, workdir)
        return self._made[name]

    def ready(self, name: str) -> PooledDeployment:
        """The deployment, up and every process healthy (started, or revived after a test broke it)."""
        if name in self._failed:
            pytest.fail(f"pooled deployment {name} could not be brought up: {self._failed[name]}")
        deployment = self.get(name)
        with self._lock:
            if name in self._up:
                self._up.remove(name)
            while len(self._up) >= self._capacity:
                self.problems += self._made[self._up.pop(0)].down()
            self._up.append(name)
        try:
            deployment.up()
            deadline = time.monotonic() + 60
            while not all(r.healthy for r in deployment.rows().values()):
                assert time.monotonic() < deadline, f"not healthy after `up`: {deployment.rows()}"
                time.sleep(0.5)
        except BaseException as exc:
            self._failed[name] = f"{type(exc).__name__}: {exc}"
            self._up.remove(name)
            self.problems += deployment.down()
            raise
        return deployment

    def release(self, name: str) -> None:
        """Take one deployment down now (a test needs the cores or the memory)."""
        with self._lock:
            if name in self._up:
                self._up.remove(name)
                self.problems += self._made[name].down()

    def release_all(self) -> None:
        """Take every deployment down now; the pool stays usable."""
        with self._lock:
            while self._up:
                self.problems += self._made[self._up.pop()].down()

    def close(self) -> list[str]:
        """Take every deployment down; what was left of any (also of those taken down earlier)."""
        self.release_all()
        return self.problems


_open_pools: list[DeploymentPool] = []


def _close_open_pools() -> None:
    while _open_pools:
        _open_pools.pop().close()


def register(pool: DeploymentPool) -> None:
    """Take the pool down at interpreter exit too, should pytest die before its teardown (SIGTERM
    and SIGHUP unwind like Ctrl-C: tests/conftest.py)."""
    if not _open_pools:
        atexit.register(_close_open_pools)
    _open_pools.append(pool)


def unregister(pool: DeploymentPool) -> None:
    if pool in _open_pools:
        _open_pools.remove(pool)
