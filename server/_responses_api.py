"""OpenAI's Responses API (``POST /v1/responses``, the openai-agents SDK's default) over the chat path.

A Responses body is rewritten as a chat-completions body and mapped by :func:`~._requests.chat_call`:
``input`` (a string, or a list of items: messages with role user / system / developer / assistant and
string or ``input_text`` / ``output_text`` / ``refusal`` content, ``function_call``,
``function_call_output`` and ``reasoning`` items) becomes ``messages`` after ``instructions`` (a
system message) and, with ``previous_response_id``, after the stored conversation of that response;
``max_output_tokens`` -> ``max_tokens``; flat function ``tools`` -> chat tools; ``tool_choice``;
``text.format`` -> ``response_format``; ``reasoning.effort`` -> ``enable_thinking`` ("none": off,
any other effort: on); ``include: ["message.output_text.logprobs"]`` / ``top_logprobs`` ->
logprobs. A field this server cannot honour (built-in tools, ``conversation``, ``background``, ...)
or that no table here names is refused with :class:`APIError` 400 naming it.

The result is a ``response`` object (``output``: a ``reasoning`` item, a ``message`` with one
``output_text`` part, ``function_call`` items), or a stream of typed events (``response.created``
... ``response.completed`` / ``response.incomplete`` / ``response.failed``, numbered by
``sequence_number``). Stored responses (``store``, default true) live in a :class:`ResponseStore`,
an LRU bounded by count and characters.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..serving import AsyncStream, Client, ServingError
from ._errors import APIError, from_exception
from ._requests import Call, chat_call
from ._responses import Event, chat_logprobs, event
from ._shutdown import Drain

__all__ = ["Item", "Recorder", "ResponseStore", "ResponsesAPI", "Turn"]

Json = dict[str, Any]

# Responses fields read below, by name.
_READ = ("model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
         "parallel_tool_calls", "text", "reasoning", "stream", "stream_options", "store", "previous_response_id",
         "include", "top_logprobs", "truncation", "metadata")
# Accepted without effect on the output (OpenAI's bookkeeping; max_tool_calls bounds built-in tools only).
_IGNORED = ("user", "service_tier", "prompt_cache_key", "safety_identifier", "prompt_cache_retention",
            "max_tool_calls")
# Not honoured: 400 naming the field unless null (or false).
_UNSUPPORTED = ("background", "conversation", "prompt", "context_management", "moderation", "image",
                "access_programs", "background_options", "prompt_cache_options")
# This server's (and vLLM's) extensions of the chat path, passed to it under the same names.
_EXTENSIONS = ("top_k", "min_p", "seed", "stop", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "logit_bias", "min_tokens", "deadline", "priority", "ignore_eos", "stop_token_ids",
               "include_stop_str_in_output", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar")
_KNOWN = frozenset((*_READ, *_IGNORED, *_UNSUPPORTED, *_EXTENSIONS))
# The chat field an error names -> the Responses field it came from.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text",
           "chat_template_kwargs": "reasoning", "logprobs": "include"}
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_LOGPROBS = "message.output_text.logprobs"
_ITEM_KEYS = {"message": {"type", "role", "content", "id", "status", "phase"},
              "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
              "function_call_output": {"type", "call_id", "output", "id", "status"},
              "reasoning": {"type", "id", "summary", "content", "status"}}
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- the conversation ----------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Item:
    """One conversation item, normalized. ``kind``: "message" (``role``: user, system, developer or
    assistant; ``text``: its content), "function_call" (``call_id``, ``name``; ``text``: the
    arguments' JSON), "function_call_output" (``call_id``; ``text``: the output) or "reasoning"
    (``text``: the reasoning)."""

    kind: str
    text: str
    role: str = ""
    call_id: str = ""
    name: str = ""

    def chars(self) -> int:
        return len(self.text) + len(self.call_id) + len(self.name)


def items_of(value: Any) -> list[Item]:
    """A request's ``input`` as items: a string is one user message. Raises APIError 400 (param
    ``input``) for anything else than a string or a list of the supported items."""
    if isinstance(value, str):
        return [Item("message", value, role="user")]
    if not isinstance(value, list):
        raise _bad("'input' must be a string or a list of input items", "input")
    return [_item(raw, f"input[{i}]") for i, raw in enumerate(value)]


def _item(raw: Any, where: str) -> Item:
    if not isinstance(raw, dict):
        raise _bad(f"{where} must be an object", "input")
    raw = {k: v for k, v in raw.items() if v is not None}
    kind = raw.get("type", "message")
    if kind not in _ITEM_KEYS:
        raise _bad(f"{where}: items of type {kind!r:.80} are not supported (supported: {sorted(_ITEM_KEYS)})", "input")
    unknown = sorted(set(raw) - _ITEM_KEYS[kind])
    if unknown:
        raise _bad(f"{where}: unknown field {unknown[0]!r:.80} in a {kind} item", "input")
    if kind == "message":
        role = raw.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise _bad(f"{where}.role must be user, system, developer or assistant, got {role!r:.80}", "input")
        return Item("message", _text(raw.get("content"), f"{where}.content"), role=role)
    if kind == "reasoning":
        parts = raw.get("content") or raw.get("summary") or []
        return Item("reasoning", _text(parts, f"{where}.content", ("reasoning_text", "summary_text")))
    call_id = raw.get("call_id")
    if not isinstance(call_id, str) or not call_id:
        raise _bad(f"{where}.call_id must be a non-empty string", "input")
    if kind == "function_call_output":
        return Item(kind, _text(raw.get("output"), f"{where}.output"), call_id=call_id)
    name, arguments = raw.get("name"), raw.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise _bad(f"{where}: 'name' and 'arguments' (JSON text) must be strings", "input")
    return Item(kind, arguments, call_id=call_id, name=name)


def _text(content: Any, where: str, kinds: tuple[str, ...] = tuple(_TEXT_PARTS)) -> str:
    """A string, or the joined text of a list of text parts (``input_text``, ``output_text``,
    ``refusal``; ``kinds`` for reasoning)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind, "text") if kind in kinds else None
        if key is None or not isinstance(part.get(key), str):
            raise _bad(f"{where}[{j}]: only text parts ({', '.join(kinds)}) are supported, got {kind!r:.80}", "input")
        texts.append(part[key])
    return "".join(texts)


