"""Seeded random checkpoints of any registered family, in the mlx-community MLX layout.

``python -m mlx_serving.models.seeded_checkpoint DIR --family qwen3|qwen2|llama --preset NAME
--seed N [--unquantized] [--dtype float32|bfloat16|float16] [--shards N] [--untied]
[--set FIELD=JSON ...]`` writes config.json (the family's :func:`checkpoint_config` for the preset,
with the ``quantization`` block when quantized), model.safetensors (or shards +
model.safetensors.index.json), generation_config.json and the shipped Qwen tokenizer files. Both
:func:`models.loader.load` and mlx-lm's ``load()`` read the result. Which tensors are written (q/k
norms, biases, a separate head) follows the config as the family reads it, so a config override
such as ``--set attention_bias=true`` (llama) writes the biases it declares.

The tokenizer is the shipped Qwen3 one for every family (a real Llama checkpoint carries its own
tokenizer.json; what these checkpoints test is the model): the vocabulary (151,936 rows) and the
BOS / EOS ids of every family's seeded config follow it. Random weights give meaningless text;
they exist for parity tests and benchmarks. The init is scaled so the residual stream is dominated
by the layers rather than the (tied) input embedding, so greedy decoding does not just repeat the
last token.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..tokenization import data_path
from ._checkpoint import COMPUTE_DTYPES
from .config import DecoderConfig
from . import families

__all__ = ["write_checkpoint"]

_GAINS = {"self_attn.q_proj": 2.0, "self_attn.k_proj": 2.0, "self_attn.o_proj": 4.0, "mlp.down_proj": 4.0}
_QUANTIZATION = {"group_size": 64, "bits": 4}  # the mlx-community 4-bit layout
DTYPES = tuple(COMPUTE_DTYPES)  # the dtypes a checkpoint is written in: the compute dtypes


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> mx.array:
    return mx.array(rng.standard_normal(shape, dtype=np.float32) * std)


def _matrices(c: DecoderConfig) -> dict[str, tuple[tuple[int, int], bool]]:
    """Each layer's projections: ``{module: ((out, in), has bias)}``."""
    h, inter, d = c.hidden_size, c.intermediate_size, c.head_dim
    nq, nkv = c.num_attention_heads, c.num_key_value_heads
    return {
        "self_attn.q_proj": ((nq * d, h), c.attention_bias), "self_attn.k_proj": ((nkv * d, h), c.attention_bias),
        "self_attn.v_proj": ((nkv * d, h), c.attention_bias), "self_attn.o_proj": ((h, nq * d), c.o_proj_bias),
        "mlp.gate_proj": ((inter, h), c.mlp_bias), "mlp.up_proj": ((inter, h), c.mlp_bias),
        "mlp.down_proj": ((h, inter), c.mlp_bias),
    }


def _dense_weights(c: DecoderConfig, rng: np.random.Generator,
                   progress: Callable[[Iterable[int]], Iterable[int]] = iter) -> dict[str, mx.array]:
    """float32 weights, std = gain / sqrt(fan_in); biases (where the config declares them) std 0.1;
    norm weights around 1. The embedding (std 0.4 / sqrt(hidden)) is small next to the layers'
    outputs (gain 4 on o_proj / down_proj), so the residual stream is not dominated by the input
    token and greedy decoding does not lock onto one repeated token; q/k gain 2 sharpens attention
    so the context matters; the final norm weight 4 spreads the tied head's logits (std ~1.6).
    Tuned by measuring distinct tokens in 32 greedy steps (about 30 of 32 on Qwen3 tiny)."""
    h, v = c.hidden_size, c.vocab_size
    w: dict[str, mx.array] = {
        "model.embed_tokens.weight": _normal(rng, (v, h), 0.4 / np.sqrt(h)),
        "model.norm.weight": mx.full((h,), 4.0),
    }
    norms = [("input_layernorm", h), ("post_attention_layernorm", h)]
    norms += [("self_attn.q_norm", c.head_dim), ("self_attn.k_norm", c.head_dim)] if c.qk_norm else []
    for i in progress(range(c.num_hidden_layers)):
        p = f"model.layers.{i}"
        for name, (shape, bias) in _matrices(c).items():
            w[f"{p}.{name}.weight"] = _normal(rng, shape, _GAINS.get(name, 1.0) / np.sqrt(shape[1]))
            if bias:
                w[f"{p}.{name}.bias"] = _normal(rng, (shape[0],), 0.1)
        for norm, size in norms:
            w[f"{p}.{norm}.weight"] = mx.array(1.0 + 0.1 * rng.standard_normal(size, dtype=np.float32))
    if not c.tie_word_embeddings:
        w["lm_head.weight"] = _normal(rng, (v, h), 0.4 / np.sqrt(h))
    return w


def _finish(w: dict[str, mx.array], quantized: bool, dtype: mx.Dtype) -> dict[str, mx.array]:
    """Quantize every 2-D matrix (affine: uint32-packed values, scales/biases in ``dtype``) when
    ``quantized``; cast the rest to ``dtype``."""
    out: dict[str, mx.array] = {}
    for name, arr in w.items():
        if quantized and arr.ndim == 2:
            base = name[: -len(".weight")]
            q, scales, biases = mx.quantize(arr.astype(dtype), group_size=_QUANTIZATION["group_size"],
                                            bits=_QUANTIZATION["bits"])
            out[f"{base}.weight"], out[f"{base}.scales"], out[f"{base}.biases"] = q, scales, biases
        else:
            out[name] = arr.astype(dtype)
    mx.eval(list(out.values()))
    return out


