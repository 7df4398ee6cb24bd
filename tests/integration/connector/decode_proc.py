"""A decode-side push consumer in its own process, driven over stdin/stdout by the tests, so that a
test can stop it (SIGSTOP) while a prefill's WRITE into it is in flight.

Commands (one JSON object per line): {"expect": [req, tid, peer, host, port, [blocks], first, tokens]},
{"take": true} -> prints {"outcomes": [{"tid", "ok", "reason", "may_still_land"}, ...], "unfenced": [tids],
"counts": {...}} (what arrived since the last take), {"blocks": [ids]} -> prints {"hex": ...} (those
blocks' bytes). Prints {"ready": true} once its consumer is up.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from peer_proc import identity, kv_buffer, view_of  # noqa: E402

from kvpush.connector.consumer import Consumer, ConsumerConfig
from kvpush.connector.layout import kv_regions
from kvpush.connector.transfer import NixlEngine


class DecodeProcess:
    """Launcher side."""

    def __init__(self, engine_id: str, allowed: list[str], *, num_blocks: int, block_shape: tuple[int, ...], **extra):
        cfg = {"engine_id": engine_id, "allowed": allowed, "num_blocks": num_blocks, "block_shape": list(block_shape),
               **extra}
        env = {**os.environ, "UCX_MODULES": "^ib", "UCX_MEM_EVENTS": "no", "NIXL_LOG_LEVEL": "WARN"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__)), json.dumps(cfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        assert json.loads(self.proc.stdout.readline())["ready"]

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline()) if "expect" not in cmd else {}

    def wait_taken(self, got: dict, until, timeout_s: float = 20.0) -> dict:
        """Takes what arrives into `got` (lists appended, counts summed) until `until(got)`."""
        deadline = time.monotonic() + timeout_s
        while not until(got) and time.monotonic() < deadline:
            taken = self.ask(take=True)
            got["outcomes"] = got.get("outcomes", []) + taken["outcomes"]
            got["unfenced"] = got.get("unfenced", []) + taken["unfenced"]
            got["counts"] = {k: got.get("counts", {}).get(k, 0) + taken["counts"].get(k, 0)
                             for k in {*got.get("counts", {}), *taken["counts"]}}
            time.sleep(0.01)
        return got

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    arr = kv_buffer(cfg["num_blocks"], tuple(cfg["block_shape"]), None)
    regions = kv_regions([view_of(arr)], cfg["num_blocks"])
    engine = NixlEngine(cfg["engine_id"], regions)
    consumer = Consumer(ConsumerConfig(cfg["engine_id"], 0, identity(arr), frozenset(cfg["allowed"]),
                                       timeout_s=cfg.get("timeout_s", 60.0), peer_silence_s=cfg.get("peer_silence_s", 30.0),
                                       late_write_hold_s=cfg.get("late_write_hold_s", 600.0)),
                        engine.name, engine.metadata, tuple(regions))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if "expect" in cmd:
            consumer.expect(*cmd["expect"])
        elif "take" in cmd:
            _, outcomes, unfenced = consumer.take()
            print(json.dumps({"outcomes": [{"tid": o.pending.transfer_id, "ok": o.ok, "reason": o.reason,
                                            "may_still_land": o.may_still_land} for o in outcomes],
                              "unfenced": unfenced, "counts": dict(consumer.take_counts())}), flush=True)
        elif "blocks" in cmd:
            print(json.dumps({"hex": arr[cmd["blocks"]].tobytes().hex()}), flush=True)
    consumer.close()
    engine.close()


if __name__ == "__main__":
    main()
