"""kvpush.bench.engine_spans and .handoff: vLLM's request spans read field by field (never trusted
as given) and a request's prefill and decode spans joined into the engine handoff, the same for every mode."""
from __future__ import annotations

import pytest

from kvpush.bench.engine_spans import EngineSpan
from kvpush.bench.handoff import (HandoffSamples, client_request_id, join, missing, pooled, spans_document,
                                         summarize)
from kvpush.router.protocols import new_transfer_id

T0 = 1_800_000_000.0  # a wall-clock second


def record(side: str, vllm_id: str, arrival_s: float, ttft_s: float, prefill_s: float = 0.0, queue_s: float = 0.0,
           **changes) -> dict:
    """One span as the receiver keeps it (engine_spans.parse_export)."""
    attributes = {"gen_ai.request.id": vllm_id, "gen_ai.latency.time_to_first_token": ttft_s,
                  "gen_ai.latency.time_in_queue": queue_s, "gen_ai.latency.time_in_model_prefill": prefill_s,
                  "gen_ai.latency.e2e": ttft_s + 0.05, "gen_ai.usage.prompt_tokens": 256}
    attributes.update(changes.pop("attributes", {}))
    return {"deployment": "local-cpu-bench", "instance": f"{side}-0", "role": side,
            "start_unix_nano": int(round(arrival_s * 1e9)), "end_unix_nano": int(round((arrival_s + 1) * 1e9)),
            "attributes": attributes, **changes}


def legs(client_id: str, p_arrival: float, p_ttft: float, p_prefill: float, d_arrival: float, d_ttft: float,
         chat: bool = False) -> list[dict]:
    """Both legs' spans of one dispatch, named as vLLM names a request whose X-Request-Id is the router's."""
    dispatch = new_transfer_id(client_id)
    vllm_id = f"chatcmpl-{dispatch}" if chat else f"cmpl-{dispatch}-0"
    return [record("prefill", vllm_id, p_arrival, p_ttft, p_prefill), record("decode", vllm_id, d_arrival, d_ttft)]


def spans(records: list[dict]) -> list[EngineSpan]:
    return [s for s in map(EngineSpan.of, records) if s is not None]


def test_the_clients_id_is_read_back_from_the_id_vllm_gives_each_leg():
    dispatch = new_transfer_id("kvpush-rate2-round1-17")
    assert client_request_id(f"cmpl-{dispatch}-0") == "kvpush-rate2-round1-17"
    assert client_request_id(f"chatcmpl-{dispatch}") == "kvpush-rate2-round1-17"
    assert client_request_id(f"cmpl-{new_transfer_id()}-0") is None  # no client id: warm-up, `up`'s proof
    assert client_request_id("cmpl-kvpush-rate2-17-0") is None  # colocated: the client's id as it was, one leg


def test_both_intervals_from_one_requests_two_spans():
    # push: both legs arrive at once; P computes 40 ms (its first token 45 ms after arrival), D's first token at 60 ms
    records = legs("r-0", T0, 0.045, 0.040, T0 + 0.001, 0.059)
    [sample] = join(spans(records), ["r-0"]).samples
    assert sample.request_id == "r-0"
    assert sample.answer_to_first_ms == pytest.approx(15.0, abs=1e-3)  # D first (T0+60ms) - P first (T0+45ms)
    assert sample.compute_to_first_ms == pytest.approx(55.0, abs=1e-3)  # D first - P start (T0+5ms)
    assert sample.prefill_ms == pytest.approx(40.0)


def test_pull_joins_alike_although_decode_arrives_after_prefill_answered():
    records = legs("r-0", T0, 0.030, 0.025, T0 + 0.034, 0.020, chat=True)
    [sample] = join(spans(records), ["r-0"]).samples
    assert sample.answer_to_first_ms == pytest.approx(24.0, abs=1e-3)
    assert sample.compute_to_first_ms == pytest.approx(49.0, abs=1e-3)


