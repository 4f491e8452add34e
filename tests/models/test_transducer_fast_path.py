"""The transducer's per-token fast path (a row with no stop strings and no deltas gives its
detokenized pieces as they come) gives the same items as the general path, including multi-byte
characters split across tokens, list inputs, and rows of both kinds in one request."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_serving.models.generation import FinishReason
from mlx_serving.models.text_generation import TokenEvent
from mlx_serving.models.text_generation._inputs import RequestInfo, RowOutput
from mlx_serving.models.text_generation._stream import GenerationTransducer, collect
from mlx_serving.tokenization import StreamingDetokenizer, Tokenizer

NEVER = "\x00"  # a stop string that never appears: the general path, nothing held back


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.qwen3()


def _byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """``text`` as one single-byte token per UTF-8 byte (every multi-byte character split)."""
    pieces = tok.byte_table().pieces
    by_byte = {p[0]: i for i, p in enumerate(pieces) if isinstance(p, bytes) and len(p) == 1}
    return [by_byte[b] for b in text.encode()]


def _ids(tok: Tokenizer) -> list[int]:
    """Whole tokens, a split 4-byte emoji, an added token, a trailing incomplete character."""
    return [*tok.encode("Grüße, "), *_byte_ids(tok, "👩🏽‍🚀 ok"), 151667, *tok.encode(" é"),
            *_byte_ids(tok, "€")[:2]]


def _events(ids: list[int], last: FinishReason = FinishReason.LENGTH) -> list[TokenEvent]:
    return [TokenEvent(i, float(k + 1), last if k == len(ids) - 1 else None) for k, i in enumerate(ids)]


def _feed_rows(transducer: GenerationTransducer, rows: list[list[TokenEvent]]) -> tuple[list[Any], list[int]]:
    """Interleave the rows' events as a step loop would (row 0, row 1, ... per step)."""
    items: list[Any] = []
    stopped: list[int] = []
    for k in range(max(len(r) for r in rows)):
        for row, events in enumerate(rows):
            if k < len(events):
                items += transducer.feed(row, events[k])
                stopped += transducer.stop_rows()
    return items, stopped


def test_plain_row_items_are_the_detokenizer_pieces(tok: Tokenizer) -> None:
    ids = _ids(tok)
    detok = StreamingDetokenizer(tok)
    pieces = [detok.add(i) for i in ids]
    pieces[-1] += detok.finalize()
    info = RequestInfo(is_list=False, input_tokens=(2,), stops=((),))
    items, stopped = _feed_rows(GenerationTransducer(tok, info), [_events(ids)])
    assert stopped == []
    assert items[:-1] == [p for p in pieces if p]
    assert "".join(items[:-1]) == tok.decode(ids) and items[-1]["num_tokens"] == len(ids)
    assert "" in pieces and items[-2].endswith("\ufffd")  # split characters wait; the tail is flushed


def test_fast_and_general_paths_give_the_same_items(tok: Tokenizer) -> None:
    ids = _ids(tok)
    info = RequestInfo(is_list=True, input_tokens=(2, 2), stops=((), (NEVER,)))
    items, stopped = _feed_rows(GenerationTransducer(tok, info), [_events(ids), _events(ids)])
    fast = [it for i, it in items if i == 0]
    general = [it for i, it in items if i == 1]
    assert stopped == [] and fast == general
    assert [r["results"][0]["generated_text"] for r in collect(items, info)] == [tok.decode(ids)] * 2


def test_stop_string_across_tokens_beside_a_plain_row(tok: Tokenizer) -> None:
    plain = tok.encode(" alpha beta gamma")
    stopping = _byte_ids(tok, "one tw") + tok.encode("o three four")  # "two" spans byte tokens
    info = RequestInfo(is_list=True, input_tokens=(1, 1), stops=((), ("two",)))
    items, stopped = _feed_rows(GenerationTransducer(tok, info), [_events(plain), _events(stopping)])
    results = collect(items, info)
    assert stopped == [1]
    assert results[0]["results"][0]["generated_text"] == " alpha beta gamma"
    assert results[1]["results"][0]["generated_text"] == "one "
    assert results[1]["results"][0]["finish_reason"] == "stop"
    assert results[0]["results"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("stops", [(), ("two",)])
def test_collect_of_one_row_equals_the_general_collect(tok: Tokenizer, stops: tuple[str, ...]) -> None:
    ids = _byte_ids(tok, "one tw") + tok.encode("o three")
    single = RequestInfo(is_list=False, input_tokens=(1,), stops=(stops,), outputs=(RowOutput(),))
    items, _ = _feed_rows(GenerationTransducer(tok, single), [_events(ids)])
    as_list = RequestInfo(is_list=True, input_tokens=(1,), stops=(stops,), outputs=(RowOutput(),))
    result = collect(items, single)
    assert result == collect([(0, it) for it in items], as_list)[0]
    assert result["results"][0]["generated_text"] == ("one " if stops else "one two three")
