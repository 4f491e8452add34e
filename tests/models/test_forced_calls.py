"""Forced tool calls (models/text_generation/_forced_calls.py, issue 40 items 1-3): each tool's
``$ref`` pointers re-rooted in the combined schema (several tools whose ``$defs`` share names),
objects closed over their declared properties, "required" as one to MAX_PARALLEL_CALLS calls with
EOS allowed after each complete call, ``parallel_tool_calls`` false as exactly one; and the row
parser of a forced turn (no cut-off markup as content, a repeated call ends the turn). Grammars
are driven token by token through llguidance with the real Qwen3 tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mlx_serving.models.text_generation._forced_calls import MAX_PARALLEL_CALLS, call_parameters, tool_call_format
from mlx_serving.models.text_generation._outputs import RowParser
from mlx_serving.models.text_generation._structured import compile_response_format, constraint_factory
from mlx_serving.serving import InvalidInput
from mlx_serving.tokenization import Tokenizer

pytest.importorskip("llguidance")

EOS = 151_645
# Two tools whose nested models are both called "City", of different shapes.
CITY_A = {"type": "object", "properties": {"name": {"enum": ["Paris", "Rome"]}}, "required": ["name"]}
CITY_B = {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"]}
TRIP = {"$defs": {"City": CITY_A}, "type": "object", "properties": {"to": {"$ref": "#/$defs/City"}}, "required": ["to"]}
POST = {"definitions": {"City": CITY_B}, "type": "object", "properties": {"to": {"$ref": "#/definitions/City"}},
        "required": ["to"]}
TREE = {"type": "object", "properties": {"leaf": {"type": "boolean"},
                                         "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["leaf", "kids"]}
TOOLS = [{"type": "function", "function": {"name": "trip", "parameters": TRIP}},
         {"type": "function", "function": {"name": "post", "parameters": POST}},
         {"type": "function", "function": {"name": "tree", "parameters": TREE}},
         {"type": "function", "function": {"name": "ping"}}]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.qwen3()


@pytest.fixture(scope="module")
def factory(tokenizer: Tokenizer):
    return constraint_factory(tokenizer, tokenizer.vocab_size)


def _call(name: str, arguments: dict) -> str:
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _run(factory, tokenizer: Tokenizer, grammar: str, text: str):
    """The constraint after ``text``, or None when the grammar refuses one of its tokens."""
    constraint = factory(grammar, (EOS,))
    for token in tokenizer.encode(text):
        if not constraint.allowed()[token]:
            return None
        constraint.accept(token)
    return constraint


def _ends(factory, tokenizer: Tokenizer, grammar: str, text: str) -> bool:
    """``text`` is a whole output of ``grammar``: every token allowed, then EOS allowed."""
    constraint = _run(factory, tokenizer, grammar, text)
    return constraint is not None and bool(constraint.allowed()[EOS])


def _grammar(choice: object, parallel: bool = True, tools: list = TOOLS) -> str:
    grammar = compile_response_format(tool_call_format(tools, choice, parallel))
    assert grammar is not None
    return grammar


def test_refs_are_rerooted_and_objects_closed() -> None:
    params = {"$defs": {"City": CITY_A}, "type": "object",
              "properties": {"to": {"$ref": "#/$defs/City"}, "self": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                             "tags": {"type": "object", "additionalProperties": {"type": "string"}},
                             "both": {"allOf": [{"$ref": "#/$defs/City"}, {"properties": {"x": {}}}]},
                             "data": {"const": {"$ref": "#/not/a/schema"}}}}
    out = call_parameters(params, "tool3")
    assert out["$defs"]["City"]["additionalProperties"] is False  # closed over its declared properties
    assert out["additionalProperties"] is False
    props = out["properties"]
    assert props["to"] == {"$ref": "#/$defs/tool3/$defs/City"}
    assert props["self"]["anyOf"][0] == {"$ref": "#/$defs/tool3"}
    assert props["tags"]["additionalProperties"] == {"type": "string"}  # what it says of further keys stays
    assert props["both"]["allOf"][1] == {"properties": {"x": {}}}  # an allOf member stays open
    assert props["data"] == {"const": {"$ref": "#/not/a/schema"}}  # a value, not a schema
    assert "additionalProperties" not in params and params["properties"]["to"] == {"$ref": "#/$defs/City"}


def test_tools_with_clashing_defs_each_resolve_their_own(factory, tokenizer) -> None:
    grammar = _grammar("required")
    assert _ends(factory, tokenizer, grammar, _call("trip", {"to": {"name": "Rome"}}))
    assert _ends(factory, tokenizer, grammar, _call("post", {"to": {"zip": 75001}}))
    assert _run(factory, tokenizer, grammar, _call("trip", {"to": {"zip": 75001}})) is None
    assert _run(factory, tokenizer, grammar, _call("post", {"to": {"name": "Rome"}})) is None
    assert _ends(factory, tokenizer, grammar, _call("tree", {"leaf": False, "kids": [{"leaf": True, "kids": []}]}))
    named = _grammar({"type": "function", "function": {"name": "post"}})
    assert _ends(factory, tokenizer, named, _call("post", {"to": {"zip": 1}}))
    assert _run(factory, tokenizer, named, _call("trip", {"to": {"name": "Rome"}})) is None


def test_forced_arguments_are_closed_over_declared_properties(factory, tokenizer) -> None:
    grammar = _grammar({"type": "function", "function": {"name": "trip"}})
    assert _run(factory, tokenizer, grammar, _call("trip", {"to": {"name": "Rome"}, "extra": 1})) is None
    assert _run(factory, tokenizer, grammar, _call("trip", {"to": {"name": "Rome", "extra": 1}})) is None
    # once the declared keys are written, both objects can only end
    constraint = _run(factory, tokenizer, grammar, '<tool_call>\n{"name": "trip", "arguments": {"to": {"name": "Rome')
    assert constraint is not None
    allowed = [tokenizer.decode([int(t)]) for t in np.flatnonzero(constraint.allowed())]
    assert allowed and all(t.startswith('"}}') for t in allowed), allowed
    ping = _grammar({"type": "function", "function": {"name": "ping"}})  # no parameters: no arguments
    assert _ends(factory, tokenizer, ping, _call("ping", {}))
    assert _run(factory, tokenizer, ping, _call("ping", {"a": 1})) is None


def test_required_is_one_or_more_calls_and_not_parallel_exactly_one(factory, tokenizer) -> None:
    calls = [_call("trip", {"to": {"name": "Rome"}}), _call("post", {"to": {"zip": 2}})] * MAX_PARALLEL_CALLS
    grammar = _grammar("required")
    assert _run(factory, tokenizer, grammar, "") is not None and not _ends(factory, tokenizer, grammar, "")
    for k in range(1, MAX_PARALLEL_CALLS + 1):
        assert _ends(factory, tokenizer, grammar, "\n".join(calls[:k])), k  # EOS after each complete call
    assert _run(factory, tokenizer, grammar, "\n".join(calls[:MAX_PARALLEL_CALLS + 1])) is None
    single = _grammar("required", parallel=False)
    done = _run(factory, tokenizer, single, calls[0])
    assert done is not None and done.is_stopped()  # the grammar is complete: the turn ends
    assert _run(factory, tokenizer, single, "\n".join(calls[:2])) is None


def test_bad_choices_name_the_field() -> None:
    with pytest.raises(InvalidInput) as info:
        tool_call_format(TOOLS, {"type": "function", "function": {"name": "nope"}}, True)
    assert info.value.param == "tool_choice" and "nope" in str(info.value)
    with pytest.raises(InvalidInput) as info:
        tool_call_format([{"type": "function", "function": {"name": "f", "parameters": [1]}}], "required", True)
    assert info.value.param == "tools" and "tools[0]" in str(info.value)
    assert tool_call_format(TOOLS, "auto", True) is None


def test_a_forced_turn_never_shows_cut_markup_and_ends_at_a_repeated_call() -> None:
    parser = RowParser(reasoning=False, tools=True, forced=True)
    first = _call("trip", {"to": {"name": "Rome"}})
    content, _, calls = parser.feed(first + "\n")
    assert content == "" and [c["function"]["name"] for c in calls] == ["trip"] and not parser.repeated
    content, _, calls = parser.feed(first + "\n" + _call("post", {"to": {"zip": 2}}))
    assert content == "" and calls == [] and parser.repeated  # the repeat and what follows are dropped
    cut = RowParser(reasoning=False, tools=True, forced=True)
    assert cut.feed('<tool_call>\n{"name": "tr')[0] == "" and cut.finish() == ("", "", [])
    assert not cut.called
    free = RowParser(reasoning=False, tools=True)  # not forced: the unterminated block stays content
    free.feed('<tool_call>\n{"name": "tr')
    assert free.finish()[0] == '<tool_call>\n{"name": "tr'