def _save(path: Path, tensors: dict[str, mx.array], shards: int) -> None:
    names = sorted(tensors)
    if shards <= 1:
        mx.save_safetensors(str(path / "model.safetensors"), tensors, metadata={"format": "mlx"})
        return
    parts = np.array_split(np.array(names, dtype=object), shards)
    weight_map: dict[str, str] = {}
    for k, part in enumerate(parts, start=1):
        fname = f"model-{k:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(path / fname), {n: tensors[n] for n in part}, metadata={"format": "mlx"})
        weight_map.update({n: fname for n in part})
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _copy_tokenizer(path: Path) -> None:
    """The shipped tokenizer files (tokenization package data), tokenizer.json unzipped."""
    for name in ("tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(data_path(name), path / name)
    with gzip.open(data_path("tokenizer.json.gz"), "rb") as fin, open(path / "tokenizer.json", "wb") as fout:
        shutil.copyfileobj(fin, fout)


def _config(family_name: str, preset: str, quantized: bool, dtype: str, tie_word_embeddings: bool,
            overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """config.json's fields (ValueError for an unknown family, preset or dtype)."""
    fam = families.family(family_name)
    if preset not in fam.PRESETS:
        raise ValueError(f"unknown {family_name} preset {preset!r} (choose from {', '.join(fam.PRESETS)})")
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}")
    cfg = fam.checkpoint_config(preset)
    cfg["torch_dtype"] = dtype
    for key in ("quantization", "quantization_config"):
        if quantized:
            cfg[key] = dict(_QUANTIZATION)
        else:
            cfg.pop(key, None)
    cfg["tie_word_embeddings"] = tie_word_embeddings
    cfg.update(overrides or {})
    return cfg


def write_checkpoint(path: str | Path, preset: str = "tiny", seed: int = 0, *, family: str = "qwen3",
                     quantized: bool = True, dtype: str = "bfloat16", shards: int = 1,
                     tie_word_embeddings: bool = True, config_overrides: Mapping[str, Any] | None = None,
                     progress: Callable[[Iterable[int]], Iterable[int]] = iter) -> Path:
    """Write a seeded random checkpoint of ``family`` (a ``model_type`` of
    :data:`models.families.FAMILIES`) to ``path`` (created) and return it.

    ``preset``: a key of the family's ``PRESETS``. ``quantized``: 4-bit affine, group size 64 (the
    mlx-community layout: every matrix, the embedding included; biases and norms dense); otherwise
    dense ``dtype`` weights and no quantization block. ``dtype``: "bfloat16" (as shipped) or
    "float32" (exact parity tests). ``config_overrides``: config.json fields set last
    (``attention_bias``, ``rope_scaling``, ``model_type``, ...); the tensors written follow the
    resulting config as the family reads it. ``shards`` > 1 splits the tensors and writes
    model.safetensors.index.json. ``progress`` wraps the iteration over layers (e.g. ``tqdm``).
    Same arguments, same bytes. Raises ValueError for an unknown family, preset or dtype, or a
    config the family refuses.
    """
    cfg = _config(family, preset, quantized, dtype, tie_word_embeddings, config_overrides)
    config = families.family(family).config_from_dict(cfg, where=f"seeded {family} config.json")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = _dense_weights(config, np.random.default_rng(seed), progress)
    _save(path, _finish(weights, quantized, COMPUTE_DTYPES[dtype]), shards)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    _copy_tokenizer(path)
    return path


def _override(text: str) -> tuple[str, Any]:
    """``FIELD=JSON`` -> ``(FIELD, value)`` (argparse type of ``--set``)."""
    field, sep, value = text.partition("=")
    if not sep or not field:
        raise argparse.ArgumentTypeError(f"expected FIELD=JSON, got {text!r}")
    try:
        return field, json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{field}: not JSON ({exc.msg})") from None


def main(argv: list[str] | None = None) -> None:
    """CLI entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m mlx_serving.models.seeded_checkpoint",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--family", choices=sorted(set(families.FAMILIES.values())), default="qwen3")
    ap.add_argument("--preset", default="tiny", help="a preset of the family (tiny; 0.6b, 0.5b, 1b)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--unquantized", action="store_true", help="dense weights, no quantization block")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--untied", action="store_true", help="a separate lm_head")
    ap.add_argument("--set", type=_override, action="append", default=[], metavar="FIELD=JSON",
                    help="a config.json field set last, e.g. attention_bias=true or rope_scaling=null")
    args = ap.parse_args(argv)
    try:
        out = write_checkpoint(args.dir, args.preset, args.seed, family=args.family,
                               quantized=not args.unquantized, dtype=args.dtype, shards=args.shards,
                               tie_word_embeddings=not args.untied, config_overrides=dict(args.set))
    except ValueError as exc:
        ap.error(str(exc))
    print(f"wrote {args.family} {args.preset} checkpoint (seed {args.seed}) to {out}")


if __name__ == "__main__":
    main()
