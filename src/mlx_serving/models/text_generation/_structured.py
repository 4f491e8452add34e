"""Structured output: an OpenAI ``response_format`` compiled to an llguidance grammar, and the
per-sequence token masks that hold generation to it.

Peers: vLLM's and SGLang's llguidance backends (vLLM ``vllm/v1/structured_output/backend_guidance.py``).
llguidance (https://github.com/guidance-ai/llguidance) runs on the CPU, next to any accelerator:
a mask costs tens of microseconds per row; it is imported only when a request asks for a format
(``pip install 'mlx-serving[structured]'``).

Two halves, as in the issue-14 contract (C):

- :func:`compile_response_format` runs in the caller: it validates the request's
  ``response_format`` (``InvalidInput``, param ``response_format``, naming the bad sub-field) and
  returns the grammar as llguidance's serialized grammar string, which travels in
  ``SamplingParams.grammar``. Results are cached by
  the format's JSON text, so a repeated schema costs one ``json.dumps``.
- :func:`constraint_factory` runs where the engine lives: it builds llguidance's tokenizer once
  and returns a factory ``(grammar, eos_ids) -> GrammarConstraint``, one matcher per sequence.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ...serving import InvalidInput

if TYPE_CHECKING:
    import llguidance

    from ...tokenization import Tokenizer

__all__ = ["GrammarConstraint", "GrammarFactory", "compile_response_format", "constraint_factory"]

logger = logging.getLogger("mlx_serving")

#: JSON compile options: compact JSON (``,`` and ``:`` with no whitespace around them, no free
#: whitespace anywhere). They are llguidance's *defaults*, so a schema's own ``x-guidance``
#: options (llguidance docs/json_schema.md) may loosen them.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
_KEYS = {
    "text": {"type"},
    "json_object": {"type"},
    "json_schema": {"type", "json_schema"},
    "regex": {"type", "regex"},
    "grammar": {"type", "grammar"},
}
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
#: OpenAI's rule for ``json_schema.name``: a-z, A-Z, 0-9, underscores and dashes, at most 64.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_COMPILED_CACHE = 512  # distinct response formats kept compiled
_MATCHER_CACHE = 16  # distinct grammars kept as ready matchers per factory (each up to ~40 MB: _LIMITS)
#: Most characters of a response format's JSON text (a schema, a regex, a Lark grammar).
MAX_FORMAT_CHARS = 64 << 10
#: Most rules of a Lark grammar: llguidance compiles a chain of rules by recursion on the calling
#: thread's stack; 3,000 chained rules overflow an 8 MiB stack (SIGSEGV, reproduced in
#: tests/chaos/test_hostile_formats.py), 2,000 compile in 85 ms.
MAX_GRAMMAR_RULES = 1000
_RULE = re.compile(r"^\s*[?!]?[A-Za-z_][A-Za-z0-9_]*(\.-?\d+)?\s*:", re.MULTILINE)


@functools.cache
def _limits() -> Any:
    """llguidance's resource limits for every grammar here (its defaults let the 13-character
    regex ``a{1000}{1000}`` build its lexer for ~1 s and keep ~150 MB): ~20 ms and ~40 MB at most
    to build a matcher, ~7 ms of lexer work per token; past them the grammar is refused (at
    validation) or the sequence ends (``GrammarConstraint.accept``)."""
    return _llguidance().LLParserLimits(initial_lexer_fuel=200_000, step_lexer_fuel=100_000, max_lexer_states=20_000,
                                        max_grammar_size=200_000)


def _llguidance() -> Any:
    """The llguidance module, imported on first use."""
    try:
        import llguidance
    except ImportError as exc:
        raise ImportError(
            "structured output (response_format) needs llguidance: pip install 'mlx-serving[structured]'"
        ) from exc
    return llguidance


def compile_response_format(response_format: object) -> str | None:
    """The llguidance grammar for an OpenAI-shaped ``response_format``, or None for free text.

    Accepted shapes: None or ``{"type": "text"}`` (no constraint); ``{"type": "json_object"}``
    (any JSON object); ``{"type": "json_schema", "json_schema": {"name": str, "schema": {...},
    "description": str?, "strict": bool?}}``; ``{"type": "regex", "regex": str}`` (Rust ``regex``
    syntax); ``{"type": "grammar", "grammar": str}`` (llguidance's Lark syntax). JSON is compact
    (no whitespace outside strings) unless the schema's ``x-guidance`` says otherwise.

    Returns:
        llguidance's serialized grammar (a JSON string, opaque to the engine), or None.

    Raises:
        InvalidInput: (a ValueError, ``param`` ``"response_format"``) naming ``response_format``
            and the bad sub-field (wrong type, unknown key, bad name, a schema / regex / grammar
            llguidance rejects, or not JSON-serializable).
        ImportError: a constraint was asked for and llguidance is not installed.
    """
    if response_format is None:
        return None
    try:
        canonical = json.dumps(response_format, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidInput(f"response_format must be JSON data (dicts, lists, str, finite numbers): {exc}",
                           "response_format") from None
    if len(canonical) > MAX_FORMAT_CHARS:
        raise InvalidInput(f"response_format is {len(canonical)} characters of JSON, more than {MAX_FORMAT_CHARS}",
                           "response_format")
    try:
        return _compile(canonical)
    except InvalidInput:
        raise
    except ValueError as exc:  # _compile's own checks, and llguidance's
        raise InvalidInput(str(exc), "response_format") from exc


@functools.lru_cache(maxsize=_COMPILED_CACHE)
def _compile(canonical: str) -> str | None:
    """Grammar of one response format given as its JSON text (key order kept: it is the order
    JSON object properties are generated in)."""
    response_format = json.loads(canonical)
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object or None, got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in _KEYS:
        raise ValueError(f"response_format.type must be one of {sorted(_KEYS)}, got {kind!r:.80}")
    _check_keys(response_format, _KEYS[kind], "response_format")
    if kind == "text":
        return None
    matcher = _llguidance().LLMatcher
    if kind == "json_object":
        return _validated(matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS), "type")
    if kind == "json_schema":
        schema = _schema_of(response_format.get("json_schema"))
        return _validated(matcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS), "json_schema.schema")
    source = response_format.get(kind)
    if not isinstance(source, str) or not source:
        raise ValueError(f"response_format.{kind} must be a non-empty string, got {type(source).__name__}")
    if kind == "grammar" and len(_RULE.findall(source)) > MAX_GRAMMAR_RULES:
        raise ValueError(f"response_format.grammar has more than {MAX_GRAMMAR_RULES} rules")
    grammar = matcher.grammar_from_regex(source) if kind == "regex" else matcher.grammar_from_lark(source)
    return _validated(grammar, kind)


def _check_keys(value: Mapping[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ValueError(f"{where} has unknown key {unknown[0]!r:.80} (allowed: {sorted(allowed)})")


def _schema_of(json_schema: object) -> dict[str, Any]:
    """The ``schema`` of ``response_format.json_schema``, after checking its fields."""
    where = "response_format.json_schema"
    if not isinstance(json_schema, dict):
        raise ValueError(f"{where} must be an object with name and schema, got {type(json_schema).__name__}")
    _check_keys(json_schema, _JSON_SCHEMA_KEYS, where)
    name = json_schema.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -, got {name!r:.80}")
    if not isinstance(json_schema.get("description", ""), str):
        raise ValueError(f"{where}.description must be a string")
    if not isinstance(json_schema.get("strict", False), (bool, type(None))):
        raise ValueError(f"{where}.strict must be a boolean or null")
    schema = json_schema.get("schema")
    if not isinstance(schema, dict):
        raise ValueError(f"{where}.schema must be a JSON Schema object, got {type(schema).__name__}")
    return schema


def _validated(grammar: str, field: str) -> str:
    """``grammar`` if llguidance compiles it, else ValueError naming ``response_format.<field>``."""
    failed, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(grammar, None, limits=_limits())
    if failed:
        raise ValueError(f"response_format.{field} cannot be compiled: {messages[0][:500]}")
    return grammar


class GrammarConstraint:
    """One sequence's grammar state: a ``models.generation.protocol.TokenConstraint``.

    ``allowed()`` is the next-token mask, ``accept(id)`` advances by the sampled token,
    ``is_stopped()`` says the grammar is complete (or failed: see ``accept``). Not thread-safe:
    one sequence, one caller.

    Args:
        matcher: a fresh ``llguidance.LLMatcher`` (no token consumed).
        vocab_size: length of the mask (the model's vocabulary; ids from the tokenizer's size on
            are never allowed).
        n_tokens: the tokenizer's vocabulary size (llguidance's mask covers ids below it).
        eos_ids: this sequence's EOS ids; they are allowed exactly when the grammar may end.
        grammar_eos: llguidance's own EOS ids (the tokenizer's), cleared from its mask so that
            only ``eos_ids`` signal the end.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, n_tokens: int,
                 eos_ids: Iterable[int], grammar_eos: Iterable[int]) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._n = min(n_tokens, vocab_size)
        self._words = np.zeros((n_tokens + 31) // 32, dtype="<i4")
        self._eos_set = frozenset(i for i in eos_ids if 0 <= i < vocab_size)
        self._eos = np.array(sorted(self._eos_set), dtype=np.int64)
        self._grammar_eos = np.array([i for i in grammar_eos if i < self._n], dtype=np.int64)
        self._ended = False

    def allowed(self) -> np.ndarray:
        """(vocab_size,) bool: the tokens the grammar allows next; EOS ids exactly when it may end.

        llguidance fills a packed bitmask (bit ``i % 32`` of int32 word ``i // 32`` for token
        ``i``, little-endian), unpacked here with numpy.
        """
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        mask = np.zeros(self._vocab_size, dtype=bool)
        mask[: self._n] = np.unpackbits(self._words.view(np.uint8), count=self._n, bitorder="little")
        mask[self._grammar_eos] = False
        mask[self._eos] = self._matcher.is_accepting()
        return mask

    def accept(self, token_id: int) -> None:
        """Advance by the sampled ``token_id``. An EOS id ends the sequence. A token the grammar
        refuses (the engine sampled outside ``allowed()``, or llguidance hit a resource limit)
        puts the matcher in its error state: logged as a warning, and ``is_stopped()`` becomes
        True so the sequence ends instead of failing its batch."""
        if token_id in self._eos_set:
            self._ended = True
            return
        if not 0 <= token_id < self._n:
            self._ended = True
            logger.warning("structured output: token %d is outside the grammar's vocabulary", token_id)
            return
        if not self._matcher.consume_token(token_id):
            logger.warning("structured output: token %d refused: %s", token_id, self._matcher.get_error()[:300])

    def is_stopped(self) -> bool:
        """True when the grammar is complete (no token but EOS could follow), an EOS was accepted,
        or the matcher failed: the sequence ends now."""
        return self._ended or self._matcher.is_stopped()


class GrammarFactory:
    """``(grammar, eos_ids) -> GrammarConstraint``: a ``models.generation.protocol.ConstraintFactory``.

    A grammar is compiled into a matcher once and kept (the last ``_MATCHER_CACHE`` grammars);
    each sequence gets a ``deep_copy`` of it. Safe to call from several threads.

    Raises (on call):
        ValueError: ``grammar`` is not a grammar llguidance compiles for this tokenizer.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._matchers: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, grammar: str, eos_ids: tuple[int, ...]) -> GrammarConstraint:
        tokenizer = self._tokenizer
        return GrammarConstraint(self._template(grammar).deep_copy(), self._vocab_size,
                                 tokenizer.vocab_size, eos_ids, tokenizer.eos_tokens)

    def _template(self, grammar: str) -> llguidance.LLMatcher:
        if not isinstance(grammar, str):
            raise ValueError(f"grammar must be a str (from compile_response_format), got {type(grammar).__name__}")
        with self._lock:
            if grammar in self._matchers:
                self._matchers.move_to_end(grammar)
                return self._matchers[grammar]
        matcher = _llguidance().LLMatcher(self._tokenizer, grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            raise ValueError(f"grammar cannot be compiled: {matcher.get_error()[:500]}")
        with self._lock:
            self._matchers[grammar] = matcher
            while len(self._matchers) > _MATCHER_CACHE:
                self._matchers.popitem(last=False)
        return matcher


class _TokenizerView:
    """What ``llguidance.TokenizerWrapper`` reads of a tokenizer, from our public ``Tokenizer``
    API: every id's bytes (byte-level BPE pieces; special tokens as their text, flagged special),
    the EOS id and an encoder of UTF-8 bytes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        specials = tokenizer.special_token_strings()
        self.tokens = [
            piece if isinstance(piece, bytes) else (specials[i] if piece is None else piece).encode("utf-8")
            for i, piece in enumerate(tokenizer.byte_table().pieces)
        ]
        self.special_token_ids = sorted(specials)
        self.eos_token_id = min(tokenizer.eos_token_ids)
        self.bos_token_id = None
        self._tokenizer = tokenizer

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace"))


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    llg = _llguidance()
    return llg.LLTokenizer(llg.TokenizerWrapper(_TokenizerView(tokenizer)), eos_token=sorted(tokenizer.eos_token_ids))


def constraint_factory(tokenizer: Tokenizer, vocab_size: int) -> GrammarFactory:
    """The constraint factory for an engine whose model has ``vocab_size`` logits per row.

    llguidance's tokenizer is built from ``tokenizer`` (its byte table: byte-level BPE, as
    ``StreamingDetokenizer`` needs too) once per tokenizer (~0.6 s for Qwen3) and cached.

    Raises:
        ValueError: ``vocab_size`` is not a positive int, or the tokenizer has no EOS id.
        TokenizationError: the tokenizer is not byte-level BPE.
        ImportError: llguidance is not installed.
    """
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r:.80}")
    if not tokenizer.eos_token_ids:
        raise ValueError("structured output needs a tokenizer with an EOS id")
    return GrammarFactory(_ll_tokenizer(tokenizer), vocab_size)
