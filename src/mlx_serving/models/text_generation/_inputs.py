"""Client preprocessing: parse, validate and tokenize text-generation inputs (caller side).

Every per-request option is checked here, in the caller, before anything is tokenized or queued, so
a bad request fails alone with an :class:`~mlx_serving.serving.InvalidInput` (a ValueError) naming
the option, in its message and as its ``param``, and never reaches the executor (where it could
fail a step shared with other requests). The accepted types and ranges are declared in
``_schema.GenerationInput`` and listed in docs/qwen3.md ("Request options").
"""

from __future__ import annotations

import dataclasses
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...serving import Batch, InvalidInput
from ...serving._json import JSON, JSONObject
from ...tokenization import Tokenizer

from ..generation.sampling import SamplingParams, _show
from . import _request
from ._options import GenerationOptions
from ._request import ROLES, GenerationRequest, RowOutput, _blame, parse_request

__all__ = ["ROLES", "Prompt", "RequestInfo", "RowOutput", "max_bytes_per_token", "needs_thread", "preprocess"]

# Unicode NFC can shrink UTF-8 text by up to 3x (U+0390 is 6 bytes decomposed, 2 composed; a
# Hangul L+V+T jamo triple is 9 bytes, the syllable 3; U+212A KELVIN SIGN 3 bytes -> "K"). Checked
# over every code point (decomposed and single) with unicodedata; a tokenizer that normalizes NFC
# may therefore turn N bytes of prompt into N / 3 bytes of tokens.
_NFC_SHRINK = 3

# Preprocessing of an input above this size may hold an event loop for more than ~10 ms, so
# async callers run it on a worker thread (needs_thread). Size: characters of every string in
# the input, plus _CONTAINER_CHARS per dict or list (a message, a tool, the input list).
# Measured on the 2-core dev machine, Qwen3 tokenizer, best of 5 (python -m timeit -s "from
# mlx_serving.tokenization import Tokenizer; t = Tokenizer.qwen3(); import random; r =
# random.Random(0); s = ''.join(r.choice('0123456789') for _ in range(10_000))" "t.encode(s)"):
# 10,000 random digits 13.9 ms (the slowest text found: ~7,200 chars per 10 ms), random CJK
# 11.0 ms, random emoji 11.0 ms, English prose (docs/qwen3.md) 5.2 ms (~19,000 chars per 10 ms);
# encode_chat of one short message 0.11 ms, of 200 one-character messages 6.7 ms (34 us per
# message), of one message + 5 tools (~800 chars of JSON) 1.1 ms. 3,000 chars is ~4 ms of the
# slowest text: a 2x margin under 10 ms for a loaded machine.
_OFFLOAD_CHARS = 3_000
_CONTAINER_CHARS = 50
_END = object()


@dataclass(frozen=True)
class Prompt:
    """One row sent to the executor: token ids (int32 range), sampling parameters and scheduling
    priority (lower runs sooner under the engine's "priority" policy; ignored by "fcfs");
    ``prompt_logprobs``: alternatives per prompt token when the row asks for the prompt's
    log-probabilities (an int in [0, 20]), else None; ``generate``: False for a row that only
    scores its prompt (``max_new_tokens`` 0: ``params.max_new_tokens`` is then unused)."""

    ids: list[int]
    params: SamplingParams
    priority: int = 0
    prompt_logprobs: int | None = None
    generate: bool = True


@dataclass(frozen=True)
class RequestInfo:
    """Caller-side facts about one request: whether the input was a list, each row's prompt
    length (tokens), stop strings and :class:`RowOutput` (``outputs``; empty: row i is input i,
    plain output)."""

    is_list: bool
    input_tokens: tuple[int, ...]
    stops: tuple[tuple[str, ...], ...]
    outputs: tuple[RowOutput, ...] = ()

    def output(self, row: int) -> RowOutput:
        """Row ``row``'s :class:`RowOutput`."""
        return self.outputs[row] if self.outputs else RowOutput(input=row)

    @property
    def num_inputs(self) -> int:
        """Inputs in the request (rows are their completions, in input order)."""
        return self.outputs[-1].input + 1 if self.outputs else len(self.input_tokens)


