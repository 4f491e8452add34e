"""A 4-bit matrix-vector product for few decode rows, fused with what surrounds it (MLX's CUDA build).

At one to a few rows a decode step of a small model is bound by how many primitives MLX records
per token (issue 43: each costs host time to encode into MLX's CUDA graph), not by the bytes of
the weights. :func:`qmv` reads an MLX affine 4-bit matrix (packed ``uint32``, one scale and bias
per ``group_size`` inputs) and dequantizes in registers, and folds into the same launch:

- ``norm``: the RMSNorm of the input rows (the layer's input or post-attention norm, or the final
  norm before the head), computed by every thread block on its own copy of the rows;
- ``residual``: the residual add after o_proj / down_proj;
- ``glu``: SwiGLU over a fused [gate | up] matrix (each warp takes gate row c and up row I + c).

So a layer's decode is five launches (qkv, attention, o_proj, gate/up, down_proj) where the
kernels of :mod:`.cuda_kernels` with MLX's ``quantized_matmul`` take eight. Roundings follow the
separate operations: the normed input is rounded to the activation dtype as ``mx.fast.rms_norm``
rounds it, the product is rounded before the residual add or SwiGLU.
"""

from __future__ import annotations

import mlx.core as mx

from .._weights import Linear
from .cuda_kernels import _as, _kernel, sm_count

__all__ = ["MAX_ROWS", "fits", "qmv"]

#: Most rows one call takes (the input rows are staged in shared memory and each row holds registers
#: per lane: 161 at 4 rows with SwiGLU, spilling at 8; more rows: MLX's matmul).
MAX_ROWS = 4
_SHARED_BYTES = 48 * 1024  # the shared memory a block gets without opting in
_WARPS = 8

_QMV = r"""
    // block: 8 warps; warp w of block j computes output columns c = j * 8 + w, + 8 * gridDim.x ...
    // lane l reads VW packed words (8 * VW inputs, one quantization group) per iteration.
    constexpr int NW = 8;
    constexpr int CH = 8 * VW;
    constexpr int ITERS = K / (32 * CH);
    constexpr int EPW = 4 / (int)sizeof(T);
    constexpr int SW = CH / EPW + 1;       // 32-bit words per staged chunk: odd, so no bank conflicts
    constexpr int RW = (K / CH) * SW;      // words per staged row
    extern __shared__ unsigned int xs[];
    __shared__ float red[NW];
    const int t = threadIdx.x, warp = t / 32, lane = t % 32;
    for (int b = 0; b < NR; ++b) {
        const T* xr = x + (u64)b * K;
        float inv = 1.f;
        if (NORM) {
            float ss = 0.f;
            for (int k = t; k < K; k += NW * 32) { const float v = ld(xr[k]); ss += v * v; }
            inv = rsqrtf(block_sum<NW>(ss, red) / (float)K + EPS);
        }
        T* row = (T*)(xs + b * RW);
        for (int k = t; k < K; k += NW * 32) {
            float v = ld(xr[k]);
            if (NORM) v = ld(st(ld(st(v * inv)) * ld(nw[k])));
            row[(k / CH) * SW * EPW + k % CH] = st(v);
        }
    }
    __syncthreads();
    for (int c = blockIdx.x * NW + warp; c < NOUT; c += gridDim.x * NW) {
        float acc[GLU + 1][NR];
        #pragma unroll
        for (int p = 0; p <= GLU; ++p) {
            const u64 n = (u64)c + (u64)p * NOUT;
            const unsigned int* wr = wq + n * (K / 8);
            unsigned int wv[ITERS][VW];
            float s[ITERS], z[ITERS];
            #pragma unroll
            for (int i = 0; i < ITERS; ++i) {
                const int w0 = (i * 32 + lane) * VW;
                if constexpr (VW == 4) {
                    const uint4 v = *(const uint4*)(wr + w0);
                    wv[i][0] = v.x; wv[i][1] = v.y; wv[i][2] = v.z; wv[i][3] = v.w;
                } else if constexpr (VW == 2) {
                    const uint2 v = *(const uint2*)(wr + w0);
                    wv[i][0] = v.x; wv[i][1] = v.y;
                } else {
                    wv[i][0] = wr[w0];
                }
                s[i] = ld(sc[n * (K / G) + w0 * 8 / G]);
                z[i] = ld(bi[n * (K / G) + w0 * 8 / G]);
            }
            #pragma unroll
            for (int b = 0; b < NR; ++b) {
                float a = 0.f;
                #pragma unroll
                for (int i = 0; i < ITERS; ++i) {
                    const T* xc = (const T*)(xs + b * RW + (i * 32 + lane) * SW);
                    float dq = 0.f, sx = 0.f;
                    #pragma unroll
                    for (int v = 0; v < VW; ++v) {
                        #pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            const float xv = ld(xc[v * 8 + e]);
                            dq += xv * (float)((wv[i][v] >> (4 * e)) & 15u);
                            sx += xv;
                        }
                    }
                    a += s[i] * dq + z[i] * sx;
                }
                for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffff, a, off);
                acc[p][b] = a;
            }
        }
        if (lane == 0) {
            #pragma unroll
            for (int b = 0; b < NR; ++b) {
                float y = ld(st(acc[0][b]));
                if (GLU) {
                    const float u = ld(st(acc[GLU][b]));
                    y = y / (1.f + expf(-y)) * u;
                } else if (RES) {
                    y = ld(res[(u64)b * NOUT + c]) + y;
                }
                out[(u64)b * NOUT + c] = st(y);
            }
        }
    }
"""

