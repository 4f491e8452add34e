"""The seam between a model family's forward pass and the KV cache (model-agnostic).

A family's ``forward(state, cache, rows)`` takes a :class:`Rows` (which KV blocks the call covers
and where each row's tokens go), builds the per-forward values once with :func:`make_step`, and
calls :func:`attend` in every layer with its normed and rotated q/k and v: ``attend`` writes the new
K/V into the paged cache through the block table and runs masked GQA attention over each row's valid
prefix. :func:`compiled_decode` is the ``mx.compile``d one-token decode. The model runner
(:mod:`.model_runner`) builds ``Rows``; the shared decoder
(:mod:`models.decoder.layers`, which every family in ``models/families`` runs) only calls this seam.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

import mlx.core as mx
import numpy as np

from ..native import PagedAttention, StoringAttention
from .kv_cache import PagedKVCache


__all__ = ["Cache", "DecodeBackend", "Rows", "Step", "attend", "last_hidden", "make_step", "packing", "token_ids"]

#: The KV cache :func:`attend` reads and writes.
Cache = PagedKVCache


StateT = TypeVar("StateT", contravariant=True)  # the loaded model a backend decodes (models.decoder.layers.State)


class DecodeBackend(Protocol[StateT]):
    """How one-token decode rows attend (read-only attributes); the backends are in
    :mod:`.decode_backends`."""

    @property
    def name(self) -> str:
        """"fused", "matmul" or "sdpa"."""

    @property
    def sdpa(self) -> bool:
        """One-token masked rows through ``mx.fast.scaled_dot_product_attention`` (the generic path)."""

    @property
    def reads_own_length(self) -> bool:
        """Each row reads its own length: a compiled decode spans ``max_len``, one graph per row count."""

    @property
    def verifies_as_rows(self) -> bool:
        """A speculative verify row of k + 1 tokens runs as k + 1 one-token rows through
        :meth:`decode` (sharing its block table, at consecutive positions: each attends to the
        K/V the earlier ones wrote in the same layer), so a verified position's logits are bit for
        bit a plain decode step's; else it runs in the multi-token forward."""

    def decode(self, state: StateT, cache: PagedKVCache, rows: Rows, h: mx.array) -> mx.array | None:
        """Logits ``(B, vocab)`` of one-token rows from their embeddings ``h`` ``(B, hidden)``, the
        K/V written in place; None: run the shared decoder's generic path."""


@dataclass
class Rows:
    """Which KV blocks a forward call covers, and where each row's tokens go.

    ``tokens`` (B, T) int32; ``start`` (B,) int32 position of each row's first token (its cache
    length before the call); ``n_valid`` (B,) int32 real tokens per row (the rest is
    padding: written to the null block, never attended); ``kv_len`` the attention
    span (at least the max over rows of start + n_valid; callers may round it up; unused with
    ``causal_groups``, where each group's span is its start + T); ``last`` (B,) int32 index in ``[0, T)`` of
    the token whose logits each row returns (unless ``gather`` is set); ``dense`` True when B == 1 and the row has
    no padding (then no mask array is built: ``"causal"`` at T > 1, none at T == 1).
    ``block_table`` (B, W) int32 (:class:`~models.decoder.kv_cache.PagedKVCache`): the KV blocks
    of each row in order (W >= ceil(kv_len / block_size); unused entries and padding rows 0, the
    null block).

    Packed (ragged) prefill: ``packed`` (N,) int32, the flat index in ``B * T`` of each real
    token in row-major order, then index 0 up to N (the bucket's padding); ``unpacked``
    (B * T,) int32, the index in ``packed`` of each padded position (0 for padding). With
    them set a family runs embeddings, projections and MLP on the N packed tokens only and
    lays them out as ``(B, T)`` just for attention (:meth:`Step.unpack` / :meth:`Step.pack`);
    padding costs attention work only. :func:`packing` builds both.

    ``causal_groups``: ``(lo, hi, start)`` ranges of rows, in order, covering
    every real row, whose rows all start at ``start`` (padding rows: n_valid 0, any start; padding
    rows after the last group attend to nothing: their output is zero). Each group
    then attends with the ``"causal"`` mask over ``start + T`` gathered positions instead of a
    boolean mask over ``kv_len``: exact for every real token (query ``j`` sees positions
    ``<= start + j``; positions past a row's end are seen only by its padding queries), and on
    MLX's CUDA build ~9x cheaper (bench/gpu_prefill.py: 1.8 vs 16.1 ms at 256 x 512 queries
    over 1,024 keys: the boolean mask becomes an additive bias cuDNN reads per head).

    ``gather``: (M,) int32 flat indices into the padded ``B * T`` token layout whose logits the
    forward returns, in that order, instead of one per row at ``last`` (a speculative verify span
    needs every position's).
    """

    tokens: mx.array
    start: mx.array
    n_valid: mx.array
    kv_len: int
    last: mx.array
    block_table: mx.array
    dense: bool = False
    packed: mx.array | None = None
    unpacked: mx.array | None = None
    causal_groups: tuple[tuple[int, int, int], ...] | None = None
    gather: mx.array | None = None


