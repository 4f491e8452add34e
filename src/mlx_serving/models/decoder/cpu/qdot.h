// The int8 products' common parts (qdot.cpp): the instruction set and MLX's weight layout (the
// products and the activations' rounding: qgemm.h).
#pragma once

#include <cstdint>
#include <string>

namespace mlx_serving {

// The instruction set the int8 products run with, picked at run time.
enum class Isa { portable, avx2, avx512vnni };

Isa best_isa();                      // what this CPU supports (the override applied)
void set_isa_override(const std::string& name);  // "auto" | "avx2" | "portable" (tests)
const char* isa_name(Isa isa);

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
