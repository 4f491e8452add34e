"""Pooling (on the device, inside the compiled forward) and the per-request finish (in the caller).

Pooling follows sentence-transformers' ``Pooling`` module over right-padded rows: "last" reads the
hidden state at each row's last real token (``lengths - 1``: where Qwen3-Embedding's appended
``<|endoftext|>`` sits), "mean" averages the real tokens' states, "cls" takes the first token's.
The finish keeps the first ``dimensions`` components and then L2-normalizes (as
sentence-transformers' ``truncate_dim`` with ``normalize_embeddings``), in float32.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ._st_config import Pooling

__all__ = ["finish", "pool"]

_EPS = 1e-12  # torch.nn.functional.normalize's, which sentence-transformers' Normalize uses


def pool(hidden: mx.array, lengths: mx.array, mode: Pooling) -> mx.array:
    """``hidden`` ``(B, T, D)``, ``lengths`` ``(B,)`` int32 (real tokens per row; 0 for a pad
    row) -> ``(B, D)`` float32."""
    h = hidden.astype(mx.float32)
    if mode == "cls":
        return h[:, 0, :]
    if mode == "last":
        last = mx.maximum(lengths - 1, 0).astype(mx.int32)
        return mx.take_along_axis(h, last[:, None, None], axis=1)[:, 0, :]
    mask = (mx.arange(h.shape[1])[None, :] < lengths[:, None]).astype(mx.float32)
    total = (h * mask[:, :, None]).sum(axis=1)
    return total / mx.maximum(lengths, 1).astype(mx.float32)[:, None]


def finish(vector: np.ndarray, dimensions: int | None, normalize: bool) -> np.ndarray:
    """One pooled vector ``(D,)`` float32 -> its first ``dimensions`` components (None: all),
    L2-normalized when ``normalize`` (a zero vector stays zero): ``(dimensions,)`` float32."""
    v = np.array(vector[:dimensions] if dimensions is not None else vector, dtype=np.float32)
    if normalize:
        v /= max(float(np.linalg.norm(v)), _EPS)
    return v
