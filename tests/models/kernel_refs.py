"""Pure-MLX implementations of the contracts of models/decoder/cuda_kernels.py, for the tests: they stand
in for the CUDA kernels on any device (test_qwen3_fused_path.py) and are what the kernels are
checked against on a GPU (test_qwen3_kernels_cuda.py)."""

from __future__ import annotations

import mlx.core as mx


def ref_decode_attention(qkv, q_norm, k_norm, start, n_valid, keys, values, *, heads, eps, rope_theta,
                         block_table, block_size):
    """kernels.decode_attention's contract in MLX ops over the paged cache (``keys``/``values``
    (blocks * block_size, Hkv, D)); the cache write updates ``keys`` / ``values`` (the caller's
    array objects) as the kernel's in-place write does; ``q_norm``/``k_norm`` None: no q/k norm."""
    b = qkv.shape[0]
    _, hkv, d = keys.shape
    q, k, v = _qkv(qkv, q_norm, k_norm, start, heads, hkv, d, eps, rope_theta)
    width = block_table.shape[1]
    blk = mx.take_along_axis(block_table, mx.minimum(start // block_size, width - 1)[:, None], axis=1)[:, 0]
    row = mx.where(n_valid > 0, blk * block_size + start % block_size, 0)  # padding rows: the null block
    keys[row] = k
    values[row] = v
    j = mx.arange(width * block_size)
    read = block_table[:, j // block_size] * block_size + (j % block_size)[None, :]  # (b, span)
    return _attend(q, keys[read].transpose(0, 2, 1, 3), values[read].transpose(0, 2, 1, 3),
                   start + n_valid, heads, hkv)


def _qkv(qkv, q_norm, k_norm, start, heads, hkv, d, eps, rope_theta):
    b = qkv.shape[0]
    q, k, v = mx.split(qkv, [heads * d, (heads + hkv) * d], axis=-1)

    def rope(x: mx.array) -> mx.array:
        return mx.fast.rope(x[:, :, None], d, traditional=False, base=rope_theta, scale=1.0, offset=start)[:, :, 0]

    q, k = q.reshape(b, heads, d), k.reshape(b, hkv, d)
    if q_norm is not None:
        q, k = mx.fast.rms_norm(q, q_norm, eps), mx.fast.rms_norm(k, k_norm, eps)
    q, k = rope(q), rope(k)
    return q, k, v.reshape(b, hkv, d)


def _attend(q, keys, values, n, heads, hkv):
    """``q`` (b, heads, d) over ``keys``/``values`` (b, hkv, length, d), positions < ``n`` (b,)."""
    b, _, length, d = keys.shape
    kk = mx.repeat(keys, heads // hkv, axis=1)
    vv = mx.repeat(values, heads // hkv, axis=1)
    scores = (q[:, :, None] @ kk.swapaxes(-1, -2)) * d**-0.5  # (b, heads, 1, length)
    open_ = (mx.arange(length)[None, :] < n[:, None])[:, None, None]
    scores = mx.where(open_, scores, -mx.inf)
    probs = mx.where(open_, mx.softmax(scores, axis=-1, precise=True), 0.0)
    return (probs @ vv).reshape(b, heads * d)


def ref_add_rms_norm(h, delta, weight, eps):
    s = h + delta
    return s, mx.fast.rms_norm(s, weight, eps)


def ref_swiglu(gate_up):
    gate, up = mx.split(gate_up, 2, axis=-1)
    return gate * mx.sigmoid(gate) * up


def ref_qmv(x, lin, *, norm=None, eps=0.0, residual=None, glu=False):
    """cuda_gemv.qmv's contract with MLX's own operations: RMSNorm, the 4-bit product, then the residual
    add or SwiGLU."""
    y = lin(x if norm is None else mx.fast.rms_norm(x, norm, eps))
    if glu:
        return ref_swiglu(y)
    return y if residual is None else residual + y


def ref_attention_o_proj(qkv, q_norm, k_norm, start, n_valid, keys, values, *, o_proj, residual, **kw):
    """cuda_gemv.attention_o_proj's contract: attention, then o_proj and the residual add."""
    return ref_qmv(ref_decode_attention(qkv, q_norm, k_norm, start, n_valid, keys, values, **kw), o_proj,
                   residual=residual)
