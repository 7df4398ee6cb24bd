"""What kvpush hands Slurm, as text: sbatch options and scripts, and one srun line per process.

Pure functions of the topology and its plan. `up` submits `hold_script` (the job only holds the
allocation) and launches every process with `step_argv`; `kvpush plan --slurm-script` prints
`standalone_script`, which launches the same steps itself for users who submit it themselves.
"""
from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from kvpush.common.errors import UsageError
from kvpush.deploy.lifecycle.secret_content import user_secret_word
from kvpush.deploy.lifecycle.tiny_model import MARKER as TINY_MODEL_MARKER
from kvpush.deploy.runners.base import shell_word
from kvpush.deploy.runners.slurm_step import srun_argv, step_shell
from kvpush.deploy.topology.secret_looking import secret_looking_fields
from kvpush.deploy.topology.slurm_topology import node_count, used_hosts
from kvpush.deploy.topology.topology import Topology

from .private_file import private_write_command

if TYPE_CHECKING:
    from .plan_model import HostPlan, ProcessPlan

HOLD_COMMAND = "exec sleep infinity"
SCRIPT_EOF = "KVPUSH_FILE_END"
SECRET_MODULE = (
    "kvpush.deploy.lifecycle.secret_content"  # run by the job: derives each secret file (never in the script)
)


def job_name(topo: Topology) -> str:
    assert topo.slurm is not None
    return topo.slurm.job_name or f"kvpush-{topo.name}"


def gpus_per_node(topo: Topology) -> int | None:
    assert topo.slurm is not None
    if topo.slurm.gpus_per_node is not None or topo.platform != "cuda":
        return topo.slurm.gpus_per_node
    per_host: dict[str, int] = {}
    for _, _, spec in topo.instances():
        per_host[spec.resolved_host] = max(per_host.get(spec.resolved_host, 0), max(spec.devices, default=-1) + 1)
    return max(per_host.values(), default=None) or None


def sbatch_options(topo: Topology) -> list[str]:
    """The allocation `up` submits: one node per used host, the named ones by name."""
    slurm = topo.slurm
    assert slurm is not None
    options = [f"--job-name={job_name(topo)}", f"--nodes={node_count(topo)}", "--ntasks-per-node=1"]
    named = [node for h in used_hosts(topo) if (node := topo.hosts[h].node)]
    if named:
        options.append(f"--nodelist={','.join(named)}")
    if slurm.partition:
        options.append(f"--partition={slurm.partition}")
    if slurm.account:
        options.append(f"--account={slurm.account}")
    if slurm.time_limit:
        options.append(f"--time={slurm.time_limit}")
    exclusive = slurm.exclusive if slurm.exclusive is not None else topo.platform == "cuda"
    if exclusive:
        options.append("--exclusive")
    gpus = gpus_per_node(topo)
    if gpus:
        options.append(f"--gpus-per-node={gpus}")
    return options + list(slurm.sbatch_options)


def _header(topo: Topology, output: str) -> list[str]:
    return ["#!/bin/bash", *(f"#SBATCH {o}" for o in sbatch_options(topo)), f"#SBATCH --output={output}"]


def hold_script(topo: Topology) -> str:
    """The batch script `up` submits: it holds the allocation while `up` launches the steps."""
    return "\n".join(_header(topo, "/dev/null") + [
        f"# kvpush deployment {topo.name}: `kvpush up` launches every process as a job step (srun --overlap);",
        "# this script only holds the allocation. `kvpush down` (or scancel) ends it.",
        HOLD_COMMAND, ""])


def step_argv(host: HostPlan, proc: ProcessPlan, with_job: bool = True) -> list[str]:
    slurm = host.slurm or {}
    job = slurm.get("job_id") if with_job else None
    return srun_argv(job, slurm.get("node"), proc.name, slurm.get("srun_options", [])) + [
        "bash", "-c", step_shell(proc.launch_argv, proc.env, proc.cwd, proc.log_path, proc.env_file)]


def host_fields(topo: Topology, host_name: str) -> dict | None:
    """What a host plan carries for the Slurm launcher (None for SSH)."""
    if topo.launcher != "slurm":
        return None
    assert topo.slurm is not None
    return {
        "job_id": topo.slurm.job_id,
        "node": topo.hosts[host_name].node,
        "srun_options": list(topo.slurm.srun_options),
    }


def plan_fields(topo: Topology, hosts: list[HostPlan]) -> dict | None:
    """The plan's Slurm section: what `up` submits and the srun line of every process."""
    if topo.launcher != "slurm":
        return None
    return {"sbatch_options": sbatch_options(topo), "hold_script": hold_script(topo), "steps": step_lines(hosts)}


def step_lines(hosts: list[HostPlan]) -> dict[str, str]:
    """Each process's srun line, by name."""
    return {p.name: shlex.join(step_argv(h, p)) for h in hosts for p in h.processes}


