"""router/rotation.py against in-process fake vLLM instances: hung instances leave rotation and
come back, their waiting legs are retried elsewhere, restarts are seen, and the instance list is
read again on request (added instances join when healthy, removed ones drain)."""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import pytest
from router_harness import MODEL, deployment, eventually, upstream

from kvpush.router.config import Timeouts
from fake_upstream import FakeVllm
from kvpush.router.instances import InstanceList, reload_progress
from router_helpers import run, sample

COMPLETION = {"model": MODEL, "prompt": "hello", "max_tokens": 4}
FAST_PROBES = {"probe_interval_s": 0.05, "eject_after_failures": 3}
# Router, fakes and clients share one event loop: a probe's answer waits out any stall of that loop,
# so the health bound is kept well above the stalls of a loaded CI machine. A hung instance then
# leaves rotation about 1.2 s after it stops answering.
SHORT_HEALTH = Timeouts(connect_s=1, health_s=1.0)
ROTATION_CHANGE_S = 10.0  # a bound only to name a hang: an ejection or a return takes about a second



# --- hangs -------------------------------------------------------------------------------------


def test_a_stopped_decode_leaves_rotation_and_the_requests_waiting_on_it_are_retried_on_its_peer():
    async def scenario():
        async with deployment("kvpush", n_decode=2, timeouts=SHORT_HEALTH, **FAST_PROBES) as dep:
            d0 = dep.router.decode.instances[0]
            dep.decode[0].behavior.stopped = True  # answers nothing: not /health, not the leg
            status, raw = await dep.post("/v1/completions", {**COMPLETION, "stream": True})  # round robin: d0 first
            assert status == 200 and raw.decode().endswith("data: [DONE]\n\n")
            assert not d0.in_rotation and len(dep.decode[1].received) == 1
            m = await dep.metrics()
            assert sample(m, "kvpush_router_leg_failures_total", instance="d0", reason="left_rotation") == 1
            assert sample(m, "kvpush_router_retries_total", reason="left_rotation") == 1
            assert sample(m, "kvpush_router_inflight", instance="d0") == 0
            dep.decode[0].behavior.stopped = False  # SIGCONT
            await eventually(lambda: d0.in_rotation, ROTATION_CHANGE_S)

    run(scenario())


def test_a_stream_already_flowing_from_an_instance_that_stops_ends_with_a_clear_error_at_its_idle_bound():
    async def scenario():
        # the stream outlasts the instance's ejection: leaving rotation does not cut a flowing stream
        timeouts = Timeouts(connect_s=1, health_s=1.0, stream_idle_s=3.0)
        async with deployment("kvpush", timeouts=timeouts, **FAST_PROBES) as dep:
            dep.decode[0].behavior.token_delay_s = 0.05
            async with dep.session.post(dep.url + "/v1/completions",
                                        json={**COMPLETION, "max_tokens": 50, "stream": True}) as resp:
                assert resp.status == 200
                await resp.content.readuntil(b"\n\n")  # the first token reached the client
                dep.decode[0].behavior.stopped = True
                await eventually(lambda: not dep.router.decode.instances[0].in_rotation, ROTATION_CHANGE_S)
                rest = (await resp.read()).decode()
            assert "failed mid-stream" in rest and "sent nothing for 3 s" in rest and rest.endswith("data: [DONE]\n\n")
            dep.decode[0].behavior.stopped = False

    run(scenario())


def test_a_hung_prefill_is_taken_out_not_the_decode_that_reports_its_transfers_failing():
    async def scenario():
        async with deployment("kvpush", timeouts=SHORT_HEALTH, **FAST_PROBES) as dep:
            p0, d0 = dep.router.prefill.instances[0], dep.router.decode.instances[0]
            dep.prefill[0].behavior.stopped = True
            dep.decode[0].behavior.transfer_error = True  # kvpush's connector fails a transfer from a silent prefill
            for _ in range(3):
                async with dep.session.post(dep.url + "/v1/completions", json=COMPLETION) as resp:
                    assert resp.status == 200  # decode computed the prompt itself
                    await resp.read()
            await eventually(lambda: not p0.in_rotation, ROTATION_CHANGE_S)
            assert d0.in_rotation and d0.consecutive_failures == 0
            async with dep.session.post(dep.url + "/v1/completions", json=COMPLETION) as resp:
                assert resp.status == 200 and resp.headers["X-Kvpush-Decode-Computed-Prompt"] == "no_prefill_in_rotation"
            dep.prefill[0].behavior.stopped = False
            dep.decode[0].behavior.transfer_error = False
            await eventually(lambda: p0.in_rotation, ROTATION_CHANGE_S)
            before = len(dep.prefill[0].received)
            assert (await dep.post("/v1/completions", COMPLETION))[0] == 200
            assert len(dep.prefill[0].received) == before + 1  # transfers again

    run(scenario())


