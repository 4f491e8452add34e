"""One text-generation input parsed and validated, in the caller: :func:`parse_request` decodes a
string or an input dict with the schema (``_schema.decode``: every key's type and range) and
checks what the schema cannot (rules between keys, against the tokenizer and the serving's
options, each chat message) into a :class:`GenerationRequest`, once. Every refusal is
:class:`~mlx_serving.serving.InvalidInput` (a ValueError) naming the key, in its message and as
its ``param``. Used by ``_inputs.preprocess``; the table of keys is in docs/qwen3.md ("Request
options").
"""

from __future__ import annotations

import dataclasses
import re
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
from ._schema import KEYS, GenerationInput, _keys, decode
from ._forced_calls import tool_call_format
from ._structured import compile_response_format

__all__ = ["ROLES", "GenerationRequest", "RowOutput", "completion_params", "completion_seed", "parse_request"]

#: Keys passed to :class:`SamplingParams` as they are (None: the serving's default, where it has one).
_SAMPLING_KEYS = tuple(k for k in KEYS if k in {f.name for f in dataclasses.fields(SamplingParams)}
                       and k not in ("logit_bias", "logprobs"))
_CHAT_ONLY = ("enable_thinking", "tools", "tool_choice")
_MAX_ID_DIGITS = 10  # a token id written as a string: at most 2**32 - 1

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
    ``n`` > 1, logprobs, tools, thinking or stream usage); ``keep_stop``: a matched stop string stays
    at the end of the text (``include_stop_str_in_output``, vLLM's); ``usage``: each delta carries
    ``token_summary`` (the prompt's tokens and those generated so far: ``stream_usage``);
    ``prompt_logprobs``: its first delta carries the prompt's log-probabilities (deltas too); ``forced``:
    ``tool_choice`` forces the turn's tool calls (its text is calls only: no content, and a call
    repeating an earlier one ends the row, see ``_outputs.RowParser``)."""

    input: int = 0
    index: int = 0
    logprobs: bool = False
    reasoning: bool = False
    tools: bool = False
    deltas: bool = False
    keep_stop: bool = False
    usage: bool = False
    prompt_logprobs: bool = False
    forced: bool = False


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
    the input set ``max_new_tokens`` (so a prompt + max_new_tokens over max_len may blame it; when it
    did not, ``params.max_new_tokens`` is the serving's default, capped to fit once the prompt is
    tokenized); ``truncate_prompt_tokens``: keep only the prompt's last N tokens (-1: as many as
    fit), or None;
    ``prompt_logprobs``: alternatives per prompt token when the prompt's log-probabilities are asked
    for, else None; ``generate``: False when ``max_new_tokens`` is 0 (score the prompt only;
    ``params.max_new_tokens`` is then 1, unused)."""

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
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    generate: bool = True

    @property
    def chat(self) -> bool:
        """The prompt is rendered by the chat template."""
        return self.messages is not None


def parse_request(item: object, tokenizer: Tokenizer, opts: GenerationOptions) -> GenerationRequest:
    """``item`` (a string, ``{"text": ...}`` or ``{"messages": [...]}`` with per-request keys: the
    fields of ``_schema.GenerationInput``) as a :class:`GenerationRequest`, every key checked once.
    Raises InvalidInput naming the key at fault (its ``param``), or naming none for an item that is
    not a string or a dict with exactly one of "text" and "messages"."""
    spec = decode(item)
    chat = isinstance(spec.messages, list) or opts.chat
    for key in _CHAT_ONLY:
        if getattr(spec, key) is not None and not chat:
            raise InvalidInput(f"'{key}' applies to chat inputs only: send 'messages' (or build the serving with "
                               "chat=True)", key)
    generate = spec.max_new_tokens != 0
    if not generate:
        _check_score_only(spec)
        spec = msgspec.structs.replace(spec, max_new_tokens=1)  # SamplingParams' least; nothing is generated
    params = sampling_params(spec, tokenizer, opts)
    stop = opts.stop
    if spec.stop is not None:
        with _blame("stop"):
            stop = _stop_tuple(spec.stop)
    source = "messages" if isinstance(spec.messages, list) else "text"
    text = spec.text if isinstance(spec.text, str) else None
    messages: list[JSONObject] | None = None
    chars = 0
    if chat:
        messages = spec.messages if isinstance(spec.messages, list) else [{"role": "user", "content": text}]
        with _blame(source):
            chars = _check_messages(messages)
        with _blame("tools"):
            chars += _json_chars(spec.tools or [], "'tools'")
        text = None
    n = 1 if spec.n is None else spec.n
    if spec.truncate_prompt_tokens == 0:
        raise InvalidInput("truncate_prompt_tokens must be -1 or an integer >= 1, got 0", "truncate_prompt_tokens")
    return GenerationRequest(
        source=source, text=text, messages=messages, tools=spec.tools, enable_thinking=spec.enable_thinking,
        chat_chars=chars, params=params, n=n, priority=spec.priority or 0, stop=stop,
        output=_output(spec, chat, params, n), max_new_tokens_given=spec.max_new_tokens is not None,
        truncate_prompt_tokens=spec.truncate_prompt_tokens, prompt_logprobs=spec.prompt_logprobs,
        generate=generate)


def _check_score_only(spec: GenerationInput) -> None:
    """``max_new_tokens`` 0 (score the prompt, generate nothing) needs ``prompt_logprobs`` and
    leaves ``min_tokens`` at 0; InvalidInput naming the key otherwise."""
    if spec.prompt_logprobs is None:
        raise InvalidInput("max_new_tokens must be >= 1, or 0 with prompt_logprobs (score the prompt only), got 0",
                           "max_new_tokens")
    if spec.min_tokens:
        raise InvalidInput(f"min_tokens must be 0 when max_new_tokens is 0, got {_show(spec.min_tokens)}",
                           "min_tokens")


def sampling_params(spec: GenerationInput, tokenizer: Tokenizer, opts: GenerationOptions) -> SamplingParams:
    """The row's :class:`SamplingParams`: the request's keys over the serving's defaults.

    ``logit_bias`` ids (ints or decimal strings, JSON object keys) must be in ``[0,
    tokenizer.vocab_size)``; ``logprobs`` true gives ``top_logprobs`` alternatives (0 by default).
    ``response_format``: OpenAI's shape, compiled to a grammar (``_structured``); ``tool_choice``
    "required" or a named function (with ``tools``; ``parallel_tool_calls`` false: one call) compiles
    to the grammar of a forced call instead (:func:`~._forced_calls.tool_call_format`).
    ``ignore_eos`` (vLLM's): the tokenizer's EOS ids do not end the row (it runs to
    ``max_new_tokens``, a stop string or a stop token); ``stop_token_ids`` (vLLM's): ids in
    ``[0, vocab_size)`` that end the row as EOS does (the id is the row's last token). Raises
    InvalidInput naming the key (its ``param``): the one SamplingParams' message names for the
    rules it holds between keys (``min_tokens`` <= ``max_new_tokens``) and over the schema's
    (``seed`` < 2**64)."""
    values = {k: getattr(spec, k) if getattr(spec, k) is not None else getattr(opts, k, None) for k in _SAMPLING_KEYS}
    kwargs: dict[str, Any] = {k: v for k, v in values.items() if v is not None}
    if spec.logit_bias is not None:
        kwargs["logit_bias"] = _logit_bias(spec.logit_bias, tokenizer.vocab_size)
    if spec.logprobs:
        kwargs["logprobs"] = spec.top_logprobs or 0
    kwargs.update(eos_token_ids=_stop_ids(spec, tokenizer), grammar=_grammar(spec))
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        named = re.match(r"\w+", str(exc))
        raise InvalidInput(str(exc), named[0] if named and named[0] in KEYS else None) from None


def _stop_ids(spec: GenerationInput, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids that end the row: the tokenizer's EOS (unless ``ignore_eos``) and ``stop_token_ids``."""
    ids = set() if spec.ignore_eos else set(tokenizer.eos_token_ids)
    for i in spec.stop_token_ids or ():
        if not 0 <= i < tokenizer.vocab_size:
            raise InvalidInput(f"stop_token_ids: {_show(i)} is not a token id in [0, {tokenizer.vocab_size})",
                               "stop_token_ids")
        ids.add(i)
    return tuple(sorted(ids))


def _grammar(spec: GenerationInput) -> str | None:
    """The grammar of the request's ``response_format``, or of the one its ``tool_choice`` forces."""
    choice = spec.tool_choice
    if choice in (None, "auto", "none"):
        return compile_response_format(spec.response_format)
    if not spec.tools:
        raise InvalidInput(f"tool_choice {_show(choice)} needs 'tools' (a non-empty list of tool dicts)",
                           "tool_choice")
    if spec.response_format is not None:
        raise InvalidInput("tool_choice 'required' or a named function forces the output's format: it cannot be "
                           "combined with response_format", "tool_choice")
    forced = tool_call_format(spec.tools, choice, spec.parallel_tool_calls is not False)
    try:
        return compile_response_format(forced)
    except ValueError as exc:
        raise InvalidInput(f"tools: a function's parameters schema cannot be compiled for tool_choice: {exc}",
                           "tools") from None


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


def _logit_bias(value: dict[int | str, float], vocab_size: int) -> dict[int, float]:
    """``{id or decimal string: bias}`` -> ``{id: bias}`` (types, size and biases: the schema's)."""
    out: dict[int, float] = {}
    for key, bias in value.items():
        token = key if isinstance(key, int) else _token_id(key)
        if token is None or not 0 <= token < vocab_size:
            raise InvalidInput(f"logit_bias keys must be token ids in [0, {vocab_size}) (ints or decimal strings), "
                               f"got {_show(key)}", "logit_bias")
        if token in out:
            raise InvalidInput(f"logit_bias names token {token} twice", "logit_bias")
        out[token] = bias
    return out


def _token_id(key: str) -> int | None:
    return int(key) if key.isascii() and key.isdigit() and len(key) <= _MAX_ID_DIGITS else None


def _output(spec: GenerationInput, chat: bool, params: SamplingParams, n: int) -> RowOutput:
    """What the rows of this input return (see :class:`RowOutput`)."""
    logprobs = params.logprobs is not None
    reasoning = chat and spec.enable_thinking is True
    tools, usage = chat and bool(spec.tools), spec.stream_usage is True
    prompt = spec.prompt_logprobs is not None
    return RowOutput(logprobs=logprobs, reasoning=reasoning, tools=tools,
                     deltas=n > 1 or logprobs or reasoning or tools or usage or prompt,
                     keep_stop=bool(spec.include_stop_str_in_output), usage=usage, prompt_logprobs=prompt,
                     forced=tools and spec.tool_choice not in (None, "auto", "none"))


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


def _check_messages(messages: Any) -> int:
    """ValueError naming the message and field unless ``messages`` is what the chat template takes;
    returns the characters of its strings."""
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
