"""Secret-looking values a topology gives (an `env:` HF_TOKEN, a `--hf-token` argument) are
replaced before a plan is shown: `kvpush plan` output lands in terminals, tickets and CI logs.

kvpush's own secrets and the topology's `secrets:` never reach a plan (it names their files and
variables only); this covers values given elsewhere (secret_looking.py says which), in every form a
plan is shown: each process's env and argv, and the srun line of each (rendered again from them).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvpush.deploy.topology.secret_looking import REDACTED, is_secret_env_name, redact_argv, redact_env

from . import slurm_render

if TYPE_CHECKING:
    from .plan_model import HostPlan, Plan, ProcessPlan

__all__ = ["REDACTED", "is_secret_env_name", "redact_argv", "redact_env", "redact_plan"]


def _process(proc: ProcessPlan) -> ProcessPlan:
    return dataclasses.replace(proc, env=redact_env(proc.env), argv=redact_argv(proc.argv))


def _host(host: HostPlan) -> HostPlan:
    return dataclasses.replace(host, processes=[_process(p) for p in host.processes])


def redact_plan(plan: Plan) -> Plan:
    """The plan as it may be shown; launching uses the plan itself."""
    hosts = [_host(h) for h in plan.hosts]
    slurm = None if plan.slurm is None else {**plan.slurm, "steps": slurm_render.step_lines(hosts)}
    return dataclasses.replace(plan, hosts=hosts, slurm=slurm)
