"""Client preprocessing of embedding inputs (caller side): parse, validate, tokenize, pad.

Every input key is checked here, before anything is queued, so a bad input fails alone with an
:class:`~mlx_serving.serving.InvalidInput` (a ValueError) naming the key as ``param``, and never
reaches the executor, where it could fail the batch it shares with other requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...serving import Batch, InvalidInput
from ...serving._json import JSON
from ...tokenization import Tokenizer
from ._options import Settings

__all__ = ["KEYS", "EmbeddingInput", "RequestInfo", "bucket_for", "preprocess"]

#: The keys an input dict may hold.
KEYS = frozenset(("text", "input_ids", "instruction", "prompt_name", "dimensions", "truncate"))
#: Extra tokens a truncated text is tokenized past ``max_len`` (the tokens at a cut may merge
#: differently than in the whole text; these are dropped).
_CUT_MARGIN = 16

EmbeddingInput = str | dict[str, JSON] | list[str | dict[str, JSON]]


@dataclass(frozen=True)
class RequestInfo:
    """Caller-side facts of one request: whether the input was a list, and per input its token
    count (``num_tokens``, special tokens included), the ``dimensions`` it keeps (None: all) and
    whether its vector is L2-normalized."""

    is_list: bool
    num_tokens: tuple[int, ...]
    dimensions: tuple[int | None, ...]
    normalize: bool


def bucket_for(length: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= ``length`` (``length`` <= the last bucket)."""
    return next(b for b in buckets if b >= length)


def preprocess(input: EmbeddingInput, tokenizer: Tokenizer, s: Settings,
               bytes_per_token: int | None = None) -> tuple[Batch, RequestInfo]:
    """An input (a string, a dict, or a non-empty list of them) -> a Batch keyed by its bucket.

    Dict keys: ``text`` (a non-empty string) or ``input_ids`` (a non-empty list of token ids,
    used as given: no instruction, prompt or special tokens added); ``instruction`` (a string:
    the text is prefixed by the serving's ``instruction_template``, Qwen3-Embedding's query
    format), ``prompt_name`` (a key of the checkpoint's prompts, prefixed as is; not with
    ``instruction``), ``dimensions`` (an int in [1, hidden size]: Matryoshka truncation),
    ``truncate`` (a bool, default False: an input over ``max_len`` tokens is refused; True: cut
    to ``max_len``, the special tokens kept). Every input of a request is padded (zeros, on the
    right) to the smallest bucket holding its longest input: the Batch's rows are ``{"tokens":
    (n, bucket) int32, "lengths": (n,) int32}`` and its key is that bucket.

    ``bytes_per_token`` (``text_generation``'s ``max_bytes_per_token``): when given, a text that
    cannot fit whatever its tokenization is refused (or cut) before it is tokenized whole.
    Raises InvalidInput naming the key (None for an empty list or an item that is neither a
    string nor a dict; the message names the item of a list)."""
    is_list = isinstance(input, list)
    items = input if is_list else [input]
    if not items:
        raise InvalidInput("empty input list: give at least one text")
    rows, dims = [], []
    for i, item in enumerate(items):
        where = f"input[{i}]: " if is_list else ""
        try:
            ids, d = _row(item, tokenizer, s, bytes_per_token)
        except InvalidInput as exc:
            raise InvalidInput(f"{where}{exc}", exc.param) from None
        rows.append(ids)
        dims.append(d)
    return _batch(rows, s), RequestInfo(is_list, tuple(len(r) for r in rows), tuple(dims), s.normalize)


def _batch(rows: list[list[int]], s: Settings) -> Batch:
    bucket = bucket_for(max(len(r) for r in rows), s.buckets)
    tokens = np.zeros((len(rows), bucket), dtype=np.int32)
    for j, r in enumerate(rows):
        tokens[j, : len(r)] = r
    lengths = np.array([len(r) for r in rows], dtype=np.int32)
    return Batch.concatenate([{"tokens": tokens, "lengths": lengths}]).key(bucket)


