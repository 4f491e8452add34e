"""The server as OpenAI and vLLM clients use it (issue 25), driven by the official ``openai``
client and httpx against a real uvicorn server: forced tool calls (``tool_choice`` "required" and
a named function), ``models.retrieve`` with ``max_model_len``, vLLM's extension fields
(``ignore_eos``, ``stop_token_ids``, ``include_stop_str_in_output``, ``structured_outputs`` /
``guided_*``), ``cached_tokens``, ``/tokenize`` / ``/detokenize``, ``/version``, CORS, OpenAI-shaped
errors on every route, ``x-request-id``, and fields no table knows refused by name."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from mlx_serving import Serving
from mlx_serving.server import create_app
from mlx_serving.server import ServedModel
from mlx_serving.tokenization import Tokenizer

from server_helpers import MODEL, OPTIONS, Server, serve

ORIGIN = "http://app.example"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# Bounded arguments (enums): random weights would wander inside an open string forever.
UNIT = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"],
        "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_unit", "parameters": UNIT}}]
SCHEMAS = {"get_weather": CITY, "get_unit": UNIT}


@pytest.fixture(scope="module")
def v2(tiny_serving: Serving, tiny_ckpt) -> Iterator[Server]:
    with Serving.start(tiny_serving, max_queue=1024) as handle:
        model = ServedModel(handle, OPTIONS["max_len"], Tokenizer.from_dir(tiny_ckpt))
        app = create_app({MODEL: model}, allowed_origins=(ORIGIN,))
        with serve(app) as url:
            yield Server(url, handle, app)


@pytest.fixture(scope="module")
def client(v2: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{v2.url}/v1", api_key="unused", max_retries=0)


def _check_calls(calls, names: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- tool_choice ---------------------------------------------------------------------------------

def test_tool_choice_required_forces_a_valid_call(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            max_tokens=60).choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, set(SCHEMAS))
    auto = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=8).choices[0]
    assert auto.finish_reason != "tool_calls"  # unforced, the random-weight model writes no call


def test_named_tool_choice_forces_that_function_streamed_too(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_unit"}}
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=60)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    _check_calls(choice.message.tool_calls, {"get_unit"})
    chunks = [c.choices[0] for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    calls = [t for c in chunks for t in c.delta.tool_calls or ()]
    assert [t.function.name for t in calls] == ["get_unit"] and chunks[-1].finish_reason == "tool_calls"
    assert json.loads(calls[0].function.arguments) == json.loads(choice.message.tool_calls[0].function.arguments)


def test_parallel_tool_calls_false_gives_one_call(client: openai.OpenAI) -> None:
    choice = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=60).choices[0]
    assert len(choice.message.tool_calls) == 1


@pytest.mark.parametrize("kwargs,param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
])
def test_bad_tool_choice_is_a_400_naming_it(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kwargs)
    assert info.value.body["param"] == param


# -- models ---------------------------------------------------------------------------------------

def test_models_retrieve_reports_the_context_length(client: openai.OpenAI) -> None:
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.model_extra["max_model_len"] == OPTIONS["max_len"]
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert info.value.body["code"] == "model_not_found"


# -- vLLM's extension fields ----------------------------------------------------------------------

def test_ignore_eos_runs_to_max_tokens(client: openai.OpenAI) -> None:
    eos = 151645
    forced = {"logit_bias": {str(eos): 100}}  # EOS is the only token the model would pick
    stopped = client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, **forced)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    kept = client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, extra_body={"ignore_eos": True},
                                     **forced)
    assert kept.choices[0].finish_reason == "length" and kept.usage.completion_tokens == 8


def test_stop_token_ids_end_the_completion(client: openai.OpenAI, tiny_ckpt) -> None:
    [word] = Tokenizer.from_dir(tiny_ckpt).encode(" sunny")
    forced = {"logit_bias": {str(word): 100}}  # every token is " sunny"
    free = client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, **forced)
    assert free.choices[0].text == " sunny" * 8 and free.choices[0].finish_reason == "length"
    stopped = client.completions.create(model=MODEL, prompt="Hi", max_tokens=8, extra_body={"stop_token_ids": [word]},
                                        **forced)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1


def test_include_stop_str_in_output(client: openai.OpenAI) -> None:
    text = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=8).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=8, stop=[stop])
    kept = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=8, stop=[stop],
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut.choices[0].text + stop
    assert text.startswith(kept.choices[0].text)


@pytest.mark.parametrize("extra", [{"guided_choice": ["sunny", "rainy"]},
                                   {"structured_outputs": {"choice": ["sunny", "rainy"]}},
                                   {"structured_outputs": {"regex": "(sunny|rainy)"}},
                                   {"guided_regex": "(sunny|rainy)"}])
def test_vllm_structured_output_fields(client: openai.OpenAI, extra: dict) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body=extra)
    assert reply.choices[0].message.content in ("sunny", "rainy")


def test_guided_json(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30,
                                           extra_body={"guided_json": CITY})
    jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)


@pytest.mark.parametrize("extra,param", [
    ({"use_beam_search": True}, "use_beam_search"), ({"chat_template": "{{ x }}"}, "chat_template"),
    ({"frobnicate": 1}, "frobnicate"), ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_fields_not_honoured_are_refused_by_name(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
    assert info.value.body["param"] == param


def test_openai_bookkeeping_fields_are_accepted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, user="u1",
                                           metadata={"k": "v"}, store=False)
    assert reply.usage.completion_tokens == 2


def test_a_repeated_prompt_reports_cached_tokens(client: openai.OpenAI) -> None:
    prompt = "Tell me about the weather in Paris and in Rome, in detail, with numbers and dates. " * 3
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=True,
                                       stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage[0].prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens


# -- tokenize, version, errors, CORS, request ids --------------------------------------------------

def test_tokenize_and_detokenize_match_the_completion_prompt(v2: Server, client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    chat = httpx.post(f"{v2.url}/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert chat["count"] == reply.usage.prompt_tokens == len(chat["tokens"]) and chat["max_model_len"] == 320
    plain = httpx.post(f"{v2.url}/tokenize", json={"prompt": "hello world"}).json()
    assert plain["count"] == client.completions.create(model=MODEL, prompt="hello world", max_tokens=1).usage.prompt_tokens
    back = httpx.post(f"{v2.url}/detokenize", json={"model": MODEL, "tokens": plain["tokens"]}).json()
    assert back == {"prompt": "hello world"}
    bad = httpx.post(f"{v2.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_without_a_tokenizer_tokenize_says_so(server: Server) -> None:
    response = httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"})
    assert response.status_code == 400 and "no tokenizer" in response.json()["error"]["message"]


def test_version(v2: Server) -> None:
    body = httpx.get(f"{v2.url}/version").json()
    assert re.fullmatch(r"\d+\.\d+\.\d+.*|0\+unknown", body["version"])


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nothing", 404), ("DELETE", "/v1/models", 405),
                                                ("GET", "/v1/chat/completions", 405)])
def test_unknown_routes_and_methods_answer_in_openai_shape(v2: Server, method: str, path: str, status: int) -> None:
    response = httpx.request(method, f"{v2.url}{path}")
    assert response.status_code == status
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_a_body_that_is_not_json_media_is_415(v2: Server) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1})
    response = httpx.post(f"{v2.url}/v1/completions", content=body, headers={"content-type": "text/plain"})
    assert response.status_code == 415 and response.json()["error"]["code"] == "unsupported_media_type"


def test_cors_answers_only_the_allowed_origin(v2: Server, server: Server) -> None:
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}
    ok = httpx.options(f"{v2.url}/v1/chat/completions", headers={"origin": ORIGIN, **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{v2.url}/v1/chat/completions", headers={"origin": "http://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers
    assert other.status_code == 400 and "Disallowed CORS origin" in other.json()["error"]["message"]
    off = httpx.options(f"{server.url}/v1/chat/completions", headers={"origin": ORIGIN, **preflight})
    assert off.status_code == 405 and "access-control-allow-origin" not in off.headers


def test_x_request_id_is_echoed_or_made(v2: Server) -> None:
    echoed = httpx.get(f"{v2.url}/v1/models", headers={"x-request-id": "abc-123"})
    assert echoed.headers["x-request-id"] == "abc-123"
    made = httpx.get(f"{v2.url}/v1/models").headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)


def test_hostile_formats_are_400s_and_the_server_keeps_serving(v2: Server) -> None:
    """The reproductions of tests/chaos/test_hostile_formats.py over HTTP: 400 naming the field, and
    the next request is served."""
    chain = "start: r0\n" + "".join(f"r{i}: r{i + 1} | \"x{i}\"\n" for i in range(3000)) + "r3000: \"end\"\n"
    formats = [json.dumps({"type": "grammar", "grammar": chain})]
    for depth in (300, 900):  # JSON text written by hand: json.dumps itself gives up past ~490 levels
        schema = '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth
        formats.append('{"type": "json_schema", "json_schema": {"name": "deep", "schema": ' + schema + "}}")
    for fmt in formats:
        body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": ' + fmt + "}"
        r = httpx.post(f"{v2.url}/v1/chat/completions", timeout=60, content=body,
                       headers={"content-type": "application/json"})
        error = r.json()["error"]
        assert r.status_code == 400, r.text[:300]
        assert error["param"] == "response_format" or "nested too deeply" in error["message"], error  # 900: at parse
    deep: object = "hi"
    for _ in range(500):
        deep = [deep]
    r = httpx.post(f"{v2.url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": deep}], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:300]
    ok = httpx.post(f"{v2.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_small_defects_each_answer_400_naming_the_field(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:  # True == 1 in Python, but not a count
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_body={"n": True})
    assert info.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as info:  # more rows than the queue ever holds: not a 503
        client.completions.create(model=MODEL, prompt=["hi"] * 1025, max_tokens=1)
    assert "max_queue" in info.value.body["message"] and info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:  # the same, streamed
        client.completions.create(model=MODEL, prompt=["hi"] * 1025, max_tokens=1, stream=True)
    assert "max_queue" in info.value.body["message"] and info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:  # the prompt is at fault, not max_tokens
        client.completions.create(model=MODEL, prompt="word " * 2_000_000, max_tokens=1)
    assert info.value.body["param"] == "prompt"


def test_required_tool_calls_are_bounded_and_a_cut_off_turn_is_length(client: openai.OpenAI) -> None:
    from mlx_serving.models.text_generation._forced_calls import MAX_PARALLEL_CALLS

    done = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                          max_tokens=110).choices[0]
    assert done.finish_reason == "tool_calls" and 1 <= len(done.message.tool_calls) <= MAX_PARALLEL_CALLS
    cut = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                         max_tokens=5).choices[0]
    assert cut.finish_reason == "length" and not cut.message.tool_calls
