"""The per-request `kv_transfer_params` the router sends on each leg (the router contract).

prefill leg: {"kvpush_role": "producer", "transfer_id", "peer_engine_id", "peer_host", "peer_port"}
decode leg:  {"kvpush_role": "consumer", ..., "peer_tp_size"}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

ROLE_KEY = "kvpush_role"


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

    @classmethod
    def parse(cls, params: Any) -> "PushParams | None":
        """None for requests without kvpush params; ParamsError for malformed ones."""
        if not isinstance(params, dict) or ROLE_KEY not in params:
            return None
        role = params[ROLE_KEY]
        if role not in ("producer", "consumer"):
            raise ParamsError(f"{ROLE_KEY} must be 'producer' or 'consumer', not {role!r}")
        try:
            parsed = cls(role, str(params["transfer_id"]), str(params["peer_engine_id"]),
                         str(params["peer_host"]), int(params["peer_port"]), int(params.get("peer_tp_size", 1)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ParamsError(f"kvpush kv_transfer_params are incomplete or malformed: {exc}") from None
        if not parsed.transfer_id or not 0 < parsed.peer_port < 65536:
            raise ParamsError("kvpush kv_transfer_params need a transfer_id and a valid peer_port")
        return parsed
