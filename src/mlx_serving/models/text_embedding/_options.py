"""``EmbeddingOptions``: the serving's settings, checked once when it is built."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ._st_config import POOLINGS, EmbeddingConfig, Pooling

__all__ = ["DEFAULT_INSTRUCTION_TEMPLATE", "PRODUCTS", "EmbeddingOptions", "Settings", "default_buckets", "settings"]

#: Qwen3-Embedding's query format (its model card's ``get_detailed_instruct``).
DEFAULT_INSTRUCTION_TEMPLATE = "Instruct: {instruction}\nQuery:"
_SMALLEST_BUCKET = 16
#: The forwards a serving may run (``products``): "native", the packed forward with the native int8
#: GEMM (:mod:`._packed`); "matmul", the exact float forward over padded rows.
PRODUCTS = ("native", "matmul")


def default_buckets(max_len: int) -> tuple[int, ...]:
    """Powers of two from 16 below ``max_len``, then ``max_len``: ``(16, 32, 64, ..., max_len)``."""
    out, n = [], _SMALLEST_BUCKET
    while n < max_len:
        out.append(n)
        n *= 2
    return (*out, max_len)


@dataclass(frozen=True)
class EmbeddingOptions:
    """Settings of a text-embedding serving.

    ``pooling``: "last" (the hidden state of each input's last token: Qwen3-Embedding), "mean"
    (the mean over its tokens) or "cls" (its first token); None takes the checkpoint's
    ``1_Pooling/config.json``, else "mean". ``normalize``: L2-normalize each vector (after the
    ``dimensions`` truncation); None takes the checkpoint's (a ``Normalize`` module), else True.
    ``max_len``: most tokens per input, special tokens and instruction included (None: the
    checkpoint's ``max_seq_length``, else 512, capped by ``max_position_embeddings``).
    ``buckets``: the padded sequence lengths, ascending, the last = ``max_len`` (None:
    :func:`default_buckets`); each is a batch key. ``batch_size``: most inputs per forward;
    ``batch_timeout``: seconds a started serving waits to fill a batch (Nx.Serving's).
    ``instruction_template``: how a request's ``instruction`` prefixes its text (``{instruction}``
    is replaced). ``pad_batch``: pad each batch's rows to the next power of two (at most
    ``batch_size``), so a bucket compiles a few shapes, not one per row count (the "matmul"
    forward only). ``products``: "native" (a batch's texts packed into one sequence of their real
    tokens, the quantized products on the native int8 GEMM: the CPU device with float32
    activations only), "matmul" (the exact float forward over padded rows, compiled) or None
    ("native" where it applies, else "matmul"): :mod:`._products`.
    Raises ValueError naming the field for a value out of range.
    """

    pooling: Pooling | None = None
    normalize: bool | None = None
    max_len: int | None = None
    buckets: tuple[int, ...] | None = None
    batch_size: int = 32
    batch_timeout: float = 0.01
    instruction_template: str = DEFAULT_INSTRUCTION_TEMPLATE
    pad_batch: bool = True
    products: str | None = None

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLINGS.values():
            raise ValueError(f"pooling must be 'last', 'mean', 'cls' or None, got {self.pooling!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a bool or None, got {self.normalize!r}")
        if self.max_len is not None and not _positive_int(self.max_len):
            raise ValueError(f"max_len must be an int >= 1, got {self.max_len!r}")
        if not _positive_int(self.batch_size):
            raise ValueError(f"batch_size must be an int >= 1, got {self.batch_size!r}")
        if isinstance(self.batch_timeout, bool) or not isinstance(self.batch_timeout, (int, float)) \
                or not 0 <= self.batch_timeout < float("inf"):
            raise ValueError(f"batch_timeout must be a finite number of seconds >= 0, got {self.batch_timeout!r}")
        if self.products is not None and self.products not in PRODUCTS:
            raise ValueError(f"products must be one of {list(PRODUCTS)} or None, got {self.products!r:.80}")
        if "{instruction}" not in self.instruction_template:
            raise ValueError("instruction_template must contain '{instruction}'")
        if self.buckets is not None:
            _check_buckets(tuple(self.buckets), self.max_len)
            object.__setattr__(self, "buckets", tuple(self.buckets))


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_buckets(buckets: tuple[int, ...], max_len: int | None) -> None:
    if not buckets or not all(_positive_int(b) for b in buckets) or list(buckets) != sorted(set(buckets)):
        raise ValueError(f"buckets must be ascending distinct ints >= 1, got {buckets!r}")
    if max_len is not None and buckets[-1] != max_len:
        raise ValueError(f"the last bucket must be max_len ({max_len}), got {buckets[-1]}")


@dataclass(frozen=True)
class Settings:
    """The options resolved against the checkpoint: what preprocessing and the backend use.
    ``dims``: the model's hidden size (the full vector length); ``vocab_size``: rows of its embedding
    table (token ids must be below it); ``prefix`` / ``suffix``: token ids
    put around every text; ``prompts``: the checkpoint's named prompts."""

    pooling: Pooling
    normalize: bool
    max_len: int
    buckets: tuple[int, ...]
    batch_size: int
    pad_batch: bool
    dims: int
    vocab_size: int
    instruction_template: str
    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    prompts: Mapping[str, str] = field(default_factory=dict)


_FALLBACK_MAX_LEN = 512


def settings(opts: EmbeddingOptions, config: EmbeddingConfig, hidden_size: int, vocab_size: int,
             max_positions: int) -> Settings:
    """``opts`` with every None filled from the checkpoint's ``config`` (then the defaults).
    Raises ValueError when ``max_len`` exceeds ``max_positions`` or holds no text besides the
    special tokens."""
    max_len = opts.max_len or min(config.max_seq_length or _FALLBACK_MAX_LEN, max_positions)
    if max_len > max_positions:
        raise ValueError(f"max_len ({max_len}) exceeds the model's max_position_embeddings ({max_positions})")
    if max_len <= len(config.prefix) + len(config.suffix):
        raise ValueError(f"max_len ({max_len}) leaves no room for text after the special tokens")
    buckets = opts.buckets or default_buckets(max_len)
    _check_buckets(buckets, max_len)
    normalize = opts.normalize if opts.normalize is not None else config.normalize is not False
    return Settings(pooling=opts.pooling or config.pooling or "mean", normalize=normalize, max_len=max_len,
                    buckets=buckets, batch_size=opts.batch_size, pad_batch=opts.pad_batch, dims=hidden_size,
                    vocab_size=vocab_size,
                    instruction_template=opts.instruction_template, prefix=config.prefix, suffix=config.suffix,
                    prompts=dict(config.prompts))
