"""The transfer probe's metadata hand-over on real loopback sockets (the NIXL WRITE itself is
tests/integration/test_doctor_ssh.py's)."""
from __future__ import annotations

import json
import threading
import time

import pytest

from kvpush.deploy.doctor.transfer_probe import receive_offer, send_offer


def _receiving(port: int, nonce: str, within_s: float) -> tuple[dict, threading.Thread]:
    box: dict = {}

    def receive():
        try:
            box["offer"] = receive_offer("127.0.0.1", port, nonce, time.monotonic() + within_s)
        except RuntimeError as exc:
            box["error"] = str(exc)

    thread = threading.Thread(target=receive, daemon=True)
    thread.start()
    return box, thread


def test_the_initiator_skips_strangers_and_other_runs_and_takes_its_own_targets_offer(free_port):
    port = free_port
    box, thread = _receiving(port, "n1", within_s=30)
    deadline = time.monotonic() + 30
    send_offer("127.0.0.1", port, b"GET / HTTP/1.1\r\n\r\n", deadline)
    send_offer("127.0.0.1", port, (json.dumps({"nonce": "n0", "addr": 1}) + "\n").encode(), deadline)
    send_offer("127.0.0.1", port, (json.dumps({"nonce": "n1", "addr": 2}) + "\n").encode(), deadline)
    thread.join()
    assert box == {"offer": {"nonce": "n1", "addr": 2}}


def test_no_offer_in_time_is_one_line_naming_the_port(free_port):
    port = free_port
    box, thread = _receiving(port, "n1", within_s=0.2)
    thread.join()
    assert box == {"error": f"no metadata from the target on 127.0.0.1:{port} in time"}


def test_the_target_gives_up_naming_the_initiator_when_nothing_listens(free_port):
    port = free_port
    with pytest.raises(RuntimeError, match=f"could not send metadata to 127.0.0.1:{port}"):
        send_offer("127.0.0.1", port, b"{}\n", time.monotonic() + 0.2)
