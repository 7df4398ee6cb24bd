"""The options several commands share, defined once so every command names them the same way.

Every command that reads a topology takes it as `--file`, so a script can name it one way for all
of them; a command whose positional argument is free (all but `logs PROCESS` and `request PROMPT`)
takes it there too, as the shorter form. `-f` is left to `logs --follow`, as in `tail -f`.
"""
from __future__ import annotations

import inspect
import shlex
from pathlib import Path

import typer

from kvpush.common.errors import UsageError
from kvpush.deploy.runners import SshOptions

FILE_HELP = "Topology file (default: ./kvpush.yaml, else the built-in local-cpu)."
FILE_ARG = typer.Argument(None, help=FILE_HELP)
FILE_OPTION = typer.Option(None, "--file", help=FILE_HELP)

ACCEPT = typer.Option(
    False, "--accept-new-host-keys", help="Record unknown SSH host keys in known_hosts (trust on first use)."
)
KNOWN_HOSTS = typer.Option(None, "--known-hosts", envvar="KVPUSH_KNOWN_HOSTS", show_default=False,
                           help="known_hosts file to verify SSH hosts against (default: the SSH config's "
                                "UserKnownHostsFile, ~/.ssh/known_hosts).")
CONNECT_TIMEOUT = typer.Option(10.0, "--connect-timeout", help="Seconds to connect and authenticate to each host.")
DEPLOYMENT = typer.Option(None, "--deployment", "-d", help="Deployment name (default: the topology's name).")


HELP_WIDTH = 78  # an 80-column terminal, less the help's margin


def examples(*lines: tuple[str, str]) -> str:
    """A command's help epilog: (command line, what it does) per example, as shell lines a user can copy.
    Each comment goes after its command where all of them fit an 80-column terminal, else on the line above."""
    width = max(len(command) for command, _ in lines)
    if width + max(len(what) for _, what in lines) + 5 <= HELP_WIDTH:
        return "Examples:\n" + "\n".join(f"{command:<{width}}   # {what}" for command, what in lines)
    return "Examples:\n" + "\n".join(f"# {what}\n{command}" for command, what in lines)


def unwrapped(doc: str) -> str:
    """A docstring as help text: each paragraph one line, for the help to wrap at the terminal's width
    (typer's rich help keeps a docstring's line breaks, which would break lines mid-sentence)."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def topology_file(positional: Path | None, option: Path | None) -> Path | None:
    """The topology file of a command that takes it either way; two different files are an error."""
    if positional is not None and option is not None and positional.resolve() != option.resolve():
        raise UsageError(f"the topology is given twice ({positional} and --file {option}); give one of them")
    return positional if positional is not None else option


# For `logs` and `request`, whose one argument is not the topology: extra words reach one_argument,
# which can say what was meant instead of click's "unexpected extra argument".
EXTRA_ARGUMENTS = {"allow_extra_args": True}


def one_argument(command: str, what: str, args: list[str], file: Path | None) -> str | None:
    """The one positional argument of `logs` or `request`. Both take the topology as --file, so a
    YAML file in that place is the likely mistake (`kvpush logs my.yaml decode`): it is named with
    the command line that was meant, rather than read as a process name or sent as a prompt."""
    if file is None and args and args[0].endswith((".yaml", ".yml")) and Path(args[0]).is_file():
        rest = " ".join(shlex.quote(a) for a in args[1:]) or what
        raise UsageError(f"{args[0]} is a topology file; {command} takes it as --file: "
                         f"kvpush {command} --file {shlex.quote(args[0])} {rest}")
    if len(args) > 1:
        raise UsageError(f"{command} takes one {what}, got {len(args)} arguments ({' '.join(map(shlex.quote, args))}); "
                         "quote it if it has spaces")
    return args[0] if args else None


def ssh_options(accept_new: bool, known_hosts: str | None, connect_timeout: float) -> SshOptions:
    return SshOptions(known_hosts=known_hosts, accept_new_host_keys=accept_new,
                      connect_timeout_s=connect_timeout, auth_timeout_s=connect_timeout)


