"""``EmbeddingBackend``: the static backend, one forward + pooling per batch.

Each batch holds rows of one bucket (its key): ``tokens`` ``(n, bucket)`` int32 and ``lengths``
``(n,)``. On the "native" products (:mod:`._products`) the rows' real tokens are packed into one
sequence and run through :func:`._packed.packed_embeddings` (no padding computed, no compilation).
On "matmul" the rows are padded to the next power of two (at most ``batch_size``) so that MLX's
compiled function sees a few shapes per bucket (it traces once per new shape), run through the
model's :func:`models.decoder.layers.hidden_states` and pooled on the device. Either way the caller
gets ``(n, D)`` float32 numpy rows.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ...serving import Batch
from ...serving._backend import Mode
from ..decoder.layers import State, hidden_states
from ._options import Settings
from ._packed import packed_embeddings
from ._pooling import pool

__all__ = ["EmbeddingBackend", "padded_rows"]

#: ``(tokens (n, bucket) int32, lengths (n,) int32) -> ((n, D) float32, rows run)``.
Forward = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, int]]


def padded_rows(n: int, batch_size: int, pad: bool) -> int:
    """Rows a batch of ``n`` runs as: the next power of two, at most ``max(batch_size, n)`` (``n``
    when ``pad`` is off)."""
    if not pad:
        return n
    p = 1
    while p < n:
        p *= 2
    return max(min(p, batch_size), n)


class EmbeddingBackend:
    """The embedding forward over a loaded ``state`` with the resolved ``settings``; ``packed``:
    the model the packed forward runs (:func:`._products.native_state`), None for the exact one."""

    def __init__(self, state: State, settings: Settings, packed: State | None = None) -> None:
        self._state, self._settings, self._packed = state, settings, packed

    def init(self, mode: Mode, arg: object, partitions: int) -> Forward:
        """Build the forward (on the executor thread: MLX streams are per thread)."""
        return self._packed_forward(self._packed) if self._packed is not None else self._padded_forward()

    def handle_batch(self, batch: Batch, partition: int, state: Forward) -> tuple[np.ndarray, dict[str, int]]:
        """``(vectors (rows, D) float32, {"bucket", "rows_run"})`` for the batch's rows."""
        tokens, lengths = batch.data["tokens"], batch.data["lengths"]
        vectors, run = state(tokens, lengths)
        return vectors, {"bucket": int(tokens.shape[1]), "rows_run": run}

    def _packed_forward(self, packed: State) -> Forward:
        pooling = self._settings.pooling

        def forward(tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, int]:
            ids = np.concatenate([row[:n] for row, n in zip(tokens, lengths)])
            out = packed_embeddings(packed, mx.array(ids.astype(np.int32)), lengths.tolist(), pooling)
            return np.array(out), len(lengths)

        return forward

    def _padded_forward(self) -> Forward:
        state, s = self._state, self._settings

        def run(tokens: mx.array, lengths: mx.array) -> mx.array:
            return pool(hidden_states(state, tokens), lengths, s.pooling)

        compiled = mx.compile(run)

        def forward(tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, int]:
            n, bucket = tokens.shape
            rows = padded_rows(n, s.batch_size, s.pad_batch)
            if rows > n:
                tokens = np.concatenate([tokens, np.zeros((rows - n, bucket), np.int32)])
                lengths = np.concatenate([lengths, np.zeros(rows - n, np.int32)])
            return np.array(compiled(mx.array(tokens), mx.array(lengths)))[:n], rows

        return forward
