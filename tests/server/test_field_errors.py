"""A 400 names the field the client sent, through a real server: the max-tokens field it used
(``max_completion_tokens`` or ``max_tokens``), completions' ``logprobs`` (the count, mapped to the
serving's ``top_logprobs``), ``tools`` when the tools' schemas are what cannot fit; and a completions
``prompt`` list longer than :data:`MAX_PROMPTS` is refused before any of it is tokenized."""

from __future__ import annotations

import httpx
import pytest

from mlx_serving.server._requests import MAX_PROMPTS
from server_helpers import MODEL, Server

HI = [{"role": "user", "content": "hi"}]


def _error(server: Server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}/v1/{path}", json={"model": MODEL, **body}, timeout=120)
    assert response.status_code == 400, response.text
    return response.json()["error"]


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
def test_the_max_tokens_field_sent_is_named(server: Server, field: str):
    error = _error(server, "chat/completions", {"messages": HI, field: 10**6})
    assert error["param"] == field and field in error["message"], error
    assert _error(server, "chat/completions", {"messages": HI, field: -1})["param"] == field


def test_completions_logprobs_is_named(server: Server):
    error = _error(server, "completions", {"prompt": "hi", "logprobs": 50})
    assert error["param"] == "logprobs", error


def test_tools_that_cannot_fit_are_named(server: Server):
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {}}}}
             for i in range(10_000)]
    assert _error(server, "chat/completions", {"messages": HI, "tools": tools})["param"] == "tools"
    long = [{"role": "user", "content": "word " * 100_000}]  # the messages themselves do not fit
    assert _error(server, "chat/completions", {"messages": long, "tools": tools[:1]})["param"] == "messages"


def test_a_prompt_list_over_the_bound_is_refused_before_tokenizing(server: Server):
    before = server.handle.stats()
    error = _error(server, "completions", {"prompt": ["x"] * 100_000, "max_tokens": 1})
    assert error["param"] == "prompt" and str(MAX_PROMPTS) in error["message"], error
    assert server.handle.stats().rejected == before.rejected  # never reached the serving
    ok = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": ["x"] * 3, "max_tokens": 1})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 3
