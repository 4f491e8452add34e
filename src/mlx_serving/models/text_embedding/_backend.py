"""``EmbeddingBackend``: the static backend, one compiled forward + pooling per batch.

Each batch holds rows of one bucket (its key): ``tokens`` ``(n, bucket)`` int32 and ``lengths``
``(n,)``. The rows are padded to the next power of two (at most ``batch_size``) so that MLX's
compiled function sees a few shapes per bucket (it traces once per new shape), run through the
model's :func:`models.decoder.layers.hidden_states` and pooled on the device; the caller gets ``(n, D)``
float32 numpy rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ...serving import Batch
from ...serving._backend import Mode
from ..decoder.layers import State, hidden_states
from ._options import Settings
from ._pooling import pool

__all__ = ["EmbeddingBackend", "padded_rows"]

Forward = Callable[[mx.array, mx.array], mx.array]


def padded_rows(n: int, batch_size: int, pad: bool) -> int:
    """Rows a batch of ``n`` runs as: the next power of two, at most ``max(batch_size, n)`` (``n``
    when ``pad`` is off)."""
    if not pad:
        return n
    p = 1
    while p < n:
        p *= 2
    return max(min(p, batch_size), n)


@dataclass(frozen=True)
class _Compiled:
    forward: Forward


class EmbeddingBackend:
    """The embedding forward over a loaded ``state`` with the resolved ``settings``."""

    def __init__(self, state: State, settings: Settings) -> None:
        self._state, self._settings = state, settings

    def init(self, mode: Mode, arg: object, partitions: int) -> _Compiled:
        """Build the compiled forward (on the executor thread: MLX streams are per thread)."""
        state, pooling = self._state, self._settings.pooling

        def forward(tokens: mx.array, lengths: mx.array) -> mx.array:
            return pool(hidden_states(state, tokens), lengths, pooling)

        return _Compiled(mx.compile(forward))

    def handle_batch(self, batch: Batch, partition: int, state: _Compiled) -> tuple[np.ndarray, dict[str, int]]:
        """``(vectors (rows, D) float32, {"bucket", "rows_run"})`` for the batch's rows."""
        data = batch.data
        tokens, lengths = data["tokens"], data["lengths"]
        n, bucket = tokens.shape
        run = padded_rows(n, self._settings.batch_size, self._settings.pad_batch)
        if run > n:
            tokens = np.concatenate([tokens, np.zeros((run - n, bucket), np.int32)])
            lengths = np.concatenate([lengths, np.zeros(run - n, np.int32)])
        out = state.forward(mx.array(tokens), mx.array(lengths))
        vectors = np.array(out)[:n]
        return vectors, {"bucket": int(bucket), "rows_run": int(run)}
