"""Structured output (models/text_generation/_structured.py): response_format validation and
llguidance token masks with the real Qwen3 tokenizer.

The driver samples from seeded random logits of the model's vocabulary size, masked by
``allowed()``: with random logits only the mask can make the output valid, so every output that
finishes must parse and validate against its schema (``jsonschema``).
"""

from __future__ import annotations

import json
import sys

import jsonschema
import numpy as np
import pytest

from mlx_serving.models.generation import Engine, EngineConfig
from mlx_serving.models.generation.sampling import SamplingParams
from mlx_serving.models.text_generation import _structured
from mlx_serving.models.text_generation._structured import compile_response_format, constraint_factory
from mlx_serving.tokenization import Tokenizer

VOCAB = 151_936  # Qwen3's model vocabulary (the tokenizer has 151,669 ids)
EOS = (151_643, 151_645)
MAX_STEPS = 120


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.qwen3()


@pytest.fixture(scope="module")
def factory(tokenizer: Tokenizer) -> _structured.GrammarFactory:
    return constraint_factory(tokenizer, VOCAB)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _drive(factory, tokenizer, grammar: str, seed: int, eos=EOS, sample: bool = False):
    """Generate under ``grammar`` from random logits; returns (text, finished, masks seen).

    Checks on every step: the mask has the model's length, allows no id past the tokenizer,
    and the sampled token is one it allows."""
    rng = np.random.default_rng(seed)
    constraint = factory(grammar, eos)
    ids: list[int] = []
    for _ in range(MAX_STEPS):
        mask = constraint.allowed()
        assert mask.shape == (VOCAB,) and mask.dtype == np.bool_
        assert not mask[tokenizer.vocab_size:].any()
        assert mask.any()
        logits = rng.standard_normal(VOCAB)
        logits[~mask] = -np.inf
        if sample:
            p = np.exp(logits - logits.max())
            token = int(rng.choice(VOCAB, p=p / p.sum()))
        else:
            token = int(np.argmax(logits))
        constraint.accept(token)
        if token in eos:
            return tokenizer.decode(ids), True, constraint
        ids.append(token)
        if constraint.is_stopped():
            return tokenizer.decode(ids), True, constraint
    return tokenizer.decode(ids), False, constraint


def _whitespace_outside_strings(text: str) -> list[int]:
    """Positions of whitespace outside JSON strings."""
    found, in_string, escaped = [], False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch.isspace():
            found.append(i)
    return found


