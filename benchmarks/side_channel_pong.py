"""How fast a busy prefill answers decode's side-channel pings: the figure `peer_silence_s` (decode's
bound on a prefill's silence) is chosen from.

With a kvpush deployment up (`kvpush up TOPOLOGY`), this keeps its first prefill computing (clients
sending long prompts through the router, non-streamed, as many at once as `--clients`), starts
`--busy-loops` processes spinning beside it (`while 1: pass`), and meanwhile pings that prefill's
rank-0 side channel the way decode does: a proven connection (HELLO, CHALLENGE, AUTH with the
deployment's key), a PING every `--interval-s`, each timed to its PONG. Every `--rehandshake-s` it
makes a new connection, timing HELLO -> CHALLENGE too. The pinger runs in its own process, like
decode's reactor, and the load in another.

    python benchmarks/side_channel_pong.py TOPOLOGY --seconds 360 --out DIR
        [--clients 16] [--prompt-tokens 1500] [--max-tokens 48] [--busy-loops 2] [--interval-s 0.2]

Writes DIR/pong.json (summary, and every ping: start time, RTT or the error) and DIR/requests.json
(every request: start, seconds, HTTP status), and prints the summary.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvpush.common.deployment_secret import SIDE_CHANNEL, derive_key, read_secret
from kvpush.connector import auth, frame_mac, wire
from kvpush.deploy.plan.plan import build_plan
from kvpush.deploy.topology.topology import load_topology

PROBE_ENGINE = "pong-probe"  # never admitted (it sends no LAYOUT): proven connections are answered all the same
BUSY_LOOP = "while 1: pass"


class Probe:
    """A proven side-channel connection to one prefill rank."""

    def __init__(self, host: str, port: int, key: bytes, timeout_s: float):
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.reader = wire.FrameReader()
        self.opener: frame_mac.FrameOpener | None = None
        hello = wire.Hello(PROBE_ENGINE, 0, 1, auth.new_nonce())
        started = time.monotonic()
        self.sock.sendall(wire.encode(hello))
        challenge = self.read()
        self.challenge_s = time.monotonic() - started
        hello_digest, layout_digest = auth.digest(wire.encode(hello)), auth.digest(b"no layout follows")
        if not isinstance(challenge, wire.Challenge) or not auth.verify(
                key, challenge.proof, "prefill", challenge.nonce, hello.nonce, challenge.engine_id, challenge.tp_rank,
                hello_digest):
            raise RuntimeError(f"the side channel at {host}:{port} did not prove the deployment's key: {challenge!r}")
        self.sock.sendall(wire.encode(wire.Auth(auth.prove(key, "decode", challenge.nonce, hello.nonce, PROBE_ENGINE, 0,
                                                           hello_digest, layout_digest), layout_digest)))
        keys = frame_mac.session_keys(key, hello.nonce, challenge.nonce)  # every frame from now on carries its MAC
        self.sealer, self.opener = keys.sealer("decode"), keys.opener("decode")

    def read(self) -> wire.Message:
        while (frame := self.reader.next_frame()) is None:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed by prefill")
            self.reader.add(data)
        return wire.decode(frame if self.opener is None else self.opener.open(frame))

    def ping(self) -> float:
        started = time.monotonic()
        self.sock.sendall(self.sealer.seal(wire.encode(wire.Ping())))
        while not isinstance(self.read(), wire.Pong):
            pass
        return time.monotonic() - started

    def close(self) -> None:
        self.sock.close()


def load(url: str, model: str, vocab: int, clients: int, prompt_tokens: int, max_tokens: int, seconds: float,
         out: Path) -> None:
    """Run in its own process: `clients` threads sending requests back to back until `seconds` pass.
    Exits at once if a client's first request is refused: a load that computes nothing measures nothing."""
    end, records, lock = time.monotonic() + seconds, [], threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < end:
            body = {"model": model, "prompt": [rng.randrange(10, vocab) for _ in range(prompt_tokens)],
                    "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
            request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                             headers={"Content-Type": "application/json"})
            started, status = time.monotonic(), 0
            try:
                with urllib.request.urlopen(request, timeout=600) as response:
                    response.read()
                    status = response.status
            except urllib.error.HTTPError as exc:
                status = exc.code
                if not records:
                    print(f"side_channel_pong: the load's first request got HTTP {status}: {exc.read()[:300]!r}", flush=True)
                    os._exit(2)
            except OSError:
                status = 0
            with lock:
                records.append({"t": round(started, 3), "s": round(time.monotonic() - started, 3), "status": status})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.write_text(json.dumps(records))


