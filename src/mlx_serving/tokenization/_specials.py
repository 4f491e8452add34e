"""Special (control) tokens: finding them in trusted text, and keeping them out of untrusted text.

``SpecialTokens.split`` cuts text at special-token strings, leftmost match first and the longest
string first at the same position (how the ``tokenizers`` added vocabulary matches them when none
has ``lstrip``/``rstrip``/``single_word`` set, which holds for Qwen3).

``escape``/``unescape`` let a chat template run over user data that contains special-token strings
without those strings reaching the rendered text as such: ``escape`` replaces each special string
(and the escape character itself) by a two-character code made of private-use characters, and
``unescape`` restores the original text after rendering. Template operations that do not touch
private-use characters (``strip('\\n')``, ``split('</think>')``, ``startswith``, ``tojson`` with
``ensure_ascii=False``) act the same on escaped text, so the rendered text after ``unescape`` is the
text an unescaped render gives.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping

_ESC = "\U000f0000"  # first code point of Supplementary Private Use Area-A
_CODE_BASE = 0xF0100  # special string number i is coded as _ESC + chr(_CODE_BASE + i)


class SpecialTokens:
    """The special tokens of one tokenizer: ``strings`` maps each special string to its id."""

    def __init__(self, strings: Mapping[str, int]) -> None:
        self.strings = dict(strings)
        self._by_code = list(self.strings)
        ordered = sorted(self.strings, key=len, reverse=True)
        self._split_re = re.compile("|".join(map(re.escape, ordered))) if ordered else None
        self._escape_map = {s: _ESC + chr(_CODE_BASE + i) for i, s in enumerate(self._by_code)}
        self._escape_map[_ESC] = _ESC + _ESC
        self._escape_re = re.compile("|".join(map(re.escape, [*ordered, _ESC])))
        self._unescape_re = re.compile(re.escape(_ESC) + "(.)", re.DOTALL)

    def split(self, text: str) -> Iterator[tuple[str, int | None]]:
        """Yield ``(piece, id)``: ``id`` is the special token's id for a special string, ``None``
        for the text between them (empty pieces are left out)."""
        start = 0
        if self._split_re is not None:
            for m in self._split_re.finditer(text):
                if m.start() > start:
                    yield text[start : m.start()], None
                yield m.group(), self.strings[m.group()]
                start = m.end()
        if start < len(text):
            yield text[start:], None

    def escape(self, text: str) -> str:
        """``text`` with every special string (and the escape character) replaced by its code."""
        return self._escape_re.sub(lambda m: self._escape_map[m.group()], text)

    def unescape(self, text: str) -> str:
        """Inverse of ``escape`` on a string."""
        return self._unescape_re.sub(self._decode_code, text)

    def _decode_code(self, m: re.Match[str]) -> str:
        code = m.group(1)
        index = ord(code) - _CODE_BASE
        if code == _ESC:
            return _ESC
        return self._by_code[index] if 0 <= index < len(self._by_code) else m.group()
