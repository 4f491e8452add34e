"""Qwen3 checkpoint configuration: ``config.json`` + ``generation_config.json``.

Field names follow the Hugging Face ``Qwen3Config`` (transformers) as shipped in
mlx-community / lmstudio-community MLX checkpoints.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["QuantSpec", "Quantization", "Qwen3Config", "read_config"]

#: Quantization modes this backend runs (``mx.quantized_matmul`` modes).
SUPPORTED_MODES = ("affine",)
#: Qwen3 ships rope_theta = 1,000,000 (not the 10,000 RoPE default).
DEFAULT_ROPE_THETA = 1_000_000.0
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)


@dataclass(frozen=True)
class QuantSpec:
    """How one weight matrix is packed: ``bits`` per value, one scale and bias per
    ``group_size`` values along the input dimension, MLX ``mode``."""

    group_size: int = 64
    bits: int = 4
    mode: str = "affine"


@dataclass(frozen=True)
class Quantization:
    """The ``quantization`` block of config.json.

    ``default`` applies to every module stored with ``.scales``; ``overrides`` maps a
    module path (``"model.embed_tokens"``, ``"lm_head"``...) to its own spec, or to
    ``None`` when the block says ``false`` (that module is dense).
    """

    default: QuantSpec
    overrides: Mapping[str, QuantSpec | None] = field(default_factory=dict)

    def spec_for(self, module: str) -> QuantSpec | None:
        """The spec for ``module`` (override first, then the default)."""
        if module in self.overrides:
            return self.overrides[module]
        return self.default


@dataclass(frozen=True)
class Qwen3Config:
    """Architecture fields of a Qwen3 checkpoint (all lengths in tokens)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = DEFAULT_ROPE_THETA
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: Quantization | None = None


def _spec(raw: Mapping[str, Any], where: str, base: QuantSpec | None = None) -> QuantSpec:
    base = base or QuantSpec()
    mode = raw.get("mode", base.mode)
    if mode not in SUPPORTED_MODES:
        raise ValueError(
            f"{where}: unsupported quantization mode {mode!r} (supported: {', '.join(SUPPORTED_MODES)})"
        )
    return QuantSpec(
        group_size=int(raw.get("group_size", base.group_size)),
        bits=int(raw.get("bits", base.bits)),
        mode=mode,
    )


def _quantization(raw: Mapping[str, Any] | None, where: str) -> Quantization | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: 'quantization' must be an object, got {raw!r}")
    default = _spec(raw, f"{where} quantization")
    overrides: dict[str, QuantSpec | None] = {}
    for key, value in raw.items():
        if isinstance(value, Mapping):
            overrides[key] = _spec(value, f"{where} quantization[{key!r}]", default)
        elif value is False:
            overrides[key] = None
    return Quantization(default, overrides)


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _require(raw: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in raw:
        raise KeyError(f"{where}: missing field {name!r}")
    return raw[name]


def config_from_dict(raw: Mapping[str, Any], generation: Mapping[str, Any] | None = None,
                     where: str = "config.json") -> Qwen3Config:
    """Build a :class:`Qwen3Config` from parsed config.json (and generation_config.json).

    Raises ValueError for an architecture other than Qwen3 or an unsupported
    quantization mode / RoPE scaling, KeyError naming a missing required field.
    """
    arch = raw.get("architectures") or []
    model_type = raw.get("model_type")
    if model_type != "qwen3" and not any(a in SUPPORTED_ARCHITECTURES for a in arch):
        raise ValueError(
            f"{where}: unsupported architecture (model_type={model_type!r}, architectures={arch!r}); "
            f"only Qwen3 ({', '.join(SUPPORTED_ARCHITECTURES)}) is supported"
        )
    if raw.get("rope_scaling"):
        raise ValueError(f"{where}: rope_scaling {raw['rope_scaling']!r} is not supported")
    hidden = int(_require(raw, "hidden_size", where))
    heads = int(_require(raw, "num_attention_heads", where))
    eos = _eos_ids((generation or {}).get("eos_token_id")) or _eos_ids(raw.get("eos_token_id"))
    rope_theta = raw.get("rope_theta")
    if rope_theta is None:
        rope_theta = (raw.get("rope_parameters") or {}).get("rope_theta", DEFAULT_ROPE_THETA)
    return Qwen3Config(
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size", where)),
        num_hidden_layers=int(_require(raw, "num_hidden_layers", where)),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        vocab_size=int(_require(raw, "vocab_size", where)),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 40960)),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos,
        quantization=_quantization(raw.get("quantization"), where),
    )


def read_config(path: str | Path) -> Qwen3Config:
    """Read ``config.json`` (required) and ``generation_config.json`` (optional, its
    ``eos_token_id`` list wins over config.json's) from a checkpoint directory.

    Raises FileNotFoundError naming config.json when it is missing.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"checkpoint {path}: missing file config.json ({cfg_file})")
    raw = json.loads(cfg_file.read_text())
    gen_file = path / "generation_config.json"
    generation = json.loads(gen_file.read_text()) if gen_file.is_file() else None
    return config_from_dict(raw, generation, where=str(cfg_file))
