"""The deployment state file: what `up` started where, so later commands can observe and stop it.

`~/.kvpush/state/<deployment>.json` on the machine kvpush runs on (KVPUSH_STATE_DIR overrides the
directory). Written atomically; `locked()` holds an fcntl lock so two kvpush commands can't
interleave their read-modify-write cycles.
"""
from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from kvpush.common.errors import KvpushError
from kvpush.deploy.plan.plan_model import HostPlan
from kvpush.deploy.topology.host_address import HostAddress, base_url

STATE_VERSION = 1


def state_dir() -> Path:
    return Path(os.environ.get("KVPUSH_STATE_DIR") or Path.home() / ".kvpush" / "state")


@dataclass(kw_only=True)
class HostRecord(HostAddress):
    workdir: str
    slurm: dict | None = None  # launcher slurm: job_id, node, srun_options

    @classmethod
    def from_plan(cls, host: HostPlan) -> HostRecord:
        return cls(**host.address_fields(), workdir=host.workdir, slurm=host.slurm)


@dataclass
class ProcessRecord:
    name: str
    role: str
    host: str
    pid: int
    pgid: int
    start_time: float | None  # from the host's process table; tells a reused PID apart
    http_port: int
    health_url: str
    log_path: str
    digest: str  # ProcessPlan digest (+ files it reads) it was started from
    started_at: float
    restarts: int = 0  # by `up`; its supervisor counts its own in the status file
    status_path: str = ""  # its supervisor's status file ("": started without one)
    reload_digest: str = ""  # of the files it reads again on SIGHUP, as it last read them (changes.reload_digest)

    @property
    def base_url(self) -> str:
        return base_url(self.health_url)


@dataclass
class DeploymentState:
    deployment: str
    plan_hash: str = ""
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    hosts: dict[str, HostRecord] = field(default_factory=dict)
    processes: dict[str, ProcessRecord] = field(default_factory=dict)
    version: int = STATE_VERSION
    slurm_submitted_job: str | None = None  # the job `up` submitted; `down` cancels it

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)  # keeps plan order: status lists processes in it

    @classmethod
    def from_json(cls, text: str) -> DeploymentState:
        """Raises ValueError saying what is wrong when the text is not a state this version wrote."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"holds {'null' if data is None else 'a JSON ' + type(data).__name__}, not an object")
        for key, record_type in (("hosts", HostRecord), ("processes", ProcessRecord)):
            records = data.get(key, {})
            if not isinstance(records, dict) or not all(isinstance(v, dict) for v in records.values()):
                raise ValueError(f"'{key}' is not a mapping of records")
            if key == "hosts":  # older states recorded is_local, which the address now implies
                records = {k: {f: x for f, x in v.items() if f != "is_local"} for k, v in records.items()}
            try:
                data[key] = {k: record_type(**v) for k, v in records.items()}
            except TypeError:
                raise ValueError(f"a record under '{key}' lacks fields or has unknown ones") from None
        for record in data["processes"].values():
            if not all(isinstance(getattr(record, f), int) and not isinstance(getattr(record, f), bool)
                       for f in ("pid", "pgid", "http_port")):
                raise ValueError(f"process {record.name!r} has a pid, pgid or port that is not a number")
        return cls(**data)

    def processes_on(self, host: str) -> list[ProcessRecord]:
        return [p for p in self.processes.values() if p.host == host]


def state_path(deployment: str) -> Path:
    return state_dir() / f"{deployment}.json"


def recorded_deployments() -> list[str]:
    """The deployments with a state file on this machine, by name (`kvpush ls`)."""
    try:
        return sorted(p.stem for p in state_dir().glob("*.json") if not p.name.startswith("."))
    except OSError:
        return []


def load_state(deployment: str) -> DeploymentState | None:
    path = state_path(deployment)
    try:
        return DeploymentState.from_json(path.read_text())
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise _corrupt(path, deployment, "not UTF-8 text") from None
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise _corrupt(path, deployment, str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__) from None
    except OSError as exc:
        raise KvpushError(
            f"{path}: cannot read the deployment state ({exc.strerror or exc}); check its permissions"
        ) from None


def _corrupt(path: Path, deployment: str, why: str) -> KvpushError:
    return KvpushError(f"{path}: not a kvpush deployment state ({why}); move it aside (mv {path} {path}.bad), stop "
                       f"deployment {deployment}'s processes on its hosts by hand if any run, then rerun `kvpush up`")


def write_private_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step, readable by its owner only (mkstemp makes it 0600):
    a reader sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_state(state: DeploymentState) -> None:
    state.updated_at = time.time()
    write_private_atomically(state_path(state.deployment), state.to_json())


def remove_state(deployment: str) -> None:
    state_path(deployment).unlink(missing_ok=True)


@contextmanager
def locked(deployment: str, wait_s: float = 10.0) -> Iterator[None]:
    """Exclusive lock for one deployment's state; waits up to wait_s, then fails in one line."""
    path = state_dir() / f"{deployment}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        end = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= end:
                    f.seek(0)
                    holder = f.read().strip() or "unknown"
                    raise KvpushError(
                        f"deployment {deployment}: another kvpush command (pid {holder}) holds {path}; wait for it to "
                        "finish"
                    ) from None
                time.sleep(0.05)
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        try:
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
