"""The Llama family (models/families/llama.py): greedy parity with mlx-lm's ``mlx_lm.models.llama`` on seeded
tiny checkpoints (4-bit and float32; biases; RoPE scaling "llama3" and "linear"; Mistral), a
checkpoint written by mlx-lm's own saver, continuous batching through the Engine, serving through
``text_generation.from_mlx4bit`` and the registry (models/families), and the config / tensor checks."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from parity import DROP, assert_logits_match, copy_with_config, mlx_lm_greedy

from mlx_serving.models import text_generation
from mlx_serving.models._checkpoint import MissingFieldError
from mlx_serving.models.families import FAMILIES, model_type, read_config
from mlx_serving.models.families.llama import LLAMA3_ROPE_SCALING, config_from_dict
from mlx_serving.models.decoder.layers import rope_frequencies
from mlx_serving.models.loader import load
from mlx_serving.models.seeded_checkpoint import write_checkpoint
from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams, generate
from mlx_serving.serving import Serving

ELIXIR = [7985, 825, 11652, 911, 468, 97772, 13]  # "Write one sentence about Elixir." (Qwen3 tokenizer)
LONG = [int(x) for x in np.random.default_rng(7).integers(0, 151000, 40)]
#: Llama 3's rule with a short original context, so that most of the tiny model's frequencies are
#: stretched or interpolated (Llama 3.2's 8192 touches only the slowest ones of a 16-dim head).
SHARP_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}

#: name -> write_checkpoint arguments (seed 0 unless given; ``attention_bias``, ``mlp_bias`` and
#: ``rope_scaling`` are config.json fields, :func:`_write` passes them as overrides).
VARIANTS: dict[str, dict[str, Any]] = {
    "q4": {},  # mlx-community layout: 4-bit, tied, Llama 3.2's rope_scaling
    "q4_bias_untied": dict(attention_bias=True, tie_word_embeddings=False, seed=1),
    "f32": dict(quantized=False, dtype="float32", tie_word_embeddings=False, rope_scaling=None),
    "f32_bias": dict(quantized=False, dtype="float32", attention_bias=True, mlp_bias=True, rope_scaling=None,
                     seed=2),
    "f32_llama3": dict(quantized=False, dtype="float32", rope_scaling=SHARP_LLAMA3, seed=3),
    "f32_linear": dict(quantized=False, dtype="float32", rope_scaling={"type": "linear", "factor": 4.0}, seed=4),
    "f32_mistral": dict(quantized=False, dtype="float32", rope_scaling=None, seed=5, config_overrides={
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None,
        "rope_theta": 1_000_000.0}),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llama")
    return {name: _write(root / name, **kw) for name, kw in VARIANTS.items()}


def _write(path: Path, *, config_overrides: dict[str, Any] | None = None, **kw: Any) -> Path:
    """A seeded llama checkpoint; the config fields of ``kw`` become overrides."""
    fields = {k: kw.pop(k) for k in ("attention_bias", "mlp_bias", "rope_scaling") if k in kw}
    return write_checkpoint(path, family="llama", config_overrides={**fields, **(config_overrides or {})}, **kw)


@pytest.fixture(scope="module")
def f32(ckpts: dict[str, Path]):
    return load(ckpts["f32_llama3"])


def _mlx_lm_model(path: Path, dtype=mx.float32):
    """mlx-lm's model for ``path`` (``load_model``: config.json's model_type through
    ``_get_classes``; mistral maps to its llama module), floating parameters cast to ``dtype``."""
    from mlx_lm.utils import load_model

    model = load_model(path)[0]
    model.set_dtype(dtype)
    return model


# ---- parity with mlx-lm --------------------------------------------------------------------

@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_ids_match_mlx_lm(ckpts, name):
    """Exact greedy ids over 24 new tokens, both sides computing in float32 (4-bit weights: the
    same packed values through quantized_matmul on both sides, as in the Qwen3 parity tests)."""
    state = load(ckpts[name])
    assert model_type(ckpts[name]) == state.config.model_type and FAMILIES[state.config.model_type] == "llama"
    model = _mlx_lm_model(ckpts[name])
    for prompt in (LONG, ELIXIR) if name == "q4" else (LONG,):
        # mlx-lm's ids: the exact path (the native step's int8 activations differ)
        ours, info = generate(prompt, state, max_new_tokens=24, eos_token_ids=[], decode_path="matmul")
        assert ours == mlx_lm_greedy(model, prompt, 24), (name, prompt[:3])
        assert info["finish_reason"] == "length" and len(set(ours)) > 4  # not degenerate


def test_greedy_ids_match_mlx_lm_bfloat16(ckpts):
    """The 4-bit checkpoint computing in its stored bfloat16, as mlx-lm loads it (16 tokens: MLX's
    CPU kernels are ~8x slower in bfloat16)."""
    state = load(ckpts["q4"], dtype="bfloat16")
    ours, _ = generate(ELIXIR, state, max_new_tokens=16, eos_token_ids=[])
    assert ours == mlx_lm_greedy(_mlx_lm_model(ckpts["q4"], mx.bfloat16), ELIXIR, 16)


def test_prefill_and_decode_logits_match_mlx_lm(ckpts):
    assert_logits_match(load(ckpts["f32_bias"]), _mlx_lm_model(ckpts["f32_bias"]), ELIXIR)


def test_llama3_frequencies_are_mlx_lm_s_and_change_the_outputs(ckpts, f32):
    from mlx_lm.models.rope_utils import initialize_rope

    c = f32.config
    for block in (SHARP_LLAMA3, LLAMA3_ROPE_SCALING):
        ref = initialize_rope(c.head_dim, c.rope_theta, False, block, c.max_position_embeddings)
        ours = rope_frequencies(config_from_dict({**json.loads((ckpts["f32_llama3"] / "config.json").read_text()),
                                                  "rope_scaling": block}))
        assert np.array_equal(np.array(ours), np.array(ref._freqs))
    # the same weights without the scaling give other tokens: the parity test above exercises it
    plain = dataclasses.replace(f32, rope_freqs=None)
    assert generate(LONG, plain, max_new_tokens=16, eos_token_ids=[])[0] != \
        generate(LONG, f32, max_new_tokens=16, eos_token_ids=[])[0]


@pytest.mark.parametrize("quantized", [False, True], ids=["dense", "4bit"])
def test_checkpoint_saved_by_mlx_lm_loads_and_matches(tmp_path, quantized):
    """An mlx-lm Llama (GQA 4:1, biases, untied head, llama3 RoPE) written by mlx-lm's own
    ``save_model`` / ``save_config`` (``quantize_model`` first for 4-bit) loads through the
    registry and generates mlx-lm's greedy ids."""
    from mlx_lm.models import llama
    from mlx_lm.utils import quantize_model, save_config, save_model

    cfg = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=512,
               attention_bias=True, mlp_bias=True, tie_word_embeddings=False, rope_theta=500000.0,
               rope_scaling=SHARP_LLAMA3)
    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    if quantized:
        model, cfg = quantize_model(model, cfg, 64, 4)
    save_model(tmp_path, model)
    save_config(cfg, tmp_path / "config.json")
    state = load(tmp_path)
    assert state.config.num_key_value_heads == 1 and state.config.attention_bias
    assert (state.embed_tokens.scales is not None) == quantized
    for prompt in ([1, 5, 77, 300, 12], [9, 8, 7]):
        # the exact path: mlx-lm's ids are compared token for token (the native default rounds to int8)
        ours, _ = generate(prompt, state, max_new_tokens=24, eos_token_ids=[], decode_path="matmul")
        assert ours == mlx_lm_greedy(model, prompt, 24)


