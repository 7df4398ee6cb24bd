"""The Slurm job a deployment runs in: found, or submitted and waited for; released by `down`.

`up` runs inside an existing allocation when one is given (slurm.job_id, or SLURM_JOB_ID as set
inside salloc/sbatch), reuses the job an earlier `up` submitted while it still runs, and else
submits one. Before submitting, `sbatch --test-only` asks Slurm whether it would take the job, so
bad input is refused with Slurm's reason and nothing is queued. `down` cancels only a job that
`up` submitted; an allocation the user made stays theirs.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from kvpush.common.errors import KvpushError, UsageError
from kvpush.deploy.plan.slurm_render import hold_script, job_name, sbatch_options
from kvpush.deploy.runners.slurm_cli import HOPELESS_REASONS, JobInfo, SlurmClient, job_gone_words, sbatch_error_field
from kvpush.deploy.topology.slurm_topology import bind_allocation, node_count
from kvpush.deploy.topology.topology import Topology

from .state import DeploymentState, load_state, remove_state, save_state


@dataclass(frozen=True)
class Allocation:
    job_id: str
    nodes: list[str]
    addresses: dict[str, str]
    submitted: bool  # by kvpush: `down` cancels it
    new: bool = False  # submitted by this call


def refusal_line(topo: Topology, words: str, client: SlurmClient) -> str:
    """One line for a job Slurm refused: the field it is about, what was asked, Slurm's reason."""
    assert topo.slurm is not None
    field = sbatch_error_field(words)
    if field == "slurm.partition":
        return (f"slurm.partition: Slurm refused partition {topo.slurm.partition!r}: {words}; "
                "see `sinfo -s` for the partitions")
    if field == "hosts":
        has = client.partition_nodes(topo.slurm.partition)
        where = f"partition {topo.slurm.partition}" if topo.slurm.partition else "the default partition"
        size = f"; {where} has {has}" if has is not None else ""
        return (f"hosts: the deployment needs {node_count(topo)} nodes (one per host){size}; Slurm: {words}; "
                "put more processes on one host or choose a larger partition")
    if field == "hosts.*.node":
        named = ",".join(h.node for h in topo.hosts.values() if h.node)
        return f"hosts.*.node: Slurm refused the nodes {named}: {words}; see `sinfo -N` for the node names"
    if field == "slurm.account":
        return f"slurm.account: Slurm refused account {topo.slurm.account!r}: {words}"
    if field == "slurm.time_limit":
        return f"slurm.time_limit: Slurm refused time limit {topo.slurm.time_limit!r}: {words}"
    if field == "slurm.gpus_per_node":
        asked = " ".join(o for o in sbatch_options(topo) if "gpu" in o)
        return f"slurm.gpus_per_node: Slurm refused the GPU request ({asked}): {words}"
    return f"slurm.sbatch_options: sbatch refused the job ({' '.join(sbatch_options(topo))}): {words}"


def _wait_running(topo: Topology, job_id: str, client: SlurmClient, events) -> JobInfo:
    assert topo.slurm is not None
    timeout = topo.slurm.start_timeout_s
    end = time.monotonic() + timeout
    shown = None
    while True:
        info = client.job(job_id)
        if info is not None and info.running:
            return info
        if info is None or not info.active:
            raise KvpushError(f"{job_gone_words(job_id, info)} before it started; see `scontrol show job {job_id}`")
        if info.state == "PENDING" and info.reason in HOPELESS_REASONS:
            client.cancel(job_id)
            raise UsageError(
                f"{sbatch_error_field(info.reason) or 'slurm'}: Slurm will never start job {job_id} as asked "
                f"(pending, reason {info.reason}); cancelled it. Check the partition, nodes and options"
            )
        if time.monotonic() > end:
            client.cancel(job_id)
            raise KvpushError(f"Slurm job {job_id} was still {info.state} ({info.reason}) after {timeout:.0f} s; "
                              "cancelled it, nothing was started. Raise slurm.start_timeout_s or free nodes")
        if (info.state, info.reason) != shown:
            shown = (info.state, info.reason)
            events.process("slurm", f"job {job_id} {info.state.lower()} ({info.reason})")
        time.sleep(0.5)


def submit(topo: Topology, client: SlurmClient) -> str:
    """Ask Slurm whether it would take the job (nothing queued), then submit it."""
    ok, words = client.test_submit(sbatch_options(topo))
    if not ok:
        raise UsageError(refusal_line(topo, words, client))
    try:
        return client.submit(hold_script(topo))
    except KvpushError as exc:
        raise UsageError(refusal_line(topo, str(exc), client)) from None


