"""Parts of the text-generation serving, without a scheduler: the transducer's timing and finish
reasons from typed events, the backend adapter, the byte table built with the serving, the
offload predicate of preprocessing, and the isolation of one bad request (issue 12): every
request option checked in the caller, prompts that can never fit refused before tokenization,
tiny temperatures sampled safely."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
import time
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_serving.models import text_generation
from mlx_serving.models.generation import Engine, EngineConfig, FinishReason, SamplingParams, generate
from mlx_serving.models.decoder.layers import State
from mlx_serving.models.generation.sampling import MIN_TEMPERATURE, SamplerKind, sample_top_p
from mlx_serving.models.text_generation import GenerationOptions, TokenEvent
from mlx_serving.models.text_generation._backend import GenerationBackend
from mlx_serving.models.text_generation._inputs import (Prompt, RequestInfo, max_bytes_per_token, needs_thread,
                                                        preprocess)
from mlx_serving.models.text_generation._stream import GenerationTransducer, collect
from mlx_serving.serving import Serving
from mlx_serving.tokenization import ByteTable, StreamingDetokenizer, Tokenizer, data_path

TEXT = " alpha beta gamma delta epsilon"
TIMES = [4.0, 6.5, 9.0, 13.0, 20.0, 30.0]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.qwen3()


def _events(ids: list[int], last: FinishReason | None) -> list[TokenEvent]:
    reasons = [None] * (len(ids) - 1) + [last]
    return [TokenEvent(i, t, r) for i, t, r in zip(ids, TIMES, reasons)]


def _feed(transducer: GenerationTransducer, events: list[TokenEvent]) -> tuple[list[Any], list[int]]:
    items, stopped = [], []
    for ev in events:
        items += transducer.feed(0, ev)
        stopped += transducer.stop_rows()
    return items, stopped


def _info(stops: tuple[str, ...] = ()) -> RequestInfo:
    return RequestInfo(is_list=False, input_tokens=(3,), stops=(stops,))


def test_timing_from_elapsed_times_when_the_length_ends_the_row(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)[:4]
    items, stopped = _feed(GenerationTransducer(tok, _info()), _events(ids, FinishReason.LENGTH))
    assert stopped == [] and "".join(items[:-1]) == tok.decode(ids)
    assert items[-1] == {"finish_reason": "length", "num_tokens": 4, "token_summary": {"input": 3, "output": 4},
                         "timing": {"prefill_ms": 4.0, "decode_ms": 9.0, "total_ms": 13.0,
                                    "itl_ms": [2.5, 2.5, 4.0]}}


def test_stop_string_row_has_timing_up_to_the_token_that_stopped_it(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    hit = next(k for k in range(len(ids)) if "gamma" in tok.decode(ids[: k + 1]))
    assert 0 < hit < len(ids) - 1
    transducer = GenerationTransducer(tok, _info(("gamma",)))
    items, stopped = _feed(transducer, _events(ids, None))  # the backend's final event never comes
    final = items[-1]
    assert stopped == [0] and "".join(items[:-1]) == " alpha beta "
    assert final["finish_reason"] == "stop" and type(final["finish_reason"]) is str
    assert final["num_tokens"] == hit + 1
    assert final["timing"] == {"prefill_ms": TIMES[0], "decode_ms": TIMES[hit] - TIMES[0], "total_ms": TIMES[hit],
                               "itl_ms": [b - a for a, b in zip(TIMES[:hit], TIMES[1:hit + 1])]}
    result = collect(items, _info(("gamma",)))
    assert result["results"][0]["timing"] == final["timing"]
    assert json.loads(json.dumps(result)) == result


def test_eos_finish_and_profile_timing_off(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)[:3]
    items, _ = _feed(GenerationTransducer(tok, _info(), profile_timing=False), _events(ids, FinishReason.STOP))
    assert items[-1] == {"finish_reason": "stop", "num_tokens": 3, "token_summary": {"input": 3, "output": 3}}


def test_token_event_is_typed_and_crosses_processes_by_pickle() -> None:
    ev = TokenEvent(17, 2.5, FinishReason.LENGTH)
    assert pickle.loads(pickle.dumps(ev)) == ev
    assert ev.finish_reason == "length" and f"{ev.finish_reason}" == "length"
    assert json.dumps({"r": FinishReason.STOP}) == '{"r": "stop"}'
    with pytest.raises(AttributeError):
        ev.token_id = 3  # type: ignore[misc]


def test_backend_is_a_thin_adapter_over_the_engine(tok: Tokenizer, tiny32: State) -> None:
    backend = GenerationBackend(tiny32, GenerationOptions(max_new_tokens=4, max_len=64, max_batch=2))
    engine = backend.init("inline", None, 1)
    assert isinstance(engine, Engine)
    eos = tuple(sorted(tok.eos_token_ids))
    for round_ in range(2):  # the same row ids again: no state left from the first round
        rows = [(0, Prompt([1, 2, 3], SamplingParams(4, eos_token_ids=eos))), (1, Prompt([5] * 70, SamplingParams(4)))]
        rejected = backend.admit(engine, rows, 0)
        assert [(r, type(e)) for r, e in rejected] == [(1, ValueError)]
        out: list[tuple[int, TokenEvent, bool]] = []
        while backend.active(engine):
            out += backend.step(engine)
        assert [r for r, _, _ in out] == [0] * len(out) and 1 <= len(out) <= 4
        assert all(type(ev) is TokenEvent and done == (ev.finish_reason is not None) for _, ev, done in out)
        assert out[-1][2] and out[-1][1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert backend.free_slots(engine) == 2


def test_serving_builds_the_byte_table_once(tiny32: State, monkeypatch: pytest.MonkeyPatch) -> None:
    builds = []
    build = ByteTable.build.__func__  # type: ignore[attr-defined]
    monkeypatch.setattr(ByteTable, "build", classmethod(lambda cls, *a: builds.append(1) or build(cls, *a)))
    tok = Tokenizer.from_dir(data_path("tokenizer.json.gz").parent)  # a fresh instance, no table yet
    assert builds == []
    text_generation.serving(tok, tiny32, max_new_tokens=4, max_len=64)
    assert len(builds) == 1
    GenerationTransducer(tok, _info()).feed(0, TokenEvent(tok.encode("hi")[0], 1.0))
    StreamingDetokenizer(tok)
    text_generation.serving(tok, tiny32, max_new_tokens=4, max_len=64)
    assert len(builds) == 1


@pytest.mark.parametrize("input, expected", [
    ("Hello", False),
    ({"text": "x" * 2_000, "max_new_tokens": 5}, False),
    ({"messages": [{"role": "user", "content": "Hi"}] * 10}, False),
    ("x" * 3_100, True),
    ({"text": "x" * 3_100}, True),
    ([{"text": "x" * 1_000}] * 3 + ["x" * 200], True),  # a list input: the sum
    ([{"text": "x" * 1_000}] * 2, False),
    ({"messages": [{"role": "user", "content": "Hi"}] * 60}, True),  # per-message templating
    ({"messages": [{"role": "user", "content": "Hi"}], "tools": [{"description": "d" * 3_000}]}, True),
    (42, False), (None, False), ([], False),
])
def test_needs_thread(input: Any, expected: bool) -> None:
    assert needs_thread(input) is expected


def test_needs_thread_walks_a_bounded_part_of_huge_inputs() -> None:
    assert needs_thread([""] * 10_000_000)  # returns after ~3,000 items, not ten million
    deep: Any = "x"
    for _ in range(100_000):
        deep = [deep]
    assert needs_thread(deep)  # no RecursionError


def test_async_callers_tokenize_long_inputs_off_the_event_loop(
        tok: Tokenizer, tiny32: State, monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[int] = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, **kw: threads.append(threading.get_ident()) or encode(text, **kw))
    gen = text_generation.serving(tok, tiny32, max_new_tokens=2, max_len=4096)

    async def main() -> int:
        await Serving.run_async(gen, "Hello")
        await Serving.run_async(gen, "word " * 700)  # 3,500 characters
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert threads[0] == loop_thread and threads[1] != loop_thread


# ---- isolation of one bad request (issue 12): every option checked in the caller ------------------

OPTS = GenerationOptions(max_new_tokens=4, max_len=128)
HI = [{"role": "user", "content": "hi"}]


def _deep(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"k": [value]}
    return value


@pytest.mark.parametrize("bad, match", [
    ({"text": "hi", "seed": 2**64}, r"seed .*\[0, 2\*\*64\)"),
    ({"text": "hi", "seed": True}, "seed"),
    ({"text": "hi", "seed": 1.5}, "seed"),
    ({"text": "hi", "seed": float("nan")}, "seed"),
    ({"text": "hi", "seed": {"a": 1}}, "seed"),
    ({"text": "hi", "seed": "abc"}, "seed"),
    ({"text": "hi", "temperature": 10**400}, "temperature"),  # was OverflowError
    ({"text": "hi", "temperature": True}, "temperature"),
    ({"text": "hi", "temperature": "0.5"}, "temperature"),
    ({"text": "hi", "top_p": True}, "top_p"),
    ({"text": "hi", "top_p": float("nan")}, "top_p"),
    ({"text": "hi", "top_p": [0.5]}, "top_p"),
    ({"text": "hi", "max_new_tokens": True}, "max_new_tokens"),
    ({"text": "hi", "max_new_tokens": 2.0}, "max_new_tokens"),
    ({"text": "hi", "max_new_tokens": 10**5000}, "max_new_tokens"),  # not "Exceeds the limit (4300 digits)"
    ({"text": "hi", "stop": 5}, "stop must be a string or a list"),  # was TypeError
    ({"text": "hi", "stop": {"a": 1}}, "stop must be a string or a list"),  # was accepted (its keys)
    ({"text": "hi", "stop": b"ab"}, "stop must be a string or a list"),
    ({"text": "hi", "stop": [1]}, "stop must be a string or a list"),
    ({"text": "hi", "stop": ["a", ""]}, "stop strings"),
    ({"text": "hi", "stop": ["s"] * 17}, "at most 16"),
    ({"text": "hi", "stop": "x" * 257}, "at most 256 characters"),
    ({"messages": HI, "enable_thinking": "yes"}, "enable_thinking"),
    ({"messages": HI, "enable_thinking": 1}, "enable_thinking"),
    ({"text": "hi", "enable_thinking": False}, "'enable_thinking' applies to chat inputs only"),
    ({"messages": HI, "tools": "x"}, "tools must be a list"),
    ({"messages": HI, "tools": [1]}, "tools must be a list"),
    ({"messages": HI, "tools": {"a": 1}}, "tools must be a list"),
    ({"messages": HI, "tools": [_deep(40)]}, "'tools' nests deeper than 32"),  # was RecursionError
    ({"messages": HI, "tools": [{1: "x"}]}, "tools must be a list of tool objects"),
    ({"messages": HI, "tools": [{"f": {1: "x"}}]}, "'tools': object keys must be strings"),
    ({"messages": HI, "tools": [{"f": b"x"}]}, "'tools' must hold JSON values"),
    ({"text": "hi", "tools": []}, "'tools' applies to chat inputs only"),
    ({"messages": [{"role": "hacker", "content": "hi"}]}, r"messages\[0\]: 'role' must be one of"),  # was dropped
    ({"messages": [{"content": "hi"}]}, r"messages\[0\]: 'role'"),
    ({"messages": [{"role": 1, "content": "hi"}]}, "'role'"),
    ({"messages": [*HI, {"role": "user", "content": None}]}, r"messages\[1\]: 'content' must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, "'content' must be a string"),
    ({"messages": [{"role": "user", "content": "x", "junk": 1}]}, r"unknown keys \['junk'\]"),
    ({"messages": [{"role": "user", "content": "x", "reasoning_content": 3}]}, "'reasoning_content' must be a string"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "'tool_calls' are for assistant messages"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": "f"}]}, "'tool_calls' must be a list"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": 1}}]}]},
     r"tool_calls\[0\]: 'name' must be a string"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": 3}]}]},
     "'arguments' must be a JSON string or an object"),
    ({"messages": None}, "messages must be a non-empty list"),  # was KeyError('text')
    ({"messages": ["hi"]}, r"messages\[0\] must be a"),
    ({"text": b"hi"}, "text must be a non-empty string"),
    ({"text": "hi", 1: 2, "zz": 3}, r"unknown input keys \['zz', 1\]"),  # mixed key types: was TypeError
    (["ok", {"text": "hi", "seed": -1}], "input 1: seed"),
])
def test_every_request_option_is_checked_in_the_caller(tok: Tokenizer, bad: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        preprocess(bad, tok, OPTS, max_bytes_per_token(tok))


def test_good_options_and_null_defaults_pass(tok: Tokenizer) -> None:
    ok = [
        {"text": "hi", "seed": 2**64 - 1, "temperature": 0.7, "top_p": 1, "max_new_tokens": 3, "stop": ["a", "b"]},
        {"text": "hi", "seed": None, "temperature": None, "top_p": None, "max_new_tokens": None, "stop": None},
        {"messages": [{"role": "system", "content": "s"}, *HI,
                      {"role": "assistant", "content": "", "reasoning_content": "r",
                       "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                                      {"name": "g", "arguments": {"x": [1, 2.5, None, True]}}]},
                      {"role": "tool", "content": "42", "tool_call_id": "1", "name": "f"}],
         "tools": [{"type": "function", "function": {"name": "f", "parameters": _deep(10)}}], "enable_thinking": False},
    ]
    batch, info = preprocess(ok, tok, GenerationOptions(max_new_tokens=4, max_len=1024), max_bytes_per_token(tok))
    params = [row.params for row in batch.rows()]
    assert params[1] == SamplingParams(4, 0.0, 1.0, None, params[1].eos_token_ids)  # null = the serving's default
    assert info.stops == (("a", "b"), (), ())


def test_python_sequences_are_taken_as_json_arrays(tok: Tokenizer) -> None:
    """The schema decodes as msgspec converts: a tuple (or a set, for stop strings) is an array."""
    _, info = preprocess([{"text": "hi", "stop": ("a", "b")}, {"text": "hi", "stop": {"c"}},
                          {"messages": ({"role": "user", "content": "x"},)}], tok, OPTS, max_bytes_per_token(tok))
    assert info.stops == (("a", "b"), ("c",), ())


def test_bad_options_fail_in_the_caller_of_a_started_serving(tok: Tokenizer, tiny32: State) -> None:
    gen = text_generation.serving(tok, tiny32, max_new_tokens=3, max_len=64, max_batch=2)
    with gen.start() as h:
        good = h.run("Hello")["results"][0]
        for bad in ({"text": "hi", "seed": 2**64}, {"text": "hi", "stop": 5}, {"text": "hi", "temperature": 10**400},
                    {"messages": [{"role": "x", "content": ""}]}):
            with pytest.raises(ValueError):
                h.run(bad)
        again = h.run("Hello")["results"][0]
        assert (again["generated_text"], again["num_tokens"]) == (good["generated_text"], good["num_tokens"])
        stats = h.stats()
    assert (stats.failed, stats.queued, stats.running) == (0, 0, 0)


# ---- a prompt that can never fit is refused before it is tokenized ------------------------------

def test_max_bytes_per_token_of_qwen3(tok: Tokenizer) -> None:
    longest = max(len(p) for p in tok.byte_table().pieces if type(p) is bytes)
    assert longest == 128  # a run of 128 spaces is one token
    assert max_bytes_per_token(tok) == 128 * 3  # x3: NFC may shrink text 3x before it is split


def test_a_huge_prompt_is_refused_without_tokenizing(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append("encode") or [1])
    monkeypatch.setattr(tok, "encode_chat", lambda *a, **k: calls.append("encode_chat") or [1])
    per_token = max_bytes_per_token(tok)
    huge = "a b " * 250_000  # 1 MB: tokenizing it takes ~0.8 s
    for bad in (huge, {"text": huge}, {"messages": [{"role": "user", "content": huge}]},
                [{"text": "x" * 2_000_000}, "hi"], {"messages": HI, "tools": [{"description": huge}]},
                {"messages": [*HI, {"role": "assistant", "content": "ok"}, {"role": "user", "content": huge}]}):
        start = time.thread_time()  # CPU time: a busy machine cannot fail it
        with pytest.raises(ValueError, match="exceeds max_len 128.*refused before tokenizing"):
            preprocess(bad, tok, OPTS, per_token)
        assert time.thread_time() - start < 0.05  # measured 0.01-0.5 ms (2.4 ms with 1 MB of tools JSON)
    assert calls == []


def test_the_prompt_bound_refuses_nothing_that_fits(tok: Tokenizer) -> None:
    per_token = max_bytes_per_token(tok)
    room = OPTS.max_len - OPTS.max_new_tokens
    spaces = "x" + " " * (128 * (room - 2))  # room - 1 tokens of up to 128 bytes: fits
    assert len(tok.encode(spaces)) <= room
    preprocess(spaces, tok, OPTS, per_token)
    # Earlier assistant turns lose their reasoning in Qwen3's template: the messages' strings are
    # far over the bound, the rendered prompt is not, so the request is tokenized and accepted.
    thought = "<think>" + "why " * 50_000 + "</think>ok"
    messages = [*HI, {"role": "assistant", "content": thought}, {"role": "user", "content": "and?"}]
    batch, info = preprocess({"messages": messages}, tok, OPTS, per_token)
    assert info.input_tokens[0] == len(tok.encode_chat(messages)) < room


def test_a_huge_prompt_is_refused_fast_by_a_started_serving(tok: Tokenizer, tiny32: State) -> None:
    # "Fast" = without tokenizing the prompt: the refusal's CPU time in the caller's thread (best
    # of 3, so a busy machine's stall cannot fail it) stays far below what tokenizing costs here.
    gen = text_generation.serving(tok, tiny32, max_new_tokens=3, max_len=64)
    prompt = "word " * 200_000
    start = time.thread_time()
    tok.encode(prompt)
    tokenizing = time.thread_time() - start
    refusals = []
    for _ in range(3):
        start = time.thread_time()
        with pytest.raises(ValueError, match="max_len 64"):
            Serving.run(gen, prompt)
        refusals.append(time.thread_time() - start)
    assert min(refusals) < tokenizing / 4


# ---- sampling numerics ------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 5e-324, 9.99e-6])
def test_a_tiny_temperature_gives_the_greedy_tokens(tiny32: State, temperature: float) -> None:
    prompt = [7985, 825, 11652, 911, 468, 97772, 13]
    greedy, _ = generate(prompt, tiny32, max_new_tokens=8, eos_token_ids=[])
    tiny, _ = generate(prompt, tiny32, max_new_tokens=8, eos_token_ids=[], temperature=temperature, seed=3)
    assert tiny == greedy and 151935 not in tiny  # was [151935] * 8 for 1e-38
    assert SamplingParams(temperature=temperature).kind is SamplerKind.GREEDY
    assert SamplingParams(temperature=MIN_TEMPERATURE).kind is SamplerKind.TOP_P


def test_sample_top_p_is_safe_at_the_extremes() -> None:
    logits = mx.array(np.random.default_rng(0).normal(size=(3, 1000)).astype(np.float32) * 5)
    best = np.array(mx.argmax(logits, axis=-1))
    ones, u = mx.ones((3,)), mx.array([0.0, 0.5, 0.999])
    cold = sample_top_p(logits, mx.full((3,), MIN_TEMPERATURE), ones, u)
    assert (np.array(cold) == best).all()
    narrow = sample_top_p(logits, ones, mx.array([1e-300, 1e-300, 1e-300]), u)  # 0 in float32
    assert (np.array(narrow) == best).all()  # the nucleus keeps the most probable token


def test_engine_add_refuses_bad_rows_and_queues_nothing(tiny32: State) -> None:
    engine = Engine(tiny32, EngineConfig.of(max_batch=1, max_len=32))
    for ids, params, match in (([1.5, 2.0], SamplingParams(2), "integer"), ([True], SamplingParams(2), "integer"),
                               (["a"], SamplingParams(2), "integer"), ([2**70], SamplingParams(2), "token ids"),
                               ([[1, 2], [3]], SamplingParams(2), "prompt_ids"),
                               ([1, 2], {"max_new_tokens": 2}, "SamplingParams"), ([1, 2], None, "SamplingParams")):
        with pytest.raises(ValueError, match=match):
            engine.add(0, ids, params)  # type: ignore[arg-type]
    assert engine.num_active == 0
    engine.add(0, [1, 2], SamplingParams(2))
    assert engine.num_active == 1
