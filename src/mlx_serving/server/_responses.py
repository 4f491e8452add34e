"""Serving results and stream items -> OpenAI response objects and stream chunks.

A text-generation result is ``{"results": [entry, ...]}`` (``n`` entries; a list input gives a list of
those), an entry ``{"generated_text", "num_tokens", "finish_reason", "token_summary": {"input",
"output"}, "timing", ["logprobs", "reasoning_content", "tool_calls"]}``. A stream yields, per row,
text pieces (``str``) or delta dicts (``content`` / ``reasoning_content`` / ``tool_calls`` /
``logprobs``, with ``index``: which of the ``n`` completions), and one final dict per completion
(``finish_reason``, ``num_tokens``, ``token_summary``, ``timing``); a list input wraps each item as
``(row, item)``. OpenAI's choice index is ``row * n + index``. A completion asking for the prompt's
log-probabilities has ``prompt_logprobs`` entries (one per prompt token, the first with logprob
None): in its result entry, and streamed as its first delta. They become the echoed prompt's part
of a completions ``logprobs`` object (:class:`Echo`) and vLLM's ``prompt_logprobs`` field.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Final, Literal, NotRequired, TypeAlias, TypedDict

from ..serving._json import JSON, JSONObject

__all__ = ["MIN_LOGPROB", "Echo", "Entry", "Event", "Kind", "Result", "StreamDict", "StreamItem", "StreamState",
           "chat_logprobs", "chat_response", "completion_logprobs", "completion_response", "event", "new_id", "usage",
           "vllm_prompt_logprobs"]

Kind = Literal["chat", "completion"]
#: The log-probability sent for -inf (JSON has no infinity; vLLM's value).
MIN_LOGPROB = -9999.0
_DELTA_KEYS: Final = ("content", "reasoning_content", "tool_calls")


class Entry(TypedDict):
    """One completion of a text-generation result (see the module docstring)."""

    generated_text: str
    num_tokens: int
    finish_reason: str
    token_summary: dict[str, int]
    timing: NotRequired[JSONObject]
    logprobs: NotRequired[list[dict[str, Any]]]
    reasoning_content: NotRequired[str]
    tool_calls: NotRequired[list[dict[str, Any]]]
    prompt_logprobs: NotRequired[list[dict[str, Any]]]


class Result(TypedDict):
    """A (non-list) text-generation result: its ``n`` completions."""

    results: list[Entry]


class StreamDict(TypedDict, total=False):
    """A stream's delta dict or final dict (see the module docstring)."""

    index: int
    content: str
    reasoning_content: str
    tool_calls: list[dict[str, Any]]
    logprobs: list[dict[str, Any]]
    prompt_logprobs: list[dict[str, Any]]
    finish_reason: str
    num_tokens: int
    token_summary: dict[str, int]
    timing: JSONObject


#: One stream item: a text piece or a dict; a list input's are ``(row, item)`` pairs.
StreamItem: TypeAlias = str | StreamDict | tuple[int, str | StreamDict]


@dataclass(frozen=True)
class Echo:
    """What a request asked of its prompts: ``prompts``, each prompt's text when the completions
    request set ``echo`` (its choices' text starts with it; empty otherwise); ``logprobs``: echo
    with ``logprobs`` (the choices' logprobs object covers the prompt's tokens, then the generated
    ones); ``vllm``: the client sent vLLM's ``prompt_logprobs`` (the choices carry that field, as
    :func:`vllm_prompt_logprobs`)."""

    prompts: tuple[str, ...] = ()
    logprobs: bool = False
    vllm: bool = False


def new_id(kind: Kind) -> str:
    """A response id: ``chatcmpl-<hex>`` or ``cmpl-<hex>``."""
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


@dataclass(frozen=True)
class Event:
    """One stream item, normalized: ``choice`` (OpenAI's choice index), ``delta`` (``content``,
    ``reasoning_content``, ``tool_calls``; only those present), ``logprobs`` (entries of this item, or
    None), ``final`` (the completion's final dict on its last item, else None)."""

    choice: int
    delta: dict[str, Any]
    logprobs: list[dict[str, Any]] | None
    final: StreamDict | None
    tokens: dict[str, int] | None = None  #: ``{"input", "output"}`` so far (``stream_usage`` deltas, finals)
    prompt: list[dict[str, Any]] | None = None  #: the prompt's logprob entries (its first item), or None


def event(item: StreamItem, is_list: bool, n: int) -> Event:
    """Normalize one stream item (see the module docstring)."""
    if is_list:
        assert isinstance(item, tuple)  # a list input's items are (row, item) pairs
        row, value = item
    else:
        assert not isinstance(item, tuple)  # a single input's items: text pieces and dicts
        row, value = 0, item
    if isinstance(value, str):
        return Event(row * n, {"content": value}, None, None)
    index = value.get("index", 0)
    delta = {k: value[k] for k in _DELTA_KEYS if value.get(k)}
    final = value if "finish_reason" in value else None
    return Event(row * n + index, delta, value.get("logprobs") if final is None else None, final,
                 value.get("token_summary"), value.get("prompt_logprobs"))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> JSONObject:
    """OpenAI's ``usage`` object; ``prompt_tokens_details.cached_tokens`` when the engine reports
    prefix-cache hits (the paged KV cache)."""
    out: JSONObject = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def _entries(result: Any) -> list[list[dict[str, Any]]]:
    """Per prompt, its completions' entries."""
    return [r["results"] for r in (result if isinstance(result, list) else [result])]


