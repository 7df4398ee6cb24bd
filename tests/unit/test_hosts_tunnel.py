"""`kvpush tunnel`: where the router is, and the local forward's byte copying (over a plain TCP
connection standing in for the SSH channel; tests/integration/test_exec_tunnel_ssh.py uses sshd)."""
from __future__ import annotations

import socket
import threading

import pytest

from kvpush.common.errors import KvpushError
from kvpush.deploy.lifecycle.hosts_tunnel import free_local_port, router_endpoint
from kvpush.deploy.lifecycle.state import DeploymentState, HostRecord, ProcessRecord
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.runners.base import HostError
from kvpush.deploy.runners.ssh_tunnel import LocalForward
from kvpush.deploy.topology.topology import resolve_topology


def test_the_router_is_where_up_recorded_it_else_where_the_plan_puts_it():
    plan = build_plan(resolve_topology(None)[0])
    planned = router_endpoint("local-cpu", None, plan)
    assert (planned.host, planned.url) == ("local", plan.router_url.rstrip("/"))
    router = ProcessRecord("router", "router", "gpu", 1, 1, None, 9000, "http://127.0.0.1:9000/health", "r.log", "d", 0.0)
    state = DeploymentState("local-cpu", hosts={"gpu": HostRecord(address="10.0.0.9", workdir="/w")},
                            processes={"router": router})
    recorded = router_endpoint("local-cpu", state, plan)
    assert (recorded.host, recorded.record.address, recorded.address, recorded.port) == ("gpu", "10.0.0.9", "127.0.0.1", 9000)
    with pytest.raises(KvpushError, match="deployment x: no router recorded or planned; give its topology with --file"):
        router_endpoint("x", None, None)


def _echo_server() -> socket.socket:
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data.upper())

    threading.Thread(target=serve, daemon=True).start()
    return server


def test_every_connection_is_carried_both_ways_and_close_ends_them():
    server = _echo_server()
    forward = LocalForward(lambda peer: socket.create_connection(server.getsockname()), 0)
    try:
        payload = b"kv" * 100_000  # more than one chunk each way
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", forward.port)) as client:
                client.sendall(payload)
                client.shutdown(socket.SHUT_WR)
                got = b""
                while chunk := client.recv(65536):
                    got += chunk
            assert got == payload.upper()
        assert forward.connections == 2 and forward.url == f"http://127.0.0.1:{forward.port}"
    finally:
        forward.close()
        server.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", forward.port)).close()


def test_a_refused_far_side_is_recorded_and_a_taken_port_is_a_one_line_error():
    def refuse(peer):
        raise ConnectionRefusedError("127.0.0.1:9 refused through gpu")

    forward = LocalForward(refuse, 0)
    try:
        with socket.create_connection(("127.0.0.1", forward.port)) as client:
            assert client.recv(10) == b""  # closed at once
        assert forward.errors == ["127.0.0.1:9 refused through gpu"]
        assert free_local_port(forward.port) == 0
        with pytest.raises(HostError, match=rf"local port {forward.port}: cannot listen on it .*--local-port"):
            LocalForward(refuse, forward.port)
    finally:
        forward.close()
