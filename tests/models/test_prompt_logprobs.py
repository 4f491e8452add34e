"""Prompt log-probabilities (``prompt_logprobs``; the server's completions ``echo``) on the tiny
float32 checkpoint: equal to a teacher-forced reference (one plain ``layers.forward`` per prefix,
numpy log-softmax), batched == solo, ``max_new_tokens`` 0 (score only), and generation after them
unchanged."""

from __future__ import annotations

import pickle

import mlx.core as mx
import numpy as np
import pytest

from mlx_serving.models import text_generation
from mlx_serving.models.decoder.layers import State, forward
from mlx_serving.models.generation.sampling import SamplingParams
from mlx_serving.models.text_generation._backend import GenerationBackend
from mlx_serving.models.text_generation._events import PromptEvent, TokenEvent
from mlx_serving.models.text_generation._inputs import Prompt
from mlx_serving.models.text_generation._options import GenerationOptions
from mlx_serving.serving import InvalidInput, Serving
from mlx_serving.tokenization import Tokenizer
from paged import fresh

TEXT = "The quick brown fox jumps over the lazy dog, twice."


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.qwen3()


@pytest.fixture(scope="module")
def gen(tok: Tokenizer, tiny32: State) -> Serving:
    return text_generation.serving(tok, tiny32, max_new_tokens=6, max_len=128, max_batch=4)


def _reference(state: State, ids: list[int]) -> np.ndarray:
    """log-softmax (float64) of the logits after ``ids``: a plain dense forward through a KV cache."""
    n = len(ids)
    kv = fresh(state, n + 1)
    rows = kv.rows(mx.array([ids], dtype=mx.int32), mx.zeros((1,), dtype=mx.int32), mx.array([n], dtype=mx.int32),
                   n, mx.array([n - 1], dtype=mx.int32), dense=True)
    z = np.array(forward(state, kv.cache, rows)[0]).astype(np.float64)
    return z - (np.log(np.exp(z - z.max()).sum()) + z.max())


def _content(result: object) -> object:
    """A result without what depends on timing or the prefix cache (``timing``, ``cached``)."""
    if isinstance(result, list):
        return [_content(r) for r in result]
    assert isinstance(result, dict)
    return [{**{k: v for k, v in r.items() if k != "timing"},
             "token_summary": {k: v for k, v in r["token_summary"].items() if k != "cached"}}
            for r in result["results"]]


def _one(result: object) -> dict:
    assert isinstance(result, dict) and len(result["results"]) == 1
    return result["results"][0]


def test_prompt_logprobs_equal_a_teacher_forced_reference(gen: Serving, tok: Tokenizer, tiny32: State) -> None:
    ids = tok.encode(TEXT)
    r = _one(Serving.run(gen, {"text": TEXT, "max_new_tokens": 0, "prompt_logprobs": 3}))
    assert (r["generated_text"], r["num_tokens"], r["finish_reason"]) == ("", 0, "length")
    assert r["token_summary"]["input"] == len(ids) and r["token_summary"]["output"] == 0
    entries = r["prompt_logprobs"]
    assert [e["token_id"] for e in entries] == ids
    assert [e["token"] for e in entries] == [tok.decode([i]) for i in ids]  # ASCII text: each token's own
    assert entries[0]["logprob"] is None and entries[0]["top_logprobs"] == []
    for i in range(1, len(ids)):
        ref = _reference(tiny32, ids[:i])
        e = entries[i]
        assert e["logprob"] == pytest.approx(ref[ids[i]], abs=1e-4)
        top = np.argsort(-ref)[:3]
        assert [t["token_id"] for t in e["top_logprobs"]] == top.tolist()
        assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(ref[top].tolist(), abs=1e-4)
        assert [t["token"] for t in e["top_logprobs"]] == [tok.decode([int(t)]) for t in top]


