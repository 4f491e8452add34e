"""Preallocated KV cache: one K and one V buffer per layer, written in place.

Each buffer is ``(slots, num_key_value_heads, max_len + 1, head_dim)`` in the model's
activation dtype. Position ``max_len`` is a scratch column: padded tokens of a ragged
batch write there, and attention never reads it. A slot's valid prefix length lives in
``lengths`` (host side); positions at or past it are never read, so a slot is reused
without clearing.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .protocol import ModelState as State

__all__ = ["KVCache", "budget_slots", "init_kv_cache", "kv_bytes_per_token"]


@dataclass
class KVCache:
    """Per-layer ``keys``/``values`` buffers plus per-slot valid ``lengths`` (int64,
    tokens). ``max_len`` is the usable positions per slot."""

    keys: list[mx.array]
    values: list[mx.array]
    lengths: np.ndarray
    max_len: int

    @property
    def slots(self) -> int:
        """Number of sequences the cache holds at once."""
        return int(self.lengths.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


def kv_bytes_per_token(state: State) -> int:
    """Bytes of K and V one token occupies across all layers."""
    c = state.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * state.dtype.size


def budget_slots(state: State, max_len: int, kv_cache_bytes: int) -> int:
    """How many sequences of ``max_len`` tokens (plus the scratch column) fit in
    ``kv_cache_bytes`` bytes of K/V. Raises ValueError when not even one fits."""
    per_seq = kv_bytes_per_token(state) * (max_len + 1)
    if kv_cache_bytes < per_seq:
        raise ValueError(f"kv_cache_bytes={kv_cache_bytes} holds no sequence of max_len={max_len} "
                         f"({per_seq} bytes each)")
    return kv_cache_bytes // per_seq


def init_kv_cache(state: State, max_len: int, batch: int = 1) -> KVCache:
    """Allocate (zero-filled, evaluated) a cache of ``batch`` slots x ``max_len`` tokens.

    Raises ValueError when ``max_len`` or ``batch`` is below 1.
    """
    if max_len < 1 or batch < 1:
        raise ValueError(f"init_kv_cache needs max_len >= 1 and batch >= 1, got {max_len} and {batch}")
    c = state.config
    shape = (batch, c.num_key_value_heads, max_len + 1, c.head_dim)
    keys = [mx.zeros(shape, dtype=state.dtype) for _ in range(c.num_hidden_layers)]
    values = [mx.zeros(shape, dtype=state.dtype) for _ in range(c.num_hidden_layers)]
    mx.eval(keys + values)
    return KVCache(keys, values, np.zeros(batch, dtype=np.int64), max_len)