def _row(item: object, tokenizer: Tokenizer, s: Settings, bytes_per_token: int | None) -> tuple[list[int], int | None]:
    """One input's token ids and kept dimensions."""
    spec: dict[str, JSON] = {"text": item} if isinstance(item, str) else _dict(item)
    truncate = _bool(spec.get("truncate"), "truncate")
    dims = _dimensions(spec.get("dimensions"), s.dims)
    if spec.get("input_ids") is not None:
        if spec.get("text") is not None or spec.get("instruction") is not None or spec.get("prompt_name") is not None:
            raise InvalidInput("'input_ids' takes no 'text', 'instruction' or 'prompt_name'", "input_ids")
        return _fit(_ids(spec["input_ids"], s.vocab_size), [], [], s.max_len, truncate, "input_ids"), dims
    text = spec.get("text")
    if not isinstance(text, str) or not text:
        raise InvalidInput(f"'text' must be a non-empty string, got {text!r:.80}", "text")
    text = _prefix(spec, s) + text
    text = _bounded(text, s.max_len, truncate, bytes_per_token)
    try:
        content = tokenizer.encode(text)
    except ValueError as exc:
        raise InvalidInput(f"the text cannot be tokenized: {exc}", "text") from None
    return _fit(content, list(s.prefix), list(s.suffix), s.max_len, truncate, "text"), dims


def _dict(item: object) -> dict[str, JSON]:
    if not isinstance(item, dict):
        raise InvalidInput(f"an input must be a string or a dict, got {type(item).__name__}")
    unknown = sorted(str(k) for k in item if k not in KEYS)
    if unknown:
        raise InvalidInput(f"unknown key {unknown[0]!r:.80} (known: {sorted(KEYS)})", unknown[0][:80])
    return item


def _prefix(spec: dict[str, JSON], s: Settings) -> str:
    instruction, name = spec.get("instruction"), spec.get("prompt_name")
    if instruction is not None and name is not None:
        raise InvalidInput("give 'instruction' or 'prompt_name', not both", "prompt_name")
    if instruction is not None:
        if not isinstance(instruction, str):
            raise InvalidInput(f"'instruction' must be a string, got {instruction!r:.80}", "instruction")
        return s.instruction_template.replace("{instruction}", instruction)
    if name is not None:
        if not isinstance(name, str) or name not in s.prompts:
            raise InvalidInput(f"'prompt_name' must be one of the model's prompts {sorted(s.prompts)}, "
                               f"got {name!r:.80}", "prompt_name")
        return s.prompts[name]
    return ""


def _bounded(text: str, max_len: int, truncate: bool, bytes_per_token: int | None) -> str:
    """``text``, cut (``truncate``) or refused when no tokenization of it fits ``max_len``."""
    if bytes_per_token is None or len(text) <= bytes_per_token * max_len:
        return text
    if truncate:
        return text[: bytes_per_token * (max_len + _CUT_MARGIN)]
    if len(text.encode("utf-8", "surrogatepass")) > bytes_per_token * max_len:
        raise InvalidInput(f"the text ({len(text):,} characters) is longer than max_len ({max_len}) tokens; "
                           "send 'truncate': true to cut it", "text")
    return text


def _fit(content: list[int], prefix: list[int], suffix: list[int], max_len: int, truncate: bool,
         param: str) -> list[int]:
    room = max_len - len(prefix) - len(suffix)
    if len(content) > room:
        if not truncate:
            raise InvalidInput(f"the input is {len(content) + len(prefix) + len(suffix)} tokens, more than max_len "
                               f"({max_len}); send 'truncate': true to cut it", param)
        content = content[:room]
    ids = prefix + content + suffix
    if not ids:
        raise InvalidInput("the text has no tokens", param)
    return ids


def _ids(value: JSON, vocab_size: int) -> list[int]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in value)):
        raise InvalidInput(f"'input_ids' must be a non-empty list of token ids in [0, {vocab_size})", "input_ids")
    return [i for i in value if isinstance(i, int)]


def _dimensions(value: JSON, dims: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= dims:
        raise InvalidInput(f"'dimensions' must be an int in [1, {dims}], got {value!r:.80}", "dimensions")
    return value


def _bool(value: JSON, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidInput(f"'{name}' must be true, false or null, got {value!r:.80}", name)
    return value