def messages_of(items: list[Item], instructions: str | None) -> list[Json]:
    """Chat messages for ``items``: ``instructions`` first (a system message); an assistant turn's
    reasoning, text and function calls joined into one assistant message; outputs as tool messages."""
    out: list[Json] = [{"role": "system", "content": instructions}] if instructions else []
    for it in items:
        last = out[-1] if out and out[-1]["role"] == "assistant" else None
        fresh = last if last is not None and not last["content"] and "tool_calls" not in last else None
        if it.kind == "message" and it.role != "assistant":
            out.append({"role": it.role, "content": it.text})
        elif it.kind == "message" and fresh is not None:
            fresh["content"] = it.text  # the text after this turn's reasoning
        elif it.kind == "message":
            out.append({"role": "assistant", "content": it.text})
        elif it.kind == "reasoning" and fresh is not None and "reasoning_content" not in fresh:
            fresh["reasoning_content"] = it.text
        elif it.kind == "reasoning":
            out.append({"role": "assistant", "content": "", "reasoning_content": it.text})
        elif it.kind == "function_call":
            call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.text}}
            if last is None:
                out.append(last := {"role": "assistant", "content": ""})
            last.setdefault("tool_calls", []).append(call)
        else:
            out.append({"role": "tool", "tool_call_id": it.call_id, "content": it.text})
    return out


# -- the stored responses ------------------------------------------------------------------------

@dataclass
class _Stored:
    response: Json
    items: list[Item]  # the conversation: its input items (with the earlier turns), then its output
    chars: int


