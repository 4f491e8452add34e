"""Response objects: the envelope (``object: "response"``, the echoed request fields), its output
items and usage, and the finished response stored.

``output`` holds a ``reasoning`` item (``reasoning_text`` content) when the model reasoned, a
``message`` with one ``output_text`` part (its ``logprobs`` when asked) unless the model only
called functions, then one ``function_call`` item per call. ``status`` is "incomplete"
(``incomplete_details.reason``: "max_output_tokens") when the completion hit its token limit,
"completed" otherwise (with ``completed_at``). Usage counts the prompt's tokens (cached ones in
``input_tokens_details``) and the generated ones. Nothing here raises for a well-formed result.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

from .._responses import Result, chat_logprobs
from ._items import Item, Json
from ._request import Turn
from ._store import ResponseStore

__all__ = ["envelope", "finish", "function_call", "message", "new_id", "reasoning", "response", "status", "usage"]


def new_id(prefix: str) -> str:
    """A fresh id: ``<prefix>_<hex>`` (``resp``, ``msg``, ``rs``, ``fc``)."""
    return f"{prefix}_{uuid.uuid4().hex}"


def envelope(rid: str, model: str, turn: Turn, status: str, created: int) -> Json:
    """A response object without output yet, repeating the turn's request fields."""
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": None, "model": model, "output": [], "usage": None, **turn.echo}


def response(turn: Turn, model: str, result: Result) -> Json:
    """The response object of a finished (non-list) result; not yet :func:`finish` ed."""
    e = result["results"][0]
    state, details = status(e["finish_reason"])
    output = [reasoning(e["reasoning_content"])] if e.get("reasoning_content") else []
    if e["generated_text"] or not e.get("tool_calls"):
        lp = chat_logprobs(e.get("logprobs") or []) if turn.logprobs else None
        output.append(message(e["generated_text"], "incomplete" if details else "completed", lp))
    output += [function_call(c) for c in e.get("tool_calls") or []]
    body = envelope(new_id("resp"), model, turn, state, int(time.time()))
    body.update(output=output, incomplete_details=details, usage=usage(e))
    return body


def finish(body: Json, turn: Turn, store: ResponseStore) -> Json:
    """The finished response ``body``, with ``completed_at`` when completed, put in ``store`` (with
    its conversation) when the turn asks."""
    if body["status"] == "completed":
        body["completed_at"] = int(time.time())
    if turn.store:
        store.put(body, turn.items + _output_items(body["output"]))
    return body


def usage(final: Mapping[str, Any]) -> Json:
    """The ``usage`` of a completion's final dict."""
    summary = final.get("token_summary", {})
    prompt, generated = summary.get("input", 0), final.get("num_tokens", 0)
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": summary.get("cached", 0)},
            "output_tokens": generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + generated}


def status(finish_reason: object) -> tuple[str, Json | None]:
    """``(status, incomplete_details)`` for a finish reason: "length" is incomplete, any other completed."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def message(text: str, state: str, logprobs: list[Json] | None) -> Json:
    """A ``message`` output item: one ``output_text`` part (with ``logprobs`` unless None)."""
    part: Json = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"id": new_id("msg"), "type": "message", "role": "assistant", "status": state, "content": [part]}


def reasoning(text: str) -> Json:
    """A ``reasoning`` output item: one ``reasoning_text`` part."""
    return {"id": new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def function_call(call: Mapping[str, Any]) -> Json:
    """A ``function_call`` output item of one chat tool call."""
    return {"id": new_id("fc"), "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
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