def _usage_of(per_prompt: list[list[dict[str, Any]]]) -> dict[str, Any]:
    firsts = [entries[0]["token_summary"] for entries in per_prompt if entries]
    cached = [t["cached"] for t in firsts if "cached" in t]
    return usage(sum(t["input"] for t in firsts), sum(e["num_tokens"] for entries in per_prompt for e in entries),
                 sum(cached) if cached else None)


def _envelope(rid: str, model: str, obj: str) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model}


def chat_response(result: JSON, model: str, rid: str, echo: Echo = Echo()) -> JSONObject:
    """A ``chat.completion`` object from a (non-list) text-generation result (with ``echo.vllm``,
    vLLM's top-level ``prompt_logprobs``: the rendered prompt's)."""
    entries = _entries(result)
    choices = []
    for i, e in enumerate(entries[0]):
        message: dict[str, Any] = {"role": "assistant", "content": e["generated_text"]}
        if e.get("reasoning_content"):
            message["reasoning_content"] = e["reasoning_content"]
        if e.get("tool_calls"):
            message["tool_calls"] = e["tool_calls"]
            message["content"] = e["generated_text"] or None
        logprobs = {"content": chat_logprobs(e["logprobs"])} if e.get("logprobs") is not None else None
        choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": e["finish_reason"]})
    out = {**_envelope(rid, model, "chat.completion"), "choices": choices, "usage": _usage_of(entries)}
    prompt = entries[0][0].get("prompt_logprobs") if entries[0] else None
    if echo.vllm and prompt is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(prompt)
    return out


def completion_response(result: JSON, model: str, rid: str, echo: Echo = Echo()) -> JSONObject:
    """A ``text_completion`` object from a text-generation result (a list result: one per prompt);
    ``echo``: what the request asked of its prompts."""
    entries = _entries(result)
    choices: list[JSON] = []
    for p, prompt_entries in enumerate(entries):
        for e in prompt_entries:
            choices.append(_completion_choice(len(choices), e, echo.prompts[p] if echo.prompts else None, echo))
    return {**_envelope(rid, model, "text_completion"), "choices": choices,
            "usage": _usage_of(entries)}


def _completion_choice(index: int, e: dict[str, Any], prompt: str | None, echo: Echo) -> JSONObject:
    """One completions choice; ``prompt``: the echoed prompt's text (None: no echo)."""
    entries, prompt_entries = e.get("logprobs"), e.get("prompt_logprobs")
    if prompt is not None and entries is not None and prompt_entries is not None:
        entries = prompt_entries + entries
    logprobs = completion_logprobs(entries, 0) if entries is not None else None
    choice: JSONObject = {"index": index, "text": (prompt or "") + e["generated_text"], "logprobs": logprobs,
                          "finish_reason": e["finish_reason"]}
    if echo.vllm and prompt_entries is not None:
        choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_entries)
    return choice


def vllm_prompt_logprobs(entries: list[dict[str, Any]]) -> list[JSON]:
    """The serving's prompt logprob entries in vLLM's ``prompt_logprobs`` shape: None for the first
    token, then per token ``{token_id (str): {"logprob", "rank", "decoded_token"}}``, the prompt's
    token first, then its alternatives (rank 1 = most probable; the prompt's token has the rank of
    its place among them, None when it is not one)."""
    out: list[JSON] = [None]
    for e in entries[1:]:
        top = e.get("top_logprobs") or []
        ranks = {t["token_id"]: r for r, t in enumerate(top, 1)}
        one: dict[str, JSON] = {str(e["token_id"]): {"logprob": _logprob(e["logprob"]), "rank": ranks.get(e["token_id"]),
                                                     "decoded_token": e["token"]}}
        for r, t in enumerate(top, 1):
            one.setdefault(str(t["token_id"]), {"logprob": _logprob(t["logprob"]), "rank": r,
                                                "decoded_token": t["token"]})
        out.append(one)
    return out


def _logprob(value: float | None) -> float | None:
    """A log-probability JSON can carry: -inf (a masked token) becomes -9999.0, as vLLM sends it."""
    return None if value is None else max(value, MIN_LOGPROB)


def chat_logprobs(entries: list[dict[str, Any]]) -> list[JSONObject]:
    """The serving's logprob entries as OpenAI chat ``logprobs.content`` items."""
    def one(e: dict[str, Any]) -> dict[str, Any]:
        return {"token": e["token"], "logprob": _logprob(e["logprob"]), "bytes": list(e["token"].encode("utf-8"))}
    return [{**one(e), "top_logprobs": [one(t) for t in e.get("top_logprobs") or []]} for e in entries]


