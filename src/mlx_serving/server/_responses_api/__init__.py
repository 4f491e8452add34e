"""OpenAI's Responses API (``POST /v1/responses``, the openai-agents SDK's default) over the chat path.

A Responses body is rewritten as a chat-completions body and mapped by :func:`~.._requests.chat_call`:
``input`` (a string, or a list of items: messages with role user / system / developer / assistant and
string or ``input_text`` / ``output_text`` / ``refusal`` content, ``function_call``,
``function_call_output`` and ``reasoning`` items) becomes ``messages`` after ``instructions`` (a
system message) and, with ``previous_response_id``, after the stored conversation of that response;
``max_output_tokens`` -> ``max_tokens``; flat function ``tools`` -> chat tools; ``tool_choice``;
``text.format`` -> ``response_format``; ``reasoning.effort`` -> ``enable_thinking`` ("none": off,
any other effort: on); ``include: ["message.output_text.logprobs"]`` / ``top_logprobs`` ->
logprobs. A field this server cannot honour (built-in tools, ``conversation``, ``background``, ...)
or that no table names is refused with :class:`~.._errors.APIError` 400 naming it.

The result is a ``response`` object (``output``: a ``reasoning`` item, a ``message`` with one
``output_text`` part, ``function_call`` items), or a stream of typed events (``response.created``
... ``response.completed`` / ``response.incomplete`` / ``response.failed``, numbered by
``sequence_number``). Stored responses (``store``, default true) live in a :class:`ResponseStore`,
an LRU bounded by count and characters.

Modules: ``_items`` (input items -> :class:`Item` -> chat messages), ``_fields`` (the fields whose
shape differs on the chat path), ``_request`` (a body -> :class:`Turn`), ``_store``
(:class:`ResponseStore`), ``_output`` (response objects and usage), ``_stream`` (the streamed
events), ``_api`` (:class:`ResponsesAPI`, what the app calls).
"""

from ._api import ResponsesAPI
from ._items import Item, items_of, messages_of
from ._request import Turn
from ._store import ResponseStore
from ._stream import Recorder

__all__ = ["Item", "Recorder", "ResponseStore", "ResponsesAPI", "Turn", "items_of", "messages_of"]
