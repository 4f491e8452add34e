"""The outputs beyond text through the server (issue 14's keys): ``n`` completions, logprobs,
``response_format`` (JSON schema), tools; equal to ``Serving.run`` on the same inputs."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from mlx_serving import Serving

from server_helpers import MODEL, Server

MESSAGES = [{"role": "user", "content": "Describe a cat."}]
# Bounded (an enum, a bool): random weights would wander inside an open string or number forever.
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["Tom", "Kitty", "Felix"]}, "indoor": {"type": "boolean"}},
          "required": ["name", "indoor"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _entries(serving: Serving, input: dict) -> list[dict]:
    return serving.run(input)["results"]


def test_n_completions_equal_serving_run(client: openai.OpenAI, tiny_serving: Serving):
    sampling = dict(temperature=0.9, seed=5)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=6, **sampling)
    expected = _entries(tiny_serving, {"messages": MESSAGES, "n": 3, "max_new_tokens": 6, **sampling})
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert [c.message.content for c in reply.choices] == [e["generated_text"] for e in expected]
    assert len({c.message.content for c in reply.choices}) > 1  # distinct draws
    assert reply.usage.completion_tokens == 18 and reply.usage.prompt_tokens == expected[0]["token_summary"]["input"]

    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=6, stream=True,
                                            **sampling)
    texts, finishes = ["", "", ""], [None, None, None]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [e["generated_text"] for e in expected] and finishes == ["length"] * 3


def test_chat_logprobs(client: openai.OpenAI, tiny_serving: Serving):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True,
                                           top_logprobs=3)
    expected = _entries(tiny_serving, {"messages": MESSAGES, "max_new_tokens": 5, "logprobs": True,
                                       "top_logprobs": 3})[0]["logprobs"]
    content = reply.choices[0].logprobs.content
    assert [(t.token, t.logprob) for t in content] == [(e["token"], e["logprob"]) for e in expected]
    for item in content:  # greedy: the chosen token is the most probable one
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].token == item.token
        assert item.logprob <= 0 and item.bytes == list(item.token.encode())
    streamed = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True,
                                              stream=True)
    tokens = [t.token for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [e["token"] for e in expected]


def test_completion_logprobs(client: openai.OpenAI):
    reply = client.completions.create(model=MODEL, prompt="The sea", max_tokens=4, logprobs=2)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]


def test_response_format_json_schema(client: openai.OpenAI):
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0.7, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "cat", "schema": SCHEMA, "strict": True}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_completions_honour_response_format(client: openai.OpenAI):
    """/v1/completions applies response_format as chat does (JSON out; a bad format is 400)."""
    reply = client.completions.create(model=MODEL, prompt="The sea", max_tokens=60, temperature=0.7, seed=1,
                                      extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                          "name": "cat", "schema": SCHEMA, "strict": True}}})
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMA)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="The sea", extra_body={"response_format": {"type": "xml"}})
    assert info.value.body["param"] == "response_format"


def test_bad_response_format_is_400(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                       response_format={"type": "json_schema", "json_schema": {"schema": 5}})
    assert info.value.body["param"] == "response_format"


def test_tools_reach_the_template(client: openai.OpenAI, tiny_serving: Serving):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, tools=TOOLS)
    expected = _entries(tiny_serving, {"messages": MESSAGES, "max_new_tokens": 6, "tools": TOOLS})[0]
    assert reply.choices[0].message.content == expected["generated_text"]
    assert reply.usage.prompt_tokens == expected["token_summary"]["input"]
    without = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, tools=TOOLS,
                                             tool_choice="none")
    assert without.usage.prompt_tokens < reply.usage.prompt_tokens  # tool_choice none: no tools in the prompt


# A regex response_format makes the random-weight model write a think block or a tool call, so
# the server's reasoning_content and tool_calls fields can be checked on real output.
THINK = {"type": "regex", "regex": "<think>\nhm\n</think>\n\nhi"}
CALL = {"type": "regex", "regex": '<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "Paris"\\}\\}\n'
                                  '</tool_call>'}


def test_reasoning_content(client: openai.OpenAI):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=30, response_format=THINK,
                  extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert (message.content, message.reasoning_content) == ("hi", "hm")
    chunks = [c.choices[0].delta for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == "hm"
    assert "".join(d.content or "" for d in chunks) == "hi"


def test_tool_calls(client: openai.OpenAI):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=60, response_format=CALL, tools=TOOLS)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function", "get_weather", {"city": "Paris"})
    assert call.id.startswith("call_")
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    calls = [t for c in chunks for t in c.delta.tool_calls or ()]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert chunks[-1].finish_reason == "tool_calls"