def _tags(max_items: int) -> dict:
    """Schema of an array of at most ``max_items`` tags, each "a" or "b"."""
    return {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": max_items}


SCHEMAS = {
    "required_fields": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enums_and_bool": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                       "size": {"type": "string", "enum": ["S", "M"]}},
        "required": ["color", "ok", "size"],
        "additionalProperties": False,
    },
    "integers_bounded": {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "m": {"type": "number"}},
        "required": ["n", "m"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4}},
        "required": ["xs"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "tags": _tags(3)},
                "required": ["id", "tags"],
                "additionalProperties": False,
            },
            "kind": {"const": "user"},
        },
        "required": ["user", "kind"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_logits_outputs_validate(factory, tokenizer, name):
    schema = SCHEMAS[name]
    grammar = compile_response_format(_schema_format(schema))
    finished = 0
    for seed in range(6):
        text, done, constraint = _drive(factory, tokenizer, grammar, seed, sample=seed % 2 == 1)
        if not done:
            continue
        finished += 1
        jsonschema.validate(json.loads(text), schema)
        assert _whitespace_outside_strings(text) == [], text
        assert text.endswith("}") and constraint.is_stopped()
    assert finished >= 3


def test_json_object_outputs_are_objects(factory, tokenizer):
    grammar = compile_response_format({"type": "json_object"})
    finished = 0
    for seed in range(12):
        text, done, _ = _drive(factory, tokenizer, grammar, seed)
        if done:
            finished += 1
            assert isinstance(json.loads(text), dict)
            assert _whitespace_outside_strings(text) == [], text
    assert finished >= 2


def test_stops_after_closing_brace_and_eos_only_then(factory, tokenizer):
    """EOS is allowed exactly when the grammar may end: never inside the object, and after the
    closing brace nothing but this request's EOS ids."""
    grammar = compile_response_format(_schema_format(SCHEMAS["required_fields"]))
    constraint = factory(grammar, (151_645,))
    for token in tokenizer.encode('{"name":"ab","age":7'):
        mask = constraint.allowed()
        assert mask[token] and not mask[list(EOS)].any()
        constraint.accept(token)
        assert not constraint.is_stopped()
    (brace,) = tokenizer.encode("}")
    assert constraint.allowed()[brace]
    constraint.accept(brace)
    assert constraint.is_stopped()
    assert np.flatnonzero(constraint.allowed()).tolist() == [151_645]


def test_regex_and_lark_grammar(factory, tokenizer):
    import re

    regex = compile_response_format({"type": "regex", "regex": "[a-z]{2,5}-[0-9]{1,3}"})
    lark = compile_response_format({"type": "grammar", "grammar": 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'})
    for seed in range(4):
        text, done, _ = _drive(factory, tokenizer, regex, seed)
        assert done and re.fullmatch("[a-z]{2,5}-[0-9]{1,3}", text), text
        text, done, _ = _drive(factory, tokenizer, lark, seed)
        assert done and re.fullmatch("yes|no|maybe [0-9]", text), text


def test_refused_token_stops_the_sequence(factory, tokenizer, caplog):
    constraint = factory(compile_response_format({"type": "json_object"}), EOS)
    (letter,) = tokenizer.encode("x")
    assert not constraint.allowed()[letter]
    constraint.accept(letter)
    assert constraint.is_stopped()
    assert "refused" in caplog.text


def test_bad_grammar_to_factory_raises(factory):
    with pytest.raises(ValueError, match="grammar cannot be compiled"):
        factory('{"grammars": [{"lark_grammar": "start: undefined_rule"}]}', EOS)
    with pytest.raises(ValueError, match="grammar must be a str"):
        factory(b"{}", EOS)


def test_request_eos_is_allowed_exactly_when_the_grammar_may_end(factory, tokenizer):
    """An EOS id the grammar would also take as text ("x" here) is refused until the grammar
    may end, then allowed, and ends the sequence."""
    (x,) = tokenizer.encode("x")
    constraint = factory(compile_response_format({"type": "regex", "regex": "[a-z]{2,8}"}), (x,))
    for token in tokenizer.encode("ab"):
        assert not constraint.allowed()[x]
        constraint.accept(token)
    assert constraint.allowed()[x] and not constraint.allowed()[list(EOS)].any()
    constraint.accept(x)
    assert constraint.is_stopped()


def test_compact_by_default_and_schema_may_loosen_it(factory, tokenizer):
    (space,) = tokenizer.encode(" ")
    compact = factory(compile_response_format({"type": "json_object"}), EOS)
    for token in tokenizer.encode('{"a":1'):
        compact.accept(token)
    assert not compact.allowed()[space]
    loose_schema = {"type": "object", "x-guidance": {"whitespace_flexible": True}}
    loose = factory(compile_response_format(_schema_format(loose_schema)), EOS)
    for token in tokenizer.encode('{"a":1'):
        loose.accept(token)
    assert loose.allowed()[space]


def test_compiled_formats_are_cached():
    fmt = _schema_format({"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}})
    first = compile_response_format(fmt)
    assert compile_response_format(json.loads(json.dumps(fmt))) is first
    swapped = _schema_format({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}})
    assert compile_response_format(swapped) != first  # property order is generation order


@pytest.mark.parametrize("fmt", [None, {"type": "text"}])
def test_free_text_has_no_grammar(fmt):
    assert compile_response_format(fmt) is None


@pytest.mark.parametrize(
    ("fmt", "field"),
    [
        ("json", "response_format must be an object"),
        ({}, "response_format.type"),
        ({"type": "xml"}, "response_format.type"),
        ({"type": "json_object", "schema": {}}, "response_format has unknown key 'schema'"),
        ({"type": "json_schema"}, "response_format.json_schema must be an object"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}, "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "a"}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": []}}, "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}},
         "response_format.json_schema.strict"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "extra": 1}},
         "response_format.json_schema has unknown key 'extra'"),
        (_schema_format({"type": "strng"}), "response_format.json_schema.schema cannot be compiled"),
        (_schema_format({"type": "array", "minItems": 3, "maxItems": 1}),
         "response_format.json_schema.schema cannot be compiled"),
        (_schema_format({"$ref": "#/defs/missing"}), "response_format.json_schema.schema cannot be compiled"),
        ({"type": "regex", "regex": "[a-"}, "response_format.regex cannot be compiled"),
        ({"type": "regex", "regex": 5}, "response_format.regex must be a non-empty string"),
        ({"type": "grammar", "grammar": "start: nowhere"}, "response_format.grammar cannot be compiled"),
        (_schema_format({"type": "number", "maximum": float("nan")}), "response_format must be JSON data"),
        ({"type": "json_object", 1j: 1}, "response_format must be JSON data"),
    ],
)
def test_invalid_formats_name_the_field(fmt, field):
    with pytest.raises(ValueError) as info:
        compile_response_format(fmt)
    assert field in str(info.value)


