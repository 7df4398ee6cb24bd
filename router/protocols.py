"""How each transfer protocol shapes the two legs of one request: bodies and kv_transfer_params.

Pure functions; the dispatcher decides when each leg is sent. kvpush's own fields are the
connector's contract (kvpush.common.kv_params).
"""
from __future__ import annotations

import copy
import re
import uuid
from dataclasses import dataclass

from kvpush.common.kv_params import CONSUMER, PRODUCER, PushParams

from .config import Upstream

KV_PARAMS = "kv_transfer_params"
CONCURRENT_PROTOCOLS = ("kvpush", "nixl-push")


_NOT_IN_TRANSFER_IDS = re.compile(r"[^A-Za-z0-9._-]")
MAX_CLIENT_ID_IN_TRANSFER_ID = 128


def new_transfer_id(client_request_id: str | None = None) -> str:
    """One per dispatch: a retry gets a new one so a late transfer of the failed try can't match.

    Both legs carry it as their X-Request-Id, so vLLM's request ids, logs and traces on both
    instances name the same dispatch. It starts with the client's X-Request-Id, if one was sent (at
    most 128 characters of it, any outside [A-Za-z0-9._-] replaced by '_'), so they also name the
    client's request; random hex comes last and keeps each dispatch unique and unguessable. The
    narrow alphabet is what every connector's wire takes in an id (vLLM's NIXL connectors separate
    ids by ',' and ':' and strip a trailing '-<8 hex>' of their own)."""
    random_part = uuid.uuid4().hex
    return f"{client_id_in_transfer_id(client_request_id)}-{random_part}" if client_request_id else random_part


def client_id_in_transfer_id(client_request_id: str) -> str:
    """What of the client's X-Request-Id a transfer id carries."""
    return _NOT_IN_TRANSFER_IDS.sub("_", client_request_id[:MAX_CLIENT_ID_IN_TRANSFER_ID])


# Fields that ask for more than one sequence, or for more tokens than one, from a request: a leg
# that only computes the prompt's KV (prefill's, or decode's KV-loading leg) drops them. The
# prompt-shaping fields (messages, tools, chat template arguments, truncation, cache salt) stay,
# so both instances see exactly the client's prompt tokens.
_ONE_TOKEN_DROPS = ("n", "best_of", "use_beam_search", "min_tokens", "stream_options")


def prefill_only(body: dict, chat: bool) -> dict:
    """The client's body turned into a leg that computes (or loads) the prompt: one sequence, one
    token, not streamed."""
    leg = copy.copy(body)
    for name in _ONE_TOKEN_DROPS:
        leg.pop(name, None)
    leg["max_tokens"] = 1
    if chat:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    return leg


def with_params(body: dict, params: dict | None) -> dict:
    leg = copy.copy(body)
    if params is not None:
        leg[KV_PARAMS] = params
    return leg


def kvpush_producer_params(transfer_id: str, decode: Upstream) -> dict:
    return PushParams(PRODUCER, transfer_id, decode.engine_id, decode.side_channel_host, decode.side_channel_port,
                      decode.tp_size).to_dict()


def kvpush_consumer_params(transfer_id: str, prefill: Upstream) -> dict:
    return PushParams(CONSUMER, transfer_id, prefill.engine_id, prefill.side_channel_host, prefill.side_channel_port,
                      prefill.tp_size).to_dict()


def nixl_producer_params() -> dict:
    """Prefill leg for vLLM's NixlConnector (pull) and NixlPushConnector (push)."""
    return {"do_remote_decode": True, "do_remote_prefill": False}


def vllm_base_request_id(transfer_id: str, chat: bool) -> str:
    """The id vLLM's OpenAI server derives from X-Request-Id (before the engine appends its random
    suffix): chat `chatcmpl-<id>`, completions `cmpl-<id>-<prompt index>` (the first prompt's)."""
    return f"chatcmpl-{transfer_id}" if chat else f"cmpl-{transfer_id}-0"


def nixl_push_consumer_params(prefill: Upstream, remote_request_id: str) -> dict:
    """Decode leg for NixlPushConnector: P's coordinates up front. P matches D's registration to its
    finished request by base request id, so both legs carry the same X-Request-Id (the transfer id).
    vLLM requires remote_request_id; P's exact id (with the engine's random suffix) is unknowable
    before P answers, so this is its base id."""
    return {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": prefill.engine_id,
        "remote_request_id": remote_request_id,
        "remote_host": prefill.side_channel_host,
        "remote_port": prefill.side_channel_port,
        "tp_size": prefill.tp_size,
        "pp_size": prefill.pp_size,
    }


@dataclass(frozen=True)
class Legs:
    prefill: dict
    decode: dict


def concurrent_legs(protocol: str, body: dict, chat: bool, transfer_id: str, prefill: Upstream, decode: Upstream,
                    decode_body: dict | None = None) -> Legs:
    """Both legs of a push protocol, known before either is sent. The decode leg generates from
    `decode_body` (default: the client's body)."""
    decode_body = body if decode_body is None else decode_body
    if protocol == "kvpush":
        return Legs(
            prefill=with_params(prefill_only(body, chat), kvpush_producer_params(transfer_id, decode)),
            decode=with_params(decode_body, kvpush_consumer_params(transfer_id, prefill)),
        )
    if protocol == "nixl-push":
        return Legs(
            prefill=with_params(prefill_only(body, chat), nixl_producer_params()),
            decode=with_params(
                decode_body, nixl_push_consumer_params(prefill, vllm_base_request_id(transfer_id, chat))
            ),
        )
    raise ValueError(f"protocol {protocol!r} does not dispatch both legs at once")


def pull_prefill_leg(body: dict, chat: bool) -> dict:
    return with_params(prefill_only(body, chat), nixl_producer_params())


def pull_decode_leg(body: dict, prefill_answer: dict) -> dict | None:
    """The decode leg carries what the prefill instance answered; None if it answered none."""
    params = prefill_answer.get(KV_PARAMS)
    if not isinstance(params, dict):
        return None
    return with_params(body, params)
