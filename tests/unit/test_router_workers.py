"""router/workers.py: the sockets a supervisor hands its workers, and how it names a worker's end."""
from __future__ import annotations

import signal
import socket

import pytest

from kvpush.router.workers import describe_exit, listening_sockets

pytestmark = pytest.mark.unit


def test_every_worker_socket_listens_on_the_same_port():
    sockets = listening_sockets("127.0.0.1", 0, 1)  # port 0: let the kernel pick, then share it
    port = sockets[0].getsockname()[1]
    sockets[0].close()
    sockets = listening_sockets("127.0.0.1", port, 3)
    try:
        assert [s.getsockname() for s in sockets] == [("127.0.0.1", port)] * 3
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # one of them accepted it
    finally:
        for s in sockets:
            s.close()


def test_a_port_already_listened_on_is_refused_and_nothing_stays_bound():
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        with pytest.raises(OSError, match="in use"):
            listening_sockets("127.0.0.1", port, 2)
    finally:
        holder.close()
    listening_sockets("127.0.0.1", port, 1)[0].close()  # free again once the holder is gone


def test_sockets_already_bound_are_closed_when_a_later_one_fails(monkeypatch):
    from kvpush.router import workers

    made: list[socket.socket] = []
    real = socket.create_server

    def third_fails(address, **options):
        if len(made) == 3:
            raise OSError(24, "Too many open files")
        made.append(real(address, **options))
        return made[-1]

    monkeypatch.setattr(workers.socket, "create_server", third_fails)
    with pytest.raises(OSError, match="Too many"):
        listening_sockets("127.0.0.1", 0, 4)  # the free-port check, then two, then the failure
    assert len(made) == 3 and all(s.fileno() == -1 for s in made)


def test_a_worker_end_is_named_by_code_or_signal():
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-200) == "killed by signal 200"
