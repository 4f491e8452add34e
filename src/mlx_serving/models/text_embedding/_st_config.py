"""What a checkpoint directory says about embedding: the sentence-transformers files.

A directory whose ``modules.json`` lists a ``sentence_transformers.models.Pooling`` module with a
``config.json`` (``1_Pooling/config.json``, as the Qwen3-Embedding repos ship) is an embedding
model. Read here, each file contained in the directory and size-capped (the checkpoint is
untrusted, as for the loader): the pooling mode (``1_Pooling/config.json``), whether a
``Normalize`` module follows, the named prompts (``config_sentence_transformers.json``), the
context (``sentence_bert_config.json``'s ``max_seq_length``) and the special tokens the
tokenizer's post-processor puts around a text (``tokenizer.json``: Qwen3-Embedding appends
``<|endoftext|>``, whose hidden state last-token pooling reads).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ...serving._json import JSON, JSONObject
from .._checkpoint import checkpoint_file

__all__ = ["POOLINGS", "EmbeddingConfig", "Pooling", "is_embedding_model", "read_embedding_config"]

Pooling = Literal["last", "mean", "cls"]
#: 1_Pooling/config.json's flags -> the pooling they stand for.
POOLINGS: dict[str, Pooling] = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                                "pooling_mode_cls_token": "cls"}
_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_JSON_LIMIT = 1 << 20
_TOKENIZER_LIMIT = 64 << 20
_POOLING_TYPE = "sentence_transformers.models.Pooling"
_NORMALIZE_TYPE = "sentence_transformers.models.Normalize"


@dataclass(frozen=True)
class EmbeddingConfig:
    """A checkpoint's embedding settings. ``pooling``: from ``1_Pooling/config.json`` (None: no
    sentence-transformers files); ``normalize``: a ``Normalize`` module follows the pooling
    (None: not said); ``prompts``: named prefixes (``{"query": "Instruct: ...\\nQuery:"}``);
    ``max_seq_length``: tokens per input (None: not said); ``prefix`` / ``suffix``: token ids the
    tokenizer's post-processor puts before / after every text."""

    pooling: Pooling | None = None
    normalize: bool | None = None
    prompts: Mapping[str, str] = field(default_factory=dict)
    max_seq_length: int | None = None
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()