def process_tree_cpu(http_port: int) -> float:
    """CPU seconds used so far by the vLLM instance serving `http_port` (its API server and children)."""
    import psutil

    tree: dict[int, psutil.Process] = {}  # by pid: the supervisor's command line names the port too
    for proc in psutil.process_iter(["cmdline"]):
        if f"--port {http_port}" in " ".join(proc.info["cmdline"] or []):
            tree.update({p.pid: p for p in [proc, *proc.children(recursive=True)]})
    total = 0.0
    for p in tree.values():
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("topology")
    parser.add_argument("--seconds", type=float, default=360.0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--busy-loops", type=int, default=2)
    parser.add_argument("--interval-s", type=float, default=0.2)
    parser.add_argument("--rehandshake-s", type=float, default=10.0)
    parser.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    plan = build_plan(load_topology(Path(args.topology)))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.load_only:
        vocab = json.loads((Path(plan.model_path).expanduser() / "config.json").read_text())["vocab_size"]
        load(plan.router_url_from_here(), plan.served_model_name, vocab, args.clients, args.prompt_tokens,
             args.max_tokens, args.seconds, args.out / "requests.json")
        return
    prefill = next(p for p in plan.processes() if p.role == "prefill")
    host = plan.host(prefill.host)
    secret = next(f.path for f in host.secret_files if f.kind == "deployment-secret")
    key = derive_key(read_secret(secret), SIDE_CHANNEL)
    address = (host.address, prefill.side_channel_ports[0])
    busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.busy_loops)]
    loader = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--load-only"])
    pings, challenges = [], []
    try:
        time.sleep(5.0)  # the load is under way
        if loader.poll() is not None:
            raise SystemExit("side_channel_pong: the load stopped; nothing was measured")
        end, probe, connected = time.monotonic() + args.seconds - 10.0, None, 0.0
        cpu_from, wall_from = process_tree_cpu(prefill.http_port), time.monotonic()
        while time.monotonic() < end:
            started = time.monotonic()
            try:
                if probe is None or started - connected > args.rehandshake_s:
                    if probe is not None:
                        probe.close()
                    probe, connected = Probe(*address, key, timeout_s=60.0), started
                    challenges.append(round(probe.challenge_s, 6))
                pings.append({"t": round(started, 3), "rtt": round(probe.ping(), 6)})
            except (OSError, RuntimeError, ConnectionError) as exc:
                pings.append({"t": round(started, 3), "error": str(exc)})
                probe = None
            time.sleep(max(0.0, args.interval_s - (time.monotonic() - started)))
        prefill_cores = (process_tree_cpu(prefill.http_port) - cpu_from) / (time.monotonic() - wall_from)
    finally:
        for proc in busy:
            proc.kill()
        loader.wait()
        for proc in busy:
            proc.wait()
    rtts = [p["rtt"] for p in pings if "rtt" in p]
    requests = json.loads((args.out / "requests.json").read_text())
    summary = {
        "pings": len(pings), "errors": len(pings) - len(rtts),
        "rtt_ms": {"p50": statistics.median(rtts) * 1e3, "p99": percentile(rtts, 0.99) * 1e3,
                   "p999": percentile(rtts, 0.999) * 1e3, "max": max(rtts) * 1e3},
        "hello_to_challenge_ms": {"n": len(challenges), "p50": statistics.median(challenges) * 1e3,
                                  "max": max(challenges) * 1e3},
        "requests": {"n": len(requests), "ok": sum(r["status"] == 200 for r in requests),
                     "seconds_p50": statistics.median(r["s"] for r in requests),
                     "seconds_max": max(r["s"] for r in requests)},
        "prefill_cores_used": round(prefill_cores, 3),  # its process tree's CPU seconds per second while pinged
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "load_only")},
    }
    (args.out / "pong.json").write_text(json.dumps({"summary": summary, "pings": pings, "challenges_s": challenges}))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
