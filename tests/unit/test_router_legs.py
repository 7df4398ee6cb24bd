"""router/legs.py: when a leg has been answered, and what a leg whose instance left rotation fails with."""
from __future__ import annotations

import asyncio
import json

import pytest

from kvpush.router.config import Upstream
from kvpush.router.legs import Leg
from kvpush.router.metrics import RouterMetrics
from kvpush.router.pool import LeftRotation, Pool
from kvpush.router.upstream_answer import UpstreamResponse


def data(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode())


def _decode_leg_with_its_first_token_received():
    """A decode leg waiting on a real answer whose head and first token have arrived but not
    been read yet."""
    pool = Pool("decode", [Upstream(name="d0", url="http://h:1", engine_id="e0", side_channel_host="h", side_channel_port=1)],
                "round-robin", 2, RouterMetrics())
    inst = pool.instances[0]
    pool.restore(inst)
    loop = asyncio.get_running_loop()
    resp = UpstreamResponse(None, loop, loop.time() + 60)
    leg = Leg(pool, inst, RouterMetrics())
    leg.wait_for(resp)
    resp.feed(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    event = data({"choices": [{"index": 0, "text": " a", "finish_reason": None}]}) + b"\n\n"
    resp.feed(b"%x\r\n%s\r\n" % (len(event), event))
    return pool, inst, leg, resp


def test_a_leg_whose_instance_left_rotation_before_it_was_answered_fails_though_its_first_token_had_come():
    async def scenario():
        pool, inst, leg, resp = _decode_leg_with_its_first_token_received()
        pool.eject(inst, "2 failures in a row")  # another leg's failures, while this answer sat unread
        assert (await resp.readany()).startswith(b"data: ")  # the bytes are there, but the instance is gone
        with pytest.raises(LeftRotation, match="d0 left rotation"):
            leg.answered()  # so the attempt is retried elsewhere before the client sees any of it
        assert inst.waiting == set()

    asyncio.run(scenario())


def test_a_leg_answered_while_its_instance_is_in_rotation_stops_waiting_on_it():
    async def scenario():
        pool, inst, leg, resp = _decode_leg_with_its_first_token_received()
        leg.answered()
        assert inst.waiting == set()
        pool.eject(inst, "2 failures in a row")
        assert resp.error is None and (await resp.readany()).startswith(b"data: ")  # an answered leg goes on

    asyncio.run(scenario())
