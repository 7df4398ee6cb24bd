"""The router's URL as clients where kvpush runs reach it, and the warning when they cannot.

The plan records the router's URL as its own host reaches it (its health check and `up`'s proof
run there). A client on this machine needs the router host's address instead whenever the router
runs on another host, and that address only answers when the router listens on it: a router bound
to loopback on another host serves that host alone.
"""
from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from kvpush.deploy.topology.host_address import HostAddress, http_url

WILDCARD_BINDS = ("0.0.0.0", "::")


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def client_router_url(host: HostAddress, router_base_url: str) -> str:
    """The router's URL for a client on this machine, from its host and its URL as that host reaches
    it (a wildcard bind is reached there at 127.0.0.1, a specific bind at that address)."""
    if host.is_local:
        return router_base_url
    parts = urlsplit(router_base_url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"{router_base_url} is not a router URL (http://ADDRESS:PORT)")
    if not _is_loopback(parts.hostname):
        return router_base_url  # bound to one address of its host: clients use that one
    return http_url(host.address, parts.port)


def loopback_bind_warning(host_name: str, host: HostAddress, bind: str, port: int) -> str | None:
    """One line when the router listens on loopback of a host other than this machine (clients
    here get connection refused at the URL `plan` and `up` print), with the fix; None otherwise."""
    if host.is_local or not _is_loopback(bind) or bind == host.address:
        return None
    return (f"router.bind: {bind} on host '{host_name}' ({host.address}) serves that host alone, so "
            f"{http_url(host.address, port)} refuses clients here; set router.bind to 0.0.0.0 (with "
            "router.api_key_env) or reach it through `kvpush tunnel`")