def test_a_restart_is_counted_when_the_instances_start_time_changed():
    async def scenario():
        async with deployment("kvpush", timeouts=SHORT_HEALTH, **FAST_PROBES) as dep:
            d0 = dep.router.decode.instances[0]
            assert d0.start_time == dep.decode[0].start_time
            for restarted in (False, True):
                dep.decode[0].behavior.unhealthy = True  # down (or restarting) for a while
                await eventually(lambda: not d0.in_rotation, ROTATION_CHANGE_S)
                if restarted:
                    dep.decode[0].start_time += 30
                dep.decode[0].behavior.unhealthy = False
                await eventually(lambda: d0.in_rotation, ROTATION_CHANGE_S)
                assert sample(await dep.metrics(), "kvpush_router_instance_restarts", instance="d0") == int(restarted)

    run(scenario())


# --- the instance list -------------------------------------------------------------------------


async def reload_now(dep) -> None:
    """SIGHUP's reload, awaited: the list is read on a thread of its own."""
    task = dep.router.reload()
    if task is not None:
        await task


def write_list(path, prefill, decode) -> str:
    listed = InstanceList(prefill=[upstream(n, f, 5600 + i) for i, (n, f) in enumerate(prefill)],
                          decode=[upstream(n, f, 5700 + i) for i, (n, f) in enumerate(decode)])
    path.write_text(listed.model_dump_json())
    return listed.digest()


def test_an_added_instance_enters_rotation_only_once_healthy(tmp_path):
    async def scenario():
        path = tmp_path / "instances.json"
        async with deployment("kvpush", instances_file=str(path), **FAST_PROBES) as dep:
            write_list(path, [("p0", dep.prefill[0])], [("d0", dep.decode[0])])  # what it was started with
            d1 = FakeVllm(model=MODEL, created=0)
            await d1.start()
            try:
                d1.behavior.unhealthy = True  # still loading
                digest = write_list(path, [("p0", dep.prefill[0])], [("d0", dep.decode[0]), ("d1", d1)])
                await reload_now(dep)
                assert reload_progress(await dep.metrics()).took(digest)
                for _ in range(4):
                    assert (await dep.post("/v1/completions", COMPLETION))[0] == 200
                assert not d1.received
                d1.behavior.unhealthy = False
                await eventually(lambda: dep.router.decode.instances[1].in_rotation, ROTATION_CHANGE_S)
                for _ in range(4):
                    assert (await dep.post("/v1/completions", COMPLETION))[0] == 200
                assert len(d1.received) == 2
            finally:
                await d1.stop()

    run(scenario())


def test_a_removed_instance_leaves_rotation_at_once_and_its_stream_finishes_whole(tmp_path):
    async def scenario():
        path = tmp_path / "instances.json"
        async with deployment("kvpush", n_decode=2, instances_file=str(path)) as dep:
            pair = [("p0", dep.prefill[0])]
            write_list(path, pair, [("d0", dep.decode[0]), ("d1", dep.decode[1])])
            assert (await dep.post("/v1/completions", COMPLETION))[0] == 200  # d0; the stream goes to d1
            dep.decode[1].behavior.token_delay_s = 0.02
            async with dep.session.post(dep.url + "/v1/completions",
                                        json={**COMPLETION, "max_tokens": 30, "stream": True}) as resp:
                await resp.content.readuntil(b"\n\n")
                digest = write_list(path, pair, [("d0", dep.decode[0])])
                await reload_now(dep)
                progress = reload_progress(await dep.metrics())
                assert progress.took(digest) and progress.left_on(["d1", "gone"]) == {"d1": 1}
                for _ in range(3):
                    assert (await dep.post("/v1/completions", COMPLETION))[0] == 200
                assert len(dep.decode[1].received) == 1  # no new legs
                rest = (await resp.read()).decode()
            assert rest.endswith("data: [DONE]\n\n") and "error" not in rest
            assert reload_progress(await dep.metrics()).left_on(["d1"]) == {}
            assert [i.name for i in dep.router.decode.instances] == ["d0"] and not dep.router.decode.draining

    run(scenario())


def test_an_instance_whose_address_changed_is_a_new_instance_and_the_old_one_drains(tmp_path):
    async def scenario():
        path = tmp_path / "instances.json"
        async with deployment("kvpush", instances_file=str(path), **FAST_PROBES) as dep:
            old = dep.router.decode.instances[0]
            moved = FakeVllm(model=MODEL, created=0)
            await moved.start()
            try:
                write_list(path, [("p0", dep.prefill[0])], [("d0", moved)])
                await reload_now(dep)
                new = dep.router.decode.instances[0]
                assert new is not old and old.removed and not old.in_rotation
                await eventually(lambda: new.in_rotation, ROTATION_CHANGE_S)
                assert (await dep.post("/v1/completions", COMPLETION))[0] == 200
                assert len(moved.received) == 1 and not dep.decode[0].received
            finally:
                await moved.stop()

    run(scenario())


