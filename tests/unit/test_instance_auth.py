"""kvpush.common.instance_auth: every path of an instance needs the instance key but the open ones."""
from __future__ import annotations

import asyncio
import logging

import pytest
from fastapi import FastAPI
from prometheus_client import REGISTRY
from starlette.routing import Mount
from starlette.testclient import TestClient

from kvpush.common import instance_auth
from kvpush.common.instance_auth import InstanceKeyMiddleware, public_paths

KEY = "a" * 64
BEARER = {"Authorization": f"Bearer {KEY}"}


def _refused(reason: str) -> float:
    return REGISTRY.get_sample_value("vllm:kvpush_refused_requests_total", {"reason": reason}) or 0.0


def _app(environ: dict[str, str] | None = None) -> FastAPI:
    """vLLM's shape: routes under /v1 and outside it, a /metrics mount matching /metrics*, and the
    middleware added as vLLM's --middleware adds it (the class alone)."""
    app = FastAPI()

    @app.get("/health")
    def health():
        return {}

    @app.post("/invocations")
    def invocations():
        return {"generated": True}

    @app.post("/v1/completions")
    def completions():
        return {"generated": True}

    @app.post("/tokenize")
    def tokenize():
        return {"tokens": [1]}

    @app.post("/pooling")
    def pooling():
        return {"data": []}

    async def metrics_app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"metrics"})

    mount = Mount("/metrics", metrics_app)
    app.routes.append(mount)
    env = {"VLLM_API_KEY": KEY} if environ is None else environ

    class Configured(InstanceKeyMiddleware):
        def __init__(self, inner):
            super().__init__(inner, environ=env)

    app.add_middleware(Configured)
    return app


@pytest.fixture
def client():
    with TestClient(_app()) as c:
        yield c


@pytest.mark.parametrize("method,path", [("POST", "/invocations"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
                                         ("POST", "/pooling"), ("GET", "/docs"), ("GET", "/openapi.json"),
                                         ("GET", "/no-such-path"), ("OPTIONS", "/v1/completions"), ("GET", "/metrics/x"),
                                         ("GET", "/metricsx"), ("GET", "//health"), ("GET", "/health/x")])
def test_every_path_but_the_open_ones_needs_the_key(client, method, path):
    before = _refused("no_key")
    response = client.request(method, path, json={})
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == 401
    assert _refused("no_key") == before + 1


@pytest.mark.parametrize("path", ["/invocations", "/v1/completions", "/tokenize", "/pooling"])
def test_the_key_opens_every_path(client, path):
    assert client.post(path, json={}, headers=BEARER).status_code == 200
    assert client.post(path, json={}, headers={"Authorization": f"bearer {KEY}"}).status_code == 200


@pytest.mark.parametrize("header,reason", [(f"Bearer {KEY[:-1]}b", "wrong_key"), (f"Bearer {KEY}x", "wrong_key"),
                                           ("Bearer client-key", "wrong_key"), (f"Basic {KEY}", "no_key"),
                                           (KEY, "no_key"), ("Bearer ", "no_key"), ("", "no_key")])
def test_a_wrong_or_malformed_key_is_refused_and_counted_by_reason(client, header, reason):
    before = _refused(reason)
    assert client.post("/invocations", json={}, headers={"Authorization": header}).status_code == 401
    assert _refused(reason) == before + 1


@pytest.mark.parametrize("path", ["/health", "/metrics", "/metrics/", "/health?x=/v1/completions"])
def test_the_open_paths_answer_without_a_key(client, path):
    before = _refused("no_key") + _refused("wrong_key")
    assert client.get(path).status_code == 200
    assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 200
    assert _refused("no_key") + _refused("wrong_key") == before


def test_the_deployment_chooses_the_open_paths():
    with TestClient(_app({"VLLM_API_KEY": KEY, "KVPUSH_INSTANCE_PUBLIC_PATHS": ""})) as closed:
        assert closed.get("/health").status_code == 401 and closed.get("/metrics").status_code == 401
        assert closed.get("/health", headers=BEARER).status_code == 200
    with TestClient(_app({"VLLM_API_KEY": KEY, "KVPUSH_INSTANCE_PUBLIC_PATHS": "/health"})) as health_only:
        assert health_only.get("/health").status_code == 200 and health_only.get("/metrics").status_code == 401


def test_public_paths_parse_and_refuse_what_is_not_a_path():
    assert public_paths(None) == {"/health", "/health/", "/metrics", "/metrics/"}
    assert public_paths(" /health , ") == {"/health", "/health/"}
    assert public_paths("") == frozenset()
    with pytest.raises(ValueError, match="KVPUSH_INSTANCE_PUBLIC_PATHS: 'health' is not a path"):
        public_paths("health")


@pytest.mark.parametrize("environ", [{}, {"VLLM_API_KEY": ""}])
def test_an_instance_without_a_key_refuses_to_start(environ):
    with pytest.raises(RuntimeError, match="VLLM_API_KEY is unset or empty, and this instance would answer anyone"):
        InstanceKeyMiddleware(lambda *a: None, environ=environ)


def test_websockets_need_the_key_too():
    calls = []

    async def inner(scope, receive, send):
        calls.append(scope["path"])

    sent = []

    async def send(message):
        sent.append(message)

    middleware = InstanceKeyMiddleware(inner, environ={"VLLM_API_KEY": KEY})
    asyncio.run(middleware({"type": "websocket", "path": "/v1/realtime", "headers": []}, None, send))
    assert sent == [{"type": "websocket.close", "code": 1008}] and calls == []
    sent.clear()
    asyncio.run(middleware({"type": "websocket", "path": "/v1/realtime", "headers": [],
                            "extensions": {"websocket.http.response": {}}}, None, send))
    assert [m["type"] for m in sent] == ["websocket.http.response.start", "websocket.http.response.body"]
    assert sent[0]["status"] == 401 and calls == []
    asyncio.run(middleware({"type": "websocket", "path": "/v1/realtime",
                            "headers": [(b"authorization", f"Bearer {KEY}".encode())]}, None, send))
    assert calls == ["/v1/realtime"]


def test_lifespan_passes_through():
    seen = []

    async def inner(scope, receive, send):
        seen.append(scope["type"])

    asyncio.run(InstanceKeyMiddleware(inner, environ={"VLLM_API_KEY": KEY})({"type": "lifespan"}, None, None))
    assert seen == ["lifespan"]


def test_refusals_are_logged_at_most_once_per_interval_with_the_count(caplog):
    now = [100.0]
    middleware = InstanceKeyMiddleware(lambda *a: None, environ={"VLLM_API_KEY": KEY}, clock=lambda: now[0])

    async def send(message):
        pass

    def attack(path):
        scope = {"type": "http", "method": "POST", "path": path, "headers": [], "client": ("10.0.0.9", 5555)}
        asyncio.run(middleware(scope, None, send))

    logger = logging.getLogger(instance_auth.__name__)  # inside vLLM it logs through vLLM's handlers, not the root's
    logger.addHandler(caplog.handler)
    propagate, logger.propagate = logger.propagate, False
    try:
        attack("/invocations")
        for _ in range(5):
            attack("/tokenize")
        now[0] += instance_auth.LOG_EVERY_S
        attack("/pooling\nforged line")
    finally:
        logger.removeHandler(caplog.handler)
        logger.propagate = propagate
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "refused 1 request(s)" in lines[0] and "'/invocations' from 10.0.0.9 (no_key)" in lines[0]
    assert "refused 6 request(s)" in lines[1] and "'/pooling\\nforged line'" in lines[1]  # repr: one line, always
