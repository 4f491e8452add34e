"""The Qwen3 forward pass over a ragged batch, writing a preallocated KV cache.

Per layer (pre-norm): RMSNorm -> q/k/v projections -> per-head q_norm/k_norm ->
split-half RoPE (``traditional=False``, base ``rope_theta``, per-row position offsets)
-> write K/V into the cache -> GQA attention through ``mx.fast.scaled_dot_product_attention``
over each row's valid prefix -> o_proj -> residual; RMSNorm -> SwiGLU MLP -> residual.
Then the final norm and the (tied or separate) head, for one position per row only.
Architecture: Qwen3 technical report (arXiv:2505.09388) / transformers ``Qwen3Model``.

Every projection sees 2-D activations ``(rows, features)``: on MLX's CUDA build a
``(B, 1, K)`` input into ``quantized_matmul`` costs time linear in B.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx

from ..generation.attention import Cache, Rows, Step, attend, last_hidden, make_step, token_ids
from .kernels import add_rms_norm, decode_attention, kernels_available, supports, swiglu
from .loader import Layer, State

__all__ = ["decode_path", "forward"]

#: How a decode forward (one token per row, slots ``0..B-1``) runs: "fused" (the custom
#: CUDA kernels of :mod:`.kernels`: 8 launches per layer, no mask), "matmul" (generic
#: path, masked attention through :func:`_decode_attention`) or "sdpa" (generic path,
#: ``mx.fast.scaled_dot_product_attention`` with the mask); None picks "fused" where it
#: runs (MLX's CUDA build) and "matmul" elsewhere. bench/gpu_step.py times them.
DECODE_PATH: str | None = None


@partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return gate * mx.sigmoid(gate) * up


def decode_path(state: State) -> str:
    """The decode path :func:`forward` takes for ``state``: :data:`DECODE_PATH`, or when that
    is None "fused" where the kernels run (MLX's CUDA build, a supported shape), else "matmul"."""
    if DECODE_PATH is not None:
        return DECODE_PATH
    c = state.config
    return "fused" if kernels_available() and supports(c.hidden_size, c.head_dim) else "matmul"


def _attention(layer: Layer, x: mx.array, cache: Cache, i: int, step: Step, state: State) -> mx.array:
    c = state.config
    b, t = step.rows.tokens.shape
    d = c.head_dim
    q, k, v = (step.unpack(a) for a in layer.qkv(x))
    q = q.reshape(b, t, c.num_attention_heads, d)
    k = k.reshape(b, t, c.num_key_value_heads, d)
    v = v.reshape(b, t, c.num_key_value_heads, d)
    q = step.rope(mx.fast.rms_norm(q, layer.q_norm, c.rms_norm_eps).transpose(0, 2, 1, 3))
    k = step.rope(mx.fast.rms_norm(k, layer.k_norm, c.rms_norm_eps).transpose(0, 2, 1, 3))
    return layer.o_proj(step.pack(attend(cache, i, q, k, v, step)))


def _layer(layer: Layer, h: mx.array, cache: Cache, i: int, step: Step, state: State) -> mx.array:
    eps = state.config.rms_norm_eps
    x = mx.fast.rms_norm(h, layer.input_layernorm, eps)
    h = h + _attention(layer, x, cache, i, step, state)
    x = mx.fast.rms_norm(h, layer.post_attention_layernorm, eps)
    gate, up = layer.gate_up(x)
    return h + layer.down_proj(_swiglu(gate, up))


def forward(state: State, cache: Cache, rows: Rows) -> mx.array:
    """Run ``rows`` through the model, writing their K/V into ``cache`` (lazily).

    Returns logits ``(B, vocab_size)`` in the activation dtype, one row per batch row,
    at token index ``rows.last``. Does not update ``cache.lengths`` (the caller does).
    """
    t = rows.tokens.shape[1]
    h = state.embed_tokens.rows(token_ids(rows))
    c = state.config
    if t == 1 and rows.slots is None and decode_path(state) == "fused":
        return _fused_decode(state, cache, rows, h)
    step = make_step(rows, cache, c.head_dim, c.rope_theta, sdpa_decode=DECODE_PATH == "sdpa")
    for i, layer in enumerate(state.layers):
        h = _layer(layer, h, cache, i, step, state)
    h = mx.fast.rms_norm(last_hidden(h, rows), state.norm, state.config.rms_norm_eps)
    return state.lm_head(h)


def _fused_decode(state: State, cache: Cache, rows: Rows, h: mx.array) -> mx.array:
    """The decode forward through :mod:`.kernels` (rows ``0..B-1`` = cache slots, or on a paged
    cache the blocks of ``rows.block_table``); the K/V cache is written in place. Same contract as
    :func:`forward`."""
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
        act = swiglu(layer.gate_up.merged(x)) if layer.gate_up.merged is not None else _swiglu(*layer.gate_up(x))
        after = state.layers[i + 1].input_layernorm if i + 1 < len(state.layers) else state.norm
        h, x = add_rms_norm(h, layer.down_proj(act), after, eps)
    return state.lm_head(x)
