"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) as the official
``anthropic`` client uses it, against a real uvicorn server over the real default model
(SmolLM2-135M-Instruct, greedy): the reply equals the chat route's for the same conversation; system
prompts, multi-turn and tool-result turns render as the chat route renders them (counted tokens
equal ``/tokenize``'s); stop sequences, ``max_tokens``; the streamed events in Anthropic's order and
adding up to the unstreamed message; forced tool calls (``any``, a named tool) whose input follows
the schema; ``x-api-key`` and Bearer auth; errors in Anthropic's shape naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from mlx_serving import Serving, text_generation
from mlx_serving.server import ServedModel, create_app
from mlx_serving.tokenization import Tokenizer

from server_helpers import Server, metric_samples, serve

MODEL = "smollm2"
KEY = "test-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the anthropic client (2.x) takes sampling fields as extra body fields
# Bounded arguments (an enum): the model cannot wander inside an open string.
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": CITY}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TOKENS = 40  # a forced call of WEATHER takes 30 tokens with SmolLM2's tokenizer


@pytest.fixture(scope="module")
def api(smollm2_dir: Path) -> Iterator[Server]:
    serving = text_generation.from_mlx4bit(smollm2_dir, max_new_tokens=8, max_len=512, max_batch=4)
    with Serving.start(serving) as handle:
        model = ServedModel(handle, 512, Tokenizer.from_dir(smollm2_dir))
        with serve(create_app({MODEL: model}, api_key=KEY)) as url:
            yield Server(url, handle, None)
    serving.close()


@pytest.fixture(scope="module")
def client(api: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=api.url, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def greedy(client: anthropic.Anthropic) -> anthropic.types.Message:
    """The greedy 8-token reply to QUESTION."""
    return client.messages.create(model=MODEL, max_tokens=8, messages=QUESTION, extra_body=GREEDY)


def _tokenize(api: Server, messages: list[dict]) -> int:
    """The chat route's prompt tokens for OpenAI-shaped ``messages``."""
    response = httpx.post(f"{api.url}/tokenize", json={"messages": messages},
                          headers={"authorization": f"Bearer {KEY}"})
    return response.json()["count"]


def _count(client: anthropic.Anthropic, messages: list, **fields: object) -> int:
    return client.messages.count_tokens(model=MODEL, messages=messages, **fields).input_tokens


# -- the message object --------------------------------------------------------------------------------

def test_reply_is_the_chat_routes_reply(api: Server, greedy: anthropic.types.Message) -> None:
    chat = httpx.post(f"{api.url}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "messages": QUESTION, "max_tokens": 8, **GREEDY}, timeout=None).json()
    [block] = greedy.content
    assert block.type == "text" and block.text == chat["choices"][0]["message"]["content"] and block.text
    assert greedy.id.startswith("msg_") and greedy.type == "message" and greedy.role == "assistant"
    assert greedy.model == MODEL and greedy.stop_sequence is None
    assert greedy.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
    assert greedy.usage.input_tokens == chat["usage"]["prompt_tokens"] == _tokenize(api, QUESTION)
    assert greedy.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_messages_requests_reach_the_metrics(api: Server, client: anthropic.Anthropic) -> None:
    def finished() -> float:
        return sum(v for (name, labels), v in metric_samples(api.url).items()
                   if name == "mlx_serving:request_success_total" and ("model_name", MODEL) in labels)

    before = finished()
    client.messages.create(model=MODEL, max_tokens=1, messages=QUESTION)
    assert finished() == before + 1


def test_max_tokens_cuts_the_reply(client: anthropic.Anthropic, greedy: anthropic.types.Message) -> None:
    reply = client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION, extra_body=GREEDY)
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 2
    assert greedy.content[0].text.startswith(reply.content[0].text)


def test_system_prompt_and_turns_render_as_the_chat_routes(api: Server, client: anthropic.Anthropic) -> None:
    system = "You answer in one word."
    turns = [*QUESTION, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    expected = _tokenize(api, [{"role": "system", "content": system}, *turns])
    assert _count(client, turns, system=system) == expected
    blocks = [{"type": "text", "text": "You answer "}, {"type": "text", "text": "in one word."}]
    split = [*turns[:2], {"role": "user", "content": [{"type": "text", "text": "And of "},
                                                      {"type": "text", "text": "Italy?"}]}]
    assert _count(client, split, system=blocks) == expected
    assert _count(client, turns) == _tokenize(api, turns) != expected  # the template's default system prompt
    reply = client.messages.create(model=MODEL, max_tokens=1, system=blocks, messages=split)
    assert reply.usage.input_tokens == expected and reply.usage.output_tokens == 1


def test_stop_sequences(client: anthropic.Anthropic, greedy: anthropic.types.Message) -> None:
    text = greedy.content[0].text
    stop = text.split()[2]  # a word inside the greedy reply ("The capital of ...")
    before = text[: text.index(stop)]
    reply = client.messages.create(model=MODEL, max_tokens=8, messages=QUESTION, stop_sequences=["zzz", stop],
                                   extra_body=GREEDY)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == stop
    assert reply.content[0].text == before
    with client.messages.stream(model=MODEL, max_tokens=8, messages=QUESTION, stop_sequences=[stop],
                                extra_body=GREEDY) as stream:
        assert "".join(stream.text_stream) == before
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


# -- streaming -------------------------------------------------------------------------------------------

def test_stream_adds_up_to_the_message(client: anthropic.Anthropic, greedy: anthropic.types.Message) -> None:
    with client.messages.stream(model=MODEL, max_tokens=8, messages=QUESTION, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) >= 1 and "".join(pieces) == greedy.content[0].text
    assert [(b.type, b.text) for b in final.content] == [(b.type, b.text) for b in greedy.content]
    assert final.stop_reason == greedy.stop_reason
    assert final.usage.input_tokens == greedy.usage.input_tokens
    assert final.usage.output_tokens == greedy.usage.output_tokens and final.id.startswith("msg_")


def _events(api: Server, body: dict) -> list[tuple[str, dict]]:
    """The SSE events of a streamed ``POST /v1/messages``: ``(event name, data)``, asserted to agree."""
    with httpx.stream("POST", f"{api.url}/v1/messages", json={**body, "stream": True}, headers={"x-api-key": KEY},
                      timeout=None) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line and not line.startswith(":")]  # no keep-alive comments
    names = [line.removeprefix("event: ") for line in lines[0::2]]
    datas = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [d["type"] for d in datas] == names
    return list(zip(names, datas))


def test_stream_events_in_anthropics_order(api: Server) -> None:
    events = _events(api, {"model": MODEL, "max_tokens": 2, "messages": QUESTION})
    names = [n for n, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"} and names[-3:] == ["content_block_stop", "message_delta",
                                                                         "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert start["usage"]["input_tokens"] == events[-2][1]["usage"]["input_tokens"] > 0
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert all(d["index"] == 0 and d["delta"]["type"] == "text_delta" for _, d in events[3:-3])
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2][1]["usage"]["output_tokens"] == 2


# -- tools -------------------------------------------------------------------------------------------------

def test_tool_choice_any_calls_a_tool_and_takes_its_result(api: Server, client: anthropic.Anthropic) -> None:
    reply = client.messages.create(model=MODEL, max_tokens=CALL_TOKENS, messages=WEATHER_QUESTION, tools=[WEATHER],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert reply.stop_reason == "tool_use"
    [call] = reply.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, CITY)
    turns = [*WEATHER_QUESTION, {"role": "assistant", "content": reply.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"}]}]
    as_chat = [*WEATHER_QUESTION, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    assert _count(client, turns, tools=[WEATHER]) == _tokenize(api, as_chat)
    answer = client.messages.create(model=MODEL, max_tokens=2, messages=turns, tools=[WEATHER])
    assert answer.usage.input_tokens == _tokenize(api, as_chat) and answer.content[0].type == "text"


def test_a_named_tool_streams_its_input_as_json(api: Server, client: anthropic.Anthropic) -> None:
    body = {"model": MODEL, "max_tokens": CALL_TOKENS, "messages": WEATHER_QUESTION, "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"}}
    events = _events(api, body)
    start = next(d for n, d in events if n == "content_block_start")
    assert start["content_block"]["type"] == "tool_use" and start["content_block"]["input"] == {}
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert [d["type"] for d in deltas] == ["input_json_delta"]
    jsonschema.validate(json.loads(deltas[0]["partial_json"]), CITY)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_choice_none_leaves_the_tools_out(api: Server, client: anthropic.Anthropic) -> None:
    assert _count(client, WEATHER_QUESTION, tools=[WEATHER], tool_choice={"type": "none"}) == _tokenize(
        api, WEATHER_QUESTION)


# -- auth and errors ---------------------------------------------------------------------------------------

def test_api_key_as_x_api_key_or_bearer(api: Server) -> None:
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        anthropic.Anthropic(base_url=api.url, api_key="wrong", max_retries=0).messages.count_tokens(
            model=MODEL, messages=QUESTION)
    assert wrong.value.status_code == 401 and wrong.value.body["type"] == "error"
    assert wrong.value.body["error"]["type"] == "authentication_error"
    assert httpx.post(f"{api.url}/v1/messages/count_tokens", json={}).status_code == 401
    bearer = anthropic.Anthropic(base_url=api.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens > 0


BASE = {"model": MODEL, "max_tokens": 4, "messages": QUESTION}


@pytest.mark.parametrize("body, status, kind, names", [
    ({"model": MODEL, "messages": QUESTION}, 400, "invalid_request_error", "max_tokens"),
    ({**BASE, "max_tokens": "4"}, 400, "invalid_request_error", "max_tokens"),
    ({**BASE, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ({**BASE, "temperature": -1}, 400, "invalid_request_error", "temperature"),
    ({**BASE, "stop_sequences": [""]}, 400, "invalid_request_error", "stop_sequences"),
    ({**BASE, "frequency_penalty": 1}, 400, "invalid_request_error", "frequency_penalty"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     400, "invalid_request_error", "messages[0].content[0]: image blocks are not supported"),
    ({**BASE, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400, "invalid_request_error",
     "messages[0].content[0].type"),
    ({**BASE, "messages": [*QUESTION, {"role": "assistant", "content": "The"}]}, 400, "invalid_request_error",
     "prefill"),
    ({**BASE, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error",
     "tool_choice"),
    ({**BASE, "tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
    ({**BASE, "model": "claude-nope"}, 404, "not_found_error", "claude-nope"),
])
def test_bad_requests_name_the_field(api: Server, body: dict, status: int, kind: str, names: str) -> None:
    response = httpx.post(f"{api.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=None)
    error = response.json()
    assert response.status_code == status and error["type"] == "error" and error["error"]["type"] == kind
    assert names in error["error"]["message"]


def test_the_client_raises_typed_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError, match="image blocks are not supported"):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        client.messages.create(model="claude-nope", max_tokens=4, messages=QUESTION)
