"""Load an MLX Qwen3 checkpoint directory into a :class:`State`.

Layout (mlx-community / lmstudio-community MLX checkpoints): ``config.json``,
``model.safetensors`` or shards listed in ``model.safetensors.index.json``, optional
``generation_config.json``. A quantized module stores ``<name>.weight`` (uint32, ``bits``
values packed per word, shape ``(out, in * bits / 32)``) plus ``<name>.scales`` and
``<name>.biases`` (shape ``(out, in / group_size)``); a module without ``.scales`` is dense.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import ClassVar
from pathlib import Path

import mlx.core as mx
import numpy as np

from .config import QuantSpec, Qwen3Config, checkpoint_file, read_config, read_json

__all__ = ["Fused", "Layer", "Linear", "State", "load"]


@dataclass
class Linear:
    """A weight matrix of logical shape ``(out, in)``, dense or quantized.

    Dense: ``weight`` is ``(out, in)`` float; ``weight_t`` is its transposed view, made once
    (evaluated at load, it is a leaf of every step's graph rather than one more node per
    call). Quantized: ``weight`` packed uint32, with ``scales``/``biases`` and ``spec``.
    Call with 2-D ``x`` ``(rows, in)`` -> ``(rows, out)``.
    """

    weight: mx.array
    scales: mx.array | None = None
    biases: mx.array | None = None
    spec: QuantSpec | None = None
    weight_t: mx.array | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.scales is None and self.weight_t is None:
            self.weight_t = self.weight.T

    def __call__(self, x: mx.array) -> mx.array:
        if self.scales is None:
            return x @ self.weight_t
        return mx.quantized_matmul(
            x, self.weight, self.scales, self.biases, transpose=True,
            group_size=self.spec.group_size, bits=self.spec.bits, mode=self.spec.mode,
        )

    def dequantized(self, dtype: mx.Dtype) -> "Linear":
        """This matrix as a dense ``(out, in)`` Linear in ``dtype`` (itself when dense)."""
        if self.scales is None:
            return self
        return Linear(mx.dequantize(self.weight, self.scales, self.biases, group_size=self.spec.group_size,
                                    bits=self.spec.bits, mode=self.spec.mode).astype(dtype))

    def rows(self, ids: mx.array) -> mx.array:
        """Embedding lookup: rows ``ids`` (any int shape) -> ``ids.shape + (in,)``.

        Quantized tables gather the packed rows and dequantize only those (as mlx-lm's
        ``QuantizedEmbedding`` does), never the whole table.
        """
        if self.scales is None:
            return self.weight[ids]
        return mx.dequantize(
            self.weight[ids], self.scales[ids], self.biases[ids],
            group_size=self.spec.group_size, bits=self.spec.bits, mode=self.spec.mode,
        )


@dataclass
class Fused:
    """Linears that read the same input (q/k/v, gate/up), run as one matmul.

    When every part is stored alike (all dense in one dtype, or all quantized with one
    spec) their rows are concatenated once at load into ``merged`` (exact: each output
    is the same dot product) and ``splits`` holds the output offsets; otherwise
    ``parts`` run one by one. Call with ``(rows, in)`` -> list of ``(rows, out_i)``.
    Fewer, larger matmuls mean fewer kernel launches per decode step.
    """

    merged: Linear | None
    splits: list[int]
    parts: list[Linear]

    def __call__(self, x: mx.array) -> list[mx.array]:
        if self.merged is None:
            return [p(x) for p in self.parts]
        return mx.split(self.merged(x), self.splits, axis=-1)

    @classmethod
    def of(cls, parts: list[Linear]) -> "Fused":
        first = parts[0]
        alike = all((p.scales is None) == (first.scales is None) and p.spec == first.spec
                    and p.weight.dtype == first.weight.dtype for p in parts)
        if not alike:
            return cls(None, [], parts)
        cat = [mx.concatenate([getattr(p, f) for p in parts]) if getattr(first, f) is not None else None
               for f in ("weight", "scales", "biases")]
        offsets = [int(x) for x in np.cumsum([p.weight.shape[0] for p in parts])[:-1]]
        return cls(Linear(cat[0], cat[1], cat[2], first.spec), offsets, [])


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


#: safetensors dtypes and their sizes in bytes (https://github.com/huggingface/safetensors).
_ST_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
                   "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_FLOAT_DTYPES = ("F16", "BF16", "F32")
#: Largest safetensors JSON header read (the format allows 100 MB; a dense Qwen3 shard's header
#: is tens of KB, and parsing 16 MiB of JSON already takes a few hundred MB of Python objects).
MAX_HEADER_BYTES = 16 * 2**20
_COMPUTE_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True)
class _TensorInfo:
    """One tensor as a safetensors header describes it (nothing read yet)."""

    dtype: str
    shape: tuple[int, ...]
    file: str


def _weight_files(path: Path) -> list[Path]:
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
        files = [checkpoint_file(path, s, f"weight shard (in {index.name})") for s in sorted(set(weight_map.values()))]
    else:
        files = [checkpoint_file(path, "model.safetensors", "weight file")]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint {path}: missing weight file {f.name}")
    return files


def _read_header(path: Path, f: Path) -> dict[str, _TensorInfo]:
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
    out: dict[str, _TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        ints = lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                     for x in v)
        if (dtype not in _ST_DTYPE_BYTES or not ints(shape) or len(shape) > 8 or not ints(offsets)
                or len(offsets) != 2):
            raise ValueError(f"{where}: malformed header entry for tensor {name!r}")
        begin, end = offsets
        if not begin <= end <= data or end - begin != math.prod(shape) * _ST_DTYPE_BYTES[dtype]:
            raise ValueError(f"{where}: tensor {name!r} ({dtype} {tuple(shape)}) has data_offsets "
                             f"{offsets} that do not match its size or lie outside the file")
        out[name] = _TensorInfo(dtype, tuple(shape), f.name)
    return out


def _check_tensors(path: Path, infos: dict[str, _TensorInfo], config: Qwen3Config) -> None:
    """Check every tensor the model reads against the shape and dtype config.json implies,
    before anything is loaded. Raises KeyError naming a missing tensor, ValueError naming a
    tensor of the wrong shape or dtype (with the config fields its shape comes from).

    The embedding (and an untied head) must have exactly ``vocab_size`` rows: a token id is
    valid when it is below ``config.vocab_size`` (what the engine checks), and every such id
    then has a row.
    """
    c = config
    h, d, inter = c.hidden_size, c.head_dim, c.intermediate_size
    nq, nkv, v = c.num_attention_heads, c.num_key_value_heads, c.vocab_size

    def info(name: str) -> _TensorInfo:
        if name not in infos:
            raise KeyError(f"checkpoint {path}: missing tensor {name!r}")
        return infos[name]

    def expect(name: str, dtypes: tuple[str, ...], shape: tuple[int, ...], why: str) -> None:
        t = info(name)
        if t.dtype not in dtypes:
            raise ValueError(f"checkpoint {path}: tensor {name!r} ({t.file}) has dtype {t.dtype}, "
                             f"expected {' or '.join(dtypes)}")
        if t.shape != shape:
            raise ValueError(f"checkpoint {path}: tensor {name!r} ({t.file}) has shape {t.shape}, "
                             f"expected {shape} from config.json ({why})")

    def matrix(module: str, out: int, inn: int, why_out: str, why_in: str) -> None:
        if f"{module}.scales" not in infos:
            expect(f"{module}.weight", _FLOAT_DTYPES, (out, inn), f"rows: {why_out}; columns: {why_in}")
            return
        spec = c.quantization.spec_for(module) if c.quantization is not None else None
        if spec is None:
            raise ValueError(f"checkpoint {path}: {module}.scales present but config.json's "
                             f"quantization block does not quantize {module!r}")
        if inn % spec.group_size:
            raise ValueError(f"checkpoint {path}: {module} has {inn} input features ({why_in}), "
                             f"not a multiple of its quantization group_size {spec.group_size}")
        expect(f"{module}.weight", ("U32",), (out, inn * spec.bits // 32),
               f"rows: {why_out}; columns: {why_in} at {spec.bits} bits per 32-bit word")
        groups = (out, inn // spec.group_size)
        why = f"rows: {why_out}; columns: {why_in} / group_size {spec.group_size}"
        expect(f"{module}.scales", _FLOAT_DTYPES, groups, why)
        expect(f"{module}.biases", _FLOAT_DTYPES, groups, why)

    hid = f"hidden_size = {h}"
    matrix("model.embed_tokens", v, h, f"vocab_size = {v}", hid)
    if not c.tie_word_embeddings:
        matrix("lm_head", v, h, f"vocab_size = {v}", hid)
    expect("model.norm.weight", _FLOAT_DTYPES, (h,), hid)
    q_out = f"num_attention_heads * head_dim = {nq} * {d}"
    kv_out = f"num_key_value_heads * head_dim = {nkv} * {d}"
    inter_s = f"intermediate_size = {inter}"
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}"
        for norm, n, why in (("input_layernorm", h, hid), ("post_attention_layernorm", h, hid),
                             ("self_attn.q_norm", d, f"head_dim = {d}"), ("self_attn.k_norm", d, f"head_dim = {d}")):
            expect(f"{p}.{norm}.weight", _FLOAT_DTYPES, (n,), why)
        matrix(f"{p}.self_attn.q_proj", nq * d, h, q_out, hid)
        matrix(f"{p}.self_attn.k_proj", nkv * d, h, kv_out, hid)
        matrix(f"{p}.self_attn.v_proj", nkv * d, h, kv_out, hid)
        matrix(f"{p}.self_attn.o_proj", h, nq * d, hid, q_out)
        matrix(f"{p}.mlp.gate_proj", inter, h, inter_s, hid)
        matrix(f"{p}.mlp.up_proj", inter, h, inter_s, hid)
        matrix(f"{p}.mlp.down_proj", h, inter, hid, inter_s)


def _read_tensors(path: Path, config: Qwen3Config) -> dict[str, mx.array]:
    files = _weight_files(path)
    infos: dict[str, _TensorInfo] = {}
    for f in files:
        infos.update(_read_header(path, f))
    _check_tensors(path, infos, config)
    tensors: dict[str, mx.array] = {}
    for f in files:
        try:
            tensors.update(mx.load(str(f)))
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"checkpoint {path}: weight file {f.name} could not be read: {exc}") from exc
    return tensors


class _Reader:
    def __init__(self, path: Path, tensors: dict[str, mx.array], config: Qwen3Config):
        self.path, self.tensors, self.config = path, tensors, config

    def tensor(self, name: str) -> mx.array:
        if name not in self.tensors:
            raise KeyError(f"checkpoint {self.path}: missing tensor {name!r}")
        return self.tensors[name]

    def linear(self, module: str) -> Linear:
        weight = self.tensor(f"{module}.weight")
        if f"{module}.scales" not in self.tensors:
            return Linear(weight)
        quant = self.config.quantization
        spec = quant.spec_for(module) if quant is not None else None
        if spec is None:
            raise ValueError(
                f"checkpoint {self.path}: {module}.scales present but config.json's "
                f"quantization block does not quantize {module!r}"
            )
        biases = self.tensors.get(f"{module}.biases")
        if biases is None and spec.mode == "affine":
            raise KeyError(f"checkpoint {self.path}: missing tensor '{module}.biases'")
        return Linear(weight, self.tensor(f"{module}.scales"), biases, spec)


def _layer(r: _Reader, i: int) -> Layer:
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


def _check_dtype(dtype: object) -> None:
    if dtype is not None and not (isinstance(dtype, str) and dtype in _COMPUTE_DTYPES
                                  or isinstance(dtype, mx.Dtype) and dtype in _COMPUTE_DTYPES.values()):
        raise ValueError(f"dtype must be one of {', '.join(_COMPUTE_DTYPES)} (or the mx dtype), got {dtype!r}")


def _compute_dtype(dtype: str | mx.Dtype | None, stored: mx.Dtype) -> mx.Dtype:
    if dtype is None:
        # MLX's CPU kernels are ~8x slower in bfloat16 than float32 (quantized_matmul
        # of a 1x1024 row by a 3072x1024 4-bit matrix: 17.6 ms vs 2.0 ms on the dev
        # machine, MLX 0.32); the GPU runs the stored half precision natively.
        return mx.float32 if mx.default_device() == mx.cpu else stored
    return _COMPUTE_DTYPES[dtype] if isinstance(dtype, str) else dtype


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
    _check_dtype(dtype)
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    config = read_config(path)
    tensors = _read_tensors(path, config)
    embed_key = "model.embed_tokens.scales"
    stored = tensors.get(embed_key, tensors.get("model.embed_tokens.weight", mx.array(0.0))).dtype
    compute = _compute_dtype(dtype, stored)
    tensors = {k: v.astype(compute) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in tensors.items()}
    r = _Reader(path, tensors, config)
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

    def fused(f: Fused) -> Fused:
        if f.merged is None:
            return Fused(None, [], [p.dequantized(d) for p in f.parts])
        return Fused(f.merged.dequantized(d), f.splits, [])

    layers = [replace(layer, qkv=fused(layer.qkv), o_proj=layer.o_proj.dequantized(d),
                      gate_up=fused(layer.gate_up), down_proj=layer.down_proj.dequantized(d))
              for layer in state.layers]
    return replace(state, layers=layers, lm_head=state.lm_head.dequantized(d))


def _arrays(state: State) -> list[mx.array]:
    out: list[mx.array] = [state.norm]
    linears = [state.embed_tokens, state.lm_head]
    for layer in state.layers:
        out += [layer.input_layernorm, layer.post_attention_layernorm, layer.q_norm, layer.k_norm]
        linears += [layer.o_proj, layer.down_proj]
        for fused in (layer.qkv, layer.gate_up):
            linears += fused.parts if fused.merged is None else [fused.merged]
    for lin in linears:
        out += [a for a in (lin.weight, lin.scales, lin.biases, lin.weight_t) if a is not None]
    return out
