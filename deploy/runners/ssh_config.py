"""Where an SSH connection goes, as OpenSSH's own client reads ~/.ssh/config.

kvpush asks OpenSSH itself: `ssh -G NAME` prints the configuration `ssh NAME` would use after
every Host and Match block, Include (globs, relative to ~/.ssh, nested), the system-wide
/etc/ssh/ssh_config and the defaults. So kvpush and `ssh` never disagree about a config, and no
second parser has to follow OpenSSH's rules. What the topology gives wins, as a command-line
option does for `ssh` (`-p`, `-l`; a topology `key` is that key alone). Nothing here connects;
paramiko does, through the target this module returns (ssh.py).
"""
from __future__ import annotations

import getpass
import hashlib
import os
import pwd
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import overload

from kvpush.deploy.topology.host_address import DEFAULT_SSH_PORT, HostAddress

from .base import HostError
from .options import DEFAULT_SSH_CONFIG, SshOptions

MAX_JUMPS = 8  # a longer chain is a loop in the config, as a rule
READ_TIMEOUT_S = 15.0  # `ssh -G` runs `Match exec` commands; one that hangs must not hang kvpush
UNKNOWN_KEY_POLICIES = ("yes", "ask")  # an unknown host key is refused (kvpush never asks on a terminal)


@dataclass(frozen=True)
class SshTarget:
    name: str  # as the topology or a ProxyJump wrote it (an alias or an address)
    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...] = ()  # empty: the agent and ~/.ssh/id_*
    agent: bool = True
    jumps: tuple[SshTarget, ...] = field(default=())  # hops, the first one connected to first
    proxy_command: str | None = None  # tokens expanded; run through the user's shell (ssh.py)
    known_hosts: tuple[str, ...] = ("~/.ssh/known_hosts",)  # checked in order; new keys go to the first
    global_known_hosts: tuple[str, ...] = ()  # read, never written
    strict_host_key_checking: str = "ask"  # yes | ask | accept-new | no, as OpenSSH's StrictHostKeyChecking
    host_key_alias: str | None = None
    hash_known_hosts: bool = False

    @property
    def known_hosts_name(self) -> str:
        """The name its key is recorded under in known_hosts, as OpenSSH writes it."""
        if self.host_key_alias:
            return self.host_key_alias
        return self.hostname if self.port == DEFAULT_SSH_PORT else f"[{self.hostname}]:{self.port}"

    def describe(self) -> str:
        via = f" via {', '.join(j.describe() for j in self.jumps)}" if self.jumps else ""
        proxy = f" via ProxyCommand '{self.proxy_command}'" if self.proxy_command else ""
        return f"{self.user}@{self.hostname}:{self.port}{via}{proxy}"


def config_label(options: SshOptions) -> str:
    return options.config_file or DEFAULT_SSH_CONFIG


def resolve(host: HostAddress, options: SshOptions = SshOptions()) -> SshTarget:
    """Where and as whom to connect for `host`, through which hops or proxy command."""
    return _resolve(host.ssh_name, host.ssh_port, host.user, [host.key] if host.key else None, options,
                    depth=0, follow_proxies=True)


def read_effective(
    name: str, options: SshOptions, port: int | None = None, user: str | None = None
) -> dict[str, list[str]]:
    """`ssh -G`'s answer for `name`: each keyword (lowercase) with its values, in order.

    A config ssh refuses is a HostError naming the file and line, as ssh says them."""
    config = options.config_file
    if shutil.which("ssh") is None:
        given = Path(os.path.expanduser(config or DEFAULT_SSH_CONFIG))
        if given.exists() or (config is None and Path("/etc/ssh/ssh_config").exists()):
            raise HostError(f"{given}: kvpush reads the SSH config with OpenSSH's client (`ssh -G`), which is not "
                            "installed here; install it (apt-get install openssh-client)")
        return {}
    argv = ["ssh", "-G"] + (["-F", os.path.expanduser(config)] if config else [])
    argv += (["-p", str(port)] if port else []) + (["-l", user] if user else []) + ["--", name]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=READ_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise HostError(f"{config_label(options)}: `ssh -G {name}` did not finish in {READ_TIMEOUT_S:.0f} s; "
                        "check the config's `Match exec` commands") from None
    if done.returncode != 0:
        raise HostError(_config_error(done.stderr, config_label(options), name))
    values: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition(" ")
        values.setdefault(key.lower(), []).append(value)
    return values


