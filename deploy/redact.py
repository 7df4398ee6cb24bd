"""Secret-looking values a topology gives (an `env:` HF_TOKEN, a `--hf-token` argument) are
replaced before a plan is shown: `kvpush plan` output lands in terminals, tickets and CI logs.

kvpush's own secrets never reach a plan (it names their files only); this covers the user's.
"""
from __future__ import annotations

import dataclasses
import re

from .plan import HostPlan, Plan, ProcessPlan

REDACTED = "<redacted>"
# Whole words of a variable name: HF_TOKEN, AWS_SECRET_ACCESS_KEY, OPENAI_API_KEY; not KVCACHE or SSH_AUTH_SOCK.
SECRET_ENV_NAME = re.compile(r"(^|_)(KEY|TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?)(_|$)", re.IGNORECASE)
SECRET_FLAG = re.compile(r"^--?[\w-]*(token|secret|password|passwd|api-key)$", re.IGNORECASE)


def is_secret_env_name(name: str) -> bool:
    return bool(SECRET_ENV_NAME.search(name))


def redact_env(env: dict[str, str]) -> dict[str, str]:
    return {k: (REDACTED if is_secret_env_name(k) and v else v) for k, v in env.items()}


def redact_argv(argv: list[str]) -> list[str]:
    """`--hf-token X` and `--hf-token=X` keep the flag and lose the value."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        flag, eq, _ = arg.partition("=")
        if hide_next:
            out.append(REDACTED)
            hide_next = False
        elif eq and SECRET_FLAG.match(flag):
            out.append(f"{flag}={REDACTED}")
        else:
            out.append(arg)
            hide_next = bool(SECRET_FLAG.match(arg))
    return out


def _process(proc: ProcessPlan) -> ProcessPlan:
    return dataclasses.replace(proc, env=redact_env(proc.env), argv=redact_argv(proc.argv))


def _host(host: HostPlan) -> HostPlan:
    return dataclasses.replace(host, processes=[_process(p) for p in host.processes])


def redact_plan(plan: Plan) -> Plan:
    """The plan as it may be shown; launching uses the plan itself."""
    return dataclasses.replace(plan, hosts=[_host(h) for h in plan.hosts])