def acquire(topo: Topology, state: DeploymentState, events, client: SlurmClient, record: bool = True) -> Allocation:
    """The running job to deploy into; a job it submits is recorded in `state` at once (unless
    `record` is false), so that `down` can cancel it even if `up` fails later."""
    assert topo.slurm is not None
    given, source = topo.slurm.job_id, "slurm.job_id"
    if not given and os.environ.get("SLURM_JOB_ID"):
        given, source = os.environ["SLURM_JOB_ID"], "SLURM_JOB_ID"
    if given:
        info = client.job(given)
        if info is None or not info.running:
            raise UsageError(f"{source}: {job_gone_words(given, info)}, not running; give a running allocation "
                             "(see `squeue --me`) or leave it unset so `up` submits one")
        events.note(f"Slurm: deploying into job {given} ({source}) on {','.join(info.nodes)}")
        return Allocation(
            given, info.nodes, client.node_addresses(info.nodes), submitted=given == state.slurm_submitted_job
        )
    recorded = state.slurm_submitted_job
    info = client.job(recorded) if recorded else None
    if recorded and info is not None and info.active:
        job_id, new = recorded, False
        events.note(f"Slurm: job {job_id} from the last `up` is {info.state.lower()}; deploying into it")
    else:
        job_id, new = submit(topo, client), True
        if record:
            state.slurm_submitted_job = job_id
            save_state(state)
        events.note(f"Slurm: submitted job {job_id} ({job_name(topo)}, {node_count(topo)} node(s))")
    try:
        info = _wait_running(topo, job_id, client, events)
    except KvpushError:
        if record:
            state.slurm_submitted_job = None
            save_state(state)
        raise
    events.process("slurm", f"job {job_id} running on {','.join(info.nodes)}", done=True)
    return Allocation(job_id, info.nodes, client.node_addresses(info.nodes), submitted=True, new=new)


def _recorded_jobs(state: DeploymentState) -> set[str]:
    return {h.slurm["job_id"] for h in state.hosts.values() if h.slurm and h.slurm.get("job_id")}


def _forget_other_jobs(state: DeploymentState, job_id: str, client: SlurmClient) -> None:
    """Processes recorded in another job than this one: stop what still runs, drop the records."""
    for old in _recorded_jobs(state) - {job_id}:
        hosts = {n for n, h in state.hosts.items() if h.slurm and h.slurm.get("job_id") == old}
        records = [r for r in state.processes.values() if r.host in hosts]
        if old == state.slurm_submitted_job:
            client.cancel(old)
        else:
            for r in records:
                client.cancel(f"{old}.{r.pid}")
        for r in records:
            del state.processes[r.name]
        for n in hosts:
            del state.hosts[n]
    if state.slurm_submitted_job not in (None, job_id):
        client.cancel(state.slurm_submitted_job)
        state.slurm_submitted_job = None
    save_state(state)


def allocate(topo: Topology, state: DeploymentState, events, client: SlurmClient | None = None) -> Topology:
    """`up`'s first step on Slurm: the topology bound to the nodes of a running job."""
    client = client or SlurmClient()
    allocation = acquire(topo, state, events, client)
    _forget_other_jobs(state, allocation.job_id, client)
    return bind_allocation(topo, allocation.job_id, allocation.nodes, allocation.addresses)


def recorded_job(state: DeploymentState | None) -> str | None:
    if state is None:
        return None
    jobs = _recorded_jobs(state)
    return next(iter(jobs)) if jobs else state.slurm_submitted_job


def ended_message(state: DeploymentState | None, client: SlurmClient | None = None) -> str | None:
    """One line when the deployment's Slurm job no longer runs (e.g. scancel from outside); else None."""
    job_id = recorded_job(state)
    if job_id is None or state is None or not state.processes:
        return None
    info = (client or SlurmClient()).job(job_id)
    if info is not None and info.running:
        return None
    return (
        f"deployment {state.deployment}: {job_gone_words(job_id, info)}, and every process of the deployment with it; "
        "`kvpush up` starts it again"
    )


def release(state: DeploymentState | None, client: SlurmClient | None = None, timeout_s: float = 30.0) -> str | None:
    """Cancel the job `up` submitted (an allocation the user made stays); what was done, or None."""
    if state is None or not state.slurm_submitted_job:
        return None
    client = client or SlurmClient()
    job_id = state.slurm_submitted_job
    client.cancel(job_id)
    if not client.wait_gone(job_id, timeout_s):
        raise KvpushError(
            f"Slurm job {job_id} is still there {timeout_s:.0f} s after scancel; see `squeue -j {job_id}`"
        )
    state.slurm_submitted_job = None
    return f"cancelled Slurm job {job_id}"


@contextmanager
def allocation_for_checks(topo: Topology, events, client: SlurmClient | None = None) -> Iterator[Topology]:
    """`doctor` on Slurm: the topology bound to a running job (the given one, the deployment's, or
    one submitted for the checks and cancelled after them)."""
    client = client or SlurmClient()
    state = load_state(topo.name) or DeploymentState(topo.name)
    allocation = acquire(topo, state, events, client, record=False)
    try:
        yield bind_allocation(topo, allocation.job_id, allocation.nodes, allocation.addresses)
    finally:
        if allocation.new:
            client.cancel(allocation.job_id)
            client.wait_gone(allocation.job_id, 30)


def release_if_idle(deployment: str, client: SlurmClient | None = None) -> str | None:
    """After a failed `up`: cancel the job `up` submitted if no process of the deployment runs in it."""
    state = load_state(deployment)
    if state is None or not state.slurm_submitted_job or state.processes:
        return None
    done = release(state, client)
    remove_state(deployment)  # no process and no job: nothing left to record
    return f"{done}: nothing of deployment {deployment} runs in it" if done else None
