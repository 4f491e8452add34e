"""Convert a GGUF file (llama.cpp's format) into an MLX checkpoint directory the loaders read.

The result is the mlx-community layout: ``config.json`` (Hugging Face field names, with a
``quantization`` block), ``model.safetensors`` (Hugging Face tensor names), ``tokenizer.json``
+ ``tokenizer_config.json`` built from the GGUF's tokenizer metadata
(:func:`tokenization.tokenizer_files`) and ``generation_config.json`` (BOS / EOS ids). Both
the family loaders and mlx-lm's ``load()`` read it; the loaders then check it like any
untrusted checkpoint.

Tensor types (ggml's): Q4_0, Q4_1 and Q8_0 become MLX affine-quantized weights without loss
(group size 32; 4 or 8 bits; a block's scale ``d`` and offset: ``-8 d`` for Q4_0, ``m`` for Q4_1,
``-128 d`` for Q8_0, all exact in float16), decoded by MLX's own GGUF reader (``mx.load``);
F32, F16 and BF16 stay dense. Any other type (the K-quants, the IQ types, ...) is refused with
an error naming it. Architectures: ``general.architecture`` ``llama`` (Llama 2 / 3.x, Mistral,
SmolLM), ``qwen2`` and ``qwen3``. llama.cpp's converter (``convert_hf_to_gguf.py``,
``LlamaModel.permute``) reorders the rows of each Llama Q and K projection for its RoPE
layout; :func:`unpermute` restores the Hugging Face order (proven by parity with mlx-lm and by
the golden continuations in tests/models/test_real_model.py).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import mlx.core as mx
import numpy as np

from ..tokenization import tokenizer_files
from .gguf_file import GGMLType, GGUFError, GGUFHeader, MetaValue, TensorEntry, read_header

__all__ = ["ARCHITECTURES", "SUPPORTED_TYPES", "GGUFError", "convert", "hf_config", "unpermute"]

#: Quantized ggml types and the MLX affine bits they become (group size 32, ggml's block).
QUANT_BITS: dict[GGMLType, int] = {GGMLType.Q4_0: 4, GGMLType.Q4_1: 4, GGMLType.Q8_0: 8}
SUPPORTED_TYPES: tuple[GGMLType, ...] = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, *QUANT_BITS)
GROUP_SIZE = 32


@dataclass(frozen=True)
class Architecture:
    """How one ``general.architecture`` maps to a Hugging Face config: its ``model_type`` and
    ``architectures`` entry, whether llama.cpp permuted its Q/K rows, its default RoPE base."""

    model_type: str
    hf_architecture: str
    permuted_qk: bool
    rope_theta: float


#: ``general.architecture`` -> its Hugging Face counterpart (defaults: transformers' configs).
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("llama", "LlamaForCausalLM", True, 10_000.0),
    "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", False, 1_000_000.0),
    "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", False, 1_000_000.0),
}

#: GGUF tensor names (llama.cpp ``gguf-py/gguf/constants.py`` ``TENSOR_NAMES``) -> Hugging Face.
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
#: llama.cpp's Llama 3 RoPE factors (``rope_freqs.weight``) are matched against this rule's
#: usual parameters (Llama 3.1 / 3.2 / 3.3: low 1, high 4, original context 8,192).
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

_T = TypeVar("_T")


def hf_module(name: str, path: Path) -> tuple[str, str]:
    """``(hf module, suffix)`` for GGUF tensor ``name``: ``blk.3.attn_q.bias`` ->
    ``("model.layers.3.self_attn.q_proj", "bias")``. GGUFError naming an unknown tensor."""
    stem, _, suffix = name.rpartition(".")
    parts = stem.split(".")
    if suffix in ("weight", "bias"):
        if len(parts) == 1 and parts[0] in _GLOBAL:
            return _GLOBAL[parts[0]], suffix
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER:
            return f"model.layers.{int(parts[1])}.{_LAYER[parts[2]]}", suffix
    raise GGUFError(f"{path}: tensor {name!r} has no Hugging Face counterpart this converter knows")


def _meta(header: GGUFHeader, key: str, kind: type[_T], default: _T | None = None) -> _T:
    value = header.metadata.get(key, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if value is None and default is None:
        raise GGUFError(f"{header.path}: missing metadata {key!r}")
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise GGUFError(f"{header.path}: metadata {key!r} must be {kind.__name__}, got {value!r:.80}")
    return value


def architecture(header: GGUFHeader) -> tuple[str, Architecture]:
    """``general.architecture`` and its :class:`Architecture`; GGUFError for another one."""
    arch = _meta(header, "general.architecture", str)
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{header.path}: general.architecture {arch!r} is not supported "
                        f"(supported: {', '.join(ARCHITECTURES)})")
    return arch, ARCHITECTURES[arch]


def hf_config(header: GGUFHeader) -> dict[str, object]:
    """The Hugging Face ``config.json`` fields of the GGUF's model (the loaders range-check
    them). Raises GGUFError naming a missing or mistyped metadata key, an unsupported
    architecture or RoPE scaling."""
    arch, spec = architecture(header)
    key = lambda k: f"{arch}.{k}"  # noqa: E731
    hidden = _meta(header, key("embedding_length"), int)
    heads = _meta(header, key("attention.head_count"), int)
    embed = header.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise GGUFError(f"{header.path}: missing 2-D tensor 'token_embd.weight'")
    tensors = header.tensors
    cfg: dict[str, object] = {
        "architectures": [spec.hf_architecture], "model_type": spec.model_type,
        "hidden_size": hidden, "intermediate_size": _meta(header, key("feed_forward_length"), int),
        "num_hidden_layers": _meta(header, key("block_count"), int), "num_attention_heads": heads,
        "num_key_value_heads": _meta(header, key("attention.head_count_kv"), int, heads),
        "head_dim": (head_dim := _meta(header, key("attention.key_length"), int, hidden // max(heads, 1))),
        "rms_norm_eps": _meta(header, key("attention.layer_norm_rms_epsilon"), float),
        "rope_theta": (rope_theta := _meta(header, key("rope.freq_base"), float, spec.rope_theta)),
        "max_position_embeddings": _meta(header, key("context_length"), int),
        "vocab_size": embed.shape[0], "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu", "torch_dtype": "float16",
    }
    if spec.model_type == "llama":
        cfg.update(attention_bias="blk.0.attn_q.bias" in tensors, mlp_bias=False)
        cfg["rope_scaling"] = _rope_scaling(header, arch, head_dim, rope_theta)
    if spec.model_type == "qwen2":
        cfg.update(use_sliding_window=False)
    cfg.update(_special_ids(header))
    return cfg


def _rope_scaling(header: GGUFHeader, arch: str, d: int, theta: float) -> dict[str, str | float] | None:
    """The ``rope_scaling`` block (for head dimension ``d`` and RoPE base ``theta``): "linear" from
    ``{arch}.rope.scaling.*``; "llama3" recovered from the ``rope_freqs.weight`` factors (checked to
    match the rule exactly); GGUFError for YaRN or factors that match no known rule."""
    kind = _meta(header, f"{arch}.rope.scaling.type", str, "none")
    if kind == "linear":
        return {"type": "linear", "factor": _meta(header, f"{arch}.rope.scaling.factor", float)}
    if kind != "none":
        raise GGUFError(f"{header.path}: {arch}.rope.scaling.type {kind!r} is not supported (none, linear)")
    entry = header.tensors.get("rope_freqs.weight")
    if entry is None:
        return None
    if entry.type not in (GGMLType.F32, GGMLType.F16):
        raise GGUFError(f"{header.path}: rope_freqs.weight has ggml type {entry.type_name}, expected F32 or F16")
    factors = _stored(header, entry).astype(np.float32)
    block: dict[str, str | float] = {"rope_type": "llama3", "factor": float(factors.max()), **_LLAMA3_ROPE}
    if factors.shape != (d // 2,) or not np.allclose(factors, _llama3_factors(block, d, theta), rtol=1e-4):
        raise GGUFError(f"{header.path}: rope_freqs.weight matches no RoPE scaling rule this converter "
                        "knows (Llama 3's with low 1, high 4, original 8192)")
    return block


def _llama3_factors(block: Mapping[str, str | float], dims: int, theta: float) -> np.ndarray:
    """llama.cpp's ``rope_freqs`` for Llama 3 scaling (``LlamaModel.generate_extra_tensors``)."""
    factor, low, high = float(block["factor"]), float(block["low_freq_factor"]), float(block["high_freq_factor"])
    original = float(block["original_max_position_embeddings"])
    wavelen = 2 * math.pi * theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    smooth = (original / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, mid))