class ResponseStore:
    """Stored responses, least recently used first out: at most ``max_responses`` of them holding at
    most ``max_chars`` characters together (a response's whole conversation counts, so what a chain
    holds is bounded too). One bigger than ``max_chars`` alone is not stored."""

    def __init__(self, max_responses: int = 1000, max_chars: int = 64 << 20) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self._entries: OrderedDict[str, _Stored] = OrderedDict()
        self.chars = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: Json, items: list[Item]) -> None:
        chars = sum(it.chars() for it in items) + len(json.dumps(response, ensure_ascii=False))
        if chars > self.max_chars:
            return
        self._entries[response["id"]] = _Stored(response, items, chars)
        self.chars += chars
        while len(self._entries) > self.max_responses or self.chars > self.max_chars:
            self.chars -= self._entries.popitem(last=False)[1].chars

    def items(self, rid: str) -> list[Item]:
        """The conversation a ``previous_response_id`` continues; APIError 400 naming it when unknown."""
        entry = self._get(rid)
        if entry is None:
            raise APIError(400, f"Previous response with id '{rid:.100}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        return entry.items

    def response(self, rid: str) -> Json:
        """A stored response object; APIError 404 when unknown."""
        entry = self._get(rid)
        if entry is None:
            raise APIError(404, f"Response with id '{rid:.100}' not found.", "not_found_error", code="not_found")
        return entry.response

    def delete(self, rid: str) -> Json:
        """Forget a stored response: ``{"id", "object": "response", "deleted": true}``; APIError 404 when unknown."""
        self.response(rid)
        self.chars -= self._entries.pop(rid).chars
        return {"id": rid, "object": "response", "deleted": True}

    def _get(self, rid: str) -> _Stored | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry


# -- requests ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Turn:
    """One Responses request, mapped: ``call`` (the chat path's), ``items`` (the conversation so
    far: the previous response's, then this input), ``echo`` (the request fields a response object
    repeats), ``store``, ``logprobs`` (the output text carries them)."""

    call: Call
    items: list[Item]
    echo: Json
    store: bool
    logprobs: bool


class Recorder(Protocol):
    """What the metrics see of a request (the app's ``_Recorder``)."""

    def final(self, choice: int, final: Mapping[str, Any]) -> None: ...

    def aborted(self) -> None: ...


def _check_fields(body: Json) -> None:
    unknown = [k for k in body if k not in _KNOWN]
    if unknown:
        raise _bad(f"unknown field {unknown[0]!r:.80} in a responses request", str(unknown[0])[:80])
    for name in _UNSUPPORTED:
        if body.get(name) is not None and body[name] is not False:
            raise _bad(f"'{name}' is not supported by this server", name)
    if body.get("truncation") not in (None, "disabled"):
        raise _bad("'truncation' must be 'disabled' (a prompt that does not fit is refused, never cut)",
                   "truncation")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise _bad("'metadata' must be an object", "metadata")
    options = body.get("stream_options")
    if options is not None and (body.get("stream") is not True or not isinstance(options, dict)
                                or set(options) - {"include_obfuscation"}):
        raise _bad("'stream_options' may hold only 'include_obfuscation', with 'stream': true", "stream_options")


def _tools(tools: Any) -> list[Json] | None:
    """Flat function tools -> chat tools; APIError 400 (param ``tools``) for any other kind."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise _bad("'tools' must be a list of function tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _bad(f"tools[{i}]: only function tools are supported, not {kind!r:.80} (built-in tools run on "
                       "OpenAI's servers)", "tools")
        fn = {k: v for k, v in tool.items() if k != "type" and v is not None}
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown or not isinstance(fn.get("name"), str):
            raise _bad(f"tools[{i}] must be {{'type': 'function', 'name', 'description', 'parameters', 'strict'}}"
                       + (f", not {unknown[0]!r:.80}" if unknown else ""), "tools")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    """``tool_choice`` in the chat shape (None for "auto", the default); APIError 400 for hosted
    tools and ``allowed_tools``."""
    if choice in (None, "auto"):
        return None
    if choice in ("none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("'tool_choice' must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
               "tool_choice")


def _response_format(text: Any) -> Json | None:
    """``text.format`` -> the chat ``response_format`` (None for plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise _bad("'text' may hold only 'format' (and a null 'verbosity')", "text")
    if text.get("verbosity") is not None:
        raise _bad("'text.verbosity' is not supported by this server", "text.verbosity")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise _bad("'text.format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}", "text")


def _thinking(reasoning: Any) -> Json | None:
    """``reasoning`` -> ``chat_template_kwargs`` (effort "none": thinking off; any other: on)."""
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise _bad("'reasoning' may hold only 'effort'", "reasoning")
    for key in ("summary", "generate_summary"):
        if reasoning.get(key) is not None:
            raise _bad(f"'reasoning.{key}' is not supported: the reasoning comes back whole, as the reasoning "
                       "item's content", f"reasoning.{key}")
    effort = reasoning.get("effort")
    if effort is None:
        return None
    if effort not in _EFFORTS:
        raise _bad(f"'reasoning.effort' must be one of {list(_EFFORTS)}, got {effort!r:.80}", "reasoning.effort")
    return {"enable_thinking": effort != "none"}


def _logprobs(body: Json) -> bool:
    include = body.get("include") or []
    if not isinstance(include, list) or any(x != _LOGPROBS for x in include):
        raise _bad(f"'include' may hold only {_LOGPROBS!r}", "include")
    return bool(include) or body.get("top_logprobs") is not None


def _renamed(exc: BaseException) -> APIError:
    """The error of a chat field as the Responses field it came from (``max_tokens`` ->
    ``max_output_tokens``, ...)."""
    error = from_exception(exc)
    if error.param in _PARAMS:
        error.param = _PARAMS[error.param]
    return error


def _chat_body(body: Json, messages: list[Json], logprobs: bool) -> Json:
    chat: Json = {"messages": messages, "stream": body.get("stream"), "max_tokens": body.get("max_output_tokens"),
                  "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                  "tools": _tools(body.get("tools")), "tool_choice": _tool_choice(body.get("tool_choice")),
                  "parallel_tool_calls": body.get("parallel_tool_calls"),
                  "response_format": _response_format(body.get("text")),
                  "chat_template_kwargs": _thinking(body.get("reasoning")),
                  "logprobs": logprobs or None, "top_logprobs": body.get("top_logprobs") if logprobs else None,
                  **{k: body.get(k) for k in _EXTENSIONS}}
    return {k: v for k, v in chat.items() if v is not None}


def _echo(body: Json) -> Json:
    """The request fields a response object repeats (OpenAI's defaults where none was given); call
    after the fields were checked."""
    same = ("instructions", "max_output_tokens", "previous_response_id", "temperature", "top_logprobs", "top_p",
            "user")
    return {**{k: body.get(k) for k in same}, "metadata": body.get("metadata") or {},
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "reasoning": {"effort": (body.get("reasoning") or {}).get("effort"), "summary": None},
            "store": body.get("store") is not False, "text": {"format": (body.get("text") or {}).get("format")
                                                                         or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "truncation": "disabled"}


# -- responses -----------------------------------------------------------------------------------

def _usage(final: Mapping[str, Any]) -> Json:
    summary = final.get("token_summary", {})
    prompt, generated = summary.get("input", 0), final.get("num_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": summary.get("cached", 0)},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated}


def _status(finish_reason: Any) -> tuple[str, Json | None]:
    """``(status, incomplete_details)`` for a finish reason: "length" is incomplete, any other completed."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _message(text: str, status: str, logprobs: list[Json] | None) -> Json:
    part: Json = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": status, "content": [part]}


def _reasoning(text: str) -> Json:
    return {"id": _new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _function_call(call: Mapping[str, Any]) -> Json:
    return {"id": _new_id("fc"), "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": "completed"}


def _output_items(output: list[Json]) -> list[Item]:
    """A response's output as conversation items (what a later ``previous_response_id`` continues)."""
    items = []
    for o in output:
        if o["type"] == "message":
            items.append(Item("message", o["content"][0]["text"], role="assistant"))
        elif o["type"] == "reasoning":
            items.append(Item("reasoning", o["content"][0]["text"]))
        else:
            items.append(Item("function_call", o["arguments"], call_id=o["call_id"], name=o["name"]))
    return items


class ResponsesAPI:
    """The Responses routes' logic over one app's :class:`ResponseStore`."""

    def __init__(self, store: ResponseStore | None = None) -> None:
        self.store = store if store is not None else ResponseStore()

    def turn(self, body: Json) -> Turn:
        """Map a ``POST /v1/responses`` body (see the module docstring). Raises APIError 400 naming
        the Responses field at fault (``previous_response_id`` when that response is not stored)."""
        _check_fields(body)
        if body.get("store") is not None and not isinstance(body["store"], bool):
            raise _bad(f"'store' must be true, false or null, got {body['store']!r:.80}", "store")
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise _bad("'instructions' must be a string", "instructions")
        previous = body.get("previous_response_id")
        if previous is not None and not isinstance(previous, str):
            raise _bad("'previous_response_id' must be a string", "previous_response_id")
        items = (self.store.items(previous) if previous else []) + items_of(body.get("input"))
        logprobs = _logprobs(body)
        try:
            call = chat_call(_chat_body(body, messages_of(items, instructions), logprobs))
        except APIError as exc:
            raise _renamed(exc) from None
        return Turn(call, items, _echo(body), body.get("store") is not False, logprobs)

    async def run(self, client: Client, turn: Turn, deadline: float | None) -> Any:
        """``client.run_async`` of the turn; the serving's ValueError as an APIError naming the Responses field."""
        try:
            return await client.run_async(turn.call.input, deadline=deadline)
        except ValueError as exc:
            raise _renamed(exc) from None

    async def stream(self, client: Client, turn: Turn, deadline: float | None) -> AsyncStream:
        """``client.stream_async`` of the turn (errors as :meth:`run`)."""
        try:
            return await client.stream_async(turn.call.input, deadline=deadline)
        except ValueError as exc:
            raise _renamed(exc) from None

    def response(self, turn: Turn, model: str, result: Any) -> Json:
        """The ``response`` object of a finished (non-list) result, stored when the turn asks."""
        e = result["results"][0]
        status, details = _status(e["finish_reason"])
        output = [_reasoning(e["reasoning_content"])] if e.get("reasoning_content") else []
        if e["generated_text"] or not e.get("tool_calls"):
            lp = chat_logprobs(e.get("logprobs") or []) if turn.logprobs else None
            output.append(_message(e["generated_text"], "incomplete" if details else "completed", lp))
        output += [_function_call(c) for c in e.get("tool_calls") or []]
        body = _envelope(_new_id("resp"), model, turn, status, int(time.time()))
        body.update(output=output, incomplete_details=details, usage=_usage(e))
        return self.finish(turn, body)

    def events(self, stream: AsyncStream, turn: Turn, model: str, record: Recorder,
               drain: Drain) -> AsyncIterator[Json]:
        """The SSE events (``{"event", "data"}``) of a streamed turn; see :class:`_Streamed`."""
        return _Streamed(self, turn, model).events(stream, record, drain)

    def finish(self, turn: Turn, body: Json) -> Json:
        """A finished response object ``body``, with ``completed_at`` when completed, stored when the turn asks."""
        if body["status"] == "completed":
            body["completed_at"] = int(time.time())
        if turn.store:
            self.store.put(body, turn.items + _output_items(body["output"]))
        return body


def _envelope(rid: str, model: str, turn: Turn, status: str, created: int) -> Json:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": None, "model": model, "output": [], "usage": None, **turn.echo}


_END = object()


@dataclass
class _Streamed:
    """One streamed response: its events' sequence numbers and the output items so far (one item
    open at a time: reasoning or a message takes deltas; function calls come whole). Its output
    items are those the unstreamed response would have, in the order they were generated."""

    api: ResponsesAPI
    turn: Turn
    model: str
    seq: int = 0
    output: list[Json] = field(default_factory=list)
    current: Json | None = None  # the open reasoning or message item
    body: Json = field(default_factory=dict)

    async def events(self, stream: AsyncStream, record: Recorder, drain: Drain) -> AsyncIterator[Json]:
        """``response.created``, ``response.in_progress``, the items' events, then
        ``response.completed`` / ``response.incomplete``; ``response.failed`` for an error (or the
        end of the shutdown grace period) once the stream has begun. Leaving early withdraws the
        request; a failed response is not stored."""
        self.body = _envelope(_new_id("resp"), self.model, self.turn, "in_progress", int(time.time()))
        try:
            async with stream:
                yield self._event("response.created", response=dict(self.body))
                yield self._event("response.in_progress", response=dict(self.body))
                items = aiter(stream)
                try:
                    while True:
                        item: Any = _END
                        with drain.scope() as waiting:
                            item = await anext(items, _END)
                        if waiting.cancelled_caught:
                            for e in self._failed(f"the server is shutting down: the stream was ended "
                                                  f"{drain.grace:g} s after shutdown began"):
                                yield e
                            return
                        if item is _END:
                            return
                        for one in _joined([item, *stream.take_ready()]):
                            ev = event(one, False, 1)
                            for e in self._feed(ev):
                                yield e
                            if ev.final is not None:
                                record.final(0, ev.final)
                except (ServingError, ValueError) as exc:
                    for e in self._failed(str(from_exception(exc))):
                        yield e
        finally:
            record.aborted()

    def _event(self, kind: str, **fields: Any) -> Json:
        self.seq += 1
        return {"event": kind, "data": json.dumps({"type": kind, "sequence_number": self.seq, **fields},
                                                  ensure_ascii=False)}

    def _feed(self, ev: Event) -> list[Json]:
        out: list[Json] = []
        if ev.delta.get("reasoning_content"):
            out += self._delta("reasoning", ev.delta["reasoning_content"], None)
        if ev.delta.get("content"):
            out += self._delta("message", ev.delta["content"], ev.logprobs)
        elif ev.logprobs and self.turn.logprobs and self.current is not None and self.current["type"] == "message":
            self.current["content"][0]["logprobs"] += chat_logprobs(ev.logprobs)  # tokens with no text of their own
        for call in ev.delta.get("tool_calls") or []:
            out += self._close()
            item = _function_call(call)
            out += [self._event("response.output_item.added", output_index=len(self.output),
                                item={**item, "arguments": "", "status": "in_progress"}),
                    self._event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=len(self.output), delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=len(self.output), arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=len(self.output), item=item)]
            self.output.append(item)
        if ev.final is not None:
            out += self._final(ev.final)
        return out

    def _delta(self, kind: str, text: str, logprobs: list[Json] | None) -> list[Json]:
        """A reasoning or text delta, opening its item first unless it is the one open."""
        out: list[Json] = []
        item = self.current
        if item is None or item["type"] != kind:
            out += self._close()
            item = self._open(kind, out)
        part = item["content"][0]
        part["text"] += text
        where = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        if kind == "reasoning":
            return out + [self._event("response.reasoning_text.delta", **where, delta=text)]
        lp = chat_logprobs(logprobs or []) if self.turn.logprobs else []
        if self.turn.logprobs:
            part["logprobs"] += lp
        return out + [self._event("response.output_text.delta", **where, delta=text, logprobs=lp)]

    def _open(self, kind: str, out: list[Json]) -> Json:
        """Open a reasoning or message item (its events go to ``out``) and return it."""
        logprobs = [] if self.turn.logprobs else None
        item = _reasoning("") if kind == "reasoning" else _message("", "in_progress", logprobs)
        item["status"], self.current = "in_progress", item
        out += [self._event("response.output_item.added", output_index=len(self.output), item={**item, "content": []}),
                self._event("response.content_part.added", item_id=item["id"], output_index=len(self.output),
                            content_index=0, part={**item["content"][0]})]
        return item

    def _close(self, status: str = "completed") -> list[Json]:
        """Close the open item, if any: its done events."""
        item, self.current = self.current, None
        if item is None:
            return []
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": len(self.output), "content_index": 0}
        if item["type"] == "reasoning":
            done = self._event("response.reasoning_text.done", **where, text=part["text"])
        else:
            done = self._event("response.output_text.done", **where, text=part["text"],
                               logprobs=part.get("logprobs") or [])
        item["status"] = status
        self.output.append(item)
        return [done, self._event("response.content_part.done", **where, part=part),
                self._event("response.output_item.done", output_index=len(self.output) - 1, item=item)]

    def _final(self, final: Mapping[str, Any]) -> list[Json]:
        status, details = _status(final.get("finish_reason"))
        out: list[Json] = []
        if not any(o["type"] in ("message", "function_call") for o in self.output) and (
                self.current is None or self.current["type"] != "message"):
            out += self._close()
            self._open("message", out)  # no text and no call: an empty message, as unstreamed
        out += self._close("incomplete" if details else "completed")
        self.body.update(status=status, output=self.output, incomplete_details=details, usage=_usage(final))
        body = self.api.finish(self.turn, self.body)
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return out + [self._event(kind, response=body)]

    def _failed(self, message: str) -> list[Json]:
        out = self._close("incomplete")
        self.body.update(status="failed", output=self.output, error={"code": "server_error", "message": message})
        return out + [self._event("response.failed", response=self.body)]


def _joined(items: list[Any]) -> list[Any]:
    """Consecutive text pieces joined (a stream that fell behind sends them as one delta)."""
    out: list[Any] = []
    for item in items:
        if isinstance(item, str) and out and isinstance(out[-1], str):
            out[-1] += item
        else:
            out.append(item)
    return out
