"""Custom CUDA kernels for the decode step (MLX's CUDA build only).

On a GPU a decode step of a small model is bound by the number of operations MLX records
and launches per token (measured ~8-10 us each on an H200, bench/gpu_step.py), not by
arithmetic or memory traffic. These kernels cut a layer's decode work from ~29 graph
nodes to 8 (four of them the projections):

- :func:`decode_attention`: per (row, KV head) block, from the fused q/k/v projection:
  q_norm/k_norm (RMSNorm, where the family has them: Qwen3 does, Llama and Qwen2 do not),
  split-half RoPE at the row's position, the new K/V written into the KV cache, then one-token GQA attention of the ``G = H / Hkv`` query heads over
  the row's valid prefix with an online softmax (running max and sum; Milakov &
  Gimelshein, arXiv:1805.02867), warps splitting the keys and merged through shared memory;
  the cache is the paged KV cache, read through each row's block table; when
  rows x KV heads leave the GPU's SMs idle, several blocks share each row's keys and a second
  kernel merges their partial softmax sums (split-K, flash-decoding).
- :func:`add_rms_norm`: residual add and the next RMSNorm in one pass.
- :func:`swiglu`: ``silu(gate) * up`` straight from the fused gate/up projection.

The K/V write is in place: the kernel writes into the cache buffers it receives as inputs
(which MLX treats as read-only), so the cache needs no scatter and no new arrays per step.
That is safe here because the cache is always contiguous (no copy is made for the kernel)
and every reader of those positions (this kernel, later steps) is ordered after the write
by its data dependence on the kernel's output.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
from functools import cache

import mlx.core as mx

from .cuda_build import CudaKernel
from .memory import on_cuda

__all__ = ["add_rms_norm", "decode_attention", "decode_attention_partials", "kernels_available", "split_count", "supports", "swiglu"]

# Every kernel's source starts with this prelude: the element type T behind ld()/st() (bfloat16 and
# float16 as raw 16-bit values converted in registers, so no CUDA header is needed and NVRTC compiles
# in a fraction of a second), u64 offsets and a block-wide sum.
_PRELUDE = r"""
typedef unsigned long long u64;
#define INF __int_as_float(0x7f800000)
__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
template <int NW>
__device__ float block_sum(float v, float* scratch) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
    __syncthreads();
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    float tot = 0.f;
    for (int w = 0; w < NW; ++w) tot += scratch[w];
    return tot;
}
"""

_DTYPES = {
    "float32": "typedef float T;\n"
               "__device__ __forceinline__ float ld(T x) { return x; }\n"
               "__device__ __forceinline__ T st(float x) { return x; }\n",
    # bfloat16: the high half of a float32; rounding to nearest even, NaN kept quiet
    "bfloat16": "typedef unsigned short T;\n"
                "__device__ __forceinline__ float ld(T x) { return __uint_as_float(((unsigned int)x) << 16); }\n"
                "__device__ __forceinline__ T st(float x) {\n"
                "    unsigned int u = __float_as_uint(x);\n"
                "    if ((u & 0x7fffffffu) > 0x7f800000u) return (T)((u >> 16) | 0x40u);\n"
                "    return (T)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);\n"
                "}\n",
    "float16": "typedef unsigned short T;\n"
               "__device__ __forceinline__ float ld(T x) { float f; asm(\"cvt.f32.f16 %0, %1;\" : \"=f\"(f) : \"h\"(x)); return f; }\n"
               "__device__ __forceinline__ T st(float x) { T r; asm(\"cvt.rn.f16.f32 %0, %1;\" : \"=h\"(r) : \"f\"(x)); return r; }\n",
}

_ATTENTION_SIGNATURE = ("const T* qkv, const T* q_w, const T* k_w, const int* start, const int* n_valid, T* keys, "
                        "T* values, const int* table")

_ATTENTION = r"""
    // block (g, b, split): threads = D; W = D / 32 warps; lane handles E = D / 32 dims of a head.
    // L: block-table width; splits_max: blocks sharing a row's keys; min_split: fewest keys each.
    constexpr int W = D / 32;
    constexpr int E = D / 32;
    constexpr int HALF = D / 2;
    const int g = blockIdx.x;
    const int b = blockIdx.y;
    const int split = blockIdx.z;
    const int t = threadIdx.x;
    const int warp = t / 32;
    const int lane = t % 32;
    const int pos = start[b];
    const bool real = n_valid[b] > 0;
    const int n = pos + (real ? 1 : 0);
    // element offset of position j's head-g vector in the cache (blocks * BS, HKV, D), through
    // row b's block table (b, L); the row's block ids are staged in (dynamic) shared memory first,
    // so that the key loop's address needs no dependent global load per key
    extern __shared__ int tab[];
    const int nb = imin((n + BS - 1) / BS, L);
    for (int i = t; i < nb; i += D) tab[i] = table[(u64)b * L + i];
    __syncthreads();
    auto kv_at = [&](int j) -> u64 {
        return (((u64)tab[j / BS] * BS + j % BS) * HKV + g) * D;
    };
    __shared__ float red[W];
    __shared__ float rot[D];
    __shared__ float qs[G][D];
    __shared__ float kself[D];
    __shared__ float vself[D];

    // q/k heads: RMSNorm (weight; QKN 0: none), then RoPE (split halves) at position pos.
    const T* row = qkv + (u64)b * (H + 2 * HKV) * D;
    const float freq = exp2f(-(float)(2 * (t % HALF)) / (float)D * LOG2_BASE);
    float sn, cs;
    sincosf((float)pos * freq, &sn, &cs);
    for (int j = 0; j <= G; ++j) {
        const bool is_k = j == G;
        const float x = ld(row[(is_k ? H + g : g * G + j) * D + t]);
        float nv = x;
        if (QKN) {
            const float inv = rsqrtf(block_sum<W>(x * x, red) / (float)D + EPS);
            const float wt = ld((is_k ? k_w : q_w)[t]);
            nv = ld(st(ld(st(x * inv)) * wt));
        }
        rot[t] = nv;
        __syncthreads();
        const float other = rot[t < HALF ? t + HALF : t - HALF];
        const float o = ld(st(t < HALF ? nv * cs - other * sn : nv * cs + other * sn));
        __syncthreads();
        if (!is_k) {
            qs[j][t] = o;
        } else {
            kself[t] = ld(st(o));
            if (real && split == 0) keys[kv_at(pos) + t] = st(o);
        }
    }
    vself[t] = ld(row[(H + HKV + g) * D + t]);
    if (real && split == 0) {
        values[kv_at(pos) + t] = row[(H + HKV + g) * D + t];
    }
    __syncthreads();

    // attention over keys 0..n-1 of slot b, KV head g; warp w takes keys w, w + W, ...
    const float scale = rsqrtf((float)D);
    float m[G], l[G], acc[G][E];
    for (int h = 0; h < G; ++h) {
        m[h] = -INF;
        l[h] = 0.f;
        for (int e = 0; e < E; ++e) acc[h][e] = 0.f;
    }
    auto visit = [&](const float* kf, const float* vf) {
        for (int h = 0; h < G; ++h) {
            float s = 0.f;
            for (int e = 0; e < E; ++e) s += qs[h][lane * E + e] * kf[e];
            for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
            s *= scale;
            const float mn = fmaxf(m[h], s);
            const float c = expf(m[h] - mn);
            const float p = expf(s - mn);
            l[h] = l[h] * c + p;
            for (int e = 0; e < E; ++e) acc[h][e] = acc[h][e] * c + p * vf[e];
            m[h] = mn;
        }
    };
    // keys before pos come from the cache: this block's share of them (split-K over blockIdx.z,
    // flash-decoding; at most one split per min_split keys); the new key (pos) from registers
    const int splits = imin(splits_max, imax(1, (pos + min_split - 1) / min_split));
    const int per = (pos + splits - 1) / splits;
    const int lo = split * per;
    const int hi = split < splits ? imin(pos, lo + per) : lo;
    for (int j = lo + warp; j < hi; j += W) {
        const u64 at = kv_at(j) + lane * E;
        const T* kr = keys + at;
        const T* vr = values + at;
        float kf[E], vf[E];
        for (int e = 0; e < E; ++e) { kf[e] = ld(kr[e]); vf[e] = ld(vr[e]); }
        visit(kf, vf);
    }
    if (real && split == 0 && warp == (pos % W)) {
        float kf[E], vf[E];
        for (int e = 0; e < E; ++e) { kf[e] = kself[lane * E + e]; vf[e] = vself[lane * E + e]; }
        visit(kf, vf);
    }
    __shared__ float sm_m[W][G];
    __shared__ float sm_l[W][G];
    __shared__ float sm_acc[W][G][D];
    for (int h = 0; h < G; ++h) {
        if (lane == 0) { sm_m[warp][h] = m[h]; sm_l[warp][h] = l[h]; }
        for (int e = 0; e < E; ++e) sm_acc[warp][h][lane * E + e] = acc[h][e];
    }
    __syncthreads();
    for (int h = 0; h < G; ++h) {
        float top = -INF;
        for (int w = 0; w < W; ++w) top = fmaxf(top, sm_m[w][h]);
        float den = 0.f, num = 0.f;
        if (top > -INF) {
            for (int w = 0; w < W; ++w) {
                const float c = expf(sm_m[w][h] - top);
                den += sm_l[w][h] * c;
                num += sm_acc[w][h][t] * c;
            }
        }
        out[((u64)b * H + g * G + h) * D + t] = st(den > 0.f ? num / den : 0.f);
    }
