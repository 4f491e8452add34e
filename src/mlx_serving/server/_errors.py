"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

The serving's errors map to statuses in :func:`from_exception`: ``ValueError`` (bad input, raised by
the serving's client preprocessing, naming the field) 400; ``ServingOverloaded`` 503 with
``Retry-After``; ``DeadlineExceeded`` 504; ``ServingStopped`` 503; anything else 500.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..serving import DeadlineExceeded, ServingOverloaded, ServingStopped

__all__ = ["RETRY_AFTER_S", "APIError", "from_exception"]

#: Seconds a client is told to wait (``Retry-After``) when the serving's queue is full.
RETRY_AFTER_S = 1

# The text-generation input keys, and how the OpenAI request spells them (for ``param``).
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "text": "prompt", "enable_thinking": "chat_template_kwargs"}
_KEYS = ("messages", "text", "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
         "presence_penalty", "frequency_penalty", "logit_bias", "min_tokens", "seed", "stop", "n", "logprobs",
         "top_logprobs", "response_format", "tools", "enable_thinking", "priority", "tool_choice",
         "parallel_tool_calls", "ignore_eos", "stop_token_ids", "include_stop_str_in_output")
_KEY = re.compile(r"(?<![\w.])(" + "|".join(sorted(_KEYS, key=len, reverse=True)) + r")(?!\w)")


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


def from_exception(exc: BaseException) -> APIError:
    """The OpenAI error for an exception raised while serving a request (see the module docstring)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return APIError(400, str(exc), param=_param(str(exc)))
    if isinstance(exc, ServingOverloaded):
        return APIError(503, f"the server is overloaded: {exc}; retry later", "server_overloaded",
                        code="overloaded", headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, DeadlineExceeded):
        return APIError(504, f"the request's deadline passed: {exc}", "timeout_error", code="deadline_exceeded")
    if isinstance(exc, ServingStopped):
        return APIError(503, f"the model is not serving: {exc}", "server_error", code="stopped",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return APIError(500, f"{type(exc).__name__}: {exc}", "server_error", code="internal_error")


def _param(message: str) -> str | None:
    """The request field a serving ValueError names (the first input key in its message), spelled as
    in the OpenAI request (``max_new_tokens`` -> ``max_tokens``); None when it names none."""
    match = _KEY.search(message)
    return None if match is None else _OPENAI_NAMES.get(match.group(1), match.group(1))
