"""The facts probe's port work on real loopback sockets: who counts as the peer a listener waits for."""
from __future__ import annotations

import socket
import threading

from kvpush.deploy.doctor.facts_probe import PortWork


def _listening(port: int, expect: int) -> tuple[PortWork, threading.Thread]:
    work = PortWork({"host": "b", "nonce": "n1", "reach_window_s": 5.0, "expect_incoming": expect,
                     "listen": [{"addr": "127.0.0.1", "port": port, "label": "decode-0 HTTP"}], "connect": []})
    thread = threading.Thread(target=work.run, daemon=True)
    thread.start()
    return work, thread


def _stranger_says(port: int, what: bytes) -> bytes:
    """Connects as something else would (a router's health probe), once the listener is up."""
    while True:
        try:
            conn = socket.create_connection(("127.0.0.1", port), timeout=5)
            break
        except ConnectionRefusedError:
            continue
    with conn:
        conn.sendall(what)
        conn.shutdown(socket.SHUT_WR)
        return conn.recv(512)


def _reach(port: int, nonce: str = "n1") -> dict:
    work = PortWork({"host": "a", "nonce": nonce, "reach_window_s": 5.0, "listen": [],
                     "connect": [{"addr": "127.0.0.1", "port": port, "label": "decode-0 HTTP", "host": "b"}]})
    work.run()
    return work.reach_results[0]


def test_a_stranger_connecting_first_neither_counts_nor_closes_the_listener_before_the_peer(free_port):
    port = free_port
    listener, thread = _listening(port, expect=1)
    assert _stranger_says(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n") == b""
    reached = _reach(port)
    thread.join()
    assert reached["ok"], reached
    assert reached["answer"] == f"KVPUSH-DOCTOR n1 b {port}"
    assert listener.incoming == 1


def test_a_peer_from_another_doctor_run_is_not_answered(free_port):
    port = free_port
    listener, thread = _listening(port, expect=1)
    other_run = _reach(port, nonce="n2")
    assert not other_run["ok"] and listener.incoming == 0
    assert _reach(port)["ok"]
    thread.join()
    assert listener.incoming == 1
