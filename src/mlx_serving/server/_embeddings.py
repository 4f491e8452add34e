"""``POST /v1/embeddings``: OpenAI's embeddings request -> the text-embedding serving's input, and
its result -> OpenAI's response (``{"object": "list", "data": [{"object": "embedding", "index",
"embedding"}], "model", "usage": {"prompt_tokens", "total_tokens"}}``).

``input``: a string, a list of strings, a list of token ids, or a list of such lists (at most
:data:`MAX_INPUTS`); ``encoding_format``: "float" (JSON numbers) or "base64" (the little-endian
float32 bytes, as OpenAI sends them and its client asks by default); ``dimensions``: Matryoshka
truncation (then L2-normalized); ``user``: accepted, no effect. Extension fields:
``instruction`` (a task description: the query format of the serving's instruction template,
Qwen3-Embedding's), ``prompt_name`` (a prompt the checkpoint names, e.g. "query"), ``truncate``
(cut inputs over the model's length instead of a 400). Errors name the OpenAI field (the
serving's ``text`` / ``input_ids`` are reported as ``input``).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import cast

import numpy as np

from ..serving import InvalidInput
from ..serving._json import JSON, JSONObject
from ._errors import APIError

__all__ = ["MAX_INPUTS", "EmbeddingCall", "embedding_call", "embedding_response", "input_error", "prompt_tokens"]

#: Most inputs one request may carry (OpenAI's limit).
MAX_INPUTS = 2048
_FIELDS = frozenset(("model", "input", "encoding_format", "dimensions", "user", "instruction", "prompt_name",
                     "truncate"))
_PASS = ("dimensions", "instruction", "prompt_name", "truncate")
_FORMATS = ("float", "base64")
_SERVING_NAMES = {"text": "input", "input_ids": "input"}


@dataclass(frozen=True)
class EmbeddingCall:
    """One embeddings request, mapped: ``inputs`` (the serving's list of input dicts) and the
    ``encoding_format`` of the answer."""

    inputs: list[JSONObject]
    encoding_format: str


def _is_ids(value: JSON) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(i, int) and not isinstance(i, bool)
                                                            for i in value)


def _inputs(value: JSON) -> list[JSONObject]:
    """The request's ``input`` as ``[{"text"} | {"input_ids"}]``; APIError 400 naming ``input``."""
    if isinstance(value, str):
        return [{"text": value}]
    if _is_ids(value):
        return [{"input_ids": value}]
    if isinstance(value, list) and value and len(value) <= MAX_INPUTS:
        if all(isinstance(v, str) for v in value):
            return [{"text": v} for v in value]
        if all(_is_ids(v) for v in value):
            return [{"input_ids": v} for v in value]
    raise APIError(400, "'input' must be a string, a list of strings, a list of token ids or a list of token-id "
                        f"lists, non-empty and at most {MAX_INPUTS} inputs", param="input")


def embedding_call(body: JSONObject) -> EmbeddingCall:
    """Map a ``/v1/embeddings`` body. Raises APIError 400 naming the field for an unknown field, a
    malformed ``input`` or an ``encoding_format`` other than float / base64; the values of
    ``dimensions``, ``instruction``, ``prompt_name`` and ``truncate`` are checked by the serving."""
    unknown = [k for k in body if k not in _FIELDS]
    if unknown:
        raise APIError(400, f"unknown field {unknown[0]!r:.80} in an embeddings request", param=unknown[0][:80])
    fmt = body.get("encoding_format") or "float"
    if fmt not in _FORMATS:
        raise APIError(400, f"'encoding_format' must be 'float' or 'base64', got {fmt!r:.80}", param="encoding_format")
    extra = {k: body[k] for k in _PASS if body.get(k) is not None}
    return EmbeddingCall([{**item, **extra} for item in _inputs(body.get("input"))], str(fmt))


def input_error(exc: InvalidInput) -> APIError:
    """The serving's InvalidInput as a 400 naming the OpenAI field."""
    param = None if exc.param is None else _SERVING_NAMES.get(exc.param, exc.param)
    return APIError(400, str(exc), param=param)


def _encode(vector: np.ndarray, fmt: str) -> JSON:
    if fmt == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return cast(list[JSON], vector.tolist())


def embedding_response(results: list[dict[str, object]], name: str, fmt: str) -> JSONObject:
    """OpenAI's embeddings response for the serving's results (one per input, in order)."""
    data: list[JSON] = [{"object": "embedding", "index": i, "embedding": _encode(cast(np.ndarray, r["embedding"]), fmt)}
                        for i, r in enumerate(results)]
    tokens = prompt_tokens(results)
    return {"object": "list", "data": data, "model": name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def prompt_tokens(results: list[dict[str, object]]) -> int:
    """The tokens of every input of a result (``usage.prompt_tokens``)."""
    return sum(int(cast(int, r["num_tokens"])) for r in results)
