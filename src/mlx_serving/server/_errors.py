"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

The serving's errors map to statuses in :func:`from_exception`: ``InvalidInput`` (bad input, raised
by the serving's client preprocessing; its ``param`` names the input key at fault) 400 with that key
as ``param``, spelled as in the OpenAI request (``max_new_tokens`` -> ``max_tokens``, ``text`` ->
``prompt``, ``enable_thinking`` -> ``chat_template_kwargs``), and that key in the message spelled
the same way, as is ``max_new_tokens`` wherever the message names it (an over-long prompt's
refusal names the prompt and says to lower ``max_tokens``); any other ``ValueError`` 400 with
``param`` null (``max_new_tokens`` in its message renamed too); ``ServingOverloaded`` 503 with
``Retry-After``; ``DeadlineExceeded`` 504; ``ServingStopped`` 503; anything else 500.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..serving import DeadlineExceeded, InvalidInput, ServingOverloaded, ServingStopped

__all__ = ["RETRY_AFTER_S", "APIError", "from_exception"]

#: Seconds a client is told to wait (``Retry-After``) when the serving's queue is full.
RETRY_AFTER_S = 1

# The text-generation input keys the OpenAI request spells otherwise (for ``param``); every other
# key (temperature, messages, logit_bias, ...) has the OpenAI field's name.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "text": "prompt", "enable_thinking": "chat_template_kwargs"}


@dataclass
class APIError(Exception):
    """An error answered in the OpenAI shape. ``status``: the HTTP status; ``type``: OpenAI's error
    type (``invalid_request_error``, ...); ``param``: the request field at fault, or None; ``code``:
    a short machine-readable code, or None; ``headers``: extra response headers (``Retry-After``)."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, object]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __str__(self) -> str:
        return self.message


def from_exception(exc: BaseException, fields: Mapping[str, str] | None = None) -> APIError:
    """The OpenAI error for an exception raised while serving a request (see the module docstring);
    ``fields``: the request field each renamed input key came from (``Call.fields``), over the
    usual names."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        param = exc.param if isinstance(exc, InvalidInput) else None
        message = str(exc)
        for key in dict.fromkeys((param or "max_new_tokens", "max_new_tokens")):
            message = re.sub(rf"\b{re.escape(key)}\b", _openai_name(key, fields), message)
        return APIError(400, message, param=None if param is None else _openai_name(param, fields))
    if isinstance(exc, ServingOverloaded):
        return APIError(503, f"the server is overloaded: {exc}; retry later", "server_overloaded",
                        code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, DeadlineExceeded):
        return APIError(504, f"the request's deadline passed: {exc}", "timeout_error", code="deadline_exceeded")
    if isinstance(exc, ServingStopped):
        return APIError(503, f"the model is not serving: {exc}", "server_error", code="stopped",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return APIError(500, f"{type(exc).__name__}: {exc}", "server_error", code="internal_error")



def _openai_name(key: str, fields: Mapping[str, str] | None) -> str:
    """The request field an input key came from (``fields``), else its usual OpenAI name."""
    return (fields or {}).get(key) or _OPENAI_NAMES.get(key, key)
