"""The native prefill (issue 39): the shared decoder's prefill forward with int8-activation products.

On the "native" decode path a prefill (and every forward of more than one token per row) runs the
shared decoder's generic forward (:func:`models.decoder.layers.forward`: norms, RoPE and attention
stay MLX operations) over :func:`prefill_state`, the model whose quantized projections and head are
computed by the native int8 GEMM (``prefill.cpp`` / ``qgemm.cpp``): each row's activations
quantized to int8 per block of 32 and multiplied with integer products against the 4- or 8-bit
weights, each weight panel unpacked once and reused across the rows (AVX-512 VNNI, AVX2 or a
portable loop, picked at run time), on a pool of threads kept alive across calls.

Numerics: each product is bit for bit the decode step's (``qdot.cpp``) for the same row, so a
row's result never depends on its batchmates or its place among the rows (batched == solo,
prefix hit == miss); it differs from the exact float path ("matmul") as the decode step does.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import mlx.core as mx

from ..._weights import Linear
from ..layers import Layer, State

__all__ = ["prefill_state"]


def prefill_state(state: State, module: Any, threads: int) -> State:
    """``state`` with each projection and the head computed by ``module``'s int8 GEMM on a pool of
    ``threads`` (the weights are the same arrays, not copies; a tied embedding stays tied).
    Every matrix must be affine 4/8-bit with group size 32/64/128 and scales and biases of one
    dtype, float32 or float16 (as :func:`.native_decode` checks); a matrix that is not keeps its
    own product."""
    kernel = partial(module.int8_quantized_matmul, threads=threads)

    def swap(m: Linear) -> Linear:
        return replace(m, kernel=kernel) if _takes(m) else m

    def layer(ly: Layer) -> Layer:
        return replace(ly, qkv=ly.qkv.map(swap), o_proj=swap(ly.o_proj), gate_up=ly.gate_up.map(swap),
                       down_proj=swap(ly.down_proj))

    head = swap(state.lm_head)
    embed = head if state.embed_tokens is state.lm_head else state.embed_tokens
    return replace(state, layers=[layer(ly) for ly in state.layers], lm_head=head, embed_tokens=embed)


def _takes(m: Linear) -> bool:
    spec, scales, biases = m.spec, m.scales, m.biases
    return (spec is not None and scales is not None and biases is not None and spec.mode == "affine"
            and spec.bits in (4, 8) and spec.group_size in (32, 64, 128) and scales.dtype == biases.dtype
            and scales.dtype in (mx.float32, mx.float16))
