"""Completions ``echo`` (how lm-eval-harness scores a text: ``echo`` + ``logprobs`` + ``max_tokens``
0) and vLLM's ``prompt_logprobs`` over a real uvicorn server with the official ``openai`` client:
the prompt's tokens and log-probabilities equal the serving's ``prompt_logprobs``; echo with
generation, echo without logprobs, streamed echo."""

from __future__ import annotations

import httpx
import openai
import pytest

from mlx_serving import Serving

from server_helpers import MODEL, Server

PROMPT = "The capital of France is Paris."


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _prompt_entries(serving: Serving, k: int) -> list[dict]:
    return serving.run({"text": PROMPT, "max_new_tokens": 0, "prompt_logprobs": k})["results"][0]["prompt_logprobs"]


def test_echo_logprobs_max_tokens_0_scores_the_prompt(client: openai.OpenAI, tiny_serving: Serving):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0)
    choice, expected = reply.choices[0], _prompt_entries(tiny_serving, 2)
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.tokens == [e["token"] for e in expected] and "".join(lp.tokens) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [e["logprob"] for e in expected[1:]]
    assert all(x < 0 for x in lp.token_logprobs[1:])
    assert lp.top_logprobs[1:] == [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in expected[1:]]
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert reply.usage.prompt_tokens == len(expected) and reply.usage.completion_tokens == 0


def test_echo_with_generation(client: openai.OpenAI, tiny_serving: Serving):
    reply = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=0, max_tokens=4)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=0, max_tokens=4).choices[0]
    choice, expected = reply.choices[0], _prompt_entries(tiny_serving, 0)
    assert choice.text == PROMPT + plain.text and reply.usage.completion_tokens == 4
    lp = choice.logprobs
    assert lp.tokens == [e["token"] for e in expected] + plain.logprobs.tokens
    assert lp.token_logprobs == [None, *(e["logprob"] for e in expected[1:]), *plain.logprobs.token_logprobs]
    assert lp.text_offset[len(expected)] == len("".join(e["token"] for e in expected))


def test_echo_without_logprobs(client: openai.OpenAI):
    plain = client.completions.create(model=MODEL, prompt=[PROMPT, "Hi"], max_tokens=3)
    reply = client.completions.create(model=MODEL, prompt=[PROMPT, "Hi"], echo=True, max_tokens=3)
    assert [c.text for c in reply.choices] == [PROMPT + plain.choices[0].text, "Hi" + plain.choices[1].text]
    assert all(c.logprobs is None for c in reply.choices)
    only = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=0).choices[0]
    assert only.text == PROMPT and only.logprobs is None and only.finish_reason == "length"


def test_streamed_echo_sends_the_prompt_first(client: openai.OpenAI):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3).choices[0]
    chunks = [c for c in client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=3,
                                                    stream=True) if c.choices]
    assert chunks[0].choices[0].text == PROMPT
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == whole.logprobs.tokens and offsets == whole.logprobs.text_offset


def test_vllm_prompt_logprobs_field(server: Server, tiny_serving: Serving):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 1}
    choice = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    expected = _prompt_entries(tiny_serving, 1)
    assert choice["text"] != PROMPT and choice["prompt_logprobs"][0] is None
    for got, e in zip(choice["prompt_logprobs"][1:], expected[1:]):
        assert next(iter(got)) == str(e["token_id"])  # the prompt's token first
        assert got[str(e["token_id"])]["logprob"] == e["logprob"]
        top = e["top_logprobs"][0]
        assert got[str(top["token_id"])] == {"logprob": top["logprob"], "rank": 1, "decoded_token": top["token"]}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1, "prompt_logprobs": 0}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=60).json()
    rendered = tiny_serving.run({"messages": chat["messages"], "max_new_tokens": 1, "prompt_logprobs": 0})
    expected = rendered["results"][0]["prompt_logprobs"]
    assert len(reply["prompt_logprobs"]) == len(expected) == reply["usage"]["prompt_tokens"]
    assert [next(iter(d)) for d in reply["prompt_logprobs"][1:]] == [str(e["token_id"]) for e in expected[1:]]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "prompt_logprobs": 99}, "prompt_logprobs"),
    ({"prompt": "x", "echo": True, "logprobs": 99}, "logprobs"),
])
def test_bad_echo_requests_name_the_field(server: Server, body: dict, param: str):
    reply = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param
