"""Small GGUF files for the tests, written with llama.cpp's own ``gguf`` package (GGUFWriter and
``gguf.quants``), laid out as llama.cpp's converter lays them out (``convert_hf_to_gguf.py``):
Llama Q/K rows permuted, norms in F32, the weights in one ggml type. Each comes with the dense
Hugging Face weights it stands for (the quantized values dequantized), the reference the
conversion is checked against."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

#: A byte-level BPE vocabulary: the 256 byte symbols of GPT-2's byte-to-unicode table, a few merges
#: and ChatML's special tokens.
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _byte_symbols() -> list[str]:
    """GPT-2's ``bytes_to_unicode`` (openai/gpt-2 encoder.py), in byte order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[int]]:
    """``(tokens, token types)``: specials (type 3, control) then bytes then merged symbols (1)."""
    merged = [m.replace(" ", "") for m in _MERGES]
    tokens = _SPECIALS + _byte_symbols() + merged
    return tokens, [3] * len(_SPECIALS) + [1] * (len(tokens) - len(_SPECIALS))


@dataclass(frozen=True)
class Shape:
    """A tiny Llama-family shape (``arch``: llama, qwen2 or qwen3)."""

    arch: str = "llama"
    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    tied: bool = True

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order (``convert_hf_to_gguf.py`` ``LlamaModel.permute``)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(shape: Shape, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded float32 weights under Hugging Face names (std 1 / sqrt(fan_in); norms around 1)."""
    rng = np.random.default_rng(seed)
    h, d, inter = shape.hidden, shape.head_dim, shape.intermediate
    mats = {"self_attn.q_proj": (shape.heads * d, h), "self_attn.k_proj": (shape.kv_heads * d, h),
            "self_attn.v_proj": (shape.kv_heads * d, h), "self_attn.o_proj": (h, shape.heads * d),
            "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter)}
    norm = lambda n: (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, h)).astype(np.float32) * 0.5,
         "model.norm.weight": norm(h)}
    for i in range(shape.layers):
        p = f"model.layers.{i}"
        for name, (rows, cols) in mats.items():
            w[f"{p}.{name}.weight"] = (rng.standard_normal((rows, cols)) * 2 / np.sqrt(cols)).astype(np.float32)
        w[f"{p}.input_layernorm.weight"] = norm(h)
        w[f"{p}.post_attention_layernorm.weight"] = norm(h)
        if shape.arch == "qwen2":
            for n in "qkv":
                rows = mats[f"self_attn.{n}_proj"][0]
                w[f"{p}.self_attn.{n}_proj.bias"] = (0.1 * rng.standard_normal(rows)).astype(np.float32)
        if shape.arch == "qwen3":
            w[f"{p}.self_attn.q_norm.weight"] = norm(d)
            w[f"{p}.self_attn.k_norm.weight"] = norm(d)
    if not shape.tied:
        w["lm_head.weight"] = rng.standard_normal((vocab, h)).astype(np.float32) * 0.5
    return w


_TO_GGUF = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    """``model.layers.1.self_attn.q_proj.weight`` -> ``blk.1.attn_q.weight`` (llama.cpp's names)."""
    module, _, suffix = hf.rpartition(".")
    if module in _TO_GGUF:
        return f"{_TO_GGUF[module]}.{suffix}"
    _, _, i, rest = module.split(".", 3)
    return f"blk.{i}.{_LAYER[rest]}.{suffix}"


def write_gguf(path: Path, shape: Shape, kind: T = T.Q4_0, *, seed: int = 0, embed_kind: T | None = None,
               extra_metadata: dict[str, object] | None = None,
               tokenizer: dict[str, object] | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Write a GGUF of ``shape`` with every matrix in ``kind`` (the embedding in ``embed_kind``
    when given; 1-D tensors F32) and return the dense Hugging Face weights it holds (quantized
    values dequantized with ``gguf.quants``). ``tokenizer``: ``tokenizer.*`` metadata (plain
    values, e.g. copied from llama.cpp's ``ggml-vocab-llama-spm.gguf``) written instead of the
    GPT-2 vocabulary; the embedding then has one row per its ``tokenizer.ggml.tokens``.
    ``extra_tensors``: more F32 tensors by GGUF name (e.g. llama.cpp's ``rope_freqs.weight``)."""
    tokens, types = vocabulary()
    rows = len(tokens) if tokenizer is None else len(tokenizer["tokenizer.ggml.tokens"])  # type: ignore[arg-type]
    weights = hf_weights(shape, rows, seed)
    writer = gguf.GGUFWriter(str(path), shape.arch)
    _metadata(writer, shape, tokens, types, extra_metadata or {}, tokenizer)
    reference: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        stored, data, raw = w, w, T.F32
        this = embed_kind if embed_kind is not None and name.startswith("model.embed_tokens") else kind
        if w.ndim == 2 and this != T.F32:
            data = gguf.quants.quantize(w, this)
            stored, raw = gguf.quants.dequantize(data, this).reshape(w.shape).astype(np.float32), this
        reference[name] = stored
        if shape.arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            n = shape.heads if ".q_proj." in name else shape.kv_heads
            data = permute(data, n)
        writer.add_tensor(gguf_name(name), data, raw_dtype=raw)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data.astype(np.float32), raw_dtype=T.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return reference


def _metadata(writer: gguf.GGUFWriter, shape: Shape, tokens: list[str], types: list[int],
              extra: dict[str, object], tokenizer: dict[str, object] | None = None) -> None:
    writer.add_block_count(shape.layers)
    writer.add_context_length(512)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    if f"{shape.arch}.rope.freq_base" not in extra:
        writer.add_rope_freq_base(10_000.0)
    if shape.arch == "qwen3":
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if tokenizer is None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("gpt-2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(_MERGES)
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(2)
        writer.add_chat_template(CHATML)
    else:
        _add_plain(writer, tokenizer)
    for key, value in extra.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))


def _add_plain(writer: gguf.GGUFWriter, metadata: dict[str, object]) -> None:
    """Write plain metadata values: str, bool, int (uint32), float (float32), lists (typed by
    their items, as ``GGUFWriter.add_array`` does)."""
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_array(key, list(value))  # type: ignore[call-overload]
