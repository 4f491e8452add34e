"""The Qwen2 / Qwen2.5 family (models/families/qwen2.py): greedy and logit parity with mlx-lm's
``mlx_lm.models.qwen2`` on seeded tiny checkpoints (float32 exact; 4-bit), a checkpoint written by
mlx-lm's own saver, continuous batching, and the config / tensor checks (q/k/v biases only,
sliding window refused, transformers' defaults)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from parity import DROP, assert_logits_match, copy_with_config, mlx_lm_greedy

from mlx_serving.models.families import model_type
from mlx_serving.models.generation import Engine, EngineConfig, SamplingParams, generate
from mlx_serving.models.loader import load
from mlx_serving.models.seeded_checkpoint import write_checkpoint

LONG = [int(x) for x in np.random.default_rng(11).integers(0, 151000, 40)]
VARIANTS: dict[str, dict[str, Any]] = {
    "f32": dict(quantized=False, dtype="float32", seed=1),
    "f32_untied": dict(quantized=False, dtype="float32", seed=2, tie_word_embeddings=False),
    "q4": dict(seed=3),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen2")
    return {name: write_checkpoint(root / name, family="qwen2", **kw) for name, kw in VARIANTS.items()}


def _mlx_lm_model(path: Path):
    from mlx_lm.utils import load_model

    model = load_model(path)[0]
    model.set_dtype(mx.float32)
    return model


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_ids_match_mlx_lm(ckpts, name):
    """Exact greedy ids over 24 new tokens, both sides computing in float32."""
    state = load(ckpts[name])
    c = state.config
    assert model_type(ckpts[name]) == c.model_type == "qwen2"
    assert c.attention_bias and not c.o_proj_bias and not c.mlp_bias and not c.qk_norm
    assert state.layers[0].qkv.linears()[0].bias is not None and state.layers[0].o_proj.bias is None
    # mlx-lm's ids: the exact path (the native step's int8 activations differ)
    ours, info = generate(LONG, state, max_new_tokens=24, eos_token_ids=[], decode_path="matmul")
    assert ours == mlx_lm_greedy(_mlx_lm_model(ckpts[name]), LONG, 24)
    assert info["finish_reason"] == "length" and len(set(ours)) > 4  # not degenerate


def test_prefill_and_decode_logits_match_mlx_lm(ckpts):
    assert_logits_match(load(ckpts["f32_untied"]), _mlx_lm_model(ckpts["f32_untied"]), LONG)


def test_checkpoint_saved_by_mlx_lm_loads_and_matches(tmp_path):
    """An mlx-lm Qwen2 (GQA 4:1, untied head) written by mlx-lm's ``save_model`` / ``save_config``."""
    from mlx_lm.models import qwen2
    from mlx_lm.utils import save_config, save_model

    cfg = dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=1, rms_norm_eps=1e-6, vocab_size=512,
               rope_theta=1_000_000.0, tie_word_embeddings=False)
    mx.random.seed(5)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    save_model(tmp_path, model)
    save_config(cfg, tmp_path / "config.json")
    state = load(tmp_path)
    assert state.config.num_key_value_heads == 1 and state.config.tie_word_embeddings is False
    for prompt in ([1, 5, 77, 300, 12], [9, 8, 7]):
        # mlx-lm's ids: the exact path (the native step's int8 activations differ)
        ours = generate(prompt, state, max_new_tokens=24, eos_token_ids=[], decode_path="matmul")[0]
        assert ours == mlx_lm_greedy(model, prompt, 24)


def test_batched_equals_solo_through_the_engine(ckpts):
    state = load(ckpts["f32"])
    prompts = [LONG[:3], LONG[5:22], LONG[:1], LONG[10:40]]
    solo = [generate(p, state, max_new_tokens=8, eos_token_ids=[])[0] for p in prompts]
    engine = Engine(state, EngineConfig.of(max_batch=2, max_len=64, prefill_chunk=8, compile_decode=True))
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add(i, p, SamplingParams(max_new_tokens=8, eos_token_ids=()))
    while engine.num_active:
        for ev in engine.step():
            out[ev.seq_id].append(ev.token_id)
    assert [out[i] for i in range(len(prompts))] == solo


# ---- config.json and tensors are checked ---------------------------------------------------

@pytest.mark.parametrize("fields,names", [
    ({"use_sliding_window": True}, ["use_sliding_window", "sliding-window"]),
    ({"use_sliding_window": "no"}, ["use_sliding_window"]),
    ({"layer_types": ["full_attention", "sliding_attention"]}, ["layer_types"]),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, ["rope_scaling", "yarn"]),
    ({"hidden_act": "gelu"}, ["hidden_act"]),
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, ["model_type", "gpt2"]),
], ids=lambda v: repr(v)[:30])
def test_bad_config_is_named(ckpts, tmp_path, fields, names):
    with pytest.raises(ValueError) as info:
        load(copy_with_config(ckpts["q4"], tmp_path / "ckpt", **fields))
    assert "config.json" in str(info.value) and all(n in str(info.value) for n in names), str(info.value)


def test_biases_are_checked(ckpts, tmp_path):
    from safetensors.numpy import load_file, save_file

    def rewrite(name: str, edit) -> Path:
        d = shutil.copytree(ckpts["f32"], tmp_path / name)
        tensors = load_file(d / "model.safetensors")
        edit(tensors)
        save_file(tensors, d / "model.safetensors", metadata={"format": "mlx"})
        return d

    missing = rewrite("missing", lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load(missing)
    extra = rewrite("extra", lambda t: t.update({"model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32)}))
    with pytest.raises(ValueError, match=r"o_proj\.bias.*qwen2.*o_proj_bias"):
        load(extra)


def test_defaults_follow_transformers(ckpts, tmp_path):
    """transformers' Qwen2Config: rope_theta 10,000, rms_norm_eps 1e-6, 32,768 positions; an absent
    tie_word_embeddings follows the tensors."""
    c = load(copy_with_config(ckpts["f32_untied"], tmp_path / "a", rope_theta=DROP, rms_norm_eps=DROP,
                   max_position_embeddings=DROP, tie_word_embeddings=DROP, use_sliding_window=DROP)).config
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (10_000.0, 1e-6, 32768)
    assert c.tie_word_embeddings is False
    assert load(copy_with_config(ckpts["f32"], tmp_path / "b", tie_word_embeddings=DROP)).config.tie_word_embeddings is True