def _special_ids(header: GGUFHeader) -> dict[str, object]:
    """``bos_token_id`` and ``eos_token_id`` (EOS, then end-of-turn and end-of-message ids)."""
    ids = {name: _meta(header, f"tokenizer.ggml.{name}_token_id", int, -1) for name in ("bos", "eos", "eot", "eom")}
    eos = list(dict.fromkeys(i for n in ("eos", "eot", "eom") if (i := ids[n]) >= 0))
    out: dict[str, object] = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    if ids["bos"] >= 0:
        out["bos_token_id"] = ids["bos"]
    return out


def unpermute(rows: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row order (``LlamaModel.permute``: per head, rows ``[0, 2, 4, ...,
    1, 3, ...]`` of the Hugging Face layout become interleaved pairs) along axis 0 of ``rows``
    (a weight, its quantization scales / biases, or a bias). GGUFError unless ``heads``
    divides the rows into pairs."""
    n = rows.shape[0]
    if heads < 1 or n % (2 * heads):
        raise GGUFError(f"cannot undo the Q/K row permutation: {n} rows, {heads} heads")
    rest = rows.shape[1:]
    return rows.reshape(heads, n // heads // 2, 2, *rest).swapaxes(1, 2).reshape(n, *rest)


def _check_types(header: GGUFHeader) -> None:
    names = ", ".join(t.name for t in SUPPORTED_TYPES)
    for entry in header.tensors.values():
        if entry.type not in SUPPORTED_TYPES:
            raise GGUFError(f"{header.path}: tensor {entry.name!r} has ggml type {entry.type_name}, which is "
                            f"not supported (supported: {names}); convert the model to one of those types "
                            "(e.g. llama.cpp's llama-quantize ... Q4_0)")


_STORED: dict[int, type[np.generic]] = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: np.uint16}


def _stored(header: GGUFHeader, entry: TensorEntry) -> np.ndarray:
    """A dense (F32, F16 or BF16: its raw 16-bit words) tensor's values, read from the file alone:
    the header reader checked that they lie inside it."""
    raw = np.memmap(header.path, dtype=_STORED[entry.type], mode="r", offset=entry.offset, shape=entry.shape)
    return np.array(raw)


def _bf16(header: GGUFHeader, entry: TensorEntry) -> mx.array:
    """A BF16 tensor read as stored (MLX's GGUF reader rounds BF16 to float16)."""
    return mx.array(_stored(header, entry)).view(mx.bfloat16)


def _hf_tensors(header: GGUFHeader, cfg: dict[str, object]) -> tuple[dict[str, mx.array], dict[str, GGMLType]]:
    """Every tensor under its Hugging Face name (Q/K rows restored for Llama), and each quantized
    module's ggml type."""
    permuted = ARCHITECTURES[str(cfg["model_type"])].permuted_qk
    q_heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    assert isinstance(q_heads, int) and isinstance(kv_heads, int)  # hf_config read both with _meta(..., int)
    heads = {"self_attn.q_proj": q_heads, "self_attn.k_proj": kv_heads}
    try:
        arrays = mx.load(str(header.path))
    except (RuntimeError, ValueError) as exc:
        raise GGUFError(f"{header.path}: MLX could not read the tensors: {exc}") from exc
    if not isinstance(arrays, dict):  # a .gguf loads as {name: array} (no return_metadata)
        raise GGUFError(f"{header.path}: MLX did not read the tensors as a mapping of names to arrays")
    out: dict[str, mx.array] = {}
    quantized: dict[str, GGMLType] = {}
    for entry in header.tensors.values():
        if entry.name == "rope_freqs.weight":
            continue  # folded into config.json's rope_scaling
        module, suffix = hf_module(entry.name, header.path)
        stem = entry.name.removesuffix(".weight")
        parts = {suffix: _bf16(header, entry) if entry.type == GGMLType.BF16 else arrays[entry.name]}
        if entry.type in QUANT_BITS:
            parts.update(scales=arrays[f"{stem}.scales"], biases=arrays[f"{stem}.biases"])
            quantized[module] = GGMLType(entry.type)  # a known type: the member itself
        for part, array in parts.items():
            kind = module.rsplit(".", 1)[-1]
            if permuted and module.endswith(tuple(heads)):
                array = unpermute(array, heads[f"self_attn.{kind}"])
            out[f"{module}.{part}"] = array
    return out, quantized


def _quantization(quantized: dict[str, GGMLType]) -> dict[str, object] | None:
    """config.json's ``quantization`` block: the most common bits as the default, the other
    quantized modules as per-module overrides (mlx-lm reads the same layout)."""
    if not quantized:
        return None
    bits = {module: QUANT_BITS[t] for module, t in quantized.items()}
    default = Counter(bits.values()).most_common(1)[0][0]
    block: dict[str, object] = {"group_size": GROUP_SIZE, "bits": default}
    block.update({m: {"group_size": GROUP_SIZE, "bits": b} for m, b in sorted(bits.items()) if b != default})
    return block


def convert(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert the GGUF file ``gguf_path`` into an MLX checkpoint directory ``out_dir`` (created;
    files in it are overwritten) and return ``out_dir``.

    Raises FileNotFoundError when the file is missing; GGUFError (a ValueError) naming the file
    and the cause for a malformed header (:func:`models.gguf_file.read_header`), an unsupported
    architecture, tensor type or RoPE scaling, a tensor with no Hugging Face counterpart, missing
    metadata; ``tokenization.TokenizationError`` for tokenizer metadata it cannot build from.
    """
    header = read_header(gguf_path)
    _check_types(header)
    cfg = hf_config(header)
    files = tokenizer_files(header.metadata)  # before the weights: a bad vocabulary fails fast
    tensors, quantized = _hf_tensors(header, cfg)
    quant = _quantization(quantized)
    if quant is not None:
        cfg.update(quantization=quant, quantization_config=quant)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    generation = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if k in cfg}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    return out