def preprocess(input: JSON, tokenizer: Tokenizer, opts: GenerationOptions,
               bytes_per_token: int | None = None) -> tuple[Batch, RequestInfo]:
    """Turn an input (a string, ``{"text": ...}``, ``{"messages": [...]}`` or a list of them) into a
    Batch of :class:`Prompt` rows.

    Per-request keys: the fields of ``_schema.GenerationInput`` (types and ranges; None, JSON null,
    means the serving's default), decoded and checked by ``_request.parse_request``; ``n``
    completions become ``n`` rows, seeds derived by ``_request.completion_seed``.

    The context: a request that gives no ``max_new_tokens`` gets the serving's default capped to
    ``max_len - prompt tokens`` (vLLM's default is the whole rest of the context; ours stays the
    serving's default where it fits); ``truncate_prompt_tokens`` N keeps the prompt's last N tokens
    (of the rendered prompt for chat; -1: ``max_len - max_new_tokens``, as many as fit).

    ``bytes_per_token`` (from :func:`max_bytes_per_token`): when given, a prompt whose UTF-8 size is
    more than ``bytes_per_token * (max_len - new tokens)`` bytes (new tokens: the request's
    ``max_new_tokens``, else its ``min_tokens``, at least 1) is refused before it is tokenized (no
    tokenization of it could fit), unless the request truncates its prompt; a chat input's
    strings are summed, and when they come near the bound the template is rendered (cheap) and
    the rendered prompt measured.

    Raises :class:`~mlx_serving.serving.InvalidInput` (a ValueError; its message names the item
    for lists, and the option) for an empty input, an unknown key, a bad option, text the tokenizer
    refuses, or a prompt + the new tokens it needs longer than max_len (the message says what to
    lower or raise: ``max_new_tokens``, ``truncate_prompt_tokens``, ``max_len`` / ``--max-len``).
    Its ``param`` is the input key at fault: for a prompt over max_len, ``"max_new_tokens"`` (or
    ``"min_tokens"``) when the request gave it and the prompt could fit with a smaller one, else
    ``"text"`` / ``"messages"`` (the key the prompt came from, as for a prompt the tokenizer or chat
    template refuses); None when no key is (an empty list, an item that is not a dict)."""
    is_list = isinstance(input, list)
    items = input if isinstance(input, list) else [input]
    if not items:
        raise InvalidInput("empty input list: give at least one prompt")
    rows: list[Prompt] = []
    stops: list[tuple[str, ...]] = []
    outputs: list[RowOutput] = []
    for i, item in enumerate(items):
        try:
            prompts, stop, output = _one(item, tokenizer, opts, bytes_per_token)
        except InvalidInput as e:
            if not is_list:
                raise
            raise InvalidInput(f"input {i}: {e}", e.param) from e.__cause__  # the tokenizer's error, if any
        except ValueError as e:  # no check raises a plain one; should one come, it names no key
            raise InvalidInput(f"input {i}: {e}" if is_list else str(e)) from None
        rows += prompts
        stops += [stop] * len(prompts)
        outputs += [dataclasses.replace(output, input=i, index=j) for j in range(len(prompts))]
    info = RequestInfo(is_list, tuple(len(p.ids) for p in rows), tuple(stops), tuple(outputs))
    return Batch.stack(rows), info


def max_bytes_per_token(tokenizer: Tokenizer) -> int | None:
    """Most bytes of UTF-8 prompt text that one token of ``tokenizer`` can stand for, or None when
    its pipeline is not one this bound is proven for. Computed once per tokenizer (~40 ms for
    Qwen3 once its byte table exists) and cached.

    A byte-level BPE tokenizer turns text into tokens whose byte strings concatenate to the
    (normalized) text, so ``n`` bytes need at least ``n / longest_token_bytes`` tokens; NFC
    normalization may first shrink the text up to 3x. Qwen3: the longest token is 128 bytes (a run
    of spaces; special and added tokens included), so 384 bytes per token. The bound holds when
    every byte has its own token (nothing is unknown or dropped), the pre-tokenizer only splits
    (``Split`` without ``Removed``, ``ByteLevel``), no added token strips the whitespace around it,
    and the normalizer is none or NFC; otherwise
    this returns None and prompts are only measured after tokenization.
    """
    try:
        return _PER_TOKEN[tokenizer]
    except (KeyError, TypeError):
        pass
    per_token = _max_bytes_per_token(tokenizer)
    try:
        _PER_TOKEN[tokenizer] = per_token
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return per_token


_PER_TOKEN: weakref.WeakKeyDictionary[Tokenizer, int | None] = weakref.WeakKeyDictionary()


def _max_bytes_per_token(tokenizer: Tokenizer) -> int | None:
    backend = getattr(tokenizer, "_backend", None)  # the tokenizers.Tokenizer (no public accessor)
    if backend is None:
        return None
    try:
        shrink = _normalizer_shrink(backend.normalizer)
        if shrink is None or not _pre_tokenizer_keeps_text(backend.pre_tokenizer):
            return None
        if type(backend.model).__name__ != "BPE":
            return None
        if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
            return None  # such a token also swallows the whitespace next to it, however long
        pieces = tokenizer.byte_table().pieces
    except Exception:  # noqa: BLE001 - any surprise: no pre-check, tokenization still bounds it
        return None
    if len({p for p in pieces if type(p) is bytes and len(p) == 1}) < 256:
        return None  # some byte has no token: text could become fewer (unknown) tokens
    longest = max((len(p) if isinstance(p, bytes) else len(p.encode("utf-8", "surrogatepass"))
                   for p in pieces if p is not None), default=1)
    specials = tokenizer.special_token_strings().values()
    longest = max([longest, *(len(t.encode("utf-8", "surrogatepass")) for t in specials)])
    return max(longest, 1) * shrink


