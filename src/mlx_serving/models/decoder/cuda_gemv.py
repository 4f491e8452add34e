"""A 4-bit matrix-vector product for few decode rows, fused with what surrounds it (MLX's CUDA build).

At one to a few rows a decode step of a small model is bound by how many primitives MLX records
per token (issue 43: each costs host time to encode into MLX's CUDA graph), not by the bytes of
the weights. :func:`qmv` reads an MLX affine 4-bit matrix (packed ``uint32``, one scale and bias
per ``group_size`` inputs) and dequantizes in registers, and folds into the same launch:

- ``norm``: the RMSNorm of the input rows (the layer's input or post-attention norm, or the final
  norm before the head), computed by every thread block on its own copy of the rows;
- ``residual``: the residual add after o_proj / down_proj;
- ``glu``: SwiGLU over a fused [gate | up] matrix (each warp takes gate row c and up row I + c).

- the merge of split-K attention's partials (:func:`attention_o_proj`): o_proj stages its input
  from them, so attention needs no combine kernel.

So a layer's decode is five launches (qkv, attention, o_proj, gate/up, down_proj) where the
kernels of :mod:`.cuda_kernels` with MLX's ``quantized_matmul`` take nine. Roundings follow the
separate operations: the normed input is rounded to the activation dtype as ``mx.fast.rms_norm``
rounds it, the product is rounded before the residual add or SwiGLU.
"""

from __future__ import annotations

import mlx.core as mx

from .._weights import Linear
from .cuda_kernels import _as, _kernel, decode_attention_partials, sm_count, split_count

__all__ = ["MAX_ROWS", "attention_o_proj", "fits", "qmv"]

#: Most rows one call takes. The kernel stages NR rows, but with its loops rolled 4 rows ran slower
#: than MLX's matmuls on an H200 (issue 43, lease 3: 4.72 vs 2.73 ms a step), so it takes one row.
MAX_ROWS = 1
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
    if constexpr (COMB) {
        // x is attention's split-K partials: per (row b, head h) pair p = b * NH + h and split s, the
        // running max and sum pml[(p * splits + s) * 2 + {0, 1}] and weighted values pacc[(.. ) * HD + d];
        // merged as decode_attention's combine kernel merges them
        constexpr int NH = K / HD;
        __shared__ float cw[NR * NH * 32];
        __shared__ float cden[NR * NH];
        #pragma unroll 1
        for (int p = warp; p < NR * NH; p += NW) {
            const float m = lane < splits ? pml[((u64)p * splits + lane) * 2] : -INF;
            float top = m;
            for (int off = 16; off > 0; off >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, off));
            cw[p * 32 + lane] = (m == -INF) ? 0.f : expf(m - top);
            __syncwarp();
            if (lane == 0) {
                float den = 0.f;
                #pragma unroll 1
                for (int q = 0; q < splits; ++q)
                    if (pml[((u64)p * splits + q) * 2] != -INF) den += pml[((u64)p * splits + q) * 2 + 1] * cw[p * 32 + q];
                cden[p] = den;
            }
        }
        __syncthreads();
        #pragma unroll 1
        for (int b = 0; b < NR; ++b) {
            T* row = (T*)(xs + b * RW);
            #pragma unroll 1
            for (int k = t; k < K; k += NW * 32) {
                const int p = b * NH + k / HD;
                float num = 0.f;
                #pragma unroll 1
                for (int q = 0; q < splits; ++q) {
                    const float c = cw[p * 32 + q];
                    if (pml[((u64)p * splits + q) * 2] != -INF) num += pacc[((u64)p * splits + q) * HD + k % HD] * c;
                }
                row[(k / CH) * SW * EPW + k % CH] = st(cden[p] > 0.f ? num / cden[p] : 0.f);
            }
        }
    }
    #pragma unroll 1
    for (int b = 0; b < NR && !COMB; ++b) {
        const T* xr = x + (u64)b * K;
        float inv = 1.f;
        if (NORM) {
            float ss = 0.f;
            #pragma unroll 1
            for (int k = t; k < K; k += NW * 32) { const float v = ld(xr[k]); ss += v * v; }
            inv = rsqrtf(block_sum<NW>(ss, red) / (float)K + EPS);
        }
        T* row = (T*)(xs + b * RW);
        #pragma unroll 1
        for (int k = t; k < K; k += NW * 32) {
            float v = ld(xr[k]);
            if (NORM) v = ld(st(ld(st(v * inv)) * ld(nw[k])));
            row[(k / CH) * SW * EPW + k % CH] = st(v);
        }
    }
    __syncthreads();
    // loops are kept rolled on purpose: MLX hashes a kernel's whole cubin at every launch (~0.25 us
    // per KB on an H200's host, bench/gpu_launch_cost.py), which costs more than the loop overhead
    #pragma unroll 1
    for (int c = blockIdx.x * NW + warp; c < NOUT; c += gridDim.x * NW) {
        #pragma unroll 1
        for (int b = 0; b < NR; ++b) {
            float acc0 = 0.f, acc1 = 0.f;
            #pragma unroll 1
            for (int p = 0; p <= GLU; ++p) {
                const u64 n = (u64)c + (u64)p * NOUT;
                const unsigned int* wr = wq + n * (K / 8);
                float a = 0.f;
                #pragma unroll 1
                for (int i = 0; i < ITERS; ++i) {
                    const int w0 = (i * 32 + lane) * VW;
                    unsigned int wv[VW];
                    if constexpr (VW == 4) {
                        const uint4 v = *(const uint4*)(wr + w0);
                        wv[0] = v.x; wv[1] = v.y; wv[2] = v.z; wv[3] = v.w;
                    } else if constexpr (VW == 2) {
                        const uint2 v = *(const uint2*)(wr + w0);
                        wv[0] = v.x; wv[1] = v.y;
                    } else {
                        wv[0] = wr[w0];
                    }
                    const float s = ld(sc[n * (K / G) + w0 * 8 / G]);
                    const float z = ld(bi[n * (K / G) + w0 * 8 / G]);
                    const T* xc = (const T*)(xs + b * RW + (i * 32 + lane) * SW);
                    float dq = 0.f, sx = 0.f;
                    #pragma unroll
                    for (int v = 0; v < VW; ++v) {
                        #pragma unroll 1
                        for (int e = 0; e < 8; ++e) {
                            const float xv = ld(xc[v * 8 + e]);
                            dq += xv * (float)((wv[v] >> (4 * e)) & 15u);
                            sx += xv;
                        }
                    }
                    a += s * dq + z * sx;
                }
                for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffff, a, off);
                if (p == 0) acc0 = a; else acc1 = a;
            }
            if (lane == 0) {
                float y = ld(st(acc0));
                if (GLU) {
                    const float u = ld(st(acc1));
                    y = y / (1.f + expf(-y)) * u;
                } else if (RES) {
                    y = ld(res[(u64)b * NOUT + c]) + y;
                }
                out[(u64)b * NOUT + c] = st(y);
            }
        }
    }
