"""router/legs.py: how the events before decode's first token are read, and when a leg has been answered."""
from __future__ import annotations

import asyncio
import json

import pytest

from kvpush.router.config import Upstream
from kvpush.router.legs import Leg, classify_event, error_message
from kvpush.router.metrics import RouterMetrics
from kvpush.router.pool import LeftRotation, Pool
from kvpush.router.upstream_answer import UpstreamResponse


def data(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode())


@pytest.mark.parametrize("event,kind", [
    (data({"choices": [{"index": 0, "text": " a", "finish_reason": None}]}), "token"),
    (data({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}), "token"),  # ended with no text
    (data({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}), "other"),  # chat's role chunk
    (data({"choices": [{"index": 0, "delta": {"content": "x"}}]}), "token"),
    (data({"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "c"}]}}]}), "token"),
    (data({"choices": [{"index": 0, "text": "", "finish_reason": "error"}]}), "error"),
    (data({"error": {"message": "KV load failed", "code": 500}}), "error"),
    (data(b"[DONE]"), "done"),
    (data({"choices": [], "usage": {"prompt_tokens": 1}}), "other"),
    (data(b"not json"), "other"),
    (data([1, 2]), "other"),
    (data({"choices": ["not a dict", {"delta": "nor this"}]}), "other"),
    (b": a comment", "other"),
])
def test_each_event_before_the_first_token_is_classified(event, kind):
    assert classify_event(event) == kind


def test_an_error_events_message_is_what_the_client_is_told():
    assert error_message(data({"error": {"message": "KV load failed", "code": 500}})) == "KV load failed"
    assert error_message(b'{"error": "plain"}') == "plain"
    assert error_message(b"<html>bad gateway</html>") == "<html>bad gateway</html>"


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