def _normalizer_shrink(normalizer: Any) -> int | None:
    if normalizer is None:
        return 1
    kind = json.loads(normalizer.__getstate__()).get("type")
    return _NFC_SHRINK if kind == "NFC" else None


def _pre_tokenizer_keeps_text(pre_tokenizer: Any) -> bool:
    if pre_tokenizer is None:
        return True
    state = json.loads(pre_tokenizer.__getstate__())
    parts = state.get("pretokenizers", []) if state.get("type") == "Sequence" else [state]
    return all(p.get("type") == "ByteLevel" or (p.get("type") == "Split" and p.get("behavior") != "Removed")
               for p in parts)


def needs_thread(input: object) -> bool:
    """True when preprocessing ``input`` (tokenization, chat templating) could take more than
    ~10 ms: its strings (text, message contents, tools; for a list input, all items together)
    hold more than 3,000 characters, each dict or list counting as 50 more. Never raises; stops
    walking the input as soon as the budget is spent, so its own cost is bounded."""
    budget = _OFFLOAD_CHARS
    stack = [iter((input,))]
    while stack:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        if isinstance(item, str):
            budget -= len(item) + 1
        elif isinstance(item, (dict, list, tuple)):
            budget -= _CONTAINER_CHARS
            stack.append(iter(item.values() if isinstance(item, dict) else item))
        else:
            budget -= 1
        if budget < 0:
            return True
    return False


def _one(item: object, tokenizer: Tokenizer, opts: GenerationOptions,
         bytes_per_token: int | None) -> tuple[list[Prompt], tuple[str, ...], RowOutput]:
    """One input -> its ``n`` rows (one per completion), stop strings and output spec."""
    request = parse_request(item, tokenizer, opts)
    ids = _truncate(_encode(request, tokenizer, opts, bytes_per_token), request, opts)
    params = _fit(request, len(ids), opts)
    prompts = [Prompt(ids, p, request.priority, request.prompt_logprobs, request.generate)
               for p in _request.completion_params(params, request.n)]
    return prompts, request.stop, request.output


def _least_new(request: GenerationRequest) -> int:
    """New tokens the row needs room for: the request's ``max_new_tokens``, else its ``min_tokens``
    (at least 1); the serving's default ``max_new_tokens`` is capped to what fits (:func:`_fit`)."""
    params = request.params
    return params.max_new_tokens if request.max_new_tokens_given else max(1, params.min_tokens)


def _truncate(ids: list[int], request: GenerationRequest, opts: GenerationOptions) -> list[int]:
    """The prompt's last ``truncate_prompt_tokens`` ids (vLLM's left truncation; of the rendered
    prompt for chat inputs); -1 keeps ``max_len - max_new_tokens`` (the request's, else the
    serving's default): as many as fit with the new tokens."""
    keep = request.truncate_prompt_tokens
    if keep is None:
        return ids
    if keep == -1:
        keep = max(opts.max_len - request.params.max_new_tokens, 1)
    return ids[-keep:]


def _fit(request: GenerationRequest, prompt_len: int, opts: GenerationOptions) -> SamplingParams:
    """The row's sampling with ``max_new_tokens`` capped to ``max_len - prompt_len`` when the
    request gave none; InvalidInput (:func:`_over_context`) when the prompt and the new tokens the
    request needs (:func:`_least_new`) exceed ``max_len``."""
    params, room = request.params, opts.max_len - prompt_len
    if room < _least_new(request):
        raise _over_context(request, prompt_len, opts)
    if request.max_new_tokens_given or params.max_new_tokens <= room:
        return params
    return dataclasses.replace(params, max_new_tokens=room)


#: What an over-long prompt's refusal offers; the server names its fields (``max_tokens``) instead.
_RAISE_MAX_LEN = "raise max_len (--max-len of mlx-serving serve, generate and chat)"


