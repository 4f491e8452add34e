"""What every model family's loader shares: reading an untrusted MLX checkpoint directory.

A checkpoint is untrusted input. This module holds the checks every family applies before any
tensor is read or any buffer sized from a config value:

- files: :func:`checkpoint_file` (a name or symlink may not leave the checkpoint directory; a
  Hugging Face hub snapshot may point into its ``blobs`` folder), :func:`read_json` (size cap
  :data:`MAX_JSON_BYTES`, UTF-8, named errors), :func:`read_config_files`;
- config.json fields: typed, range-checked accessors (:func:`int_field` with the bounds of
  :data:`LIMITS`, :func:`float_field`, :func:`bool_field`, :func:`require`), the
  ``quantization`` block (:class:`Quantization`), EOS ids, and :func:`decoder_fields`, the
  fields every decoder-only transformer family reads (sizes, heads, head_dim, norm eps,
  vocabulary, BOS/EOS, quantization);
- weights: :func:`weight_files` (model.safetensors or the shards of its index),
  :func:`read_header` (each safetensors header parsed and checked without reading data),
  :class:`TensorChecks` (every tensor's shape and dtype against the config, dense or
  quantized) and :func:`read_tensors`; the compute-dtype helpers.

A bad value raises ``ValueError`` naming the file and the field, tensor or file; a missing
required field :class:`MissingFieldError` (a ``KeyError`` and a ``ValueError``); a missing
tensor ``KeyError`` naming it; a missing file ``FileNotFoundError`` naming it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, TypedDict, TypeGuard, TypeVar

import mlx.core as mx

from .._paths import resolves_inside
from ..serving._json import JSON, JSONObject

__all__ = [
    "COMPUTE_DTYPES", "DecoderFields", "DecoderShape", "FLOAT_DTYPES", "LIMITS", "MAX_HEADER_BYTES", "MAX_JSON_BYTES", "MissingFieldError",
    "QuantSpec", "Quantization", "TensorChecks", "TensorInfo", "bool_field", "cast_floating", "check_dtype",
    "checkpoint_file", "compute_dtype", "decoder_fields", "eos_ids", "float_field", "int_field", "optional",
    "quantization_block", "read_config_files", "read_header", "read_json", "read_tensors", "require", "show",
    "weight_files",
]

#: Quantization modes the families run (``mx.quantized_matmul`` modes).
SUPPORTED_MODES = ("affine",)
#: Bits and group sizes MLX's affine quantization supports (``mx.quantize``).
SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)

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

_T = TypeVar("_T")
_D = TypeVar("_D")


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


# ---- checked field access -------------------------------------------------------------------

def show(value: object) -> str:
    """``repr(value)``, cut to 80 characters (a hostile value is not echoed whole)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def int_field(value: object, where: str, name: str, lo: int = 1, hi: int | None = None) -> int:
    """An int field (a JSON integer, not a bool or a float) in ``lo..hi`` (``hi`` defaults to
    :data:`LIMITS` for the field's name)."""
    hi = LIMITS.get(name, hi) if hi is None else hi
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {name} must be an integer, got {show(value)}")
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi:,}" if hi is not None else f">= {lo}"
        raise ValueError(f"{where}: {name} must be in {bound}, got {value:,}")
    return value


def float_field(value: object, where: str, name: str, lo: float, hi: float, lo_open: bool = True) -> float:
    """A finite number field in ``(lo, hi]`` (``[lo, hi]`` when not ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: {name} must be a number, got {show(value)}")
    try:
        x = float(value)
    except OverflowError:
        x = math.inf
    if not math.isfinite(x) or x > hi or x < lo or (lo_open and x == lo):
        bound = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise ValueError(f"{where}: {name} must be a finite number in {bound}, got {value!r}")
    return x


def bool_field(value: object, where: str, name: str) -> bool:
    """A JSON ``true`` / ``false`` field (not 0 / 1, not a string)."""
    if not isinstance(value, bool):
        raise ValueError(f"{where}: {name} must be true or false, got {show(value)}")
    return value


def require(raw: Mapping[str, _T], name: str, where: str) -> _T:
    """``raw[name]``; :class:`MissingFieldError` naming the field when absent."""
    if name not in raw:
        raise MissingFieldError(f"{where}: missing field {name!r}")
    return raw[name]


def optional(raw: Mapping[str, _T], name: str, default: _D) -> _T | _D:
    """``raw[name]``, or ``default`` when absent or JSON null."""
    value = raw.get(name)
    return default if value is None else value


def _spec(raw: Mapping[str, Any], where: str, base: QuantSpec | None = None) -> QuantSpec:
    base = base or QuantSpec()
    mode = raw.get("mode", base.mode)
    if mode not in SUPPORTED_MODES:
        raise ValueError(
            f"{where}: unsupported quantization mode {show(mode)} (supported: {', '.join(SUPPORTED_MODES)})"
        )
    bits = int_field(raw.get("bits", base.bits), where, "bits", 1, 8)
    group_size = int_field(raw.get("group_size", base.group_size), where, "group_size", 1, 2**20)
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{where}: bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"{where}: group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    return QuantSpec(group_size=group_size, bits=bits, mode=mode)


def quantization_block(raw: object, where: str) -> Quantization | None:
    """config.json's ``quantization`` block (None when absent): its default spec and the
    per-module overrides (an object, or ``false`` for a module kept dense)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: quantization must be an object, got {show(raw)}")
    default = _spec(raw, f"{where}: quantization")
    overrides: dict[str, QuantSpec | None] = {}
    for key, value in raw.items():
        if isinstance(value, Mapping):
            overrides[key] = _spec(value, f"{where}: quantization[{key!r}]", default)
        elif value is False:
            overrides[key] = None
    return Quantization(default, overrides)


