"""The text-generation Serving: inputs, outputs, sampling options, stop strings, timing, bad input
(the CLI: tests/models/test_cli.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from mlx_serving.models import text_generation
from mlx_serving.models.generation import generate
from mlx_serving.models.decoder.layers import State
from mlx_serving.serving import Serving
from mlx_serving.tokenization import Tokenizer

PROMPTS = ["Write a short story about a robot who learns to love.", "Hello", "1 2 3 4 5 6 7 8 9"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.qwen3()


@pytest.fixture(scope="module")
def gen(tok: Tokenizer, tiny32: State) -> Serving:
    return text_generation.serving(tok, tiny32, max_new_tokens=10, max_len=128, max_batch=4)


def _one(result: dict) -> dict:
    assert set(result) == {"results"} and len(result["results"]) == 1
    return result["results"][0]


def test_string_input_matches_generate_and_decode(gen: Serving, tok: Tokenizer, tiny32: State) -> None:
    ids = tok.encode(PROMPTS[0])
    expected, info = generate(ids, tiny32, max_new_tokens=10, max_len=128, eos_token_ids=sorted(tok.eos_token_ids))
    r = _one(Serving.run(gen, PROMPTS[0]))
    assert r["generated_text"] == tok.decode(expected)
    assert r["num_tokens"] == len(expected)
    assert r["finish_reason"] == info["finish_reason"]
    summary = dict(r["token_summary"])
    assert 0 <= summary.pop("cached", 0) < len(ids)  # prompt tokens found in the prefix cache
    assert summary == {"input": len(ids), "output": len(expected)}
    assert set(r["timing"]) == {"prefill_ms", "decode_ms", "total_ms", "itl_ms"}
    gaps = r["timing"]["itl_ms"]  # one inter-token latency per decode token, summing to decode_ms
    assert len(gaps) == r["num_tokens"] - 1 and all(g >= 0 for g in gaps)
    assert sum(gaps) == pytest.approx(r["timing"]["decode_ms"])


def test_dict_and_list_inputs_keep_order(gen: Serving) -> None:
    solo = [_one(Serving.run(gen, p))["generated_text"] for p in PROMPTS]
    batch = Serving.run(gen, [PROMPTS[0], {"text": PROMPTS[1]}, PROMPTS[2]])
    assert isinstance(batch, list) and len(batch) == 3
    assert [_one(r)["generated_text"] for r in batch] == solo


def test_per_request_max_new_tokens(gen: Serving) -> None:
    short = _one(Serving.run(gen, {"text": PROMPTS[0], "max_new_tokens": 3}))
    assert short["num_tokens"] == 3 and short["finish_reason"] == "length"


def test_temperature_samples_under_the_default_options(gen: Serving) -> None:
    """Greedy is temperature 0 (the default); temperature > 0 samples, reproducibly per seed."""
    greedy = _one(Serving.run(gen, PROMPTS[1]))["generated_text"]
    assert _one(Serving.run(gen, {"text": PROMPTS[1], "seed": 11}))["generated_text"] == greedy
    sampled = {}
    for seed in (11, 12, 13):
        req = {"text": PROMPTS[1], "temperature": 1.0, "seed": seed}
        sampled[seed] = _one(Serving.run(gen, req))["generated_text"]
        assert _one(Serving.run(gen, req))["generated_text"] == sampled[seed]
    assert any(text != greedy for text in sampled.values())


def test_serving_default_temperature_samples(tok: Tokenizer, tiny32: State, gen: Serving) -> None:
    greedy = _one(Serving.run(gen, PROMPTS[1]))["generated_text"]
    hot = text_generation.serving(tok, tiny32, max_new_tokens=10, max_len=128, temperature=1.0, top_p=0.95)
    texts = [_one(Serving.run(hot, {"text": PROMPTS[1], "seed": s}))["generated_text"] for s in (11, 12, 13)]
    assert any(t != greedy for t in texts)
    assert _one(Serving.run(hot, {"text": PROMPTS[1], "seed": 12}))["generated_text"] == texts[1]
    assert _one(Serving.run(hot, {"text": PROMPTS[1], "temperature": 0}))["generated_text"] == greedy


def test_chat_messages_use_the_template(gen: Serving, tok: Tokenizer, tiny32: State) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    r = _one(Serving.run(gen, {"messages": messages}))
    assert r["token_summary"]["input"] == len(tok.encode_chat(messages))
    chat = text_generation.serving(tok, tiny32, max_new_tokens=10, max_len=128, chat=True)
    assert _one(Serving.run(chat, "Hello"))["generated_text"] == r["generated_text"]


def test_stop_string_cuts_text_and_finishes_with_stop(gen: Serving) -> None:
    full = _one(Serving.run(gen, PROMPTS[0]))["generated_text"]
    assert len(full) > 6
    stop = full[3:6]
    r = _one(Serving.run(gen, {"text": PROMPTS[0], "stop": [stop]}))
    assert r["finish_reason"] == "stop"
    assert r["generated_text"] == full[: full.index(stop)]
    assert r["num_tokens"] < 10


def test_stop_string_result_and_final_stream_item_have_timing(gen: Serving) -> None:
    with Serving.start(gen) as h:  # process mode (see test_profile_timing_false_omits_timing)
        full = _one(Serving.batched_run(h, PROMPTS[0], deadline=60))["generated_text"]
        req = {"text": PROMPTS[0], "stop": [full[3:6]]}
        r = _one(Serving.batched_run(h, req, deadline=60))
        final = list(Serving.stream(h, req, deadline=60))[-1]
    for done in (r, final):
        assert done["finish_reason"] == "stop"
        assert set(done["timing"]) == {"prefill_ms", "decode_ms", "total_ms", "itl_ms"}
        t = done["timing"]
        assert t["prefill_ms"] > 0 and t["total_ms"] == pytest.approx(t["prefill_ms"] + t["decode_ms"])


def test_profile_timing_false_omits_timing(tok: Tokenizer, tiny32: State) -> None:
    quiet = text_generation.serving(tok, tiny32, max_new_tokens=10, max_len=128, profile_timing=False)
    with Serving.start(quiet) as h:  # process mode: an inline run after an inline stop-string run can hang
        full = _one(Serving.batched_run(h, PROMPTS[0], deadline=60))["generated_text"]
        for req in (PROMPTS[0], {"text": PROMPTS[0], "stop": [full[3:6]]}):
            assert "timing" not in _one(Serving.batched_run(h, req, deadline=60))
            assert "timing" not in list(Serving.stream(h, req, deadline=60))[-1]


def test_results_are_plain_json(gen: Serving) -> None:
    r = _one(Serving.run(gen, PROMPTS[0]))
    assert type(r["finish_reason"]) is str
    assert json.loads(json.dumps(r)) == r


@pytest.mark.parametrize("bad, match", [
    ("", "text must be a non-empty string"),
    ({"messages": []}, "non-empty list"),
    ([], "empty input list"),
    ({"text": "hi", "bogus": 1}, "unknown input keys"),
    ({"text": "hi", "messages": []}, "exactly one"),
    (42, "expected a string"),
    ({"text": "hi", "sampler": "greedy"}, r"unknown input keys \['sampler'\]"),
    ({"text": "hi", "top_p": 1.5}, "top_p"),
    ({"text": "hi", "temperature": -1}, "temperature"),
    ({"text": "hi", "temperature": float("nan")}, "temperature"),
    ({"text": "hi", "temperature": "hot"}, "temperature"),
    ({"text": "hi", "temperature": 1.0, "seed": -3}, "seed"),
    ({"text": "hi", "max_new_tokens": 0}, "max_new_tokens"),
    ({"text": "hi", "max_new_tokens": 200}, r"1 tokens \+ max_new_tokens 200 = 201 exceeds max_len 128"),
    (["ok", ""], "input 1: text must be a non-empty string"),
])
def test_bad_input_raises_value_error(gen: Serving, bad: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Serving.run(gen, bad)


def test_bad_request_fails_only_its_caller_in_process_mode(gen: Serving) -> None:
    solo = _one(Serving.run(gen, PROMPTS[1]))["generated_text"]
    results: dict[str, object] = {}

    def call(key: str, value: object) -> None:
        try:
            results[key] = _one(Serving.batched_run(h, value, deadline=60))["generated_text"]
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results[key] = e

    with Serving.start(gen, batch_timeout=0.05) as h:
        threads = [threading.Thread(target=call, args=(k, v)) for k, v in
                   (("good", PROMPTS[1]), ("bad", {"text": "hi", "max_new_tokens": 500}))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert results["good"] == solo
        assert isinstance(results["bad"], ValueError)
        assert _one(Serving.batched_run(h, PROMPTS[1], deadline=60))["generated_text"] == solo


@pytest.mark.parametrize("options, match", [
    ({"top_p": 0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_len": 1}, "max_len"), ({"stop": [""]}, "stop"),
    ({"max_len": 64, "max_new_tokens": 100}, "max_new_tokens 100 must be < max_len 64"),
])
def test_bad_serving_options_raise_at_construction(tok: Tokenizer, tiny32: State, options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        text_generation.serving(tok, tiny32, **options)


def test_from_mlx4bit_names_missing_file(tiny32_ckpt: Path, tmp_path: Path) -> None:
    broken = tmp_path / "ckpt"
    broken.mkdir()
    (broken / "config.json").write_bytes((tiny32_ckpt / "config.json").read_bytes())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        text_generation.from_mlx4bit(broken)
    with pytest.raises(TypeError, match="unknown text-generation options"):
        text_generation.from_mlx4bit(tiny32_ckpt, max_new_token=3)
