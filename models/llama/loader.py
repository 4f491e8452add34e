"""Load an MLX Llama checkpoint directory into a :class:`State`.

Layout (mlx-community MLX checkpoints, or mlx-lm's ``save_model``): ``config.json``,
``model.safetensors`` or shards listed in ``model.safetensors.index.json``, optional
``generation_config.json``; per module either dense (``<name>.weight`` ``(out, in)``) or
quantized (packed uint32 ``<name>.weight`` plus ``<name>.scales`` / ``<name>.biases``), and a
``<name>.bias`` ``(out,)`` on the attention projections when ``attention_bias`` and on the MLP
ones when ``mlp_bias``. Unlike Qwen3 there is no q/k norm. Everything the families share
(files, headers, tensor-shape checks, dense/quantized matrices) comes from
:mod:`models._checkpoint` and :mod:`models._weights`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import mlx.core as mx

from .._checkpoint import TensorChecks, TensorInfo, cast_floating, check_dtype, read_tensors
from .._weights import Fused, Linear, Reader
from .config import LlamaConfig, read_config

__all__ = ["Layer", "State", "load"]


@dataclass
class Layer:
    """One decoder layer's weights; ``qkv`` fuses q/k/v_proj, ``gate_up`` gate/up_proj (each
    with its bias when the config has one)."""

    input_layernorm: mx.array
    post_attention_layernorm: mx.array
    qkv: Fused
    o_proj: Linear
    gate_up: Fused
    down_proj: Linear


@dataclass
class State:
    """A loaded Llama: config (``tie_word_embeddings`` resolved), weights, activation ``dtype``,
    checkpoint ``path``, and ``rope_freqs``, the RoPE frequency table when ``rope_scaling`` is
    "llama3" (None otherwise). ``family``: the package of its forward pass (``models.registry``)."""

    family: ClassVar[str] = "llama"
    config: LlamaConfig
    embed_tokens: Linear
    layers: list[Layer]
    norm: mx.array
    lm_head: Linear
    dtype: mx.Dtype
    path: Path | None = None
    rope_freqs: mx.array | None = None


def _check_tensors(path: Path, infos: dict[str, TensorInfo], config: LlamaConfig) -> None:
    """Check every tensor the model reads against the shape and dtype config.json implies,
    before anything is loaded (KeyError naming a missing tensor, ValueError naming one of the
    wrong shape or dtype with the config fields its shape comes from). A ``.bias`` the config
    does not declare (``attention_bias`` / ``mlp_bias`` false) is refused rather than ignored:
    it would change the model's outputs."""
    c = config
    t = TensorChecks(path, infos, c.quantization)
    shapes = t.decoder(c)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        for module, (out, inn, why_out, why_in) in shapes.items():
            name = f"{p}.{module}"
            t.matrix(name, out, inn, why_out, why_in)
            flag = "attention_bias" if module.startswith("self_attn") else "mlp_bias"
            if getattr(c, flag):
                t.vector(f"{name}.bias", out, f"{why_out}; {flag} = true")
            elif f"{name}.bias" in infos:
                raise ValueError(f"checkpoint {path}: tensor '{name}.bias' present but config.json's "
                                 f"{flag} is false (or absent)")


def _layer(r: Reader, i: int, config: LlamaConfig) -> Layer:
    p = f"model.layers.{i}"
    ab, mb = config.attention_bias, config.mlp_bias
    return Layer(
        input_layernorm=r.tensor(f"{p}.input_layernorm.weight"),
        post_attention_layernorm=r.tensor(f"{p}.post_attention_layernorm.weight"),
        qkv=Fused.of([r.linear(f"{p}.self_attn.{n}_proj", ab) for n in "qkv"]),
        o_proj=r.linear(f"{p}.self_attn.o_proj", ab),
        gate_up=Fused.of([r.linear(f"{p}.mlp.gate_proj", mb), r.linear(f"{p}.mlp.up_proj", mb)]),
        down_proj=r.linear(f"{p}.mlp.down_proj", mb),
    )


def load(path: str | Path, dtype: str | mx.Dtype | None = None, *, dequantize: bool = False) -> State:
    """Load the Llama checkpoint directory ``path`` and evaluate its weights.

    Same contract as :func:`models.qwen3.load`: ``dtype`` the compute dtype (None: float32 on
    the CPU device, the checkpoint's own dtype elsewhere); ``dequantize`` stores the
    projections and the head as dense matrices in that dtype. A head is tied to the embedding
    when ``tie_word_embeddings`` says so, or, when config.json does not say, when the
    checkpoint stores no ``lm_head.weight``.

    The checkpoint is untrusted: config.json is range-checked (:mod:`.config`), every file must
    resolve inside the directory, and every safetensors header is parsed and every tensor's
    shape and dtype checked against the config before any weight is read.

    Raises FileNotFoundError (missing config.json / weight file, named), KeyError (missing
    tensor or config field, named), ValueError (unsupported architecture, RoPE scaling or
    quantization mode, a config value of the wrong type or out of range, a tensor whose shape
    or dtype does not match the config, an undeclared bias, a malformed weight file, a file
    outside the checkpoint directory: each named; a bad ``dtype`` argument).
    """
    from .model import rope_frequencies

    check_dtype(dtype)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    config = read_config(path)

    def check(infos: dict[str, TensorInfo]) -> None:
        nonlocal config
        if config.tie_word_embeddings is None:
            config = replace(config, tie_word_embeddings="lm_head.weight" not in infos)
        _check_tensors(path, infos, config)

    tensors = read_tensors(path, check)
    tensors, compute = cast_floating(tensors, dtype)
    r = Reader(path, tensors, config.quantization)
    embed = r.linear("model.embed_tokens")
    head = embed if config.tie_word_embeddings else r.linear("lm_head")
    state = State(
        config=config,
        embed_tokens=embed,
        layers=[_layer(r, i, config) for i in range(config.num_hidden_layers)],
        norm=r.tensor("model.norm.weight"),
        lm_head=head,
        dtype=compute,
        path=path,
        rope_freqs=rope_frequencies(config),
    )
    if dequantize:
        d = compute
        state = replace(state, lm_head=state.lm_head.dequantized(d), layers=[
            replace(layer, qkv=layer.qkv.dequantized(d), o_proj=layer.o_proj.dequantized(d),
                    gate_up=layer.gate_up.dequantized(d), down_proj=layer.down_proj.dequantized(d))
            for layer in state.layers])
    mx.eval(_arrays(state))
    return state


def _arrays(state: State) -> list[mx.array]:
    out: list[mx.array] = [state.norm] + ([state.rope_freqs] if state.rope_freqs is not None else [])
    linears = [state.embed_tokens, state.lm_head]
    for layer in state.layers:
        out += [layer.input_layernorm, layer.post_attention_layernorm]
        linears += [layer.o_proj, layer.down_proj] + layer.qkv.linears() + layer.gate_up.linears()
    for lin in linears:
        out += lin.arrays()
    return out
