"""Issue 40 item 6 (lowering the context): ``max_new_tokens`` defaults that fit a smaller
``max_len`` (half of it at most), a request's default capped to what its prompt leaves, refusals
that say what to lower or raise, and ``truncate_prompt_tokens`` (vLLM's: the prompt's last N tokens).
Through the server: tests/server/test_context_fit.py; the command line: tests/models/test_cli.py."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_serving.models import text_generation
from mlx_serving.models.decoder.layers import State
from mlx_serving.models.text_generation import GenerationOptions
from mlx_serving.models.text_generation._inputs import Prompt, max_bytes_per_token, preprocess
from mlx_serving.serving import InvalidInput, Serving
from mlx_serving.tokenization import Tokenizer

OPTS = GenerationOptions(max_len=128)  # max_new_tokens: the default, 64 here
LONG = "x" * 1000  # 125 tokens of "xxxxxxxx" (Qwen3)
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.qwen3()


def _rows(tok: Tokenizer, input: Any, opts: GenerationOptions = OPTS) -> list[Prompt]:
    batch, _ = preprocess(input, tok, opts, max_bytes_per_token(tok))
    return list(batch.rows())


@pytest.mark.parametrize(("max_len", "default"), [(2048, 100), (256, 100), (128, 64), (64, 32), (3, 1), (2, 1)])
def test_the_default_max_new_tokens_is_at_most_half_of_max_len(max_len: int, default: int) -> None:
    assert GenerationOptions(max_len=max_len).max_new_tokens == default


def test_a_given_max_new_tokens_that_leaves_no_room_is_refused() -> None:
    with pytest.raises(ValueError, match="max_new_tokens 100 must be < max_len 64.*leave max_new_tokens out"):
        GenerationOptions(max_len=64, max_new_tokens=100)


def test_a_request_without_max_new_tokens_gets_the_default_capped_to_what_fits(tok: Tokenizer) -> None:
    assert len(tok.encode(LONG)) == 125
    [short] = _rows(tok, "hi")
    assert short.params.max_new_tokens == 64  # the serving's default where it fits
    [long] = _rows(tok, LONG)
    assert long.params.max_new_tokens == 3 and len(long.ids) == 125  # 128 - 125
    [given] = _rows(tok, {"text": LONG, "max_new_tokens": 2})
    assert given.params.max_new_tokens == 2


def test_an_explicit_max_new_tokens_too_large_names_it_and_the_most_that_fits(tok: Tokenizer) -> None:
    with pytest.raises(InvalidInput, match=r"prompt of 125 tokens \+ max_new_tokens 10 = 135 exceeds max_len 128: "
                                           r"lower max_new_tokens to at most 3, or raise max_len \(--max-len") as info:
        _rows(tok, {"text": LONG, "max_new_tokens": 10})
    assert info.value.param == "max_new_tokens"


@pytest.mark.parametrize("input, param", [({"text": "x" * 1024}, "text"),
                                          ({"messages": [{"role": "user", "content": "x" * 2000}]}, "messages")])
def test_a_prompt_over_max_len_names_the_prompt_truncation_and_max_len(tok: Tokenizer, input: Any, param: str) -> None:
    with pytest.raises(InvalidInput, match=r"exceeds max_len 128 \(at most 127 prompt tokens fit.*set "
                                           r"truncate_prompt_tokens.*raise max_len \(--max-len of mlx-serving") as info:
        _rows(tok, input)
    assert info.value.param == param


def test_truncate_prompt_tokens_keeps_the_last_tokens(tok: Tokenizer) -> None:
    text = "one two three four five six seven eight nine ten " * 30  # 300 tokens: over max_len
    ids = tok.encode(text)
    [row] = _rows(tok, {"text": text, "truncate_prompt_tokens": 7})
    assert row.ids == ids[-7:] and row.params.max_new_tokens == 64
    [row] = _rows(tok, {"text": text, "truncate_prompt_tokens": -1})  # room for the default 64
    assert row.ids == ids[-64:] and row.params.max_new_tokens == 64
    [row] = _rows(tok, {"text": text, "truncate_prompt_tokens": -1, "max_new_tokens": 100})
    assert row.ids == ids[-28:] and row.params.max_new_tokens == 100
    [row] = _rows(tok, {"text": "hi", "truncate_prompt_tokens": 7})  # shorter: kept whole
    assert row.ids == tok.encode("hi")
    messages = [{"role": "user", "content": text}]
    [row] = _rows(tok, {"messages": messages, "truncate_prompt_tokens": 20})  # the rendered prompt's last 20
    assert row.ids == tok.encode_chat(messages)[-20:]
    with pytest.raises(InvalidInput, match="lower max_new_tokens to at most 28") as info:  # still must fit
        _rows(tok, {"text": text, "truncate_prompt_tokens": 100, "max_new_tokens": 100})
    assert info.value.param == "max_new_tokens"


def test_truncation_lifts_the_bound_refusing_huge_prompts_before_tokenizing(tok: Tokenizer) -> None:
    huge = "x" * 200_000
    with pytest.raises(InvalidInput, match="refused before tokenizing.*set truncate_prompt_tokens"):
        _rows(tok, huge)
    [row] = _rows(tok, {"text": huge, "truncate_prompt_tokens": -1})
    assert len(row.ids) == 64


def test_a_serving_generates_to_the_capped_default_and_from_the_truncated_prompt(
        tok: Tokenizer, tiny32: State) -> None:
    gen = text_generation.serving(tok, tiny32, max_len=64)  # max_new_tokens: 32
    prompt = "x" * 400  # 50 tokens: 14 new ones fit
    [result] = gen.run({"text": prompt, "ignore_eos": True})["results"]
    assert (result["finish_reason"], result["num_tokens"], result["token_summary"]["input"]) == ("length", 14, 50)
    assert tok.encode("x" * 80) == tok.encode("x" * 1000)[-10:]
    truncated = gen.run({"text": "x" * 1000, "truncate_prompt_tokens": 10, "max_new_tokens": 5})["results"][0]
    assert truncated["token_summary"]["input"] == 10
    assert truncated["generated_text"] == gen.run({"text": "x" * 80, "max_new_tokens": 5})["results"][0]["generated_text"]
    with gen.start(batch_timeout=0.01) as handle, pytest.raises(InvalidInput) as info:  # process mode
        Serving.batched_run(handle, {"text": prompt, "max_new_tokens": 20}, deadline=60)
    assert info.value.param == "max_new_tokens" and "at most 14" in str(info.value)
