"""router/fanout.py: a batch is one part per prompt; how each part's prompt reaches decode."""
from __future__ import annotations

import json

import pytest

from kvpush.router.fanout import (LOCAL, NO_PREFILL, PROMPT_LOGITS, SAMPLES, SAMPLES_WITHOUT_CACHE, TRANSFER,
                                  TRANSFERS_FAILED, split, wants_prefill, way_to_decode)
from kvpush.router.validation import ParsedRequest, RequestRejected


def parsed(body: dict) -> ParsedRequest:
    return ParsedRequest(body, json.dumps(body).encode())


def test_a_batch_of_strings_or_token_lists_is_one_part_per_prompt_in_order():
    body = {"prompt": ["a", "b", "c"], "max_tokens": 3, "n": 2}
    parts = split(parsed(body), chat=False, colocated=False)
    assert [(p.index, p.body["prompt"]) for p in parts] == [(0, "a"), (1, "b"), (2, "c")]
    assert all(p.body["n"] == 2 and p.body["max_tokens"] == 3 for p in parts)
    assert json.loads(parts[1].data()) == {"prompt": "b", "max_tokens": 3, "n": 2}
    assert body["prompt"] == ["a", "b", "c"]  # the client's body is not changed
    tokens = split(parsed({"prompt": [[1, 2], [3]]}), chat=False, colocated=False)
    assert [p.body["prompt"] for p in tokens] == [[1, 2], [3]]


@pytest.mark.parametrize("prompt", ["a", [1, 2, 3], ["only one"], [[7, 8]]])
def test_one_prompt_is_one_part_that_forwards_the_clients_bytes(prompt):
    request = parsed({"prompt": prompt})
    [part] = split(request, chat=False, colocated=False)
    assert part.body is request.body and part.data() is request.raw


def test_colocated_instances_and_chat_take_the_request_as_it_is():
    request = parsed({"prompt": ["a", "b"]})
    assert split(request, chat=False, colocated=True)[0].body is request.body
    chat = parsed({"messages": [{"role": "user", "content": "x"}], "n": 3})
    assert len(split(chat, chat=True, colocated=False)) == 1


def test_a_list_of_prompt_embeds_is_refused_with_a_reason():
    with pytest.raises(RequestRejected) as info:
        split(parsed({"prompt_embeds": ["AAAA", "BBBB"]}), chat=False, colocated=False)
    assert info.value.status == 400 and info.value.param == "prompt_embeds"


P = None  # a prefill instance was chosen


@pytest.mark.parametrize("body,chat,colocated,without_prefill,caches,expected", [
    ({"prompt": "x", "n": 1}, False, False, P, True, (TRANSFER, None)),
    ({"prompt": "x", "n": 3}, False, False, P, True, (SAMPLES, None)),
    ({"prompt": "x", "use_beam_search": True, "n": 2}, False, False, P, True, (SAMPLES, None)),
    ({"prompt": "x", "n": 3}, False, False, P, False, (LOCAL, SAMPLES_WITHOUT_CACHE)),
    ({"prompt": "x", "prompt_logprobs": 0}, False, False, P, True, (LOCAL, PROMPT_LOGITS)),
    ({"prompt": "x", "echo": True, "logprobs": 1}, False, False, P, True, (LOCAL, PROMPT_LOGITS)),
    ({"prompt": "x", "echo": True}, False, False, P, True, (TRANSFER, None)),
    ({"prompt": "x", "logprobs": 2}, False, False, P, True, (TRANSFER, None)),
    ({"messages": [], "echo": True, "top_logprobs": 2}, True, False, P, True, (LOCAL, PROMPT_LOGITS)),
    ({"messages": [], "logprobs": True, "top_logprobs": 2}, True, False, P, True, (TRANSFER, None)),
    ({"prompt": "x", "n": 3}, False, False, NO_PREFILL, True, (LOCAL, NO_PREFILL)),
    ({"prompt": "x"}, False, False, TRANSFERS_FAILED, True, (LOCAL, TRANSFERS_FAILED)),
    # decode computing the prompt by design is not called a fallback, prefill or not
    ({"prompt": "x", "prompt_logprobs": 0}, False, False, NO_PREFILL, True, (LOCAL, PROMPT_LOGITS)),
    ({"prompt": "x", "n": 3}, False, False, TRANSFERS_FAILED, False, (LOCAL, SAMPLES_WITHOUT_CACHE)),
    ({"prompt": "x", "n": 3}, False, True, NO_PREFILL, True, (LOCAL, None)),
])
def test_the_way_each_part_reaches_decode(body, chat, colocated, without_prefill, caches, expected):
    assert way_to_decode(body, chat, colocated, without_prefill, caches) == expected


def test_only_a_disaggregated_prompt_whose_logits_are_not_asked_for_wants_a_prefill():
    assert wants_prefill({"prompt": "x", "n": 3}, chat=False, colocated=False)
    assert not wants_prefill({"prompt": "x"}, chat=False, colocated=True)
    assert not wants_prefill({"prompt": "x", "prompt_logprobs": 1}, chat=False, colocated=False)
