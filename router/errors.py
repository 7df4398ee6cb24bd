"""Error bodies shaped exactly like vLLM's OpenAI server (`{"error": {message, type, param, code}}`)."""
from __future__ import annotations

import json
from http import HTTPStatus

from aiohttp import web

# vLLM's err_type strings by status, as its create_error_response produces them.
_TYPES = {
    400: "BadRequestError",
    401: "Unauthorized",
    404: "NotFoundError",
    413: "BadRequestError",
    500: "InternalServerError",
    502: "BadGateway",
    503: "ServiceUnavailable",
    504: "GatewayTimeout",
}


def error_payload(status: int, message: str, param: str | None = None, err_type: str | None = None) -> dict:
    kind = err_type or _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, err_type: str | None = None) -> web.Response:
    return web.json_response(error_payload(status, message, param, err_type), status=status)


def sse_error_event(status: int, message: str) -> bytes:
    """An error inside an already started stream, as vLLM writes it, followed by the end marker."""
    return f"data: {json.dumps(error_payload(status, message))}\n\ndata: [DONE]\n\n".encode()
