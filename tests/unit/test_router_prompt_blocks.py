"""router/prompt_blocks.py: a prompt's block chain, from token ids, text or chat messages."""
from __future__ import annotations

from kvpush.router.prompt_blocks import CHARS, TOKENS, prompt_blocks


def chain(body: dict, chat: bool = False, tokens: int = 4, chars: int = 8):
    return prompt_blocks(body, chat, tokens, chars)


def test_token_ids_are_cut_in_whole_blocks_and_a_longer_prompt_extends_a_shorter_ones_chain():
    short = chain({"model": "m", "prompt": list(range(10))})
    longer = chain({"model": "m", "prompt": list(range(10)) + [7, 7, 7]})
    assert short.unit == TOKENS and short.length == 10 and len(short.keys) == 2  # 2 whole blocks of 4
    assert len(longer.keys) == 3 and longer.keys[:2] == short.keys


def test_a_prompt_that_differs_early_shares_no_key_after_the_difference():
    a = chain({"model": "m", "prompt": [1, 2, 3, 4, 5, 6, 7, 8]})
    b = chain({"model": "m", "prompt": [1, 2, 3, 9, 5, 6, 7, 8]})
    assert not set(a.keys) & set(b.keys)


def test_the_model_and_cache_salt_separate_equal_prompts():
    ids = list(range(8))
    base = chain({"model": "m", "prompt": ids}).keys
    assert chain({"model": "lora-a", "prompt": ids}).keys[0] != base[0]
    assert chain({"model": "m", "prompt": ids, "cache_salt": "s"}).keys[0] != base[0]


def test_text_is_cut_in_characters_and_a_batch_of_one_reads_as_its_prompt():
    text = "abcdefgh" * 3 + "xy"
    plain = chain({"prompt": text})
    assert plain.unit == CHARS and plain.length == 26 and len(plain.keys) == 3
    assert chain({"prompt": [text]}) == plain
    assert chain({"prompt": [list(range(8))]}).unit == TOKENS


def test_a_chat_turn_extends_the_previous_turns_chain():
    first = [{"role": "system", "content": "You are terse." * 4}, {"role": "user", "content": "hello there " * 5}]
    second = first + [{"role": "assistant", "content": "hi " * 9}, {"role": "user", "content": "more please " * 3}]
    a, b = chain({"messages": first}, chat=True), chain({"messages": second}, chat=True)
    assert a.unit == CHARS and len(b.keys) > len(a.keys) > 2
    assert b.keys[:len(a.keys)] == a.keys


def test_chat_fields_rendered_before_the_messages_change_the_chain():
    messages = [{"role": "user", "content": "x" * 40}]
    plain = chain({"messages": messages}, chat=True).keys
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert chain({"messages": messages, "tools": tools}, chat=True).keys[0] != plain[0]
    # dict order of equal JSON does not matter
    assert (chain({"messages": [{"content": "x" * 40, "role": "user"}]}, chat=True).keys == plain)


def test_chat_content_parts_and_message_fields_are_part_of_the_text():
    parts = [{"role": "user", "content": [{"type": "text", "text": "y" * 40}]}]
    named = [{"role": "user", "content": [{"type": "text", "text": "y" * 40}], "name": "bob"}]
    a, b = chain({"messages": parts}, chat=True), chain({"messages": named}, chat=True)
    assert a.keys and b.keys and a.keys[-1] != b.keys[-1]


def test_prompts_the_record_cannot_follow_have_no_chain():
    assert chain({"prompt_embeds": "AAAA"}) is None
    assert chain({"prompt": [[1, 2], [3, 4]]}) is None  # a batch: each part has its own
    assert chain({"prompt": [1, "x"]}) is None
    assert chain({"prompt": [True, 2, 3, 4, 5]}) is None  # bools are not token ids
    assert chain({"messages": "hi"}, chat=True) is None


def test_a_prompt_shorter_than_one_block_has_an_empty_chain():
    short = chain({"prompt": "abc"})
    assert short is not None and short.keys == () and short.length == 3
