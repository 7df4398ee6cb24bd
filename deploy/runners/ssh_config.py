"""Where an SSH connection goes: the topology's fields, completed by ~/.ssh/config.

What the topology gives wins; where it is silent, the config's Host blocks decide as they do for
`ssh`: HostName, Port, User, IdentityFile (IdentitiesOnly), and ProxyJump, whose hops are looked
up in the same file. Parsing is paramiko's SSHConfig; nothing here connects.
"""
from __future__ import annotations

import getpass
import os
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from ..host_address import DEFAULT_SSH_PORT, HostAddress
from .base import HostError

MAX_JUMPS = 8  # a longer chain is a loop in the config, as a rule


@dataclass(frozen=True)
class SshTarget:
    name: str  # as the topology or a ProxyJump wrote it (an alias or an address)
    hostname: str
    port: int
    user: str
    key_files: tuple[str, ...] = ()  # empty: the agent and ~/.ssh/id_*
    agent: bool = True
    jumps: tuple["SshTarget", ...] = field(default=())  # hops, the first one connected to first

    def describe(self) -> str:
        via = f" via {', '.join(j.describe() for j in self.jumps)}" if self.jumps else ""
        return f"{self.user}@{self.hostname}:{self.port}{via}"


def read_config(path: str) -> paramiko.SSHConfig:
    """The config at `path` (~ expanded); an empty one where there is no file."""
    config_file = Path(os.path.expanduser(path))
    try:
        return paramiko.SSHConfig.from_path(str(config_file))
    except FileNotFoundError:
        return paramiko.SSHConfig()
    except (OSError, UnicodeDecodeError) as exc:
        raise HostError(f"{config_file}: cannot read the SSH config ({exc}); fix it or pass --ssh-config") from None
    except Exception as exc:  # paramiko's parse errors have no common class
        raise HostError(f"{config_file}: not a valid SSH config ({exc}); fix it or pass --ssh-config") from None


def resolve(host: HostAddress, config: paramiko.SSHConfig, config_name: str = "~/.ssh/config") -> SshTarget:
    """Where and as whom to connect for `host`, through which hops."""
    return _resolve(host.ssh_name, host.ssh_port, host.user, [host.key] if host.key else None, config, config_name,
                    depth=0, follow_jumps=True)


def _resolve(name: str, port: int | None, user: str | None, keys: list[str] | None, config: paramiko.SSHConfig,
             config_name: str, depth: int, follow_jumps: bool) -> SshTarget:
    if depth > MAX_JUMPS:
        raise HostError(f"{config_name}: ProxyJump for {name} goes more than {MAX_JUMPS} hops deep; is it a loop?")
    entry = config.lookup(name)
    if entry.get("proxycommand", "none").lower() != "none":
        raise HostError(f"{config_name}: ProxyCommand for {name} is not supported by kvpush; reach the host with "
                        "ProxyJump instead")
    if keys is None:
        keys = [k for k in entry.get("identityfile", []) if Path(k).expanduser().is_file()]
        agent = entry.get("identitiesonly", "no").lower() != "yes" or not keys
    else:
        agent = False  # the topology named the key: that key alone
    try:
        resolved_port = port or int(entry.get("port", DEFAULT_SSH_PORT))
    except ValueError:
        raise HostError(f"{config_name}: Port for {name} is '{entry['port']}', not a number") from None
    jumps: tuple[SshTarget, ...] = ()
    jump_text = entry.get("proxyjump", "none")
    if follow_jumps and jump_text.lower() != "none":
        hops = [_hop(part, config, config_name, depth, first=i == 0) for i, part in enumerate(jump_text.split(","))]
        jumps = tuple(j for hop in hops for j in (*hop.jumps, hop))
        jumps = tuple(SshTarget(j.name, j.hostname, j.port, j.user, j.key_files, j.agent) for j in jumps)
    return SshTarget(name, entry.get("hostname", name), resolved_port, user or entry.get("user") or getpass.getuser(),
                     tuple(str(Path(k).expanduser()) for k in keys), agent, jumps)


def _hop(text: str, config: paramiko.SSHConfig, config_name: str, depth: int, first: bool) -> SshTarget:
    """One ProxyJump hop, `[user@]host[:port]`; as with ssh, only the first hop's own ProxyJump applies."""
    text = text.strip()
    user, _, rest = text.rpartition("@")
    name, port = rest, None
    if rest.startswith("["):  # [address]:port
        name, _, tail = rest[1:].partition("]")
        port = tail[1:] or None
    elif rest.count(":") == 1:
        name, port = rest.split(":")
    if not name:
        raise HostError(f"{config_name}: ProxyJump hop '{text}' names no host")
    try:
        port_number = int(port) if port else None
    except ValueError:
        raise HostError(f"{config_name}: ProxyJump hop '{text}' has the port '{port}', not a number") from None
    return _resolve(name, port_number, user or None, None, config, config_name, depth + 1, follow_jumps=first)
