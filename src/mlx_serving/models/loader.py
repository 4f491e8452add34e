"""Load an MLX checkpoint directory of any registered family into a :class:`~models.decoder.layers.State`.

Layout (mlx-community / lmstudio-community MLX checkpoints, or mlx-lm's ``save_model``):
``config.json``, ``model.safetensors`` or shards listed in ``model.safetensors.index.json``,
optional ``generation_config.json``. A quantized module stores ``<name>.weight`` (uint32, ``bits``
values packed per word, shape ``(out, in * bits / 32)``) plus ``<name>.scales`` and
``<name>.biases`` (shape ``(out, in / group_size)``); a module without ``.scales`` is dense. The
weight names are the transformers ones every family shares (``model.embed_tokens``,
``model.layers.{i}.self_attn.{q,k,v,o}_proj``, ``...mlp.{gate,up,down}_proj``, the norms,
``lm_head``); which optional tensors a layer has (``.bias``, ``q_norm`` / ``k_norm``) follows the
family's :class:`~models.config.DecoderConfig` hooks.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Protocol, TypeVar

import mlx.core as mx

from ._checkpoint import TensorChecks, TensorInfo, cast_floating, check_dtype, read_tensors
from ._weights import Fused, Linear, Reader
from .config import DecoderConfig
from .families import read_config
from .decoder.layers import Layer, State, rope_frequencies
from .decoder.memory import check_fits
from .native import QuantizedMatmul, paged_attention_cpu, quantized_matmul_cpu

__all__ = ["load"]

_ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_M = TypeVar("_M", Linear, Fused)


class _Prepare(Protocol):
    """What the loader does to a projection: the same kind back (a Linear, or a Fused)."""

    def __call__(self, m: _M, /) -> _M: ...


def _bias_flag(module: str) -> str:
    """The :class:`DecoderConfig` field that declares ``module``'s bias."""
    if module in _ATTENTION:
        return "attention_bias"
    return "o_proj_bias" if module == "self_attn.o_proj" else "mlp_bias"


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
                "I8": 1, "U8": 1, "BOOL": 1}


def _stored_bytes(infos: dict[str, TensorInfo]) -> int:
    """Bytes the tensors take as stored (safetensors dtypes; an unknown one counted as 4 bytes)."""
    return sum(_DTYPE_BYTES.get(i.dtype, 4) * math.prod(i.shape) for i in infos.values())


def _check_tensors(path: Path, infos: dict[str, TensorInfo], c: DecoderConfig) -> None:
    """Check every tensor the model reads against the shape and dtype config.json implies,
    before anything is loaded (KeyError naming a missing tensor, ValueError naming one of the
    wrong shape or dtype with the config fields its shape comes from). The embedding (and an
    untied head) must have exactly ``vocab_size`` rows: every id the engine accepts has a row. A
    ``.bias`` the config does not declare is refused rather than ignored: it would change the
    model's outputs."""
    t = TensorChecks(path, infos, c.quantization)
    shapes = t.decoder(c)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        if c.qk_norm:
            for norm in ("self_attn.q_norm", "self_attn.k_norm"):
                t.vector(f"{p}.{norm}.weight", c.head_dim, f"head_dim = {c.head_dim}")
        for module, (out, inn, why_out, why_in) in shapes.items():
            name, flag = f"{p}.{module}", _bias_flag(module)
            t.matrix(name, out, inn, why_out, why_in)
            if getattr(c, flag):
                t.vector(f"{name}.bias", out, f"{why_out}; {flag} = true")
            elif f"{name}.bias" in infos:
                raise ValueError(f"checkpoint {path}: tensor '{name}.bias' present but the {c.model_type} "
                                 f"config declares no such bias ({flag} is false)")


def _layer(r: Reader, i: int, c: DecoderConfig) -> Layer:
    p = f"model.layers.{i}"
    return Layer(
        input_layernorm=r.tensor(f"{p}.input_layernorm.weight"),
        post_attention_layernorm=r.tensor(f"{p}.post_attention_layernorm.weight"),
        qkv=Fused.of([r.linear(f"{p}.{m}", c.attention_bias) for m in _ATTENTION]),
        o_proj=r.linear(f"{p}.self_attn.o_proj", c.o_proj_bias),
        gate_up=Fused.of([r.linear(f"{p}.mlp.gate_proj", c.mlp_bias), r.linear(f"{p}.mlp.up_proj", c.mlp_bias)]),
        down_proj=r.linear(f"{p}.mlp.down_proj", c.mlp_bias),
        q_norm=r.tensor(f"{p}.self_attn.q_norm.weight") if c.qk_norm else None,
        k_norm=r.tensor(f"{p}.self_attn.k_norm.weight") if c.qk_norm else None,
    )


