"""The decode path choice and the fused CUDA decode forward (:mod:`.cuda_kernels`).

A one-token decode forward runs "fused" (the custom CUDA kernels: 8 launches per layer, no mask),
"matmul" (the generic path of :func:`models.layers.forward`, masked attention through batched
matmuls) or "sdpa" (the generic path through ``mx.fast.scaled_dot_product_attention`` with the
mask). The fused kernels implement one architecture: q/k RMSNorm folded into the attention kernel
and plain split-half RoPE (``config.qk_norm``, no ``rope_scaling``, not ``rope_traditional``:
Qwen3); any other config decodes on the generic path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from .attention import Cache, Rows
from .._weights import swiglu as split_swiglu
from .cuda_kernels import add_rms_norm, decode_attention, kernels_available, supports, swiglu

if TYPE_CHECKING:
    from ..layers import State

__all__ = ["DECODE_PATH", "decode_path", "fused_decode"]

#: Forces the decode path: "fused" (where the config fits the kernels), "matmul" or "sdpa"; None
#: picks "fused" where it runs (MLX's CUDA build, a supported shape, a fitting config) and
#: "matmul" elsewhere. bench/gpu_step.py times them.
DECODE_PATH: str | None = None


def decode_path(state: State) -> str:
    """The decode path :func:`models.layers.forward` takes for ``state``: :data:`DECODE_PATH` (a
    forced "fused" only where the config fits the kernels, else "matmul"), or when that is None
    "fused" where the kernels run and fit, else "matmul"."""
    c = state.config
    fits = c.qk_norm and c.rope_scaling is None and not c.rope_traditional
    if DECODE_PATH is not None:
        return DECODE_PATH if DECODE_PATH != "fused" or fits else "matmul"
    return "fused" if fits and kernels_available() and supports(c.hidden_size, c.head_dim) else "matmul"


def fused_decode(state: State, cache: Cache, rows: Rows, h: mx.array) -> mx.array:
    """The decode forward through :mod:`.cuda_kernels` from the embedded tokens ``h`` ``(B, hidden)``
    (rows ``0..B-1`` = cache slots, or on a paged cache the blocks of ``rows.block_table``); the
    K/V cache is written in place. Returns logits ``(B, vocab_size)``, as
    :func:`models.layers.forward`."""
    c = state.config
    eps = c.rms_norm_eps
    paged = {} if rows.block_table is None else {"block_table": rows.block_table, "block_size": cache.block_size}
    x = mx.fast.rms_norm(h, state.layers[0].input_layernorm, eps)
    for i, layer in enumerate(state.layers):
        qkv = layer.qkv.merged(x) if layer.qkv.merged is not None else mx.concatenate(layer.qkv(x), axis=-1)
        attn = decode_attention(qkv, layer.q_norm, layer.k_norm, rows.start, rows.n_valid, cache.keys[i],
                                cache.values[i], heads=c.num_attention_heads, eps=eps, rope_theta=c.rope_theta,
                                **paged)
        h, x = add_rms_norm(h, layer.o_proj(attn), layer.post_attention_layernorm, eps)
        act = swiglu(layer.gate_up.merged(x)) if layer.gate_up.merged is not None else split_swiglu(*layer.gate_up(x))
        after = state.layers[i + 1].input_layernorm if i + 1 < len(state.layers) else state.norm
        h, x = add_rms_norm(h, layer.down_proj(act), after, eps)
    return state.lm_head(x)
