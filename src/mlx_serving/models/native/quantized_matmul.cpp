// CPU kernel for MLX affine-quantized matrix products: y = x @ dequantize(w).T
//
// MLX's CPU backend computes mx.quantized_matmul with a scalar loop (1.2-1.9 GFLOP/s measured on
// a 2-core x86-64, issue 24); decode is a product of one row by each weight matrix, so it bounds
// single-stream decode. This primitive computes the same product with AVX2 + FMA when the CPU
// has them (checked at run time with __builtin_cpu_supports, so one build runs on any x86-64),
// a portable loop otherwise (auto-vectorized by the compiler: NEON on Arm), threads over output
// columns with OpenMP.
//
// Layout (MLX's affine quantization, mx.quantize): w (N, K * bits / 32) uint32, value j of row n
// in word j * bits / 32 at bit (j % (32 / bits)) * bits; scales and biases (N, K / group_size);
// dequantized w[n, j] = scales[n, j / G] * q + biases[n, j / G]. x (M, K) float32, y (M, N)
// float32; scales and biases float32, or float16 (half the bytes a decode step reads for them; the
// loader stores them so only where that is exact). bits 4 or 8, group_size 32, 64 or 128.
//
// Numerics: each weight is dequantized to float32 exactly as MLX does (s * q + b), and each dot
// product accumulates in float32 (in 8 lanes, summed at the end), so results differ from MLX's
// own kernel only by the order of float32 additions.

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QMM_X86 1
#endif

namespace mx = mlx::core;

namespace mlx_serving {
namespace {

struct Shape {
  int64_t m, n, k;
  int bits, group;
};

// ---- dequantization of one row into a float buffer --------------------------------------------

inline float f32(float v) { return v; }
inline float f32(mx::float16_t v) { return static_cast<float>(v); }

template <typename S>
void dequant_row_portable(const uint32_t* w, const S* s, const S* b, float* out, const Shape& sh) {
  const int per_word = 32 / sh.bits;
  const uint32_t mask = (1u << sh.bits) - 1u;
  for (int64_t j = 0; j < sh.k; ++j) {
    const uint32_t q = (w[j / per_word] >> ((j % per_word) * sh.bits)) & mask;
    out[j] = f32(s[j / sh.group]) * static_cast<float>(q) + f32(b[j / sh.group]);
  }
}

#ifdef QMM_X86
// The same conversions with F16C's instruction (the portable one is a bit-manipulation routine).
__attribute__((target("avx2,fma,f16c"))) inline float f32x(float v) { return v; }
__attribute__((target("avx2,fma,f16c"))) inline float f32x(mx::float16_t v) {
  uint16_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return _cvtsh_ss(bits);
}

template <typename S>
__attribute__((target("avx2,fma,f16c"))) void dequant_row_avx2(const uint32_t* w, const S* s, const S* b,
                                                            float* out, const Shape& sh) {
  const int64_t groups = sh.k / sh.group;
  if (sh.bits == 4) {
    const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i mask = _mm256_set1_epi32(0xF);
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 vs = _mm256_set1_ps(f32x(s[g])), vb = _mm256_set1_ps(f32x(b[g]));
      for (int i = 0; i < sh.group / 8; ++i) {
        const int64_t word = g * (sh.group / 8) + i;  // 8 values per word
        const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w[word])), shifts), mask);
        _mm256_storeu_ps(out + word * 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), vs, vb));
      }
    }
  } else {  // 8 bits: 4 values per word, bytes in order
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w);
    for (int64_t g = 0; g < groups; ++g) {
      const __m256 vs = _mm256_set1_ps(f32x(s[g])), vb = _mm256_set1_ps(f32x(b[g]));
      for (int i = 0; i < sh.group / 8; ++i) {
        const int64_t j = g * sh.group + i * 8;
        const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + j));
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(raw));
        _mm256_storeu_ps(out + j, _mm256_fmadd_ps(q, vs, vb));
      }
    }
  }
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  const __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// y[m, n0..n0+3] for rows m, m+1 of x against four dequantized weight rows (K floats each).
__attribute__((target("avx2,fma"))) void tile_2x4(const float* x0, const float* x1, const float* wt, int64_t k,
                                                    float* y0, float* y1) {
  __m256 a[2][4];
  for (auto& r : a)
    for (auto& v : r) v = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; j += 8) {
    const __m256 u = _mm256_loadu_ps(x0 + j), v = _mm256_loadu_ps(x1 + j);
    for (int c = 0; c < 4; ++c) {
      const __m256 w = _mm256_loadu_ps(wt + c * k + j);
      a[0][c] = _mm256_fmadd_ps(u, w, a[0][c]);
      a[1][c] = _mm256_fmadd_ps(v, w, a[1][c]);
    }
  }
  for (int c = 0; c < 4; ++c) {
    y0[c] = hsum(a[0][c]);
    y1[c] = hsum(a[1][c]);
  }
}

