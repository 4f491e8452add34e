"""The native prefill (issue 39): the shared decoder's prefill forward with int8-activation products.

On the "native" decode path a prefill (and every forward of more than one token per row) runs the
shared decoder's generic forward (:func:`models.decoder.layers.forward`: norms and RoPE stay MLX
operations) over :func:`prefill_state`, the model whose quantized projections and head are
computed by the native int8 GEMM (``prefill.cpp`` / ``qgemm.cpp``) over the decode step's own
matrices, packed once when the decoder was made (``pack.h``): each row's activations quantized to
int8 per block of 32 and multiplied with integer products against the 4- or 8-bit weights as they
lie (AVX-512 VNNI, AVX2 or a portable loop, picked at run time), on a pool of threads kept alive
across calls. Each layer's MLP is :class:`NativeMlp` (``Layer.mlp``): the gate/up product, then one
primitive that computes the SwiGLU row by row as the decode step does and quantizes it for the down
product (``int8_swiglu_matmul``), instead of MLX's split, sigmoid and multiplies over strided views.
The native paged attention runs on the same pool (its ``threads`` argument), not on OpenMP's threads,
and stores each layer's new K/V itself (:class:`PoolAttention`): the decode step's store
(``kv_store.cpp``), so a quantized cache's rotation and rounding run natively in one pass, its
queries rotated and its output rotated back inside the attention, with no MLX operation between.

Numerics: each product is bit for bit the decode step's for the same row, so a row's result never
depends on its batchmates or its place among the rows (batched == solo, prefix hit == miss); it
differs from the exact float path ("matmul") as the decode step does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from ..._weights import Linear
from ..layers import Layer, State

__all__ = ["RELEASED", "NativeMlp", "PackedEmbedding", "PackedLayer", "PoolAttention", "packed_matrix", "prefill_state"]


@dataclass(frozen=True)
class PackedLayer:
    """One layer's packed matrices (the native module's ``QMatrix``): fused q/k/v, o, fused
    gate/up, down."""

    qkv: Any
    o: Any
    gate_up: Any
    down: Any


#: What a swapped Linear holds in place of MLX's arrays (weight, scales, biases): an empty array,
#: never read (its product is the packed matrix's).
RELEASED = mx.zeros((0,), mx.uint8)


@dataclass(frozen=True)
class _Packed:
    """A Linear's product through its packed matrix (the Linear's own arrays are not read)."""

    module: Any
    matrix: Any
    threads: int

    def __call__(self, x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                 bits: int) -> mx.array:
        return self.module.int8_packed_matmul(self.matrix, x, self.threads)


@dataclass(frozen=True)
class NativeMlp:
    """A layer's gated MLP on the native path: ``gate_up`` (the merged gate/up Linear, its product
    the int8 GEMM) then ``down`` (the packed down matrix, which adds its bias) fed by ``module``'s
    ``int8_swiglu_matmul`` on a pool of ``threads``. Call with normed ``x`` ``(N, hidden)`` float32
    -> ``(N, hidden)`` float32."""

    gate_up: Linear
    down: Any
    module: Any
    threads: int

    def __call__(self, x: mx.array) -> mx.array:
        return self.module.int8_swiglu_matmul(self.down, self.gate_up(x), self.threads)


@dataclass(frozen=True)
class PoolAttention:
    """The native paged attention (``module.paged_attention``, :class:`models.native.PagedAttention`)
    on the prefill's pool of ``threads``, which also stores the new K/V itself
    (:meth:`store_and_attend`, :class:`models.native.StoringAttention`). The same bits as on
    OpenMP's threads."""

    module: Any
    threads: int

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, block_table: mx.array, start: mx.array,
                 n_valid: mx.array, scale: float, block_size: int, *, k_scales: mx.array | None = None,
                 k_biases: mx.array | None = None, v_scales: mx.array | None = None,
                 v_biases: mx.array | None = None, group_size: int = 0, bits: int = 0,
                 threads: int = 0) -> mx.array:
        """:class:`models.native.PagedAttention` on this pool (``threads`` is ignored: the pool's)."""
        return self.module.paged_attention(q, k, v, block_table, start, n_valid, scale, block_size, k_scales, k_biases,
                                           v_scales, v_biases, group_size, bits, self.threads)

    def store_and_attend(self, q: mx.array, new_k: mx.array, new_v: mx.array, rows: mx.array, cache: list[mx.array],
                         block_table: mx.array, start: mx.array, n_valid: mx.array, scale: float, block_size: int,
                         group_size: int = 0, bits: int = 0) -> list[mx.array]:
        """:meth:`models.native.StoringAttention.store_and_attend` on this pool."""
        k, v, *quant = cache
        ks, kb, vs, vb = quant or (None, None, None, None)
        return list(self.module.paged_attention_store(q, new_k, new_v, rows, k, v, block_table, start, n_valid, scale,
                                                      block_size, ks, kb, vs, vb, group_size, bits, self.threads))