def load(path: str | Path, dtype: str | mx.Dtype | None = None, *, dequantize: bool = False,
         native: bool = True) -> State:
    """Load the checkpoint directory ``path`` (its family picked by config.json's ``model_type``,
    :mod:`models.families`) and evaluate its weights.

    ``dtype`` is the activation (compute) dtype: floating tensors (dense weights, scales, biases,
    norms) are cast to it; packed weights stay as stored. None picks float32 on the CPU device and
    the checkpoint's own dtype (that of the embedding scales / weight) elsewhere. ``dequantize``
    stores the projections and the head as dense matrices in that dtype (the same weights, ~3.3x
    their 4-bit bytes; the embedding stays quantized, only looked up): on MLX's CUDA build a
    batched decode step then runs 2.3x faster at 128 rows (bench/gpu_step.py). A tied head
    (``tie_word_embeddings``, or when config.json does not say and the family has no default, no
    ``lm_head.weight`` stored) reuses ``model.embed_tokens`` (a stray ``lm_head.*`` is ignored).
    ``native``: on the CPU device, computing in float32, the quantized projections and head run
    on the native CPU kernel (:mod:`models.native`; 7-42x MLX's CPU ``quantized_matmul``,
    docs/benchmarks.md) and attention over the paged KV cache on the native CPU attention, when
    they build on this machine; False keeps MLX's own everywhere.

    The checkpoint is untrusted: config.json is range-checked (the family's ``config_from_dict``),
    every file must resolve inside the directory, and every safetensors header is parsed and every
    tensor's shape and dtype checked against the config before any weight is read.

    Raises FileNotFoundError (missing directory, config.json or weight file, named), KeyError
    (missing tensor or config field, named), ValueError (unsupported ``model_type``, architecture,
    RoPE scaling or quantization mode, a config value of the wrong type or out of range, a tensor
    whose shape or dtype does not match the config, an undeclared bias, a malformed weight file, a
    file outside the checkpoint directory: each named; a bad ``dtype`` argument).
    """
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
        check_fits(_stored_bytes(infos), f"the weights of {path.name}", "the model's size (a smaller or more "
                   "quantized checkpoint)")  # before any weight is read

    tensors, compute = cast_floating(read_tensors(path, check), dtype)
    r = Reader(path, tensors, config.quantization)
    on_cpu = native and compute == mx.float32 and mx.default_device() == mx.cpu
    kernel = quantized_matmul_cpu() if on_cpu and not dequantize else None
    layers = [_load_layer(r, i, config, _preparation(compute, dequantize, kernel))
              for i in range(config.num_hidden_layers)]
    embed = r.linear("model.embed_tokens")
    head = embed if config.tie_word_embeddings else r.linear("lm_head")
    if dequantize:
        head = head.dequantized(compute)  # the embedding stays as stored: it is only looked up
    elif kernel is not None:
        head = head.with_kernel(kernel)
        embed = head if config.tie_word_embeddings else embed  # a tied head stays tied
    state = State(config=config, embed_tokens=embed, layers=layers, norm=r.tensor("model.norm.weight"),
                  lm_head=head, dtype=compute, path=path, rope_freqs=rope_frequencies(config),
                  attention=paged_attention_cpu() if on_cpu else None)
    mx.eval(_arrays(state))
    mx.clear_cache()  # the buffers of the stored tensors the layers were built from
    return state


def _preparation(compute: mx.Dtype, dequantize: bool, kernel: QuantizedMatmul | None) -> _Prepare:
    """What the loader does to each projection: dense in ``compute`` (``dequantize``), computed
    by the native CPU ``kernel`` with its scales compacted where exact, or nothing."""
    if dequantize:
        return lambda m: m.dequantized(compute)
    if kernel is not None:
        return lambda m: m.with_kernel(kernel).compact()
    return lambda m: m


def _load_layer(r: Reader, i: int, c: DecoderConfig, prepare: _Prepare) -> Layer:
    """Layer ``i`` built, prepared and evaluated, and its stored tensors dropped from ``r``: the
    loader's peak memory is the model plus one layer's stored tensors, not twice the model."""
    layer = _layer(r, i, c)
    layer = replace(layer, **{name: prepare(getattr(layer, name)) for name in _PROJECTIONS})
    mx.eval(_layer_arrays(layer))
    r.release(f"model.layers.{i}.")
    return layer


_PROJECTIONS = ("qkv", "o_proj", "gate_up", "down_proj")


def _layer_arrays(layer: Layer) -> list[mx.array]:
    out = [a for a in (layer.input_layernorm, layer.post_attention_layernorm, layer.q_norm, layer.k_norm)
           if a is not None]
    for lin in [layer.o_proj, layer.down_proj] + layer.qkv.linears() + layer.gate_up.linears():
        out += lin.arrays()
    return out


def _arrays(state: State) -> list[mx.array]:
    out = [a for a in (state.norm, state.rope_freqs) if a is not None]
    for layer in state.layers:
        out += _layer_arrays(layer)
    return out + state.embed_tokens.arrays() + state.lm_head.arrays()