__attribute__((target("avx2,fma"))) void tile_1x4(const float* x0, const float* wt, int64_t k, float* y0) {
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t j = 0; j < k; j += 8) {
    const __m256 u = _mm256_loadu_ps(x0 + j);
    for (int c = 0; c < 4; ++c) a[c] = _mm256_fmadd_ps(u, _mm256_loadu_ps(wt + c * k + j), a[c]);
  }
  for (int c = 0; c < 4; ++c) y0[c] = hsum(a[c]);
}

// One row of x against four weight rows, dequantized in registers (decode: nothing is stored).
template <typename S>
__attribute__((target("avx2,fma,f16c"))) void gemv_4rows(const float* x, const uint32_t* w, const S* s, const S* b,
                                                      const Shape& sh, float* y) {
  const int64_t words = sh.k * sh.bits / 32, groups = sh.k / sh.group;
  const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28), mask = _mm256_set1_epi32(0xF);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < groups; ++g) {
    __m256 vs[4], vb[4];
    for (int r = 0; r < 4; ++r) {
      vs[r] = _mm256_set1_ps(f32x(s[r * groups + g]));
      vb[r] = _mm256_set1_ps(f32x(b[r * groups + g]));
    }
    for (int i = 0; i < sh.group / 8; ++i) {
      const int64_t j = g * sh.group + i * 8;
      const __m256 xc = _mm256_loadu_ps(x + j);
      for (int r = 0; r < 4; ++r) {
        __m256 q;
        if (sh.bits == 4) {
          const int word = static_cast<int>(w[r * words + j / 8]);
          q = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(word), shifts), mask));
        } else {
          const uint8_t* bytes = reinterpret_cast<const uint8_t*>(w + r * words);
          q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + j))));
        }
        acc[r] = _mm256_fmadd_ps(xc, _mm256_fmadd_ps(q, vs[r], vb[r]), acc[r]);
      }
    }
  }
  for (int r = 0; r < 4; ++r) y[r] = hsum(acc[r]);
}

#endif

// ---- the product over a block of 4 output columns ---------------------------------------------

void block_portable(const float* x, const float* wt, float* y, const Shape& sh, int64_t n0, int cols) {
  for (int64_t m = 0; m < sh.m; ++m)
    for (int c = 0; c < cols; ++c) {
      float acc = 0.f;
      const float* xr = x + m * sh.k;
      const float* wr = wt + c * sh.k;
      for (int64_t j = 0; j < sh.k; ++j) acc += xr[j] * wr[j];
      y[m * sh.n + n0 + c] = acc;
    }
}

// y[:, n0..n0+cols) through the dequantized rows wt (cols x K): pairs of x rows against four
// columns at a time, so a pair is read from memory once per panel, not once per four columns.
void panel(const float* x, const float* wt, float* y, const Shape& sh, int64_t n0, int cols, bool avx2) {
#ifdef QMM_X86
  if (avx2 && cols % 4 == 0) {
    float out[2][4];
    int64_t m = 0;
    for (; m + 1 < sh.m; m += 2)
      for (int c = 0; c < cols; c += 4) {
        tile_2x4(x + m * sh.k, x + (m + 1) * sh.k, wt + c * sh.k, sh.k, out[0], out[1]);
        std::memcpy(y + m * sh.n + n0 + c, out[0], sizeof out[0]);
        std::memcpy(y + (m + 1) * sh.n + n0 + c, out[1], sizeof out[1]);
      }
    if (m < sh.m)
      for (int c = 0; c < cols; c += 4) {
        tile_1x4(x + m * sh.k, wt + c * sh.k, sh.k, out[0]);
        std::memcpy(y + m * sh.n + n0 + c, out[0], sizeof out[0]);
      }
    return;
  }
#else
  (void)avx2;
#endif
  block_portable(x, wt, y, sh, n0, cols);
}

