"""Slurm's client commands (sbatch, squeue, scontrol, scancel, sinfo), and parsers for what they print.

Everything kvpush asks Slurm goes through `SlurmClient`, which runs the commands on this machine
(SLURM_CONF and the rest of the environment pass through). The parsers are pure, so they are
tested on recorded output.
"""
from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Callable

from kvpush.common.errors import KvpushError

COMMAND_TIMEOUT_S = 30.0
# Pending reasons after which the job will never start as submitted: waiting is pointless.
HOPELESS_REASONS = {
    "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "InvalidAccount", "InvalidQOS",
    "AccountNotAllowed", "QOSNotAllowed", "PartitionDown", "PartitionInactive", "NodeDown", "ReqNodeNotAvail",
    "JobHeldAdmin", "JobHeldUser", "DependencyNeverSatisfied",
}
ACTIVE_STATES = {"RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


class SlurmError(KvpushError):
    """A Slurm command failed; str() is one line with Slurm's own words."""


@dataclass(frozen=True)
class JobInfo:
    job_id: str
    state: str  # RUNNING, PENDING, CANCELLED, ...
    reason: str
    nodes: list[str]

    @property
    def running(self) -> bool:
        return self.state == "RUNNING"

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_STATES


@dataclass(frozen=True)
class StepInfo:
    step_id: int
    name: str
    node: str
    start_time: float | None


# -- parsers -----------------------------------------------------------------------------------


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list -> names: 'n[1-3,7],gpu-[08-09]' -> n1 n2 n3 n7 gpu-08 gpu-09."""
    names: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", text.strip()):
        names += _expand_one(part)
    return names


def _expand_one(pattern: str) -> list[str]:
    match = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", pattern)
    if not match:
        return [pattern] if pattern else []
    prefix, ranges, rest = match.groups()
    tails = _expand_one(rest) if rest else [""]
    out = []
    for item in ranges.split(","):
        lo, _, hi = item.partition("-")
        if not hi:
            values = [lo]
        else:
            width = len(lo) if lo.startswith("0") else 0
            values = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
        out += [prefix + v + tail for v in values for tail in tails]
    return out


def parse_slurm_time(text: str) -> float | None:
    """Slurm's local ISO time ('2026-12-01T18:18:35') as seconds since the epoch."""
    try:
        return datetime.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


def parse_steps(job_id: str, text: str) -> list[StepInfo]:
    """`squeue -h -s -j J -o '%i|%j|%N|%S'`: the job's running steps (the batch and extern steps left out)."""
    steps = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 4 or not parts[0].startswith(f"{job_id}."):
            continue
        step = parts[0][len(job_id) + 1:]
        if step.isdigit():
            steps.append(StepInfo(int(step), parts[1], parts[2], parse_slurm_time(parts[3])))
    return steps


def parse_job_line(job_id: str, text: str) -> JobInfo | None:
    """`squeue -h -j J -o '%T|%r|%N'`; None when squeue lists nothing."""
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 3:
            return JobInfo(job_id, parts[0], parts[1], expand_hostlist(parts[2]) if parts[2] else [])
    return None


def parse_scontrol_record(text: str) -> dict[str, str]:
    """`scontrol show job|node X` key=value pairs (values without spaces are enough here)."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


def sbatch_error_field(stderr: str) -> str | None:
    """The topology field an sbatch refusal is about, judged from Slurm's message."""
    text = stderr.lower()
    rules = [
        ("account", "slurm.account"),  # before partition: "Invalid account or account/partition combination"
        ("partition", "slurm.partition"),
        ("time limit", "slurm.time_limit"), ("invalid time", "slurm.time_limit"),
        ("invalid node name", "hosts.*.node"),
        ("node configuration is not available", "hosts"), ("node count", "hosts"),
        ("generic resource", "slurm.gpus_per_node"), ("gres", "slurm.gpus_per_node"),
        ("unrecognized option", "slurm.sbatch_options"), ("invalid option", "slurm.sbatch_options"),
    ]
    for needle, field in rules:
        if needle in text:
            return field
    return None


def slurm_reason(stderr: str) -> str:
    """Slurm's own words, one line: its messages without the `sbatch: error:` prefixes."""
    lines = [re.sub(r"^(\w+: )?(error: )?", "", ln.strip()) for ln in stderr.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith("Try ")]
    return "; ".join(dict.fromkeys(lines)) or "no message"


# -- the commands ------------------------------------------------------------------------------


Run = Callable[[list[str], "bytes | None", float], "subprocess.CompletedProcess[bytes]"]


def _run(argv: list[str], stdin: bytes | None, timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout)
    except FileNotFoundError:
        raise SlurmError(
            f"`{argv[0]}` not found: launcher slurm needs Slurm's client commands on this machine "
            "(Debian: apt-get install slurm-client)"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(
            f"`{' '.join(argv[:3])}` did not answer within {timeout:.0f} s; is slurmctld reachable?"
        ) from None


class SlurmClient:
    def __init__(self, run: Run = _run):
        self._run = run

    def call(
        self, argv: list[str], stdin: bytes | None = None, timeout: float = COMMAND_TIMEOUT_S
    ) -> tuple[int, str, str]:
        proc = self._run(argv, stdin, timeout)
        return proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")

    def test_submit(self, options: list[str]) -> tuple[bool, str]:
        """Would Slurm take this job? (sbatch --test-only: nothing is queued.) -> (ok, Slurm's words)."""
        code, out, err = self.call(["sbatch", "--test-only", *options, "--wrap", "true"])
        return code == 0, slurm_reason(err or out)

    def submit(self, script: str) -> str:
        code, out, err = self.call(["sbatch", "--parsable"], stdin=script.encode())
        if code != 0:
            raise SlurmError(f"sbatch refused the job: {slurm_reason(err or out)}")
        return out.strip().split(";")[0]

    def job(self, job_id: str) -> JobInfo | None:
        """The job as Slurm knows it; None once Slurm has forgotten it."""
        code, out, err = self.call(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%N"])
        info = parse_job_line(job_id, out) if code == 0 else None
        if info is not None:
            return info
        code, out, err = self.call(["scontrol", "show", "job", job_id])
        if code != 0:
            if "invalid job id" in (err + out).lower():
                return None
            raise SlurmError(f"asking Slurm about job {job_id} failed: {slurm_reason(err or out)}")
        record = parse_scontrol_record(out)
        nodes = record.get("NodeList", "")
        return JobInfo(job_id, record.get("JobState", "UNKNOWN"), record.get("Reason", ""),
                       expand_hostlist(nodes) if nodes and nodes != "(null)" else [])

    def steps(self, job_id: str) -> list[StepInfo]:
        code, out, err = self.call(["squeue", "-h", "-s", "-j", job_id, "-o", "%i|%j|%N|%S"])
        if code != 0:
            raise SlurmError(f"listing the steps of job {job_id} failed: {slurm_reason(err or out)}")
        return parse_steps(job_id, out)

    def node_addresses(self, nodes: list[str]) -> dict[str, str]:
        addresses = {}
        for node in nodes:
            code, out, _ = self.call(["scontrol", "show", "node", node])
            address = parse_scontrol_record(out).get("NodeAddr") if code == 0 else None
            addresses[node] = address or node
        return addresses

    def partition_nodes(self, partition: str | None) -> int | None:
        """How many nodes the partition (default: the default one) has; None if Slurm doesn't say."""
        argv = ["sinfo", "-h", "-o", "%D|%P"] + (["-p", partition] if partition else [])
        code, out, _ = self.call(argv)
        for line in out.splitlines() if code == 0 else []:
            count, _, name = line.partition("|")
            if count.strip().isdigit() and (partition or name.strip().endswith("*")):
                return int(count)
        return None

    def cancel(self, target: str, signal: str | None = None) -> None:
        """scancel a job or a step (J.S); one already gone is fine."""
        self.call(["scancel", *([f"--signal={signal}"] if signal else []), target])

    def wait_gone(self, job_id: str, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            info = self.job(job_id)
            if info is None or not info.active:
                return True
            time.sleep(0.3)
        return False


def job_gone_words(job_id: str, info: JobInfo | None) -> str:
    """One phrase for a job that no longer runs: 'has ended (CANCELLED)', 'is PENDING (Priority)'."""
    if info is None:
        return f"Slurm job {job_id} has ended (Slurm no longer knows it)"
    if info.active:
        return f"Slurm job {job_id} is {info.state}" + (
            f" ({info.reason})" if info.reason and info.reason != "None" else ""
        )
    return f"Slurm job {job_id} has ended ({info.state})"
