"""kvpush.bench.conversations and conversation_client: the multi-turn workload, its client
against a streaming server, and its result file as the bench reads it."""
from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest
from aiohttp import web

from kvpush.common.errors import UsageError
from kvpush.bench.client import LoadSpec, job_argv
from kvpush.bench.conversation_client import (PROGRAM, StreamReader, parse_args, result_document, run,
                                                     turn_body)
from kvpush.bench.conversations import Workload, new_tokens, next_prompt, plan, request_index
from kvpush.bench.options import BenchOptions
from kvpush.bench.results import completed_request_ids, parse_client_result, parse_request_samples

VOCAB = list(range(100, 600))


def test_every_conversation_gets_its_turns_new_tokens_and_the_shared_prefix_first():
    workload = Workload(conversations=4, turns=3, first_tokens=10, turn_tokens=5, prefix_len=7)
    conversations = plan(workload, rate=2.0, seed=1, vocabulary=VOCAB)
    assert [c.index for c in conversations] == [0, 1, 2, 3]
    assert all([len(u) for u in c.users] == [17, 5, 5] for c in conversations)
    prefixes = {c.users[0][:7] for c in conversations}
    assert len(prefixes) == 1  # one system prompt for all
    assert len({c.users[0][7:] for c in conversations}) == 4  # their own first turns differ
    assert all(t in VOCAB for c in conversations for u in c.users for t in u)


def test_conversations_start_as_a_poisson_process_at_the_rate():
    workload = Workload(conversations=2000, turns=1, first_tokens=1, turn_tokens=1)
    starts = [c.start_s for c in plan(workload, rate=4.0, seed=3, vocabulary=VOCAB)]
    assert starts[0] == 0.0 and starts == sorted(starts)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert 0.22 < sum(gaps) / len(gaps) < 0.28  # mean gap 1/rate


def test_the_same_seed_gives_the_same_conversations_and_another_seed_others():
    workload = Workload(conversations=3, turns=2, first_tokens=8, turn_tokens=4, prefix_len=2)
    assert plan(workload, 1.0, 5, VOCAB) == plan(workload, 1.0, 5, VOCAB)
    assert plan(workload, 1.0, 5, VOCAB) != plan(workload, 1.0, 6, VOCAB)


def test_a_turns_prompt_extends_the_last_prompt_and_answer_and_only_the_user_part_is_new():
    workload = Workload(conversations=1, turns=3, first_tokens=4, turn_tokens=2)
    first = next_prompt([], [], [1, 2, 3, 4])
    second = next_prompt(first, [9, 9], [5, 6])
    assert second == [1, 2, 3, 4, 9, 9, 5, 6]
    assert new_tokens(0, len(first), workload) == 4 and new_tokens(1, len(second), workload) == 2
    assert [request_index(c, t, 3) for c in range(2) for t in range(3)] == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("field, value, flag", [("conversations", 0, "--conversations"), ("turns", 0, "--turns"),
                                                ("first_tokens", 0, "--input-len"), ("turn_tokens", 0, "--turn-tokens"),
                                                ("prefix_len", -1, "--prefix-len")])
def test_a_bad_workload_names_its_option(field, value, flag):
    values = dict(conversations=1, turns=1, first_tokens=1, turn_tokens=1, prefix_len=0)
    values[field] = value
    assert Workload(**values).problem().startswith(f"{flag} must be at least")


def test_bench_options_make_the_workload_and_refuse_turns_without_conversations(tmp_path):
    base = dict(modes=["kvpush"], rates=[1.0], input_len=64, output_len=8, num_prompts=4, out_dir=tmp_path,
                baseline="kvpush")
    assert BenchOptions(**base).workload() is None
    options = BenchOptions(**base, conversations=3, turns=4)
    assert options.workload() == Workload(3, 4, 64, 64, 0)
    options.validate()
    with pytest.raises(UsageError, match="give --conversations"):
        BenchOptions(**base, turns=3).validate()
    with pytest.raises(UsageError, match="--turn-tokens must be at least 1"):
        BenchOptions(**base, conversations=2, turn_tokens=0).validate()


def test_a_multi_turn_load_level_runs_the_conversation_client_with_its_options(tmp_path):
    load = LoadSpec(base_url="http://r:1", served_model="tiny", tokenizer="/tok", rate=0.5, num_prompts=9, input_len=32,
                    output_len=8, seed=7, result_dir=str(tmp_path), result_filename="x.json", request_id_prefix="m-",
                    prefix_len=4, workload=Workload(2, 3, 32, 16, 4), timeout_s=60)
    argv = job_argv(load)
    assert argv[0] == PROGRAM
    args = parse_args(argv[1:])
    assert (args.conversations, args.turns, args.input_len, args.turn_tokens, args.prefix_len, args.output_len) == (
        2, 3, 32, 16, 4, 8)
    assert (args.rate, args.seed, str(args.result), args.request_id_prefix) == (0.5, 7, str(tmp_path / "x.json"), "m-")
    plain = job_argv(LoadSpec(**{**load.__dict__, "workload": None}))
    assert plain[:3] == ["vllm", "bench", "serve"]