template <typename S>
void product(const float* x, const uint32_t* w, const S* s, const S* b, float* y, const Shape& sh) {
  const int64_t words = sh.k * sh.bits / 32, groups = sh.k / sh.group;
#ifdef QMM_X86
  const bool avx2 = cpu_has_avx2() && sh.k % 8 == 0;
#else
  const bool avx2 = false;
#endif
  // One row (decode): 4 columns per block, dequantized in registers. More rows: panels of 16
  // dequantized columns (64 KiB at K = 1,024: in L2) that each pair of x rows runs through.
  const int64_t width = sh.m == 1 ? 4 : 16;
  const int64_t blocks = (sh.n + width - 1) / width;
  // Dynamic blocks: when the cores are shared (another process, MLX's own thread), a descheduled
  // thread must not hold the whole product at the barrier; small products run on one thread.
  const int64_t chunk = std::max<int64_t>(1, blocks / 32);
  const bool parallel = sh.m * sh.n * sh.k >= (1 << 18);
#pragma omp parallel if (parallel)
  {
    std::vector<float> wt;  // allocated on first use: the one-row (decode) path dequantizes in registers
#pragma omp for schedule(dynamic, chunk)
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t n0 = blk * width;
      const int cols = static_cast<int>(std::min<int64_t>(width, sh.n - n0));
#ifdef QMM_X86
      if (avx2 && cols == 4 && sh.m == 1) {
        gemv_4rows(x, w + n0 * words, s + n0 * groups, b + n0 * groups, sh, y + n0);
        continue;
      }
#endif
      if (wt.empty()) wt.resize(width * sh.k);
      for (int c = 0; c < cols; ++c) {
        const int64_t n = n0 + c;
#ifdef QMM_X86
        if (avx2) {
          dequant_row_avx2(w + n * words, s + n * groups, b + n * groups, wt.data() + c * sh.k, sh);
          continue;
        }
#endif
        dequant_row_portable(w + n * words, s + n * groups, b + n * groups, wt.data() + c * sh.k, sh);
      }
      const int whole = avx2 ? cols / 4 * 4 : 0;  // the AVX2 tiles take columns four at a time
      if (whole) panel(x, wt.data(), y, sh, n0, whole, avx2);
      if (whole < cols) block_portable(x, wt.data() + whole * sh.k, y, sh, n0 + whole, cols - whole);
    }
  }
}

// ---- the MLX primitive --------------------------------------------------------------------------

class QuantizedMatmul : public mx::Primitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits)
      : mx::Primitive(stream), group_(group_size), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& x = inputs[0];
    const auto& w = inputs[1];
    auto& y = outputs[0];
    y.set_data(mx::allocator::malloc(y.nbytes()));
    const int64_t k = x.shape(-1);
    const Shape sh{static_cast<int64_t>(x.size() / k), static_cast<int64_t>(w.shape(0)), k, bits_, group_};
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(y);
    if (inputs[2].dtype() == mx::float16) {
      encoder.dispatch([xp = x.data<float>(), wp = w.data<uint32_t>(), sp = inputs[2].data<mx::float16_t>(),
                        bp = inputs[3].data<mx::float16_t>(), yp = y.data<float>(), sh]() { product(xp, wp, sp, bp, yp, sh); });
      return;
    }
    encoder.dispatch([xp = x.data<float>(), wp = w.data<uint32_t>(), sp = inputs[2].data<float>(),
                      bp = inputs[3].data<float>(), yp = y.data<float>(), sh]() { product(xp, wp, sp, bp, yp, sh); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("QuantizedMatmulCPU has no GPU implementation");
  }

  const char* name() const override { return "QuantizedMatmulCPU"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    auto shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedMatmul&>(other);
    return group_ == o.group_ && bits_ == o.bits_;
  }

 private:
  int group_, bits_;
};

}  // namespace

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales, const mx::array& biases,
                           int group_size, int bits) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("quantized_matmul_cpu: bits must be 4 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128)
    throw std::invalid_argument("quantized_matmul_cpu: group_size must be 32, 64 or 128");
  if (x.dtype() != mx::float32 || (scales.dtype() != mx::float32 && scales.dtype() != mx::float16) ||
      biases.dtype() != scales.dtype() || w.dtype() != mx::uint32)
    throw std::invalid_argument(
        "quantized_matmul_cpu: x float32, scales and biases both float32 or both float16, w uint32 expected");
  const int k = x.shape(-1);
  if (w.ndim() != 2 || k % group_size || w.shape(1) * 32 / bits != k || scales.shape() != biases.shape() ||
      scales.ndim() != 2 || scales.shape(0) != w.shape(0) || scales.shape(1) != k / group_size)
    throw std::invalid_argument("quantized_matmul_cpu: shapes of x, w, scales and biases do not agree");
  const auto s = mx::Device(mx::Device::cpu);
  auto shape = x.shape();
  shape.back() = w.shape(0);
  std::vector<mx::array> inputs = {mx::contiguous(x, false, s), mx::contiguous(w, false, s),
                                   mx::contiguous(scales, false, s), mx::contiguous(biases, false, s)};
  return mx::array(shape, mx::float32, std::make_shared<QuantizedMatmul>(mx::default_stream(s), group_size, bits),
                   std::move(inputs));
}

}  // namespace mlx_serving
