"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the chat path.

A body is checked against msgspec Structs (:mod:`._schema`, each field named once; a field no Struct
names is refused, 400 naming it) and mapped to the text-generation input the chat route builds
(:mod:`._request`: messages with tool calls and tool results, tools, ``tool_choice`` forcing a call
as the chat route's "required" / named choice, ``stop_sequences``, sampling, ``thinking``). The
result is a ``message`` (:mod:`._output`) or a stream of Anthropic's SSE events (:mod:`._stream`).
Errors, the API key check's included, answer in Anthropic's shape (:mod:`._route`).

Modules: ``_schema`` (the Structs, :func:`decode`), ``_request`` (a body -> :class:`Turn` /
:class:`Prompt`), ``_output`` (message objects, stop reasons, error bodies), ``_stream`` (the
events), ``_route`` (:class:`AnthropicRoute`), ``_count`` (:func:`count_tokens`).
"""

from ._count import count_tokens
from ._output import message
from ._request import Prompt, Turn, prompt, turn
from ._route import AnthropicRoute
from ._stream import events

__all__ = ["AnthropicRoute", "Prompt", "Turn", "count_tokens", "events", "message", "prompt", "turn"]
