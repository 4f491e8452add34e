"""``ServedModel``: one model the server answers for, and the routes that describe it or use its
tokenizer without generating: ``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize``
(vLLM's shapes: ``vllm/entrypoints/openai/protocol.py``, ``TokenizeRequest`` / ``DetokenizeRequest``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, cast
from ..serving import Client
from ..serving._json import JSON, JSONObject
from ..tokenization import Tokenizer
from ._errors import APIError

__all__ = ["MAX_TOKENIZE_IDS", "Lazy", "ServedModel", "Task", "detokenize", "model_object", "tokenize"]

#: What a served model does: text generation (the chat, completions and responses routes) or
#: embedding (``/v1/embeddings``).
Task = Literal["generate", "embed"]

#: Most ids one ``/detokenize`` takes (bounds its work: ~1 us per id).
MAX_TOKENIZE_IDS = 1 << 20


@dataclass(frozen=True)
class ServedModel:
    """A served model: its ``client`` (the generation contract), ``max_model_len`` (positions per
    sequence, prompt and output together; reported by ``/v1/models``; None: not known) and
    ``tokenizer`` (for ``/tokenize`` and ``/detokenize``; None: those answer 400 for the model) and
    ``task``: "generate" (a text-generation serving) or "embed" (a text-embedding serving)."""

    client: Client
    max_model_len: int | None = None
    tokenizer: Tokenizer | None = None
    task: Task = "generate"

    def check_task(self, name: str, task: Task) -> None:
        """APIError 400 naming ``model`` unless this model does ``task``."""
        if self.task != task:
            route = "/v1/embeddings" if self.task == "embed" else "the chat, completions or responses routes"
            raise APIError(400, f"the model {name!r} is {'an embedding' if self.task == 'embed' else 'a generation'} "
                                f"model: use {route}", param="model", code="wrong_model_task")


@dataclass(frozen=True)
class Lazy:
    """A model the server loads at its first request (and again after it unloaded it): ``load()``
    builds and starts its client, blocking (it runs on a thread), and returns it or a
    ``ServedModel`` holding it; the server closes that client (``aclose``) when it unloads it."""

    load: Callable[[], Client | ServedModel]


def model_object(name: str, created: int, status: str, task: Task | None, max_model_len: int | None) -> JSONObject:
    """The ``model`` object of ``/v1/models``: OpenAI's fields, the model's ``task`` ("generate" or
    "embed"), vLLM's ``max_model_len`` (each left out while not known: a model loaded on demand
    before its first load) and its ``status`` ("loaded", "loading", "unloading", "unloaded" or
    "failed")."""
    out: JSONObject = {"id": name, "object": "model", "created": created, "owned_by": "mlx-serving"}
    if task is not None:
        out["task"] = task
    if max_model_len is not None:
        out["max_model_len"] = max_model_len
    out["status"] = status
    return out


def _tokenizer(model: ServedModel, name: str) -> Tokenizer:
    if model.tokenizer is None:
        raise APIError(400, f"the model {name!r} has no tokenizer attached to this server", param="model")
    return model.tokenizer


def tokenize(body: JSONObject, name: str, model: ServedModel, messages: list[JSONObject] | None) -> JSONObject:
    """``/tokenize``: ``{"prompt": str}`` or ``{"messages": [...], "add_generation_prompt": bool}``
    (``messages`` already mapped from OpenAI's shape) -> ``{"count", "max_model_len", "tokens"}``:
    the ids a completion or chat request with that prompt generates from. Blocking (~1 us per
    character): call off the event loop. Raises APIError 400 naming the field."""
    tok = _tokenizer(model, name)
    if messages is not None:
        generation = _bool(body, "add_generation_prompt", True)
        try:
            ids = tok.encode_chat(messages, add_generation_prompt=generation)
        except ValueError as exc:  # a template error or text the tokenizer refuses
            raise APIError(400, f"the messages cannot be rendered: {exc}", param="messages") from None
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise APIError(400, "give 'prompt' (a string) or 'messages'", param="prompt")
        if not _bool(body, "add_special_tokens", True):
            raise APIError(400, "'add_special_tokens': false is not supported (prompts are encoded as the "
                                "completions route encodes them)", param="add_special_tokens")
        try:
            ids = tok.encode(prompt)
        except ValueError as exc:
            raise APIError(400, f"the prompt cannot be tokenized: {exc}", param="prompt") from None
    return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": cast(list[JSON], ids)}


def detokenize(body: JSONObject, name: str, model: ServedModel) -> JSONObject:
    """``/detokenize``: ``{"tokens": [int, ...]}`` -> ``{"prompt": str}`` (special tokens kept as
    text, as vLLM's). Raises APIError 400 naming ``tokens``."""
    tok = _tokenizer(model, name)
    ids = body.get("tokens")
    if (not isinstance(ids, list) or len(ids) > MAX_TOKENIZE_IDS
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < tok.vocab_size for i in ids)):
        raise APIError(400, f"'tokens' must be a list of at most {MAX_TOKENIZE_IDS} token ids in "
                            f"[0, {tok.vocab_size})", param="tokens")
    return {"prompt": tok.decode(cast(list[int], ids), skip_special_tokens=False)}  # every id checked above


def _bool(body: JSONObject, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"'{key}' must be true, false or null, got {value!r:.80}", param=key)
    return value
