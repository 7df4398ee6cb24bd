"""An in-process router in front of fake vLLM instances, for the router's tests and benchmark."""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import aiohttp

from kvpush.router.app import ROUTER_KEY, Router, build_app, start_site
from kvpush.router.config import RouterConfig, Timeouts, Upstream
from fake_upstream import FakeVllm
from kvpush.router.keys import Keys

MODEL = "fake"


@dataclass
class Deployment:
    url: str
    prefill: list[FakeVllm]
    decode: list[FakeVllm]
    router: Router
    session: aiohttp.ClientSession

    async def post(self, path: str, body: dict, headers: dict | None = None) -> tuple[int, bytes]:
        async with self.session.post(self.url + path, json=body, headers=headers or {}) as resp:
            return resp.status, await resp.read()

    async def metrics(self) -> str:
        async with self.session.get(self.url + "/metrics") as resp:
            return await resp.text()


def upstream(name: str, fake: FakeVllm, side_port: int) -> Upstream:
    return Upstream(name=name, url=fake.url, engine_id=f"test.{name}", side_channel_host="127.0.0.1",
                    side_channel_port=side_port, tp_size=1)


@contextlib.asynccontextmanager
async def deployment(protocol: str = "kvpush", n_prefill: int = 1, n_decode: int = 1, api_key: str | None = None,
                     timeouts: Timeouts | None = None, **config):
    fakes_p = [FakeVllm(model=MODEL, created=0) for _ in range(0 if protocol == "colocated" else n_prefill)]
    fakes_d = [FakeVllm(model=MODEL, created=0) for _ in range(n_decode)]
    for fake in fakes_p + fakes_d:
        await fake.start()
    cfg = RouterConfig(protocol=protocol, served_model_name=MODEL, port=0, timeouts=timeouts or Timeouts(),
                       prefill=[upstream(f"p{i}", f, 5600 + i) for i, f in enumerate(fakes_p)],
                       decode=[upstream(f"d{i}", f, 5700 + i) for i, f in enumerate(fakes_d)], **config)
    app = build_app(cfg, Keys.same(api_key))
    runner = await start_site(app, "127.0.0.1", 0)
    port = runner.addresses[0][1]
    session = aiohttp.ClientSession()
    try:
        yield Deployment(f"http://127.0.0.1:{port}", fakes_p, fakes_d, app[ROUTER_KEY], session)
    finally:
        await session.close()
        await runner.cleanup()
        for fake in fakes_p + fakes_d:
            await fake.stop()


async def eventually(check, timeout_s: float = 3.0, every_s: float = 0.02) -> None:
    """Wait until check() is true; assert it at the end so failures show the last value."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while asyncio.get_running_loop().time() < deadline:
        if check():
            return
        await asyncio.sleep(every_s)
    assert check()
