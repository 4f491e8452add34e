// The CPU decode step's attention (attend.cpp): the query heads of one row that share a KV head,
// over the row's prefix in the paged cache, read as the cache stores it (kv_store.h).
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

#include "kv_store.h"
#include "qdot.h"

namespace mlx_serving {

// One row's query heads [first, first + m) of ``h`` (all reading KV head g = first / (h / kv.hkv))
// over its ``n`` keys of one layer (``ks`` / ``vs``), key p at cache row ``rows[p]``:
// out[j] = softmax(q[j] . K^T / sqrt(d)) V, ``q`` and ``out`` m * d float32 (head j at j * d).
// A quantized cache holds rotated vectors: the query is rotated into the cache's Hadamard basis and
// the output back (kv_cache.PagedKVCache.rotate). ``isa``: avx512vnni runs 16-lane vectors (d % 16
// == 0), avx2 8-lane (d % 8 == 0), else the portable loops. Each head's sums run in one fixed order
// whatever ``m`` (the heads run alongside, sharing each key's and value's load, never mixed), so a
// head's result depends only on its query, its prefix and the instruction set.
void attend_heads(const KvCache& kv, const KvSide& ks, const KvSide& vs, int64_t g, const int64_t* rows, int64_t n,
                  const float* q, int64_t m, float* out, Isa isa);

// attend_heads over arrays, for the tests: q (m, D) float32, the query heads of KV head ``g``; k / v
// (R, Hkv, D) float32, float16 or bfloat16, or with ``bits`` 4 / 8 MLX's affine layout (R, Hkv, D * bits
// / 32) uint32 with ``scales`` = [key scales, key biases, value scales, value biases] (R, Hkv, D / group)
// float32; rows (n,) int32 cache rows -> (m, D) float32, with the decoder's instruction set
// (set_isa_override). Raises std::invalid_argument on another layout or a row out of range.
mlx::core::array attend(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                        const mlx::core::array& rows, int g, const std::vector<mlx::core::array>& scales, int bits,
                        int group);

}  // namespace mlx_serving