def _config_error(stderr: str, config: str, name: str) -> str:
    """ssh's complaint as one line: `FILE: line N: WHAT`, and the fix."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for line in lines:  # ssh writes `FILE: line N: ...` or `FILE line N: ...`
        located = re.match(r"(.+?):? line (\d+): (.+)", line)
        if located:
            where, number, what = located.groups()
            return (f"{where}: line {number}: {what.rstrip('.')}; fix or remove that line "
                    "(`man ssh_config` lists the keywords)")
    said = [ln for ln in lines if "Pseudo-terminal" not in ln]
    return f"{config}: ssh cannot read its config for {name}: {said[-1] if said else 'no message'}; fix the config"


def _resolve(name: str, port: int | None, user: str | None, keys: list[str] | None, options: SshOptions,
             depth: int, follow_proxies: bool) -> SshTarget:
    label = config_label(options)
    if depth > MAX_JUMPS:
        raise HostError(f"{label}: ProxyJump for {name} goes more than {MAX_JUMPS} hops deep; is it a loop?")
    entry = read_effective(name, options, port, user)

    @overload
    def first(key: str) -> str | None: ...
    @overload
    def first(key: str, default: str) -> str: ...
    def first(key: str, default: str | None = None) -> str | None:
        return entry.get(key, [default])[0]  # ssh -G gives each key a value: a default only for one it left out

    try:
        resolved_port = int(first("port", str(port or DEFAULT_SSH_PORT)))
    except ValueError:
        raise HostError(f"{label}: Port for {name} is '{first('port')}', not a number") from None
    hostname = first("hostname", name)
    resolved_user = user or first("user") or getpass.getuser()
    jump_text = first("proxyjump", "none") if follow_proxies else "none"
    tokens = _tokens(name, hostname, resolved_port, resolved_user, jump_text, first("hostkeyalias"))
    if keys is None:
        found = [_expand_path(k, tokens, f"{label}: IdentityFile for {name}") for k in entry.get("identityfile", [])]
        keys = [k for k in found if Path(k).is_file()]  # as ssh does: a missing IdentityFile is passed over
        agent = first("identitiesonly", "no").lower() != "yes" or not keys
    else:
        keys = [os.path.expanduser(k) for k in keys]
        agent = False  # the topology named the key: that key alone
    jumps: tuple[SshTarget, ...] = ()
    if jump_text.lower() != "none":
        hops = [_hop(part, options, depth, first=i == 0) for i, part in enumerate(jump_text.split(","))]
        flat = [j for hop in hops for j in (*hop.jumps, hop)]
        jumps = tuple(SshTarget(**{**j.__dict__, "jumps": ()}) for j in flat)
    proxy = first("proxycommand", "none") if follow_proxies and not jumps else "none"
    proxy_command = None if proxy.lower() == "none" else _expand(proxy, tokens, f"{label}: ProxyCommand for {name}")
    if proxy_command is not None and proxy_command.startswith("-"):
        raise HostError(f"{label}: ProxyCommand for {name} starts with '-'; give the command itself")
    return SshTarget(
        name, hostname, resolved_port, resolved_user, tuple(keys), agent, jumps, proxy_command,
        known_hosts=tuple((options.known_hosts,) if options.known_hosts else _words(entry, "userknownhostsfile")
                          or ("~/.ssh/known_hosts",)),
        global_known_hosts=() if options.known_hosts else _words(entry, "globalknownhostsfile"),
        strict_host_key_checking=_strict(first("stricthostkeychecking", "ask")),
        host_key_alias=first("hostkeyalias"),
        hash_known_hosts=first("hashknownhosts", "no").lower() == "yes",
    )


def _words(entry: dict[str, list[str]], key: str) -> tuple[str, ...]:
    return tuple(w for value in entry.get(key, []) for w in value.split() if w.lower() != "none")


def _strict(value: str) -> str:
    value = value.lower()
    return {"true": "yes", "false": "no", "off": "no", "on": "yes"}.get(value, value)


def _hop(text: str, options: SshOptions, depth: int, first: bool) -> SshTarget:
    """One ProxyJump hop, `[user@]host[:port]` or `ssh://[user@]host[:port]`, resolved with its own
    config. As with ssh (`ProxyJump a,b` runs `ssh -J a -W ... b`), only the first hop's own
    ProxyJump or ProxyCommand applies."""
    label = config_label(options)
    text = text.strip().removeprefix("ssh://")
    user, _, rest = text.rpartition("@")
    name, port = rest, None
    if rest.startswith("["):  # [address]:port
        name, _, tail = rest[1:].partition("]")
        port = tail[1:] or None
    elif rest.count(":") == 1:
        name, port = rest.split(":")
    if not name:
        raise HostError(f"{label}: ProxyJump hop '{text}' names no host")
    try:
        port_number = int(port) if port else None
    except ValueError:
        raise HostError(f"{label}: ProxyJump hop '{text}' has the port '{port}', not a number") from None
    return _resolve(name, port_number, user or None, None, options, depth + 1, follow_proxies=first)


# -- tokens, as ssh_config(5) defines them ------------------------------------------------------

def _home() -> str:
    """The home OpenSSH expands `~` to: the user's passwd entry, not $HOME."""
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return os.path.expanduser("~")


def _tokens(original: str, hostname: str, port: int, user: str, jump: str, alias: str | None) -> dict[str, str]:
    local = socket.gethostname()
    jump = "" if jump.lower() == "none" else jump
    values = {"%": "%", "h": hostname, "p": str(port), "r": user, "n": original, "u": getpass.getuser(), "d": _home(),
              "i": str(os.getuid()), "l": local, "L": local.split(".")[0], "j": jump, "k": alias or original}
    values["C"] = hashlib.sha1(f"{local}{hostname}{port}{user}{jump}".encode()).hexdigest()
    return values


def _expand(text: str, tokens: dict[str, str], what: str) -> str:
    def one(match: re.Match) -> str:
        letter = match.group(1)
        if letter not in tokens:
            raise HostError(f"{what} uses the unknown token %{letter}; ssh_config(5) lists the tokens "
                            "(%h %p %r %n %u %d %l %L %i %j %k %C %%)")
        return tokens[letter]

    return re.sub(r"%(.)", one, text)


def _expand_path(text: str, tokens: dict[str, str], what: str) -> str:
    expanded = _expand(text, tokens, what)
    if expanded == "~" or expanded.startswith("~/"):
        return _home() + expanded[1:]
    return os.path.expanduser(expanded)