def test_batched_equals_solo_and_generation_is_unchanged(gen: Serving, tok: Tokenizer) -> None:
    inputs = [{"text": TEXT, "max_new_tokens": 0, "prompt_logprobs": 2},
              {"text": "Hello there", "max_new_tokens": 5, "prompt_logprobs": 0, "logprobs": True},
              {"text": "1 2 3 4 5", "max_new_tokens": 4},
              {"text": "Hello there", "max_new_tokens": 5, "prompt_logprobs": 1, "n": 2}]
    solo = [Serving.run(gen, x) for x in inputs]
    batched = Serving.run(gen, inputs)
    assert _content(batched) == [_content(r) for r in solo]
    plain = _one(Serving.run(gen, {"text": "Hello there", "max_new_tokens": 5, "logprobs": True}))
    scored = _one(solo[1])
    assert scored["generated_text"] == plain["generated_text"] and scored["logprobs"] == plain["logprobs"]
    assert scored["num_tokens"] == plain["num_tokens"] == 5
    assert [e["top_logprobs"] for e in scored["prompt_logprobs"]] == [[]] * len(tok.encode("Hello there"))
    assert "prompt_logprobs" not in _one(solo[2])
    first, second = solo[3]["results"]
    assert first["prompt_logprobs"] == second["prompt_logprobs"]
    assert all(len(e["top_logprobs"]) == 1 for e in first["prompt_logprobs"][1:])


def test_stream_gives_the_prompt_first(gen: Serving, tok: Tokenizer) -> None:
    with Serving.start(gen) as h:
        items = list(Serving.stream(h, {"text": "Hello there", "max_new_tokens": 3, "prompt_logprobs": 1},
                                    deadline=60))
        only = list(Serving.stream(h, {"text": "Hello there", "max_new_tokens": 0, "prompt_logprobs": 0},
                                   deadline=60))
    assert len(items[0]["prompt_logprobs"]) == len(tok.encode("Hello there")) and items[0]["content"] == ""
    assert all("prompt_logprobs" not in item for item in items[1:])
    assert items[-1]["finish_reason"] in ("stop", "length") and items[-1]["num_tokens"] >= 1
    assert [set(item) >= {"finish_reason"} for item in only] == [False, True]
    assert only[1]["finish_reason"] == "length" and only[1]["num_tokens"] == 0


def test_one_token_prompt_has_only_its_first_entry(gen: Serving, tok: Tokenizer) -> None:
    ids = tok.encode("Hi")
    assert len(ids) == 1
    r = _one(Serving.run(gen, {"text": "Hi", "max_new_tokens": 0, "prompt_logprobs": 5}))
    assert r["prompt_logprobs"] == [{"token_id": ids[0], "token": "Hi", "logprob": None, "top_logprobs": []}]


@pytest.mark.parametrize(("item", "param"), [
    ({"text": "hi", "max_new_tokens": 0}, "max_new_tokens"),
    ({"text": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"text": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"text": "hi", "prompt_logprobs": True}, "prompt_logprobs"),
    ({"text": "hi", "max_new_tokens": 0, "prompt_logprobs": 1, "min_tokens": 1}, "min_tokens"),
])
def test_bad_prompt_logprobs_inputs_name_the_key(gen: Serving, item: dict, param: str) -> None:
    with pytest.raises(InvalidInput) as err:
        Serving.run(gen, item)
    assert err.value.param == param and param in str(err.value)


def test_backend_counts_score_only_rows_until_stepped_and_cancels_them(tiny32: State) -> None:
    backend = GenerationBackend(tiny32, GenerationOptions(max_new_tokens=4, max_len=64, max_batch=2))
    engine = backend.init("inline", None, 1)
    score = Prompt([1, 2, 3], SamplingParams(1), prompt_logprobs=0, generate=False)
    assert backend.admit(engine, [(0, score), (1, score)], 0) == []
    assert backend.active(engine) == 2 and engine.num_active == 0
    backend.cancel(engine, [1])
    out = backend.step(engine)
    assert [(r, type(ev), done) for r, ev, done in out] == [(0, PromptEvent, True)]
    assert len(out[0][1].tokens) == 2 and out[0][1].first == 1 and backend.active(engine) == 0
    assert pickle.loads(pickle.dumps(out[0][1])) == out[0][1]  # it crosses the ServingPool wire
    both = Prompt([1, 2, 3], SamplingParams(2), prompt_logprobs=0)
    assert backend.admit(engine, [(2, both)], 0) == []
    out = []
    while backend.active(engine):
        out += backend.step(engine)
    assert [type(ev) for _, ev, _ in out] == [PromptEvent, TokenEvent, TokenEvent]
    assert [done for _, _, done in out] == [False, False, True]
    backend.close(engine)
