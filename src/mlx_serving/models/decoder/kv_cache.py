"""The paged KV cache's device side: one K and one V array per layer holding every block.

Each array is ``(num_blocks * block_size, kv_heads, head_dim)`` in the model's activation dtype:
block ``b`` is the rows ``b * block_size .. (b + 1) * block_size - 1``, so a token at position
``p`` of a sequence whose block table is ``t`` lives at row ``t[p // bs] * bs + p % bs``. A flat,
token-major layout makes both the write (one scatter of ``(B * T, Hkv, D)``) and the read (one
gather of ``(B, S)`` rows, then a transpose to ``(B, Hkv, S, D)``) single MLX ops. Block 0 is the
null block: padding tokens write there and padded block-table entries point there; it is never
attended and never handed to a sequence.

The budget (:func:`kv_budget`, :func:`plan_blocks`): ``kv_cache_bytes`` absolute, or
``kv_cache_fraction`` of the device's available memory (:mod:`.memory`: after the weights, split
among a pool's workers), or by default 1 GiB on the CPU (half the available memory on a GPU);
never more than every row at full length needs (``max_batch x ceil(max_len / block_size)``
blocks), and never past the budget: one that holds no sequence of ``max_len`` is refused. The pool
is allocated up front for that budget.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx
import numpy as np

from . import memory


__all__ = ["BLOCK_SIZE", "DEFAULT_CPU_BYTES", "ModelConfig", "ModelState", "PagedKVCache", "init_paged_kv_cache", "kv_budget",
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


def kv_budget(kv_cache_bytes: int | None = None, kv_cache_fraction: float | None = None) -> tuple[int, str]:
    """This process's KV budget in bytes and what set it, in words naming the option:
    ``kv_cache_bytes`` (the machine's, split among a ``ServingPool``'s workers), else
    ``kv_cache_fraction`` of :func:`.memory.available_memory` (already this process's share), else
    the default (half of that on a GPU, :data:`DEFAULT_CPU_BYTES` split among a pool's workers on
    the CPU). Raises ValueError for a fraction outside (0, 1], and for bytes the device cannot hold
    (GPUs: :func:`.memory.check_fits`)."""
    if kv_cache_fraction is not None and not 0 < kv_cache_fraction <= 1:
        raise ValueError(f"kv_cache_fraction must be in (0, 1], got {kv_cache_fraction!r}")
    share = memory.pool_share()
    if kv_cache_bytes is not None:
        mine = kv_cache_bytes // share  # the machine's budget, split among a pool's workers
        memory.check_fits(mine, f"kv_cache_bytes={kv_cache_bytes}", "kv_cache_bytes (--kv-cache-memory-bytes)")
        return mine, f"kv_cache_bytes={kv_cache_bytes}" + (f" split among {share} pool workers" if share > 1 else "")
    if kv_cache_fraction is not None:
        return int(memory.available_memory() * kv_cache_fraction), f"kv_cache_fraction={kv_cache_fraction}"
    if memory.device_limit() is not None:
        return memory.available_memory() // 2, "the default budget, half the device memory left"
    return DEFAULT_CPU_BYTES // share, "the default CPU budget"


def plan_blocks(state: ModelState, max_batch: int, max_len: int, kv_cache_bytes: int | None = None,
                kv_cache_fraction: float | None = None, block_size: int = BLOCK_SIZE, *,
                draft: ModelState | None = None) -> int:
    """Usable KV blocks (the null block not counted) for the budget (:func:`kv_budget`): as many
    as it holds, never more than every row at full length needs. With a speculative ``draft``
    model, whose pool has as many blocks, a block's bytes are the target's plus the draft's (the
    budget holds both pools). Never past the budget: raises ValueError, naming the options to
    change, when it holds no sequence of ``max_len`` (``max_len + 1`` tokens, the slot design's
    bound), or as :func:`kv_budget`."""
    per_token = kv_bytes_per_token(state) + (kv_bytes_per_token(draft) if draft is not None else 0)
    budget, source = kv_budget(kv_cache_bytes, kv_cache_fraction)
    one_seq = -(-max_len // block_size)  # blocks of one sequence of max_len (whole blocks)
    blocks = min(budget // (per_token * block_size), max_batch * one_seq)  # never more than every row needs
    need = per_token * (max_len + 1)
    if budget < need or blocks < one_seq:
        raise ValueError(f"{source} holds no sequence of max_len={max_len} ({need} bytes each, {budget} in the "
                         "budget): lower max_len (--max-len) or raise kv_cache_bytes (--kv-cache-memory-bytes) "
                         "or kv_cache_fraction (--kv-cache-fraction)")
    return blocks


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
