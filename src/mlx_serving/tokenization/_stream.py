"""UTF-8-safe streaming detokenization for byte-level BPE and SentencePiece tokenizers.

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

SentencePiece vocabularies (Llama 2, Mistral: ``▁`` for a space, ``<0xXX>`` byte-fallback tokens)
are decoded by a ``tokenizers`` decoder chain, not byte by byte; ``SentencePieceDecoding`` holds
the rules of the chains supported (``sentencepiece_chain``) and ``StreamingDetokenizer``
follows them token by token (see that class).
"""

from __future__ import annotations

import codecs
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, SupportsIndex

from ._errors import InvalidTokenIdError

_MAX_ID = 2**32 - 1  # token ids are u32 in tokenizers
_SPACE = "\u2581"  # ▁, SentencePiece's space
#: A token ``tokenizers``' ByteFallback decoder reads as one byte: 6 bytes, ``<0x``, two
#: characters Rust's ``u8::from_str_radix(_, 16)`` accepts (it takes a ``+`` sign), ``>``.
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2}|\+[0-9A-Fa-f])>")


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
class SentencePieceDecoding:
    """How a SentencePiece decoder chain turns tokens into text, beyond each token's own text
    (``▁`` -> space, in ``ByteTable.pieces``).

    ``byte_ids``: ids of ``<0xXX>`` tokens when the chain has ByteFallback. ``tokenizers``'
    ByteFallback (decoders/byte_fallback.rs) decodes each run of consecutive byte tokens as a
    whole: its text if the run is valid UTF-8, else one U+FFFD per byte (not the maximal-subpart
    rule of byte-level BPE). Special tokens are dropped before the chain runs, so a skipped one
    does not end a run; any other token does.

    ``strip``: leading spaces the chain's ``Strip(" ", strip, 0)`` (after ``Fuse``) removes from
    the text of the whole decode (decoders/strip.rs).

    ``first_texts``: with ``Metaspace`` (prepend_scheme "first" or "always"), the text of an id
    when it is the first token decoded: every ``▁`` of token 0 of the chain is removed, not made a
    space (decoders/metaspace.rs ``decode_chain``); only ids whose first text differs are listed.
    """

    byte_ids: frozenset[int] = frozenset()
    strip: int = 0
    first_texts: Mapping[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Chain:
    """A supported SentencePiece decoder chain, parsed (see ``sentencepiece_chain``)."""

    metaspace_first: bool
    byte_fallback: bool
    strip: int


def _step_kind(step: Mapping[str, Any]) -> str:
    """A decoder step's role: "space" (``Replace("▁", " ")``, or a ``Metaspace`` whose
    prepend_scheme is "never"), "metaspace" (``Metaspace`` "first" / "always"), "bytes"
    (``ByteFallback``), "fuse", "strip" (``Strip(" ", n, 0)``), or "" for anything else."""
    kind = step.get("type")
    if kind == "Replace" and step.get("pattern") == {"String": _SPACE} and step.get("content") == " ":
        return "space"
    if kind == "Metaspace" and step.get("replacement") == _SPACE:
        return "space" if step.get("prepend_scheme") == "never" else "metaspace"
    if kind == "Strip" and step.get("content") == " " and step.get("stop") == 0:
        return "strip"
    simple: dict[object, str] = {"ByteFallback": "bytes", "Fuse": "fuse"}  # ``kind``: any JSON value
    return simple.get(kind, "")


def sentencepiece_chain(state: Mapping[str, Any]) -> _Chain | None:
    """The rules of a SentencePiece decoder (``tokenizers``' JSON state of ``Tokenizer.decoder``)
    when it is one ``StreamingDetokenizer`` follows exactly, else None: the steps, in this order,
    ``Replace("▁", " ")`` or ``Metaspace``; then optionally ``ByteFallback``; ``Fuse``; and
    ``Strip(" ", n, 0)`` (which needs ``Fuse`` before it: without it every token would be
    stripped). That is the chain transformers' LlamaConverter writes (Llama 2, Mistral), the one
    ``tokenizer_files`` builds, and SpmConverter's plain ``Metaspace``."""
    steps: Sequence[Mapping[str, Any]] = state.get("decoders", []) if state.get("type") == "Sequence" else [state]
    kinds = [_step_kind(step) for step in steps]
    if not re.fullmatch(r"(space|metaspace)( bytes)?( fuse( strip)?)?", " ".join(kinds)):
        return None
    strip = int(steps[-1]["start"]) if kinds[-1] == "strip" else 0
    return _Chain(kinds[0] == "metaspace", "bytes" in kinds, strip)


def _spm_text(token: str, first: bool) -> str:
    """A token's text in the chain: ``▁`` -> space, or removed in Metaspace's token 0."""
    return token.replace(_SPACE, "" if first else " ")


@dataclass(frozen=True)
class ByteTable:
    """Per-id pieces: ``bytes`` for vocabulary tokens, ``str`` for added non-special tokens,
    ``None`` for special tokens. Ids past the end have no token.

    ``texts``: per-id text of a piece that stands on its own (what ``StreamingDetokenizer.add``
    returns for that id while no partial character is pending, its per-token fast path): a
    vocabulary token whose bytes are complete, valid UTF-8 decoded (``b""`` -> ``""``), an added
    non-special token's text; None for the rest (a partial or invalid byte sequence, a special
    token). Empty when not built (every id then takes the general path).

    ``sentencepiece``: None for byte-level BPE; for a SentencePiece vocabulary (``build_sentencepiece``)
    the decoder's rules, and then a vocabulary token's bytes are its text with ``▁`` as a space,
    a ``<0xXX>`` token's the one byte (llama.cpp's ``llama_token_to_piece``), and ``texts`` is None
    for byte tokens (a run of them decodes as a whole)."""

    pieces: tuple[bytes | str | None, ...]
    texts: tuple[str | None, ...] = ()
    sentencepiece: SentencePieceDecoding | None = None

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

    @classmethod
    def build_sentencepiece(cls, vocab: Mapping[str, int], added: Mapping[int, tuple[str, bool]],
                            chain: _Chain) -> ByteTable:
        """The table of a SentencePiece vocabulary decoded by ``chain`` (``sentencepiece_chain``);
        ``vocab`` and ``added`` as in ``build``. An added token's content goes through the chain
        like a vocabulary token (``tokenizers``' ``decode`` passes every kept token's string)."""
        strings = {i: (t, False) for t, i in vocab.items()} | dict(added)
        size = max(strings, default=-1) + 1
        pieces: list[bytes | str | None] = [b""] * size
        texts: list[str | None] = [""] * size
        byte_ids: set[int] = set()
        for i, (token, special) in strings.items():
            match = _BYTE_TOKEN.fullmatch(token) if chain.byte_fallback and not special else None
            if special:
                pieces[i] = texts[i] = None
            elif match:
                pieces[i], texts[i] = bytes([int(match[1], 16)]), None
                byte_ids.add(i)
            else:
                text = texts[i] = _spm_text(token, first=False)
                pieces[i] = text.encode("utf-8") if i not in added else text
        firsts = ({i: _spm_text(t, first=True) for i, (t, _) in strings.items() if _SPACE in t}
                  if chain.metaspace_first else {})
        rules = SentencePieceDecoding(frozenset(byte_ids), chain.strip, firsts)
        return cls(tuple(pieces), tuple(texts), rules)


def _own_text(piece: bytes | str | None) -> str | None:
    """A piece's text when it stands on its own (see ``ByteTable.texts``), else None."""
    if isinstance(piece, bytes):
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
    if not isinstance(token_id, SupportsIndex):
        raise InvalidTokenIdError(f"token id must be an int, got {type(token_id).__name__}")
    try:
        i = operator.index(token_id)
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

    SentencePiece tokenizers (``ByteTable.sentencepiece``) follow their decoder chain instead of
    one UTF-8 byte stream: a token's text is emitted as it comes; a run of ``<0xXX>`` tokens is
    held until a token that is not a byte (or ``finalize``) ends it, since ``tokenizers``'
    ByteFallback turns a whole run into U+FFFD if any of its bytes is invalid; the decoder's
    start rule (``Strip`` of leading spaces, ``Metaspace``'s first token) applies at the start of
    the ids given, as ``decode`` of those ids alone applies it. So a generation's first token
    ``▁Paris`` streams as ``"Paris"``, equal to ``decode(generated_ids)`` (not the ``" Paris"``
    it adds after the prompt in ``decode(prompt_ids + generated_ids)``).

    Args:
        tokenizer: a ``Tokenizer`` (its byte table is built once, on first use, and shared).
        skip_special_tokens: drop special tokens (default, like ``decode``); if False, their text
            is kept.

    Raises:
        TokenizationError: the tokenizer's decoder is neither byte-level BPE nor a supported
            SentencePiece chain.
    """

    def __init__(self, tokenizer: ByteTableSource, skip_special_tokens: bool = True) -> None:
        table = tokenizer.byte_table()
        self._pieces, self._texts, self._spm = table.pieces, table.texts, table.sentencepiece
        specials = {} if skip_special_tokens else tokenizer.special_token_strings()
        if self._spm is not None:
            specials = {i: _spm_text(s, first=False) for i, s in specials.items()}
        self._specials = specials
        self._pending = b""  # bytes not decoded yet: a partial character, or a SentencePiece byte run
        self._start()

    def _start(self) -> None:
        """Arm the SentencePiece decoder's start rule for a new sequence."""
        spm = self._spm
        self._strip = 0 if spm is None else spm.strip  # leading spaces still to strip
        self._first = spm is not None and bool(spm.first_texts)  # Metaspace's token 0 still to come
        self._lead = bool(self._strip) or self._first

    def add(self, token_id: int) -> str:
        """Text completed by ``token_id`` (``str``, possibly empty).

        Raises:
            InvalidTokenIdError: ``token_id`` is not an int in 0..2**32-1.
        """
        if not self._pending and not self._lead and type(token_id) is int and 0 <= token_id < len(self._texts):
            text = self._texts[token_id]  # the common case: a whole piece, nothing pending
            if text is not None:
                return text
        i = check_id(token_id)
        piece = self._pieces[i] if i < len(self._pieces) else b""
        if self._spm is not None:
            return self._add_sentencepiece(i, piece)
        if isinstance(piece, bytes):
            return self._decode(piece, final=False)
        if piece is None:
            if i not in self._specials:
                return ""
            piece = self._specials[i]
        return self._flush() + piece

    def finalize(self) -> str:
        """The rest of the text; an incomplete trailing character becomes U+FFFD."""
        if self._spm is None:
            return self._flush()
        text = self._lstrip(self._end_run())
        self._start()
        return text

    def _decode(self, data: bytes, final: bool) -> str:
        """Incremental UTF-8 decoding with U+FFFD for invalid bytes (as ``codecs``' buffered
        incremental decoder: the bytes of an incomplete character wait for the next piece)."""
        data = self._pending + data
        text, used = codecs.utf_8_decode(data, "replace", final)
        self._pending = data[used:]
        return text

    def _flush(self) -> str:
        return self._decode(b"", final=True)

    def _add_sentencepiece(self, i: int, piece: bytes | str | None) -> str:
        """``add`` under a SentencePiece chain (see the class docstring): a skipped special token
        or an id without a token is not in the chain at all (it neither ends a byte run nor counts
        as token 0), a byte token extends the run, any other token ends it."""
        spm = self._spm
        assert spm is not None
        if piece is None:
            if i not in self._specials:
                return ""
            text = self._specials[i]
        elif not piece:
            return ""
        elif i in spm.byte_ids:
            self._pending += piece  # type: ignore[operator]  # a byte token's piece is bytes
            self._first = False
            return ""
        else:
            text = piece if isinstance(piece, str) else piece.decode("utf-8")
        if self._first:
            text = spm.first_texts.get(i, text)
            self._first = False
        return self._lstrip(self._end_run() + text)

    def _end_run(self) -> str:
        """The pending byte run's text: all of it if valid UTF-8, else one U+FFFD per byte
        (``tokenizers``' ByteFallback, decoders/byte_fallback.rs)."""
        run, self._pending = self._pending, b""
        try:
            return run.decode("utf-8")
        except UnicodeDecodeError:
            return "\ufffd" * len(run)

    def _lstrip(self, text: str) -> str:
        """``text`` less the leading spaces the chain's ``Strip`` still removes (up to
        ``SentencePieceDecoding.strip`` spaces from the start of the whole text)."""
        if self._strip:
            cut = min(len(text) - len(text.lstrip(" ")), self._strip)
            text = text[cut:]
            self._strip = 0 if text else self._strip - cut
        self._lead = bool(self._strip) or self._first
        return text
