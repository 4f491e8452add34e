"""One text-generation input parsed and validated, in the caller: :func:`parse_request` turns a
string or an input dict into a :class:`GenerationRequest` (a frozen msgspec Struct), once.

Each ``_``-less function below reads one group of input keys of the input dict (``spec``) and
raises :class:`~mlx_serving.serving.InvalidInput` (a ValueError) naming the key, in its message and
as its ``param``, for a bad value; None (JSON null) is the default. Used by
``_inputs.preprocess``; the table of keys is in docs/qwen3.md ("Request options").
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from ...serving import InvalidInput
from ...serving._json import JSONObject
from ...tokenization import Tokenizer

from ..generation.sampling import MAX_SEED, SamplingParams, _show
from ._options import GenerationOptions, _stop_tuple
from ._structured import compile_response_format, tool_call_format

__all__ = ["KEYS", "MAX_COMPLETIONS", "MAX_LOGIT_BIAS", "MAX_TOP_LOGPROBS", "ROLES", "GenerationRequest", "RowOutput",
           "completion_params", "completion_seed", "completions", "parse_request", "priority", "sampling_params"]

#: Keys passed to :class:`SamplingParams` under their own name (the serving's options give the
#: defaults of those it has: max_new_tokens, temperature, top_p).
_SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty",
                  "presence_penalty", "frequency_penalty", "min_tokens")
#: The keys SamplingParams checks, in its order (``_culprit``).
_CHECK_ORDER = (*_SAMPLING_KEYS[:-1], "logit_bias", "min_tokens")
#: Every key read here.
KEYS = (*_SAMPLING_KEYS, "logit_bias", "logprobs", "top_logprobs", "n", "response_format", "priority", "tool_choice",
        "parallel_tool_calls", "ignore_eos", "stop_token_ids", "include_stop_str_in_output")
#: Most ``stop_token_ids``: bounds the caller-side check, as ``logit_bias``.
MAX_STOP_TOKEN_IDS = 1024
#: Most completions of one prompt (``n``); as many rows of the batch.
MAX_COMPLETIONS = 16
#: Most alternatives per token (``top_logprobs``), OpenAI's bound.
MAX_TOP_LOGPROBS = 20
#: Most ``logit_bias`` entries: bounds the caller-side check (~1 us each); OpenAI documents no bound.
MAX_LOGIT_BIAS = 1024
_PRIORITY_RANGE = (-(2**63), 2**63)  # a signed 64-bit int: what an engine or a wire format holds
_MAX_ID_DIGITS = 10  # a token id written as a string: at most 2**32 - 1
_KEYS = frozenset(("text", "messages", "stop", "enable_thinking", "tools", *KEYS))

#: Chat roles a message may have (the Qwen3 template renders these four and silently drops any other).
ROLES = ("system", "user", "assistant", "tool")
_MESSAGE_KEYS = frozenset(("role", "content", "reasoning_content", "thinking", "reasoning", "tool_calls", "name",
                           "tool_call_id"))
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
#: Nesting depth of the JSON values in ``tools`` and tool-call arguments (JSON Schemas of real tools
#: nest ~10 deep; the chat template's ``tojson`` and copy are recursive, so depth must be bounded).
MAX_JSON_DEPTH = 32


@dataclass(frozen=True)
class RowOutput:
    """Where one row's output goes and what it carries: ``input`` (index of its input in the
    request) and ``index`` (which of that input's ``n`` completions); ``logprobs``: per-token
    log-probabilities were asked for; ``reasoning``: split ``<think>`` blocks into
    ``reasoning_content`` (``enable_thinking`` true); ``tools``: parse ``<tool_call>`` blocks
    (``tools`` given); ``deltas``: stream dict deltas instead of str pieces (its input asked for
    ``n`` > 1, logprobs, tools or thinking); ``keep_stop``: a matched stop string stays at the end
    of the text (``include_stop_str_in_output``, vLLM's)."""

    input: int = 0
    index: int = 0
    logprobs: bool = False
    reasoning: bool = False
    tools: bool = False
    deltas: bool = False
    keep_stop: bool = False


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One input of the text-generation serving, parsed and validated (:func:`parse_request`).

    ``source``: the input key the prompt came from, "text" or "messages" (the ``param`` of a
    refusal of the prompt); ``text``: the prompt of a plain (non-chat) input, else None;
    ``messages``: the chat messages (a ``chat=True`` serving makes a "text" input one user
    message), else None; ``tools`` (JSON Schema function specs) and ``enable_thinking``: chat
    inputs only; ``chat_chars``: characters of the chat input's strings (messages and tools; 0 for
    plain text), to bound a prompt before it is rendered; ``params``: the row's sampling;
    ``n``: completions (rows) of this prompt; ``priority``: lower runs sooner under the "priority"
    policy; ``stop``: stop strings; ``output``: what its rows return; ``max_new_tokens_given``:
    the input set ``max_new_tokens`` (so a prompt + max_new_tokens over max_len may blame it)."""

    source: str
    text: str | None
    messages: list[JSONObject] | None
    tools: list[JSONObject] | None
    enable_thinking: bool | None
    chat_chars: int
    params: SamplingParams
    n: int
    priority: int
    stop: tuple[str, ...]
    output: RowOutput
    max_new_tokens_given: bool

    @property
    def chat(self) -> bool:
        """The prompt is rendered by the chat template."""
        return self.messages is not None


def parse_request(item: object, tokenizer: Tokenizer, opts: GenerationOptions) -> GenerationRequest:
    """``item`` (a string, ``{"text": ...}`` or ``{"messages": [...]}`` with per-request keys, see
    ``_inputs.preprocess``) as a :class:`GenerationRequest`, every key checked once. Raises
    InvalidInput naming the key at fault (its ``param``), or naming none for an item that is not a
    string or a dict with exactly one of "text" and "messages"."""
    spec = _as_dict(item)
    params = sampling_params(spec, tokenizer, opts)
    n, rank = completions(spec), priority(spec)
    stop = opts.stop
    if spec.get("stop") is not None:
        with _blame("stop"):
            stop = _stop_tuple(spec["stop"])
    chat = "messages" in spec or opts.chat
    for key in ("enable_thinking", "tools", "tool_choice"):
        if spec.get(key) is not None and not chat:
            raise InvalidInput(f"'{key}' applies to chat inputs only: send 'messages' (or build the serving with "
                               "chat=True)", key)
    thinking = spec.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise InvalidInput(f"'enable_thinking' must be true, false or null, got {_show(thinking)}", "enable_thinking")
    source = "messages" if "messages" in spec else "text"
    text: str | None = None
    messages: list[JSONObject] | None = None
    tools, chars = spec.get("tools"), 0
    if chat:
        messages = spec["messages"] if "messages" in spec else [{"role": "user", "content": _text(spec["text"])}]
        with _blame(source):
            chars = _check_messages(messages)
        chars += _check_tools(tools)
    else:
        text = _text(spec["text"])
    return GenerationRequest(
        source=source, text=text, messages=messages, tools=tools, enable_thinking=thinking, chat_chars=chars,
        params=params, n=n, priority=rank, stop=stop, output=_output(spec, chat, thinking, params, n),
        max_new_tokens_given=spec.get("max_new_tokens") is not None)


def _check_tools(tools: object) -> int:
    """Characters of ``tools`` (None: 0); InvalidInput naming "tools" unless a list of JSON dicts."""
    if tools is None:
        return 0
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidInput(f"'tools' must be a list of tool dicts (JSON Schema function specs), got {_show(tools)}",
                           "tools")
    with _blame("tools"):
        return _json_chars(tools, "'tools'")


def sampling_params(spec: dict[str, Any], tokenizer: Tokenizer, opts: GenerationOptions) -> SamplingParams:
    """The row's :class:`SamplingParams`: the request's keys over the serving's defaults.

    ``logit_bias``: ``{token id: bias}``, ids as ints or decimal strings (JSON object keys), each in
    ``[0, tokenizer.vocab_size)``, biases in [-100, 100], at most :data:`MAX_LOGIT_BIAS` entries.
    ``logprobs``: a bool; ``top_logprobs``: an int in [0, 20], only with ``logprobs`` true.
    ``response_format``: OpenAI's shape, compiled to a grammar (``_structured``); ``tool_choice``
    "required" or a named function (with ``tools``; ``parallel_tool_calls`` false: one call) compiles
    to the grammar of a forced call instead (:func:`~._structured.tool_call_format`).
    ``ignore_eos`` (a bool, vLLM's): the tokenizer's EOS ids do not end the row (it runs to
    ``max_new_tokens``, a stop string or a stop token); ``stop_token_ids`` (vLLM's): a list of
    ids in ``[0, vocab_size)``, at most :data:`MAX_STOP_TOKEN_IDS`, that end the row as EOS does
    (the id is the row's last token). Raises InvalidInput naming the key (its ``param``)."""
    values = {k: spec[k] if spec.get(k) is not None else getattr(opts, k, None) for k in _SAMPLING_KEYS}
    kwargs = {k: v for k, v in values.items() if v is not None}
    if spec.get("logit_bias") is not None:
        kwargs["logit_bias"] = _logit_bias(spec["logit_bias"], tokenizer.vocab_size)
    kwargs["logprobs"] = _logprobs(spec.get("logprobs"), spec.get("top_logprobs"))
    kwargs["grammar"] = _grammar(spec)
    eos = _stop_ids(spec, tokenizer)
    try:
        return SamplingParams(eos_token_ids=eos, **kwargs)
    except ValueError as exc:
        raise InvalidInput(str(exc), _culprit(kwargs)) from None


def _culprit(kwargs: dict[str, Any]) -> str | None:
    """The key of ``kwargs`` that SamplingParams refuses (after :func:`sampling_params` failed to
    build one, so the first key its message names): each key is tried alone, in the order
    SamplingParams checks them (``min_tokens`` with ``max_new_tokens``: its range depends on it);
    None if each passes alone. Runs only on the failure path."""
    for key in _CHECK_ORDER:
        if key not in kwargs:
            continue
        probe = {key: kwargs[key]}
        if key == "min_tokens" and "max_new_tokens" in kwargs:
            probe["max_new_tokens"] = kwargs["max_new_tokens"]
        try:
            SamplingParams(**probe)
        except ValueError:
            return key
    return None


def _stop_ids(spec: dict[str, Any], tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids that end the row: the tokenizer's EOS (unless ``ignore_eos``) and ``stop_token_ids``."""
    ignore = spec.get("ignore_eos")
    if ignore is not None and not isinstance(ignore, bool):
        raise InvalidInput(f"ignore_eos must be true, false or null, got {_show(ignore)}", "ignore_eos")
    ids = set() if ignore else set(tokenizer.eos_token_ids)
    extra = spec.get("stop_token_ids")
    if extra is not None:
        if not isinstance(extra, (list, tuple)) or len(extra) > MAX_STOP_TOKEN_IDS:
            raise InvalidInput(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids, got "
                               f"{_show(extra)}", "stop_token_ids")
        for i in extra:
            if not _is_int(i) or not 0 <= i < tokenizer.vocab_size:
                raise InvalidInput(f"stop_token_ids: {_show(i)} is not a token id in [0, {tokenizer.vocab_size})",
                                   "stop_token_ids")
        ids |= {int(i) for i in extra}
    return tuple(sorted(ids))


def _grammar(spec: dict[str, Any]) -> str | None:
    """The grammar of the request's ``response_format``, or of the one its ``tool_choice`` forces."""
    choice, parallel = spec.get("tool_choice"), spec.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidInput(f"parallel_tool_calls must be true, false or null, got {_show(parallel)}",
                           "parallel_tool_calls")
    if choice in (None, "auto", "none"):
        return compile_response_format(spec.get("response_format"))
    tools = spec.get("tools")
    if not isinstance(tools, list) or not tools:
        raise InvalidInput(f"tool_choice {_show(choice)} needs 'tools' (a non-empty list of tool dicts)",
                           "tool_choice")
    if spec.get("response_format") is not None:
        raise InvalidInput("tool_choice 'required' or a named function forces the output's format: it cannot be "
                           "combined with response_format", "tool_choice")
    forced = tool_call_format(tools, choice, parallel is not False)
    try:
        return compile_response_format(forced)
    except ValueError as exc:
        raise InvalidInput(f"tools: a function's parameters schema cannot be compiled for tool_choice: {exc}",
                           "tools") from None


def completions(spec: dict[str, Any]) -> int:
    """``n``: how many completions of this prompt, an int in [1, 16] (default 1)."""
    n = spec.get("n")
    if n is None:
        return 1
    if not _is_int(n) or not 1 <= n <= MAX_COMPLETIONS:
        raise InvalidInput(f"n must be an integer in [1, {MAX_COMPLETIONS}], got {_show(n)}", "n")
    return int(n)


def priority(spec: dict[str, Any]) -> int:
    """``priority``: an int in [-2**63, 2**63) (default 0; lower runs sooner under the "priority"
    scheduling policy, as in vLLM)."""
    value = spec.get("priority")
    if value is None:
        return 0
    if not _is_int(value) or not _PRIORITY_RANGE[0] <= value < _PRIORITY_RANGE[1]:
        raise InvalidInput(f"priority must be an integer in [-2**63, 2**63), got {_show(value)}", "priority")
    return int(value)


def completion_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a request with ``seed`` and ``n > 1``: the first 64-bit
    word of ``numpy.random.SeedSequence([seed, index])`` (distinct streams per completion and per
    seed, unlike ``seed + index``). An int in [0, 2**64)."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1, np.uint64)[0]) % MAX_SEED


def completion_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per completion: ``params`` itself when ``n == 1``; else a seeded request
    gets :func:`completion_seed` per completion, an unseeded one fresh entropy per row."""
    if n == 1 or params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=completion_seed(params.seed, i)) for i in range(n)]


def _logprobs(logprobs: Any, top: Any) -> int | None:
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidInput(f"logprobs must be true, false or null, got {_show(logprobs)}", "logprobs")
    if top is None:
        return 0 if logprobs else None
    if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidInput(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {_show(top)}",
                           "top_logprobs")
    if not logprobs:
        raise InvalidInput("top_logprobs needs logprobs: true", "top_logprobs")
    return int(top)


def _logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    """``{id or decimal string: bias}`` -> ``{id: bias}`` (biases are checked by SamplingParams)."""
    if not isinstance(value, dict):
        raise InvalidInput(f"logit_bias must be an object {{token id: bias}}, got {_show(value)}", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidInput(f"logit_bias has {len(value):,} entries; at most {MAX_LOGIT_BIAS} are allowed",
                           "logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = _token_id(key)
        if token is None or not 0 <= token < vocab_size:
            raise InvalidInput(f"logit_bias keys must be token ids in [0, {vocab_size}) (ints or decimal strings), "
                               f"got {_show(key)}", "logit_bias")
        if token in out:
            raise InvalidInput(f"logit_bias names token {token} twice", "logit_bias")
        out[token] = bias
    return out


def _token_id(key: Any) -> int | None:
    if _is_int(key):
        return int(key)
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= _MAX_ID_DIGITS:
        return int(key)
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _output(spec: dict[str, Any], chat: bool, thinking: bool | None, params: SamplingParams, n: int) -> RowOutput:
    """What the rows of this input return (see :class:`RowOutput`)."""
    logprobs = params.logprobs is not None
    reasoning = chat and thinking is True
    tools = chat and bool(spec.get("tools"))
    keep = spec.get("include_stop_str_in_output")
    if keep is not None and not isinstance(keep, bool):
        raise InvalidInput(f"include_stop_str_in_output must be true, false or null, got {_show(keep)}",
                           "include_stop_str_in_output")
    return RowOutput(logprobs=logprobs, reasoning=reasoning, tools=tools,
                     deltas=n > 1 or logprobs or reasoning or tools, keep_stop=bool(keep))



def _as_dict(item: Any) -> dict[str, Any]:
    if isinstance(item, str):
        return {"text": item}
    if not isinstance(item, dict):
        raise InvalidInput(f"expected a string or a dict with 'text' or 'messages', got {type(item).__name__}")
    unknown = set(item) - _KEYS
    if unknown:
        named = min((k[:80] for k in unknown if isinstance(k, str)), default=None)  # a key may be huge
        raise InvalidInput(f"unknown input keys {_keys(unknown)} (allowed: {sorted(_KEYS)})", named)
    if ("text" in item) == ("messages" in item):
        raise InvalidInput("an input dict needs exactly one of 'text' or 'messages'")
    return item



@contextmanager
def _blame(param: str) -> Iterator[None]:
    """Re-raise a plain ValueError of the block (a TokenizationError, ...) as InvalidInput naming
    ``param``, same message, the original as ``__cause__``; an InvalidInput passes as it is."""
    try:
        yield
    except InvalidInput:
        raise
    except ValueError as exc:
        raise InvalidInput(str(exc), param) from exc



def _keys(keys: set[Any]) -> str:
    """``['a', 'b']`` for any keys (mixed types do not sort; a key may be huge)."""
    return "[" + ", ".join(sorted(_show(k) for k in keys)[:10]) + (", ...]" if len(keys) > 10 else "]")



def _check_messages(messages: Any) -> int:
    """ValueError naming the message and field unless ``messages`` is what the chat template takes;
    returns the characters of its strings."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {'role', 'content'} dicts")
    chars = 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{where} must be a {{'role', 'content'}} dict, got {type(m).__name__}")
        unknown = set(m) - _MESSAGE_KEYS
        if unknown:
            raise ValueError(f"{where}: unknown keys {_keys(unknown)} (allowed: {sorted(_MESSAGE_KEYS)})")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"{where}: 'role' must be one of {list(ROLES)}, got {_show(role)}")
        content = m.get("content")
        if not isinstance(content, str):
            raise ValueError(f"{where}: 'content' must be a string, got {_show(content)}")
        chars += len(content)
        for key in (*_REASONING_KEYS, "name", "tool_call_id"):
            value = m.get(key)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{where}: '{key}' must be a string, got {_show(value)}")
            chars += len(value or "")
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant":
                raise ValueError(f"{where}: 'tool_calls' are for assistant messages only (role is {role!r})")
            if not isinstance(calls, list):
                raise ValueError(f"{where}: 'tool_calls' must be a list of dicts, got {_show(calls)}")
            for j, call in enumerate(calls):
                _check_tool_call(call, f"{where}.tool_calls[{j}]")
            chars += _json_chars(calls, f"{where}: 'tool_calls'")
    return chars


def _check_tool_call(call: Any, where: str) -> None:
    function = call.get("function", call) if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise ValueError(f"{where} must be a dict: {{'function': {{'name', 'arguments'}}}} or {{'name', 'arguments'}}")
    if not isinstance(function.get("name"), str):
        raise ValueError(f"{where}: 'name' must be a string, got {_show(function.get('name'))}")
    if not isinstance(function.get("arguments"), (str, dict)):
        raise ValueError(f"{where}: 'arguments' must be a JSON string or an object, "
                         f"got {_show(function.get('arguments'))}")


def _json_chars(value: Any, where: str) -> int:
    """Characters of the strings in a JSON-like ``value`` (str, int, float, bool, None, lists,
    dicts with string keys, at most MAX_JSON_DEPTH deep); ValueError naming ``where`` otherwise.
    Iterative: a deeply nested or self-containing value costs no recursion."""
    chars = 0
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            chars += len(v)
        elif v is None or isinstance(v, (bool, int, float)):
            chars += 1
        elif isinstance(v, (dict, list, tuple)):
            if depth >= MAX_JSON_DEPTH:
                raise ValueError(f"{where} nests deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(v, dict):
                for k in v:
                    if not isinstance(k, str):
                        raise ValueError(f"{where}: object keys must be strings, got {_show(k)}")
                    chars += len(k)
                stack.extend((x, depth + 1) for x in v.values())
            else:
                stack.extend((x, depth + 1) for x in v)
        else:
            raise ValueError(f"{where} must hold JSON values only (str, number, bool, null, list, dict), "
                             f"got {type(v).__name__}")
    return chars



def _text(text: Any) -> str:
    if not isinstance(text, str):
        raise InvalidInput(f"'text' must be a string, got {type(text).__name__}", "text")
    if not text:
        raise InvalidInput("empty prompt: 'text' must contain at least one character", "text")
    return text
