"""The native prefill (issue 39): the shared decoder's prefill forward with int8-activation products.

On the "native" decode path a prefill (and every forward of more than one token per row) runs the
shared decoder's generic forward (:func:`models.decoder.layers.forward`: norms and RoPE stay MLX
operations) over :func:`prefill_state`, the model whose quantized projections and head are
computed by the native int8 GEMM (``prefill.cpp`` / ``qgemm.cpp``): each row's activations
quantized to int8 per block of 32 and multiplied with integer products against the 4- or 8-bit
weights, each weight panel unpacked once and reused across the rows (AVX-512 VNNI, AVX2 or a
portable loop, picked at run time), on a pool of threads kept alive across calls (a call of fewer
than 4 rows, the head's one row, is the decode step's product over column ranges). Each layer's MLP
is :class:`NativeMlp` (``Layer.mlp``): the gate/up product, then one primitive that computes the
SwiGLU row by row as the decode step does and quantizes it for the down product
(``int8_swiglu_matmul``), instead of MLX's split, sigmoid and multiplies over strided views. The
native paged attention runs on the same pool (its ``threads`` argument), not on OpenMP's threads.

Numerics: each product is bit for bit the decode step's (``qdot.cpp``) for the same row, so a
row's result never depends on its batchmates or its place among the rows (batched == solo,
prefix hit == miss); it differs from the exact float path ("matmul") as the decode step does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import mlx.core as mx

from ..._weights import Fused, Linear
from ..layers import Layer, State

__all__ = ["NativeMlp", "prefill_state"]


@dataclass(frozen=True)
class NativeMlp:
    """A layer's gated MLP on the native path: ``gate_up`` (the merged gate/up matrix, its product
    already the int8 GEMM) then ``down`` fed by ``module``'s ``int8_swiglu_matmul`` on a pool of
    ``threads``. Call with normed ``x`` ``(N, hidden)`` float32 -> ``(N, hidden)`` float32."""

    gate_up: Linear
    down: Linear
    module: Any
    threads: int

    def __call__(self, x: mx.array) -> mx.array:
        d = self.down
        if d.scales is None or d.biases is None or d.spec is None:
            raise ValueError("NativeMlp: down must be an affine quantized matrix (scales, biases and spec)")
        y = self.module.int8_swiglu_matmul(self.gate_up(x), d.weight, d.scales, d.biases, d.spec.group_size,
                                           d.spec.bits, self.threads)
        return y if d.bias is None else y + d.bias


def prefill_state(state: State, module: Any, threads: int) -> State:
    """``state`` with each projection and the head computed by ``module``'s int8 GEMM on a pool of
    ``threads`` (the weights are the same arrays, not copies; a tied embedding stays tied), each
    layer's MLP a :class:`NativeMlp` where both its matrices take the GEMM (gate/up merged), and
    the native attention (``state.attention``, when set) on the same pool instead of OpenMP's.
    Every matrix must be affine 4/8-bit with group size 32/64/128 and scales and biases of one
    dtype, float32 or float16 (as :func:`.native_decode` checks); a matrix that is not keeps its
    own product."""
    kernel = partial(module.int8_quantized_matmul, threads=threads)

    def swap(m: Linear) -> Linear:
        return replace(m, kernel=kernel) if _takes(m) else m

    def layer(ly: Layer) -> Layer:
        gate_up = ly.gate_up.map(swap)
        return replace(ly, qkv=ly.qkv.map(swap), o_proj=swap(ly.o_proj), gate_up=gate_up,
                       down_proj=swap(ly.down_proj), mlp=_mlp(gate_up, ly.down_proj, module, threads))

    head = swap(state.lm_head)
    embed = head if state.embed_tokens is state.lm_head else state.embed_tokens
    attention = None if state.attention is None else partial(state.attention, threads=threads)
    return replace(state, layers=[layer(ly) for ly in state.layers], lm_head=head, embed_tokens=embed,
                   attention=attention)


def _mlp(gate_up: Fused, down: Linear, module: Any, threads: int) -> NativeMlp | None:
    merged = gate_up.merged
    if merged is None or merged.kernel is None or not _takes(down):
        return None
    return NativeMlp(merged, down, module, threads)


def _takes(m: Linear) -> bool:
    spec, scales, biases = m.spec, m.scales, m.biases
    return (spec is not None and scales is not None and biases is not None and spec.mode == "affine"
            and spec.bits in (4, 8) and spec.group_size in (32, 64, 128) and scales.dtype == biases.dtype
            and scales.dtype in (mx.float32, mx.float16))
