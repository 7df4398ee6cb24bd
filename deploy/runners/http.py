"""A minimal HTTP/1.0 client over any connected socket-like object (a TCP socket or an SSH channel).

Health checks and metrics must reach binds that are local to a remote host, so requests travel
through the host's SSH connection; one client for both keeps the two runners identical.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from .base import HttpResponse


def split_url(url: str) -> tuple[str, int, str]:
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return parts.hostname or "127.0.0.1", parts.port or 80, path


def exchange(sock, host: str, port: int, method: str, path: str, body: bytes | None,
             headers: dict[str, str] | None = None) -> HttpResponse:
    head = [f"{method} {path} HTTP/1.0", f"Host: {host}:{port}", "Connection: close"]
    head += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
    chunks = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
    raw = b"".join(chunks)
    header, _, payload = raw.partition(b"\r\n\r\n")
    status_line = header.split(b"\r\n", 1)[0].split()
    if len(status_line) < 2 or not status_line[1].isdigit():
        raise ConnectionError(f"{host}:{port} answered no HTTP status line")
    return HttpResponse(status=int(status_line[1]), body=payload)
