"""Issue 14 end to end through the text-generation serving on the tiny float32 checkpoint: every
sampling option gives the engine's own tokens for the same SamplingParams (solo and mixed in one
continuous batch), logprobs, n completions with derived seeds, structured output that validates,
reasoning and tool calls, through Serving.run, stream, run_async / stream_async; bad values fail
alone in their caller. The pool: tests/models/test_generation_pool.py."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
from typing import Any

import jsonschema
import pytest

from mlx_serving.models import text_generation
from mlx_serving.models.generation import BLOCK_SIZE, Engine, EngineConfig
from mlx_serving.models.generation.events import SeqEvent
from mlx_serving.models.generation.sampling import SamplingParams
from mlx_serving.models.decoder.layers import State
from mlx_serving.models.text_generation._request import completion_seed
from mlx_serving.models.text_generation._structured import constraint_factory
from mlx_serving.serving import Serving
from mlx_serving.tokenization import Tokenizer

MAX_LEN, MAX_NEW = 256, 8
PROMPT = "Once upon a time"
#: Option sets sent as request keys; each is also a SamplingParams field set (the engine reference).
OPTION_SETS: list[dict[str, Any]] = [
    {"temperature": 1.0, "seed": 3, "top_k": 5},
    {"temperature": 0.9, "seed": 4, "min_p": 0.2},
    {"temperature": 0.9, "seed": 4, "top_p": 0.5},
    {"temperature": 1.0, "seed": 2, "repetition_penalty": 1.5},
    {"temperature": 0.8, "seed": 6, "presence_penalty": 1.5},
    {"temperature": 0.8, "seed": 6, "frequency_penalty": 2.0},
    {"logit_bias": {"128582": -100, "11": 4.0}},  # 128582: the first greedy token
    {"temperature": 1.0, "seed": 7, "min_tokens": 6},
    {"temperature": 0.7, "seed": 5, "logprobs": 3},
]
SCHEMA = {
    "type": "object",
    "properties": {"size": {"enum": ["S", "M", "L"]}, "ok": {"type": "boolean"},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["size", "ok", "n"],
    "additionalProperties": False,
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
#: What the tiny random model is held to (a lark grammar: only the mask makes it write this).
SCRIPT = '<think>\nplan it\n</think>\n\nSure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
SCRIPT_FORMAT = {"type": "grammar", "grammar": "start: " + json.dumps(SCRIPT)}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.qwen3()


@pytest.fixture(scope="module")
def gen(tok: Tokenizer, tiny32: State) -> Serving:
    return text_generation.serving(tok, tiny32, max_new_tokens=MAX_NEW, max_len=MAX_LEN, max_batch=8)


@pytest.fixture(scope="module")
def prompt_ids(tok: Tokenizer) -> list[int]:
    return tok.encode(PROMPT)


def _request(options: dict[str, Any]) -> dict[str, Any]:
    """Request keys for an option set (``logprobs`` N is the keys logprobs + top_logprobs)."""
    spec = {"text": PROMPT, **options}
    if "logprobs" in options:
        spec.update(logprobs=True, top_logprobs=options["logprobs"])
    return spec


def _engine(state: State, tok: Tokenizer, ids: list[int], params: SamplingParams,
            grammar: bool = False) -> list[SeqEvent]:
    """The engine's own events for one sequence (the reference for the serving)."""
    factory = constraint_factory(tok, state.config.vocab_size) if grammar else None
    engine = Engine(state, EngineConfig.of(max_batch=1, max_len=MAX_LEN), constraint_factory=factory)
    engine.add(0, ids, params)
    events: list[SeqEvent] = []
    while engine.num_active:
        events += engine.step()
    return events


def _params(tok: Tokenizer, **options: Any) -> SamplingParams:
    if "logit_bias" in options:  # JSON object keys -> token ids
        options["logit_bias"] = {int(k): v for k, v in options["logit_bias"].items()}
    return SamplingParams(**{"max_new_tokens": MAX_NEW, **options}, eos_token_ids=tuple(sorted(tok.eos_token_ids)))


