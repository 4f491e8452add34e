"""OpenAI request bodies -> text-generation inputs (the serving's input dict).

``/v1/chat/completions`` becomes ``{"messages": [...]}`` (the model's chat template is applied by the
serving); ``/v1/completions`` becomes ``{"text": prompt}`` (a list of prompts: a list of inputs).
Sampling fields pass through under the serving's names (``max_tokens`` / ``max_completion_tokens``
-> ``max_new_tokens``, ``chat_template_kwargs.enable_thinking`` -> ``enable_thinking``, ...); a field
left out (or null) is left out of the input, so the serving's default applies. The serving validates
the values and raises ``InvalidInput`` naming the input key (answered 400, ``param`` the OpenAI
field: :func:`._errors.from_exception`). This module checks only the
shape of the OpenAI envelope (messages, prompt, stream, tool_choice, ...), with :class:`APIError`
naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Any, cast

from ..models.text_generation._schema import KEYS
from ..serving._json import JSONObject
from ._errors import APIError

__all__ = ["GUIDED", "MAX_PROMPTS", "PASS", "Call", "chat_call", "completion_call", "messages_of"]

#: Most prompts in one ``/v1/completions`` request (as OpenAI bounds an embeddings request's inputs):
#: a longer list is refused before any of it is parsed or tokenized.
MAX_PROMPTS = 2048

# Text-generation input keys this module sets itself (renamed, or read by the envelope's rules below).
_MAPPED = ("text", "messages", "max_new_tokens", "enable_thinking", "logprobs", "top_logprobs", "n", "response_format",
           "tools", "tool_choice", "parallel_tool_calls", "stream_usage")
#: Every other input key (the schema's): an OpenAI (or vLLM) field of the same name, passed through
#: when present and not null.
PASS = tuple(k for k in KEYS if k not in _MAPPED)
# Fields this server cannot honour (answered 400, naming the field, when set to anything but their
# default): OpenAI's, then vLLM's extensions.
_UNSUPPORTED = {"suffix": None, "best_of": None, "audio": None, "modalities": None,
                "prediction": None, "functions": None, "function_call": None, "reasoning_effort": None,
                "verbosity": None, "web_search_options": None,
                "use_beam_search": False, "length_penalty": 1.0, "skip_special_tokens": True,
                "spaces_between_special_tokens": True, "allowed_token_ids": None,
                "bad_words": None, "logits_processors": None, "return_tokens_as_token_ids": False,
                "add_generation_prompt": True, "continue_final_message": False, "add_special_tokens": None,
                "chat_template": None, "documents": None, "mm_processor_kwargs": None,
                "guided_decoding_backend": None, "guided_whitespace_pattern": None, "request_id": None,
                "cache_salt": None, "vllm_xargs": None, "kv_transfer_params": None, "return_token_ids": None}
# Fields accepted and without effect on the output (OpenAI's bookkeeping).
_IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
#: vLLM's structured-output fields -> the response_format they stand for.
GUIDED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# Every other field a request may carry (the ones read by name below).
_READ = {
    "chat": ("model", "messages", "max_tokens", "max_completion_tokens", "response_format", "tools", "tool_choice",
             "parallel_tool_calls", "chat_template_kwargs", "logprobs", "top_logprobs", "n", "stream",
             "stream_options", "deadline"),
    "completion": ("model", "prompt", "max_tokens", "response_format", "logprobs", "n", "stream", "stream_options",
                   "deadline", "echo"),
}
# Message keys whose null value means "absent" (OpenAI clients send content: null with tool calls).
_MESSAGE_NULLABLE = ("content", "name", "tool_calls", "tool_call_id", "reasoning_content", "refusal",
                     "function_call", "audio")


@dataclass(frozen=True)
class Call:
    """One OpenAI request, mapped. ``input``: the text-generation input (a dict, or a list of dicts
    for a list of prompts); ``stream``: answer with server-sent events; ``include_usage``: a last
    chunk with ``usage`` (``stream_options.include_usage``); ``deadline``: seconds the request may
    take (the ``deadline`` extension field), or None for the server's default; ``n``: completions per
    prompt; ``prompts``: prompts in the request (1 for chat); ``fields``: the request field each
    renamed input key came from (``max_new_tokens`` -> ``max_completion_tokens`` or ``max_tokens``,
    ...), for errors naming the field the client sent; ``continuous_usage``: every chunk carries
    ``usage`` (``stream_options.continuous_usage_stats``, vLLM's); ``echo``: each completion's text
    starts with its prompt (``/v1/completions``), with ``logprobs`` its logprobs cover the prompt's
    tokens first."""

    input: Any
    stream: bool
    include_usage: bool
    deadline: float | None
    n: int
    prompts: int
    fields: dict[str, str]
    continuous_usage: bool = False
    echo: bool = False


def chat_call(body: JSONObject) -> Call:
    """Map a ``/v1/chat/completions`` body. Raises APIError (400, naming the field) for a malformed
    envelope: ``messages`` missing or not a list of message dicts, a content part that is not text,
    a bad ``stream`` / ``stream_options`` / ``tool_choice`` / ``chat_template_kwargs``, or an
    unsupported field."""
    _check_fields(body, "chat")
    spec: dict[str, Any] = {"messages": _messages(body.get("messages"))}
    fields = _sampling(body, spec, max_keys=("max_completion_tokens", "max_tokens"))
    logprobs = _flag(body, "logprobs")
    if logprobs:
        spec["logprobs"] = True
        if body.get("top_logprobs") is not None:
            spec["top_logprobs"] = body["top_logprobs"]
    elif body.get("top_logprobs") is not None:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    _tools(body, spec)
    _template_kwargs(body.get("chat_template_kwargs"), spec)
    return _call(body, spec, 1, fields)


def completion_call(body: JSONObject) -> Call:
    """Map a ``/v1/completions`` body (``prompt``: a string or a list of strings; ``logprobs``: an
    int, the alternatives per token; ``echo``: the prompt's log-probabilities are asked for, as
    ``prompt_logprobs`` (``logprobs`` of them, 0 without), and ``max_tokens`` may be 0). Raises
    APIError (400, naming the field) for a malformed one."""
    _check_fields(body, "completion")
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and 0 < len(prompt) <= MAX_PROMPTS and all(isinstance(p, str) for p in prompt):
        prompts = cast(list[str], prompt)  # every item checked
    else:
        raise APIError(400, f"'prompt' must be a string or a non-empty list of at most {MAX_PROMPTS} strings "
                            "(token-id prompts are not supported)", param="prompt")
    spec: dict[str, Any] = {}
    fields = _sampling(body, spec, max_keys=("max_tokens",))
    fields.update(logprobs="logprobs", top_logprobs="logprobs")  # completions' logprobs is the count
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int):
            raise APIError(400, f"'logprobs' must be an integer (alternatives per token) or null, got {logprobs!r}",
                           param="logprobs")
        spec.update(logprobs=True, top_logprobs=logprobs)
    echo = _flag(body, "echo")
    if echo and "prompt_logprobs" not in spec:
        spec["prompt_logprobs"] = logprobs or 0
    inputs = [{"text": p, **spec} for p in prompts]
    call = _call(body, inputs if isinstance(prompt, list) else inputs[0], len(prompts), fields)
    return dataclasses.replace(call, echo=echo)


def _call(body: dict[str, Any], input: Any, prompts: int, fields: dict[str, str]) -> Call:
    for name, default in _UNSUPPORTED.items():
        if body.get(name, default) not in (default, None) and not (name == "best_of" and body[name] == 1):
            raise APIError(400, f"'{name}' is not supported by this server", param=name)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise APIError(400, "'stream_options' must be an object, and only with 'stream': true",
                       param="stream_options")
    if options and set(options) - {"include_usage", "continuous_usage_stats"}:
        raise APIError(400, "'stream_options' may hold only 'include_usage' and 'continuous_usage_stats' (bools)",
                       param="stream_options")
    include_usage = _flag(options or {}, "include_usage", "stream_options.include_usage")
    continuous = _flag(options or {}, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    for item in (input if isinstance(input, list) else [input]) if continuous else ():
        item["stream_usage"] = True  # each delta carries its token counts
    n = body.get("n")
    if isinstance(n, bool):  # True == 1 in Python: not a count
        raise APIError(400, f"'n' must be an integer, got {n!r}", param="n")
    if n is not None and n != 1:
        for item in input if isinstance(input, list) else [input]:
            item["n"] = n
    return Call(input, stream, include_usage, _deadline(body.get("deadline")),
                n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1, prompts, fields, continuous)


def _sampling(body: dict[str, Any], spec: dict[str, Any], max_keys: tuple[str, ...]) -> dict[str, str]:
    """Copy the sampling fields present in ``body`` into ``spec`` under the serving's names; the
    request field each renamed key came from."""
    fields = {"max_new_tokens": max_keys[-1]}
    for key in max_keys:
        if body.get(key) is not None:
            spec["max_new_tokens"] = body[key]
            fields["max_new_tokens"] = key
            break
    spec.update((k, body[k]) for k in PASS if body.get(k) is not None)
    if body.get("response_format") is not None and body["response_format"] != {"type": "text"}:
        spec["response_format"] = body["response_format"]  # chat and completions alike
    guided = _guided(body)
    if guided is not None:
        if "response_format" in spec:
            raise APIError(400, "give either 'response_format' or one of vLLM's structured-output fields "
                                f"{list(GUIDED)}, not both", param="response_format")
        spec["response_format"] = guided
    if spec.get("top_k") == -1:  # vLLM's spelling of "off" (the serving's is 0)
        del spec["top_k"]
    return fields


_KNOWN = {kind: frozenset((*PASS, *_UNSUPPORTED, *_IGNORED, *GUIDED, *read)) for kind, read in _READ.items()}


def _check_fields(body: dict[str, Any], kind: str) -> None:
    """APIError 400 naming the first field no table above knows: no field is silently dropped."""
    unknown = [k for k in body if k not in _KNOWN[kind]]
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r:.80} in a {kind} request", param=str(unknown[0])[:80])


def _guided(body: dict[str, Any]) -> dict[str, Any] | None:
    """The ``response_format`` that vLLM's ``structured_outputs`` (``{"json" | "regex" | "choice" |
    "grammar" | "json_object": ...}``) or its older ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar`` stand for; None when none is set."""
    present = [k for k in GUIDED if body.get(k) is not None]
    if not present:
        return None
    if len(present) > 1:
        raise APIError(400, f"give only one of {present}", param=present[1])
    field, value = present[0], body[present[0]]
    if field == "structured_outputs":
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if isinstance(value, dict)
                 and value.get(k) is not None]
        if not isinstance(value, dict) or len(kinds) != 1 or set(value) - {kinds[0]}:
            raise APIError(400, "'structured_outputs' must hold exactly one of json, regex, choice, grammar, "
                                "json_object", param=field)
        kind, value = kinds[0], value[kinds[0]]
    else:
        kind = field.removeprefix("guided_")
    return _format_of(kind, value, field)


def _format_of(kind: str, value: Any, field: str) -> dict[str, Any]:
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except ValueError:
                raise APIError(400, f"'{field}' must be a JSON Schema (an object, or its JSON text)", param=field) from None
        if not isinstance(schema, dict):
            raise APIError(400, f"'{field}' must be a JSON Schema (an object, or its JSON text)", param=field)
        return {"type": "json_schema", "json_schema": {"name": "structured_output", "schema": schema}}
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(400, f"'{field}' must be a non-empty list of non-empty strings", param=field)
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in value)
        return {"type": "grammar", "grammar": f"start: {alternatives}\n"}
    if not isinstance(value, str) or not value:
        raise APIError(400, f"'{field}' must be a non-empty string", param=field)
    return {"type": kind, kind: value}


def messages_of(body: JSONObject) -> list[JSONObject]:
    """A request's ``messages`` as the chat template takes them (APIError 400 naming ``messages``)."""
    return _messages(body.get("messages"))


