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
import math
from functools import cache

import mlx.core as mx

__all__ = ["add_rms_norm", "decode_attention", "kernels_available", "split_count", "supports", "swiglu"]

_BLOCK_REDUCE = r"""
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

_ATTENTION = r"""
    // block (g, b): threads = D; W = D / 32 warps; lane handles E = D / 32 dims of a head.
    constexpr int W = D / 32;
    constexpr int E = D / 32;
    constexpr int HALF = D / 2;
    const int g = blockIdx.x;
    const int b = blockIdx.y;
    const int split = blockIdx.z;
    const int t = threadIdx.x;
    const int warp = t / 32;
    const int lane = t % 32;
    const int L = meta[0];  // block-table width
    const int pos = start[b];
    const bool real = n_valid[b] > 0;
    const int n = pos + (real ? 1 : 0);
    // element offset of position j's head-g vector in the cache (blocks * BS, HKV, D), through
    // row b's block table (b, L); the row's block ids are staged in shared memory first, so that
    // the key loop's address needs no dependent global load per key
    __shared__ int tab[TW];
    const int nb = min((n + BS - 1) / BS, L);
    for (int i = t; i < nb; i += D) tab[i] = table[(size_t)b * L + i];
    __syncthreads();
    auto kv_at = [&](int j) -> size_t {
        return (((size_t)tab[j / BS] * BS + j % BS) * HKV + g) * D;
    };
    __shared__ float red[W];
    __shared__ float rot[D];
    __shared__ float qs[G][D];
    __shared__ float kself[D];
    __shared__ float vself[D];

    // q/k heads: RMSNorm (weight; QKN 0: none), then RoPE (split halves) at position pos.
    const T* row = qkv + (size_t)b * (H + 2 * HKV) * D;
    const float freq = exp2f(-(float)(2 * (t % HALF)) / (float)D * LOG2_BASE);
    float sn, cs;
    sincosf((float)pos * freq, &sn, &cs);
    for (int j = 0; j <= G; ++j) {
        const bool is_k = j == G;
        const float x = static_cast<float>(row[(is_k ? H + g : g * G + j) * D + t]);
        float nv = x;
        if (QKN) {
            const float inv = rsqrtf(block_sum<W>(x * x, red) / (float)D + EPS);
            const float wt = static_cast<float>((is_k ? k_w : q_w)[t]);
            nv = static_cast<float>(static_cast<T>(static_cast<float>(static_cast<T>(x * inv)) * wt));
        }
        rot[t] = nv;
        __syncthreads();
        const float other = rot[t < HALF ? t + HALF : t - HALF];
        const float o = static_cast<float>(static_cast<T>(t < HALF ? nv * cs - other * sn : nv * cs + other * sn));
        __syncthreads();
        if (!is_k) {
            qs[j][t] = o;
        } else {
            kself[t] = static_cast<float>(static_cast<T>(o));
            if (real && split == 0) const_cast<T*>(keys)[kv_at(pos) + t] = static_cast<T>(o);
        }
    }
    vself[t] = static_cast<float>(row[(H + HKV + g) * D + t]);
    if (real && split == 0) {
        const_cast<T*>(values)[kv_at(pos) + t] = row[(H + HKV + g) * D + t];
    }
    __syncthreads();

    // attention over keys 0..n-1 of slot b, KV head g; warp w takes keys w, w + W, ...
    const float scale = rsqrtf((float)D);
    float m[G], l[G], acc[G][E];
    for (int h = 0; h < G; ++h) {
        m[h] = -INFINITY;
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
    // flash-decoding; at most one split per MIN_SPLIT keys); the new key (pos) from registers
    const int splits = min(SPLITS, max(1, (pos + MIN_SPLIT - 1) / MIN_SPLIT));
    const int per = (pos + splits - 1) / splits;
    const int lo = split * per;
    const int hi = split < splits ? min(pos, lo + per) : lo;
    for (int j = lo + warp; j < hi; j += W) {
        const size_t at = kv_at(j) + lane * E;
        const T* kr = keys + at;
        const T* vr = values + at;
        float kf[E], vf[E];
        for (int e = 0; e < E; ++e) { kf[e] = static_cast<float>(kr[e]); vf[e] = static_cast<float>(vr[e]); }
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
        float top = -INFINITY;
        for (int w = 0; w < W; ++w) top = fmaxf(top, sm_m[w][h]);
        float den = 0.f, num = 0.f;
        if (top > -INFINITY) {
            for (int w = 0; w < W; ++w) {
                const float c = expf(sm_m[w][h] - top);
                den += sm_l[w][h] * c;
                num += sm_acc[w][h][t] * c;
            }
        }
        out[((size_t)b * H + g * G + h) * D + t] = static_cast<T>(den > 0.f ? num / den : 0.f);
    }
"""

# the split-K variant writes each split's unnormalized partial (running max, sum, weighted values)
_ATTENTION_SPLIT = _ATTENTION.replace(
    "        out[((size_t)b * H + g * G + h) * D + t] = static_cast<T>(den > 0.f ? num / den : 0.f);",
    """        const size_t slot = ((size_t)b * H + g * G + h) * SPLITS + split;
        part_acc[slot * D + t] = num;
        if (t == 0) { part_ml[slot * 2] = top; part_ml[slot * 2 + 1] = den; }""")

_COMBINE = r"""
    // block (h, b): threads D; merge the SPLITS partials of query head h of row b.
    const int h = blockIdx.x;
    const int b = blockIdx.y;
    const int t = threadIdx.x;
    const size_t base = ((size_t)b * H + h) * SPLITS;
    float top = -INFINITY;
    for (int s = 0; s < SPLITS; ++s) top = fmaxf(top, part_ml[(base + s) * 2]);
    float den = 0.f, num = 0.f;
    if (top > -INFINITY) {
        for (int s = 0; s < SPLITS; ++s) {
            const float m = part_ml[(base + s) * 2];
            if (m == -INFINITY) continue;
            const float c = expf(m - top);
            den += part_ml[(base + s) * 2 + 1] * c;
            num += part_acc[(base + s) * D + t] * c;
        }
    }
    out[((size_t)b * H + h) * D + t] = static_cast<T>(den > 0.f ? num / den : 0.f);
"""

_ADD_RMS_NORM = r"""
    // block r: threads BLK, each N / BLK features of row r.
    constexpr int PER = N / BLK;
    const int r = blockIdx.x;
    __shared__ float red[BLK / 32];
    float vals[PER];
    float ss = 0.f;
    for (int k = 0; k < PER; ++k) {
        const size_t i = (size_t)r * N + threadIdx.x + k * BLK;
        const T s = static_cast<T>(static_cast<float>(h[i]) + static_cast<float>(delta[i]));
        h_out[i] = s;
        vals[k] = static_cast<float>(s);
        ss += vals[k] * vals[k];
    }
    const float inv = rsqrtf(block_sum<BLK / 32>(ss, red) / (float)N + EPS);
    for (int k = 0; k < PER; ++k) {
        const int c = threadIdx.x + k * BLK;
        const float nv = static_cast<float>(static_cast<T>(vals[k] * inv));
        x_out[(size_t)r * N + c] = static_cast<T>(nv * static_cast<float>(w[c]));
    }
"""


_SWIGLU = r"""
    // one thread per output element; gu row = [gate (I) | up (I)].
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)ROWS * I) return;
    const size_t r = idx / I, c = idx % I;
    const float g = static_cast<float>(gu[r * 2 * I + c]);
    const float u = static_cast<float>(gu[r * 2 * I + I + c]);
    out[idx] = static_cast<T>(g / (1.f + expf(-g)) * u);
