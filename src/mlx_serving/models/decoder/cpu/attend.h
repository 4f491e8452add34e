// The CPU decode step's attention (attend.cpp): the query heads that share a KV head (of one row, or of
// rows sharing a prefix), over their prefixes in the paged cache, read as the cache stores it (kv_store.h).
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

#include "kv_store.h"
#include "qdot.h"

namespace mlx_serving {

// One query head of a call: its query ``q`` (d float32), where its output goes (``out``, d float32)
// and how many keys it attends (``n`` >= 1: the first n of the call's rows).
struct Query {
  const float* q;
  float* out;
  int64_t n;
};

// Query heads ``heads[0, m)`` that all read KV head ``g`` of one layer (``ks`` / ``vs``), key p at
// cache row ``rows[p]`` (as many rows as the most keys a head attends): out = softmax(q . K^T /
// sqrt(d)) V over the head's own n keys. The heads may be of several rows that share a prefix (a
// verify's rows of one stream at consecutive positions): each key and value is read once for all.
// A quantized cache holds rotated vectors: the query is rotated into the cache's Hadamard basis and
// the output back (kv_cache.PagedKVCache.rotate). ``isa``: avx512vnni runs 16-lane vectors (d % 16
// == 0), avx2 8-lane (d % 8 == 0), else the portable loops. Each head's sums run in one fixed order
// whatever the other heads (the heads share each key's and value's load, never mixed; a head's
// weights past its own keys are exactly 0), so a head's result depends only on its query, its keys
// and the instruction set: with the other heads of its row, of other rows, or alone, bit for bit.
void attend_heads(const KvCache& kv, const KvSide& ks, const KvSide& vs, int64_t g, const int64_t* rows,
                  const Query* heads, int64_t m, Isa isa);

// attend_heads over arrays, for the tests: q (m, D) float32, the query heads of KV head ``g``; k / v
// (R, Hkv, D) float32, float16 or bfloat16, or with ``bits`` 4 / 8 MLX's affine layout (R, Hkv, D * bits
// / 32) uint32 with ``scales`` = [key scales, key biases, value scales, value biases] (R, Hkv, D / group)
// float32; rows (n,) int32 cache rows -> (m, D) float32, with the decoder's instruction set
// (set_isa_override); ``lengths`` (empty: all n) head j's key count, a prefix of ``rows``. Raises
// std::invalid_argument on another layout, a row out of range or a length outside [1, n].
mlx::core::array attend(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                        const mlx::core::array& rows, int g, const std::vector<mlx::core::array>& scales, int bits,
                        int group, const std::vector<int>& lengths);

}  // namespace mlx_serving
