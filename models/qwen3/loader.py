"""Load an MLX Qwen3 checkpoint directory into a :class:`State`.

Layout (mlx-community / lmstudio-community MLX checkpoints): ``config.json``,
``model.safetensors`` or shards listed in ``model.safetensors.index.json``, optional
``generation_config.json``. A quantized module stores ``<name>.weight`` (uint32, ``bits``
values packed per word, shape ``(out, in * bits / 32)``) plus ``<name>.scales`` and
``<name>.biases`` (shape ``(out, in / group_size)``); a module without ``.scales`` is dense.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar
from pathlib import Path

import mlx.core as mx

from .._checkpoint import MAX_HEADER_BYTES, TensorChecks, TensorInfo, cast_floating, check_dtype, read_tensors
from .._weights import Fused, Linear, Reader
from .config import Qwen3Config, read_config

__all__ = ["Fused", "Layer", "Linear", "State", "load"]
# Linear, Fused (models/_weights.py), the safetensors header checks and MAX_HEADER_BYTES
# (models/_checkpoint.py) are shared by every family.


@dataclass
class Layer:
    """One decoder layer's weights; ``qkv`` fuses q/k/v_proj, ``gate_up`` gate/up_proj."""

    input_layernorm: mx.array
    post_attention_layernorm: mx.array
    qkv: Fused
    o_proj: Linear
    q_norm: mx.array
    k_norm: mx.array
    gate_up: Fused
    down_proj: Linear


@dataclass
class State:
    """A loaded model: config, weights, activation ``dtype`` and checkpoint ``path``.
    ``family``: the package of its forward pass (see ``models.registry``)."""

    family: ClassVar[str] = "qwen3"
    config: Qwen3Config
    embed_tokens: Linear
    layers: list[Layer]
    norm: mx.array
    lm_head: Linear
    dtype: mx.Dtype
    path: Path | None = None


def _check_tensors(path: Path, infos: dict[str, TensorInfo], config: Qwen3Config) -> None:
    """Check every tensor the model reads against the shape and dtype config.json implies,
    before anything is loaded. Raises KeyError naming a missing tensor, ValueError naming a
    tensor of the wrong shape or dtype (with the config fields its shape comes from).

    The embedding (and an untied head) must have exactly ``vocab_size`` rows: a token id is
    valid when it is below ``config.vocab_size`` (what the engine checks), and every such id
    then has a row.
    """
    t = TensorChecks(path, infos, config.quantization)
    shapes = t.decoder(config)
    d = config.head_dim
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            t.vector(f"{p}.{norm}.weight", d, f"head_dim = {d}")
        for module, (out, inn, why_out, why_in) in shapes.items():
            t.matrix(f"{p}.{module}", out, inn, why_out, why_in)


def _layer(r: Reader, i: int) -> Layer:
    p = f"model.layers.{i}"
    return Layer(
        input_layernorm=r.tensor(f"{p}.input_layernorm.weight"),
        post_attention_layernorm=r.tensor(f"{p}.post_attention_layernorm.weight"),
        qkv=Fused.of([r.linear(f"{p}.self_attn.{n}_proj") for n in "qkv"]),
        o_proj=r.linear(f"{p}.self_attn.o_proj"),
        q_norm=r.tensor(f"{p}.self_attn.q_norm.weight"),
        k_norm=r.tensor(f"{p}.self_attn.k_norm.weight"),
        gate_up=Fused.of([r.linear(f"{p}.mlp.gate_proj"), r.linear(f"{p}.mlp.up_proj")]),
        down_proj=r.linear(f"{p}.mlp.down_proj"),
    )


def load(path: str | Path, dtype: str | mx.Dtype | None = None, *, dequantize: bool = False) -> State:
    """Load the checkpoint directory ``path`` and evaluate its weights.

    Tied embeddings (``tie_word_embeddings``) reuse ``model.embed_tokens`` as the head
    (any stray ``lm_head.*`` is ignored). ``dtype`` is the activation (compute) dtype:
    floating tensors (dense weights, scales, biases, norms) are cast to it; packed
    weights stay as stored. None picks float32 on the CPU device and the checkpoint's
    own dtype (that of the embedding scales / weight) elsewhere. ``dequantize`` stores the
    projections and the head as dense matrices in that dtype (the same weights, ~3.3x
    their 4-bit bytes; the embedding table stays quantized, only looked up): on MLX's
    CUDA build a batched decode step then runs 2.3x faster at 128 rows
    (bench/gpu_step.py, docs/benchmarks.md).

    The checkpoint is untrusted: config.json is range-checked (:mod:`.config`), every
    file must resolve inside the directory, and every safetensors header is parsed and
    every tensor's shape and dtype checked against the config before any weight is read.

    Raises FileNotFoundError (missing config.json / weight file, named), KeyError
    (missing tensor or config field, named), ValueError (unsupported architecture or
    quantization mode, a config value of the wrong type or out of range, a tensor whose
    shape or dtype does not match the config, a malformed weight file, a file or shard
    outside the checkpoint directory: each named; a bad ``dtype`` argument).
    """
    check_dtype(dtype)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    config = read_config(path)
    tensors = read_tensors(path, lambda infos: _check_tensors(path, infos, config))
    tensors, compute = cast_floating(tensors, dtype)
    r = Reader(path, tensors, config.quantization)
    embed = r.linear("model.embed_tokens")
    head = embed if config.tie_word_embeddings else r.linear("lm_head")
    state = State(
        config=config,
        embed_tokens=embed,
        layers=[_layer(r, i) for i in range(config.num_hidden_layers)],
        norm=r.tensor("model.norm.weight"),
        lm_head=head,
        dtype=compute,
        path=path,
    )
    if dequantize:
        state = _dequantized(state)
    mx.eval(_arrays(state))
    return state


def _dequantized(state: State) -> State:
    d = state.dtype
    layers = [replace(layer, qkv=layer.qkv.dequantized(d), o_proj=layer.o_proj.dequantized(d),
                      gate_up=layer.gate_up.dequantized(d), down_proj=layer.down_proj.dequantized(d))
              for layer in state.layers]
    return replace(state, layers=layers, lm_head=state.lm_head.dequantized(d))


def _arrays(state: State) -> list[mx.array]:
    out: list[mx.array] = [state.norm]
    linears = [state.embed_tokens, state.lm_head]
    for layer in state.layers:
        out += [layer.input_layernorm, layer.post_attention_layernorm, layer.q_norm, layer.k_norm]
        linears += [layer.o_proj, layer.down_proj] + layer.qkv.linears() + layer.gate_up.linears()
    for lin in linears:
        out += lin.arrays()
    return out