"""

# the split-K variant writes each split's unnormalized partial (running max, sum, weighted values);
# its loops stay rolled: it serves few rows, where MLX's host work per launch, which grows with the
# cubin's size (it hashes the binary at every launch), costs more than the loop overhead
_ATTENTION_SPLIT = _ATTENTION.replace(
    "    for (int j = 0; j <= G; ++j) {", "    #pragma unroll 1\n    for (int j = 0; j <= G; ++j) {").replace(
    "    for (int j = lo + warp; j < hi; j += W) {", "    #pragma unroll 1\n    for (int j = lo + warp; j < hi; j += W) {").replace(
    "        out[((u64)b * H + g * G + h) * D + t] = st(den > 0.f ? num / den : 0.f);",
    """        const u64 slot = ((u64)b * H + g * G + h) * splits_max + split;
        part_acc[slot * D + t] = num;
        if (t == 0) { part_ml[slot * 2] = top; part_ml[slot * 2 + 1] = den; }""")

_COMBINE = r"""
    // block (h, b): threads D; merge the splits partials of query head h of row b.
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int t = threadIdx.x;
    const u64 base = ((u64)b * H + h) * splits;
    float top = -INF;
    for (int s = 0; s < splits; ++s) top = fmaxf(top, part_ml[(base + s) * 2]);
    float den = 0.f, num = 0.f;
    if (top > -INF) {
        for (int s = 0; s < splits; ++s) {
            const float m = part_ml[(base + s) * 2];
            if (m == -INF) continue;
            const float c = expf(m - top);
            den += part_ml[(base + s) * 2 + 1] * c;
            num += part_acc[(base + s) * D + t] * c;
        }
    }
    out[((u64)b * H + h) * D + t] = st(den > 0.f ? num / den : 0.f);