def eos_ids(value: object, where: str) -> tuple[int, ...]:
    """An ``eos_token_id`` field: one id or a list of at most 1024, each in [0, 2**32)."""
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if len(items) > 1024:
        raise ValueError(f"{where}: eos_token_id lists {len(items)} ids (at most 1024)")
    return tuple(int_field(v, where, "eos_token_id", 0, 2**32 - 1) for v in items)


class DecoderFields(TypedDict):
    """What :func:`decoder_fields` returns: :class:`~models.config.DecoderConfig` keyword arguments."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    quantization: Quantization | None


def decoder_fields(raw: Mapping[str, object], generation: Mapping[str, object] | None, where: str, *,
                   max_position_embeddings: int, rms_norm_eps: float = 1e-6) -> DecoderFields:
    """The fields every decoder-only family reads from config.json (and generation_config.json),
    checked: ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``vocab_size``
    (required), ``num_attention_heads`` (required), ``num_key_value_heads`` (default: the query
    heads; must divide them), ``head_dim`` (default ``hidden_size / num_attention_heads``, which
    must then divide; even, since RoPE rotates pairs), ``rms_norm_eps`` in (0, 1],
    ``max_position_embeddings``, ``bos_token_id``, the EOS ids (generation_config.json's list
    wins over config.json's) and the ``quantization`` block. The keyword arguments are the
    family's defaults. Returns them by field name (``eos_token_ids`` a tuple)."""
    hidden = int_field(require(raw, "hidden_size", where), where, "hidden_size")
    heads = int_field(require(raw, "num_attention_heads", where), where, "num_attention_heads")
    kv_heads = int_field(optional(raw, "num_key_value_heads", heads), where, "num_key_value_heads")
    if kv_heads > heads or heads % kv_heads:
        raise ValueError(f"{where}: num_key_value_heads must divide num_attention_heads ({heads}), got {kv_heads}")
    head_dim = raw.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"{where}: hidden_size ({hidden}) must be divisible by num_attention_heads "
                             f"({heads}) when head_dim is not given")
        head_dim = hidden // heads
    head_dim = int_field(head_dim, where, "head_dim")
    if head_dim % 2:
        raise ValueError(f"{where}: head_dim must be even (RoPE rotates pairs), got {head_dim}")
    bos = raw.get("bos_token_id")
    gen_where = str(Path(where).with_name("generation_config.json"))
    if generation is not None and not isinstance(generation, Mapping):
        raise ValueError(f"{gen_where}: must hold a JSON object, got {type(generation).__name__}")
    gen_eos = eos_ids((generation or {}).get("eos_token_id"), gen_where)
    cfg_eos = eos_ids(raw.get("eos_token_id"), where)
    return DecoderFields(
        hidden_size=hidden,
        intermediate_size=int_field(require(raw, "intermediate_size", where), where, "intermediate_size"),
        num_hidden_layers=int_field(require(raw, "num_hidden_layers", where), where, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=int_field(require(raw, "vocab_size", where), where, "vocab_size"),
        head_dim=head_dim,
        rms_norm_eps=float_field(optional(raw, "rms_norm_eps", rms_norm_eps), where, "rms_norm_eps", 0.0, 1.0),
        max_position_embeddings=int_field(optional(raw, "max_position_embeddings", max_position_embeddings),
                                          where, "max_position_embeddings"),
        bos_token_id=None if bos is None else int_field(bos, where, "bos_token_id", 0, 2**32 - 1),
        eos_token_ids=gen_eos or cfg_eos,
        quantization=quantization_block(raw.get("quantization"), where),
    )


# ---- files ----------------------------------------------------------------------------------

def checkpoint_file(root: str | Path, name: object, what: str = "file") -> Path:
    """``root / name``, refusing a name or a symlink that leaves the checkpoint directory.

    Raises ValueError naming ``name`` when it is not a plain relative path string or when it
    resolves outside ``root`` (see :func:`mlx_serving._paths.allowed_roots`). Existence is not checked.
    """
    root = Path(root)
    if not isinstance(name, str) or not name or "\0" in name:
        raise ValueError(f"checkpoint {root}: {what} name must be a non-empty string, got {show(name)}")
    path = root / name
    try:
        inside, real = resolves_inside(path, root)
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise ValueError(f"checkpoint {root}: {what} {name!r} cannot be resolved ({exc})") from None
    if not inside:
        raise ValueError(f"checkpoint {root}: {what} {name!r} resolves to {real}, "
                         "outside the checkpoint directory")
    return path


def read_json(path: Path, root: Path, limit: int | None = None) -> JSON:
    """Parse the JSON file ``path`` of checkpoint ``root``: contained in it, at most ``limit``
    bytes (default :data:`MAX_JSON_BYTES`), UTF-8. Raises ValueError naming the file for
    anything else."""
    limit = MAX_JSON_BYTES if limit is None else limit
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


def read_config_files(path: str | Path) -> tuple[JSON, JSONObject | None, str]:
    """Read ``config.json`` (required) and ``generation_config.json`` (optional) of checkpoint
    ``path``: ``(config, generation or None, where)`` with ``where`` config.json's path, for
    error messages. Raises FileNotFoundError naming config.json when it is missing; ValueError
    naming the file when either is unreadable, too large, a symlink out of the directory, or
    (generation_config.json) not a JSON object."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file() and not cfg_file.is_symlink():
        raise FileNotFoundError(f"checkpoint {path}: missing file config.json ({cfg_file})")
    raw = read_json(cfg_file, path)
    gen_file = path / "generation_config.json"
    generation = None
    if gen_file.is_file() or gen_file.is_symlink():
        gen = read_json(gen_file, path)
        if not isinstance(gen, Mapping):
            raise ValueError(f"{gen_file}: must hold a JSON object, got {type(gen).__name__}")
        generation = gen
    return raw, generation, str(cfg_file)


# ---- safetensors weight files ---------------------------------------------------------------

#: safetensors dtypes and their sizes in bytes (https://github.com/huggingface/safetensors).
ST_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                  "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_DTYPES = ("F16", "BF16", "F32")
#: Largest safetensors JSON header read (the format allows 100 MB; a dense shard's header is tens
#: of KB, and parsing 16 MiB of JSON already takes a few hundred MB of Python objects).
MAX_HEADER_BYTES = 16 * 2**20


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it (nothing read yet)."""

    dtype: str
    shape: tuple[int, ...]
    file: str


def weight_files(path: Path) -> list[Path]:
    """The weight files of checkpoint ``path``: the shards named by
    model.safetensors.index.json's ``weight_map``, else model.safetensors. Every name must
    resolve inside the checkpoint (symlinks included)."""
    index = path / "model.safetensors.index.json"
    if index.is_file() or index.is_symlink():
        raw = read_json(index, path)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: weight_map must be a non-empty object of tensor name -> shard file")
        bad = next((s for s in weight_map.values() if not isinstance(s, str)), None)
        if bad is not None:
            raise ValueError(f"{index}: shard names must be strings, got {bad!r}")
        shards = sorted({s for s in weight_map.values() if isinstance(s, str)})  # all of them, checked above
        files = [checkpoint_file(path, s, f"weight shard (in {index.name})") for s in shards]
    else:
        files = [checkpoint_file(path, "model.safetensors", "weight file")]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint {path}: missing weight file {f.name}")
    return files


def _naturals(v: object) -> TypeGuard[list[int]]:
    """Whether ``v`` is a JSON array of non-negative integers (a shape, data offsets)."""
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def read_header(path: Path, f: Path) -> dict[str, TensorInfo]:
    """Parse and check the header of the safetensors file ``f`` without reading its data:
    every tensor's dtype is known, its shape non-negative integers, and its byte range
    inside the file and exactly ``prod(shape) * itemsize`` long. Raises ValueError naming
    the file otherwise."""
    where = f"checkpoint {path}: weight file {f.name}"
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{where} is not a safetensors file ({size} bytes)")
        n = int.from_bytes(head, "little")
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"{where}: header length {n:,} exceeds the file ({size:,} bytes) "
                             f"or the {MAX_HEADER_BYTES:,}-byte limit")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"{where}: header is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{where}: header is not a JSON object")
    data = size - 8 - n
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (dtype not in ST_DTYPE_BYTES or not _naturals(shape) or len(shape) > 8 or not _naturals(offsets)
                or len(offsets) != 2):
            raise ValueError(f"{where}: malformed header entry for tensor {name!r}")
        begin, end = offsets
        if not begin <= end <= data or end - begin != math.prod(shape) * ST_DTYPE_BYTES[dtype]:
            raise ValueError(f"{where}: tensor {name!r} ({dtype} {tuple(shape)}) has data_offsets "
                             f"{offsets} that do not match its size or lie outside the file")
        out[name] = TensorInfo(dtype, tuple(shape), f.name)
    return out



