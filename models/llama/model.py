"""The Llama forward pass over a ragged batch, through the same KV-cache seam as Qwen3.

Per layer (pre-norm): RMSNorm -> q/k/v projections (+ bias with ``attention_bias``) ->
RoPE (split-half unless ``rope_traditional``; base ``rope_theta``, or the "llama3" frequency
table, or positions divided by a "linear" factor; per-row offsets) -> K/V into the cache and
GQA attention over each row's valid prefix (:func:`models.generation.attention.attend`, the
seam a family calls: this module holds no cache logic) -> o_proj -> residual; RMSNorm -> SwiGLU MLP
(+ bias with ``mlp_bias``) -> residual. Then the final norm and the (tied or separate) head,
for one position per row only. Unlike Qwen3: no q/k norm. Architecture: transformers
``LlamaModel`` / mlx-lm ``mlx_lm/models/llama.py`` (the parity reference in the tests).

Every projection sees 2-D activations ``(rows, features)``, as in Qwen3. There are no custom
CUDA kernels for this family (they fold Qwen3's q/k norm in): :func:`decode_path` is never
"fused"; the engine compiles its decode with the family-generic
:func:`models.generation.attention.compiled_decode`.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import mlx.core as mx

from ..generation.attention import Cache, Rows, Step, attend, last_hidden, make_step, token_ids
from ..qwen3 import model as _qwen3_model
from .config import LlamaConfig
from .loader import Layer, State

__all__ = ["decode_path", "forward", "rope_frequencies"]


@partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return gate * mx.sigmoid(gate) * up  # silu(gate) * up, as mlx-lm's swiglu


def rope_frequencies(config: LlamaConfig) -> mx.array | None:
    """The RoPE frequency table ``(head_dim / 2,)`` for ``rope_scaling`` type "llama3" (None for
    any other RoPE, which ``mx.fast.rope`` derives from its base).

    Llama 3.1's rule (transformers ``_compute_llama3_parameters``), computed with the same MLX
    operations as mlx-lm's ``Llama3RoPE`` so the table is the same to the bit: wavelengths
    ``2 pi theta^(2i/d)`` longer than ``original / low_freq_factor`` are stretched by
    ``factor``, those shorter than ``original / high_freq_factor`` kept, and those between
    interpolated smoothly."""
    s = config.rope_scaling
    if s is None or s.rope_type != "llama3":
        return None
    dims = config.head_dim
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    freqs = config.rope_theta ** (mx.arange(0, dims, 2) / dims)
    wavelens = 2 * mx.pi * freqs
    freqs = mx.where(wavelens > low_wavelen, freqs * s.factor, freqs)
    is_medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    smooth = (s.original_max_position_embeddings / wavelens - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    smooth_freqs = freqs / ((1 - smooth) / s.factor + smooth)
    return mx.where(is_medium, smooth_freqs, freqs)


def _rope(state: State, rows: Rows) -> Callable[[mx.array], mx.array]:
    """RoPE of ``(B, heads, T, head_dim)`` at each row's start position."""
    c = state.config
    kw: dict = dict(dims=c.head_dim, traditional=c.rope_traditional, offset=rows.start)
    if state.rope_freqs is not None:
        return partial(mx.fast.rope, base=None, scale=1.0, freqs=state.rope_freqs, **kw)
    linear = c.rope_scaling is not None and c.rope_scaling.rope_type == "linear"
    return partial(mx.fast.rope, base=c.rope_theta, scale=1 / c.rope_scaling.factor if linear else 1.0, **kw)


def decode_path(state: State) -> str:
    """How a decode forward's attention runs: "sdpa" when :data:`models.qwen3.model.DECODE_PATH`
    forces it, else "matmul" (the masked batched matmuls of the generic path); never "fused"."""
    return "sdpa" if _qwen3_model.DECODE_PATH == "sdpa" else "matmul"


def _layer(layer: Layer, h: mx.array, cache: Cache, i: int, step: Step, rope: Callable[[mx.array], mx.array],
           state: State) -> mx.array:
    c = state.config
    b, t = step.rows.tokens.shape
    d, eps = c.head_dim, c.rms_norm_eps
    x = mx.fast.rms_norm(h, layer.input_layernorm, eps)
    q, k, v = (step.unpack(a) for a in layer.qkv(x))
    q = rope(q.reshape(b, t, c.num_attention_heads, d).transpose(0, 2, 1, 3))
    k = rope(k.reshape(b, t, c.num_key_value_heads, d).transpose(0, 2, 1, 3))
    v = v.reshape(b, t, c.num_key_value_heads, d)
    h = h + layer.o_proj(step.pack(attend(cache, i, q, k, v, step)))
    x = mx.fast.rms_norm(h, layer.post_attention_layernorm, eps)
    gate, up = layer.gate_up(x)
    return h + layer.down_proj(_swiglu(gate, up))


def forward(state: State, cache: Cache, rows: Rows) -> mx.array:
    """Run ``rows`` through the model, writing their K/V into ``cache`` (lazily).

    Returns logits ``(B, vocab_size)`` in the activation dtype, one row per batch row, at
    token index ``rows.last``. Does not update the cache's lengths (the caller does). Any
    cache :func:`models.generation.attention.make_step` / ``attend`` accept works here.
    """
    c = state.config
    h = state.embed_tokens.rows(token_ids(rows))
    step = make_step(rows, cache, c.head_dim, c.rope_theta, sdpa_decode=decode_path(state) == "sdpa")
    rope = _rope(state, rows)
    for i, layer in enumerate(state.layers):
        h = _layer(layer, h, cache, i, step, rope, state)
    h = mx.fast.rms_norm(last_hidden(h, rows), state.norm, c.rms_norm_eps)
    return state.lm_head(h)
