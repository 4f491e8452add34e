"""Issue 26 (typed seams): every request key the text-generation serving validates is refused with
``InvalidInput`` whose ``param`` names that key (as the serving's input dict spells it), through
the caller-side preprocessing and through a real serving; tokenizer errors on the prompt name the
key the prompt came from and stay chained as ``__cause__``. The OpenAI spelling of ``param``:
tests/server/test_requests.py and test_openai_api.py; across a process pool: tests/pool/test_pool.py."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

from mlx_serving.models import text_generation
from mlx_serving.models.decoder.layers import State
from mlx_serving.models.text_generation import GenerationOptions
from mlx_serving.models.text_generation._inputs import max_bytes_per_token, preprocess
from mlx_serving.serving import InvalidInput, Serving
from mlx_serving.tokenization import InvalidTextError, Tokenizer

OPTS = GenerationOptions(max_new_tokens=4, max_len=128)
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.qwen3()


def _text(**keys: Any) -> dict[str, Any]:
    return {"text": "hi", **keys}


def _chat(**keys: Any) -> dict[str, Any]:
    return {"messages": HI, **keys}


# (input, param, a piece of the message): one row per check of the preprocessing.
BAD = [
    # sampling options (SamplingParams' own checks, blamed on the key that fails alone)
    (_text(max_new_tokens=0), "max_new_tokens", "max_new_tokens must be"),
    (_text(max_new_tokens=True), "max_new_tokens", "max_new_tokens must be"),
    (_text(temperature=-1), "temperature", "temperature must be"),
    (_text(top_p=2), "top_p", "top_p must be"),
    (_text(seed=-1), "seed", "seed must be"),
    (_text(top_k=-1), "top_k", "top_k must be"),
    (_text(min_p=2), "min_p", "min_p must be"),
    (_text(repetition_penalty=0), "repetition_penalty", "repetition_penalty must be"),
    (_text(presence_penalty=3), "presence_penalty", "presence_penalty must be"),
    (_text(frequency_penalty=-3), "frequency_penalty", "frequency_penalty must be"),
    (_text(min_tokens=9), "min_tokens", "min_tokens must be"),  # > the serving's max_new_tokens 4
    (_text(min_tokens=3, max_new_tokens=2), "min_tokens", "max_new_tokens=2"),
    (_text(logit_bias={"1": 500}), "logit_bias", "biases numbers in"),
    (_text(top_p=2, temperature=-1), "temperature", "temperature must be"),  # several: the one the message names
    (_text(logit_bias={"1": 500}, min_tokens=99), "logit_bias", "biases numbers in"),
    # the request module's checks
    (_text(logit_bias="x"), "logit_bias", "logit_bias must be an object"),
    (_text(logit_bias={"-1": 1}), "logit_bias", "logit_bias keys"),
    (_text(logit_bias={1: 1, "1": 2}), "logit_bias", "twice"),
    (_text(logprobs="yes"), "logprobs", "logprobs must be"),
    (_text(top_logprobs=2), "top_logprobs", "needs logprobs"),
    (_text(logprobs=True, top_logprobs=99), "top_logprobs", "top_logprobs must be"),
    (_text(n=0), "n", "n must be"),
    (_text(n=True), "n", "n must be"),
    (_text(priority=1.5), "priority", "priority must be"),
    (_text(ignore_eos="yes"), "ignore_eos", "ignore_eos must be"),
    (_text(stop_token_ids="x"), "stop_token_ids", "stop_token_ids must be"),
    (_text(stop_token_ids=[-1]), "stop_token_ids", "is not a token id"),
    (_text(parallel_tool_calls="no"), "parallel_tool_calls", "parallel_tool_calls must be"),
    (_text(include_stop_str_in_output="yes"), "include_stop_str_in_output", "include_stop_str_in_output must be"),
    (_text(response_format={"type": "xml"}), "response_format", "response_format.type"),
    (_text(response_format=5), "response_format", "response_format must be an object"),
    (_text(response_format={"type": "text", "x": 1}), "response_format", "unknown key"),
    (_text(response_format={"type": "json_schema", "json_schema": {"schema": 5}}), "response_format",
     "response_format.json_schema"),
    (_text(response_format={"type": "regex", "regex": float("nan")}), "response_format", "JSON data"),
    # stop strings
    (_text(stop=[""]), "stop", "non-empty strings"),
    (_text(stop=5), "stop", "stop must be"),
    (_text(stop=["x"] * 17), "stop", "at most 16"),
    # chat-only keys, tools and tool_choice
    (_text(enable_thinking=True), "enable_thinking", "chat inputs only"),
    (_chat(enable_thinking="yes"), "enable_thinking", "enable_thinking must be"),
    (_text(tools=[TOOL]), "tools", "chat inputs only"),
    (_chat(tools="x"), "tools", "tools must be a list"),
    (_chat(tools=[{"f": {1: 2}}]), "tools", "object keys must be strings"),
    (_chat(tools=[{"type": "function"}], tool_choice="required"), "tools", "needs a function name"),
    (_chat(tools=[{"function": {"name": "f", "parameters": 5}}], tool_choice="required"), "tools",
     "parameters must be"),
    (_text(tool_choice="auto"), "tool_choice", "chat inputs only"),
    (_chat(tool_choice="required"), "tool_choice", "needs 'tools'"),
    (_chat(tools=[TOOL], tool_choice="sometimes"), "tool_choice", "tool_choice must be"),
    (_chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice",
     "not in 'tools'"),
    (_chat(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}), "tool_choice",
     "cannot be combined"),
    # the prompt
    ({"text": 5}, "text", "text must be a non-empty string"),
    ({"text": ""}, "text", "text must be a non-empty string"),
    ({"text": "a\ud800"}, "text", "lone surrogate"),  # the tokenizer's InvalidTextError
    ({"messages": []}, "messages", "messages must be"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "'role' must be"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "'content' must be"),
    ({"messages": [{"role": "user", "content": "x", "mood": 1}]}, "messages", "unknown keys"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages", "assistant messages only"),
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages", "lone surrogate"),
    # the prompt's length: the prompt, or the request's max_new_tokens when a smaller one would fit
    ({"text": "x" * 2000}, "text", "exceeds max_len"),  # 250 tokens
    ({"text": "x" * 1000, "min_tokens": 4}, "min_tokens", "lower min_tokens to at most 3"),  # 125 tokens
    (_text(truncate_prompt_tokens=0), "truncate_prompt_tokens", "-1 or an integer >= 1"),
    (_text(truncate_prompt_tokens=-2), "truncate_prompt_tokens", "-1 or an integer >= 1"),
    (_text(truncate_prompt_tokens="5"), "truncate_prompt_tokens", "-1 or an integer >= 1"),
    ({"text": "x" * 100_000}, "text", "refused before tokenizing"),
    ({"messages": [{"role": "user", "content": "x" * 100_000}]}, "messages", "refused before tokenizing"),
    (_text(max_new_tokens=200), "max_new_tokens", "exceeds max_len"),
    (_chat(max_new_tokens=127), "max_new_tokens", "exceeds max_len"),
    ({"text": "x" * 1000, "max_new_tokens": 5}, "max_new_tokens", "exceeds max_len"),
    # the input's shape
    (_text(mood=1), "mood", "unknown input keys"),
]

NO_PARAM = [
    ([], "empty input list"),
    (5, "expected a string or a dict"),
    ({"text": "a", "messages": HI}, "exactly one of"),
    ({"max_new_tokens": 3}, "exactly one of"),
]


@pytest.mark.parametrize(("input", "param", "match"), BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_each_bad_key_is_invalid_input_naming_it(tok: Tokenizer, input: Any, param: str, match: str) -> None:
    with pytest.raises(InvalidInput, match=match) as info:
        preprocess(input, tok, OPTS, max_bytes_per_token(tok))
    assert info.value.param == param, str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(("input", "match"), NO_PARAM)
def test_inputs_faulting_no_single_key_have_no_param(tok: Tokenizer, input: Any, match: str) -> None:
    with pytest.raises(InvalidInput, match=match) as info:
        preprocess(input, tok, OPTS)
    assert info.value.param is None


def test_a_list_names_the_item_and_keeps_the_param(tok: Tokenizer) -> None:
    with pytest.raises(InvalidInput, match=r"^input 1: top_p must be") as info:
        preprocess([{"text": "a"}, {"text": "b", "top_p": 2}], tok, OPTS)
    assert info.value.param == "top_p"
    with pytest.raises(InvalidInput, match=r"^input 0: .*lone surrogate") as info:
        preprocess(["a\ud800", "b"], tok, OPTS)
    assert info.value.param == "text" and isinstance(info.value.__cause__, InvalidTextError)


def test_tokenizer_errors_are_chained(tok: Tokenizer) -> None:
    with pytest.raises(InvalidInput) as info:
        preprocess({"messages": [{"role": "user", "content": "a\ud800"}]}, tok, OPTS)
    assert isinstance(info.value.__cause__, InvalidTextError)


def test_a_chat_serving_blames_text_for_its_text_prompts(tok: Tokenizer) -> None:
    chat = GenerationOptions(max_new_tokens=4, max_len=128, chat=True)
    with pytest.raises(InvalidInput, match="lone surrogate") as info:
        preprocess("a\ud800", tok, chat)
    assert info.value.param == "text"
    with pytest.raises(InvalidInput, match="exceeds max_len") as info:
        preprocess("x" * 1000, tok, chat)
    assert info.value.param == "text"


def test_invalid_input_pickles_with_its_param() -> None:
    error = pickle.loads(pickle.dumps(InvalidInput("top_p must be a number in (0, 1], got 2", "top_p")))
    assert type(error) is InvalidInput and error.param == "top_p" and str(error).startswith("top_p must")
    assert pickle.loads(pickle.dumps(InvalidInput("no key"))).param is None


@pytest.fixture(scope="module")
def gen(tok: Tokenizer, tiny32: State) -> Serving:
    return text_generation.serving(tok, tiny32, max_new_tokens=4, max_len=128, max_batch=2)


@pytest.mark.parametrize(("input", "param"), [
    (_text(max_new_tokens=0), "max_new_tokens"),
    (_text(logit_bias={"x": 1}), "logit_bias"),
    ({"messages": []}, "messages"),
    ("a\ud800", "text"),
])
def test_a_serving_raises_invalid_input_in_the_caller(gen: Serving, input: Any, param: str) -> None:
    with pytest.raises(InvalidInput) as info:  # inline
        gen.run(input)
    assert info.value.param == param
    with gen.start(batch_timeout=0.01) as handle, pytest.raises(InvalidInput) as info:  # process mode
        Serving.batched_run(handle, input, deadline=60)
    assert info.value.param == param
