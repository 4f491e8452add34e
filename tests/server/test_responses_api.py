"""OpenAI's Responses API (``POST /v1/responses``) as the official ``openai`` client uses it, against
a real uvicorn server over the tiny random-weight Qwen3: the response object and its usage,
streamed events (order, sequence numbers, deltas that add up to the final text), ``instructions``,
``max_output_tokens`` -> incomplete, ``previous_response_id`` (and the stored responses' bounds),
forced function calls and function-call outputs as input, reasoning, and fields refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from mlx_serving import Serving
from mlx_serving.server import ServedModel, create_app
from mlx_serving.server._responses_api import Item, ResponseStore, items_of, messages_of
from mlx_serving.tokenization import Tokenizer

from server_helpers import MODEL, OPTIONS, Server, metric_samples, serve

# Bounded arguments (an enum): random weights would wander inside an open string forever.
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "parameters": CITY}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def api(tiny_serving: Serving, tiny_ckpt) -> Iterator[Server]:
    with Serving.start(tiny_serving, max_queue=1024) as handle:
        model = ServedModel(handle, OPTIONS["max_len"], Tokenizer.from_dir(tiny_ckpt))
        with serve(create_app({MODEL: model})) as url:
            yield Server(url, handle, None)


@pytest.fixture(scope="module")
def client(api: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api.url}/v1", api_key="unused", max_retries=0)


def _prompt_tokens(api: Server, messages: list[dict]) -> int:
    return httpx.post(f"{api.url}/tokenize", json={"messages": messages}).json()["count"]


# -- the response object ---------------------------------------------------------------------------

def test_text_output_and_usage(api: Server, client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0.5, top_p=0.9,
                                    metadata={"k": "v"}, user="u1", truncation="disabled")
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == MODEL
    assert reply.created_at > 0 and reply.temperature == 0.5 and reply.metadata == {"k": "v"}
    [message] = reply.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [part] = message.content
    assert part.type == "output_text" and part.annotations == [] and reply.output_text == part.text
    usage = reply.usage
    assert usage.input_tokens == _prompt_tokens(api, [{"role": "user", "content": QUESTION}])
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and 1 <= usage.output_tokens <= 4
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0
    assert client.responses.retrieve(reply.id).output_text == reply.output_text


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2,
                                    extra_body={"ignore_eos": True})
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage.output_tokens == 2 and reply.output[0].status == "incomplete"


def test_instructions_come_first_as_a_system_message(api: Server, client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL, instructions="Be brief.", max_output_tokens=1,
                                    input=[{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}])
    expected = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    assert reply.usage.input_tokens == _prompt_tokens(api, expected) and reply.instructions == "Be brief."


# -- streaming ---------------------------------------------------------------------------------------

def test_streamed_events_in_order_with_deltas_adding_up(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=6, extra_body={"ignore_eos": True})
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]  # 6 tokens: cut at max_output_tokens
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text and final.usage.output_tokens >= 1
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id
    unstreamed = client.responses.create(**kwargs)  # greedy: the same text
    assert unstreamed.output_text == text and client.responses.retrieve(final.id).output_text == text


def test_an_error_mid_stream_is_a_failed_response(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=60, stream=True,
                                          extra_body={"deadline": 0.005, "ignore_eos": True}))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    failed = events[-1]
    assert failed.type == "response.failed" and failed.response.status == "failed"
    assert "deadline" in failed.response.error.message
    with pytest.raises(openai.NotFoundError):  # a failed response is not stored
        client.responses.retrieve(failed.response.id)


def test_logprobs_come_with_the_output_text(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=3, include=["message.output_text.logprobs"],
                  top_logprobs=2, extra_body={"ignore_eos": True})
    entries = client.responses.create(**kwargs).output[0].content[0].logprobs
    assert len(entries) == 3 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    events = list(client.responses.create(**kwargs, stream=True))
    assert sum(len(e.logprobs) for e in events if e.type == "response.output_text.delta") == 3
    assert [e.token for e in events[-1].response.output[0].content[0].logprobs] == [e.token for e in entries]


def test_streamed_request_is_counted_as_chat_requests_are(api: Server, client: openai.OpenAI) -> None:
    def finished() -> float:
        return sum(v for (name, _), v in metric_samples(api.url).items() if name == "mlx_serving:request_success_total")

    before = finished()
    list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, stream=True))
    client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert finished() == before + 2


# -- previous_response_id ------------------------------------------------------------------------

def test_previous_response_id_continues_the_conversation(api: Server, client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Hello!", max_output_tokens=3)
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=3)
    history = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == _prompt_tokens(api, history) > first.usage.input_tokens
    third = client.responses.create(model=MODEL, input="More.", previous_response_id=second.id, max_output_tokens=1)
    assert third.usage.input_tokens > second.usage.input_tokens  # the whole chain, not one turn back


def test_unknown_or_unstored_previous_response_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope", max_output_tokens=1)
    assert info.value.body["param"] == "previous_response_id" and "not found" in info.value.body["message"]
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_delete_forgets_a_response(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    client.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(reply.id)


def test_the_store_is_bounded_by_count_and_characters() -> None:
    store = ResponseStore(max_responses=3, max_chars=2_000)
    for i in range(5):
        store.put({"id": f"resp_{i}"}, [Item("message", "x" * 10, role="user")])
    assert len(store) == 3 and store.items("resp_4") and store.response("resp_2")
    with pytest.raises(Exception, match="not found"):
        store.items("resp_1")
    store.put({"id": "resp_big"}, [Item("message", "x" * 1_950, role="user")])
    assert len(store) < 3 and store.response("resp_big") and store.chars <= 2_000  # it pushed the oldest out
    kept = len(store)
    store.put({"id": "resp_huge"}, [Item("message", "x" * 5_000, role="user")])  # bigger than the bound: not kept
    assert len(store) == kept and store.chars <= 2_000
    assert store.delete("resp_big")["deleted"] and store.chars == sum(s.chars for s in store._entries.values())


# -- tools ---------------------------------------------------------------------------------------

def test_required_tool_choice_gives_a_valid_function_call(client: openai.OpenAI) -> None:
    reply = client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=60, parallel_tool_calls=False)
    calls = [o for o in reply.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), CITY)
    assert reply.status == "completed" and reply.tools[0].name == "get_weather"
    named = {"type": "function", "name": "get_weather"}
    events = list(client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER], tool_choice=named,
                                          max_output_tokens=60, stream=True))
    types = [e.type for e in events]
    assert types[2:6] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done"]
    [call] = [o for o in events[-1].response.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), CITY)
    assert call.arguments == events[4].arguments


def test_function_call_outputs_are_accepted_as_input(api: Server, client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=60, parallel_tool_calls=False)
    [call] = [o for o in first.output if o.type == "function_call"]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}
    chained = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result],
                                      tools=[WEATHER], max_output_tokens=3)
    by_hand = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=3, input=[
        {"role": "user", "content": QUESTION}, call.model_dump(exclude_none=True), result])
    assert chained.usage.input_tokens == by_hand.usage.input_tokens > first.usage.input_tokens
    assert chained.output_text == by_hand.output_text


def test_input_items_as_chat_messages() -> None:
    items = items_of([{"type": "reasoning", "id": "rs_1", "summary": [], "content": [
                           {"type": "reasoning_text", "text": "hmm"}]},
                      {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi",
                                                                             "annotations": []}]},
                      {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c1", "output": [
                           {"type": "input_text", "text": "done"}]},
                      {"role": "developer", "content": "Be brief."}])
    assert messages_of(items, "Sys") == [
        {"role": "system", "content": "Sys"},
        {"role": "assistant", "content": "Hi", "reasoning_content": "hmm",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}, {"role": "developer", "content": "Be brief."}]


def test_reasoning_effort_turns_thinking_on_and_off(client: openai.OpenAI) -> None:
    off = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, reasoning={"effort": "none"})
    assert [o.type for o in off.output] == ["message"] and off.reasoning.effort == "none"
    forced = {"structured_outputs": {"regex": "<think>\nabc\n</think>\n\nok"}}  # a think block, then text
    on = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=30, reasoning={"effort": "low"},
                                 extra_body=forced)
    assert [o.type for o in on.output] == ["reasoning", "message"], on.output
    assert on.output[0].content[0].text.strip() == "abc" and on.output_text == "ok"


# -- refused fields ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,param", [
    (dict(extra_body={"frobnicate": 1}), "frobnicate"),
    (dict(tools=[{"type": "web_search"}]), "tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "file_search"}), "tool_choice"),
    (dict(background=True), "background"),
    (dict(conversation="conv_1"), "conversation"),
    (dict(truncation="auto"), "truncation"),
    (dict(include=["reasoning.encrypted_content"]), "include"),
    (dict(reasoning={"effort": "low", "summary": "auto"}), "reasoning.summary"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]), "input"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input"),
    (dict(max_output_tokens=0), "max_output_tokens"),
    (dict(text={"format": {"type": "json_schema", "name": "bad name!", "schema": CITY}}), "text"),
])
def test_fields_not_honoured_are_400_naming_them(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    kwargs = {"input": QUESTION, "max_output_tokens": 2, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, **kwargs)
    assert info.value.body["param"] == param, info.value.body


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    reply = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=30, text={"format": fmt})
    jsonschema.validate(json.loads(reply.output_text), CITY)
