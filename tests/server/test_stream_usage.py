"""``stream_options.continuous_usage_stats`` (vLLM's; guidellm sends it): every chunk carries
``usage`` with the prompt's tokens and those generated so far, ending at the final usage; other
keys in ``stream_options`` are refused by name rather than dropped."""

from __future__ import annotations

import httpx
import openai
import pytest

from server_helpers import MODEL, Server


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_every_chunk_carries_the_usage_so_far(server: Server, kind: str):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    options = {"include_usage": True, "continuous_usage_stats": True}
    if kind == "chat":
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count"}],
                                                     max_tokens=6, stream=True, stream_options=options,
                                                     extra_body={"ignore_eos": True}))
    else:
        chunks = list(client.completions.create(model=MODEL, prompt="count", max_tokens=6, stream=True,
                                                stream_options=options, extra_body={"ignore_eos": True}))
    final = chunks[-1].usage
    assert final.completion_tokens == 6 and not chunks[-1].choices
    with_text = [c for c in chunks[:-1] if c.choices and (getattr(c.choices[0], "text", None)
                                                          or getattr(getattr(c.choices[0], "delta", None), "content", None))]
    assert with_text and all(c.usage is not None for c in chunks[:-1] if c.choices and c.choices[0].finish_reason is None
                             and c in with_text)
    so_far = [c.usage.completion_tokens for c in with_text]
    assert so_far == sorted(so_far) and 1 <= so_far[0] and so_far[-1] <= 6
    assert {c.usage.prompt_tokens for c in with_text} == {final.prompt_tokens}
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in with_text)


def test_without_the_option_chunks_carry_no_usage(server: Server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    chunks = list(client.completions.create(model=MODEL, prompt="count", max_tokens=3, stream=True))
    assert all(c.usage is None for c in chunks)


def test_unknown_stream_options_are_refused(server: Server):
    body = {"model": MODEL, "prompt": "x", "stream": True, "stream_options": {"include_usage": True, "bogus": 1}}
    response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"
