"""Runner for one node of a Slurm allocation: every command and every process is a job step.

The same interface as the SSH runner, so nothing above it knows which launcher it drives:
- a command runs as `srun --jobid=J --overlap --nodelist=NODE ...` and waits for it;
- a long-lived process is a step launched by a detached srun on this machine; its "pid" and
  "process group" are its step id, its start time the step's, and signalling it is `scancel`
  of the step, which stops every process the step started (and scancel of the job stops all);
- HTTP goes straight to the node's address, which is where the processes bind.
"""
from __future__ import annotations

import base64
import os
import re
import shlex
import socket
import threading
import time
from pathlib import Path
from typing import BinaryIO, Callable

import psutil

from .base import CommandResult, HostError, HttpResponse, ProcessInfo, Runner, Started
from .http import exchange, split_url
from .local import LocalRunner, stream_process
from .slurm_cli import SlurmClient, SlurmError, job_gone_words
from .slurm_step import srun_argv, step_shell

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
STEP_APPEAR_TIMEOUT_S = 60.0
MISSING_FILE_CODE = 44
ENDED_STEP = -1  # the id of a step that ended before its id was seen: never a live step


def srun_log_dir() -> Path:
    """Where the detached srun clients write what srun itself says (errors before the step starts)."""
    return Path(os.environ.get("KVPUSH_STATE_DIR") or Path.home() / ".kvpush" / "state") / "srun"


