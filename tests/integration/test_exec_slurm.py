"""`kvpush exec` on a real two-node Slurm cluster: the command runs as a job step in the
deployment's own allocation, on the host's node, its output and exit status passed on."""
from __future__ import annotations

import pytest

from kvpush.deploy.lifecycle.lifecycle import LifecycleOptions, down, up
from kvpush.deploy.lifecycle.state import load_state
from kvpush.deploy.runners import SshOptions
from cli_in_process import run_cli
from lifecycle_helpers import RecordingEvents, kill_leftovers
from slurm_cluster import slurm_topology_for
from sshd_hosts import write_standin_python

OPTIONS = LifecycleOptions(ssh=SshOptions(), ready_timeout_s=60, stop_timeout_s=5, provision=False, doctor=False)


@pytest.fixture
def deployed(slurm_cluster, tmp_path, state_dir):
    python = str(write_standin_python(tmp_path / "standin-python"))
    topo = slurm_topology_for(slurm_cluster, "sx", python, tmp_path, port_base=26710)
    try:
        result = up(topo, OPTIONS, RecordingEvents())
        assert sorted(result.ready_s) == ["decode-0", "prefill-0", "router"]
        yield load_state("sx")
    finally:
        down("sx", OPTIONS)
        left = kill_leftovers(python)
        slurm_cluster.command("scancel", "--user", "root", check=False)
        assert not left, f"processes left behind: {[p.pid for p in left]}"


def test_exec_runs_as_a_step_of_the_deployments_allocation_on_the_hosts_node(deployed):
    job = deployed.slurm_submitted_job
    done = run_cli("exec", "-d", "sx", "n1", "--", 'echo "$SLURM_JOB_ID $SLURMD_NODENAME"; echo oops >&2; exit 5')
    assert done.returncode == 5
    assert done.stdout == f"{job} n1\n" and "oops" in done.stderr.splitlines()
    process = run_cli("exec", "-d", "sx", "decode-0", "--", "echo", "$KVPUSH_PROCESS", "on")  # words pass as they are
    assert (process.returncode, process.stdout) == (0, "$KVPUSH_PROCESS on\n")
    process = run_cli("exec", "-d", "sx", "decode-0", "--", 'echo "$SLURM_JOB_ID $SLURMD_NODENAME $KVPUSH_PROCESS"')
    assert (process.returncode, process.stdout) == (0, f"{job} n2 decode-0\n")
