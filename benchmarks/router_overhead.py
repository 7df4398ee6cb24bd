"""Router overhead: TTFT p50 calling a fake decode instance directly vs through the router.

Each side runs in its own process (fake decode, fake prefill for push protocols, the router started
as `python -m kvpush.router --config FILE`), the client here. `--concurrency` streams run at once;
rounds alternate direct and routed so drift hits both equally. The defaults model decode-like
streams (64 tokens, 20 ms apart); `--tokens 8 --token-delay-ms 5` is a stress test in which the
router's own CPU is the bottleneck.

    python benchmarks/router_overhead.py [--protocol colocated|kvpush|nixl-push] [--concurrency 64]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from kvpush.router.config import RouterConfig, Upstream


def run_async(coro):
    """uvloop when installed, as vLLM and the router use it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def serve_fake(port: int, token_delay_s: float) -> None:
    from kvpush.router.fake_upstream import Behavior, FakeVllm

    async def main() -> None:
        fake = FakeVllm(model="fake", behavior=Behavior(token_delay_s=token_delay_s))
        await fake.start("127.0.0.1", port)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await fake.stop()

    run_async(main())


async def wait_healthy(url: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url + "/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy")


async def one_stream(session: aiohttp.ClientSession, url: str, body: dict) -> float:
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        ttft = None
        async for chunk in resp.content.iter_any():
            if ttft is None and b'"text"' in chunk:
                ttft = time.perf_counter() - start
        assert ttft is not None
        return ttft


async def round_of(session: aiohttp.ClientSession, url: str, concurrency: int, requests: int, body: dict) -> list[float]:
    gate = asyncio.Semaphore(concurrency)

    async def limited() -> float:
        async with gate:
            return await one_stream(session, url, body)

    return await asyncio.gather(*(limited() for _ in range(requests)))


async def measure(direct: str, routed: str, concurrency: int, requests: int, rounds: int, tokens: int) -> dict:
    body = {"model": "fake", "prompt": "hello", "max_tokens": tokens, "stream": True}
    results: dict[str, list[float]] = {"direct": [], "router": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await round_of(session, direct, concurrency, concurrency, body)  # warm connections
        await round_of(session, routed, concurrency, concurrency, body)
        for _ in range(rounds):
            results["direct"] += await round_of(session, direct, concurrency, requests, body)
            results["router"] += await round_of(session, routed, concurrency, requests, body)
    return {k: statistics.median(v) * 1000 for k, v in results.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", default="colocated", choices=["colocated", "kvpush", "nixl-push"])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=320, help="requests per round and side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--token-delay-ms", type=float, default=20.0, help="the fake decode's time per output token")
    parser.add_argument("--base-port", type=int, default=18100, help="fake decode, fake prefill, router: base+0..2")
    parser.add_argument("--serve-fake", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake:
        serve_fake(args.serve_fake, args.token_delay_ms / 1000)
        return 0

    decode_port, prefill_port, router_port = args.base_port, args.base_port + 1, args.base_port + 2
    procs: list[subprocess.Popen] = []

    def spawn(argv: list[str]) -> None:
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))

    def upstream(name: str, port: int) -> Upstream:
        return Upstream(name=name, url=f"http://127.0.0.1:{port}", engine_id=name, side_channel_host="127.0.0.1",
                        side_channel_port=port + 500)

    push = args.protocol != "colocated"
    config = RouterConfig(protocol=args.protocol, served_model_name="fake", port=router_port,
                          prefill=[upstream("p0", prefill_port)] if push else [], decode=[upstream("d0", decode_port)])
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "router.json"
        config_path.write_text(config.model_dump_json())
        try:
            spawn([sys.executable, __file__, "--serve-fake", str(decode_port), "--token-delay-ms", str(args.token_delay_ms)])
            if push:
                spawn([sys.executable, __file__, "--serve-fake", str(prefill_port), "--token-delay-ms", "0"])
            spawn([sys.executable, "-m", "kvpush.router", "--config", str(config_path), "--log-level", "WARNING"])
            run_async(wait_healthy(f"http://127.0.0.1:{decode_port}"))
            run_async(wait_healthy(f"http://127.0.0.1:{router_port}"))
            p50 = run_async(measure(f"http://127.0.0.1:{decode_port}", f"http://127.0.0.1:{router_port}",
                                      args.concurrency, args.requests, args.rounds, args.tokens))
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    added = p50["router"] - p50["direct"]
    print(json.dumps({"protocol": args.protocol, "concurrency": args.concurrency, "cpus": os.cpu_count(),
                      "ttft_p50_direct_ms": round(p50["direct"], 3), "ttft_p50_router_ms": round(p50["router"], 3),
                      "added_ms": round(added, 3), "ratio": round(p50["router"] / p50["direct"], 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
