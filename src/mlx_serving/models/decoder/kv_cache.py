"""The paged KV cache's device side: one K and one V array per layer holding every block.

Each array is ``(num_blocks * block_size, kv_heads, head_dim)`` in the model's activation dtype:
block ``b`` is the rows ``b * block_size .. (b + 1) * block_size - 1``, so a token at position
``p`` of a sequence whose block table is ``t`` lives at row ``t[p // bs] * bs + p % bs``. A flat,
token-major layout makes both the write (one scatter of ``(B * T, Hkv, D)``) and the read (one
gather of ``(B, S)`` rows, then a transpose to ``(B, Hkv, S, D)``) single MLX ops. Block 0 is the
null block: padding tokens write there and padded block-table entries point there; it is never
attended and never handed to a sequence.

The budget (:func:`plan_blocks`): ``kv_cache_bytes`` absolute, or ``kv_cache_fraction`` of the
device's available memory, or by default 1 GiB on the CPU (half the available memory on a GPU);
never more than every row at full length needs (``max_batch x ceil(max_len / block_size)``
blocks) and never less
than one sequence of ``max_len``. The pool is allocated up front for that budget.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np


__all__ = ["BLOCK_SIZE", "DEFAULT_CPU_BYTES", "ModelConfig", "ModelState", "PagedKVCache", "available_memory", "init_paged_kv_cache",
           "kv_bytes_per_token", "plan_blocks", "row_blocks"]


class ModelConfig(Protocol):
    """The dimensions the KV cache and the sampler are sized by, and the model's EOS ids
    (read-only: a family's config is a frozen dataclass)."""

    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...


class ModelState(Protocol):
    """A loaded model: its config and its activation (KV) dtype (read-only)."""

    @property
    def config(self) -> ModelConfig: ...
    @property
    def dtype(self) -> mx.Dtype: ...

log = logging.getLogger("mlx_serving")

#: Tokens per KV block.
BLOCK_SIZE = 16
#: Default KV budget on the CPU.
DEFAULT_CPU_BYTES = 1 << 30


@dataclass
class PagedKVCache:
    """Per-layer ``keys``/``values`` arrays of ``num_blocks * block_size`` token rows."""

    keys: list[mx.array]
    values: list[mx.array]
    block_size: int

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block 0 included."""
        return int(self.keys[0].shape[0]) // self.block_size if self.keys else 0

    @property
    def nbytes(self) -> int:
        """Bytes held by all arrays."""
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


def row_blocks(rows: int, max_len: int, block_size: int = BLOCK_SIZE) -> np.ndarray:
    """A fixed block table ``(rows, ceil(max_len / block_size))`` int32 giving row ``b`` the blocks
    ``1 + b * W .. (b + 1) * W`` (block 0 is the null block): the layout of forwards run without a
    scheduler (tests, benchmarks) over a cache of ``rows * W`` usable blocks."""
    width = -(-max_len // block_size)
    return 1 + np.arange(rows * width, dtype=np.int32).reshape(rows, width)


def kv_bytes_per_token(state: ModelState) -> int:
    """Bytes of K and V one token occupies across all layers."""
    c = state.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * state.dtype.size


def available_memory() -> int:
    """Bytes the default device can still use: on a GPU its memory size (MLX's
    ``device_info``) less MLX's active memory; on the CPU the available physical memory."""
    if mx.default_device() == mx.gpu:
        info = mx.device_info() if hasattr(mx, "device_info") else {}
        total = int(info.get("max_recommended_working_set_size") or info.get("memory_size") or 0)
        if total:
            return max(0, total - mx.get_active_memory())
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return DEFAULT_CPU_BYTES


def plan_blocks(state: ModelState, max_batch: int, max_len: int, kv_cache_bytes: int | None = None,
                kv_cache_fraction: float | None = None, block_size: int = BLOCK_SIZE) -> int:
    """Usable KV blocks (the null block not counted) for the budget described in the module
    docstring. Raises ValueError for a budget that holds no sequence of ``max_len`` (the same
    bound as the slot design: ``(max_len + 1)`` tokens) or a fraction outside (0, 1]."""
    per_token = kv_bytes_per_token(state)
    if kv_cache_fraction is not None and not 0 < kv_cache_fraction <= 1:
        raise ValueError(f"kv_cache_fraction must be in (0, 1], got {kv_cache_fraction!r}")
    if kv_cache_bytes is not None:
        budget = kv_cache_bytes
        if kv_cache_bytes < per_token * (max_len + 1):
            raise ValueError(f"kv_cache_bytes={kv_cache_bytes} holds no sequence of max_len={max_len} "
                             f"({per_token * (max_len + 1)} bytes each)")
    elif kv_cache_fraction is not None:
        budget = int(available_memory() * kv_cache_fraction)
    elif mx.default_device() == mx.gpu:
        budget = available_memory() // 2
    else:
        budget = DEFAULT_CPU_BYTES
    one_seq = -(-max_len // block_size)  # blocks of one sequence of max_len (whole blocks)
    blocks = min(budget // (per_token * block_size), max_batch * one_seq)  # never more than every row needs
    return max(blocks, one_seq)


def init_paged_kv_cache(state: ModelState, num_blocks: int, block_size: int = BLOCK_SIZE) -> PagedKVCache:
    """Allocate (zero-filled, evaluated) ``num_blocks`` usable blocks plus the null block, and
    log what was reserved."""
    c = state.config
    rows = (num_blocks + 1) * block_size
    shape = (rows, c.num_key_value_heads, c.head_dim)
    keys = [mx.zeros(shape, dtype=state.dtype) for _ in range(c.num_hidden_layers)]
    values = [mx.zeros(shape, dtype=state.dtype) for _ in range(c.num_hidden_layers)]
    mx.eval(keys + values)
    cache = PagedKVCache(keys, values, block_size)
    log.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %s) reserved", num_blocks, block_size,
             num_blocks * block_size, cache.nbytes / 2**20, state.dtype)
    return cache