def _one(result: dict[str, Any]) -> dict[str, Any]:
    assert set(result) == {"results"} and len(result["results"]) == 1
    return result["results"][0]


# ---- every option reaches the engine ------------------------------------------------------------

@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: "-".join(o))
def test_each_option_gives_the_engine_tokens(gen: Serving, tok: Tokenizer, tiny32: State, prompt_ids: list[int],
                                             options: dict[str, Any]) -> None:
    events = _engine(tiny32, tok, prompt_ids, _params(tok, **options))
    r = _one(Serving.run(gen, _request(options)))
    assert r["generated_text"] == tok.decode([e.token_id for e in events])
    assert (r["num_tokens"], r["finish_reason"]) == (len(events), str(events[-1].finish_reason))
    assert ("logprobs" in r) == ("logprobs" in options)


def test_mixed_options_in_one_batch_equal_their_solo_runs(gen: Serving) -> None:
    solo = [_one(Serving.run(gen, _request(o))) for o in OPTION_SETS]
    with gen.start(batch_size=8) as h:
        mixed = [_one(r) for r in h.run([_request(o) for o in OPTION_SETS])]
    assert [r["generated_text"] for r in mixed] == [r["generated_text"] for r in solo]
    assert mixed[-1]["logprobs"] == solo[-1]["logprobs"]


def test_logit_bias_forces_a_token_and_min_tokens_holds_eos_back(gen: Serving, tok: Tokenizer) -> None:
    (comma,) = tok.encode(",")
    r = _one(Serving.run(gen, {"text": PROMPT, "logit_bias": {str(comma): 100}}))
    assert r["generated_text"] == "," * MAX_NEW
    eos = {"text": PROMPT, "logit_bias": {"151645": 100}}
    assert _one(Serving.run(gen, eos))["num_tokens"] == 1
    r = _one(Serving.run(gen, {**eos, "min_tokens": 3}))
    assert (r["num_tokens"], r["finish_reason"]) == (4, "stop")


# ---- logprobs ------------------------------------------------------------------------------------

def test_logprobs_match_the_engine_and_describe_the_greedy_choice(gen: Serving, tok: Tokenizer, tiny32: State,
                                                                  prompt_ids: list[int]) -> None:
    r = _one(Serving.run(gen, {"text": PROMPT, "logprobs": True, "top_logprobs": 4}))
    events = _engine(tiny32, tok, prompt_ids, _params(tok, logprobs=4))
    entries = r["logprobs"]
    assert len(entries) == r["num_tokens"] == len(events)
    for entry, ev in zip(entries, events):
        assert entry["token_id"] == ev.token_id and entry["token"] == tok.decode([ev.token_id])
        assert math.isclose(entry["logprob"], ev.logprob, abs_tol=1e-6) and entry["logprob"] <= 0
        top = entry["top_logprobs"]
        assert len(top) == 4 and top[0]["token_id"] == ev.token_id  # greedy: the chosen token is the top one
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
    plain = _one(Serving.run(gen, {"text": PROMPT, "logprobs": True}))
    assert all(e["top_logprobs"] == [] for e in plain["logprobs"]) and "logprobs" not in _one(Serving.run(gen, PROMPT))


# ---- n completions -------------------------------------------------------------------------------

def test_n_completions_equal_solo_runs_with_the_derived_seeds(gen: Serving) -> None:
    spec = {"text": PROMPT, "temperature": 1.0, "seed": 42, "n": 3}
    results = Serving.run(gen, spec)["results"]
    solo = [_one(Serving.run(gen, {**spec, "n": 1, "seed": completion_seed(42, i)})) for i in range(3)]
    assert [r["generated_text"] for r in results] == [s["generated_text"] for s in solo]
    assert len({r["generated_text"] for r in results}) == 3
    assert _texts(Serving.run(gen, spec)) == _texts({"results": results})  # reproducible
    greedy = Serving.run(gen, [{"text": PROMPT, "n": 2}, "Hello"])
    assert [len(g["results"]) for g in greedy] == [2, 1]
    assert greedy[0]["results"][0]["generated_text"] == greedy[0]["results"][1]["generated_text"]


