"""The int4 KV cache's quantizer: per group, the scale and bias of least squared error (issue 42).

MLX's ``mx.quantize`` spans each group's [min, max]: one outlier sets the step for all 64 values.
At 4 bits that step is coarse, so :func:`fit_int4` chooses the scale and bias of each group to
minimize the squared error of the stored values, in the same layout (codes 0..15, one scale and
one bias per group; every reader dequantizes ``scale * code + bias`` as before):

1. a grid search of the range: [min, max] times each of :data:`SHRINK` (1, 0.95, 0.9, 0.85, 0.8; 1 is
   the whole span, scale (max - min) / 15 and bias min), the values beyond it clipped to the end
   codes; the factor of least squared error is kept (the first on a tie; on SmolLM2's rotated K/V
   it is 1, 0.95 or 0.9 almost always, and nine factors down to 0.6 stored the same bytes);
2. :data:`REFITS` Lloyd steps: the least-squares scale and bias for the codes (a linear regression
   of the values on their codes), then the codes rounded anew for them; neither half-step can raise
   the error.

Every step is float32 and element-wise, and every sum over a group adds its halves pairwise
(:func:`_pair_sum`), so the native CPU decode step's writer (``kv_quantize`` in
``decoder/cpu/kv_store.cpp``) computes the same bytes with the same operations in the same order.
int8 keeps ``mx.quantize`` (its error is already within 0.1% perplexity).
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["REFITS", "SHRINK", "fit_int4"]

#: The range factors searched (float32; kv_store.cpp's ``kShrinks`` factors are the same values).
SHRINK = tuple(1.0 - 0.05 * j for j in range(5))
#: Lloyd refits after the grid search (kv_store.cpp's ``kRefits``).
REFITS = 2
_LEVELS = 15.0
_EPS = 1e-7


def _pair_sum(a: mx.array) -> mx.array:
    """Sum over the first axis (a power of 2 long) by halves: ``a[:h] + a[h:]`` until one is left
    (a fixed order, unlike ``mx.sum``'s; contiguous halves). ``(G, ...)`` -> ``(1, ...)``."""
    while a.shape[0] > 1:
        h = a.shape[0] // 2
        a = a[:h] + a[h:]
    return a


def _codes(x: mx.array, scale: mx.array, bias: mx.array) -> mx.array:
    """``clip(round((x - bias) * (1 / scale)), 0, 15)`` (float32 codes, round half to even)."""
    return mx.clip(mx.round((x - bias) * (1.0 / scale)), 0.0, _LEVELS)


def _error(x: mx.array, q: mx.array, scale: mx.array, bias: mx.array) -> mx.array:
    r = q * scale + bias - x
    return _pair_sum(r * r)


def _grid(x: mx.array) -> tuple[mx.array, mx.array]:
    """The scale and bias ``(1, M)`` of the :data:`SHRINK` factor of least error for the ``M``
    groups of ``x`` ``(G, M)`` (a group per column)."""
    shrink = mx.array(SHRINK, dtype=mx.float32)[:, None]  # (A, 1)
    lo = (x.min(0, keepdims=True) * shrink)[None]  # (1, A, M)
    hi = (x.max(0, keepdims=True) * shrink)[None]
    scale = mx.maximum((hi - lo) / _LEVELS, _EPS)
    xa = x[:, None]  # (G, 1, M)
    err = _error(xa, _codes(xa, scale, lo), scale, lo)  # (1, A, M)
    best = mx.argmin(err, axis=1, keepdims=True)  # the first of the least
    return mx.take_along_axis(scale, best, axis=1)[:, 0], mx.take_along_axis(lo, best, axis=1)[:, 0]


def _refit(x: mx.array, scale: mx.array, bias: mx.array) -> tuple[mx.array, mx.array]:
    """One Lloyd step over groups ``x`` ``(G, M)``: the codes for ``scale``/``bias`` ``(1, M)``, then
    the least-squares scale and bias for those codes (kept as they were where the codes are all
    equal or the fit is below 1e-7)."""
    q = _codes(x, scale, bias)
    n = float(x.shape[0])
    sums = _pair_sum(mx.stack([q, x, q * q, q * x], axis=1))  # (1, 4, M)
    sq, sx, sqq, sqx = sums[:, 0], sums[:, 1], sums[:, 2], sums[:, 3]
    den = n * sqq - sq * sq  # exact: integers below 2^24
    num = n * sqx - sq * sx
    fit = num / mx.where(den > 0, den, 1.0)
    ok = (den > 0) & (mx.abs(fit) >= _EPS)
    new_scale = mx.where(ok, fit, scale)
    new_bias = mx.where(ok, (sx - new_scale * sq) * (1.0 / n), bias)
    return new_scale, new_bias


def _pack(q: mx.array) -> mx.array:
    """Codes ``(..., D)`` (0..15) into MLX's 4-bit words ``(..., D / 8)`` uint32 (code ``j`` of a
    word at bits ``4j``)."""
    w = q.astype(mx.uint32).reshape(*q.shape[:-1], q.shape[-1] // 8, 8)
    return mx.sum(mx.left_shift(w, mx.arange(0, 32, 4, dtype=mx.uint32)), axis=-1).astype(mx.uint32)


def fit_int4(x: mx.array, group_size: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
    """Quantize ``x`` ``(..., D)`` (non-empty, any float dtype; computed in float32) to 4 bits in groups of
    ``group_size`` (a power of 2 dividing D) with the least-squares scale and bias of each group
    (the module docstring): ``(words (..., D / 8) uint32, scales, biases (..., D / group_size)
    in dtype)``, MLX's affine layout (``mx.dequantize(words, scales, biases, group_size, 4)``).
    The codes are rounded for the scale and bias as stored in ``dtype``. Raises ValueError naming
    ``group_size`` when it is not a power of 2 dividing D."""
    if group_size < 1 or group_size & (group_size - 1) or x.shape[-1] % group_size:
        raise ValueError(f"group_size must be a power of 2 dividing the last axis {x.shape[-1]}, got {group_size}")
    shape, groups = x.shape, x.shape[-1] // group_size
    g = mx.contiguous(x.astype(mx.float32).reshape(-1, group_size).T)  # (G, M): a group per column
    scale, bias = _grid(g)
    for _ in range(REFITS):
        scale, bias = _refit(g, scale, bias)
    scale, bias = scale.astype(dtype), bias.astype(dtype)
    q = _codes(g, scale.astype(mx.float32), bias.astype(mx.float32))
    return (_pack(q.T.reshape(shape)), scale.reshape(*shape[:-1], groups), bias.reshape(*shape[:-1], groups))