def _over_context(request: GenerationRequest, prompt_len: int, opts: GenerationOptions) -> InvalidInput:
    """The refusal of a prompt whose tokens and the new tokens it needs exceed ``max_len``,
    naming (as ``param``) what to change: the request's ``max_new_tokens`` (or ``min_tokens``) when
    a smaller one would fit, else the prompt's key (``text`` / ``messages``)."""
    params, max_len, room = request.params, opts.max_len, opts.max_len - prompt_len
    if room >= 1 and (request.max_new_tokens_given or params.min_tokens > 1):
        key = "max_new_tokens" if request.max_new_tokens_given else "min_tokens"
        value = params.max_new_tokens if request.max_new_tokens_given else params.min_tokens
        return InvalidInput(f"prompt of {prompt_len} tokens + {key} {_show(value)} = {_show(prompt_len + value)} "
                            f"exceeds max_len {max_len}: lower {key} to at most {room}, or {_RAISE_MAX_LEN}", key)
    return InvalidInput(f"prompt of {prompt_len} tokens exceeds max_len {max_len} (at most {max_len - 1} prompt "
                        f"tokens fit, leaving room for 1 new token): shorten it, set truncate_prompt_tokens (keep its "
                        f"last N tokens; -1: as many as fit), or {_RAISE_MAX_LEN}", request.source)


def _encode(request: GenerationRequest, tokenizer: Tokenizer, opts: GenerationOptions,
            bytes_per_token: int | None) -> list[int]:
    """The prompt's token ids; a prompt over the byte bound (``bytes_per_token`` x the prompt
    tokens that fit) is refused before it is tokenized or rendered, unless the request truncates
    its prompt (``truncate_prompt_tokens``)."""
    if request.truncate_prompt_tokens is not None:
        bytes_per_token = None
    least = _least_new(request)
    room = opts.max_len - least  # prompt tokens that fit
    limit = None if bytes_per_token is None else bytes_per_token * max(room, 1)
    full = None if bytes_per_token is None else bytes_per_token * max(opts.max_len - 1, 1)  # max_new_tokens 1

    def too_long_param(prompt: str) -> str:
        """Who is at fault for a prompt over the byte bound: the request's max_new_tokens when the
        prompt could fit with max_new_tokens 1, else the prompt."""
        blame_max = request.max_new_tokens_given and full is not None and not _longer_than(prompt, full)
        return "max_new_tokens" if blame_max else request.source

    if request.messages is not None:
        return _encode_chat(request, request.messages, tokenizer, limit, opts, too_long_param)
    text = request.text or ""
    if limit is not None and _longer_than(text, limit):
        raise _too_long("'text' (the prompt)", len(text), limit, opts, least, too_long_param(text))
    with _blame("text"):
        return tokenizer.encode(text)


def _encode_chat(request: GenerationRequest, messages: list[JSONObject], tokenizer: Tokenizer, limit: int | None,
                 opts: GenerationOptions, too_long_param: Callable[[str], str]) -> list[int]:
    """The chat prompt's ids (``messages``: the request's); a refusal of the messages or of their
    rendering names ``request.source`` ("messages", or "text" made into one user message by a
    ``chat=True`` serving); ``too_long_param``: the ``param`` of a rendered prompt over the byte bound."""
    tools, thinking = request.tools, request.enable_thinking
    with _blame(request.source):  # the template's errors (ChatTemplateError) and text it cannot encode
        if limit is not None and 4 * request.chat_chars > limit and tokenizer.chat_template is not None:
            # Near the bound: render (about 0.4 ms for a 1 MB message) and measure what would be encoded.
            template = tokenizer.chat_template
            rendered = template.apply(messages, add_generation_prompt=True, enable_thinking=thinking, tools=tools)
            if _longer_than(rendered, limit):
                param = too_long_param(rendered)
                if tools and param == request.source and not _longer_than(
                        template.apply(messages, add_generation_prompt=True, enable_thinking=thinking), limit):
                    param = "tools"  # the messages alone fit: the tools' schemas are what does not
                raise _too_long("'messages' (the rendered chat prompt)", len(rendered), limit, opts,
                                _least_new(request), param)
        return tokenizer.encode_chat(messages, add_generation_prompt=True, enable_thinking=thinking, tools=tools)


def _longer_than(text: str, limit: int) -> bool:
    """Whether ``text`` has more than ``limit`` UTF-8 bytes; O(1) unless its character count is
    within 4x of the limit (a character is 1 to 4 bytes)."""
    if len(text) > limit:
        return True
    if 4 * len(text) <= limit:
        return False
    return len(text.encode("utf-8", "surrogatepass")) > limit


def _too_long(what: str, chars: int, limit: int, opts: GenerationOptions, new_tokens: int,
              param: str) -> InvalidInput:
    room = max(opts.max_len - new_tokens, 1)
    return InvalidInput(f"{what} of {chars:,} characters exceeds max_len {opts.max_len}: with max_new_tokens "
                        f"{new_tokens} at most {room} prompt tokens fit, and one token of this tokenizer "
                        f"covers at most {limit // room} bytes of text, so more than {limit:,} bytes never fit "
                        f"(refused before tokenizing): shorten it, set truncate_prompt_tokens, or {_RAISE_MAX_LEN}",
                        param)