"""

_ADD_RMS_NORM = r"""
    // block r: threads BLK, each N / BLK features of row r.
    constexpr int PER = N / BLK;
    const int r = blockIdx.x;
    __shared__ float red[BLK / 32];
    float vals[PER];
    float ss = 0.f;
    for (int k = 0; k < PER; ++k) {
        const u64 i = (u64)r * N + threadIdx.x + k * BLK;
        const T s = st(ld(h[i]) + ld(delta[i]));
        h_out[i] = s;
        vals[k] = ld(s);
        ss += vals[k] * vals[k];
    }
    const float inv = rsqrtf(block_sum<BLK / 32>(ss, red) / (float)N + EPS);
    for (int k = 0; k < PER; ++k) {
        const int c = threadIdx.x + k * BLK;
        const float nv = ld(st(vals[k] * inv));
        x_out[(u64)r * N + c] = st(nv * ld(w[c]));
    }
"""

_SWIGLU = r"""
    const u64 idx = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (u64)rows * I) return;
    const u64 r = idx / I, c = idx % I;
    const float g = ld(gu[r * 2 * I + c]);
    const float u = ld(gu[r * 2 * I + I + c]);
    out[idx] = st(g / (1.f + expf(-g)) * u);
"""


def _float(x: float) -> str:
    """A float32 literal of ``x`` for CUDA C++."""
    return f"{float(x)!r}f"


@cache
def _kernel(name: str, dtype: mx.Dtype, constants: tuple[tuple[str, int | float], ...], signature: str,
            body: str) -> CudaKernel:
    """``extern "C" __global__ void <name>_<digest>(signature) { body }`` with ``constants`` as
    ``constexpr`` values and ``T`` the element type of ``dtype``: one cubin per distinct source
    (cuda_build.py), whatever the shapes of a call."""
    consts = "".join(f"constexpr {'float' if isinstance(v, float) else 'int'} {k} = "
                     f"{_float(v) if isinstance(v, float) else v};\n" for k, v in constants)
    dtype_name = str(dtype).split(".")[-1]
    if dtype_name not in _DTYPES:
        raise ValueError(f"the decode kernels take float32, bfloat16 or float16, got {dtype_name}")
    head = _DTYPES[dtype_name] + _PRELUDE + consts
    digest = hashlib.sha256((head + signature + body).encode()).hexdigest()[:12]
    symbol = f"mlxs_{name}_{digest}"
    source = f'{head}\nextern "C" __global__ void {symbol}({signature}) {{\n{body}\n}}\n'
    return CudaKernel(symbol, source)


def _attention_kernel(dtype: mx.Dtype, split: bool, consts: tuple[tuple[str, int | float], ...]) -> CudaKernel:
    outs = "float* part_acc, float* part_ml" if split else "T* out"
    return _kernel("decode_attention_split" if split else "decode_attention", dtype, consts,
                   f"{_ATTENTION_SIGNATURE}, {outs}, int L, int splits_max, int min_split",
                   _ATTENTION_SPLIT if split else _ATTENTION)


#: Streaming multiprocessors assumed when the CUDA driver cannot be asked (an H100 / H200's 132).
DEFAULT_SMS = 132
_CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16  # CUdevice_attribute, CUDA driver API (cuda.h)
#: Most thread blocks sharing one (row, KV head)'s keys, and the fewest keys each takes.
MAX_SPLITS = 32
MIN_SPLIT_KEYS = 64
#: Most block-table columns the paged kernel stages in shared memory (16 KiB of int32 ids: with
#: 16-token blocks, sequences of up to 65,536 positions).
MAX_TABLE_WIDTH = 4096
_NO_NORM = mx.ones((1,), dtype=mx.float32)  # the unused q/k norm weights of a family without them


def _int32(a: mx.array) -> mx.array:
    return a if a.dtype == mx.int32 else a.astype(mx.int32)  # no extra graph node when already int32


def kernels_available() -> bool:
    """True when the default device is a GPU of MLX's CUDA build (where these kernels run)."""
    return on_cuda()