def test_n_completions_prefill_the_shared_prompt_once(gen: Serving, tok: Tokenizer) -> None:
    """The n rows share the prompt's full KV blocks: the later n - 1 reuse them from the prefix
    cache instead of computing them again (the last, partial block is each row's own)."""
    text = " ".join(f"w{i}" for i in range(40))
    shared = (len(tok.encode(text)) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert shared >= 4 * BLOCK_SIZE
    with gen.start() as h:
        results = h.run({"text": text, "n": 3, "temperature": 1.0, "max_new_tokens": 2})["results"]
        backend = h.stats().backend
    assert len(results) == 3
    assert (backend["prefix_hits"], backend["prefix_hit_tokens"]) == (2, 2 * shared)


# ---- streams and the async API -------------------------------------------------------------------

def _from_deltas(items: list[Any]) -> dict[int, dict[str, Any]]:
    """Stream deltas of one input joined per completion index."""
    out: dict[int, dict[str, Any]] = {}
    for item in items:
        row = out.setdefault(item["index"], {"content": "", "reasoning_content": "", "tool_calls": [],
                                             "logprobs": [], "final": None})
        if "finish_reason" in item:
            assert row["final"] is None
            row["final"] = item
            continue
        row["content"] += item["content"]
        row["reasoning_content"] += item.get("reasoning_content", "")
        row["tool_calls"] += item.get("tool_calls", [])
        row["logprobs"] += item.get("logprobs", [])
    return out


def _check_stream(items: list[Any], result: dict[str, Any]) -> None:
    rows = _from_deltas(items)
    assert sorted(rows) == list(range(len(result["results"])))
    for index, r in enumerate(result["results"]):
        row = rows[index]
        assert row["content"] == r["generated_text"] and row["logprobs"] == r.get("logprobs", [])
        assert row["final"]["finish_reason"] == r["finish_reason"] and row["final"]["num_tokens"] == r["num_tokens"]
        assert row["reasoning_content"] == r.get("reasoning_content", "")
        assert [c["function"] for c in row["tool_calls"]] == [c["function"] for c in r.get("tool_calls", [])]


def test_stream_deltas_carry_index_and_join_to_the_result(gen: Serving) -> None:
    spec = {"text": PROMPT, "n": 2, "temperature": 1.0, "seed": 8, "logprobs": True, "top_logprobs": 1}
    result = Serving.run(gen, spec)
    items = list(Serving.stream(gen, spec))
    assert all(isinstance(it, dict) and "index" in it for it in items)
    _check_stream(items, result)
    pairs = list(Serving.stream(gen, ["Hello", spec]))  # a list input: (input index, item) pairs
    assert {i for i, _ in pairs} == {0, 1} and all(isinstance(v, str) or "index" not in v for i, v in pairs if i == 0)
    _check_stream([v for i, v in pairs if i == 1], result)


def test_async_api_gives_the_sync_results(gen: Serving) -> None:
    spec = {"text": PROMPT, "n": 2, "temperature": 1.0, "seed": 9, "logprobs": True, "top_k": 3,
            "repetition_penalty": 1.2, "logit_bias": {"11": 2}, "min_tokens": 2, "priority": 1}
    result = Serving.run(gen, spec)

    async def main() -> tuple[Any, list[Any]]:
        with gen.start() as h:
            got = await h.run_async(spec)
            stream = await h.stream_async(spec)
            async with stream:
                items = [item async for item in stream]
        return got, items

    got, items = asyncio.run(main())
    assert [r["generated_text"] for r in got["results"]] == [r["generated_text"] for r in result["results"]]
    assert [r["logprobs"] for r in got["results"]] == [r["logprobs"] for r in result["results"]]
    _check_stream(items, result)


# ---- structured output, reasoning and tool calls -------------------------------------------------

def test_json_schema_outputs_validate(gen: Serving, tok: Tokenizer) -> None:
    """Sampled rows under the schema: every completion that ends by itself parses and validates
    (the tiny random model writes no JSON without the mask: tests/models/test_structured.py)."""
    spec = {"text": "JSON please:", "response_format": JSON_FORMAT, "n": 4, "temperature": 1.0, "seed": 1,
            "max_new_tokens": 48}
    results = Serving.run(gen, spec)["results"]
    finished = [r for r in results if r["finish_reason"] == "stop"]
    assert len(finished) >= 3
    for r in finished:
        jsonschema.validate(json.loads(r["generated_text"]), SCHEMA)
        assert " " not in r["generated_text"]  # compact: the schema's strings hold no space
    greedy = _one(Serving.run(gen, {"text": "JSON please:", "response_format": {"type": "json_object"},
                                    "max_new_tokens": 48}))
    if greedy["finish_reason"] == "stop":
        assert isinstance(json.loads(greedy["generated_text"]), dict)


def test_reasoning_and_tool_calls_in_results_and_streams(gen: Serving) -> None:
    spec = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS, "enable_thinking": True,
            "response_format": SCRIPT_FORMAT, "max_new_tokens": 64}
    r = _one(Serving.run(gen, spec))
    assert r["reasoning_content"] == "plan it" and r["generated_text"] == "Sure."
    [call] = r["tool_calls"]
    assert call["type"] == "function" and re.fullmatch("call_[0-9a-f]{24}", call["id"])
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert r["finish_reason"] == "tool_calls"
    items = list(Serving.stream(gen, spec))
    _check_stream(items, {"results": [r]})
    assert sum(len(it.get("tool_calls", [])) for it in items) == 1  # emitted once, when complete
    assert not any("<" in it.get("content", "") for it in items)  # no partial tag leaks
    without = _one(Serving.run(gen, {"text": "x", "response_format": SCRIPT_FORMAT, "max_new_tokens": 64}))
    assert without["generated_text"] == SCRIPT and "tool_calls" not in without  # no tools, no thinking: raw text


