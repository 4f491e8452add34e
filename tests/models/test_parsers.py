"""Qwen3 reasoning and tool-call parsing (models/text_generation/_parsers.py) on scripted outputs.

Each script is fed whole (the one-shot parse), token by token through the real Qwen3 tokenizer and
``StreamingDetokenizer`` (tags as their own added tokens, and spelled with ordinary tokens so they
arrive in pieces), and split at arbitrary character positions (hypothesis). Every way gives the
same fields, and at every point the content and reasoning streamed so far are prefixes of the final
ones: a partial tag never reaches content.
"""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_serving.models.text_generation._parsers import Delta, Qwen3OutputParser, ToolCall, parse_tool_call
from mlx_serving.tokenization import StreamingDetokenizer, Tokenizer

TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}'

# (script, reasoning, tools) -> expected (content, reasoning_content, [(name, arguments dict)])
CASES = {
    "think_then_answer": (
        "<think>\nThe user adds 2 and 2.\n\nIt is 4.\n</think>\n\nThe answer is 4.", True, True,
        ("The answer is 4.", "The user adds 2 and 2.\n\nIt is 4.", []),
    ),
    "think_then_two_calls": (
        f"<think>\nNeed the weather.\n</think>\n\nI will check.\n<tool_call>\n{WEATHER}\n</tool_call>\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', True, True,
        ("I will check.", "Need the weather.",
         [("get_weather", {"city": "Paris", "unit": "°C"}), ("get_time", {})]),
    ),
    "call_then_text": (
        '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2], "s": "<tool_call>"}}\n</tool_call>\n\nDone.',
        False, True, ("Done.", "", [("f", {"a": [1, 2], "s": "<tool_call>"})]),
    ),
    "arguments_as_string": (
        '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>', False, True,
        ("", "", [("f", {"a": 1})]),
    ),
    "malformed_call_is_content": (
        'Sure.\n<tool_call>\n{"name": "f", "arguments": {oops}}\n</tool_call>', True, True,
        ('Sure.\n<tool_call>\n{"name": "f", "arguments": {oops}}\n</tool_call>', "", []),
    ),
    "call_without_name_is_content": (
        '<tool_call>\n{"arguments": {}}\n</tool_call> ok', False, True,
        ('<tool_call>\n{"arguments": {}}\n</tool_call> ok', "", []),
    ),
    "unterminated_call_is_content": (
        'Let me call.\n<tool_call>\n{"name": "f", "argu', False, True,
        ('Let me call.\n<tool_call>\n{"name": "f", "argu', "", []),
    ),
    "unterminated_think_is_reasoning": (
        "<think>\nstill thinking\n", True, True, ("", "still thinking", []),
    ),
    "near_tags_are_content": (
        "a <b> and <thinking> or <tool> x < y </tool_call </think", True, True,
        ("a <b> and <thinking> or <tool> x < y </tool_call </think", "", []),
    ),
    "reasoning_off_keeps_tags": (
        "<think>\nhmm\n</think>\n\nHi", False, True, ("<think>\nhmm\n</think>\n\nHi", "", []),
    ),
    "tools_off_keeps_calls": (
        f"<think>\nx\n</think>\n\nCall:\n<tool_call>\n{WEATHER}\n</tool_call>", True, False,
        (f"Call:\n<tool_call>\n{WEATHER}\n</tool_call>", "x", []),
    ),
    "plain_text_unchanged": (
        "  Hello,\n world!  \n", True, True, ("  Hello,\n world!  \n", "", []),
    ),
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.qwen3()


def _run(pieces: list[str], reasoning: bool, tools: bool) -> tuple[str, str, list[ToolCall]]:
    """Feed ``pieces``; check that content and reasoning only ever grow by prefixes of their final
    values and that no delta holds a tag the parser consumed; return the totals."""
    parser = Qwen3OutputParser(reasoning=reasoning, tools=tools)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    reasoning_text = "".join(d.reasoning_content for d in deltas)
    calls = [c for d in deltas for c in d.tool_calls]
    so_far = ""
    for delta in deltas:
        assert isinstance(delta, Delta)
        so_far += delta.content
        assert content.startswith(so_far)
    return content, reasoning_text, calls


def _summary(result: tuple[str, str, list[ToolCall]]) -> tuple[str, str, list[tuple[str, dict]]]:
    content, reasoning, calls = result
    return content, reasoning, [(c.name, json.loads(c.arguments)) for c in calls]


def _spelled_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Ids of ``text`` with every tag written as ordinary tokens ("<th" + "ink>"...)."""
    ids: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, TAGS)) + ")", text):
        if part in TAGS:
            ids += tokenizer.encode(part[:3]) + tokenizer.encode(part[3:])
        elif part:
            ids += tokenizer.encode(part)
    return ids


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_shot_parse(name):
    text, reasoning, tools, expected = CASES[name]
    assert _summary(_run([text], reasoning, tools)) == expected


@pytest.mark.parametrize("spelled", [False, True])
@pytest.mark.parametrize("name", sorted(CASES))
def test_token_stream_equals_one_shot(tokenizer, name, spelled):
    text, reasoning, tools, expected = CASES[name]
    ids = _spelled_ids(tokenizer, text) if spelled else tokenizer.encode(text)
    if not spelled and any(tag in text for tag in TAGS):
        assert set(ids) & {151_667, 151_668, 151_657, 151_658}  # the tags arrive as added tokens
    detok = StreamingDetokenizer(tokenizer)
    pieces = [detok.add(i) for i in ids] + [detok.finalize()]
    assert "".join(pieces) == text
    assert _summary(_run(pieces, reasoning, tools)) == expected


@given(name=st.sampled_from(sorted(CASES)), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_split_equals_one_shot(name, cuts):
    text, reasoning, tools, expected = CASES[name]
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert _summary(_run(pieces, reasoning, tools)) == expected


def test_every_single_split_point():
    """Every two-piece split and the one-character-at-a-time feed of every script."""
    for text, reasoning, tools, expected in CASES.values():
        for i in range(len(text) + 1):
            assert _summary(_run([text[:i], text[i:]], reasoning, tools)) == expected
        assert _summary(_run(list(text), reasoning, tools)) == expected


def test_partial_tags_are_held_until_decided():
    parser = Qwen3OutputParser(reasoning=True, tools=True)
    assert parser.feed("<th") == Delta()
    assert parser.feed("ink>\nA") == Delta(reasoning_content="A")
    assert parser.feed("\n</thi") == Delta()
    assert parser.feed("nk>\n\nB <tool_") == Delta(content="B")
    assert parser.feed("call>\n" + WEATHER) == Delta()
    delta = parser.feed("\n</tool_call>")
    assert delta.content == "" and [c.name for c in delta.tool_calls] == ["get_weather"]
    assert parser.finish() == Delta()


def test_tool_call_ids_are_openai_shaped_and_unique():
    ids = {parse_tool_call('{"name": "f", "arguments": {}}').id for _ in range(50)}
    assert len(ids) == 50 and all(re.fullmatch("call_[0-9a-f]{24}", i) for i in ids)


@pytest.mark.parametrize("body", ["", "[]", '{"name": ""}', '{"name": "f", "arguments": [1]}',
                                  '{"name": "f", "arguments": "not json"}', '{"name": 3}'])
def test_parse_tool_call_rejects(body):
    assert parse_tool_call(body) is None
