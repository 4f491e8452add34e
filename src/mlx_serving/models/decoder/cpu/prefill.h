// The native prefill's product (prefill.cpp): an MLX primitive over the int8 GEMM (qgemm.cpp).
#pragma once

#include "decode_step.h"
#include "mlx/array.h"

namespace mlx_serving {

// x (..., K) float32 @ dequantize(m).T (+ m's bias) -> (..., N) float32, x quantized to int8 per
// block of 32: the decode step's product (bit for bit), computed by the int8 GEMM over m's packed
// weights (packed once, when m was made) on a process-wide pool of ``threads`` (kept alive across
// calls). Raises std::invalid_argument naming the argument.
mlx::core::array int8_packed_matmul(const QMatrix& m, const mlx::core::array& x, int threads);

// x (..., K) float32 @ dequantize(w, scales, biases).T -> (..., N) float32, MLX's affine layout
// (w (N, K * bits / 32) uint32, scales / biases (N, K / group_size) both float32 or both float16;
// bits 4 or 8, group_size 32, 64 or 128, K a multiple of 32), with x quantized to int8 per block
// of 32: int8_packed_matmul over the matrix packed for this call (the tests' and benches' entry;
// the model's matrices are packed once: QMatrix). Raises std::invalid_argument naming the argument.
mlx::core::array int8_quantized_matmul(const mlx::core::array& x, const mlx::core::array& w,
                                       const mlx::core::array& scales, const mlx::core::array& biases,
                                       int group_size, int bits, int threads);

}  // namespace mlx_serving
