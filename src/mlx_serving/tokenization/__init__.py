"""Tokenization for mlx-serving: the Qwen3 tokenizer (shipped as package data), its chat template,
UTF-8-safe streaming detokenization,
and tokenizer files rebuilt from GGUF metadata. See docs/tokenization.md.

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
from ._gguf import GGUFMetadataError, plain_metadata, tokenizer_files
from ._stream import ByteTable, StreamingDetokenizer
from ._tokenizer import Tokenizer

__all__ = [
    "ByteTable",
    "ChatTemplate",
    "ChatTemplateError",
    "GGUFMetadataError",
    "InvalidTextError",
    "InvalidTokenIdError",
    "StreamingDetokenizer",
    "TokenizationError",
    "Tokenizer",
    "data_path",
    "plain_metadata",
    "tokenizer_files",
]
