"""Seeded random Llama checkpoints in the mlx-community MLX layout.

``python -m mlx_serving.models.llama.checkpoint DIR --preset tiny|1b --seed N [--unquantized]
[--dtype float32|bfloat16] [--shards N] [--untied] [--attention-bias] [--mlp-bias]
[--rope-scaling llama3|none]`` writes config.json (Llama 3.2's fields: ``rope_theta`` 500,000,
``rope_scaling`` "llama3", and the ``quantization`` block when quantized), model.safetensors (or
shards + model.safetensors.index.json), generation_config.json and tokenizer files. Both
:func:`models.llama.load` and mlx-lm's ``load()`` read the result.

The tokenizer files are the shipped Qwen3 ones (as the Qwen3 writer copies them): a real Llama
checkpoint carries its own tokenizer.json, and what is tested with these checkpoints is the model,
not the tokenizer; the vocabulary (151,936 rows) and the BOS / EOS ids follow that tokenizer.
Random weights give meaningless text; they exist for parity tests and benchmarks. Weights use
the Qwen3 writer's scaled init (:mod:`models.qwen3.checkpoint`) so greedy decoding does not
just repeat one token.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from ..qwen3.checkpoint import _GAINS, _VOCAB, _copy_tokenizer, _finish, _normal, _save

__all__ = ["LLAMA3_ROPE_SCALING", "PRESETS", "write_checkpoint"]

#: Architecture presets. "1b" is the shape of Llama-3.2-1B (its config.json; vocabulary aside).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),  # head_dim 16 (hidden / heads)
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64),
}
#: Llama 3.1 / 3.2's ``rope_scaling`` block (3.2's factor).
LLAMA3_ROPE_SCALING: dict[str, Any] = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def _config(preset: str, quantized: bool, dtype: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": [151645, 151643], "hidden_act": "silu",
        "initializer_range": 0.02, "max_position_embeddings": 131072, "mlp_bias": False,
        "model_type": "llama", "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": dict(LLAMA3_ROPE_SCALING), "rope_theta": 500000.0, "tie_word_embeddings": True,
        "torch_dtype": dtype, "use_cache": True, "vocab_size": _VOCAB,
    }
    cfg.update(PRESETS[preset])
    if quantized:
        cfg["quantization"] = {"group_size": 64, "bits": 4}
        cfg["quantization_config"] = {"group_size": 64, "bits": 4}
    return cfg


def _dense_weights(cfg: Mapping[str, Any], rng: np.random.Generator,
                   progress: Callable[[Iterable[int]], Iterable[int]] = iter) -> dict[str, mx.array]:
    """float32 weights, std = gain / sqrt(fan_in) (the Qwen3 writer's gains); biases, when the
    config has them, std 0.1; norm weights around 1, the final one 4."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // nq
    w: dict[str, mx.array] = {
        "model.embed_tokens.weight": _normal(rng, (_VOCAB, h), 0.4 / np.sqrt(h)),
        "model.norm.weight": mx.full((h,), 4.0),
    }
    shapes = {
        "self_attn.q_proj": (nq * d, h), "self_attn.k_proj": (nkv * d, h),
        "self_attn.v_proj": (nkv * d, h), "self_attn.o_proj": (h, nq * d),
        "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h), "mlp.down_proj": (h, inter),
    }
    for i in progress(range(cfg["num_hidden_layers"])):
        p = f"model.layers.{i}"
        for name, shape in shapes.items():
            w[f"{p}.{name}.weight"] = _normal(rng, shape, _GAINS.get(name, 1.0) / np.sqrt(shape[1]))
            if cfg["attention_bias" if name.startswith("self_attn") else "mlp_bias"]:
                w[f"{p}.{name}.bias"] = _normal(rng, (shape[0],), 0.1)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            w[f"{p}.{norm}.weight"] = mx.array(1.0 + 0.1 * rng.standard_normal(h, dtype=np.float32))
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = _normal(rng, (_VOCAB, h), 0.4 / np.sqrt(h))
    return w


def write_checkpoint(path: str | Path, preset: str = "tiny", seed: int = 0, *,
                     quantized: bool = True, dtype: str = "bfloat16", shards: int = 1,
                     tie_word_embeddings: bool = True, attention_bias: bool = False, mlp_bias: bool = False,
                     rope_scaling: Mapping[str, Any] | str | None = "llama3",
                     config_overrides: Mapping[str, Any] | None = None,
                     progress: Callable[[Iterable[int]], Iterable[int]] = iter) -> Path:
    """Write a seeded random Llama checkpoint to ``path`` (created) and return it.

    ``preset``: a key of :data:`PRESETS`. ``quantized``: 4-bit affine, group size 64 (the
    mlx-community layout: every matrix, the embedding included; biases and norms dense);
    otherwise dense ``dtype`` weights and no quantization block. ``dtype``: "bfloat16" (as
    shipped) or "float32" (exact parity tests). ``attention_bias`` / ``mlp_bias``: random
    biases on q/k/v/o_proj / gate/up/down_proj. ``rope_scaling``: "llama3" (Llama 3.2's block,
    :data:`LLAMA3_ROPE_SCALING`), None (plain RoPE) or a block written as given.
    ``config_overrides``: config.json fields set last (``model_type``, ``rope_theta``, ...).
    ``shards`` > 1 splits the tensors and writes model.safetensors.index.json. Same arguments,
    same bytes. Raises ValueError for an unknown preset or dtype.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")
    if dtype not in ("bfloat16", "float32", "float16"):
        raise ValueError(f"unsupported dtype {dtype!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = _config(preset, quantized, dtype)
    cfg.update(tie_word_embeddings=tie_word_embeddings, attention_bias=attention_bias, mlp_bias=mlp_bias,
               rope_scaling=dict(LLAMA3_ROPE_SCALING) if rope_scaling == "llama3" else rope_scaling)
    cfg.update(config_overrides or {})
    weights = _dense_weights(cfg, np.random.default_rng(seed), progress)
    quant = cfg.get("quantization") if quantized else None
    _save(path, _finish(weights, quant, getattr(mx, dtype)), shards)
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    _copy_tokenizer(path)
    return path


def main(argv: list[str] | None = None) -> None:
    """CLI entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m mlx_serving.models.llama.checkpoint",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--unquantized", action="store_true", help="dense weights, no quantization block")
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--untied", action="store_true", help="a separate lm_head")
    ap.add_argument("--attention-bias", action="store_true")
    ap.add_argument("--mlp-bias", action="store_true")
    ap.add_argument("--rope-scaling", choices=["llama3", "none"], default="llama3")
    args = ap.parse_args(argv)
    out = write_checkpoint(args.dir, args.preset, args.seed, quantized=not args.unquantized, dtype=args.dtype,
                           shards=args.shards, tie_word_embeddings=not args.untied,
                           attention_bias=args.attention_bias, mlp_bias=args.mlp_bias,
                           rope_scaling=None if args.rope_scaling == "none" else "llama3")
    print(f"wrote {args.preset} Llama checkpoint (seed {args.seed}) to {out}")


if __name__ == "__main__":
    main()
