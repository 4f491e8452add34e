// The native prefill's products (prefill.cpp): MLX primitives over the int8 GEMM (qgemm.cpp).
#pragma once

#include <cstdint>
#include <functional>

#include "decode_step.h"
#include "mlx/array.h"

namespace mlx_serving {

// x (..., K) float32 @ dequantize(m).T (+ m's bias) -> (..., N) float32, x quantized to int8 per
// block of 32: the decode step's product (bit for bit), computed by the int8 GEMM over m's packed
// weights (packed once, when m was made) on a process-wide pool of ``threads`` (kept alive across
// calls). Raises std::invalid_argument naming the argument.
mlx::core::array int8_packed_matmul(const QMatrix& m, const mlx::core::array& x, int threads);

// The MLP's down product from its gate/up product: gate_up (..., 2 K) float32 = [gate | up] ->
// silu(gate) * up (..., K), computed as the decode step does (g / (1 + exp(-g)) * u, float32),
// then @ dequantize(m).T (+ m's bias) -> (..., N) float32 as int8_packed_matmul (same numerics).
// Raises std::invalid_argument naming the argument.
mlx::core::array int8_swiglu_matmul(const QMatrix& m, const mlx::core::array& gate_up, int threads);

// x (..., K) float32 @ dequantize(w, scales, biases).T -> (..., N) float32, MLX's affine layout
// (w (N, K * bits / 32) uint32, scales / biases (N, K / group_size) both float32 or both float16;
// bits 4 or 8, group_size 32, 64 or 128, K a multiple of 32), with x quantized to int8 per block
// of 32: int8_packed_matmul over the matrix packed for this call (the tests' and benches' entry;
// the model's matrices are packed once: QMatrix). Raises std::invalid_argument naming the argument.
mlx::core::array int8_quantized_matmul(const mlx::core::array& x, const mlx::core::array& w,
                                       const mlx::core::array& scales, const mlx::core::array& biases,
                                       int group_size, int bits, int threads);

// fn(0), ..., fn(count - 1) on the products' pool of ``threads`` (made or remade for that count; the
// native prefill's attention runs there too, not on OpenMP's threads); one caller at a time.
void run_on_prefill_pool(int threads, int64_t count, const std::function<void(int64_t)>& fn);

}  // namespace mlx_serving