def _read(root: Path, name: str, limit: int = _JSON_LIMIT) -> JSON:
    """The JSON file ``name`` of ``root`` (None when absent); ValueError naming it when it leaves
    the directory, is too large or is not JSON."""
    path = checkpoint_file(root, name)
    if not path.exists():
        return None
    if not path.is_file() or path.stat().st_size > limit:
        raise ValueError(f"{path}: not a regular file of at most {limit:,} bytes")
    try:
        return json.loads(path.read_bytes()[: limit + 1].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None


def _modules(root: Path) -> list[JSONObject]:
    raw = _read(root, "modules.json")
    if raw is None:
        return []
    if not isinstance(raw, list) or not all(isinstance(m, dict) for m in raw):
        raise ValueError(f"{root / 'modules.json'}: must be a list of module objects")
    return [m for m in raw if isinstance(m, dict)]


def _pooling_dir(modules: list[JSONObject]) -> str | None:
    for m in modules:
        if m.get("type") == _POOLING_TYPE and isinstance(m.get("path"), str):
            return str(m["path"])
    return None


def is_embedding_model(path: str | Path) -> bool:
    """True when ``path`` ships sentence-transformers' ``modules.json`` with a Pooling module whose
    ``config.json`` exists (the Qwen3-Embedding layout). Raises ValueError for a malformed or
    escaping ``modules.json``."""
    root = Path(path)
    folder = _pooling_dir(_modules(root))
    return folder is not None and checkpoint_file(root, f"{folder}/config.json").is_file()


def _pooling(root: Path, folder: str) -> Pooling:
    where = f"{root / folder / 'config.json'}"
    raw = _read(root, f"{folder}/config.json")
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be a JSON object")
    bad = [k for k in _UNSUPPORTED if raw.get(k) is True]
    chosen = [mode for key, mode in POOLINGS.items() if raw.get(key) is True]
    if bad or len(chosen) != 1:
        raise ValueError(f"{where}: exactly one of {sorted(POOLINGS)} must be true (supported poolings: "
                         f"last, mean, cls); got {bad + [k for k in POOLINGS if raw.get(k) is True]}")
    return chosen[0]


def _prompts(root: Path) -> dict[str, str]:
    raw = _read(root, "config_sentence_transformers.json")
    prompts = raw.get("prompts") if isinstance(raw, dict) else None
    if prompts is None:
        return {}
    if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
        raise ValueError(f"{root / 'config_sentence_transformers.json'}: 'prompts' must map names to strings")
    return {k: str(v) for k, v in prompts.items()}


def _max_seq_length(root: Path) -> int | None:
    raw = _read(root, "sentence_bert_config.json")
    value = raw.get("max_seq_length") if isinstance(raw, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def read_embedding_config(path: str | Path) -> EmbeddingConfig:
    """The :class:`EmbeddingConfig` of checkpoint ``path`` (defaults where it ships no
    sentence-transformers files). Raises ValueError naming the file for a malformed one, a
    pooling other than last / mean / cls, or a file outside the directory."""
    root = Path(path)
    modules = _modules(root)
    folder = _pooling_dir(modules)
    prefix, suffix = special_tokens(root)
    if folder is None:
        return EmbeddingConfig(prefix=prefix, suffix=suffix)
    return EmbeddingConfig(pooling=_pooling(root, folder),
                           normalize=any(m.get("type") == _NORMALIZE_TYPE for m in modules),
                           prompts=_prompts(root), max_seq_length=_max_seq_length(root), prefix=prefix, suffix=suffix)


def special_tokens(root: Path) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(prefix, suffix)``: the ids ``tokenizer.json``'s post-processor adds around one text
    (``TemplateProcessing``'s ``single``, Bert/Roberta's ``cls`` / ``sep``, inside a ``Sequence``);
    ``((), ())`` when it adds none or there is no tokenizer.json."""
    raw = _read(root, "tokenizer.json", _TOKENIZER_LIMIT)
    post = raw.get("post_processor") if isinstance(raw, dict) else None
    return _around(post) if isinstance(post, dict) else ((), ())


def _around(post: JSONObject) -> tuple[tuple[int, ...], tuple[int, ...]]:
    kind = post.get("type")
    if kind == "Sequence":
        prefix: tuple[int, ...] = ()
        suffix: tuple[int, ...] = ()
        processors = post.get("processors")
        for p in processors if isinstance(processors, list) else []:
            if isinstance(p, dict):
                before, after = _around(p)
                prefix, suffix = prefix + before, suffix + after
        return prefix, suffix
    if kind in ("BertProcessing", "RobertaProcessing"):
        cls, sep = post.get("cls"), post.get("sep")
        return (_id(cls),), (_id(sep),)
    if kind == "TemplateProcessing":
        return _template(post)
    return (), ()


def _id(pair: JSON) -> int:
    if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int)):
        raise ValueError(f"tokenizer.json: post_processor token {pair!r:.80} is not [text, id]")
    return pair[1]


def _template(post: JSONObject) -> tuple[tuple[int, ...], tuple[int, ...]]:
    single, specials = post.get("single"), post.get("special_tokens")
    if not isinstance(single, list) or not isinstance(specials, dict):
        raise ValueError("tokenizer.json: a TemplateProcessing post_processor needs 'single' and 'special_tokens'")
    before: list[int] = []
    after: list[int] = []
    seen_text = False
    for piece in single:
        if isinstance(piece, dict) and "Sequence" in piece:
            seen_text = True
            continue
        token = piece.get("SpecialToken") if isinstance(piece, dict) else None
        name = token.get("id") if isinstance(token, dict) else None
        entry = specials.get(name) if isinstance(name, str) else None
        ids = entry.get("ids") if isinstance(entry, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError(f"tokenizer.json: post_processor special token {name!r:.80} has no ids")
        (after if seen_text else before).extend(i for i in ids if isinstance(i, int))
    return tuple(before), tuple(after)