def packing(n_valid: np.ndarray, t: int, n: int | None = None) -> tuple[mx.array, mx.array]:
    """The ``(packed, unpacked)`` indices of :class:`Rows` for rows of ``n_valid`` (B,) real
    tokens each, padded to ``t`` per row, packed into ``n`` (default: the real token count;
    must be at least that) positions. Raises ValueError when ``n`` is too small."""
    real = int(n_valid.sum())
    n = real if n is None else n
    if n < real:
        raise ValueError(f"packing: n={n} < {real} real tokens")
    packed = np.zeros(n, dtype=np.int32)
    packed[:real] = np.concatenate([np.arange(i * t, i * t + k, dtype=np.int32) for i, k in enumerate(n_valid)])
    unpacked = np.zeros(len(n_valid) * t, dtype=np.int32)
    unpacked[packed[:real]] = np.arange(real, dtype=np.int32)
    return mx.array(packed), mx.array(unpacked)


def token_ids(rows: Rows) -> mx.array:
    """The token ids a family embeds: ``(N,)`` packed, else ``(B * T,)``."""
    ids = rows.tokens.reshape(-1)
    return ids if rows.packed is None else ids[rows.packed]


def last_hidden(h: mx.array, rows: Rows) -> mx.array:
    """Hidden states ``(B, F)`` at each row's ``rows.last`` token (``(M, F)`` at ``rows.gather``
    when set), from the layers' output ``h`` (``(N, F)`` packed, ``(B * T, F)`` padded)."""
    b, t = rows.tokens.shape
    if rows.gather is not None:
        return h[rows.gather if rows.unpacked is None else rows.unpacked[rows.gather]]
    if rows.unpacked is not None:  # packed (``packed`` and ``unpacked`` are set together)
        return h[mx.take_along_axis(rows.unpacked.reshape(b, t), rows.last[:, None], axis=1)[:, 0]]
    if t == 1:
        return h
    return mx.take_along_axis(h.reshape(b, t, -1), rows.last[:, None, None], axis=1)[:, 0]


def _mask(rows: Rows, t: int) -> mx.array | str | None:
    if rows.dense:
        return "causal" if t > 1 else None
    j = mx.arange(rows.kv_len)
    qpos = rows.start[:, None] + mx.arange(t)[None, :]
    end = (rows.start + rows.n_valid)[:, None, None]
    mask = (j <= qpos[:, :, None]) & (j < end)
    return (mask | (j == 0))[:, None]  # key 0 always open: no fully masked row


