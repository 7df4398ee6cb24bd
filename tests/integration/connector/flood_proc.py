"""Strangers flooding a prefill's side channel, in their own process: `python flood_proc.py PORT
SECONDS` opens connection after connection for SECONDS and sends each what a peer without the key
can send before proving it (a HELLO padded to 1 MiB, random bytes, a frame that is no message, a
HELLO twice, a HELLO and a forged proof, a HELLO and silence), then prints {"connections": N}."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time

from kvpush.connector import auth, wire


def payloads() -> list[bytes]:
    hello = wire.Hello("D.flood", 0, 1, nonce=auth.new_nonce())
    huge = json.dumps({"type": "hello", "engine_id": "D.flood", "tp_rank": 0, "tp_size": 1, "nonce": hello.nonce,
                       "agent_metadata": "A" * (1 << 20)}).encode()  # what a HELLO carrying NIXL metadata cost before
    return [wire.LENGTH.pack(len(huge)) + huge,
            os.urandom(4096),
            wire.LENGTH.pack(9) + b"not json!",
            wire.encode(hello) * 2,
            wire.encode(hello) + wire.encode(wire.Auth("ab" * 32, "cd" * 32)),
            wire.encode(hello)]


def main() -> None:
    port, seconds = int(sys.argv[1]), float(sys.argv[2])
    kinds, count, end = payloads(), 0, time.monotonic() + seconds
    held: list[socket.socket] = []
    while time.monotonic() < end:
        payload = kinds[count % len(kinds)]
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            continue
        with contextlib.suppress(OSError):
            sock.sendall(payload)
        count += 1
        if payload is kinds[-1]:
            held.append(sock)  # a stranger that stays, silent, until the prefill's auth deadline
            held = held[-64:]
        else:
            sock.close()
    for sock in held:
        sock.close()
    print(json.dumps({"connections": count}), flush=True)


if __name__ == "__main__":
    main()
