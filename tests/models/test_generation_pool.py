"""Issue 14 through a two-worker ServingPool (tiny seeded 4-bit checkpoint): requests using every
option give what a local serving gives, through run, stream and run_async / stream_async, and a
bad value raises ValueError naming it in the caller while the pool keeps serving. Kept to one pool
start (each worker loads the model)."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import pytest

from mlx_serving.models.text_generation import from_mlx4bit
from mlx_serving.serving import Serving, ServingPool

ALL_OPTIONS = {"text": "The pool says", "temperature": 0.9, "top_p": 0.95, "top_k": 20, "min_p": 0.01,
               "repetition_penalty": 1.1, "presence_penalty": 0.3, "frequency_penalty": 0.2, "logit_bias": {"11": 1.5},
               "min_tokens": 2, "seed": 5, "logprobs": True, "top_logprobs": 2, "n": 2, "priority": 3, "stop": "zzz"}
SCRIPT = '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
TOOL_REQUEST = {"messages": [{"role": "user", "content": "call f"}], "enable_thinking": True, "max_new_tokens": 40,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                "response_format": {"type": "grammar", "grammar": "start: " + json.dumps(SCRIPT)}}
JSON_REQUEST = {"text": "JSON:", "max_new_tokens": 40, "response_format": {"type": "json_object"}}


@pytest.fixture(scope="module")
def factory(tiny_ckpt):
    return functools.partial(from_mlx4bit, tiny_ckpt, max_new_tokens=6, max_len=192, max_batch=8)


def _strip(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Result entries without timing (and with tool-call ids dropped: they are random)."""
    out = []
    for r in result["results"]:
        r = {k: v for k, v in r.items() if k != "timing"}
        if "tool_calls" in r:
            r["tool_calls"] = [c["function"] for c in r["tool_calls"]]
        out.append(r)
    return out


def test_every_option_through_a_two_worker_pool(factory):
    requests = [ALL_OPTIONS, TOOL_REQUEST, JSON_REQUEST]
    local = factory()
    expected = [_strip(Serving.run(local, r)) for r in requests]
    assert len(expected[0]) == 2 and len(expected[0][0]["logprobs"]) == expected[0][0]["num_tokens"]
    assert expected[1][0]["finish_reason"] == "tool_calls" and expected[1][0]["reasoning_content"] == "hm"

    async def async_calls(pool: ServingPool) -> tuple[Any, list[Any]]:
        got = await pool.run_async(ALL_OPTIONS)
        stream = await pool.stream_async(ALL_OPTIONS)
        async with stream:
            return got, [item async for item in stream]

    with ServingPool(factory, workers=2) as pool:
        got = [_strip(pool.run(r)) for r in requests]
        streamed = list(pool.stream(ALL_OPTIONS))
        async_got, async_streamed = asyncio.run(async_calls(pool))
        with pytest.raises(ValueError, match="top_logprobs"):
            pool.run({**ALL_OPTIONS, "logprobs": False})
        with pytest.raises(ValueError, match="n must"):
            pool.run({**ALL_OPTIONS, "n": 17})
        after = _strip(pool.run(ALL_OPTIONS))
    assert got == expected and _strip(async_got) == expected[0] and after == expected[0]
    for items in (streamed, async_streamed):
        texts = {0: "", 1: ""}
        for item in items:
            texts[item["index"]] += item.get("content", "")
        assert [texts[0], texts[1]] == [r["generated_text"] for r in expected[0]]