def test_the_stream_reader_collects_token_ids_and_their_arrivals_and_reads_errors():
    reader = StreamReader(started=0.0)
    for now, line in enumerate([b'data: {"choices": [{"text": "a", "token_ids": [5]}]}\n', b"\n",
                                b'data: {"choices": [{"text": "bc", "token_ids": [6, 7]}]}\n',
                                b'data: {"choices": [], "usage": {"prompt_tokens": 3}}\n', b"data: [DONE]\n"]):
        reader.line(line, float(now))
    assert reader.token_ids == [5, 6, 7] and reader.arrivals == [0.0, 2.0] and reader.done and not reader.error
    bad = StreamReader(0.0)
    bad.line(b'data: {"error": {"message": "boom", "code": 500}}\n', 1.0)
    assert "boom" in bad.error


def test_a_turn_asks_for_greedy_token_ids_streamed_with_eos_ignored():
    body = turn_body("tiny", [1, 2], 8)
    assert body["prompt"] == [1, 2] and body["max_tokens"] == 8 and body["temperature"] == 0.0
    assert body["ignore_eos"] and body["stream"] and body["return_token_ids"]


# --- the client against a streaming server ------------------------------------------------------

def answer_for(prompt: list[int], n: int) -> list[int]:
    return [(sum(prompt) + i) % 1000 for i in range(n)]


async def serve_completions(fail_request: str | None = None):
    seen: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"id": request.headers.get("X-Request-Id"), "auth": request.headers.get("Authorization"),
                     "prompt": body["prompt"]})
        if request.headers.get("X-Request-Id") == fail_request:
            return web.json_response({"error": {"message": "no"}}, status=500)
        resp = web.StreamResponse()
        await resp.prepare(request)
        for token in answer_for(body["prompt"], body["max_tokens"]):
            await resp.write(f"data: {json.dumps({'choices': [{'text': 'x', 'token_ids': [token]}]})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}", seen


def client_args(base_url: str) -> SimpleNamespace:
    return SimpleNamespace(base_url=base_url, model="tiny", output_len=3, request_id_prefix="r-", timeout=10.0)


def test_the_client_sends_each_turn_with_the_whole_history_and_writes_a_result_the_bench_reads(monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    workload = Workload(conversations=2, turns=3, first_tokens=4, turn_tokens=2, prefix_len=1)
    conversations = plan(workload, rate=50.0, seed=0, vocabulary=VOCAB)

    async def scenario():
        runner, url, seen = await serve_completions()
        try:
            return (*await run(client_args(url), conversations, workload), seen)
        finally:
            await runner.cleanup()

    results, duration, seen = asyncio.run(scenario())
    assert len(seen) == 6 and all(s["auth"] == "Bearer k" for s in seen)
    by_id = {s["id"]: s["prompt"] for s in seen}
    for c in conversations:
        prompt: list[int] = []
        for turn, user in enumerate(c.users):
            prompt = next_prompt(prompt, answer_for(prompt, 3) if turn else [], user)
            assert by_id[f"r-{request_index(c.index, turn, 3)}"] == prompt
    doc = json.loads(json.dumps(result_document(results, duration, 50.0, workload)))
    text = json.dumps(doc)
    client = parse_client_result(text)
    assert (client.completed, client.failed, client.total_output_tokens) == (6, 0, 18)
    samples = parse_request_samples(text)
    assert len(samples.ttft) == 6 and samples.sent == 6
    assert completed_request_ids(text, "r-") == [f"r-{i}" for i in range(6)]
    turns = doc["conversations"]
    assert turns["turn"] == [0, 1, 2, 0, 1, 2] and turns["new_tokens"] == [5, 2, 2, 5, 2, 2]
    assert turns["answer_token_ids"][0] == answer_for(by_id["r-0"], 3)
    assert doc["input_lens"][:3] == [5, 5 + 3 + 2, 5 + 3 + 2 + 3 + 2]


def test_a_failed_turn_ends_its_conversation_and_the_rest_are_failed_unsent():
    workload = Workload(conversations=2, turns=3, first_tokens=4, turn_tokens=2)
    conversations = plan(workload, rate=50.0, seed=0, vocabulary=VOCAB)

    async def scenario():
        runner, url, seen = await serve_completions(fail_request="r-1")  # conversation 0, turn 2
        try:
            return (*await run(client_args(url), conversations, workload), seen)
        finally:
            await runner.cleanup()

    results, duration, seen = asyncio.run(scenario())
    assert sorted(s["id"] for s in seen) == ["r-0", "r-1", "r-3", "r-4", "r-5"]
    doc = result_document(results, duration, 50.0, workload)
    assert doc["completed"] == 4 and doc["failed"] == 2
    assert doc["errors"][1].startswith("HTTP 500") and doc["errors"][2] == "turn 2 failed"
    assert doc["output_lens"][1:3] == [0, 0]
    assert completed_request_ids(json.dumps(doc), "r-") == ["r-0", "r-3", "r-4", "r-5"]
