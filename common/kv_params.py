"""The per-request `kv_transfer_params` of kvpush's connector: the router writes them on each
leg, the connector reads them. Defined once, here.

prefill leg: {"kvpush_role": "producer", "transfer_id", "peer_engine_id", "peer_host", "peer_port", "peer_tp_size"}
decode leg:  {"kvpush_role": "consumer", ... the same keys, naming the prefill instance}
The peer is the instance at the other end; its side channel listens on peer_port + its TP rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ROLE_KEY = "kvpush_role"
PRODUCER = "producer"
CONSUMER = "consumer"


class ParamsError(ValueError):
    pass


@dataclass(frozen=True)
class PushParams:
    role: Literal["producer", "consumer"]
    transfer_id: str
    peer_engine_id: str
    peer_host: str
    peer_port: int
    peer_tp_size: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {ROLE_KEY: self.role, "transfer_id": self.transfer_id, "peer_engine_id": self.peer_engine_id,
                "peer_host": self.peer_host, "peer_port": self.peer_port, "peer_tp_size": self.peer_tp_size}

    @classmethod
    def parse(cls, params: Any) -> "PushParams | None":
        """None for requests without kvpush params; ParamsError for malformed ones."""
        if not isinstance(params, dict) or ROLE_KEY not in params:
            return None
        role = params[ROLE_KEY]
        if role not in (PRODUCER, CONSUMER):
            raise ParamsError(f"{ROLE_KEY} must be '{PRODUCER}' or '{CONSUMER}', not {role!r}")
        try:
            parsed = cls(role, str(params["transfer_id"]), str(params["peer_engine_id"]),
                         str(params["peer_host"]), int(params["peer_port"]), int(params.get("peer_tp_size", 1)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ParamsError(f"kvpush kv_transfer_params are incomplete or malformed: {exc}") from None
        if not parsed.transfer_id or not 0 < parsed.peer_port < 65536:
            raise ParamsError("kvpush kv_transfer_params need a transfer_id and a valid peer_port")
        if not 0 < parsed.peer_tp_size <= 1024:
            raise ParamsError(f"kvpush kv_transfer_params: peer_tp_size {parsed.peer_tp_size} is not a TP size")
        return parsed
