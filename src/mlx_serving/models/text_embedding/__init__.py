"""Text embedding as a Serving (Bumblebee's ``text_embedding`` over Nx.Serving): Qwen3-Embedding
(last-token pooling, L2 normalization, instructions for queries, Matryoshka ``dimensions``) and
mean pooling for the other decoders (Qwen2, Llama), over the static batcher.

Input (one request): a string, a dict (``text`` or ``input_ids``, with optional ``instruction``,
``prompt_name``, ``dimensions``, ``truncate``: :func:`._inputs.preprocess`), or a non-empty list of
those. Output for one input: ``{"embedding": numpy (dimensions,) float32, "num_tokens": int}``; a
list input returns a list of those, in order. Batching is Nx's: every request is padded to the
smallest sequence-length bucket that fits its longest input, each bucket is a batch key (its own
queue and timer), and a batch runs when ``batch_size`` rows of one bucket wait or
``batch_timeout`` passed. docs/embeddings.md.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import numpy as np

from ...serving import Serving
from ...tokenization import Tokenizer
from ..decoder.layers import State
from ..text_generation._inputs import max_bytes_per_token, needs_thread
from ._backend import EmbeddingBackend
from ._gguf import gguf_pooling
from ._inputs import EmbeddingInput, RequestInfo, preprocess
from ._options import DEFAULT_INSTRUCTION_TEMPLATE, EmbeddingOptions, Settings, default_buckets, settings
from ._pooling import finish
from ._products import native_state
from ._st_config import EmbeddingConfig, is_embedding_model, read_embedding_config
from .seeded import write_embedding_checkpoint

__all__ = ["DEFAULT_INSTRUCTION_TEMPLATE", "EmbeddingConfig", "EmbeddingOptions", "Settings", "default_buckets",
           "from_mlx4bit", "from_pretrained", "gguf_pooling", "is_embedding_model", "read_embedding_config", "serving",
           "settings_for",
           "write_embedding_checkpoint"]

Embedding = dict[str, object]


def serving(tokenizer: Tokenizer, state: State, config: EmbeddingConfig | None = None,
            **options: object) -> Serving:
    """A text-embedding Serving over a loaded model ``state`` (any family ``models.loader.load``
    reads).

    ``config``: the checkpoint's sentence-transformers settings (None: read from ``state.path``
    when it has one, else none). ``options``: the fields of :class:`EmbeddingOptions` (pooling,
    normalize, max_len, buckets, batch_size=32, batch_timeout=0.01, instruction_template,
    pad_batch=True, products=None: the packed forward on the native int8 GEMM where it applies;
    "matmul": the exact float forward). ``Serving.start`` defaults to ``batch_size``, ``batch_timeout`` and one batch
    key per bucket. Outputs are float32 vectors of the model's hidden size (or ``dimensions``).
    Raises ValueError for a bad option, TypeError for an unknown one; bad inputs raise
    InvalidInput in the caller only.
    """
    _check_option_names(options)
    opts = EmbeddingOptions(**options)  # type: ignore[arg-type]  # checked by the dataclass
    if config is None:
        config = read_embedding_config(state.path) if state.path is not None else EmbeddingConfig()
    c = state.config
    s = settings(opts, config, c.hidden_size, c.vocab_size, c.max_position_embeddings)
    per_token = max_bytes_per_token(tokenizer)

    def pre(input: EmbeddingInput) -> tuple:
        return preprocess(input, tokenizer, s, per_token)

    return (
        Serving.new(EmbeddingBackend(state, s, native_state(state, opts.products)))
        .client_preprocessing(pre, offload=needs_thread)
        .client_postprocessing(_postprocess)
        .batch_size(s.batch_size)
        .process_options(batch_timeout=opts.batch_timeout, batch_keys=s.buckets)
    )


def from_mlx4bit(path: str | Path, tokenizer: Tokenizer | None = None, **options: object) -> Serving:
    """Load a checkpoint directory (MLX 4-bit or dense) and return :func:`serving` over it, with its
    sentence-transformers settings (``modules.json``, ``1_Pooling/config.json``, ...) when it ships
    them. Raises FileNotFoundError naming a missing file, ValueError for an unsupported
    checkpoint or option."""
    from ..loader import load

    _check_option_names(options)
    state = load(path)
    return serving(tokenizer or Tokenizer.from_dir(path), state, read_embedding_config(path), **options)


def settings_for(path: str | Path, **options: object) -> Settings:
    """The :class:`Settings` :func:`from_mlx4bit` would serve checkpoint ``path`` with (pooling,
    normalize, max_len, buckets, ...), read from its config files without loading the weights.
    Raises what :func:`from_mlx4bit` raises for the config and the options."""
    from ..families import read_config

    _check_option_names(options)
    opts = EmbeddingOptions(**options)  # type: ignore[arg-type]  # checked by the dataclass
    c = read_config(path)
    return settings(opts, read_embedding_config(path), c.hidden_size, c.vocab_size, c.max_position_embeddings)


def from_pretrained(model: str | Path | None = None, tokenizer: Tokenizer | None = None,
                    **options: object) -> Serving:
    """:func:`from_mlx4bit` over any model source (``models.sources.resolve``: a directory, a
    ``.gguf`` file, a Hugging Face repo id, ``seeded:<family>-<preset>``, ...). A GGUF file's
    ``<arch>.pooling_type`` (llama.cpp's: a Qwen3-Embedding GGUF says "last") is the default
    ``pooling``. Raises what ``resolve`` and :func:`from_mlx4bit` raise."""
    from ..sources import resolve

    pooling = gguf_pooling(model)
    if pooling is not None and options.get("pooling") is None:
        options = {**options, "pooling": pooling}
    return from_mlx4bit(resolve(model).path, tokenizer, **options)


def _check_option_names(options: dict[str, object]) -> None:
    known = {f.name for f in fields(EmbeddingOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown text-embedding options {unknown} (known: {sorted(known)})")


def _postprocess(result: tuple[np.ndarray, object], info: RequestInfo) -> Embedding | list[Embedding]:
    vectors = result[0]
    out: list[Embedding] = [
        {"embedding": finish(vectors[i], info.dimensions[i], info.normalize), "num_tokens": info.num_tokens[i]}
        for i in range(len(info.num_tokens))
    ]
    return out if info.is_list else out[0]
