"""Secret files' content for a batch script that runs a deployment without `kvpush up`.

`kvpush plan --slurm-script` prints a script that must never hold the secret itself: the job makes
a fresh deployment secret when it starts and derives every secret file from it with this module,
so the derivation is kvpush's own (secrets.secret_file_content), not a copy in shell.

    python -m kvpush.deploy.secret_content new > SECRET             # a fresh deployment secret file
    python -m kvpush.deploy.secret_content KIND --secret SECRET \\
        [--client-key-env NAME | --client-key-file PATH]            # one secret file of the plan, on stdout

Run it with umask 077: what it prints is secret. A bad input is one line on stderr, exit 1.
"""
from __future__ import annotations

import argparse
import sys
from typing import get_args

from kvpush.common import deployment_secret as ds
from kvpush.common.errors import KvpushError

from .placement import SecretKind
from .secrets import AccessKeys, read_client_key, secret_file_content

NEW = "new"
IN_THE_JOB = ("in the job's environment", "export it before `sbatch` (the job takes the submitter's environment)",
              "give the path of a file the job's first node can read")


def content(kind: str, secret_path: str | None, client_key_env: str | None = None,
            client_key_file: str | None = None) -> bytes:
    """What to print for `kind`: a new secret file, or one secret file derived from the secret at secret_path."""
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
            raise KvpushError("router-client-key: needs --client-key-env or --client-key-file (router.api_key_env/_file)")
    secret = ds.read_secret(secret_path)
    return secret_file_content(kind, secret, AccessKeys.of(secret, client))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpush.deploy.secret_content")
    parser.add_argument("kind", help=f"{NEW} or one of {', '.join(get_args(SecretKind))}")
    parser.add_argument("--secret", help="the deployment secret file to derive from")
    parser.add_argument("--client-key-env", help="the variable holding the router's client key (router.api_key_env)")
    parser.add_argument("--client-key-file", help="the file holding the router's client key (router.api_key_file)")
    args = parser.parse_args(argv)
    try:
        data = content(args.kind, args.secret, args.client_key_env, args.client_key_file)
    except KvpushError as exc:
        print(f"kvpush: {exc}", file=sys.stderr)
        return 1
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