"""

_SIGNATURE = ("const T* x, const float* pacc, const float* pml, const T* nw, const unsigned int* wq, const T* sc, "
              "const T* bi, const T* res, T* out, int splits")


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
    return _launch(lin, b, k, x.dtype, [x, x, x], norm, eps, residual, glu, (("COMB", 0), ("HD", 1)), 1)


def attention_o_proj(qkv: mx.array, q_norm: mx.array | None, k_norm: mx.array | None, start: mx.array,
                     n_valid: mx.array, keys: mx.array, values: mx.array, *, o_proj: Linear, residual: mx.array,
                     heads: int, eps: float, rope_theta: float, block_table: mx.array, block_size: int) -> mx.array:
    """``residual + o_proj(decode_attention(qkv, ...))`` (B, hidden) in two launches: the split-K
    attention kernel (:func:`.cuda_kernels.decode_attention_partials`, at least two splits) and the
    4-bit o_proj, which merges the splits' partials as it stages its input (rounded to the dtype,
    as the combine kernel rounds them). Arguments as :func:`.cuda_kernels.decode_attention`;
    ``o_proj`` must :func:`fit <fits>` B rows. Raises ValueError as those two."""
    b, d = qkv.shape[0], keys.shape[2]
    splits = max(2, split_count(b, keys.shape[1]))
    part_acc, part_ml = decode_attention_partials(qkv, q_norm, k_norm, start, n_valid, keys, values, heads=heads,
                                                  eps=eps, rope_theta=rope_theta, block_table=block_table,
                                                  block_size=block_size, splits=splits)
    return _launch(o_proj, b, heads * d, qkv.dtype, [qkv, part_acc, part_ml], None, eps, residual, False,
                   (("COMB", 1), ("HD", d)), splits)


def _launch(lin: Linear, b: int, k: int, dtype: mx.Dtype, x: list[mx.array], norm: mx.array | None, eps: float,
            residual: mx.array | None, glu: bool, comb: tuple[tuple[str, int], ...], splits: int) -> mx.array:
    """The qmv kernel over ``x`` = [rows (B, K) (COMB 0), partials acc, partials max/sum (COMB 1)]."""
    scales, biases, spec = lin.scales, lin.biases, lin.spec
    if not fits(lin, b, dtype) or lin.weight.shape[1] * 8 != k or scales is None or biases is None or spec is None:
        raise ValueError(f"qmv: {b} rows of {k} {dtype} do not fit the matrix {lin.weight.shape}")
    n = lin.weight.shape[0] // (2 if glu else 1)
    if (residual is not None and (glu or residual.shape != (b, n))) or (norm is not None and norm.shape != (k,)):
        raise ValueError(f"qmv: residual {None if residual is None else residual.shape}, norm "
                         f"{None if norm is None else norm.shape}, glu {glu}, output ({b}, {n})")
    consts = (("K", k), ("G", spec.group_size), ("VW", _vector_words(k)), ("NR", b), ("NOUT", n),
              ("NORM", int(norm is not None)), ("RES", int(residual is not None)), ("GLU", int(glu)),
              ("EPS", float(eps)), *comb)
    kernel = _kernel("qmv", dtype, consts, _SIGNATURE, _QMV)
    rows = x[0]  # also stands in for an absent norm or residual (never read)
    inputs = [*x, rows if norm is None else _as(norm, dtype), lin.weight, scales, biases,
              rows if residual is None else residual]
    blocks = min(-(-n // _WARPS), 8 * sm_count())
    return kernel(inputs, [(b, n)], [dtype], [splits], grid=(blocks * 32 * _WARPS, 1, 1),
                  threadgroup=(32 * _WARPS, 1, 1), shared_memory=_staged_bytes(b, k, dtype))[0]