_SIGNATURE = "const T* x, const T* nw, const unsigned int* wq, const T* sc, const T* bi, const T* res, T* out"


def _vector_words(k: int) -> int:
    """Packed words each lane reads per iteration: 4 (16-byte loads) where ``k`` allows."""
    return next(v for v in (4, 2, 1) if k % (256 * v) == 0)


def _staged_bytes(rows: int, k: int, dtype: mx.Dtype) -> int:
    words_per_chunk = 8 * _vector_words(k) * dtype.size // 4 + 1
    return rows * (k // (8 * _vector_words(k))) * words_per_chunk * 4


def fits(lin: Linear | None, rows: int, dtype: mx.Dtype) -> bool:
    """True when :func:`qmv` computes ``lin`` for ``rows`` rows of ``dtype`` activations: MLX affine
    4-bit, group size 32, 64 or 128, no bias, scales and biases in ``dtype``, an input width that is
    a multiple of 256, at most :data:`MAX_ROWS` rows whose staged copy fits a block's shared memory."""
    if lin is None or lin.scales is None or lin.biases is None or lin.spec is None or lin.bias is not None:
        return False
    spec, k = lin.spec, lin.weight.shape[1] * 8
    return (spec.mode == "affine" and spec.bits == 4 and spec.group_size in (32, 64, 128) and k % 256 == 0
            and lin.scales.dtype == dtype and lin.biases.dtype == dtype and dtype.size in (2, 4)
            and 1 <= rows <= MAX_ROWS and _staged_bytes(rows, k, dtype) <= _SHARED_BYTES)


def qmv(x: mx.array, lin: Linear, *, norm: mx.array | None = None, eps: float = 0.0,
        residual: mx.array | None = None, glu: bool = False) -> mx.array:
    """``lin`` applied to ``x`` (B, K) -> (B, N) in ``x``'s dtype, ``lin`` an MLX affine 4-bit
    (N, K) matrix that :func:`fits` B rows.

    ``norm`` (K,): the rows are ``rms_norm(x) * norm`` (epsilon ``eps``) first; ``residual``
    (B, N): added to the product (rounded to the dtype first); ``glu``: ``lin`` is a fused
    [gate | up] matrix (2I, K) and the result is ``silu(gate) * up`` (B, I). Raises ValueError when
    the matrix or the shapes do not fit, or when both ``residual`` and ``glu`` are asked for.
    """
    b, k = x.shape
    scales, biases, spec = lin.scales, lin.biases, lin.spec
    if not fits(lin, b, x.dtype) or lin.weight.shape[1] * 8 != k or scales is None or biases is None or spec is None:
        raise ValueError(f"qmv: x {x.shape} {x.dtype} does not fit the matrix {lin.weight.shape}")
    n = lin.weight.shape[0] // (2 if glu else 1)
    if (residual is not None and (glu or residual.shape != (b, n))) or (norm is not None and norm.shape != (k,)):
        raise ValueError(f"qmv: residual {None if residual is None else residual.shape}, norm "
                         f"{None if norm is None else norm.shape}, glu {glu}, output ({b}, {n})")
    consts = (("K", k), ("G", spec.group_size), ("VW", _vector_words(k)), ("NR", b), ("NOUT", n),
              ("NORM", int(norm is not None)), ("RES", int(residual is not None)), ("GLU", int(glu)),
              ("EPS", float(eps)))
    kernel = _kernel("qmv", x.dtype, consts, _SIGNATURE, _QMV)
    inputs = [x, x if norm is None else _as(norm, x.dtype), lin.weight, scales, biases,
              x if residual is None else residual]  # x stands in for an absent norm or residual (never read)
    blocks = min(-(-n // _WARPS), 8 * sm_count())
    return kernel(inputs, [(b, n)], [x.dtype], [], grid=(blocks * 32 * _WARPS, 1, 1),
                  threadgroup=(32 * _WARPS, 1, 1), shared_memory=_staged_bytes(b, k, x.dtype))[0]
