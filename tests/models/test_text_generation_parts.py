"""Parts of the text-generation serving, without a scheduler: the transducer's timing and finish
reasons from typed events, the backend adapter, the byte table built with the serving, and the
offload predicate of preprocessing."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
from typing import Any

import pytest

from mlx_serving.models import text_generation
from mlx_serving.models.qwen3 import Engine, FinishReason, SamplingParams, State
from mlx_serving.models.text_generation import GenerationOptions, TokenEvent
from mlx_serving.models.text_generation._backend import GenerationBackend
from mlx_serving.models.text_generation._inputs import Prompt, RequestInfo, needs_thread
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
                         "timing": {"prefill_ms": 4.0, "decode_ms": 9.0, "total_ms": 13.0}}


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
    assert final["timing"] == {"prefill_ms": TIMES[0], "decode_ms": TIMES[hit] - TIMES[0], "total_ms": TIMES[hit]}
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
