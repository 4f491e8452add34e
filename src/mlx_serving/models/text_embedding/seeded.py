"""Seeded random embedding checkpoints: a seeded decoder checkpoint plus the sentence-transformers
files of the Qwen3-Embedding repos (for tests, docs and benchmarks; meaningless vectors)."""

from __future__ import annotations

import json
from pathlib import Path

from ...serving._json import JSONObject
from ._st_config import POOLINGS, Pooling

__all__ = ["QUERY_PROMPT", "write_embedding_checkpoint"]

#: Qwen3-Embedding's ``query`` prompt (its config_sentence_transformers.json).
QUERY_PROMPT = "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:"
_EOS = "<|endoftext|>"


def write_embedding_checkpoint(path: str | Path, preset: str = "tiny", seed: int = 0, *, family: str = "qwen3",
                               pooling: Pooling = "last", normalize: bool = True, quantized: bool = True,
                               dtype: str = "bfloat16", max_seq_length: int = 8192,
                               config_overrides: JSONObject | None = None) -> Path:
    """Write ``write_checkpoint(path, preset, seed, family=..., quantized=..., dtype=...)`` and
    Qwen3-Embedding's sentence-transformers files: ``modules.json`` (Transformer, Pooling, and
    Normalize when ``normalize``), ``1_Pooling/config.json`` (``pooling``),
    ``config_sentence_transformers.json`` (the ``query`` / ``document`` prompts),
    ``sentence_bert_config.json`` (``max_seq_length``), and a tokenizer whose post-processor
    appends ``<|endoftext|>`` to every text (as Qwen3-Embedding's does) with left padding.
    Returns ``path``. Raises ValueError for an unknown family, preset, dtype or pooling."""
    if pooling not in POOLINGS.values():
        raise ValueError(f"pooling must be one of {sorted(POOLINGS.values())}, got {pooling!r}")
    # imported here, not at the top: `python -m mlx_serving.models.seeded_checkpoint` must find the
    # module unimported when the package loads (runpy warns otherwise)
    from ..seeded_checkpoint import write_checkpoint

    path = write_checkpoint(path, preset, seed, family=family, quantized=quantized, dtype=dtype,
                            config_overrides=config_overrides)
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "2_Normalize").mkdir(exist_ok=True)
    (path / "modules.json").write_text(json.dumps(modules, indent=2))
    (path / "1_Pooling").mkdir(exist_ok=True)
    flags = {key: mode == pooling for key, mode in POOLINGS.items()}
    pool = {"word_embedding_dimension": hidden, **flags, "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
            "include_prompt": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pool, indent=2))
    prompts = {"prompts": {"query": QUERY_PROMPT, "document": ""}, "default_prompt_name": None,
               "similarity_fn_name": "cosine"}
    (path / "config_sentence_transformers.json").write_text(json.dumps(prompts, indent=2))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length,
                                                                "do_lower_case": False}))
    _append_eos(path)
    return path


def _append_eos(path: Path) -> None:
    """Qwen3-Embedding's tokenizer: ``<|endoftext|>`` after every text, padding on the left."""
    tok = json.loads((path / "tokenizer.json").read_text("utf-8"))
    eos = next(t["id"] for t in tok["added_tokens"] if t["content"] == _EOS)
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": _EOS, "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": _EOS, "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}, {"SpecialToken": {"id": _EOS, "type_id": 1}}],
        "special_tokens": {_EOS: {"id": _EOS, "ids": [eos], "tokens": [_EOS]}},
    }
    (path / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), "utf-8")
    config = json.loads((path / "tokenizer_config.json").read_text("utf-8"))
    config["padding_side"] = "left"
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), "utf-8")
