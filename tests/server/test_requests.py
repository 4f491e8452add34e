"""OpenAI bodies -> text-generation inputs, and serving errors -> OpenAI errors (no server needed)."""

from __future__ import annotations

import math

import pytest

from mlx_serving.serving import DeadlineExceeded, InvalidInput, ServingOverloaded
from mlx_serving.server._errors import APIError, from_exception
from mlx_serving.server._requests import chat_call, completion_call
from mlx_serving.server._responses import MIN_LOGPROB, StreamState, chat_logprobs, event


def test_chat_fields_map_to_the_input():
    call = chat_call({
        "model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]},
                                   {"role": "assistant", "content": None, "tool_calls": [{"function": {
                                       "name": "f", "arguments": "{}"}}]}],
        "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0.5, "top_k": -1, "min_p": 0.1, "seed": 3,
        "stop": ["x"], "logit_bias": {"12": 1.0}, "n": 2, "logprobs": True, "top_logprobs": 3,
        "response_format": {"type": "json_object"}, "tools": [{"type": "function"}], "tool_choice": "auto",
        "chat_template_kwargs": {"enable_thinking": False}, "stream": True, "stream_options": {"include_usage": True},
        "user": "ignored", "presence_penalty": None,
    })
    assert call.input == {
        "messages": [{"role": "system", "content": "ab"},
                     {"role": "assistant", "content": "",
                      "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}],
        "max_new_tokens": 7, "temperature": 0.5, "min_p": 0.1, "seed": 3, "stop": ["x"], "logit_bias": {"12": 1.0},
        "n": 2, "logprobs": True, "top_logprobs": 3, "response_format": {"type": "json_object"},
        "tools": [{"type": "function"}], "enable_thinking": False,
    }
    assert (call.stream, call.include_usage, call.n, call.prompts, call.deadline) == (True, True, 2, 1, None)


def test_defaults_stay_out_of_the_input():
    call = chat_call({"messages": [{"role": "user", "content": "hi"}], "n": 1, "response_format": {"type": "text"},
                      "tools": [{"type": "function"}], "tool_choice": "none", "logprobs": False})
    assert call.input == {"messages": [{"role": "user", "content": "hi"}]}


def test_completion_prompts_and_logprobs():
    call = completion_call({"prompt": ["a", "b"], "logprobs": 2, "max_tokens": 3, "best_of": 1, "deadline": 1.5})
    assert call.input == [{"text": p, "max_new_tokens": 3, "logprobs": True, "top_logprobs": 2} for p in "ab"]
    assert (call.prompts, call.deadline) == (2, 1.5)


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"foo": 1}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "deadline": -1}, "deadline"),
    ({"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
])
def test_malformed_chat_envelopes(body: dict, param: str):
    with pytest.raises(APIError) as info:
        chat_call(body)
    assert info.value.status == 400 and info.value.param == param


def test_max_new_tokens_is_named_as_the_request_named_it_wherever_a_message_says_it():
    """An over-long prompt blames the prompt and says to lower max_new_tokens: the server's message
    says the field the client sent (issue 40 item 6); so does an untyped ValueError's."""
    error = from_exception(InvalidInput("prompt of 9 tokens exceeds max_len 8 (with max_new_tokens 1)", "text"),
                           {"max_new_tokens": "max_completion_tokens"})
    assert (error.param, error.message) == ("prompt", "prompt of 9 tokens exceeds max_len 8 (with "
                                                      "max_completion_tokens 1)")
    assert from_exception(InvalidInput("no max_new_tokens here", None)).message == "no max_tokens here"
    assert from_exception(ValueError("max_new_tokens must be >= 1")).message == "max_tokens must be >= 1"


def test_truncate_prompt_tokens_passes_through():
    call = completion_call({"prompt": "hi", "truncate_prompt_tokens": 5})
    assert call.input == {"text": "hi", "truncate_prompt_tokens": 5}
    assert chat_call({"messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": -1}).input[
        "truncate_prompt_tokens"] == -1


def test_token_id_prompts_are_refused():
    with pytest.raises(APIError, match="token-id prompts"):
        completion_call({"prompt": [1, 2, 3]})


def test_serving_errors_map_to_statuses():
    bad = from_exception(InvalidInput("prompt of 9 tokens + max_new_tokens 400 = 409 exceeds max_len 320",
                                      "max_new_tokens"))
    assert (bad.status, bad.param, bad.message) == (400, "max_tokens", str(bad))
    assert from_exception(InvalidInput("input 1: 'text' must be a string", "text")).param == "prompt"
    assert from_exception(InvalidInput("bad", "enable_thinking")).param == "chat_template_kwargs"
    assert from_exception(InvalidInput("bad", "logit_bias")).param == "logit_bias"  # same name in OpenAI's API
    assert from_exception(InvalidInput("empty input list", None)).param is None
    plain = from_exception(ValueError("max_new_tokens must be an integer >= 1"))  # untyped: no param guessed
    assert (plain.status, plain.param) == (400, None)
    full = from_exception(ServingOverloaded("queue full"))
    assert full.status == 503 and full.headers == {"Retry-After": "1"}
    assert from_exception(DeadlineExceeded("late")).status == 504
    assert from_exception(RuntimeError("boom")).body()["error"]["type"] == "server_error"


def test_minus_infinity_logprobs_become_finite():
    entries = [{"token_id": 1, "token": "a", "logprob": -math.inf,
                "top_logprobs": [{"token_id": 1, "token": "a", "logprob": -math.inf}]}]
    out = chat_logprobs(entries)
    assert out[0]["logprob"] == MIN_LOGPROB and out[0]["top_logprobs"][0]["logprob"] == MIN_LOGPROB


def test_stream_items_of_n_completions_and_list_inputs():
    state = StreamState("completion", "m", is_list=True, n=2, choices=4)
    chunks = []
    for item in [(1, {"index": 1, "content": "x"}), (1, {"index": 1, "finish_reason": "length", "num_tokens": 1,
                                                         "token_summary": {"input": 3, "output": 1}})]:
        chunks += state.chunks(event(item, True, 2))
    assert '"index": 3' in chunks[0] and '"text": "x"' in chunks[0] and '"finish_reason": "length"' in chunks[1]
    assert list(state.finals) == [3] and not state.done


def test_an_app_needs_a_model():
    from mlx_serving.server import create_app

    with pytest.raises(ValueError, match="no model"):
        create_app({})