def test_dequantized_load_is_close(ckpts):
    quant, dense = load(ckpts["q4_bias_untied"]), load(ckpts["q4_bias_untied"], dequantize=True)
    assert dense.layers[0].qkv.merged.scales is None and dense.layers[0].qkv.merged.bias is not None
    from mlx_serving.models.decoder.layers import forward
    from paged import fresh

    t = len(ELIXIR)
    ka, kb = fresh(quant, 16), fresh(dense, 16)
    args = (mx.array([ELIXIR]), mx.array([0]), mx.array([t]), t, mx.array([t - 1]))
    a = forward(quant, ka.cache, ka.rows(*args, dense=True))
    b = forward(dense, kb.cache, kb.rows(*args, dense=True))
    np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-3)


# ---- continuous batching -------------------------------------------------------------------

def _run(engine: Engine, adds: dict[int, list[tuple[int, list[int], int]]]) -> dict[int, list[int]]:
    """Step ``engine`` to the end, adding ``adds[step]`` = [(seq_id, prompt, max_new)] before a step."""
    out: dict[int, list[int]] = {}
    step = 0
    while step <= max(adds) or engine.num_active:
        for seq_id, prompt, n in adds.get(step, []):
            engine.add(seq_id, prompt, SamplingParams(max_new_tokens=n))
            out[seq_id] = []
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
        step += 1
    return out


