"""Rules that keep a topology from loosening what kvpush secures: the connector's security entries
stay kvpush's, and a secret is given in one place only."""
from __future__ import annotations

from typing import Callable

from .topology_schema import Topology
from .topology_values import kvpush_security_key_problem, secret_name

Fail = Callable[[tuple, str], None]


def check_security_fields(topo: Topology, fail: Fail) -> None:
    for key in topo.connector.extra_config:
        problem = kvpush_security_key_problem(key)
        if problem:
            fail(("connector", "extra_config", key), problem)
    plain: dict[str, tuple] = {name: ("env", name) for name in topo.env}
    for role, index, spec in topo.instances():
        plain.update({name: (role, index, "env", name) for name in spec.env})
    for name in topo.secrets:
        try:
            secret_name(name)
        except ValueError as exc:
            fail(("secrets", name), str(exc))
        if name in plain:
            shown = ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in plain[name]).replace(".[", "[")
            fail(("secrets", name), f"{name} is also set by {shown}; keep it in secrets only (a value there is "
                                    "never printed) and remove it from env")
