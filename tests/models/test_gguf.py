"""GGUF files -> MLX checkpoints (models/gguf.py): every supported tensor type converts to the
weights it stands for, llama.cpp's Q/K permutation is undone, the result loads in our families
and in mlx-lm with the same greedy ids, and what is not supported is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from mlx_serving.models import gguf as G
from mlx_serving.models.loader import load
from mlx_serving.models.generation.generate import generate
from mlx_serving.models.gguf_file import GGUFError, read_header

from gguf_files import Shape, permute, write_gguf

KINDS = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q8_0]
PROMPT = [5, 40, 77, 100, 3, 9, 250, 17]


def _dense(tensors: dict[str, mx.array], module: str, config: dict) -> np.ndarray:
    """``module``'s weight as float32, dequantized with MLX when the conversion quantized it."""
    w = tensors[f"{module}.weight"]
    if f"{module}.scales" not in tensors:
        return np.array(w.astype(mx.float32))
    spec = config["quantization"].get(module, config["quantization"])
    return np.array(mx.dequantize(w, tensors[f"{module}.scales"].astype(mx.float32),
                                  tensors[f"{module}.biases"].astype(mx.float32),
                                  group_size=spec["group_size"], bits=spec["bits"]))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_every_tensor_converts_to_the_weight_it_stands_for(tmp_path: Path, kind: T) -> None:
    reference = write_gguf(tmp_path / "m.gguf", Shape(), kind)
    out = G.convert(tmp_path / "m.gguf", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    tensors = mx.load(str(out / "model.safetensors"))
    for name, want in reference.items():
        module = name.removesuffix(".weight")
        got = _dense(tensors, module, config) if want.ndim == 2 else np.array(tensors[name].astype(mx.float32))
        # Q/K rows included: the permutation is undone. F32 is exact; the block types agree with
        # gguf.quants up to float16 rounding of the dequantized value (MLX computes d*q + m).
        tol = 0 if kind == T.F32 else 2e-3 * max(1.0, float(np.abs(want).max()))
        np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=name)
    quantized = kind in (T.Q4_0, T.Q4_1, T.Q8_0)
    assert ("quantization" in config) == quantized
    if quantized:
        assert config["quantization"] == {"group_size": 32, "bits": 8 if kind == T.Q8_0 else 4}


def test_unpermute_inverts_llama_cpp_s_permutation() -> None:
    rows = np.arange(2 * 3 * 8 * 5).reshape(2 * 3 * 8, 5)  # 3 heads of 16 rows, 5 columns
    for heads in (1, 3, 6):
        assert (np.array(G.unpermute(mx.array(permute(rows, heads)), heads)) == rows).all()
    with pytest.raises(GGUFError, match="heads"):
        G.unpermute(mx.array(rows), 5)


@pytest.mark.parametrize("shape", [Shape(), Shape(tied=False), Shape(arch="qwen2"), Shape(arch="qwen3")],
                         ids=["llama", "llama-untied", "qwen2", "qwen3"])
