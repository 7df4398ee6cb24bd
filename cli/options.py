"""The options several commands share, defined once so every command names them the same way.

Every command that reads a topology takes it as `--file`, so a script can name it one way for all
of them; a command whose positional argument is free (all but `logs PROCESS` and `request PROMPT`)
takes it there too, as the shorter form. `-f` is left to `logs --follow`, as in `tail -f`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from kvpush.common.errors import UsageError

from kvpush.deploy.runners import SshOptions

FILE_HELP = "Topology file (default: ./kvpush.yaml, else the built-in local-cpu)."
FILE_ARG = typer.Argument(None, help=FILE_HELP)
FILE_OPTION = typer.Option(None, "--file", help=FILE_HELP)

ACCEPT = typer.Option(False, "--accept-new-host-keys", help="Record unknown SSH host keys in known_hosts (trust on first use).")
KNOWN_HOSTS = typer.Option("~/.ssh/known_hosts", "--known-hosts", envvar="KVPUSH_KNOWN_HOSTS", help="known_hosts file to verify SSH hosts against.")
CONNECT_TIMEOUT = typer.Option(10.0, "--connect-timeout", help="Seconds to connect and authenticate to each host.")
DEPLOYMENT = typer.Option(None, "--deployment", "-d", help="Deployment name (default: the topology's name).")


def topology_file(positional: Optional[Path], option: Optional[Path]) -> Optional[Path]:
    """The topology file of a command that takes it either way; two different files are an error."""
    if positional is not None and option is not None and positional.resolve() != option.resolve():
        raise UsageError(f"the topology is given twice ({positional} and --file {option}); give one of them")
    return positional if positional is not None else option


def ssh_options(accept_new: bool, known_hosts: str, connect_timeout: float) -> SshOptions:
    return SshOptions(known_hosts=known_hosts, accept_new_host_keys=accept_new,
                      connect_timeout_s=connect_timeout, auth_timeout_s=connect_timeout)


