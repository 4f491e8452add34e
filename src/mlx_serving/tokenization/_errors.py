"""Exception tree of the tokenization package.

Every error is a ``ValueError`` (bad input at the boundary), so callers that only know the
standard library can still catch it.
"""

from __future__ import annotations


class TokenizationError(ValueError):
    """Base class of every error raised by ``tokenization``."""


class InvalidTextError(TokenizationError):
    """Text to encode is not a ``str``, or holds a lone surrogate (not encodable as UTF-8)."""


class InvalidTokenIdError(TokenizationError):
    """A token id is not an integer, or lies outside 0..2**32-1."""


class ChatTemplateError(TokenizationError):
    """The chat template is missing, does not compile, or failed while rendering
    (including the template's own ``raise_exception(...)``)."""
