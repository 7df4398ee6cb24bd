"""kvpush.connector.channel.Connection.gone: a peer's close is seen from any thread, through the
kernel, before the reactor has read it (real sockets, no reactor)."""
from __future__ import annotations

import socket
import time

import pytest

from kvpush.connector import wire
from kvpush.connector.channel import Connection

pytestmark = pytest.mark.unit


@pytest.fixture
def pair():
    """A TCP connection over loopback, as the side channel uses (a peer's FIN alone sets no POLLHUP)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        there = socket.create_connection(server.getsockname())
        here, _ = server.accept()
    yield Connection(here, "pair"), there
    here.close()
    there.close()


def test_an_open_connection_with_unread_messages_is_not_gone(pair):
    conn, there = pair
    there.sendall(wire.encode(wire.Ping()))
    assert not conn.gone()


def test_a_peer_close_behind_unread_messages_is_seen_without_reading_them(pair):
    conn, there = pair
    there.sendall(wire.encode(wire.Ping()))  # what a stalled prefill finds queued: pings, then the close
    there.close()
    # a loaded kernel may deliver the FIN over loopback a moment after close() returned
    deadline = time.monotonic() + 5.0
    while not conn.gone() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert conn.gone() and not conn.closed


def test_a_connection_closed_here_is_gone(pair):
    conn, _ = pair
    conn.closed = True
    assert conn.gone() and not conn.send(wire.Ping())