def standalone_script(topo: Topology, hosts: list[HostPlan], source: str) -> str:
    """An sbatch script that runs the whole deployment by itself, each process a job step: hosts
    as build_plan makes them, never redacted (the script runs what it says). It holds no secret:
    the job makes its own deployment secret and reads the topology's `secrets` when it starts, and
    a topology with a secret-looking value elsewhere is refused."""
    secret_looking = secret_looking_fields(topo)
    if secret_looking:
        raise UsageError(f"{secret_looking[0]}: looks secret, and a standalone script would have to hold its value; "
                         "give it in secrets: (e.g. HF_TOKEN: {env: HF_TOKEN}), which the job reads when it starts")
    unnamed = [h for h in used_hosts(topo) if not topo.hosts[h].node]
    if unnamed:
        raise UsageError(f"hosts.{unnamed[0]}.node: a standalone script needs every host to name its Slurm node "
                         "(its address goes into the router's configuration); add node: or use `kvpush up`")
    lines = _header(topo, f"{job_name(topo)}-%j.out") + [
        f"# kvpush deployment {topo.name}, from {source}: every process is a job step on its node.",
        "# Submit with `sbatch THIS_FILE`; the job ends when any step ends (scancel stops them all).",
        "set -u",
    ]
    lines += _secret_file_lines(topo, hosts)
    for host in hosts:
        for f in host.files:
            directory = f.path.rsplit("/", 1)[0]
            write = f"mkdir -p {shell_word(directory)} && cat > {shell_word(f.path)}"
            lines += [f"# {f.path} on {host.name}",
                      shlex.join(step_argv_for(host, "write-file", write)) + f" <<'{SCRIPT_EOF}' || exit 1",
                      f.content, SCRIPT_EOF]
        if topo.model.tiny is not None and any(p.role != "router" for p in host.processes):
            model = topo.model.path
            make = (
                f"test -f {shell_word(model + '/' + TINY_MODEL_MARKER)} || {shell_word(host.python)} -m "
                f"kvpush.deploy.lifecycle.tiny_model {shell_word(model)} --spec "
                f"{shlex.quote(topo.model.tiny.model_dump_json())}"
            )
            lines += [f"# the tiny model on {host.name}", shlex.join(step_argv_for(host, "make-model", make))]
    lines.append("# the processes")
    for host in hosts:
        for proc in host.processes:
            lines.append(shlex.join(step_argv(host, proc, with_job=False)) + " &")
    lines += ["wait -n", 'echo "kvpush: a step ended; ending job $SLURM_JOB_ID and with it the other steps" >&2',
              "exit 1", ""]
    return "\n".join(lines)


def _secret_file_lines(topo: Topology, hosts: list[HostPlan]) -> list[str]:
    """The job's own deployment secret and the plan's secret files, with nothing secret in the script.

    On the batch step's node (one of the deployment's), with umask 077 and in a private temporary
    directory: a fresh secret, then every kind of secret file derived from it by kvpush itself
    (the router's client key first: a missing one fails the job before anything is written).
    Each file then goes to its node through a step, its content on stdin; the private directory
    is removed as soon as they are written, and at exit whatever happens."""
    kinds = list(dict.fromkeys(f.kind for h in hosts for f in h.secret_files))
    if not kinds:
        return []
    kinds.sort(key=lambda kind: kind != "router-client-key")
    pythons = {(h.slurm or {}).get("node"): h.python for h in hosts}
    nodes = ", ".join(str(n) for n in pythons)
    lines = [
        "# Secret files: the job makes its own deployment secret on its first node and derives each file",
        "# from it there; steps write them on their nodes (mode 0600, content on stdin).",
        "kvpush_umask=$(umask); umask 077",
        "kvpush_private=$(mktemp -d) || exit 1",
        "trap 'rm -rf \"$kvpush_private\"' EXIT",
        "trap 'exit 143' TERM INT",
        'case "${SLURMD_NODENAME:-}" in',
        *(f"  {shlex.quote(str(node))}) kvpush_python={shell_word(python)} ;;" for node, python in pythons.items()),
        f'  *) echo "kvpush: the batch script runs on node ${{SLURMD_NODENAME:-?}}, none of this deployment\'s '
        f'({nodes})" >&2; exit 1 ;;',
        "esac",
        f'"$kvpush_python" -m {SECRET_MODULE} new >"$kvpush_private/secret" || exit 1',
    ]
    router = topo.router
    for kind in kinds:
        sources = ""
        if kind == "router-client-key":
            sources = (f" --client-key-env {shlex.quote(router.api_key_env)}" if router.api_key_env is not None
                       else f" --client-key-file {shlex.quote(str(router.api_key_file))}")
        if kind == "instance-env":  # the topology's secrets, read in the job: their sources only are here
            sources = "".join(f" --user-secret {shlex.quote(user_secret_word(name, source))}"
                              for name, source in sorted(topo.secrets.items()))
        lines.append(f'"$kvpush_python" -m {SECRET_MODULE} {kind} --secret "$kvpush_private/secret"{sources} '
                     f'>"$kvpush_private/{kind}" || exit 1')
    for host in hosts:
        for f in host.secret_files:
            lines += [f"# {f.path} on {host.name} ({f.kind})",
                      shlex.join(step_argv_for(host, "write-secret", private_write_command(f.path, shell_word)))
                      + f' <"$kvpush_private/{f.kind}" || exit 1']
    return lines + ['rm -rf "$kvpush_private"', 'umask "$kvpush_umask"']


def step_argv_for(host: HostPlan, step_name: str, command: str) -> list[str]:
    """A one-off step (no --jobid: inside the batch script) running a shell command on the host's node."""
    slurm = host.slurm or {}
    return srun_argv(None, slurm.get("node"), step_name, slurm.get("srun_options", [])) + ["bash", "-c", command]