# ---- bad values fail alone -----------------------------------------------------------------------

BAD = [({"top_k": -1}, "top_k"), ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
       ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": "x"}, "frequency_penalty"),
       ({"logit_bias": {"999999": 1}}, "logit_bias"), ({"min_tokens": 99}, "min_tokens"),
       ({"logprobs": "yes"}, "logprobs"), ({"top_logprobs": 3}, "top_logprobs"), ({"n": 99}, "n must"),
       ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": 3}}}, "response_format"),
       ({"priority": 0.5}, "priority")]


def test_bad_values_fail_in_their_caller_and_batchmates_get_their_solo_results(gen: Serving) -> None:
    good = [_request(OPTION_SETS[0]), {"text": PROMPT, "n": 2, "logprobs": True}]
    solo = [Serving.run(gen, g) for g in good]
    errors: list[tuple[str, BaseException | None]] = []
    answers: dict[int, Any] = {}
    with gen.start(batch_size=8) as h:
        def bad_call(spec: dict[str, Any], match: str) -> None:
            try:
                h.run({"text": PROMPT, **spec})
            except BaseException as exc:  # noqa: BLE001 - checked below
                errors.append((match, exc))
                return
            errors.append((match, None))

        threads = [threading.Thread(target=bad_call, args=b) for b in BAD]
        threads += [threading.Thread(target=lambda i=i: answers.__setitem__(i, h.run(good[i]))) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stats = h.stats()
    assert len(errors) == len(BAD)
    for match, exc in errors:
        assert isinstance(exc, ValueError) and re.search(match, str(exc)), (match, exc)
    assert [_texts(answers[i]) for i in range(2)] == [_texts(s) for s in solo]
    assert answers[1]["results"][1]["logprobs"] == solo[1]["results"][1]["logprobs"]
    assert stats.running == 0


def _texts(result: dict[str, Any]) -> list[str]:
    return [r["generated_text"] for r in result["results"]]
