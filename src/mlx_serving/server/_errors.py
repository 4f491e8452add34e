"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

The serving's errors map to statuses in :func:`from_exception`: ``InvalidInput`` (bad input, raised
by the serving's client preprocessing; its ``param`` names the input key at fault) 400 with that key
as ``param``, spelled as in the OpenAI request (``max_new_tokens`` -> ``max_tokens``, ``text`` ->
``prompt``, ``enable_thinking`` -> ``chat_template_kwargs``), and that key in the message spelled
the same way; any other ``ValueError`` 400 with
``param`` null; ``ServingOverloaded`` 503 with ``Retry-After``; ``DeadlineExceeded`` 504;
``ServingStopped`` 503; anything else 500.
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
    if isinstance(exc, InvalidInput):
        if exc.param is None:
            return APIError(400, str(exc))
        param = (fields or {}).get(exc.param) or _OPENAI_NAMES.get(exc.param, exc.param)
        return APIError(400, re.sub(rf"\b{re.escape(exc.param)}\b", param, str(exc)), param=param)
    if isinstance(exc, ValueError):
        return APIError(400, str(exc))
    if isinstance(exc, ServingOverloaded):
        return APIError(503, f"the server is overloaded: {exc}; retry later", "server_overloaded",
                        code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, DeadlineExceeded):
        return APIError(504, f"the request's deadline passed: {exc}", "timeout_error", code="deadline_exceeded")
    if isinstance(exc, ServingStopped):
        return APIError(503, f"the model is not serving: {exc}", "server_error", code="stopped",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return APIError(500, f"{type(exc).__name__}: {exc}", "server_error", code="internal_error")

