"""The text-generation Serving: inputs, outputs, stop strings, bad input, the CLI."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from mlx_serving.models import text_generation
from mlx_serving.models.__main__ import main as cli_main
from mlx_serving.models.qwen3 import State, generate
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
    assert r["token_summary"] == {"input": len(ids), "output": len(expected)}
    assert set(r["timing"]) == {"prefill_ms", "decode_ms", "total_ms"}


def test_dict_and_list_inputs_keep_order(gen: Serving) -> None:
    solo = [_one(Serving.run(gen, p))["generated_text"] for p in PROMPTS]
    batch = Serving.run(gen, [PROMPTS[0], {"text": PROMPTS[1]}, PROMPTS[2]])
    assert isinstance(batch, list) and len(batch) == 3
    assert [_one(r)["generated_text"] for r in batch] == solo


def test_per_request_max_new_tokens_and_seeded_sampling(gen: Serving) -> None:
    short = _one(Serving.run(gen, {"text": PROMPTS[0], "max_new_tokens": 3}))
    assert short["num_tokens"] == 3 and short["finish_reason"] == "length"
    req = {"text": PROMPTS[1], "sampler": "top_p_gpu", "temperature": 1.0, "top_p": 0.95, "seed": 11}
    a, b = _one(Serving.run(gen, req)), _one(Serving.run(gen, req))
    assert a["generated_text"] == b["generated_text"]
    other = [_one(Serving.run(gen, {**req, "seed": s}))["generated_text"] for s in (12, 13, 14)]
    assert any(t != a["generated_text"] for t in other)


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


@pytest.mark.parametrize("bad, match", [
    ("", "empty prompt"),
    ({"messages": []}, "non-empty list"),
    ([], "empty input list"),
    ({"text": "hi", "bogus": 1}, "unknown input keys"),
    ({"text": "hi", "messages": []}, "exactly one"),
    (42, "expected a string"),
    ({"text": "hi", "sampler": "beam"}, "sampler"),
    ({"text": "hi", "top_p": 1.5}, "top_p"),
    ({"text": "hi", "temperature": -1}, "temperature"),
    ({"text": "hi", "max_new_tokens": 0}, "max_new_tokens"),
    ({"text": "hi", "max_new_tokens": 200}, r"1 tokens \+ max_new_tokens 200 = 201 exceeds max_len 128"),
    (["ok", ""], "input 1: empty prompt"),
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
    ({"sampler": "nope"}, "sampler"), ({"top_p": 0}, "top_p"), ({"temperature": -0.5}, "temperature"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"max_len": 1}, "max_len"), ({"stop": [""]}, "stop"),
    ({"max_len": 64}, "max_new_tokens 100 must be < max_len 64"),
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


def test_cli_generate_prints_text_and_timing(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["generate", "Hello", "--model", str(tiny_ckpt), "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    expected = _one(text_generation.from_mlx4bit(tiny_ckpt, max_new_tokens=5).run("Hello"))["generated_text"]
    assert out == expected + "\n"
    assert "prompt 1 tokens" in err and "5 new tokens" in err and "tok/s" in err


def test_cli_reports_bad_input_with_exit_status_2(tiny_ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["generate", "", "--model", str(tiny_ckpt)]) == 2
    assert "empty prompt" in capsys.readouterr().err
