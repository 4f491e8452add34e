"""UTF-8-safe streaming detokenization for byte-level BPE tokenizers.

Byte-level BPE (GPT-2 style, used by Qwen3) writes every byte 0..255 as one printable character;
a vocabulary token is a string of those characters, i.e. a byte string. The table built here maps
each id once to its bytes, so streaming is: look up bytes, feed them to an incremental UTF-8
decoder, return what it completes. The per-token cost depends only on that token, not on how much
text came before.

To equal ``tokenizers``' ``decode`` exactly, three rules from its behaviour are followed (and
checked by property tests): special tokens are dropped before decoding (so bytes on both sides
join); an added, non-special token (Qwen3's ``<think>``) ends the current byte run, which is then
decoded on its own (an incomplete character there becomes U+FFFD), and its text is appended as is;
ids without a token give nothing. Invalid bytes become U+FFFD with the "maximal subpart" rule,
which both Rust's ``String::from_utf8_lossy`` and Python's ``errors="replace"`` implement.
"""

from __future__ import annotations

import codecs
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ._errors import InvalidTokenIdError

_MAX_ID = 2**32 - 1  # token ids are u32 in tokenizers


def _byte_alphabet() -> dict[str, int]:
    """The byte-level alphabet: printable character -> byte (the GPT-2 ``bytes_to_unicode`` map:
    bytes that are printable Latin-1 keep their own character, the other 68 take 256, 257...)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + i): b for i, b in enumerate(others)})
    return alphabet


def _token_bytes(token: str, to_latin1: dict[int, str]) -> bytes:
    """Bytes of one vocabulary token; a token with a character outside the alphabet keeps its own
    UTF-8 bytes (as the ``tokenizers`` ByteLevel decoder does)."""
    mapped = token.translate(to_latin1)
    try:
        return mapped.encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


@dataclass(frozen=True)
class ByteTable:
    """Per-id pieces: ``bytes`` for vocabulary tokens, ``str`` for added non-special tokens,
    ``None`` for special tokens. Ids past the end have no token.

    ``texts``: per-id text of a piece that stands on its own (what ``StreamingDetokenizer.add``
    returns for that id while no partial character is pending, its per-token fast path): a
    vocabulary token whose bytes are complete, valid UTF-8 decoded (``b""`` -> ``""``), an added
    non-special token's text; None for the rest (a partial or invalid byte sequence, a special
    token). Empty when not built (every id then takes the general path)."""

    pieces: tuple[bytes | str | None, ...]
    texts: tuple[str | None, ...] = ()

    @classmethod
    def build(cls, vocab: Mapping[str, int], added: Mapping[int, tuple[str, bool]]) -> ByteTable:
        """``vocab``: model token -> id; ``added``: id -> (content, special)."""
        to_latin1 = {ord(c): chr(b) for c, b in _byte_alphabet().items()}
        size = max([*vocab.values(), *added.keys()], default=-1) + 1
        pieces: list[bytes | str | None] = [b""] * size
        for token, i in vocab.items():
            pieces[i] = _token_bytes(token, to_latin1)
        for i, (content, special) in added.items():
            pieces[i] = None if special else content
        return cls(tuple(pieces), tuple(_own_text(piece) for piece in pieces))


def _own_text(piece: bytes | str | None) -> str | None:
    """A piece's text when it stands on its own (see ``ByteTable.texts``), else None."""
    if type(piece) is bytes:
        try:
            return piece.decode("utf-8")
        except UnicodeDecodeError:
            return None
    return piece


class ByteTableSource(Protocol):
    """What ``StreamingDetokenizer`` needs from a tokenizer (``Tokenizer`` provides it)."""

    def byte_table(self) -> ByteTable: ...

    def special_token_strings(self) -> dict[int, str]: ...


def check_id(token_id: object) -> int:
    """``token_id`` as an int in 0..2**32-1, else ``InvalidTokenIdError``."""
    try:
        i = operator.index(token_id)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidTokenIdError(f"token id must be an int, got {type(token_id).__name__}") from None
    if not 0 <= i <= _MAX_ID:
        raise InvalidTokenIdError(f"token id {i} is outside 0..{_MAX_ID}")
    return i


class StreamingDetokenizer:
    """Turns generated ids into text one id at a time, one instance per request.

    ``add(id)`` returns the text that id completes (possibly ``""`` while a multi-byte character is
    still partial); ``finalize()`` flushes what is left (an incomplete character becomes U+FFFD).
    For any id sequence, ``"".join(add(i) for i in ids) + finalize()`` equals
    ``tokenizer.decode(ids, skip_special_tokens)``. Cost per ``add`` is O(bytes of that token).
    After ``finalize`` the instance is empty and can start a new sequence.

    Args:
        tokenizer: a ``Tokenizer`` (its byte table is built once, on first use, and shared).
        skip_special_tokens: drop special tokens (default, like ``decode``); if False, their text
            is kept.

    Raises:
        TokenizationError: the tokenizer's decoder is not byte-level BPE.
    """

    def __init__(self, tokenizer: ByteTableSource, skip_special_tokens: bool = True) -> None:
        table = tokenizer.byte_table()
        self._pieces, self._texts = table.pieces, table.texts
        self._specials = {} if skip_special_tokens else tokenizer.special_token_strings()
        self._pending = b""  # bytes of a character not complete yet (the incremental decoder's buffer)

    def add(self, token_id: int) -> str:
        """Text completed by ``token_id`` (``str``, possibly empty).

        Raises:
            InvalidTokenIdError: ``token_id`` is not an int in 0..2**32-1.
        """
        if not self._pending and type(token_id) is int and 0 <= token_id < len(self._texts):
            text = self._texts[token_id]  # the common case: a whole piece, nothing pending
            if text is not None:
                return text
        i = check_id(token_id)
        piece = self._pieces[i] if i < len(self._pieces) else b""
        if type(piece) is bytes:
            return self._decode(piece, final=False)
        if piece is None:
            if i not in self._specials:
                return ""
            piece = self._specials[i]
        return self._flush() + piece

    def finalize(self) -> str:
        """The rest of the text; an incomplete trailing character becomes U+FFFD."""
        return self._flush()

    def _decode(self, data: bytes, final: bool) -> str:
        """Incremental UTF-8 decoding with U+FFFD for invalid bytes (as ``codecs``' buffered
        incremental decoder: the bytes of an incomplete character wait for the next piece)."""
        data = self._pending + data
        text, used = codecs.utf_8_decode(data, "replace", final)
        self._pending = data[used:]
        return text

    def _flush(self) -> str:
        return self._decode(b"", final=True)
