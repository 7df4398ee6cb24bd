"""Which of a topology's plain values look secret: an `env:` entry named like HF_TOKEN or holding a
token of a well-known format, the value after a flag such as `--hf-token` in `extra_args`.

Values given in `secrets:` never reach a plan; these rules are the safety net for secrets given
in `env:` or `extra_args` anyway. redact.py hides what they find wherever a plan is shown, and a
standalone Slurm script, which must run with the real values, is refused while any is there.
"""
from __future__ import annotations

import re

from .topology import Topology

REDACTED = "<redacted>"
# Whole words of a variable name: HF_TOKEN, AWS_SECRET_ACCESS_KEY, OPENAI_API_KEY, GITHUB_PAT; not
# KVCACHE, SSH_AUTH_SOCK or PATH.
SECRET_ENV_NAME = re.compile(r"(^|_)(KEY|APIKEY|TOKEN|SECRET|PASSWORD|PASSWD|PASS|PASSPHRASE|PAT|CREDENTIALS?)(_|$)",
                             re.IGNORECASE)
SECRET_FLAG = re.compile(r"^--?[\w-]*(token|secret|password|passwd|api-key)$", re.IGNORECASE)
# Tokens whose format says what they are, whatever the variable's name: GitHub, Hugging Face,
# OpenAI-style, Slack, AWS access key ids, PEM private keys.
SECRET_VALUE = re.compile(r"^(gh[pousr]_[A-Za-z0-9]{20,}|github_pat_\w{20,}|hf_[A-Za-z0-9]{20,}|sk-[\w-]{20,}"
                          r"|xox[abprs]-[\w-]{10,}|AKIA[0-9A-Z]{16})$|-----BEGIN [A-Z ]*PRIVATE KEY-----")


def is_secret_env_name(name: str) -> bool:
    return bool(SECRET_ENV_NAME.search(name))


def looks_secret(name: str, value: str) -> bool:
    """An environment entry whose name or value looks secret (an empty value hides nothing)."""
    return bool(value) and (is_secret_env_name(name) or bool(SECRET_VALUE.search(value.strip())))


def redact_env(env: dict[str, str]) -> dict[str, str]:
    return {k: (REDACTED if looks_secret(k, v) else v) for k, v in env.items()}


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


def secret_looking_fields(topo: Topology) -> list[str]:
    """The topology's fields holding a value that looks secret, as `env.HF_TOKEN` or `model.extra_args`."""
    found = [f"env.{k}" for k, v in topo.env.items() if looks_secret(k, v)]
    if redact_argv(topo.model.extra_args) != topo.model.extra_args:
        found.append("model.extra_args")
    for role, index, spec in topo.instances():
        found += [f"{role}[{index}].env.{k}" for k, v in spec.env.items() if looks_secret(k, v)]
        if redact_argv(spec.extra_args) != spec.extra_args:
            found.append(f"{role}[{index}].extra_args")
    return found