class SlurmRunner(Runner):
    def __init__(self, name: str, address: str, job_id: str | None, node: str | None,
                 srun_options: list[str] | None = None, client: SlurmClient | None = None):
        self.name, self.address, self.job_id, self.node = name, address, job_id, node
        self.srun_options = list(srun_options or [])
        self.client = client or SlurmClient()
        self.local = LocalRunner(name)
        self._home: str | None = None
        self._lock = threading.Lock()
        self._step_names: dict[int, str] = {}  # step id -> name, as seen while it ran

    def _where(self) -> str:
        return f"host {self.name} (Slurm node {self.node or '?'} of job {self.job_id or '?'})"

    def connect(self) -> None:
        if not self.job_id or not self.node:
            raise HostError(f"{self._where()}: no Slurm allocation recorded for it; run `kvpush up`")
        info = self.client.job(self.job_id)
        if info is None or not info.running:
            raise HostError(f"{self._where()}: {job_gone_words(self.job_id, info)}")
        if self.node not in info.nodes:
            raise HostError(f"{self._where()}: the job's nodes are {','.join(info.nodes)}, not {self.node}")

    @property
    def home(self) -> str:
        with self._lock:
            if self._home is None:
                self._home = self.run('printf %s "$HOME"', timeout=60).check("reading $HOME").stdout.strip()
            return self._home

    def _srun(self, step_name: str, command: str) -> list[str]:
        return srun_argv(self.job_id, self.node, step_name, self.srun_options) + ["bash", "-c", command]

    def run(self, command: str, timeout: float | None = None, stdin: bytes | None = None) -> CommandResult:
        argv = self._srun("kvpush-command", command)
        started = time.monotonic()
        try:
            code, out, err = self.client.call(argv, stdin=stdin if stdin is not None else b"", timeout=timeout or 120.0)
        except SlurmError as exc:
            raise HostError(f"{self._where()}: {exc}") from None
        return CommandResult(self.name, command, code, out, err, time.monotonic() - started)

    def stream(self, command: str, stdout: BinaryIO, stderr: BinaryIO) -> int:
        """The command as a job step on this node of the allocation; srun's exit status is the command's."""
        return stream_process(self._srun("kvpush-exec", command), stdout, stderr)

    def read_file(self, path: str) -> bytes | None:
        q = shlex.quote(self.expand(path))
        result = self.run(f"test -e {q} || exit {MISSING_FILE_CODE}; base64 -w0 {q}", timeout=60)
        if result.exit_code == MISSING_FILE_CODE:
            return None
        result.check(f"reading {path}")
        return base64.b64decode(result.stdout.strip())

    def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        target = self.expand(path)
        directory, name = target.rsplit("/", 1) if "/" in target else (".", target)
        q = shlex.quote
        # mktemp: a new file of a name no one can guess, made with O_EXCL and mode 0600 (a name
        # another user could predict they could create first, as a link to a file of this user's)
        command = (
            f"mkdir -p {q(directory or '/')} && t=$(mktemp {q((directory or '') + '/.' + name + '.XXXXXXXX')}) && "
            f'{{ cat >"$t" && chmod {mode:o} "$t" && mv -f "$t" {q(target)}; }} || {{ rm -f "$t"; exit 1; }}'
        )
        self.run(command, timeout=120, stdin=data).check(f"writing {path}")

    def upload(self, local_path: str, remote_path: str) -> None:
        self.write_file(remote_path, Path(local_path).read_bytes())

    # -- processes: job steps ------------------------------------------------------------------

    def start_detached(self, argv: list[str], env: dict[str, str], cwd: str, log_path: str,
                       env_file: str | None = None) -> Started:
        """Launch a step that outlives this command; returns its step id as pid and group.

        The step's name is the log file's name without `.log` (the plan names logs after processes)."""
        step_name = re.sub(r"\.log$", "", log_path.rsplit("/", 1)[-1])
        if not self.job_id:
            raise HostError(f"{self._where()}: no Slurm job to launch {step_name} in")
        before = {s.step_id for s in self.client.steps(self.job_id)}
        client_log = srun_log_dir() / f"{self.job_id}.{step_name}.srun.log"
        client_log.parent.mkdir(parents=True, exist_ok=True)
        srun = self._srun(step_name, step_shell(argv, env, cwd, log_path, env_file))
        launch = f"nohup setsid {shlex.join(srun)} >{shlex.quote(str(client_log))} 2>&1 </dev/null & echo $!"
        result = self.local.run(launch, timeout=30).check(f"launching step {step_name}")
        client_pid = int(result.stdout.strip().splitlines()[-1])
        end = time.monotonic() + STEP_APPEAR_TIMEOUT_S
        while True:
            new = [s for s in self.client.steps(self.job_id) if s.name == step_name and s.step_id not in before]
            if new:
                step = max(new, key=lambda s: s.step_id)
                self._step_names[step.step_id] = step_name
                return Started(pid=step.step_id, pgid=step.step_id, start_time=step.start_time)
            ended = self.local.inspect([client_pid])[client_pid].state != "alive"
            if ended or time.monotonic() > end:
                said = client_log.read_text(errors="replace").strip().splitlines() if client_log.exists() else []
                if ended and not [ln for ln in said if "error:" in ln and "task 0:" not in ln]:
                    # The step ran and its process already ended: a dead process, which the caller
                    # reports with its log like any process that exits before it is ready.
                    return Started(pid=ENDED_STEP, pgid=ENDED_STEP, start_time=None)
                self.local.signal_groups([client_pid], "KILL")
                raise HostError(f"{self._where()}: srun did not start step {step_name}: "
                                f"{(said or ['no output from srun'])[-1]} (srun's output: {client_log})")
            time.sleep(0.1)

    def _live_steps(self) -> dict[int, ProcessInfo]:
        if not self.job_id:
            return {}
        try:
            steps = self.client.steps(self.job_id)
        except SlurmError:
            info = self.client.job(self.job_id)
            if info is not None and info.active:
                raise HostError(f"{self._where()}: cannot list the job's steps") from None
            return {}  # the job is gone, and every step with it
        self._step_names.update({s.step_id: s.name for s in steps})
        return {
            s.step_id: ProcessInfo(s.step_id, "alive", s.start_time, s.step_id) for s in steps if s.node == self.node
        }

    def inspect(self, pids: list[int]) -> dict[int, ProcessInfo]:
        live = self._live_steps()
        return {p: live.get(int(p), ProcessInfo(int(p), "dead")) for p in pids}

    def group_members(self, pgids: list[int]) -> dict[int, list[ProcessInfo]]:
        """The node's processes of each live step (`scontrol listpids` on the node), e.g. for
        sampling their CPU use; a live step whose processes are not listed yet stands for itself."""
        live = self._live_steps()
        members: dict[int, list[ProcessInfo]] = {int(g): [] for g in pgids}
        wanted = [g for g in members if g in live]
        if wanted:
            listed = self.run(f"scontrol listpids {shlex.quote(str(self.job_id))}", timeout=60)
            for pid, step in parse_listpids(listed.stdout if listed.ok else ""):
                if step in wanted:
                    members[step].append(ProcessInfo(pid, "alive", None, step))
            for g in wanted:
                members[g] = members[g] or [live[g]]
        # The srun on this machine that launched a step ends a moment after its step: until then
        # it belongs to the step, so a stop waits for it.
        for step, clients in self._local_clients(list(members)).items():
            members[step] += clients
        return members

    def _local_clients(self, steps: list[int]) -> dict[int, list[ProcessInfo]]:
        names = {s: self._step_names[s] for s in steps if s in self._step_names}
        if not names:
            return {}
        found: dict[int, list[ProcessInfo]] = {}
        for proc in psutil.process_iter(["cmdline", "status"]):
            argv = proc.info["cmdline"] or []
            if (
                argv[:1] != ["srun"]
                or f"--jobid={self.job_id}" not in argv
                or proc.info["status"] == psutil.STATUS_ZOMBIE
            ):
                continue
            for step, name in names.items():
                if f"--job-name={name}" in argv:
                    found.setdefault(step, []).append(ProcessInfo(proc.pid, "alive", None, step))
        return found

    def signal_groups(self, pgids: list[int], signal_name: str) -> None:
        for step in pgids:
            self.client.cancel(f"{self.job_id}.{int(step)}", signal=signal_name)
        if signal_name == "KILL":
            for clients in self._local_clients([int(g) for g in pgids]).values():
                self.local.signal_groups(
                    [c.pid for c in clients], "KILL"
                )  # each is the leader of its own process group (setsid)

    def follow(self, command: str, on_line: Callable[[str], None], stop: threading.Event) -> None:
        self.local.follow(shlex.join(self._srun("kvpush-follow", command)), on_line, stop)

    def http(self, method: str, url: str, body: bytes | None = None, timeout: float = 5.0,
             headers: dict[str, str] | None = None) -> HttpResponse:
        """From this machine to the node: a URL on the node's loopback means the node's address."""
        host, port, path = split_url(url)
        target = self.address if host in LOOPBACK else host
        with socket.create_connection((target, port), timeout=timeout) as sock:
            return exchange(sock, host, port, method, path, body, headers)


def parse_listpids(text: str) -> list[tuple[int, int]]:
    """`scontrol listpids JOB`: (pid, step id) per process of a numbered step."""
    out = []
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 3 and words[0].isdigit() and words[2].isdigit():
            out.append((int(words[0]), int(words[2])))
    return out
