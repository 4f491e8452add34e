// The native CPU kernels of mlx-serving: MLX primitives with eval_cpu (see each source file).
#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"

namespace mlx_serving {

// True when the CPU has AVX2, FMA and F16C and the portable loops are not forced (force_portable).
bool cpu_has_avx2();
void force_portable(bool on);

// x (..., K) float32 @ dequantize(w, scales, biases).T -> (..., N) float32 (quantized_matmul.cpp).
mlx::core::array quantized_matmul(const mlx::core::array& x, const mlx::core::array& w,
                                  const mlx::core::array& scales, const mlx::core::array& biases, int group_size,
                                  int bits);

// Causal GQA attention over the paged KV cache, float or quantized (the scales and biases given)
// -> (B, T, H, D) float32 (paged_attention.cpp).
mlx::core::array paged_attention(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                                 const mlx::core::array& block_table, const mlx::core::array& start,
                                 const mlx::core::array& n_valid, float scale, int block_size,
                                 const std::optional<mlx::core::array>& k_scales,
                                 const std::optional<mlx::core::array>& k_biases,
                                 const std::optional<mlx::core::array>& v_scales,
                                 const std::optional<mlx::core::array>& v_biases, int group_size, int bits,
                                 int threads);

// paged_attention after storing the new K/V ``new_k``, ``new_v`` (N, Hkv, D) float32 at the flat cache
// rows ``rows`` (N,) int32 as the CPU decode step stores them (kv_store.h: the dtype's rounding, or
// rotated and quantized; a row given twice keeps the later token's, one outside the cache is
// skipped), the queries of a quantized cache rotated into its basis and the output back out
// (kv_cache.PagedKVCache.rotate) -> [(B, T, H, D) float32, k, v, then the k scales, k biases,
// v scales and v biases when quantized]: the cache arrays over the given arrays' buffers, written in
// place (store them back as the cache). Raises std::invalid_argument as paged_attention, and for
// new K/V or rows of another shape or dtype.
std::vector<mlx::core::array> paged_attention_store(
    const mlx::core::array& q, const mlx::core::array& new_k, const mlx::core::array& new_v,
    const mlx::core::array& rows, const mlx::core::array& k, const mlx::core::array& v,
    const mlx::core::array& block_table, const mlx::core::array& start, const mlx::core::array& n_valid, float scale,
    int block_size, const std::optional<mlx::core::array>& k_scales, const std::optional<mlx::core::array>& k_biases,
    const std::optional<mlx::core::array>& v_scales, const std::optional<mlx::core::array>& v_biases, int group_size,
    int bits, int threads);

}  // namespace mlx_serving
