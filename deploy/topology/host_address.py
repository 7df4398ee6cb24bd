"""How kvpush reaches a host, and the URLs of what serves on it.

One type for the topology's hosts (which add their own settings), the plan's and the state
file's host records, and the runners. Only the fields the topology gives are set; what SSH itself
decides (port, user, key, jump hosts) comes from ~/.ssh/config where the topology is silent
(kvpush.deploy.runners.ssh_config).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated

from pydantic import Field

from .topology_values import HostAddressText, IntNotBool, PathText, PlainName, url_host

LOCAL_ADDRESSES = {"localhost", "127.0.0.1", "::1"}
DEFAULT_SSH_PORT = 22
HEALTH_PATH = "/health"


@dataclass(kw_only=True)
class HostAddress:
    # The annotations carry the topology's checks and help: HostSpec, a pydantic dataclass, applies
    # them; for the plan's and the state's records they are plain fields.
    address: Annotated[HostAddressText, Field(description="where the host's processes listen and are reached; "
                                                          "also its SSH name unless ssh_host is given")]
    ssh_port: Annotated[IntNotBool | None, Field(ge=1, le=65535, description="SSH port (default: ~/.ssh/config's Port, "
                                                                            "else 22)")] = None
    user: Annotated[PlainName | None, Field(description="SSH user (default: ~/.ssh/config's User, else yours)")] = None
    key: Annotated[PathText | None, Field(description="private key file (default: ~/.ssh/config's IdentityFile, "
                                                      "your agent, or ~/.ssh/id_*)")] = None
    ssh_host: Annotated[
        PlainName | None,
        Field(
            description="the name to look up in ~/.ssh/config and connect to "
            "(default: address), e.g. a Host alias behind a ProxyJump"
        ),
    ] = None

    def address_fields(self) -> dict:
        """This type's fields alone: another record of the same host is built from them."""
        return {f.name: getattr(self, f.name) for f in fields(HostAddress)}

    @property
    def is_local(self) -> bool:
        """This machine, driven without SSH."""
        return (self.address in LOCAL_ADDRESSES and self.ssh_port in (None, DEFAULT_SSH_PORT) and self.user is None
                and self.ssh_host is None)

    @property
    def ssh_name(self) -> str:
        return self.ssh_host or self.address

    def describe(self) -> str:
        """`user@name:port` as far as the topology says it."""
        return f"{self.user + '@' if self.user else ''}{self.ssh_name}" + (f":{self.ssh_port}" if self.ssh_port else "")


def http_url(address: str, port: int, path: str = "") -> str:
    return f"http://{url_host(address)}:{port}{path}"


def base_url(health_url: str) -> str:
    """The server's root URL, from its health URL (what the plan and the state file record)."""
    if not health_url.endswith(HEALTH_PATH):
        raise ValueError(f"{health_url} is not a health URL (it ends in {HEALTH_PATH})")
    return health_url[: -len(HEALTH_PATH)]