def test_converted_checkpoint_loads_and_matches_mlx_lm(tmp_path: Path, shape: Shape) -> None:
    """Our family and mlx-lm read the converted directory and give the same greedy ids (float32)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    write_gguf(tmp_path / "m.gguf", shape, T.Q4_1, seed=3)
    out = G.convert(tmp_path / "m.gguf", tmp_path / "out")
    state = load(out)
    # mlx-lm's ids: the exact path (the native step's int8 activations differ)
    ours, _ = generate(PROMPT, state, max_new_tokens=12, eos_token_ids=[], decode_path="matmul")
    model = load_model(out)[0]
    model.set_dtype(mx.float32)
    theirs = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=12)]
    assert ours == theirs and len(set(ours)) > 2


def test_mixed_types_get_per_module_quantization(tmp_path: Path) -> None:
    """A Q4_1 file with a Q8_0 embedding (as SmolLM2's): 4 bits by default, the embedding 8, and
    its rows (the tied head too) read back as the weights they stand for."""
    reference = write_gguf(tmp_path / "m.gguf", Shape(), T.Q4_1, embed_kind=T.Q8_0)
    out = G.convert(tmp_path / "m.gguf", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 4,
                                      "model.embed_tokens": {"group_size": 32, "bits": 8}}
    tensors = mx.load(str(out / "model.safetensors"))
    np.testing.assert_allclose(_dense(tensors, "model.embed_tokens", config),
                               reference["model.embed_tokens.weight"], atol=2e-3)
    state = load(out)
    assert state.embed_tokens.spec.bits == 8 and state.layers[0].o_proj.spec.bits == 4


def test_an_unsupported_tensor_type_is_refused_by_name(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((4, 210), dtype=np.uint8), raw_dtype=T.Q6_K)  # 4 x 256 values
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"token_embd\.weight.*Q6_K.*not supported.*Q4_0"):
        G.convert(tmp_path / "k.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unsupported_architecture_and_missing_metadata_are_named(tmp_path: Path) -> None:
    write_gguf(tmp_path / "m.gguf", Shape(), T.F16)
    header = read_header(tmp_path / "m.gguf")
    with pytest.raises(GGUFError, match="general.architecture 'gemma3' is not supported"):
        G.hf_config(G.GGUFHeader(header.path, 3, {**header.metadata, "general.architecture": "gemma3"},
                                 header.tensors))
    missing = {k: v for k, v in header.metadata.items() if k != "llama.block_count"}
    with pytest.raises(GGUFError, match="missing metadata 'llama.block_count'"):
        G.hf_config(G.GGUFHeader(header.path, 3, missing, header.tensors))
    wrong = {**header.metadata, "llama.embedding_length": "64"}
    with pytest.raises(GGUFError, match="llama.embedding_length"):
        G.hf_config(G.GGUFHeader(header.path, 3, wrong, header.tensors))


def test_rope_scaling_linear_and_yarn(tmp_path: Path) -> None:
    write_gguf(tmp_path / "lin.gguf", Shape(), T.F16,
               extra_metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    assert G.hf_config(read_header(tmp_path / "lin.gguf"))["rope_scaling"] == {"type": "linear", "factor": 4.0}
    write_gguf(tmp_path / "yarn.gguf", Shape(), T.F16, extra_metadata={"llama.rope.scaling.type": "yarn"})
    with pytest.raises(GGUFError, match="'yarn' is not supported"):
        G.hf_config(read_header(tmp_path / "yarn.gguf"))


def test_llama3_rope_factors_become_the_llama3_block(tmp_path: Path) -> None:
    """llama.cpp stores Llama 3.1+'s RoPE scaling as per-frequency factors (rope_freqs.weight):
    factors that follow the rule exactly become rope_scaling "llama3" (and the converted model
    computes what mlx-lm computes from that block); others are refused."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    shape = Shape()
    block = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}
    # head_dim 16 with a large base: some frequencies scaled, some kept, some smoothed
    meta = {"llama.rope.freq_base": 5e5}
    factors = G._llama3_factors(block, shape.head_dim, 5e5)
    assert len(set(np.round(factors, 4))) > 2
    write_gguf(tmp_path / "l3.gguf", shape, T.Q4_0, extra_metadata=meta, extra_tensors={"rope_freqs.weight": factors})
    config = G.hf_config(read_header(tmp_path / "l3.gguf"))
    assert config["rope_scaling"] == block and config["rope_theta"] == 5e5
    out = G.convert(tmp_path / "l3.gguf", tmp_path / "out")
    # mlx-lm's ids: the exact path (the native step's int8 activations differ)
    ours, _ = generate(PROMPT, load(out), max_new_tokens=8, eos_token_ids=[], decode_path="matmul")
    model = load_model(out)[0]
    model.set_dtype(mx.float32)
    assert ours == [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=8)]
    write_gguf(tmp_path / "odd.gguf", shape, T.Q4_0, extra_metadata=meta,
               extra_tensors={"rope_freqs.weight": factors * 1.5})
    with pytest.raises(GGUFError, match="rope_freqs.weight matches no RoPE scaling rule"):
        G.hf_config(read_header(tmp_path / "odd.gguf"))
