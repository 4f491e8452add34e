// The int8 products' common parts (qdot.cpp): the instruction set, the activations' rounding and
// MLX's weight layout (the products themselves: qgemm.h).
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
// sum dx * sum(q) (the affine bias term reads it); ``q`` in natural order.
struct QuantRow {
  std::vector<int8_t> q;
  std::vector<float> dx, sum;
  void quantize(const float* x, int64_t k);
};

// An affine-quantized matrix (N, K) in MLX's layout (mx.quantize): w (N, K * bits / 32) uint32,
// scales / biases (N, K / group) float32 or float16 (``half``); ``bias`` (N,) float32 or null.
// What pack() (pack.h) reads, once.
struct QMatrixView {
  const uint8_t* w;
  const void* scales;
  const void* biases;
  const float* bias;
  bool half;
  int bits, group;
  int64_t n, k;
};

}  // namespace mlx_serving