def supports(hidden_size: int, head_dim: int) -> bool:
    """True when these kernels handle a model of this shape (both multiples of 32, head_dim
    at most 1024: one thread per head dimension)."""
    return hidden_size % 32 == 0 and head_dim % 32 == 0 and head_dim <= 1024


def decode_attention(qkv: mx.array, q_norm: mx.array | None, k_norm: mx.array | None, start: mx.array,
                     n_valid: mx.array, keys: mx.array, values: mx.array, *, heads: int, eps: float,
                     rope_theta: float, block_table: mx.array, block_size: int,
                     splits: int | None = None) -> mx.array:
    """One decode token per row: q/k norm, RoPE, K/V cache write (in place), attention.

    ``qkv`` (B, (H + 2 Hkv) * D): the fused q/k/v projection of rows ``0..B-1``; ``q_norm``/``k_norm``
    (D,) RMSNorm weights (epsilon ``eps``), or both None for a family without q/k norm; ``start``
    (B,) int32 each row's position (its cache length before this token); ``n_valid`` (B,) int32, 1
    for a real row, 0 for padding (nothing written or read, output unused). The cache, one layer's
    buffers, contiguous: ``keys``/``values`` (num_blocks * block_size, Hkv, D) and ``block_table``
    (B, W) int32, row b's KV blocks in order; position j of row b lives at cache row
    ``block_table[b, j // block_size] * block_size + j % block_size`` (the block of position
    ``start`` must be in the table; W at most :data:`MAX_TABLE_WIDTH`).

    RoPE: split halves, base ``rope_theta``. Attention scale ``D ** -0.5`` over positions
    ``0..start`` (the new token included). ``splits``: thread blocks per (row, KV head) sharing
    its keys (split-K; their partial softmax sums merged by a second kernel), default
    :func:`split_count`; 1 is the one-kernel path. Returns (B, H * D) in ``qkv``'s dtype (head-major).
    H = ``heads`` must be a multiple of Hkv; D a multiple of 32, at most 1024. Raises ValueError
    on shape mismatch.
    """
    b, _ = qkv.shape
    hkv, d = keys.shape[1], keys.shape[2]
    splits = split_count(b, hkv) if splits is None else splits
    if splits == 1:
        inputs, consts, length = _attention_args(qkv, q_norm, k_norm, start, n_valid, keys, values, heads, eps,
                                                 rope_theta, block_table, block_size)
        return _attention_kernel(qkv.dtype, False, consts)(
            inputs, [(b, heads * d)], [qkv.dtype], [length, 1, 1], grid=(hkv * d, b, 1), threadgroup=(d, 1, 1),
            shared_memory=4 * length)[0]
    part_acc, part_ml = decode_attention_partials(qkv, q_norm, k_norm, start, n_valid, keys, values, heads=heads,
                                                  eps=eps, rope_theta=rope_theta, block_table=block_table,
                                                  block_size=block_size, splits=splits)
    combine = _kernel("decode_attention_combine", qkv.dtype, (("H", heads), ("D", d)),
                      "const float* part_acc, const float* part_ml, T* out, int splits", _COMBINE)
    return combine([part_acc, part_ml], [(b, heads * d)], [qkv.dtype], [splits], grid=(heads * d, b, 1),
                   threadgroup=(d, 1, 1))[0]


