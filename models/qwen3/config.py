"""Qwen3 checkpoint configuration: ``config.json`` + ``generation_config.json``.

Field names follow the Hugging Face ``Qwen3Config`` (transformers) as shipped in
mlx-community / lmstudio-community MLX checkpoints.

A checkpoint is untrusted input: every field is type- and range-checked here, before
any tensor is read or any buffer sized from it, and a bad value raises ``ValueError``
naming the file and the field (a missing required field raises :class:`MissingFieldError`,
both a ``KeyError`` and a ``ValueError``). Files are read with a size cap and must stay
inside the checkpoint directory (:func:`checkpoint_file`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

__all__ = ["MissingFieldError", "QuantSpec", "Quantization", "Qwen3Config", "checkpoint_file",
           "read_config", "read_json"]

#: Quantization modes this backend runs (``mx.quantized_matmul`` modes).
SUPPORTED_MODES = ("affine",)
#: Bits and group sizes MLX's affine quantization supports (``mx.quantize``).
SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
#: Qwen3 ships rope_theta = 1,000,000 (not the 10,000 RoPE default).
DEFAULT_ROPE_THETA = 1_000_000.0
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)

#: Upper bounds on config.json's integer fields (inclusive; every one is also >= 1). Far above
#: any released model (Llama-3.1-405B: hidden 16384, intermediate 53248, 126 layers, 128 heads;
#: Gemma 3: vocabulary 262,144), low enough that nothing sized from them can be absurd.
LIMITS: Mapping[str, int] = {
    "hidden_size": 65_536,
    "intermediate_size": 262_144,
    "num_hidden_layers": 1_024,
    "num_attention_heads": 1_024,
    "num_key_value_heads": 1_024,
    "head_dim": 1_024,
    "vocab_size": 2**24,
    "max_position_embeddings": 2**24,
}
#: Largest JSON file (config.json, generation_config.json, model.safetensors.index.json) read.
MAX_JSON_BYTES = 8 * 2**20


class MissingFieldError(KeyError, ValueError):
    """A required config.json field is absent (a ``KeyError``, as documented, and a
    ``ValueError`` like every other config error)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


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


# ---- checked field access -------------------------------------------------------------------

def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int(value: Any, where: str, name: str, lo: int = 1, hi: int | None = None) -> int:
    """An int field (a JSON integer, not a bool or a float) in ``lo..hi``."""
    hi = LIMITS.get(name, hi) if hi is None else hi
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {name} must be an integer, got {_show(value)}")
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi:,}" if hi is not None else f">= {lo}"
        raise ValueError(f"{where}: {name} must be in {bound}, got {value:,}")
    return value