def completion_logprobs(entries: list[dict[str, Any]], offset: int) -> JSONObject:
    """The serving's logprob entries as OpenAI completions ``logprobs`` (``text_offset`` from
    ``offset``); an entry without a logprob (a prompt's first token) has ``top_logprobs`` None."""
    offsets: list[JSON] = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [_logprob(e["logprob"]) for e in entries],
            "top_logprobs": [None if e["logprob"] is None else
                             {t["token"]: _logprob(t["logprob"]) for t in e.get("top_logprobs") or []}
                             for e in entries],
            "text_offset": offsets}


@dataclass
class StreamState:
    """One streamed response: its id, the finals seen so far (per choice), tool calls and text
    offsets per choice, and the chunks' JSON."""

    kind: Kind
    model: str
    is_list: bool
    n: int
    choices: int
    rid: str = ""
    continuous_usage: bool = False  #: every chunk carries ``usage`` (``stream_options.continuous_usage_stats``)
    echo: Echo = Echo()  #: what the request asked of its prompts (sent with each choice's prompt entries)
    created: int = field(default_factory=lambda: int(time.time()))
    finals: dict[int, StreamDict] = field(default_factory=dict)
    _tokens: dict[int, dict[str, int]] = field(default_factory=dict)
    _calls: dict[int, int] = field(default_factory=dict)
    _offsets: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rid = self.rid or new_id(self.kind)

    @property
    def done(self) -> bool:
        """Every choice has its final."""
        return len(self.finals) == self.choices

    def first_chunks(self) -> list[str]:
        """Chat: one chunk per choice announcing the assistant role (as OpenAI sends first)."""
        if self.kind != "chat":
            return []
        return [self._chunk(i, {"role": "assistant", "content": ""}, None, None) for i in range(self.choices)]

    def chunks(self, ev: Event) -> list[str]:
        """The SSE data (JSON) of one stream item (normalized by :func:`event`): zero or one chunk."""
        if ev.final is not None:
            self.finals[ev.choice] = ev.final
        if ev.tokens is not None:
            self._tokens[ev.choice] = ev.tokens
        if ev.prompt is not None:
            return [self._prompt_chunk(ev.choice, ev.prompt)]
        if not ev.delta and ev.logprobs is None and ev.final is None:
            return []
        return [self._chunk(ev.choice, self._delta(ev), ev.logprobs, ev.final)]

    def _prompt_chunk(self, choice: int, entries: list[dict[str, Any]]) -> str:
        """A choice's first chunk when its prompt's logprobs came: the echoed prompt (completions
        ``echo``; with ``logprobs``, the prompt's entries) and vLLM's ``prompt_logprobs`` when asked."""
        echo = self.echo
        text = echo.prompts[choice // self.n] if echo.prompts else ""
        return self._chunk(choice, {"content": text} if text else {}, entries if text and echo.logprobs else None,
                           None, vllm_prompt_logprobs(entries) if echo.vllm else None)

    def _usage_so_far(self) -> JSONObject:
        """``usage`` of the tokens generated so far (each prompt's tokens counted once)."""
        prompts = {choice // self.n: t.get("input", 0) for choice, t in sorted(self._tokens.items())}
        return usage(sum(prompts.values()), sum(t.get("output", 0) for t in self._tokens.values()))

    def usage_chunk(self) -> str:
        """The last chunk of ``stream_options.include_usage``: no choices, the usage."""
        prompts: dict[int, dict[str, int]] = {}
        for choice, final in sorted(self.finals.items()):
            prompts.setdefault(choice // self.n, final.get("token_summary", {}))
        generated = sum(f.get("num_tokens", 0) for f in self.finals.values())
        cached = [t["cached"] for t in prompts.values() if "cached" in t]
        body = {**self._envelope(), "choices": [],
                "usage": usage(sum(t.get("input", 0) for t in prompts.values()), generated,
                               sum(cached) if cached else None)}
        return json.dumps(body, ensure_ascii=False)

    def _delta(self, ev: Event) -> dict[str, Any]:
        delta = dict(ev.delta)
        if "tool_calls" in delta:
            calls = []
            for call in delta["tool_calls"]:
                k = self._calls.get(ev.choice, 0)
                self._calls[ev.choice] = k + 1
                calls.append({"index": k, **call})
            delta["tool_calls"] = calls
        return delta

    def _envelope(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def _chunk(self, choice: int, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None,
               final: StreamDict | None, prompt_logprobs: list[JSON] | None = None) -> str:
        finish = None if final is None else final["finish_reason"]
        if self.kind == "chat":
            lp: dict[str, Any] | None = None if logprobs is None else {"content": chat_logprobs(logprobs)}
            body: dict[str, Any] = {"index": choice, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            offset = self._offsets.get(choice, 0)
            lp = None if logprobs is None else completion_logprobs(logprobs, offset)
            self._offsets[choice] = offset + len(delta.get("content", ""))
            body = {"index": choice, "text": delta.get("content", ""), "logprobs": lp, "finish_reason": finish}
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        out = {**self._envelope(), "choices": [body]}
        if self.continuous_usage:
            out["usage"] = self._usage_so_far()
        return json.dumps(out, ensure_ascii=False)
