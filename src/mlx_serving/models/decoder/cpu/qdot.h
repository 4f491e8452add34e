// Products of int8-quantized activations with MLX's affine 4- and 8-bit weights (qdot.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mlx_serving {

// The instruction set the int8 products run with, picked at run time.
enum class Isa { portable, avx2, avx512vnni };

Isa best_isa();                      // what this CPU supports (the override applied)
void set_isa_override(const std::string& name);  // "auto" | "avx2" | "portable" (tests)
const char* isa_name(Isa isa);

// Activations of one row quantized in blocks of 32: x[j] ~ dx[j / 32] * q[j], with each block's
// sum dx * sum(q) (the affine bias term reads it). ``q`` in natural order (8-bit weights) and
// ``qp`` with each block's even positions first, then its odd ones (the nibble order of 4-bit words).
struct QuantRow {
  std::vector<int8_t> q, qp;
  std::vector<float> dx, sum;
  void quantize(const float* x, int64_t k);
};

// An affine-quantized matrix (N, K) in MLX's layout (mx.quantize): w (N, K * bits / 32) uint32,
// scales / biases (N, K / group) float32 or float16 (``half``); ``bias`` (N,) float32 or null.
struct QMatrixView {
  const uint8_t* w;
  const void* scales;
  const void* biases;
  const float* bias;
  bool half;
  int bits, group;
  int64_t n, k;
};

// y[r * ldy + n] = sum_j dequantize(w)[n, j] x_r[j] (+ bias[n]) for n in [n0, n1), rows r of ``x``.
// Each (row, n) is one fixed computation, whatever the rows and the range: batch-invariant.
void qgemv(const QMatrixView& m, const QuantRow* x, int64_t rows, int64_t n0, int64_t n1, float* y, int64_t ldy,
           Isa isa);

}  // namespace mlx_serving
