// The paged KV cache as the CPU decode step reads and writes it (kv_store.cpp): float32, float16 or
// bfloat16 head vectors, or MLX's affine int8 / int4 layout of Hadamard-rotated ones
// (models/decoder/kv_cache.py), one layout per cache.
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

namespace mlx_serving {

// What a cache row holds: kF32 / kF16 / kBF16 the head vectors themselves; kQ8 / kQ4 the rotated
// vectors quantized, one scale and bias (float32) per group of ``group`` values.
enum class KvKind { kF32, kF16, kBF16, kQ8, kQ4 };

// One layer's keys or values: ``data`` (R, Hkv, D) of the kind's element (uint32 words when
// quantized: (R, Hkv, D * bits / 32)), ``scales`` / ``biases`` (R, Hkv, D / group) or null.
struct KvSide {
  void* data;
  float* scales;
  float* biases;
};

struct KvCache {
  KvKind kind;
  int64_t hkv, d, group;
  std::vector<KvSide> keys, values;  // one per layer

  bool quantized() const { return kind == KvKind::kQ8 || kind == KvKind::kQ4; }
  // Store one token's ``hkv`` head vectors ``x`` (hkv * d float32) at cache row ``row``, as MLX stores
  // them (kv_cache.PagedKVCache.write): the dtype's rounding, or mx.hadamard_transform then
  // mx.quantize's (int8) or kv_quantizer.fit_int4's (int4), bit for bit. ``x`` is rotated in place when quantized.
  void store(const KvSide& side, int64_t row, float* x) const;
};

// mx.hadamard_transform of ``x`` (n float32, n a power of 2) in place, in MLX's CPU order (the
// butterflies, then the scale 1 / sqrt(n) folded into the last stage).
void hadamard(float* x, int64_t n);

// The decode step's store of ``x`` (N, D) float32 head vectors as a ``bits`` (4 / 8) cache with groups of
// ``group`` (for the tests: equal to mx.quantize (int8) or kv_quantizer.fit_int4 (int4) of mx.hadamard_transform(x),
// bit for bit) -> [w (N, D * bits /
// 32) uint32, scales (N, D / group) float32, biases (N, D / group) float32]. Raises std::invalid_argument.
std::vector<mlx::core::array> kv_quantize(const mlx::core::array& x, int bits, int group);

}  // namespace mlx_serving
