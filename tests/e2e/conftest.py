"""Fixtures of the e2e tests (real vLLM on CPU)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def reference_server(tmp_path_factory):
    """The session's plain vLLM server (tests/reference_server.py); it starts only when a test
    first asks for its URL or start, so a session without such a test never starts it."""
    from reference_server import ReferenceServer

    server = ReferenceServer(tmp_path_factory.mktemp("reference"))
    try:
        yield server
    finally:
        server.stop()