"""


def _literals(source: str, eps: float, rope_theta: float | None = None) -> str:
    source = source.replace("EPS", f"{eps!r}f")
    if rope_theta is not None:
        source = source.replace("LOG2_BASE", f"{math.log2(rope_theta)!r}f")
    return source


@cache
def _attention_kernel(eps: float, rope_theta: float) -> object:
    return mx.fast.cuda_kernel(
        name=f"qwen3_decode_attention_{abs(hash((eps, rope_theta)))}",
        input_names=["qkv", "q_w", "k_w", "start", "n_valid", "keys", "values", "table", "meta"],
        output_names=["out"], source=_literals(_ATTENTION, eps, rope_theta), header=_BLOCK_REDUCE)


@cache
def _attention_split_kernel(eps: float, rope_theta: float) -> object:
    return mx.fast.cuda_kernel(
        name=f"qwen3_decode_attention_split_{abs(hash((eps, rope_theta)))}",
        input_names=["qkv", "q_w", "k_w", "start", "n_valid", "keys", "values", "table", "meta"],
        output_names=["part_acc", "part_ml"], source=_literals(_ATTENTION_SPLIT, eps, rope_theta),
        header=_BLOCK_REDUCE)


@cache
def _combine_kernel() -> object:
    return mx.fast.cuda_kernel(name="qwen3_decode_attention_combine", input_names=["part_acc", "part_ml"],
                               output_names=["out"], source=_COMBINE)


@cache
def _add_rms_norm_kernel(eps: float) -> object:
    return mx.fast.cuda_kernel(name=f"qwen3_add_rms_norm_{abs(hash(eps))}", input_names=["h", "delta", "w"],
                               output_names=["h_out", "x_out"], source=_literals(_ADD_RMS_NORM, eps),
                               header=_BLOCK_REDUCE)


@cache
def _swiglu_kernel() -> object:
    return mx.fast.cuda_kernel(name="qwen3_swiglu", input_names=["gu"], output_names=["out"], source=_SWIGLU)


@cache
def _meta(length: int) -> mx.array:
    return mx.array([length], dtype=mx.int32)


def _pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (few distinct shared-memory table sizes, few kernel builds)."""
    return 1 << max(0, n - 1).bit_length()


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
    cuda = getattr(mx, "cuda", None)  # absent from some non-CUDA builds
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


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
    b, width = qkv.shape
    _, hkv, d = keys.shape
    if block_size < 1 or block_table.shape[0] != b or block_table.shape[1] > MAX_TABLE_WIDTH:
        raise ValueError(f"decode_attention: block_table {block_table.shape}, block_size {block_size}, rows {b}")
    table, length = _int32(block_table), block_table.shape[1]
    if (q_norm is None) != (k_norm is None):
        raise ValueError("decode_attention: q_norm and k_norm are both given or both None")
    qkn = q_norm is not None
    if width != (heads + 2 * hkv) * d or heads % hkv or d % 32 or d > 1024:
        raise ValueError(f"decode_attention: qkv {qkv.shape}, heads {heads}, keys {keys.shape}")
    if splits is None:
        splits = split_count(b, hkv)
    norms = [q_norm, k_norm] if qkn else [_NO_NORM, _NO_NORM]
    inputs = [qkv, *norms, _int32(start), _int32(n_valid), keys, values, table, _meta(length)]
    template = [("T", qkv.dtype), ("G", heads // hkv), ("D", d), ("H", heads), ("HKV", hkv), ("BS", block_size),
                ("TW", _pow2(length)), ("SPLITS", splits), ("QKN", int(qkn))]
    if splits == 1:
        return _attention_kernel(float(eps), float(rope_theta))(
            inputs=inputs, template=[*template, ("MIN_SPLIT", 1)], grid=(hkv * d, b, 1), threadgroup=(d, 1, 1),
            output_shapes=[(b, heads * d)], output_dtypes=[qkv.dtype])[0]
    part_acc, part_ml = _attention_split_kernel(float(eps), float(rope_theta))(
        inputs=inputs, template=[*template, ("MIN_SPLIT", MIN_SPLIT_KEYS)], grid=(hkv * d, b, splits),
        threadgroup=(d, 1, 1), output_shapes=[(b * heads * splits * d,), (b * heads * splits * 2,)],
        output_dtypes=[mx.float32, mx.float32])
    return _combine_kernel()(
        inputs=[part_acc, part_ml], template=[("T", qkv.dtype), ("H", heads), ("D", d), ("SPLITS", splits)],
        grid=(heads * d, b, 1), threadgroup=(d, 1, 1), output_shapes=[(b, heads * d)], output_dtypes=[qkv.dtype])[0]


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
    h_out, x_out = _add_rms_norm_kernel(float(eps))(
        inputs=[h, delta, weight], template=[("T", h.dtype), ("N", n), ("BLK", blk)],
        grid=(b * blk, 1, 1), threadgroup=(blk, 1, 1),
        output_shapes=[(b, n), (b, n)], output_dtypes=[h.dtype, h.dtype],
    )
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
    return _swiglu_kernel()(
        inputs=[gate_up], template=[("T", gate_up.dtype), ("ROWS", b), ("I", i)],
        grid=(-(-b * i // threads) * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(b, i)], output_dtypes=[gate_up.dtype],
    )[0]
