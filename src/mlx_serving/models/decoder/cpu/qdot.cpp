// The int8 products' common parts (issue 39): the instruction set they run with, picked at run
// time, and the activations' rounding to int8 per block of 32, as llama.cpp's Q8_1.
//
// For a weight group with scale s and offset b (w = s q + b, q unsigned) and an activation block
// x ~ dx xq: sum_j x_j w_j = s dx sum_j xq_j q_j + b sum_j x_j. The integer sums are exact (qgemm.cpp)
// and the bias term uses the block's quantized sum dx sum_j xq_j (with b ~ -8 s for 4-bit weights,
// the exact float sum would leave the rounding errors of the two terms uncorrelated, ~3x the error
// measured). The only approximation is the activations' rounding to 8 bits (error at most half a
// step, 1/254 of the block's largest value): the product is exactly that of the rounded x.

#include "qdot.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace mlx_serving {

bool cpu_has_avx2();  // module.cpp (false when the portable loops are forced)

namespace {

int isa_override = -1;  // -1: auto; else the Isa value forced

}  // namespace

Isa best_isa() {
  Isa best = Isa::portable;
#if defined(__x86_64__) || defined(_M_X64)
  if (cpu_has_avx2()) {
    static const bool vnni = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512f");
    best = vnni ? Isa::avx512vnni : Isa::avx2;
  }
#endif
  if (isa_override >= 0 && isa_override < static_cast<int>(best)) return static_cast<Isa>(isa_override);
  return best;
}

void set_isa_override(const std::string& name) {
  if (name == "auto") isa_override = -1;
  else if (name == "avx2") isa_override = static_cast<int>(Isa::avx2);
  else if (name == "portable") isa_override = static_cast<int>(Isa::portable);
  else throw std::invalid_argument("isa must be 'auto', 'avx2' or 'portable', got '" + name + "'");
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512vnni: return "avx512vnni";
    case Isa::avx2: return "avx2";
    default: return "portable";
  }
}

void QuantRow::quantize(const float* x, int64_t k) {
  const int64_t blocks = k / 32;
  q.resize(k);
  dx.resize(blocks);
  sum.resize(blocks);
  for (int64_t i = 0; i < blocks; ++i) {
    const float* xb = x + 32 * i;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    dx[i] = d;
    int8_t* qb = q.data() + 32 * i;
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) {
      qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
      s += qb[j];
    }
    sum[i] = d * static_cast<float>(s);
  }
}

}  // namespace mlx_serving
