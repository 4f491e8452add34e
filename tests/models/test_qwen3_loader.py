"""config.json / checkpoint loading and the seeded checkpoint writer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_serving.models.generation import generate
from paged import fresh
from mlx_serving.models.loader import load
from mlx_serving.tokenization import data_path
from mlx_serving.models.seeded_checkpoint import write_checkpoint
from mlx_serving.models.families import read_config
from mlx_serving.models.families.qwen3 import config_from_dict
from mlx_serving.models.decoder.layers import forward

PROMPT = [7985, 825, 11652, 911, 468, 97772, 13]
REF_CONFIG = json.loads(data_path("config.qwen3-0.6b-mlx-4bit.json").read_text())


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _prefill_logits(state, prompt=PROMPT) -> np.ndarray:
    kv = fresh(state, 64)
    t = len(prompt)
    rows = kv.rows(mx.array([prompt]), mx.array([0]), mx.array([t]), t, mx.array([t - 1]), dense=True)
    return np.array(forward(state, kv.cache, rows).astype(mx.float32))


def _ref_logits(path: Path, prompt=PROMPT, dtype=mx.float32) -> np.ndarray:
    """mlx-lm's last-position logits, its floating parameters cast to ``dtype``."""
    from mlx_lm.utils import load_model

    model, _ = load_model(path)
    model.set_dtype(dtype)
    return np.array(model(mx.array([prompt]))[:, -1].astype(mx.float32))


# ---- config ------------------------------------------------------------------------------