@pytest.mark.parametrize("content, said", [
    ("{not json", "Invalid JSON"),
    ('{"prefill": [], "decode": [{"name": "d9"}]}', "decode.0.url: Field required"),
    (None, "No such file"),
])
def test_an_unreadable_or_invalid_list_changes_nothing_and_says_why(tmp_path, caplog, content, said):
    async def scenario():
        path = tmp_path / "instances.json"
        async with deployment("kvpush", instances_file=str(path)) as dep:
            before = dep.router.rotation.digest
            if content is not None:
                path.write_text(content)
            with caplog.at_level(logging.ERROR, logger="kvpush.router"):
                await reload_now(dep)
            assert said in caplog.text and "still serving the instance list it had" in caplog.text
            assert dep.router.rotation.digest == before and reload_progress(await dep.metrics()).took(before)
            assert (await dep.post("/v1/completions", COMPLETION))[0] == 200

    run(scenario())


def test_a_reload_without_an_instances_file_is_a_no_op(caplog):
    async def scenario():
        async with deployment("kvpush") as dep:
            with caplog.at_level(logging.WARNING, logger="kvpush.router"):
                await reload_now(dep)
            assert "names no instances_file" in caplog.text
            assert len(dep.router.decode) == 1

    run(scenario())


def test_the_instances_served_are_in_the_metrics_by_digest():
    async def scenario():
        async with deployment("kvpush") as dep:
            listed = InstanceList(prefill=[upstream("p0", dep.prefill[0], 5600)], decode=[upstream("d0", dep.decode[0], 5700)])
            assert reload_progress(await dep.metrics()).took(listed.digest())
            assert json.loads(listed.model_dump_json())["decode"][0]["name"] == "d0"

    run(scenario())


# --- xPyD under load ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamOutcome:
    answered: bool  # whole, without an error event
    streamed: bool  # a token reached the client before it failed
    failure: str  # status and the start of the body, where not answered


async def _streamed_load(dep, clients: int, until: asyncio.Event) -> list[StreamOutcome]:
    """`clients` clients sending streamed completions back to back until `until` is set."""
    outcomes: list[StreamOutcome] = []

    async def client() -> None:
        while not until.is_set():
            status, raw = await dep.post("/v1/completions", {**COMPLETION, "max_tokens": 6, "stream": True})
            data = [e for e in raw.decode().split("\n\n") if e.startswith("data: {")]
            error = status != 200 or any('"error"' in e for e in data)
            streamed = any('"error"' not in e for e in data)
            outcomes.append(StreamOutcome(not error, error and streamed, f"{status}: {raw[:300]!r}" if error else ""))

    await asyncio.gather(*(client() for _ in range(clients)))
    return outcomes


@pytest.mark.parametrize("fault", ["hang", "kill"])
def test_with_two_prefills_and_two_decodes_losing_one_of_each_under_load_fails_no_request_not_yet_streaming(fault):
    """As SIGSTOP (nothing answers, connections stay open) or SIGKILL (connections refused and
    reset) of prefill-0 and then of decode-0 under 32 concurrent streams."""
    async def scenario():
        timeouts = Timeouts(connect_s=1, health_s=1.0, stream_idle_s=1.0)
        async with deployment("kvpush", n_prefill=2, n_decode=2, timeouts=timeouts, **FAST_PROBES) as dep:
            for fake in dep.prefill + dep.decode:
                fake.behavior.first_token_delay_s = 0.02
                fake.behavior.token_delay_s = 0.02
            until = asyncio.Event()
            load = asyncio.create_task(_streamed_load(dep, 32, until))
            await asyncio.sleep(0.5)
            for victim, instance in ((dep.prefill[0], dep.router.prefill.instances[0]),
                                     (dep.decode[0], dep.router.decode.instances[0])):
                if fault == "hang":
                    victim.behavior.stopped = True
                else:
                    asyncio.create_task(victim.stop())
                # one instance lost at a time: the next fault comes only once this one is out
                await eventually(lambda: not instance.in_rotation, ROTATION_CHANGE_S)
                await asyncio.sleep(0.5)  # the load goes on without it
            until.set()
            outcomes = await load
            assert not dep.router.prefill.instances[0].in_rotation and not dep.router.decode.instances[0].in_rotation
            answered = sum(o.answered for o in outcomes)
            failed_before_streaming = [o.failure for o in outcomes if not o.answered and not o.streamed]
            assert answered >= 32 and failed_before_streaming == []
            for victim in (dep.prefill[0], dep.decode[0]):
                victim.behavior.stopped = False

    run(scenario())
