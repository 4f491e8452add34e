"""The packed embedding forward: a batch's texts as one sequence of their real tokens, no padding.

The ``(n, bucket)`` right-padded rows of a batch become ``N = sum(lengths)`` token rows (each text's
tokens, in order), so every product runs once over all the batch's real tokens and none over
padding: q/k/v, o_proj and the MLP are ``(N, K)`` products (the native int8 GEMM on the "native"
products: :mod:`models.decoder.cpu.prefill`), RoPE takes each token's own position (its place in
its text), and attention runs per text over that text's tokens only (causal, from position 0), so
a text never attends to another. The last layer computes only the rows the pooling reads past its
K/V: each text's last token ("last") or first ("cls"); "mean" reads them all.

Numerics: every operation is per token row (norms, RoPE, SwiGLU, the int8 GEMM, whose products
are bit for bit the same whatever the other rows: :mod:`models.decoder.cpu.prefill`) or per text
(attention), so a text's vector never depends on its batchmates, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from .._weights import swiglu
from ..decoder.layers import Layer, State, _rope  # RoPE at per-token positions, as the decoder applies it
from ._st_config import Pooling

__all__ = ["packed_embeddings"]

Span = tuple[int, int]
Rope = Callable[[mx.array], mx.array]


def packed_embeddings(state: State, tokens: mx.array, lengths: Sequence[int], pooling: Pooling) -> mx.array:
    """Pooled final hidden states ``(n, hidden)`` float32 of ``n`` texts packed in ``tokens``
    ``(N,)`` int32 (text ``i``: the next ``lengths[i]`` ids; ``N = sum(lengths)``, each >= 1),
    pooled by ``pooling`` ("last", "mean" or "cls": :func:`._pooling.pool`'s meaning). Lazy."""
    ends = np.cumsum(lengths).tolist()
    texts = [(e - n, e) for n, e in zip(lengths, ends)]
    rope = _rope(state, mx.array(np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)))
    read = {"last": [(e - 1, e) for _, e in texts], "cls": [(s, s + 1) for s, _ in texts], "mean": texts}[pooling]
    h = state.embed_tokens.rows(tokens)
    for i, layer in enumerate(state.layers):
        h = _layer(state, layer, h, texts, read if i == len(state.layers) - 1 else texts, rope)
    h = mx.fast.rms_norm(h, state.norm, state.config.rms_norm_eps).astype(mx.float32)
    if pooling != "mean":
        return h
    return mx.stack([h[s:e].mean(axis=0) for s, e in texts])


def _layer(state: State, layer: Layer, h: mx.array, texts: list[Span], rows: list[Span], rope: Rope) -> mx.array:
    """One decoder layer over packed ``h`` ``(N, hidden)`` (``texts``: each text's span of rows),
    computed for the query ``rows`` (per text: its whole span, or one row of it) ->
    ``(rows' total, hidden)``, in order."""
    eps = state.config.rms_norm_eps
    attended = _attention(state, layer, mx.fast.rms_norm(h, layer.input_layernorm, eps), texts, rows, rope)
    if rows is not texts:
        h = h[mx.array(np.concatenate([np.arange(a, b) for a, b in rows]).astype(np.int32))]
    h = h + attended
    gate, up = layer.gate_up(mx.fast.rms_norm(h, layer.post_attention_layernorm, eps))
    return h + layer.down_proj(swiglu(gate, up))


def _attention(state: State, layer: Layer, x: mx.array, texts: list[Span], rows: list[Span], rope: Rope) -> mx.array:
    """Layer ``layer``'s attention block over normed packed ``x`` ``(N, hidden)``: the query
    ``rows`` of each text attend causally to its rows up to them -> ``(rows' total, hidden)``."""
    c = state.config
    n, d = x.shape[0], c.head_dim
    q, k, v = layer.qkv(x)
    q, k = q.reshape(n, c.num_attention_heads, d), k.reshape(n, c.num_key_value_heads, d)
    if c.qk_norm:
        q, k = mx.fast.rms_norm(q, layer.q_norm, c.rms_norm_eps), mx.fast.rms_norm(k, layer.k_norm, c.rms_norm_eps)
    q, k = rope(q[:, :, None, :])[:, :, 0, :], rope(k[:, :, None, :])[:, :, 0, :]
    v = v.reshape(n, c.num_key_value_heads, d)
    outs = [_causal(q[a:b], k[s:b], v[s:b], d) for (s, _), (a, b) in zip(texts, rows)]
    return layer.o_proj(mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0])


def _causal(q: mx.array, k: mx.array, v: mx.array, d: int) -> mx.array:
    """One text's attention: queries ``q`` ``(Lq, Hq, d)`` at the last ``Lq`` positions of keys and
    values ``k`` / ``v`` ``(L, Hkv, d)`` (``Lq`` is ``L`` or 1), causal -> ``(Lq, Hq * d)``."""
    rows = q.shape[0]
    q, k, v = (a.transpose(1, 0, 2)[None] for a in (q, k, v))
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=d ** -0.5, mask="causal" if rows > 1 else None)
    return out[0].transpose(1, 0, 2).reshape(rows, -1)
