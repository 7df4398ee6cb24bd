"""Secret files' content for a batch script that runs a deployment without `kvpush up`.

`kvpush plan --slurm-script` prints a script that must never hold the secret itself: the job makes
a fresh deployment secret when it starts and derives every secret file from it with this module,
so the derivation is kvpush's own (secrets.secret_file_content), not a copy in shell.

    python -m kvpush.deploy.lifecycle.secret_content new > SECRET             # a fresh deployment secret file
    python -m kvpush.deploy.lifecycle.secret_content KIND --secret SECRET \\
        [--client-key-env NAME | --client-key-file PATH]            # one secret file of the plan, on stdout
        [--user-secret NAME=env:VAR | --user-secret NAME=file:PATH ...]   # instance-env: the topology's secrets

Run it with umask 077: what it prints is secret. A bad input is one line on stderr, exit 1.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence, get_args

from pydantic import ValidationError

from kvpush.common import deployment_secret as ds
from kvpush.common.errors import KvpushError
from kvpush.deploy.topology.placement import SecretKind
from kvpush.deploy.topology.topology_schema import SecretSource

from .secrets import AccessKeys, read_client_key, read_user_secrets, secret_file_content

NEW = "new"
IN_THE_JOB = ("in the job's environment", "export it before `sbatch` (the job takes the submitter's environment)",
              "give the path of a file the job's first node can read")


def user_secret_word(name: str, source: SecretSource) -> str:
    """How the script names one of the topology's secrets to this module: NAME=env:VAR or NAME=file:PATH."""
    return f"{name}=env:{source.env}" if source.env is not None else f"{name}=file:{source.file}"


def _user_secret(word: str) -> tuple[str, SecretSource]:
    name, _, source = word.partition("=")
    how, _, where = source.partition(":")
    if not name or how not in ("env", "file") or not where:
        raise KvpushError(f"--user-secret {word}: give NAME=env:VARIABLE or NAME=file:PATH")
    try:
        return name, SecretSource(**{how: where})
    except ValidationError as exc:
        raise KvpushError(f"--user-secret {word}: {exc.errors()[0]['msg']}") from None


def content(kind: str, secret_path: str | None, client_key_env: str | None = None,
            client_key_file: str | None = None, user_secrets: Sequence[str] = ()) -> bytes:
    """What to print for `kind`: a new secret file, or one secret file derived from the secret at secret_path
    (instance-env with the values of user_secrets, read here: the job's environment and files)."""
    if kind == NEW:
        return ds.secret_file_text(ds.new_secret()).encode()
    if kind not in get_args(SecretKind):
        raise KvpushError(f"{kind}: not a secret file kind; kinds are {NEW}, {', '.join(get_args(SecretKind))}")
    if secret_path is None:
        raise KvpushError(f"{kind}: needs --secret, the deployment secret file it is derived from")
    client = None
    if kind == "router-client-key":
        client = read_client_key(client_key_env, client_key_file, IN_THE_JOB)
        if client is None:
            raise KvpushError(
                "router-client-key: needs --client-key-env or --client-key-file (router.api_key_env/_file)"
            )
    values = (
        read_user_secrets(dict(_user_secret(w) for w in user_secrets), IN_THE_JOB) if kind == "instance-env" else {}
    )
    secret = ds.read_secret(secret_path)
    return secret_file_content(kind, secret, AccessKeys.of(secret, client), values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpush.deploy.lifecycle.secret_content")
    parser.add_argument("kind", help=f"{NEW} or one of {', '.join(get_args(SecretKind))}")
    parser.add_argument("--secret", help="the deployment secret file to derive from")
    parser.add_argument("--client-key-env", help="the variable holding the router's client key (router.api_key_env)")
    parser.add_argument("--client-key-file", help="the file holding the router's client key (router.api_key_file)")
    parser.add_argument("--user-secret", action="append", default=[],
                        help="instance-env: one of the topology's secrets, NAME=env:VARIABLE or NAME=file:PATH")
    args = parser.parse_args(argv)
    try:
        data = content(args.kind, args.secret, args.client_key_env, args.client_key_file, args.user_secret)
    except KvpushError as exc:
        print(f"kvpush: {exc}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