def test_batched_equals_solo_through_the_engine(f32):
    """Staggered arrivals, chunked prefill, a queue longer than the batch: every sequence's
    tokens equal its solo run (float32, exact)."""
    rng = np.random.default_rng(3)
    prompts = [[int(x) for x in rng.integers(0, 151000, n)] for n in (3, 17, 1, 30, 9)]
    news = [12, 5, 9, 7, 10]
    solo = [generate(p, f32, max_new_tokens=n, eos_token_ids=[])[0] for p, n in zip(prompts, news)]
    engine = Engine(f32, EngineConfig.of(max_batch=3, max_len=64, prefill_chunk=8))
    adds = {0: [(0, prompts[0], news[0]), (1, prompts[1], news[1])], 2: [(2, prompts[2], news[2])],
            3: [(3, prompts[3], news[3]), (4, prompts[4], news[4])]}
    out = _run(engine, adds)
    assert [out[i] for i in range(5)] == solo


def test_compiled_decode_gives_the_same_tokens(f32):
    """``compile_decode=True`` traces the shared decoder with this family's hooks (the
    family-generic ``compiled_decode``)."""
    adds = {0: [(0, ELIXIR, 8), (1, LONG[:5], 8)]}
    eager = _run(Engine(f32, EngineConfig.of(max_batch=2, max_len=64)), adds)
    assert _run(Engine(f32, EngineConfig.of(max_batch=2, max_len=64, compile_decode=True)), adds) == eager


# ---- serving through the registry ------------------------------------------------------------

def test_from_mlx4bit_serves_a_llama_checkpoint(ckpts):
    gen = text_generation.from_mlx4bit(ckpts["q4"], max_new_tokens=8, max_len=128, max_batch=2)
    r = Serving.run(gen, {"text": "Hello", "max_new_tokens": 6})["results"][0]
    assert r["num_tokens"] == 6 and r["finish_reason"] == "length" and r["generated_text"]
    from mlx_serving.tokenization import Tokenizer

    tok = Tokenizer.from_dir(ckpts["q4"])
    ids, _ = generate(tok.encode("Hello"), load(ckpts["q4"]), max_new_tokens=6, max_len=128,
                      eos_token_ids=sorted(tok.eos_token_ids))
    assert r["generated_text"] == tok.decode(ids)
    with gen.start() as h:  # process mode: continuous batching of two callers' rows
        both = Serving.run(h, ["Hello", {"text": "Hello", "max_new_tokens": 6}])
    assert [b["results"][0]["generated_text"] for b in both][1] == r["generated_text"]


@pytest.mark.parametrize("kind", ["gpt2", None, ["llama"]])
def test_registry_rejects_an_unknown_model_type(ckpts, tmp_path, kind):
    d = copy_with_config(ckpts["f32"], tmp_path / "ckpt", model_type=kind)
    for call in (load, text_generation.from_mlx4bit):
        with pytest.raises(ValueError) as info:
            call(d)
        message = str(info.value)
        assert repr(kind) in message and "config.json" in message
        assert all(name in message for name in ("llama", "mistral", "qwen2", "qwen3"))


# ---- config.json and tensors are checked ---------------------------------------------------