def decode_attention_partials(qkv: mx.array, q_norm: mx.array | None, k_norm: mx.array | None, start: mx.array,
                              n_valid: mx.array, keys: mx.array, values: mx.array, *, heads: int, eps: float,
                              rope_theta: float, block_table: mx.array, block_size: int,
                              splits: int) -> tuple[mx.array, mx.array]:
    """:func:`decode_attention`'s first kernel alone, ``splits`` (>= 1) blocks per (row, KV head): the
    per-split partials for a consumer that merges them itself. Returns float32 ``part_acc``
    (B * H * splits * D,) (unnormalized weighted values) and ``part_ml`` (B * H * splits * 2,) (running
    max, running sum), at index ``(b * H + h) * splits + s``; a split with no keys has max -inf.
    Merged: ``sum_s acc_s exp(m_s - M) / sum_s l_s exp(m_s - M)`` over splits with ``m_s > -inf``,
    ``M`` their max (0 where none). Raises ValueError as :func:`decode_attention`."""
    b, _ = qkv.shape
    hkv, d = keys.shape[1], keys.shape[2]
    inputs, consts, length = _attention_args(qkv, q_norm, k_norm, start, n_valid, keys, values, heads, eps,
                                             rope_theta, block_table, block_size)
    part_acc, part_ml = _attention_kernel(qkv.dtype, True, consts)(
        inputs, [(b * heads * splits * d,), (b * heads * splits * 2,)], [mx.float32, mx.float32],
        [length, splits, MIN_SPLIT_KEYS], grid=(hkv * d, b, splits), threadgroup=(d, 1, 1), shared_memory=4 * length)
    return part_acc, part_ml


