"""Router overhead: TTFT p50 calling a fake decode instance directly vs through the router.

Each side runs in its own process (fake decode, fake prefill for the disaggregated protocols, the
router started as `python -m kvpush.router --config FILE`), the client here. `--concurrency` streams
run at once; rounds alternate direct and routed so drift hits both equally. The defaults model
decode-like streams (64 tokens, 20 ms apart); `--tokens 8 --token-delay-ms 5` is a stress test in
which the router's own CPU is the bottleneck.

The direct side calls the decode instance alone, except for nixl-pull, where it is what a client
would do without a router: the prefill call, then the decode call carrying prefill's
kv_transfer_params, timed from the first. `--arrivals burst` (the default) starts each round's
streams at once, and since all have the same length the later ones start in step: bursts of
`--concurrency` arrivals. `--arrivals staggered` spreads the first ones over one stream's duration:
a steady state of as many streams, arriving evenly.

    python benchmarks/router_overhead.py [--protocol colocated|kvpush|nixl-push|nixl-pull]
        [--concurrency 64] [--arrivals burst|staggered] [--router-cores 1] [--router-workers 1] [--signed]
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
from typing import Awaitable, Callable

import aiohttp

from kvpush.bench.scrape import histogram
from kvpush.deploy.topology.placement import on_cores
from kvpush.router.config import RouterConfig, Upstream
from kvpush.router.protocols import pull_decode_leg, pull_prefill_leg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the fake vLLM (tests/fake_upstream.py)

OWN_LATENCY = "kvpush_router_own_latency_seconds"
ROUTER_TTFT = "kvpush_router_ttft_seconds"


def run_async(coro):
    """uvloop when installed, as vLLM and the router use it."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def serve_fake(port: int, token_delay_s: float, first_token_delay_s: float) -> None:
    from fake_upstream import Behavior, FakeVllm

    async def main() -> None:
        fake = FakeVllm(model="fake", behavior=Behavior(first_token_delay_s=first_token_delay_s, token_delay_s=token_delay_s))
        await fake.start("127.0.0.1", port)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await fake.stop()

    run_async(main())


async def wait_healthy(url: str, timeout_s: float = 60.0) -> None:
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


async def one_stream(session: aiohttp.ClientSession, url: str, body: dict, start: float | None = None) -> float:
    """Seconds from `start` (default: now) to the first token of one streamed completion."""
    start = time.perf_counter() if start is None else start
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        ttft = None
        async for chunk in resp.content.iter_any():
            if ttft is None and b'"text"' in chunk:
                ttft = time.perf_counter() - start
        assert ttft is not None
        return ttft


async def pulled_stream(session: aiohttp.ClientSession, prefill: str, decode: str, body: dict) -> float:
    """nixl-pull without a router: the client asks prefill for the KV's whereabouts, then streams
    from decode with them (the same two legs the router builds); timed from the first request."""
    start = time.perf_counter()
    async with session.post(prefill + "/v1/completions", json=pull_prefill_leg(body, chat=False)) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    decode_body = pull_decode_leg(body, answer)
    assert decode_body is not None, "prefill answered no kv_transfer_params"
    return await one_stream(session, decode, decode_body, start)


Side = Callable[[aiohttp.ClientSession, dict], Awaitable[float]]


def direct_side(protocol: str, decode: str, prefill: str) -> Side:
    if protocol == "nixl-pull":
        return lambda session, body: pulled_stream(session, prefill, decode, body)
    return lambda session, body: one_stream(session, decode, body)


def routed_side(router: str) -> Side:
    return lambda session, body: one_stream(session, router, body)