class DecoderShape(Protocol):
    """The config fields :meth:`TensorChecks.decoder` checks a checkpoint's tensors against
    (read-only: :class:`~models.config.DecoderConfig` has them)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool | None: ...
    @property
    def num_hidden_layers(self) -> int: ...

class TensorChecks:
    """Checks of the tensors a checkpoint's headers describe against what its config implies,
    before anything is loaded: :meth:`expect` (one tensor's dtype and shape), :meth:`matrix`
    (a dense or quantized weight matrix of logical shape ``(out, in)``), :meth:`vector`.
    Errors name the tensor, its file and the config fields its expected shape comes from."""

    def __init__(self, path: Path, infos: Mapping[str, TensorInfo], quantization: Quantization | None):
        self.path, self.infos, self.quantization = path, infos, quantization

    def info(self, name: str) -> TensorInfo:
        """The header entry of ``name``; KeyError naming it when absent."""
        if name not in self.infos:
            raise KeyError(f"checkpoint {self.path}: missing tensor {name!r}")
        return self.infos[name]

    def expect(self, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...], why: str) -> None:
        """``name`` exists with one of ``dtypes`` and exactly ``shape`` (``why``: the config
        fields the shape comes from)."""
        t = self.info(name)
        if t.dtype not in dtypes:
            raise ValueError(f"checkpoint {self.path}: tensor {name!r} ({t.file}) has dtype {t.dtype}, "
                             f"expected {' or '.join(dtypes)}")
        if t.shape != shape:
            raise ValueError(f"checkpoint {self.path}: tensor {name!r} ({t.file}) has shape {t.shape}, "
                             f"expected {shape} from config.json ({why})")

    def vector(self, name: str, size: int, why: str) -> None:
        """A floating 1-D tensor of ``size`` values (a norm weight, a bias)."""
        self.expect(name, FLOAT_DTYPES, (size,), why)

    def matrix(self, module: str, out: int, inn: int, why_out: str, why_in: str) -> None:
        """``module``'s weight: dense ``.weight`` ``(out, inn)``, or quantized (``.scales``
        present) per the config's quantization block: packed uint32 ``.weight`` and
        ``.scales`` / ``.biases`` of one value per group."""
        infos = self.infos
        if f"{module}.scales" not in infos:
            self.expect(f"{module}.weight", FLOAT_DTYPES, (out, inn), f"rows: {why_out}; columns: {why_in}")
            return
        spec = self.quantization.spec_for(module) if self.quantization is not None else None
        if spec is None:
            raise ValueError(f"checkpoint {self.path}: {module}.scales present but config.json's "
                             f"quantization block does not quantize {module!r}")
        if inn % spec.group_size:
            raise ValueError(f"checkpoint {self.path}: {module} has {inn} input features ({why_in}), "
                             f"not a multiple of its quantization group_size {spec.group_size}")
        self.expect(f"{module}.weight", ("U32",), (out, inn * spec.bits // 32),
                    f"rows: {why_out}; columns: {why_in} at {spec.bits} bits per 32-bit word")
        groups = (out, inn // spec.group_size)
        why = f"rows: {why_out}; columns: {why_in} / group_size {spec.group_size}"
        self.expect(f"{module}.scales", FLOAT_DTYPES, groups, why)
        self.expect(f"{module}.biases", FLOAT_DTYPES, groups, why)

    def decoder(self, c: DecoderShape) -> dict[str, tuple[int, int, str, str]]:
        """Check what every Llama-shaped decoder has outside its layers (the embedding, an untied
        head, the final norm: exactly ``vocab_size`` x ``hidden_size``) and each layer's two
        RMSNorm weights; return each layer's projections as ``{module: (out, in, why_out,
        why_in)}`` (logical matrix shapes, the config fields behind them) for the family to
        check with :meth:`matrix` beside its own extras (q/k norms, biases). ``c`` is a config
        with ``hidden_size``, ``head_dim``, ``intermediate_size``, ``num_attention_heads``,
        ``num_key_value_heads``, ``vocab_size``, ``tie_word_embeddings``, ``num_hidden_layers``.
        Raises KeyError / ValueError as :meth:`expect`."""
        h, d, inter = c.hidden_size, c.head_dim, c.intermediate_size
        nq, nkv, v = c.num_attention_heads, c.num_key_value_heads, c.vocab_size
        hid = f"hidden_size = {h}"
        self.matrix("model.embed_tokens", v, h, f"vocab_size = {v}", hid)
        if not c.tie_word_embeddings:
            self.matrix("lm_head", v, h, f"vocab_size = {v}", hid)
        self.vector("model.norm.weight", h, hid)
        for i in range(c.num_hidden_layers):
            for norm in ("input_layernorm", "post_attention_layernorm"):
                self.vector(f"model.layers.{i}.{norm}.weight", h, hid)
        q_out = f"num_attention_heads * head_dim = {nq} * {d}"
        kv_out = f"num_key_value_heads * head_dim = {nkv} * {d}"
        inter_s = f"intermediate_size = {inter}"
        return {"self_attn.q_proj": (nq * d, h, q_out, hid), "self_attn.k_proj": (nkv * d, h, kv_out, hid),
                "self_attn.v_proj": (nkv * d, h, kv_out, hid), "self_attn.o_proj": (h, nq * d, hid, q_out),
                "mlp.gate_proj": (inter, h, inter_s, hid), "mlp.up_proj": (inter, h, inter_s, hid),
                "mlp.down_proj": (h, inter, hid, inter_s)}


def read_tensors(path: Path, check: Callable[[dict[str, TensorInfo]], None]) -> dict[str, mx.array]:
    """Every tensor of checkpoint ``path``: the headers of all its weight files are read and
    passed to ``check`` (which raises for anything the config disagrees with) before any data
    is loaded. Raises ValueError naming a weight file MLX cannot read."""
    files = weight_files(path)
    infos: dict[str, TensorInfo] = {}
    for f in files:
        infos.update(read_header(path, f))
    check(infos)
    tensors: dict[str, mx.array] = {}
    for f in files:
        try:
            loaded = mx.load(str(f))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"checkpoint {path}: weight file {f.name} could not be read: {exc}") from exc
        if not isinstance(loaded, dict):  # a .safetensors file loads as {name: array}
            raise ValueError(f"checkpoint {path}: weight file {f.name} did not load as named tensors")
        tensors.update(loaded)
    return tensors


# ---- compute dtype ---------------------------------------------------------------------------

COMPUTE_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def check_dtype(dtype: object) -> None:
    """ValueError unless ``dtype`` is None, a name in :data:`COMPUTE_DTYPES` or one of its dtypes."""
    if dtype is not None and not (isinstance(dtype, str) and dtype in COMPUTE_DTYPES
                                  or isinstance(dtype, mx.Dtype) and dtype in COMPUTE_DTYPES.values()):
        raise ValueError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)} (or the mx dtype), got {dtype!r}")


def compute_dtype(dtype: str | mx.Dtype | None, stored: mx.Dtype) -> mx.Dtype:
    """The activation dtype: ``dtype``, or for None float32 on the CPU device and ``stored``
    (the checkpoint's own floating dtype) elsewhere."""
    if dtype is None:
        # MLX's CPU kernels are ~8x slower in bfloat16 than float32 (quantized_matmul
        # of a 1x1024 row by a 3072x1024 4-bit matrix: 17.6 ms vs 2.0 ms on the dev
        # machine, MLX 0.32); the GPU runs the stored half precision natively.
        return mx.float32 if mx.default_device() == mx.cpu else stored
    return COMPUTE_DTYPES[dtype] if isinstance(dtype, str) else dtype


def cast_floating(tensors: dict[str, mx.array], dtype: str | mx.Dtype | None) -> tuple[dict[str, mx.array], mx.Dtype]:
    """``tensors`` with every floating one cast to the compute dtype (packed weights stay as
    stored), and that dtype (:func:`compute_dtype`, ``stored`` being the embedding's scales or
    weight dtype)."""
    stored = tensors.get("model.embed_tokens.scales", tensors.get("model.embed_tokens.weight", mx.array(0.0))).dtype
    compute = compute_dtype(dtype, stored)
    return {k: v.astype(compute) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in tensors.items()}, compute
