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

16-bit blocks (``kv_cache_dtype`` "float16" / "bfloat16", llama.cpp's default f16 cache, vLLM's names):
the same layout in that dtype (half a float32 cache's bytes); a write rounds the activations to it
(round to nearest even) and attention reads them widened to the activation dtype (exact).

Quantized blocks (``kv_cache_dtype`` "int8" / "int4", :class:`KVQuant`): each K and V array holds
MLX's affine ``mx.quantize`` layout along ``head_dim``, ``(rows, kv_heads, head_dim * bits / 32)``
uint32, beside per-group ``scales`` and ``biases`` ``(rows, kv_heads, head_dim / group_size)`` in the
activation dtype, of each head vector rotated first by the orthonormal Hadamard transform
(``mx.hadamard_transform``, QuaRot's rotation, Ashkboos et al. 2024: it spreads the few outlier
channels of the keys over all of them, so one scale fits the vector; int4 perplexity on SmolLM2
went from +25.7% to +9.5% of the float cache's, docs/benchmarks.md). int8 takes ``mx.quantize``'s scale and
bias; int4 fits each group's by least squares (:func:`.kv_quantizer.fit_int4`, same layout, +6.6%).
The group is one head vector (``group_size
= head_dim``, or the largest of 128/64/32 dividing it): one scale and bias per token per head, so a
token's stored K/V depend on that vector alone (batched == solo and prefix hit == miss hold as in
the float cache), and the
scales cost ``4 / head_dim`` bytes per value at a 16-bit activation dtype (head_dim 64: int8 stores
68 bytes per head vector against 128, 1.88x; int4 36, 3.56x; head_dim 128: 1.94x and 3.76x; at
float32 activations, the CPU's, twice those). A token is quantized when it is written
(:meth:`PagedKVCache.write`) and dequantized when attention reads it (:meth:`PagedKVCache.gather`,
or the native CPU attention reading the quantized rows itself).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import mlx.core as mx
import numpy as np

from . import memory
from .kv_quantizer import fit_int4


__all__ = ["BLOCK_SIZE", "DEFAULT_CPU_BYTES", "KV_CACHE_DTYPES", "KVQuant", "ModelConfig", "ModelState", "PagedKVCache",
           "KV_FLOAT_DTYPES", "init_paged_kv_cache", "kv_budget", "kv_bytes_per_token", "kv_float_dtype", "kv_quant",
           "plan_blocks", "row_blocks"]


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
#: The KV cache dtypes by name and their bits: "auto" is the activation dtype, "float32" / "float16" /
#: "bfloat16" a float cache of that dtype (None: not quantized).
KV_CACHE_DTYPES: dict[str, int | None] = {"auto": None, "float32": None, "float16": None, "bfloat16": None, "int8": 8,
                                          "int4": 4}
#: The float cache dtypes named explicitly (whatever the activation dtype).
KV_FLOAT_DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass(frozen=True)
class KVQuant:
    """How quantized blocks are stored: affine ``bits`` (4 or 8) per value, one scale and bias per
    ``group_size`` values along ``head_dim``."""

    bits: int
    group_size: int


def kv_quant(kv_cache_dtype: str, head_dim: int) -> KVQuant | None:
    """The storage of ``kv_cache_dtype`` (:data:`KV_CACHE_DTYPES`) for heads of ``head_dim``: None
    for "auto"; the group is the head vector (the largest of 128, 64, 32 dividing ``head_dim``).
    Raises ValueError naming ``kv_cache_dtype`` for an unknown name or a ``head_dim`` no group
    divides."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    bits = KV_CACHE_DTYPES[kv_cache_dtype]
    if bits is None:
        return None
    group = next((g for g in (128, 64, 32) if head_dim % g == 0), None)
    if group is None:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a head_dim divisible by 32, got {head_dim}")
    return KVQuant(bits, group)


def kv_float_dtype(kv_cache_dtype: str, activation: mx.Dtype) -> mx.Dtype:
    """The dtype a float cache's blocks hold: :data:`KV_FLOAT_DTYPES`' for a name there, else
    ``activation`` (a quantized cache's scales and biases are in it too)."""
    return KV_FLOAT_DTYPES.get(kv_cache_dtype, activation)


@dataclass
class PagedKVCache:
    """Per-layer ``keys``/``values`` arrays of ``num_blocks * block_size`` token rows: float
    ``(rows, Hkv, D)`` in the activation dtype or a 16-bit one (:func:`kv_float_dtype`), or with ``quant`` set, packed ``(rows, Hkv, D * bits
    / 32)`` uint32 with per-layer ``key_scales`` / ``key_biases`` / ``value_scales`` /
    ``value_biases`` ``(rows, Hkv, D / group_size)`` (empty lists for a float cache)."""

    keys: list[mx.array]
    values: list[mx.array]
    block_size: int
    quant: KVQuant | None = None
    key_scales: list[mx.array] = field(default_factory=list)
    key_biases: list[mx.array] = field(default_factory=list)
    value_scales: list[mx.array] = field(default_factory=list)
    value_biases: list[mx.array] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block 0 included."""
        return int(self.keys[0].shape[0]) // self.block_size if self.keys else 0

    @property
    def nbytes(self) -> int:
        """Bytes held by all arrays."""
        return sum(a.nbytes for a in self.arrays())

    def _lists(self) -> tuple[list[mx.array], ...]:
        return (self.keys, self.values, self.key_scales, self.key_biases, self.value_scales, self.value_biases)

    def arrays(self) -> list[mx.array]:
        """Every array, in a fixed order (keys, values, then the quantized cache's scales and
        biases): what a compiled step takes and returns (:meth:`set_arrays`)."""
        return [a for part in self._lists() for a in part]

    def set_arrays(self, arrays: list[mx.array]) -> None:
        """Replace the arrays in place by ``arrays``, as :meth:`arrays` orders them."""
        parts = self._lists() if self.quant is not None else self._lists()[:2]
        n = len(arrays) // len(parts)
        for j, part in enumerate(parts):
            part[:] = arrays[j * n: (j + 1) * n]

    def write(self, i: int, k: mx.array, v: mx.array, rows: mx.array) -> None:
        """Write layer ``i``'s new keys and values ``(N, Hkv, D)`` at the flat cache ``rows`` ``(N,)``
        int32; a quantized cache stores them rotated (:meth:`rotate`) and quantized (int8:
        ``mx.quantize``; int4: :func:`.kv_quantizer.fit_int4`)."""
        q = self.quant
        if q is None:
            self.keys[i][rows], self.values[i][rows] = k, v
            return
        for x, data, scales, biases in ((k, self.keys, self.key_scales, self.key_biases),
                                        (v, self.values, self.value_scales, self.value_biases)):
            r = mx.hadamard_transform(x)
            w, s, b = (fit_int4(r, q.group_size, scales[i].dtype) if q.bits == 4 else
                       mx.quantize(r, group_size=q.group_size, bits=q.bits))
            data[i][rows], scales[i][rows], biases[i][rows] = w, s, b

    def rotate(self, x: mx.array) -> mx.array:
        """``x`` ``(..., D)`` in the basis the cache stores K and V in: the orthonormal Hadamard
        transform along ``D`` for a quantized cache (its own inverse), ``x`` itself for a float one.
        Attention over a quantized cache rotates its queries in and its output back out:
        ``(Hq) . (Hk) = q . k`` and ``H sum p (Hv) = sum p v``."""
        return x if self.quant is None else mx.hadamard_transform(x)

    def gather(self, i: int, read: mx.array) -> tuple[mx.array, mx.array]:
        """Layer ``i``'s keys and values at the flat rows ``read`` ``(R, S)``: ``(R, Hkv, S, D)``
        each in the stored dtype (a float cache's) or the activation dtype (dequantized, in the
        rotated basis, for a quantized cache)."""
        q = self.quant
        if q is None:
            return self.keys[i][read].transpose(0, 2, 1, 3), self.values[i][read].transpose(0, 2, 1, 3)
        k = mx.dequantize(self.keys[i][read], self.key_scales[i][read], self.key_biases[i][read],
                          group_size=q.group_size, bits=q.bits)
        v = mx.dequantize(self.values[i][read], self.value_scales[i][read], self.value_biases[i][read],
                          group_size=q.group_size, bits=q.bits)
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def cleared(self) -> PagedKVCache:
        """This cache's layout with no arrays (a closed runner's)."""
        return PagedKVCache([], [], self.block_size, self.quant)


def row_blocks(rows: int, max_len: int, block_size: int = BLOCK_SIZE) -> np.ndarray:
    """A fixed block table ``(rows, ceil(max_len / block_size))`` int32 giving row ``b`` the blocks
    ``1 + b * W .. (b + 1) * W`` (block 0 is the null block): the layout of forwards run without a
    scheduler (tests, benchmarks) over a cache of ``rows * W`` usable blocks."""
    width = -(-max_len // block_size)
    return 1 + np.arange(rows * width, dtype=np.int32).reshape(rows, width)


def kv_bytes_per_token(state: ModelState, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V one token occupies across all layers in a ``kv_cache_dtype`` cache (a
    quantized one's scales and biases included). Raises ValueError as :func:`kv_quant`."""
    c = state.config
    q = kv_quant(kv_cache_dtype, c.head_dim)
    per_head = c.head_dim * kv_float_dtype(kv_cache_dtype, state.dtype).size if q is None else (
        c.head_dim * q.bits // 8 + 2 * (c.head_dim // q.group_size) * state.dtype.size)
    return 2 * c.num_hidden_layers * c.num_key_value_heads * per_head


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
                kv_cache_fraction: float | None = None, block_size: int = BLOCK_SIZE,
                kv_cache_dtype: str = "auto", *, draft: ModelState | None = None) -> int:
    """Usable KV blocks (the null block not counted) for the budget (:func:`kv_budget`) at the bytes
    of a ``kv_cache_dtype`` block (:func:`kv_bytes_per_token`): as many as it holds, never more than
    every row at full length needs. With a speculative ``draft`` model, whose pool has as many
    blocks (a float cache), a block's bytes are the target's plus the draft's (the budget holds both
    pools). Never past the budget: raises ValueError, naming the options to change, when it holds
    no sequence of ``max_len`` (``max_len + 1`` tokens, the slot design's bound), or as
    :func:`kv_budget` and :func:`kv_quant`."""
    per_token = kv_bytes_per_token(state, kv_cache_dtype) + (kv_bytes_per_token(draft) if draft is not None else 0)
    budget, source = kv_budget(kv_cache_bytes, kv_cache_fraction)
    one_seq = -(-max_len // block_size)  # blocks of one sequence of max_len (whole blocks)
    blocks = min(budget // (per_token * block_size), max_batch * one_seq)  # never more than every row needs
    need = per_token * (max_len + 1)
    if budget < need or blocks < one_seq:
        raise ValueError(f"{source} holds no sequence of max_len={max_len} ({need} bytes each, {budget} in the "
                         "budget): lower max_len (--max-len) or raise kv_cache_bytes (--kv-cache-memory-bytes) "
                         "or kv_cache_fraction (--kv-cache-fraction)")
    return blocks


def init_paged_kv_cache(state: ModelState, num_blocks: int, block_size: int = BLOCK_SIZE,
                        kv_cache_dtype: str = "auto") -> PagedKVCache:
    """Allocate (zero-filled, evaluated) ``num_blocks`` usable blocks plus the null block of a
    ``kv_cache_dtype`` cache (:data:`KV_CACHE_DTYPES`), and log what was reserved. Raises
    ValueError as :func:`kv_quant`."""
    c = state.config
    rows, hkv, d, n = (num_blocks + 1) * block_size, c.num_key_value_heads, c.head_dim, c.num_hidden_layers
    q = kv_quant(kv_cache_dtype, d)

    def zeros(width: int, dtype: mx.Dtype) -> list[mx.array]:
        return [mx.zeros((rows, hkv, width), dtype=dtype) for _ in range(n)]

    if q is None:
        dtype = kv_float_dtype(kv_cache_dtype, state.dtype)
        cache = PagedKVCache(zeros(d, dtype), zeros(d, dtype), block_size)
    else:
        packed, groups = d * q.bits // 32, d // q.group_size
        cache = PagedKVCache(zeros(packed, mx.uint32), zeros(packed, mx.uint32), block_size, q,
                             *(zeros(groups, state.dtype) for _ in range(4)))
    mx.eval(cache.arrays())
    log.info("KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB, %s) reserved", num_blocks, block_size,
             num_blocks * block_size, cache.nbytes / 2**20, cache.keys[0].dtype if q is None else kv_cache_dtype)
    return cache