def test_only_completed_requests_with_both_spans_are_joined_and_the_rest_counted():
    records = (legs("r-0", T0, 0.03, 0.02, T0, 0.05)
               + legs("r-1", T0, 0.03, 0.02, T0, 0.05)[:1]  # decode's span never came
               + legs("other-0", T0, 0.03, 0.02, T0, 0.05)  # not a request of this load level
               + [record("decode", "cmpl-r-2-0", T0, 0.01)])  # the same client id, colocated
    samples = join(spans(records), ["r-0", "r-1", "r-2"])
    assert samples.requests == 3 and samples.joined == 1 and [s.request_id for s in samples.samples] == ["r-0"]
    assert missing(spans(records), ["r-0", "r-1", "r-2"]) == 2


def test_a_retried_request_is_joined_by_the_dispatch_that_answered():
    failed_try = legs("r-0", T0, 0.03, 0.02, T0, 0.50)  # its decode did produce a token, earlier
    answered = legs("r-0", T0 + 1, 0.03, 0.02, T0 + 1, 0.05)
    [sample] = join(spans(failed_try + answered), ["r-0"]).samples
    assert sample.answer_to_first_ms == pytest.approx(20.0, abs=1e-3)


def test_a_client_id_the_router_rewrote_is_still_matched():
    records = legs("run 1/7", T0, 0.03, 0.02, T0, 0.05)  # the router carries it as run_1_7
    assert join(spans(records), ["run 1/7"]).joined == 1


@pytest.mark.parametrize("change", [
    {"role": None}, {"instance": ""}, {"start_unix_nano": -1}, {"start_unix_nano": True}, {"start_unix_nano": "1"},
    {"attributes": {"gen_ai.latency.time_to_first_token": float("nan")}},
    {"attributes": {"gen_ai.latency.time_in_model_prefill": -0.1}},
    {"attributes": {"gen_ai.latency.time_in_queue": True}},
    {"attributes": {"gen_ai.latency.time_to_first_token": "0.1"}},
    {"attributes": {"gen_ai.request.id": 7}},
    {"attributes": {"gen_ai.request.id": "x" * 5000}},
])
def test_a_span_missing_a_figure_or_holding_nonsense_is_left_out(change):
    assert EngineSpan.of(record("prefill", "cmpl-a-0", T0, 0.03, 0.02)) is not None
    assert EngineSpan.of(record("prefill", "cmpl-a-0", T0, 0.03, 0.02, **change)) is None
    assert EngineSpan.of("not a record") is None and EngineSpan.of({"attributes": []}) is None


def test_a_kept_document_recomputes_the_same_samples_and_rounds_pool():
    records = legs("r-0", T0, 0.03, 0.02, T0, 0.05) + legs("r-1", T0, 0.03, 0.01, T0, 0.07) + ["junk", {"x": 1}]
    document = spans_document("r-", ["r-0", "r-1"], records)
    again = HandoffSamples.of(document)
    assert again == join(spans(records), ["r-0", "r-1"]) and again.joined == 2
    both = pooled([again, HandoffSamples.of(spans_document("s-", ["s-0"], []))])
    assert both.requests == 3 and both.joined == 2


def test_summary_percentiles_and_an_empty_one():
    records = [r for i in range(5) for r in legs(f"r-{i}", T0, 0.03, 0.02, T0, 0.03 + 0.01 * (i + 1))]
    summary = summarize(join(spans(records), [f"r-{i}" for i in range(5)]))
    assert (summary.requests, summary.joined) == (5, 5)
    assert summary.answer_to_first["p50"] == pytest.approx(30.0, abs=1e-3)
    assert summary.compute_to_first["p50"] == pytest.approx(50.0, abs=1e-3)  # and prefill's 20 ms
    assert summary.answer_to_first["p90"] == pytest.approx(46.0, abs=1e-3)  # interpolated between 40 and 50
    assert summary.prefill["p99"] == pytest.approx(20.0)
    empty = summarize(HandoffSamples(4))
    assert (empty.requests, empty.joined) == (4, 0) and empty.compute_to_first == {"p50": None, "p90": None, "p99": None}