def test_reference_config_fields():
    cfg = config_from_dict(REF_CONFIG, {"eos_token_id": [151645, 151643]})
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == (1024, 28, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (16, 8)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 1_000_000
    assert cfg.eos_token_ids == (151645, 151643)  # generation_config wins
    assert cfg.quantization.default.group_size == 64 and cfg.quantization.default.bits == 4


def test_rope_theta_defaults_to_qwen3_value_and_eos_falls_back_to_config():
    raw = {k: v for k, v in REF_CONFIG.items() if k != "rope_theta"}
    cfg = config_from_dict(raw)
    assert cfg.rope_theta == 1_000_000.0
    assert cfg.eos_token_ids == (151645,)


def test_quantization_overrides():
    raw = dict(REF_CONFIG, quantization={"group_size": 64, "bits": 4, "lm_head": {"bits": 8},
                                         "model.layers.0.mlp.down_proj": False})
    q = config_from_dict(raw).quantization
    assert q.spec_for("lm_head").bits == 8 and q.spec_for("lm_head").group_size == 64
    assert q.spec_for("model.layers.0.mlp.down_proj") is None
    assert q.spec_for("model.layers.1.mlp.down_proj").bits == 4


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4"])
def test_unsupported_quantization_mode(mode):
    raw = dict(REF_CONFIG, quantization={"group_size": 32, "bits": 4, "mode": mode})
    with pytest.raises(ValueError, match=mode):
        config_from_dict(raw)


def test_unsupported_architecture():
    raw = dict(REF_CONFIG, model_type="llama", architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        config_from_dict(raw)


def test_missing_field_is_named():
    raw = {k: v for k, v in REF_CONFIG.items() if k != "vocab_size"}
    with pytest.raises(KeyError, match="vocab_size"):
        config_from_dict(raw)


# ---- loading -----------------------------------------------------------------------------

def test_missing_files_are_named(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path / "c")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load(d)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_config(d)
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "nowhere")


def test_missing_tensor_is_named(tiny_ckpt, tmp_path):
    d = _copy(tiny_ckpt, tmp_path / "c")
    tensors = mx.load(str(d / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    mx.save_safetensors(str(d / "model.safetensors"), tensors)
    with pytest.raises(KeyError, match="model.layers.1.self_attn.k_norm.weight"):
        load(d)


def test_quantized_layout_loads(tiny, tiny_bf16):
    c = tiny.config
    assert tiny_bf16.dtype == mx.bfloat16 and tiny_bf16.layers[0].qkv.merged.scales.dtype == mx.bfloat16
    assert tiny.dtype == mx.float32  # the CPU default compute dtype
    assert c.tie_word_embeddings
    assert tiny.lm_head is tiny.embed_tokens
    qkv = tiny.layers[0].qkv  # q/k/v rows concatenated into one packed matrix
    out = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    assert qkv.merged.weight.dtype == mx.uint32 and qkv.merged.weight.shape == (out, c.hidden_size // 8)
    assert qkv.merged.scales.shape == (out, c.hidden_size // 64)
    assert qkv.splits == [c.num_attention_heads * c.head_dim, (c.num_attention_heads + c.num_key_value_heads) * c.head_dim]
    assert c.eos_token_ids == (151645, 151643)


def test_sharded_and_stray_lm_head(tiny_ckpt, tmp_path):
    sharded = write_checkpoint(tmp_path / "sharded", "tiny", seed=0, shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) == 3
    ref = _prefill_logits(load(tiny_ckpt))
    np.testing.assert_array_equal(_prefill_logits(load(sharded)), ref)
    # a stray lm_head next to tied embeddings is ignored
    d = _copy(tiny_ckpt, tmp_path / "stray")
    tensors = mx.load(str(d / "model.safetensors"))
    tensors["lm_head.weight"] = mx.zeros((16, 16))
    mx.save_safetensors(str(d / "model.safetensors"), tensors)
    np.testing.assert_array_equal(_prefill_logits(load(d)), ref)


def test_untied_head(tmp_path):
    d = write_checkpoint(tmp_path / "untied", "tiny", seed=1, tie_word_embeddings=False)
    state = load(d)
    assert state.lm_head is not state.embed_tokens and state.lm_head.scales is not None
    np.testing.assert_allclose(_prefill_logits(state), _ref_logits(d), atol=1e-3)


def test_dense_module_and_per_module_override_match_mlx_lm(tiny_ckpt, tmp_path):
    """layer 0 down_proj and up_proj stored dense (no .scales, override false; gate_proj
    stays 4-bit, so gate/up cannot be fused) and the embedding re-packed at 8 bits through
    a per-module override: both loaders agree."""
    d = _copy(tiny_ckpt, tmp_path / "mixed")
    t = mx.load(str(d / "model.safetensors"))
    dense_names = ["model.layers.0.mlp.down_proj", "model.layers.0.mlp.up_proj"]
    for name in dense_names:
        t[f"{name}.weight"] = mx.dequantize(t.pop(f"{name}.weight"), t.pop(f"{name}.scales"),
                                            t.pop(f"{name}.biases"), group_size=64, bits=4)
    e = "model.embed_tokens"
    dense = mx.dequantize(t[f"{e}.weight"], t[f"{e}.scales"], t[f"{e}.biases"], group_size=64, bits=4)
    t[f"{e}.weight"], t[f"{e}.scales"], t[f"{e}.biases"] = mx.quantize(dense, group_size=64, bits=8)
    mx.save_safetensors(str(d / "model.safetensors"), t, metadata={"format": "mlx"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization"].update({e: {"group_size": 64, "bits": 8}} | {n: False for n in dense_names})
    (d / "config.json").write_text(json.dumps(cfg))
    state = load(d)
    assert state.layers[0].down_proj.scales is None and state.embed_tokens.spec.bits == 8
    assert state.layers[0].gate_up.merged is None and state.layers[1].gate_up.merged is not None
    np.testing.assert_allclose(_prefill_logits(state), _ref_logits(d), atol=1e-3)


# ---- the checkpoint writer -----------------------------------------------------------------

def test_writer_layout(tiny_ckpt):
    files = {p.name for p in tiny_ckpt.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= files
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert cfg["quantization"] == {"group_size": 64, "bits": 4} and cfg["vocab_size"] == 151936
    t = mx.load(str(tiny_ckpt / "model.safetensors"))
    assert not any(k.startswith("lm_head") for k in t)
    assert t["model.embed_tokens.weight"].dtype == mx.uint32
    assert t["model.embed_tokens.scales"].dtype == mx.bfloat16
    assert t["model.embed_tokens.biases"].shape == (151936, 1)
    assert t["model.norm.weight"].dtype == mx.bfloat16
    assert "model.layers.1.self_attn.q_norm.weight" in t


def test_writer_is_seeded(tiny_ckpt, tmp_path):
    again = write_checkpoint(tmp_path / "again", "tiny", seed=0)
    other = write_checkpoint(tmp_path / "other", "tiny", seed=1)
    data = (tiny_ckpt / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == data
    assert (other / "model.safetensors").read_bytes() != data


def test_cli_and_mlx_lm_full_load(tmp_path):
    """The CLI writes a float32 dense checkpoint that mlx-lm's load() (model and
    tokenizer) reads."""
    from mlx_lm import load as mlx_lm_load

    out = tmp_path / "cli"
    subprocess.run([sys.executable, "-m", "mlx_serving.models.seeded_checkpoint", str(out), "--preset", "tiny",
                    "--seed", "3", "--unquantized", "--dtype", "float32"], check=True, timeout=60)
    assert "quantization" not in json.loads((out / "config.json").read_text())
    model, tokenizer = mlx_lm_load(str(out))
    assert tokenizer.encode("Write one sentence about Elixir.") == PROMPT
    ours = _prefill_logits(load(out))
    theirs = np.array(model(mx.array([PROMPT]))[:, -1])
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_dequantize_keeps_the_model(tiny_ckpt):
    """load(dequantize=True) stores dense projections with the same weights: first-step
    logits within float32 rounding of the 4-bit path, the same greedy ids."""
    q4, dense = load(tiny_ckpt), load(tiny_ckpt, dequantize=True)
    assert dense.layers[0].qkv.merged.scales is None and dense.lm_head.scales is None
    assert dense.embed_tokens.scales is not None  # the table stays quantized (only looked up)
    prompt = [int(x) for x in np.random.default_rng(7).integers(0, 151000, 12)]
    ids = {}
    for name, state in (("q4", q4), ("dense", dense)):
        kv = fresh(state, 64)
        rows = kv.rows(mx.array([prompt], dtype=mx.int32), mx.zeros((1,), dtype=mx.int32),
                       mx.array([len(prompt)], dtype=mx.int32), len(prompt),
                       mx.array([len(prompt) - 1], dtype=mx.int32), dense=True)
        ids[name] = forward(state, kv.cache, rows)
        # the exact path on both (the dense one has no native step)
        ids[name + "_gen"], _ = generate(prompt, state, max_new_tokens=12, max_len=64, decode_path="matmul")
    assert mx.allclose(ids["q4"], ids["dense"], atol=1e-3, rtol=1e-3).item()
    assert ids["q4_gen"] == ids["dense_gen"]