def _float(value: Any, where: str, name: str, lo: float, hi: float, lo_open: bool = True) -> float:
    """A finite number field in ``(lo, hi]`` (``[lo, hi]`` when not ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {name} must be a number, got {_show(value)}")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x) or x > hi or x < lo or (lo_open and x == lo):
        bound = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise ValueError(f"{where}: {name} must be a finite number in {bound}, got {value!r}")
    return x


def _require(raw: Mapping[str, Any], name: str, where: str) -> Any:
    if name not in raw:
        raise MissingFieldError(f"{where}: missing field {name!r}")
    return raw[name]


def _optional(raw: Mapping[str, Any], name: str, default: Any) -> Any:
    value = raw.get(name)
    return default if value is None else value


def _spec(raw: Mapping[str, Any], where: str, base: QuantSpec | None = None) -> QuantSpec:
    base = base or QuantSpec()
    mode = raw.get("mode", base.mode)
    if mode not in SUPPORTED_MODES:
        raise ValueError(
            f"{where}: unsupported quantization mode {_show(mode)} (supported: {', '.join(SUPPORTED_MODES)})"
        )
    bits = _int(raw.get("bits", base.bits), where, "bits", 1, 8)
    group_size = _int(raw.get("group_size", base.group_size), where, "group_size", 1, 2**20)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{where}: bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"{where}: group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    return QuantSpec(group_size=group_size, bits=bits, mode=mode)


def _quantization(raw: Any, where: str) -> Quantization | None:
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: quantization must be an object, got {_show(raw)}")
    default = _spec(raw, f"{where}: quantization")
    overrides: dict[str, QuantSpec | None] = {}
    for key, value in raw.items():
        if isinstance(value, Mapping):
            overrides[key] = _spec(value, f"{where}: quantization[{key!r}]", default)
        elif value is False:
            overrides[key] = None
    return Quantization(default, overrides)


def _eos_ids(value: Any, where: str) -> tuple[int, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if len(items) > 1024:
        raise ValueError(f"{where}: eos_token_id lists {len(items)} ids (at most 1024)")
    return tuple(_int(v, where, "eos_token_id", 0, 2**32 - 1) for v in items)


def config_from_dict(raw: Mapping[str, Any], generation: Mapping[str, Any] | None = None,
                     where: str = "config.json") -> Qwen3Config:
    """Build a :class:`Qwen3Config` from parsed config.json (and generation_config.json).

    Raises ValueError naming the field for an architecture other than Qwen3, an unsupported
    quantization mode / bits / group size or RoPE scaling, and any value of the wrong type
    or out of range (integers: see :data:`LIMITS`; ``num_key_value_heads`` must divide
    ``num_attention_heads``; ``head_dim`` even; ``rms_norm_eps`` in (0, 1]; ``rope_theta``
    finite and >= 1); :class:`MissingFieldError` (a KeyError and a ValueError) naming a
    missing required field.
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: must hold a JSON object, got {type(raw).__name__}")
    arch = _optional(raw, "architectures", [])
    model_type = raw.get("model_type")
    if not isinstance(arch, list) or not all(isinstance(a, str) for a in arch):
        raise ValueError(f"{where}: architectures must be a list of strings, got {_show(arch)}")
    if model_type != "qwen3" and not any(a in SUPPORTED_ARCHITECTURES for a in arch):
        raise ValueError(
            f"{where}: unsupported architecture (model_type={_show(model_type)}, architectures={_show(arch)}); "
            f"only Qwen3 ({', '.join(SUPPORTED_ARCHITECTURES)}) is supported"
        )
    if raw.get("rope_scaling"):
        raise ValueError(f"{where}: rope_scaling {_show(raw['rope_scaling'])} is not supported")
    rope_parameters = _optional(raw, "rope_parameters", {})
    if not isinstance(rope_parameters, Mapping):
        raise ValueError(f"{where}: rope_parameters must be an object, got {_show(rope_parameters)}")
    if rope_parameters.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"{where}: rope_parameters.rope_type {_show(rope_parameters['rope_type'])} "
                         "is not supported")
    hidden = _int(_require(raw, "hidden_size", where), where, "hidden_size")
    heads = _int(_require(raw, "num_attention_heads", where), where, "num_attention_heads")
    kv_heads = _int(_optional(raw, "num_key_value_heads", heads), where, "num_key_value_heads")
    if kv_heads > heads or heads % kv_heads:
        raise ValueError(f"{where}: num_key_value_heads must divide num_attention_heads ({heads}), got {kv_heads}")
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"{where}: hidden_size ({hidden}) must be divisible by num_attention_heads "
                             f"({heads}) when head_dim is not given")
        head_dim = hidden // heads
    head_dim = _int(head_dim, where, "head_dim")
    if head_dim % 2:
        raise ValueError(f"{where}: head_dim must be even (RoPE rotates pairs), got {head_dim}")
    rope_theta = raw.get("rope_theta")
    if rope_theta is None:
        rope_theta = rope_parameters.get("rope_theta", DEFAULT_ROPE_THETA)
    tie = _optional(raw, "tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ValueError(f"{where}: tie_word_embeddings must be true or false, got {_show(tie)}")
    bos = raw.get("bos_token_id")
    gen_where = str(Path(where).with_name("generation_config.json"))
    if generation is not None and not isinstance(generation, Mapping):
        raise ValueError(f"{gen_where}: must hold a JSON object, got {type(generation).__name__}")
    gen_eos = _eos_ids((generation or {}).get("eos_token_id"), gen_where)
    cfg_eos = _eos_ids(raw.get("eos_token_id"), where)
    return Qwen3Config(
        hidden_size=hidden,
        intermediate_size=_int(_require(raw, "intermediate_size", where), where, "intermediate_size"),
        num_hidden_layers=_int(_require(raw, "num_hidden_layers", where), where, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=_int(_require(raw, "vocab_size", where), where, "vocab_size"),
        head_dim=head_dim,
        rms_norm_eps=_float(_optional(raw, "rms_norm_eps", 1e-6), where, "rms_norm_eps", 0.0, 1.0),
        rope_theta=_float(rope_theta, where, "rope_theta", 1.0, 1e15, lo_open=False),
        tie_word_embeddings=tie,
        max_position_embeddings=_int(_optional(raw, "max_position_embeddings", 40960), where,
                                     "max_position_embeddings"),
        bos_token_id=None if bos is None else _int(bos, where, "bos_token_id", 0, 2**32 - 1),
        eos_token_ids=gen_eos or cfg_eos,
        quantization=_quantization(raw.get("quantization"), where),
    )


# ---- files ----------------------------------------------------------------------------------

def _allowed_roots(root: Path) -> list[Path]:
    """Where files of checkpoint ``root`` may live: the directory itself (resolved) and, for a
    Hugging Face hub cache snapshot (``<repo>/snapshots/<revision>/``, whose files are symlinks
    to ``<repo>/blobs/``), that repository's ``blobs`` folder."""
    real = root.resolve()
    roots = [real]
    for d in {root.absolute(), real}:
        if d.parent.name == "snapshots":
            roots.append((d.parent.parent / "blobs").resolve())
    return roots


def checkpoint_file(root: str | Path, name: Any, what: str = "file") -> Path:
    """``root / name``, refusing a name or a symlink that leaves the checkpoint directory.

    Raises ValueError naming ``name`` when it is not a plain relative path string or when it
    resolves outside ``root`` (see :func:`_allowed_roots`). Existence is not checked.
    """
    root = Path(root)
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"checkpoint {root}: {what} name must be a non-empty string, got {_show(name)}")
    path = root / name
    try:
        real = path.resolve()
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise ValueError(f"checkpoint {root}: {what} {name!r} cannot be resolved ({exc})") from None
    if not any(real == r or real.is_relative_to(r) for r in _allowed_roots(root)):
        raise ValueError(f"checkpoint {root}: {what} {name!r} resolves to {real}, "
                         "outside the checkpoint directory")
    return path


def read_json(path: Path, root: Path, limit: int = MAX_JSON_BYTES) -> Any:
    """Parse the JSON file ``path`` of checkpoint ``root``: contained in it, at most ``limit``
    bytes, UTF-8. Raises ValueError naming the file for anything else."""
    path = checkpoint_file(root, path.name)
    if not path.is_file():
        raise ValueError(f"{path}: not a regular file")
    size = path.stat().st_size
    if size > limit:
        raise ValueError(f"{path}: {size:,} bytes, more than the {limit:,} allowed")
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path}: more than the {limit:,} bytes allowed")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None


def read_config(path: str | Path) -> Qwen3Config:
    """Read ``config.json`` (required) and ``generation_config.json`` (optional, its
    ``eos_token_id`` list wins over config.json's) from a checkpoint directory.

    Raises FileNotFoundError naming config.json when it is missing; ValueError naming the
    file (and the field) when either is unreadable, not a JSON object, too large (over
    :data:`MAX_JSON_BYTES`), a symlink out of the directory, or holds a bad value.
    """
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file() and not cfg_file.is_symlink():
        raise FileNotFoundError(f"checkpoint {path}: missing file config.json ({cfg_file})")
    raw = read_json(cfg_file, path)
    gen_file = path / "generation_config.json"
    generation = None
    if gen_file.is_file() or gen_file.is_symlink():
        generation = read_json(gen_file, path)
        if not isinstance(generation, Mapping):
            raise ValueError(f"{gen_file}: must hold a JSON object, got {type(generation).__name__}")
    return config_from_dict(raw, generation, where=str(cfg_file))