async def round_of(session: aiohttp.ClientSession, side: Side, concurrency: int, requests: int, body: dict,
                   spread_s: float = 0.0) -> list[float]:
    """`requests` streams, `concurrency` at a time; the first `concurrency` start `spread_s / concurrency`
    apart (0: all at once), and each later one starts when one ends."""
    gate = asyncio.Semaphore(concurrency)

    async def limited(index: int) -> float:
        if index < concurrency and spread_s:
            await asyncio.sleep(spread_s * index / concurrency)
        async with gate:
            return await side(session, body)

    return await asyncio.gather(*(limited(i) for i in range(requests)))


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU a process and its live children (a router's workers) have used so far
    (Linux /proc); None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN
        children = []
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(cpu_seconds(int(child)) or 0.0 for child in children)


async def router_metrics(session: aiohttp.ClientSession, router_url: str) -> str:
    async with session.get(router_url + "/metrics") as resp:
        return await resp.text()


async def measure(direct: Side, routed: Side, concurrency: int, requests: int, rounds: int, tokens: int,
                  spread_s: float, router_pid: int, router_url: str) -> tuple[dict, dict]:
    """Median TTFT per side in ms, the router's CPU per routed request in ms (unlike TTFT, that
    hardly moves with what else the machine runs), and the median of the router's own part of
    TTFT from its /metrics: what it adds however slow the client and the instances are. Also each
    side's TTFT deciles, and the means of the router's own part and of its TTFT (receipt to first
    token written): their difference is how long decode's first token took to reach the router."""
    body = {"model": "fake", "prompt": "hello", "max_tokens": tokens, "stream": True}
    # Each side's round starts on warm connections, as steady traffic keeps them: the router drops
    # upstream connections idle for 2 s and the other side's round lasts longer than that, while the
    # client keeps its own for 15 s. Unstreamed, so the router's TTFT histograms leave them out.
    warm = dict(body, max_tokens=1, stream=False)
    results: dict[str, list[float]] = {"direct": [], "router": []}
    router_cpu = 0.0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        metrics_before = await router_metrics(session, router_url)
        for _ in range(rounds):
            await round_of(session, direct, concurrency, concurrency, warm)
            results["direct"] += await round_of(session, direct, concurrency, requests, body, spread_s)
            await round_of(session, routed, concurrency, concurrency, warm)
            before = cpu_seconds(router_pid)
            results["router"] += await round_of(session, routed, concurrency, requests, body, spread_s)
            after = cpu_seconds(router_pid)
            router_cpu += (after - before) if before is not None and after is not None else float("nan")
        metrics_after = await router_metrics(session, router_url)
    p50 = {k: statistics.median(v) * 1000 for k, v in results.items()}
    p50["router_cpu_per_request"] = router_cpu / (rounds * requests) * 1000
    own = histogram(metrics_after, OWN_LATENCY).minus(histogram(metrics_before, OWN_LATENCY))
    ttft = histogram(metrics_after, ROUTER_TTFT).minus(histogram(metrics_before, ROUTER_TTFT))
    p50["router_own"] = ms(own.quantile(0.5))
    p50["router_own_mean"] = ms(own.mean)
    p50["router_ttft_mean"] = ms(ttft.mean)
    deciles = {side: [round(q * 1000, 2) for q in statistics.quantiles(v, n=10)] for side, v in results.items()}
    return p50, deciles


def ms(seconds: float | None) -> float:
    return seconds * 1000 if seconds is not None else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", default="colocated", choices=["colocated", "kvpush", "nixl-push", "nixl-pull"],
                        help="nixl-pull's direct side is the client's own two calls: prefill, then decode")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=320, help="requests per round and side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer")
    parser.add_argument("--token-delay-ms", type=float, default=20.0, help="the fake decode's time per output token")
    parser.add_argument("--decode-first-token-ms", type=float, default=0.0,
                        help="the fake decode's wait before its first token (both sides see it). In a push deployment "
                             "decode's first token follows prefill's answer (it needs the KV); with 0 the fake prefill's "
                             "answers reach the router together with decode's first tokens")
    parser.add_argument("--arrivals", default="burst", choices=["burst", "staggered"],
                        help="burst: each round's first streams start at once (and later ones in step as those end); "
                             "staggered: they start spread over one stream's duration, a steady state")
    parser.add_argument("--router-cores", help="e.g. '1': the router runs on these cores and the client and fake "
                                               "instances on the others, as when the router has a host of its own")
    parser.add_argument("--router-workers", type=int, default=1,
                        help="router processes sharing the port (the topology's router.workers); give as many --router-cores")
    parser.add_argument("--signed", action="store_true",
                        help="kvpush: the router signs each leg's kv_transfer_params (a random key, as `up` gives it one)")
    parser.add_argument("--base-port", type=int, default=18100, help="fake decode, fake prefill, router: base+0..2")
    parser.add_argument("--serve-fake", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake:
        serve_fake(args.serve_fake, args.token_delay_ms / 1000, args.decode_first_token_ms / 1000)
        return 0

    decode_port, prefill_port, router_port = args.base_port, args.base_port + 1, args.base_port + 2
    procs: list[subprocess.Popen] = []

    def spawn(argv: list[str]) -> subprocess.Popen:
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        return procs[-1]

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a killed run still stops what it started

    def upstream(name: str, port: int) -> Upstream:
        return Upstream(name=name, url=f"http://127.0.0.1:{port}", engine_id=name, side_channel_host="127.0.0.1",
                        side_channel_port=port + 500)

    if args.router_cores:
        from kvpush.deploy.topology.topology import parse_core_list

        others = os.sched_getaffinity(0) - parse_core_list(args.router_cores)
        if not others:
            parser.error(f"--router-cores {args.router_cores} leaves no core for the client and the fake instances")
        os.sched_setaffinity(0, others)  # inherited by the fakes spawned below
    push = args.protocol != "colocated"
    spread_s = args.tokens * args.token_delay_ms / 1000 if args.arrivals == "staggered" else 0.0
    config = RouterConfig(protocol=args.protocol, served_model_name="fake", port=router_port, workers=args.router_workers,
                          prefill=[upstream("p0", prefill_port)] if push else [], decode=[upstream("d0", decode_port)])
    with tempfile.TemporaryDirectory() as tmp:
        if args.signed:
            key_path = Path(tmp) / "router-params.key"
            key_path.write_text(os.urandom(32).hex() + "\n")
            key_path.chmod(0o600)
            config = config.model_copy(update={"transfer_params_key_file": str(key_path)})
        config_path = Path(tmp) / "router.json"
        config_path.write_text(config.model_dump_json())
        try:
            spawn([sys.executable, __file__, "--serve-fake", str(decode_port), "--token-delay-ms", str(args.token_delay_ms),
                   "--decode-first-token-ms", str(args.decode_first_token_ms)])
            if push:
                spawn([sys.executable, __file__, "--serve-fake", str(prefill_port), "--token-delay-ms", "0"])
            router = spawn(on_cores(args.router_cores, [sys.executable, "-m", "kvpush.router", "--config",
                                                        str(config_path), "--log-level", "WARNING"]))
            run_async(wait_healthy(f"http://127.0.0.1:{decode_port}"))
            run_async(wait_healthy(f"http://127.0.0.1:{router_port}"))
            run_async(wait_healthy(f"http://127.0.0.1:{prefill_port}") if push else asyncio.sleep(0))
            direct = direct_side(args.protocol, f"http://127.0.0.1:{decode_port}", f"http://127.0.0.1:{prefill_port}")
            p50, deciles = run_async(measure(direct, routed_side(f"http://127.0.0.1:{router_port}"), args.concurrency,
                                    args.requests, args.rounds, args.tokens, spread_s, router.pid,
                                    f"http://127.0.0.1:{router_port}"))
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
    print(json.dumps({"protocol": args.protocol, "concurrency": args.concurrency, "arrivals": args.arrivals,
                      "cpus": os.cpu_count(), "router_cores": args.router_cores, "router_workers": args.router_workers, "signed": args.signed, "decode_first_token_ms": args.decode_first_token_ms,
                      "ttft_p50_direct_ms": round(p50["direct"], 3), "ttft_p50_router_ms": round(p50["router"], 3),
                      "added_ms": round(added, 3), "ratio": round(p50["router"] / p50["direct"], 3),
                      "router_cpu_ms_per_request": round(p50["router_cpu_per_request"], 3),
                      "router_own_p50_ms": round(p50["router_own"], 3),
                      "router_own_mean_ms": round(p50["router_own_mean"], 3),
                      "router_ttft_mean_ms": round(p50["router_ttft_mean"], 3),
                      "ttft_deciles_direct_ms": deciles["direct"], "ttft_deciles_router_ms": deciles["router"],
                      "load_avg_1m": os.getloadavg()[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