def _decode_attention(q: mx.array, keys: mx.array, values: mx.array, scale: float,
                      mask: mx.array) -> mx.array:
    """One query per row, ``q`` (B, H, 1, D) over ``keys``/``values`` (B, Hkv, S, D) with a
    boolean ``mask`` (B, 1, 1, S): plain batched matmuls with the query heads of one KV
    head as the matrix rows (no K/V broadcast or copy). MLX's CUDA build routes a masked
    one-token ``scaled_dot_product_attention`` to cuDNN or its composite fallback, which
    builds a new graph per (B, S) shape; this path costs one cuBLAS plan per shape.
    """
    b, h, _, d = q.shape
    hkv = keys.shape[1]
    scores = (q * scale).reshape(b, hkv, h // hkv, d) @ keys.swapaxes(-1, -2)
    scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    probs = mx.softmax(scores, axis=-1, precise=True)
    return (probs @ values).reshape(b, h, 1, d)


def _sdpa(q: mx.array, keys: mx.array, values: mx.array, scale: float,
          mask: mx.array | str | None, sdpa_decode: bool = False) -> mx.array:
    """Attention ``(B, H, T, D)``; masked one-token rows go through :func:`_decode_attention`
    unless ``sdpa_decode`` (then ``mx.fast.scaled_dot_product_attention`` with the mask)."""
    if q.shape[2] == 1 and isinstance(mask, mx.array) and not sdpa_decode:
        return _decode_attention(q, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)


@dataclass
class Step:
    """Per-forward values shared by every layer (built once, not once per layer)."""

    rows: Rows
    pos: mx.array  # (B, T) cache position of each token
    write_idx: mx.array  # (B * T,) flat cache row of each token (0: padding, the null block)
    mask: mx.array | str | None = None
    sdpa_decode: bool = False  # one-token masked rows through mx.fast SDPA instead of the matmuls
    read_idx: mx.array | None = None  # (B, kv_len) flat cache row of each attended position
    groups: list[tuple[int, int, mx.array]] | None = None  # causal groups: (lo, hi, read_idx (hi-lo, start+T))
    kernel: PagedAttention | None = None  # the native CPU attention reads the block table itself
    storing: StoringAttention | None = None  # the kernel when it stores the new K/V itself (the native prefill's)

    def unpack(self, x: mx.array) -> mx.array:
        """Packed ``(N, F)`` activations laid out as ``(B * T, F)`` (identity when not packed)."""
        return x if self.rows.unpacked is None else x[self.rows.unpacked]

    def pack(self, x: mx.array) -> mx.array:
        """``(B * T, F)`` activations back to the packed ``(N, F)`` (identity when not packed)."""
        return x if self.rows.packed is None else x[self.rows.packed]


def make_step(rows: Rows, cache: Cache, *, sdpa_decode: bool = False, kernel: PagedAttention | None = None) -> Step:
    """The per-forward values every layer's :func:`attend` shares.
    ``sdpa_decode``: one-token masked rows attend through ``mx.fast.scaled_dot_product_attention``
    (the "sdpa" decode path) instead of :func:`_decode_attention` ("matmul"). ``kernel``: on a
    paged cache, every row attends through this native CPU attention
    (:func:`models.native.paged_attention_cpu`), which reads the block table itself: no mask, no
    gathered K/V, prefill and decode one computation (the model state's ``attention``); a
    :class:`~models.native.StoringAttention` (the native prefill's) also stores the new K/V.

    The block table becomes flat write and read indices once per forward, not per layer."""
    t = rows.tokens.shape[1]
    bs, table = cache.block_size, rows.block_table
    offs = mx.arange(t)[None, :]
    pos = rows.start[:, None] + offs
    blk = mx.take_along_axis(table, mx.minimum(pos // bs, table.shape[1] - 1), axis=1)
    write = mx.where(offs < rows.n_valid[:, None], blk * bs + pos % bs, 0)  # padding: null block
    step = Step(rows=rows, pos=pos, write_idx=write.reshape(-1), sdpa_decode=sdpa_decode, kernel=kernel,
                storing=kernel if isinstance(kernel, StoringAttention) else None)
    if kernel is not None:
        return step
    if rows.causal_groups is not None:
        step.groups = [(lo, hi, _read_idx(table[lo:hi], start + t, bs)) for lo, hi, start in rows.causal_groups]
    else:
        step.mask, step.read_idx = _mask(rows, t), _read_idx(table, rows.kv_len, bs)
    return step


def _read_idx(table: mx.array, span: int, bs: int) -> mx.array:
    """``(rows, span)`` flat cache row of positions ``0..span-1`` through the block table
    ``(rows, W)``, which must cover the span (``W * bs >= span``: every caller builds it so)."""
    j = mx.arange(span)
    return table[:, j // bs] * bs + (j % bs)[None, :]


def attend(cache: Cache, i: int, q: mx.array, k: mx.array, v: mx.array, step: Step) -> mx.array:
    """Attention of layer ``i`` over the KV cache: the seam between a model family and the
    cache. ``q`` (B, H, T, D) and ``k`` (B, Hkv, T, D) already normed and rotated, ``v``
    (B, T, Hkv, D); writes this call's K/V into the cache, attends over each row's valid
    prefix (GQA) and returns ``(B * T, H * D)`` ready for the output projection.

    K/V are written at each token's flat block position (:func:`make_step`; rotated and quantized
    first in a quantized cache, :meth:`~.kv_cache.PagedKVCache.write`, whose queries and output
    are rotated to match) and each row's blocks
    are gathered into ``(B, Hkv, kv_len, D)`` before a masked attention, or per causal group
    (``Rows.causal_groups``) into ``(rows, Hkv, start + T, D)`` with the ``"causal"`` mask; with
    ``step.kernel`` the native CPU attention reads them (quantized or not) through the block table
    instead; with ``step.storing`` it also writes them (and rotates a quantized cache's queries and
    output) itself: one primitive per layer, no MLX operation on the cache."""
    rows = step.rows
    b, h, t, d = q.shape
    hkv = k.shape[1]
    k, v = k.transpose(0, 2, 1, 3).reshape(b * t, hkv, d), v.reshape(b * t, hkv, d)
    if step.storing is not None:
        return _native_storing(step.storing, cache, i, q, k, v, step).reshape(b * t, h * d)
    cache.write(i, k, v, step.write_idx)
    q = cache.rotate(q)  # a quantized cache's basis (identity for a float cache), rotated back below
    if step.kernel is not None:
        return cache.rotate(_native(step.kernel, cache, i, q, rows)).reshape(b * t, h * d)
    if step.groups is not None:
        outs = [mx.fast.scaled_dot_product_attention(q[lo:hi], *_gather(cache, i, read, q.dtype), scale=d**-0.5,
                                                     mask="causal") for lo, hi, read in step.groups]
        covered = step.groups[-1][1]
        if covered < b:  # trailing padding rows outside every group
            outs.append(mx.zeros((b - covered, h, t, d), dtype=q.dtype))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs)
    elif step.read_idx is not None:  # make_step sets it whenever there are no groups
        out = _sdpa(q, *_gather(cache, i, step.read_idx, q.dtype), d**-0.5, step.mask, step.sdpa_decode)
    else:
        raise RuntimeError("attend: a step with neither causal groups nor read indices")
    return cache.rotate(out).transpose(0, 2, 1, 3).reshape(b * t, h * d)


def _gather(cache: Cache, i: int, read: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """:meth:`~.kv_cache.PagedKVCache.gather` in the activation ``dtype`` (a 16-bit cache widened)."""
    k, v = cache.gather(i, read)
    return (k, v) if k.dtype == dtype else (k.astype(dtype), v.astype(dtype))


def _native_storing(kernel: StoringAttention, cache: Cache, i: int, q: mx.array, k: mx.array, v: mx.array,
                    step: Step) -> mx.array:
    """Layer ``i``'s new K/V ``(B * T, Hkv, D)`` stored at ``step.write_idx`` and the native CPU attention
    over the float or quantized cache, one primitive: ``(B, T, H, D)``; the layer's cache arrays
    replaced by the primitive's (written in place)."""
    rows, c = step.rows, cache.quant
    parts = [cache.keys, cache.values]
    if c is not None:
        parts += [cache.key_scales, cache.key_biases, cache.value_scales, cache.value_biases]
    y, *arrays = kernel.store_and_attend(q, k, v, step.write_idx, [p[i] for p in parts], rows.block_table, rows.start,
                                         rows.n_valid, q.shape[-1] ** -0.5, cache.block_size,
                                         0 if c is None else c.group_size, 0 if c is None else c.bits)
    for part, a in zip(parts, arrays, strict=True):
        part[i] = a
    return y


def _native(kernel: PagedAttention, cache: Cache, i: int, q: mx.array, rows: Rows) -> mx.array:
    """The native CPU attention of layer ``i`` over the float or quantized cache: ``(B, T, H, D)``."""
    args = (q, cache.keys[i], cache.values[i], rows.block_table, rows.start, rows.n_valid, q.shape[-1] ** -0.5,
            cache.block_size)
    c = cache.quant
    if c is None:
        return kernel(*args)
    return kernel(*args, k_scales=cache.key_scales[i], k_biases=cache.key_biases[i], v_scales=cache.value_scales[i],
                  v_biases=cache.value_biases[i], group_size=c.group_size, bits=c.bits)