def _attention_args(qkv: mx.array, q_norm: mx.array | None, k_norm: mx.array | None, start: mx.array,
                    n_valid: mx.array, keys: mx.array, values: mx.array, heads: int, eps: float, rope_theta: float,
                    block_table: mx.array, block_size: int) -> tuple[list[mx.array], tuple, int]:
    """The attention kernels' checked inputs, constants and block-table width."""
    b, width = qkv.shape
    _, hkv, d = keys.shape
    if block_size < 1 or block_table.shape[0] != b or block_table.shape[1] > MAX_TABLE_WIDTH:
        raise ValueError(f"decode_attention: block_table {block_table.shape}, block_size {block_size}, rows {b}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("decode_attention: q_norm and k_norm are both given or both None")
    if width != (heads + 2 * hkv) * d or heads % hkv or d % 32 or d > 1024:
        raise ValueError(f"decode_attention: qkv {qkv.shape}, heads {heads}, keys {keys.shape}")
    if keys.dtype != qkv.dtype or values.dtype != qkv.dtype:
        raise ValueError(f"decode_attention: qkv {qkv.dtype}, cache {keys.dtype}/{values.dtype}: one dtype")
    norms = [_NO_NORM, _NO_NORM] if q_norm is None or k_norm is None else [_as(q_norm, qkv.dtype), _as(k_norm, qkv.dtype)]
    inputs = [qkv, *norms, _int32(start), _int32(n_valid), keys, values, _int32(block_table)]
    consts = (("G", heads // hkv), ("D", d), ("H", heads), ("HKV", hkv), ("BS", block_size),
              ("QKN", int(q_norm is not None)), ("EPS", float(eps)), ("LOG2_BASE", math.log2(rope_theta)))
    return inputs, consts, block_table.shape[1]


def _as(a: mx.array, dtype: mx.Dtype) -> mx.array:
    return a if a.dtype == dtype else a.astype(dtype)


def split_count(rows: int, kv_heads: int) -> int:
    """How many thread blocks share one (row, KV head)'s keys in :func:`decode_attention` (split-K,
    flash-decoding: Dao et al. 2023, "Flash-Decoding for long-context inference"): enough for
    about two blocks per SM of this GPU (:func:`sm_count`) when ``rows * kv_heads`` alone is
    fewer, at most :data:`MAX_SPLITS`; 1 when the batch fills the GPU. At run time a row uses at
    most one split per :data:`MIN_SPLIT_KEYS` keys, so short contexts stay on one."""
    return max(1, min(MAX_SPLITS, -(-2 * sm_count() // (rows * kv_heads))))


@cache
def sm_count() -> int:
    """Streaming multiprocessors of CUDA device 0 (the one MLX runs on; ``CUDA_VISIBLE_DEVICES``
    applies), read once from the CUDA driver (``cuDeviceGetAttribute``,
    ``CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT``); :data:`DEFAULT_SMS` where there is no driver
    (a CPU or Metal machine, where the kernels do not run)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        dev, count = ctypes.c_int(), ctypes.c_int()
        ok = (driver.cuInit(0) == 0 and driver.cuDeviceGet(ctypes.byref(dev), 0) == 0
              and driver.cuDeviceGetAttribute(ctypes.byref(count), _CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev) == 0)
    except (OSError, AttributeError):
        return DEFAULT_SMS
    return count.value if ok and count.value > 0 else DEFAULT_SMS


def add_rms_norm(h: mx.array, delta: mx.array, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """``(h + delta, rms_norm(h + delta) * weight)`` in one pass, both (B, N) in ``h``'s dtype.

    The sum is rounded to ``h``'s dtype before the norm (as two separate ops would do);
    the norm divides by ``sqrt(mean(x ** 2) + eps)``. N must be a multiple of 32.
    Raises ValueError on shape mismatch.
    """
    b, n = h.shape
    blk = math.gcd(n, 256)
    if delta.shape != h.shape or weight.shape != (n,) or blk % 32:
        raise ValueError(f"add_rms_norm: h {h.shape}, delta {delta.shape}, weight {weight.shape}")
    kernel = _kernel("add_rms_norm", h.dtype, (("N", n), ("BLK", blk), ("EPS", float(eps))),
                     "const T* h, const T* delta, const T* w, T* h_out, T* x_out", _ADD_RMS_NORM)
    h_out, x_out = kernel([h, _as(delta, h.dtype), _as(weight, h.dtype)], [(b, n), (b, n)], [h.dtype, h.dtype], [],
                          grid=(b * blk, 1, 1), threadgroup=(blk, 1, 1))
    return h_out, x_out


def swiglu(gate_up: mx.array) -> mx.array:
    """SwiGLU of a fused gate/up projection: ``gate_up`` (B, 2I) = [gate | up] ->
    ``silu(gate) * up`` (B, I), computed in float32 and rounded once to the input dtype.
    Raises ValueError when the last axis is odd."""
    b, width = gate_up.shape
    if width % 2:
        raise ValueError(f"swiglu: last axis {width} is not [gate | up]")
    i = width // 2
    threads = 256
    kernel = _kernel("swiglu", gate_up.dtype, (("I", i),), "const T* gu, T* out, int rows", _SWIGLU)
    return kernel([gate_up], [(b, i)], [gate_up.dtype], [b], grid=(-(-b * i // threads) * threads, 1, 1),
                  threadgroup=(threads, 1, 1))[0]
