"""StreamingDetokenizer: the concatenation of its pieces equals Tokenizer.decode for any ids."""

from __future__ import annotations

import codecs

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_serving.tokenization import ByteTable, InvalidTokenIdError, StreamingDetokenizer, Tokenizer

VOCAB = 151669
MODEL_VOCAB = 151936


def _stream(tok: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = StreamingDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    return [detok.add(i) for i in ids] + [detok.finalize()]


@pytest.fixture(scope="module")
def id_pools(qwen3: Tokenizer) -> dict[str, list[int]]:
    """Ids by kind: single raw bytes (incl. UTF-8 lead and continuation bytes), tokens whose bytes
    are not valid UTF-8 alone (they split a character), added and special tokens."""
    pieces = qwen3.byte_table().pieces
    single = [i for i, p in enumerate(pieces) if isinstance(p, bytes) and len(p) == 1]
    partial = []
    for i, p in enumerate(pieces):
        if isinstance(p, bytes) and len(p) > 1:
            try:
                p.decode("utf-8")
            except UnicodeDecodeError:
                partial.append(i)
    added = [i for i, p in enumerate(pieces) if not isinstance(p, bytes)]
    return {"single": single, "partial": partial, "added": added}


def _ids_strategy(pools: dict[str, list[int]]) -> st.SearchStrategy[list[int]]:
    one = st.one_of(
        st.sampled_from(pools["single"]),
        st.sampled_from(pools["partial"]),
        st.sampled_from(pools["added"]),
        st.integers(0, VOCAB - 1),
        st.integers(VOCAB, MODEL_VOCAB - 1),
    )
    return st.lists(one, max_size=40)


def test_pools_cover_split_characters(id_pools) -> None:
    assert len(id_pools["single"]) == 256
    assert len(id_pools["partial"]) > 1000
    assert len(id_pools["added"]) == VOCAB - 151643


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_stream_equals_decode(qwen3: Tokenizer, id_pools, data) -> None:
    ids = data.draw(_ids_strategy(id_pools))
    assert "".join(_stream(qwen3, ids)) == qwen3.decode(ids)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_stream_equals_decode_keeping_specials(qwen3: Tokenizer, id_pools, data) -> None:
    ids = data.draw(_ids_strategy(id_pools))
    pieces = _stream(qwen3, ids, skip_special_tokens=False)
    assert "".join(pieces) == qwen3.decode(ids, skip_special_tokens=False)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40))
def test_stream_of_encoded_text_never_emits_half_characters(qwen3: Tokenizer, text: str) -> None:
    ids = qwen3.encode(text)
    pieces = _stream(qwen3, ids)
    assert "\ufffd" not in "".join(pieces) or "\ufffd" in text
    assert "".join(pieces) == qwen3.decode(ids)


def test_multibyte_character_split_over_byte_tokens(qwen3: Tokenizer, id_pools) -> None:
    byte_id = {qwen3.byte_table().pieces[i][0]: i for i in id_pools["single"]}
    ids = [byte_id[b] for b in "👩🏽‍🚀".encode()]
    pieces = _stream(qwen3, ids)
    assert pieces[:3] == ["", "", ""] and pieces[3] == "👩"
    assert "".join(pieces) == "👩🏽‍🚀"


def test_incomplete_tail_flushed_as_replacement(qwen3: Tokenizer, id_pools) -> None:
    byte_id = {qwen3.byte_table().pieces[i][0]: i for i in id_pools["single"]}
    ids = [byte_id[0xF0], byte_id[0x9F]]
    assert _stream(qwen3, ids) == ["", "", "\ufffd"] and qwen3.decode(ids) == "\ufffd"


def test_specials_dropped_and_oov_empty(qwen3: Tokenizer) -> None:
    ids = [151644, *qwen3.encode("hi"), 151667, 151645, 151700]
    assert "".join(_stream(qwen3, ids)) == "hi<think>"
    assert "".join(_stream(qwen3, ids, skip_special_tokens=False)) == "<|im_start|>hi<think><|im_end|>"


def test_reusable_after_finalize(qwen3: Tokenizer) -> None:
    detok = StreamingDetokenizer(qwen3)
    first = [detok.add(i) for i in qwen3.encode("one")] + [detok.finalize()]
    second = [detok.add(i) for i in qwen3.encode("two")] + [detok.finalize()]
    assert "".join(first) == "one" and "".join(second) == "two"


@pytest.mark.parametrize("bad", [-1, 2**32, "5", 2.0, None])
def test_bad_ids(qwen3: Tokenizer, bad) -> None:
    with pytest.raises(InvalidTokenIdError):
        StreamingDetokenizer(qwen3).add(bad)


class _GeneralPathOnly:
    """The same tokenizer's table without ``texts``: every id takes the general (byte) path."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok

    def byte_table(self) -> ByteTable:
        return ByteTable(self._tok.byte_table().pieces)

    def special_token_strings(self) -> dict[int, str]:
        return self._tok.special_token_strings()


def _reference_pieces(tok: Tokenizer, ids: list[int], skip_special_tokens: bool) -> list[str]:
    """Per-id pieces of the plain algorithm: every byte piece through codecs' incremental UTF-8
    decoder (errors="replace"); an added or kept special token flushes it, then adds its text."""
    pieces, specials = tok.byte_table().pieces, tok.special_token_strings()
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = []
    for i in ids:
        piece = pieces[i] if i < len(pieces) else b""
        if isinstance(piece, bytes):
            out.append(decoder.decode(piece))
        elif piece is None and (skip_special_tokens or i not in specials):
            out.append("")
        else:
            out.append(decoder.decode(b"", final=True) + (specials[i] if piece is None else piece))
            decoder.reset()
    return out + [decoder.decode(b"", final=True)]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), skip=st.booleans())
def test_each_piece_equals_the_byte_path(qwen3: Tokenizer, id_pools, data, skip: bool) -> None:
    """Piece by piece (not only joined), the per-id fast path equals the general byte path and
    the plain incremental-decoder algorithm: split characters, invalid bytes, added tokens."""
    ids = data.draw(_ids_strategy(id_pools))
    fast = _stream(qwen3, ids, skip_special_tokens=skip)
    general = _stream(_GeneralPathOnly(qwen3), ids, skip_special_tokens=skip)  # type: ignore[arg-type]
    assert fast == general == _reference_pieces(qwen3, ids, skip)


def test_texts_hold_whole_pieces_only(qwen3: Tokenizer, id_pools) -> None:
    table = qwen3.byte_table()
    assert len(table.texts) == len(table.pieces)
    assert all(table.texts[i] is None for i in id_pools["partial"])
    assert table.texts[qwen3.encode("hello")[0]] == "hello"
    assert table.texts[151667] == "<think>" and table.texts[151645] is None  # added vs special
