"""Tokenization for mlx-serving: the Qwen3 tokenizer (shipped as package data), its chat template,
and UTF-8-safe streaming detokenization. See docs/tokenization.md.

Imports neither ``serving`` nor ``models``.
"""

from ._chat import ChatTemplate
from ._data import data_path
from ._errors import (
    ChatTemplateError,
    InvalidTextError,
    InvalidTokenIdError,
    TokenizationError,
)
from ._stream import ByteTable, StreamingDetokenizer
from ._tokenizer import Tokenizer

__all__ = [
    "ByteTable",
    "ChatTemplate",
    "ChatTemplateError",
    "InvalidTextError",
    "InvalidTokenIdError",
    "StreamingDetokenizer",
    "TokenizationError",
    "Tokenizer",
    "data_path",
]
