"""An SSH local port forward (`ssh -L`): a port on this machine's loopback whose every connection is
carried through an SSH host's connection to an address that host reaches (a router bound to its
loopback, say). Bytes are copied both ways, one thread per connection; nothing is parsed."""
from __future__ import annotations

import select
import socket
import threading
from typing import Callable

import paramiko

from .base import HostError

LOOPBACK = "127.0.0.1"
CHUNK = 65536
Endpoint = socket.socket | paramiko.Channel  # either end of a tunnelled connection


class LocalForward:
    """Listens on 127.0.0.1:local_port (0: the kernel picks one) until close()."""

    def __init__(self, open_channel: Callable[[tuple[str, int]], paramiko.Channel], local_port: int = 0):
        self._open_channel = open_channel
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._listener.bind((LOOPBACK, local_port))
        except OSError as exc:
            self._listener.close()
            raise HostError(f"local port {local_port}: cannot listen on it ({exc.strerror or exc}); choose another "
                            "with --local-port, or 0 for any free one") from None
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self.errors: list[str] = []  # one line per connection the far side refused
        self.connections = 0
        self._thread = threading.Thread(target=self._accept_loop, name="tunnel-accept", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._listener], [], [], 0.2)
                if not ready:
                    continue
                client, peer = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._carry, args=(client, peer), name="tunnel-conn", daemon=True).start()

    def _carry(self, client: socket.socket, peer: tuple[str, int]) -> None:
        try:
            channel = self._open_channel(peer)
        except (HostError, paramiko.SSHException, OSError, EOFError) as exc:
            with self._lock:
                self.errors.append(str(exc) or type(exc).__name__)
            client.close()
            return
        with self._lock:
            self.connections += 1
            self._open.add(client)
        try:
            # Each direction ends on its own (a half-close is passed on, as ssh -L does); the
            # connection ends when both have.
            pairs: dict[Endpoint, Endpoint] = {client: channel, channel: client}
            reading: list[Endpoint] = [client, channel]
            while reading and not self._stop.is_set():
                ready, _, _ = select.select(reading, [], [], 0.2)
                for source in ready:
                    data = source.recv(CHUNK)
                    if data:
                        pairs[source].sendall(data)
                    else:
                        reading.remove(source)
                        _shut_write(pairs[source])
        except (OSError, EOFError, paramiko.SSHException):
            pass  # either end went away: the connection ends, as with ssh -L
        finally:
            channel.close()
            client.close()
            with self._lock:
                self._open.discard(client)

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join()
        with self._lock:
            for client in list(self._open):
                try:
                    client.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _shut_write(end) -> None:
    try:
        end.shutdown_write() if isinstance(end, paramiko.Channel) else end.shutdown(socket.SHUT_WR)
    except OSError:
        pass