def test_missing_llguidance_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ImportError, match=r"mlx-serving\[structured\]"):
        compile_response_format(_schema_format({"type": "object", "title": "never compiled before"}))
    assert compile_response_format({"type": "text"}) is None  # free text needs no llguidance


def test_factory_validates_vocab_size(tokenizer):
    with pytest.raises(ValueError, match="vocab_size"):
        constraint_factory(tokenizer, 0)


FINITE = {  # schemas with a finite language: every constrained sequence must end by itself
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6},
                       "n": {"type": "integer", "minimum": 0, "maximum": 999},
                       "color": {"enum": ["red", "green"]}},
        "required": ["name", "n", "color"],
        "additionalProperties": False,
    },
    "flags": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "tags": _tags(2)},
        "required": ["ok", "tags"],
        "additionalProperties": False,
    },
}


def _engine_run(state, rows: list[tuple[list[int], SamplingParams]], factory=None) -> list[tuple[list[int], str]]:
    engine = Engine(state, EngineConfig.of(max_batch=len(rows), max_len=160), constraint_factory=factory)
    for i, (prompt, params) in enumerate(rows):
        engine.add(i, prompt, params)
    tokens: dict[int, list[int]] = {i: [] for i in range(len(rows))}
    reasons: dict[int, str] = {}
    while engine.num_active:
        for event in engine.step():
            tokens[event.seq_id].append(event.token_id)
            if event.finish_reason is not None:
                reasons[event.seq_id] = str(event.finish_reason)
    return [(tokens[i], reasons[i]) for i in range(len(rows))]


def test_engine_tiny_checkpoint_only_the_mask_makes_json(tiny32, tokenizer):
    """The tiny random checkpoint writes JSON only under the mask: in one continuous batch,
    constrained rows (greedy and seeded sampling, two schemas) all end by themselves ("stop") with
    output that validates, while the same rows unconstrained write no JSON."""
    factory = constraint_factory(tokenizer, tiny32.config.vocab_size)
    eos = tuple(sorted(tokenizer.eos_token_ids))
    prompt = tokenizer.encode("Reply with JSON:")
    plan = [("person", 0.0, None), ("person", 1.0, 1), ("flags", 1.0, 2), ("flags", 0.7, 3)]

    def rows(constrained: bool) -> list[tuple[list[int], SamplingParams]]:
        return [(prompt, SamplingParams(
            max_new_tokens=64, temperature=t, seed=seed, eos_token_ids=eos,
            grammar=compile_response_format(_schema_format(FINITE[name])) if constrained else None))
            for name, t, seed in plan]

    for (ids, reason), (name, _, _) in zip(_engine_run(tiny32, rows(True), factory), plan):
        text = tokenizer.decode(ids)
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), FINITE[name])
        assert _whitespace_outside_strings(text) == []
    for ids, _ in _engine_run(tiny32, rows(False)):
        with pytest.raises(ValueError):
            json.loads(tokenizer.decode(ids))
