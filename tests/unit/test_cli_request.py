"""`kvpush request --json`: one JSON document on stdout whether the request worked or not."""
from __future__ import annotations

import json
import socket

from cli_in_process import run_cli


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_request_json_prints_a_document_when_the_router_does_not_answer(tmp_path):
    port = _closed_port()
    (tmp_path / "t.yaml").write_text(f"model: {{path: /m}}\nprefill: [{{}}]\ndecode: [{{}}]\nrouter: {{port: {port}}}\n")
    result = run_cli("request", "--file", str(tmp_path / "t.yaml"), "--json", "hello", cwd=tmp_path)
    assert result.returncode == 1
    document = json.loads(result.stdout)
    assert document["ok"] is False and document["router"] == f"http://127.0.0.1:{port}"
    assert "request failed" in document["error"] and "request failed" in result.stderr


def test_request_json_of_a_bad_topology_keeps_exit_2(tmp_path):
    (tmp_path / "t.yaml").write_text("model: {path: /m}\nrouter: {port: 0}\n")
    result = run_cli("request", "--file", str(tmp_path / "t.yaml"), "--json", "hello", cwd=tmp_path)
    assert result.returncode == 2
    document = json.loads(result.stdout)
    assert document["ok"] is False and document["router"] is None and "router.port" in document["error"]