BAD_CONFIG = [
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, ValueError, ["rope_scaling", "yarn", "llama3"]),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, ValueError, ["rope_scaling", "dynamic"]),
    ({"rope_scaling": {"rope_type": "llama3"}}, MissingFieldError, ["rope_scaling.factor"]),
    ({"rope_scaling": {**LLAMA3_ROPE_SCALING, "factor": float("nan")}}, ValueError, ["rope_scaling.factor"]),
    ({"rope_scaling": {**LLAMA3_ROPE_SCALING, "factor": -2}}, ValueError, ["rope_scaling.factor"]),
    ({"rope_scaling": {**LLAMA3_ROPE_SCALING, "high_freq_factor": 1.0}}, ValueError, ["high_freq_factor"]),
    ({"rope_scaling": {**LLAMA3_ROPE_SCALING, "original_max_position_embeddings": 0}}, ValueError,
     ["original_max_position_embeddings"]),
    ({"rope_scaling": "llama3"}, ValueError, ["rope_scaling"]),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}, "rope_scaling": DROP}, ValueError,
     ["rope_parameters", "yarn"]),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, ValueError, ["rope_parameters", "disagree"]),
    ({"rope_theta": 0}, ValueError, ["rope_theta"]),
    ({"rope_theta": "5e5"}, ValueError, ["rope_theta"]),
    ({"attention_bias": "true"}, ValueError, ["attention_bias"]),
    ({"mlp_bias": 1}, ValueError, ["mlp_bias"]),
    ({"tie_word_embeddings": "no"}, ValueError, ["tie_word_embeddings"]),
    ({"rope_traditional": 0}, ValueError, ["rope_traditional"]),
    ({"hidden_act": "gelu"}, ValueError, ["hidden_act", "gelu"]),
    ({"layer_types": ["full_attention", "sliding_attention"]}, ValueError, ["layer_types"]),
    ({"num_key_value_heads": 3}, ValueError, ["num_key_value_heads"]),
    ({"num_hidden_layers": 10**9}, ValueError, ["num_hidden_layers"]),
    ({"vocab_size": 10**12}, ValueError, ["vocab_size"]),
    ({"head_dim": 15}, ValueError, ["head_dim"]),
    ({"hidden_size": DROP}, MissingFieldError, ["hidden_size"]),
    ({"quantization": {"group_size": 64, "bits": 7}}, ValueError, ["bits"]),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, ValueError, ["model_type", "gpt2"]),
    ({"model_type": "mistral", "sliding_window": 4096}, ValueError, ["sliding_window"]),
]


@pytest.mark.parametrize("fields,exc,names", BAD_CONFIG, ids=[re.sub(r" at 0x[0-9a-f]+", "", repr(f))[:40] for f, _, _ in BAD_CONFIG])
def test_bad_config_is_named(ckpts, tmp_path, fields, exc, names):
    d = copy_with_config(ckpts["q4"], tmp_path / "ckpt", **fields)
    for call in (load, read_config):
        with pytest.raises(exc) as info:
            call(d)
        assert "config.json" in str(info.value) and all(n in str(info.value) for n in names), str(info.value)


def test_tensors_are_checked_against_the_config(ckpts, tmp_path):
    d = copy_with_config(ckpts["f32_bias"], tmp_path / "a", num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"self_attn\.k_proj\.weight.*num_key_value_heads"):
        load(d)
    d = copy_with_config(ckpts["f32_bias"], tmp_path / "b", attention_bias=False)  # biases stored, not declared
    with pytest.raises(ValueError, match=r"self_attn\.q_proj\.bias.*attention_bias"):
        load(d)
    d = copy_with_config(ckpts["f32"], tmp_path / "c", mlp_bias=True)  # declared, not stored
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp\.gate_proj\.bias"):
        load(d)
    d = copy_with_config(ckpts["q4"], tmp_path / "d", num_hidden_layers=3)
    with pytest.raises(KeyError, match=r"model\.layers\.2\."):
        load(d)


def test_tied_head_follows_the_tensors_when_the_config_is_silent(ckpts, tmp_path):
    untied = load(copy_with_config(ckpts["f32"], tmp_path / "a", tie_word_embeddings=DROP))
    assert untied.config.tie_word_embeddings is False and untied.lm_head is not untied.embed_tokens
    tied = load(copy_with_config(ckpts["q4"], tmp_path / "b", tie_word_embeddings=DROP))
    assert tied.config.tie_word_embeddings is True and tied.lm_head is tied.embed_tokens


def test_defaults_follow_transformers(ckpts, tmp_path):
    d = copy_with_config(ckpts["f32"], tmp_path / "a", rope_theta=DROP, rms_norm_eps=DROP, max_position_embeddings=DROP,
              rope_scaling=DROP, attention_bias=DROP, mlp_bias=DROP, hidden_act=DROP)
    c = load(d).config
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (10_000.0, 1e-6, 2048)
    assert c.rope_scaling is None and not c.attention_bias and not c.mlp_bias
    v5 = copy_with_config(ckpts["f32"], tmp_path / "b", rope_theta=DROP, rope_scaling=DROP,
               rope_parameters={"rope_theta": 500000.0, **SHARP_LLAMA3})  # transformers 5's layout
    c = load(v5).config
    assert c.rope_theta == 500000.0 and c.rope_scaling.rope_type == "llama3"
    assert c.rope_scaling.original_max_position_embeddings == 64