class PackedEmbedding(Linear):
    """A tied head on the native path: its product the int8 GEMM over its packed matrix (``kernel``,
    as every swapped Linear) and its embedding lookup (:meth:`rows`) the packed matrix's rows,
    dequantized by the native module's ``packed_rows`` (``embed_rows.cpp``: bit for bit MLX's
    dequantized rows of the table it was packed from), so that MLX's table is not kept either
    (:data:`RELEASED` in its arrays): the process holds the tied table once."""

    def rows(self, ids: mx.array) -> mx.array:
        """Embedding lookup: rows ``ids`` (any integer shape) -> ``ids.shape + (hidden,)`` float32."""
        assert isinstance(self.kernel, _Packed)  # prefill_state makes it with its packed matrix
        return self.kernel.module.packed_rows(self.kernel.matrix, ids)


def packed_matrix(m: Linear) -> Any:
    """The packed matrix (the native module's ``QMatrix``) that computes ``m`` when ``m`` is a
    Linear :func:`prefill_state` swapped; else None."""
    return m.kernel.matrix if isinstance(m.kernel, _Packed) else None


def prefill_state(state: State, module: Any, threads: int, layers: list[PackedLayer], head: Any) -> State:
    """``state`` with each projection and the head computed by ``module``'s int8 GEMM over
    ``layers``' / ``head``'s packed matrices (the decode step's, one per fused q/k/v, o, fused
    gate/up, down and head: every one of ``state``'s is quantized as :func:`.native_decode`
    checks) on a pool of ``threads``, each layer's MLP a :class:`NativeMlp`, and the native
    attention (``state.attention``, when set: a :class:`PoolAttention`) on the same pool instead of
    OpenMP's, storing the new K/V itself. The packed
    matrix adds the Linear's bias (the same float32 addition), so the swapped Linear has none, and
    it does not keep MLX's arrays either (:data:`RELEASED` in their place: the packed copy is the
    only one this model holds). A tied head becomes a :class:`PackedEmbedding`, whose lookup reads
    the packed matrix too (a tied embedding stays tied: one object, MLX's table not kept). A Linear
    already swapped (``state`` is a model this made) keeps its packed matrix: :func:`packed_matrix`."""

    def swap(m: Linear, matrix: Any) -> Linear:
        kernel = _Packed(module, matrix, threads)  # the packed matrix adds the bias: the Linear has none
        tied = m is state.embed_tokens  # a tied head: the embedding lookup reads the packed rows
        return (PackedEmbedding if tied else Linear)(RELEASED, RELEASED, RELEASED, m.spec, kernel=kernel)

    def layer(ly: Layer, p: PackedLayer) -> Layer:
        gate_up = ly.gate_up.map(lambda m: swap(m, p.gate_up))
        assert gate_up.merged is not None  # native_decode takes only merged gate/up
        return replace(ly, qkv=ly.qkv.map(lambda m: swap(m, p.qkv)), o_proj=swap(ly.o_proj, p.o),
                       gate_up=gate_up, down_proj=swap(ly.down_proj, p.down),
                       mlp=NativeMlp(gate_up.merged, p.down, module, threads))

    lm_head = swap(state.lm_head, head)
    embed = lm_head if state.embed_tokens is state.lm_head else state.embed_tokens
    attention = None if state.attention is None else PoolAttention(module, threads)
    return replace(state, layers=[layer(ly, p) for ly, p in zip(state.layers, layers, strict=True)],
                   lm_head=lm_head, embed_tokens=embed, attention=attention)
