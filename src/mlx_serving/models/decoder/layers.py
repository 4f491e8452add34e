"""The shared pre-norm decoder every family runs: weights (:class:`Layer`, :class:`State`) and the
forward pass over a ragged batch, writing the KV cache through the seam of
:mod:`models.decoder.attention`.

Per layer: RMSNorm -> q/k/v projections (+ bias: ``attention_bias``) -> per-head q/k RMSNorm
(``qk_norm``) -> RoPE (split-half unless ``rope_traditional``; base ``rope_theta``, the "llama3"
frequency table or positions divided by a "linear" factor; per-row offsets) -> K/V into the cache
and GQA attention over each row's valid prefix (``attend``) -> o_proj (+ bias: ``o_proj_bias``)
-> residual; RMSNorm -> SwiGLU MLP (+ biases: ``mlp_bias``) -> residual. Then the final norm and
the (tied or separate) head, for one position per row only. The hooks are fields of the family's
:class:`~models.config.DecoderConfig`; the references are mlx-lm's ``qwen3.py``, ``llama.py`` and
``qwen2.py`` (the parity tests).

Every projection sees 2-D activations ``(rows, features)``: on MLX's CUDA build a ``(B, 1, K)``
input into ``quantized_matmul`` costs time linear in B. One-token decode forwards go through the
caller's decode backend (:mod:`models.decoder.decode_backends`: the fused CUDA kernels, or this
module's generic path).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import mlx.core as mx

from .._weights import Fused, Linear, swiglu
from ..config import DecoderConfig
from ..native import PagedAttention
from .attention import Cache, DecodeBackend, Rows, Step, attend, last_hidden, make_step, token_ids
from .kv_cache import PagedKVCache

__all__ = ["Layer", "State", "compiled_decode", "forward", "hidden_states", "rope_frequencies"]


@dataclass
class Layer:
    """One decoder layer's weights; ``qkv`` fuses q/k/v_proj, ``gate_up`` gate/up_proj (each with
    its biases when the config has them); ``q_norm`` / ``k_norm`` ``(head_dim,)`` with ``qk_norm``;
    ``mlp``: when set, the gated MLP of normed ``(N, hidden)`` -> ``(N, hidden)`` as one computation
    over these weights, run by :func:`forward` instead of ``down_proj(swiglu(*gate_up(x)))`` (the
    native prefill's: :mod:`.cpu.prefill`)."""

    input_layernorm: mx.array
    post_attention_layernorm: mx.array
    qkv: Fused
    o_proj: Linear
    gate_up: Fused
    down_proj: Linear
    q_norm: mx.array | None = None
    k_norm: mx.array | None = None
    mlp: Callable[[mx.array], mx.array] | None = None


@dataclass
class State:
    """A loaded model: config (``tie_word_embeddings`` resolved), weights, activation ``dtype``,
    checkpoint ``path``, ``rope_freqs`` ``(head_dim / 2,)``, the RoPE frequency table when
    ``rope_scaling`` is "llama3" (None otherwise), and ``attention``, the native CPU attention over
    the paged KV cache when the loader picked it (:func:`models.native.paged_attention_cpu`)."""

    config: DecoderConfig
    embed_tokens: Linear
    layers: list[Layer]
    norm: mx.array
    lm_head: Linear
    dtype: mx.Dtype
    path: Path | None = None
    rope_freqs: mx.array | None = None
    attention: PagedAttention | None = None


def rope_frequencies(config: DecoderConfig) -> mx.array | None:
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


def _rope(state: State, start: mx.array | int) -> Callable[[mx.array], mx.array]:
    """RoPE of ``(B, heads, T, head_dim)`` at each row's start position (``(B,)``, or one int)."""
    c = state.config
    kw: dict = dict(dims=c.head_dim, traditional=c.rope_traditional, offset=start)
    if state.rope_freqs is not None:
        return partial(mx.fast.rope, base=None, scale=1.0, freqs=state.rope_freqs, **kw)
    linear = c.rope_scaling.factor if c.rope_scaling is not None and c.rope_scaling.rope_type == "linear" else None
    return partial(mx.fast.rope, base=c.rope_theta, scale=1 / linear if linear else 1.0, **kw)


def _heads(x: mx.array, step: Step, heads: int, d: int) -> mx.array:
    b, t = step.rows.tokens.shape
    return step.unpack(x).reshape(b, t, heads, d)


def _attention(layer: Layer, x: mx.array, cache: Cache, i: int, step: Step,
               rope: Callable[[mx.array], mx.array], c: DecoderConfig) -> mx.array:
    """Layer ``i``'s attention block on normed ``x`` ``(N, hidden)`` -> ``(N, hidden)``."""
    d = c.head_dim
    q, k, v = layer.qkv(x)
    q, k = _heads(q, step, c.num_attention_heads, d), _heads(k, step, c.num_key_value_heads, d)
    if c.qk_norm:
        q, k = mx.fast.rms_norm(q, layer.q_norm, c.rms_norm_eps), mx.fast.rms_norm(k, layer.k_norm, c.rms_norm_eps)
    q, k = rope(q.transpose(0, 2, 1, 3)), rope(k.transpose(0, 2, 1, 3))
    v = _heads(v, step, c.num_key_value_heads, d)
    return layer.o_proj(step.pack(attend(cache, i, q, k, v, step)))


def _mlp(layer: Layer, x: mx.array) -> mx.array:
    """Layer ``layer``'s gated MLP on normed ``x`` ``(N, hidden)`` -> ``(N, hidden)``."""
    if layer.mlp is not None:
        return layer.mlp(x)
    gate, up = layer.gate_up(x)
    return layer.down_proj(swiglu(gate, up))


def forward(state: State, cache: Cache, rows: Rows, decode: DecodeBackend[State] | None = None) -> mx.array:
    """Run ``rows`` through the model, writing their K/V into ``cache`` (lazily).

    Returns logits ``(B, vocab_size)`` in the activation dtype, one row per batch row, at token
    index ``rows.last`` (``(M, vocab_size)`` at ``rows.gather`` when set). ``decode``: the backend one-token rows go through (default: the generic
    matmul path).
    """
    c = state.config
    h = state.embed_tokens.rows(token_ids(rows))
    if rows.tokens.shape[1] == 1 and decode is not None:
        logits = decode.decode(state, cache, rows, h)
        if logits is not None:
            return logits
    step = make_step(rows, cache, sdpa_decode=decode is not None and decode.sdpa, kernel=state.attention)
    rope = _rope(state, rows.start)
    eps = c.rms_norm_eps
    for i, layer in enumerate(state.layers):
        h = h + _attention(layer, mx.fast.rms_norm(h, layer.input_layernorm, eps), cache, i, step, rope, c)
        h = h + _mlp(layer, mx.fast.rms_norm(h, layer.post_attention_layernorm, eps))
    h = mx.fast.rms_norm(last_hidden(h, rows), state.norm, eps)
    return state.lm_head(h)


def compiled_decode(state: State, kv_len: int, layout: PagedKVCache,
                    decode: DecodeBackend[State] | None = None) -> Callable[..., tuple]:
    """An ``mx.compile``d one-token decode of B rows through the ``decode`` backend
    (:mod:`.decode_backends`; None: the generic path), attention span ``kv_len`` (unused by a
    backend whose rows read their own length, the fused one), over a paged cache like ``layout``
    (its block size and quantization; its arrays are not captured).

    Call as ``fn(tokens (B, 1) int32, start (B,) int32, n_valid (B,) int32, block_table (B, W)
    int32, arrays)`` with the cache's arrays (``PagedKVCache.arrays()``, of a cache laid out as
    ``layout``: float or quantized); returns ``(logits (B, vocab), arrays)``, the new arrays (the
    caller stores them back: ``set_arrays``). Weights are captured as
    constants. MLX retraces once per new input shape. The forward traced is :func:`forward`
    (looked up when traced), whatever ``state``'s family.
    """

    template = layout.cleared()  # the layout only: the closure holds none of the cache's arrays

    def step(tokens: mx.array, start: mx.array, n_valid: mx.array, table: mx.array,
             arrays: list[mx.array]) -> tuple:
        cache = template.cleared()
        cache.set_arrays(list(arrays))
        rows = Rows(tokens, start, n_valid, kv_len, mx.zeros_like(start), table)
        return forward(state, cache, rows, decode), cache.arrays()

    return mx.compile(step)


def _causal_attention(layer: Layer, x: mx.array, b: int, t: int, rope: Callable[[mx.array], mx.array],
                      c: DecoderConfig) -> mx.array:
    """Layer ``layer``'s attention block without a KV cache: normed ``x`` ``(B * T, hidden)`` of
    ``B`` rows of ``T`` tokens from position 0, causal -> ``(B * T, hidden)``."""
    d = c.head_dim
    q, k, v = layer.qkv(x)
    q = q.reshape(b, t, c.num_attention_heads, d)
    k = k.reshape(b, t, c.num_key_value_heads, d)
    if c.qk_norm:
        q, k = mx.fast.rms_norm(q, layer.q_norm, c.rms_norm_eps), mx.fast.rms_norm(k, layer.k_norm, c.rms_norm_eps)
    q, k = rope(q.transpose(0, 2, 1, 3)), rope(k.transpose(0, 2, 1, 3))
    v = v.reshape(b, t, c.num_key_value_heads, d).transpose(0, 2, 1, 3)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=d ** -0.5, mask="causal" if t > 1 else None)
    return layer.o_proj(out.transpose(0, 2, 1, 3).reshape(b * t, -1))


def hidden_states(state: State, tokens: mx.array) -> mx.array:
    """The final-normed hidden states (after ``model.norm``, before the head) of ``tokens``
    ``(B, T)`` int32: ``(B, T, hidden_size)`` in the activation dtype.

    Every row starts at position 0 and attends causally (the decoder's own attention, no KV
    cache: the entry point of embeddings). With causal attention a row's states at positions
    ``< n`` depend only on its first ``n`` tokens, so right-padding a row never changes them.
    Lazy: evaluate the result (or compile a caller of it).
    """
    c = state.config
    b, t = tokens.shape
    h = state.embed_tokens.rows(tokens.reshape(-1))
    rope = _rope(state, 0)
    eps = c.rms_norm_eps
    for layer in state.layers:
        h = h + _causal_attention(layer, mx.fast.rms_norm(h, layer.input_layernorm, eps), b, t, rope, c)
        gate, up = layer.gate_up(mx.fast.rms_norm(h, layer.post_attention_layernorm, eps))
        h = h + layer.down_proj(swiglu(gate, up))
    return mx.fast.rms_norm(h, state.norm, eps).reshape(b, t, -1)
