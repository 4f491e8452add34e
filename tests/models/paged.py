"""A paged KV cache for tests that call the shared decoder's ``forward`` directly: ``batch`` rows of
``max_len`` positions, row b holding its own blocks (:func:`row_blocks`: no scheduler)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_serving.models.decoder.attention import Rows
from mlx_serving.models.decoder.kv_cache import PagedKVCache, init_paged_kv_cache, row_blocks
from mlx_serving.models.decoder.layers import State


@dataclass
class Fresh:
    """``cache`` and the fixed ``table`` (batch, W) int32 of its rows' blocks."""

    cache: PagedKVCache
    table: np.ndarray

    def rows(self, tokens: mx.array, start: mx.array, n_valid: mx.array, kv_len: int, last: mx.array,
             dense: bool = False) -> Rows:
        """:class:`Rows` over rows ``0..B-1`` of this cache."""
        return Rows(tokens, start, n_valid, kv_len, last, mx.array(self.table[: tokens.shape[0]]), dense=dense)


def fresh(state: State, max_len: int, batch: int = 1) -> Fresh:
    """A zeroed paged cache of ``batch`` rows x ``max_len`` positions (16-token blocks)."""
    table = row_blocks(batch, max_len)
    return Fresh(init_paged_kv_cache(state, table.size), table)