def _messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI messages as the chat template takes them: text content parts joined into one string,
    ``developer`` as ``system``, null optional keys dropped."""
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list of message objects", param="messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise APIError(400, f"messages[{i}] must be an object", param="messages")
        m = {k: v for k, v in message.items() if not (v is None and k in _MESSAGE_NULLABLE)}
        m["content"] = _content(m.get("content", ""), i)
        if m.get("role") == "developer":
            m["role"] = "system"
        m.pop("refusal", None)
        out.append(m)
    return out


def _content(content: Any, i: int) -> Any:
    """A message's content: a string, or a list of ``{"type": "text", "text": str}`` parts (joined)."""
    if not isinstance(content, list):
        return content  # the serving checks it is a string
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"messages[{i}].content[{j}]: only text parts ({{'type': 'text', 'text': str}}) "
                                "are supported", param="messages")
        texts.append(part["text"])
    return "".join(texts)


def _tools(body: dict[str, Any], spec: dict[str, Any]) -> None:
    """``tools`` reach the template unless ``tool_choice`` is "none"; "required" and a named
    function pass through (the serving forces the call's format: ``_forced_calls.tool_call_format``),
    as does ``parallel_tool_calls``."""
    choice = body.get("tool_choice")
    if choice is not None and body.get("tools") is None and choice != "none":
        raise APIError(400, f"'tool_choice' {choice!r:.80} needs 'tools'", param="tool_choice")
    if body.get("tools") is not None and choice != "none":
        spec["tools"] = body["tools"]
        if choice not in (None, "auto"):
            spec["tool_choice"] = choice
        if body.get("parallel_tool_calls") is not None:
            spec["parallel_tool_calls"] = body["parallel_tool_calls"]


def _template_kwargs(kwargs: Any, spec: dict[str, Any]) -> None:
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or set(kwargs) - {"enable_thinking"}:
        raise APIError(400, "'chat_template_kwargs' may hold only 'enable_thinking' (a bool)",
                       param="chat_template_kwargs")
    if kwargs.get("enable_thinking") is not None:
        spec["enable_thinking"] = kwargs["enable_thinking"]


def _flag(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"'{param or name}' must be true, false or null, got {value!r}", param=param or name)
    return value


def _deadline(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise APIError(400, f"'deadline' must be a number of seconds > 0, got {value!r}", param="deadline")
    return float(value)
