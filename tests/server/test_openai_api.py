"""The OpenAI API over a real uvicorn server, driven by the official ``openai`` client (sync and
async): outputs equal ``Serving.run`` on the same inputs; errors in OpenAI's shape and status."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from mlx_serving import Serving, text_generation
from mlx_serving.server import create_app

from server_helpers import MODEL, Server, serve

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _expected(serving: Serving, input: dict) -> dict:
    return serving.run(input)["results"][0]


def test_chat_equals_serving_run(client: openai.OpenAI, tiny_serving: Serving):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    expected = _expected(tiny_serving, {"messages": MESSAGES, "max_new_tokens": 12})
    choice = reply.choices[0]
    assert choice.message.content == expected["generated_text"] and choice.message.role == "assistant"
    assert choice.finish_reason == expected["finish_reason"] == "length"
    assert reply.model == MODEL and reply.object == "chat.completion"
    assert reply.usage.prompt_tokens == expected["token_summary"]["input"]
    assert reply.usage.completion_tokens == 12 and reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_completion_equals_serving_run(client: openai.OpenAI, tiny_serving: Serving):
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10)
    expected = _expected(tiny_serving, {"text": "Once upon a time", "max_new_tokens": 10})
    assert reply.choices[0].text == expected["generated_text"]
    assert reply.usage.prompt_tokens == expected["token_summary"]["input"] and reply.usage.completion_tokens == 10


def test_completion_list_of_prompts(client: openai.OpenAI, tiny_serving: Serving):
    reply = client.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=4)
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.text for c in reply.choices] == [_expected(tiny_serving, {"text": p, "max_new_tokens": 4})
                                               ["generated_text"] for p in ("one", "two")]


def test_streaming_chat_equals_non_streamed(client: openai.OpenAI, tiny_serving: Serving):
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    expected = _expected(tiny_serving, {"messages": MESSAGES, "max_new_tokens": 12})
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected["generated_text"]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_streaming_completion(client: openai.OpenAI, tiny_serving: Serving):
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=6, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == _expected(
        tiny_serving, {"text": "abc", "max_new_tokens": 6})["generated_text"]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_text_pieces_waiting_together_go_out_as_one_chunk():
    """A stream that fell behind sends its waiting text pieces joined (one SSE chunk), other items
    (delta dicts, finals) as they are, in order."""
    from mlx_serving.server._sse import joined

    final = {"finish_reason": "length", "num_tokens": 3}
    assert joined(["a", "b", {"content": "c"}, "d", "e", final]) == ["ab", {"content": "c"}, "de", final]
    assert joined(["only"]) == ["only"]


def test_stop_string(client: openai.OpenAI, tiny_serving: Serving):
    full = _expected(tiny_serving, {"messages": MESSAGES, "max_new_tokens": 16})["generated_text"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, stop=[stop])
    assert reply.choices[0].message.content == full[:full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == full[:full.index(stop)]


def test_seeded_sampling_equals_serving_run(client: openai.OpenAI, tiny_serving: Serving):
    request = dict(temperature=0.9, top_p=0.95, seed=1234)
    replies = [client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, **request)
               .choices[0].message.content for _ in range(2)]
    expected = _expected(tiny_serving, {"messages": MESSAGES, "max_new_tokens": 10, **request})["generated_text"]
    greedy = _expected(tiny_serving, {"messages": MESSAGES, "max_new_tokens": 10})["generated_text"]
    assert replies == [expected, expected] and expected != greedy


def test_thinking_switch_reaches_the_template(client: openai.OpenAI, tiny_serving: Serving):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    expected = _expected(tiny_serving, {"messages": MESSAGES, "max_new_tokens": 4, "enable_thinking": False})
    assert reply.usage.prompt_tokens == expected["token_summary"]["input"]
    assert reply.usage.prompt_tokens != _expected(tiny_serving, {"messages": MESSAGES, "max_new_tokens": 4}
                                                  )["token_summary"]["input"]


@pytest.mark.asyncio
async def test_async_client_concurrent(server: Server, tiny_serving: Serving):
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    prompts = [f"prompt number {i}" for i in range(8)]

    async def one(prompt: str) -> str:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6, stream=True)
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    texts = await asyncio.gather(*(one(p) for p in prompts))
    await aclient.close()
    assert list(texts) == [_expected(tiny_serving, {"messages": [{"role": "user", "content": p}],
                                                    "max_new_tokens": 6})["generated_text"] for p in prompts]


def test_models_and_default_model(client: openai.OpenAI, server: Server):
    assert [m.id for m in client.models.list()] == [MODEL]
    body = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).json()
    assert body["model"] == MODEL and body["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("request_", "param"), [
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 2}, "top_p"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs"),
    ({"stream": "yes"}, "stream"),
])
def test_bad_input_is_400_naming_the_field(server: Server, request_: dict, param: str):
    body = {"model": MODEL, "messages": MESSAGES, **request_}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_openai_client_raises_typed_errors(client: openai.OpenAI, server: Server):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be") as bad:  # the serving's InvalidInput,
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=0)  # named as the client did
    assert bad.value.status_code == 400 and bad.value.body["param"] == "max_tokens"
    assert "max_new_tokens" not in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="exceeds max_len") as bad:  # the prompt fits a smaller one
        client.completions.create(model=MODEL, prompt="hi", max_tokens=100_000)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert info.value.body["code"] == "model_not_found"
    assert httpx.post(f"{server.url}/v1/completions", content=b"{not json").status_code == 400


def test_a_huge_body_is_413(server: Server):
    huge = b'{"prompt": "' + b"x" * (33 << 20) + b'"}'
    assert httpx.post(f"{server.url}/v1/completions", content=huge, timeout=60).status_code == 413


def test_deadline_is_504(client: openai.OpenAI, server: Server):
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300,
                                       extra_body={"deadline": 0.05})
    assert info.value.status_code == 504 and info.value.body["code"] == "deadline_exceeded"


def test_deadline_mid_stream_ends_the_stream_with_an_error(tiny_ckpt: Path):
    # 4,000 tokens no early stop can end (min_tokens): more than 0.5 s on any machine, however fast
    long = text_generation.from_mlx4bit(tiny_ckpt, max_new_tokens=8, max_len=4096, max_batch=1)
    with Serving.start(long) as handle, serve(create_app({MODEL: handle})) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4000, stream=True,
                                                extra_body={"deadline": 0.5, "min_tokens": 4000})
        pieces = []
        with pytest.raises(openai.APIError, match="deadline"):
            for chunk in stream:  # headers were sent: the error arrives as the last event
                pieces.append(chunk.choices[0].delta.content or "")
        assert "".join(pieces)  # some text streamed before the deadline


def test_overloaded_is_503_with_retry_after(tiny_ckpt: Path):
    # 4,000 tokens (seconds even on the native CPU kernel): the first row still runs when the third
    # request arrives; leaving the streams cancels them.
    long = text_generation.from_mlx4bit(tiny_ckpt, max_new_tokens=8, max_len=4096, max_batch=1)
    with Serving.start(long, batch_size=1, max_queue=1) as handle, serve(create_app({MODEL: handle})) as url:
        body = {"prompt": "busy", "max_tokens": 4000, "min_tokens": 4000, "stream": True}
        with httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", "/v1/completions", json=body) as running:
                lines = running.iter_lines()  # kept: a dropped iterator would close the stream (a cancel)
                next(lines)  # admitted and generating: the one row of the batch
                with http.stream("POST", "/v1/completions", json=body) as queued:
                    assert queued.status_code == 200  # waits in the queue (max_queue 1)
                    refused = http.post("/v1/completions", json=body)
    long.close()
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "overloaded"


def test_api_key(server: Server):
    app = create_app({MODEL: server.handle}, api_key="s3cret")
    with serve(app) as url:
        anonymous = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.list()
        assert httpx.get(f"{url}/v1/models").status_code == 401
        keyed = openai.OpenAI(base_url=f"{url}/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in keyed.models.list()] == [MODEL]
        assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
