// Int8 products for the CPU decode step (issue 39): activations quantized per block of 32 to int8,
// integer dot products with the affine 4- and 8-bit weights, as llama.cpp's Q4_1 x Q8_1 products.
//
// For a weight group with scale s and offset b (w = s q + b, q unsigned) and an activation block
// x ~ dx xq: sum_j x_j w_j = s dx sum_j xq_j q_j + b sum_j x_j. The integer sums are exact (u8 x s8
// products summed in int32: AVX-512 VNNI's vpdpbusd, AVX2's vpmaddubsw + vpmaddwd, or a plain loop);
// each block's sum is scaled and accumulated in float32 (8 lanes on the vector paths), and the bias
// term uses the block's quantized sum dx sum_j xq_j (as llama.cpp's Q8_1: with b ~ -8 s for 4-bit
// weights, the exact float sum would leave the rounding errors of the two terms uncorrelated, ~3x
// the error measured). The only approximation is the activations' rounding to 8 bits (error at most
// half a step, 1/254 of the block's largest value): the product is exactly that of the rounded x.
//
// MLX's 4-bit layout packs value j of a row at bits 4 (j % 8) of word j / 8: byte t of a 32-value
// block holds values 2t (low nibble) and 2t + 1 (high nibble). The vector paths split the 16 bytes
// into low and high nibbles (32 unsigned bytes) and read the activations in the matching order
// (QuantRow::qp: the block's even positions, then its odd ones).

#include "qdot.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QD_X86 1
#endif

namespace mlx_serving {

bool cpu_has_avx2();  // module.cpp (false when the portable loops are forced)

namespace {

int isa_override = -1;  // -1: auto; else the Isa value forced

float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) bits = sign;
    else {  // subnormal: normalize
      int e = -1;
      uint32_t m = man;
      do {
        ++e;
        m <<= 1;
      } while (!(m & 0x400u));
      bits = sign | ((127 - 15 - e) << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
  else bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

template <bool Half>
inline float param(const void* p, int64_t i) {
  if constexpr (Half) return half_to_float(static_cast<const uint16_t*>(p)[i]);
  else return static_cast<const float*>(p)[i];
}

// ---- portable ----------------------------------------------------------------------------------

template <bool Half>
float dot_portable(const QMatrixView& m, int64_t n, const QuantRow& x) {
  const int64_t blocks = m.k / 32, groups = m.k / m.group, per = m.group / 32;
  const uint8_t* w = m.w + n * m.k * m.bits / 8;
  float acc = 0.f, bacc = 0.f;
  for (int64_t i = 0; i < blocks; ++i) {
    const int8_t* xq = x.q.data() + 32 * i;
    int32_t d = 0;
    if (m.bits == 4) {
      const uint8_t* wb = w + 16 * i;
      for (int t = 0; t < 16; ++t) d += (wb[t] & 0xF) * xq[2 * t] + (wb[t] >> 4) * xq[2 * t + 1];
    } else {
      const uint8_t* wb = w + 32 * i;
      for (int t = 0; t < 32; ++t) d += wb[t] * xq[t];
    }
    const int64_t g = n * groups + i / per;
    acc += param<Half>(m.scales, g) * x.dx[i] * static_cast<float>(d);
    bacc += param<Half>(m.biases, g) * x.sum[i];
  }
  return acc + bacc;
}

#ifdef QD_X86
__attribute__((target("avx2,fma,f16c"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

template <bool Half>
__attribute__((target("avx2,fma,f16c"))) inline float param_x86(const void* p, int64_t i) {
  if constexpr (Half) return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
  else return static_cast<const float*>(p)[i];
}

// Weights of block i as 32 unsigned bytes in the activation order of QuantRow (qp for 4 bits).
template <int Bits>
__attribute__((target("avx2,fma,f16c"))) inline __m256i weights_avx2(const uint8_t* w, int64_t i) {
  if constexpr (Bits == 4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * i));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * i));
  }
}

// The int32 sums of 4 products each (8 lanes) of unsigned weights by signed activations.
template <int Bits>
__attribute__((target("avx2,fma,f16c"))) inline __m256i products_avx2(__m256i w, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Bits == 4) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);  // |pair| <= 2 * 15 * 128: no saturation
  } else {  // 8 bits: split into nibbles, as 255 * 127 * 2 would saturate vpmaddubsw's int16
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), m4), x), ones);
    const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(w, m4), x), ones);
    return _mm256_add_epi32(_mm256_slli_epi32(hi, 4), lo);
  }
}

template <int Bits>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"))) inline __m256i products_vnni(__m256i w,
                                                                                                          __m256i x) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
}

// The 8 int32 lanes of each of d[0..8) summed: lane i of the result is the sum of d[i].
__attribute__((target("avx2,fma,f16c"))) inline __m256i sum8x8(const __m256i* d) {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// Scales (or offsets) of blocks i0..i0+8 of row n as 8 floats (group 32: one per block).
template <bool Half>
__attribute__((target("avx2,fma,f16c"))) inline __m256 params8(const void* p, int64_t row0, int64_t i0, int64_t per) {
  if (per == 1) {
    if constexpr (Half)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + row0 + i0)));
    else return _mm256_loadu_ps(static_cast<const float*>(p) + row0 + i0);
  }
  alignas(32) float v[8];
  for (int j = 0; j < 8; ++j) v[j] = param_x86<Half>(p, row0 + (i0 + j) / per);
  return _mm256_load_ps(v);
}

// Blocks are taken 8 at a time: 8 integer dot products (8 int32 lanes each), summed across lanes
// together (sum8x8), then scaled by the 8 blocks' s * dx and accumulated in one fused multiply-add;
// the offsets' term likewise; the last fewer than 8 blocks padded with zeros.
#define QD_DOT_BODY(PRODUCTS)                                                                              \
  const int64_t blocks = m.k / 32, groups = m.k / m.group, per = m.group / 32, row0 = n * groups;          \
  const uint8_t* w = m.w + n * m.k * Bits / 8;                                                             \
  const int8_t* xq = (Bits == 4 ? x.qp : x.q).data();                                                      \
  __m256 acc = _mm256_setzero_ps(), bacc = _mm256_setzero_ps();                                            \
  int64_t i = 0;                                                                                           \
  for (; i + 8 <= blocks; i += 8) {                                                                        \
    __m256i d[8];                                                                                          \
    for (int j = 0; j < 8; ++j)                                                                            \
      d[j] = PRODUCTS<Bits>(weights_avx2<Bits>(w, i + j),                                                  \
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * (i + j))));      \
    const __m256 sc = _mm256_mul_ps(params8<Half>(m.scales, row0, i, per), _mm256_loadu_ps(x.dx.data() + i)); \
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8(d)), sc, acc);                                         \
    bacc = _mm256_fmadd_ps(params8<Half>(m.biases, row0, i, per), _mm256_loadu_ps(x.sum.data() + i), bacc); \
  }                                                                                                        \
  if (i < blocks) {                                                                                        \
    __m256i d[8];                                                                                          \
    alignas(32) float sc[8], bs[8], dx[8], sm[8];                                                          \
    for (int j = 0; j < 8; ++j) {                                                                          \
      const bool live = i + j < blocks;                                                                    \
      d[j] = live ? PRODUCTS<Bits>(weights_avx2<Bits>(w, i + j),                                           \
                                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * (i + j)))) \
                  : _mm256_setzero_si256();                                                                \
      sc[j] = live ? param_x86<Half>(m.scales, row0 + (i + j) / per) : 0.f;                                \
      bs[j] = live ? param_x86<Half>(m.biases, row0 + (i + j) / per) : 0.f;                                \
      dx[j] = live ? x.dx[i + j] : 0.f;                                                                    \
      sm[j] = live ? x.sum[i + j] : 0.f;                                                                   \
    }                                                                                                      \
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum8x8(d)), _mm256_mul_ps(_mm256_load_ps(sc), _mm256_load_ps(dx)), acc); \
    bacc = _mm256_fmadd_ps(_mm256_load_ps(bs), _mm256_load_ps(sm), bacc);                                  \
  }                                                                                                        \
  return hsum8(_mm256_add_ps(acc, bacc));

template <int Bits, bool Half>
__attribute__((target("avx2,fma,f16c"))) inline float dot_avx2(const QMatrixView& m, int64_t n, const QuantRow& x) {
  QD_DOT_BODY(products_avx2)
}

template <int Bits, bool Half>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"))) inline float dot_vnni(
    const QMatrixView& m, int64_t n, const QuantRow& x) {
  QD_DOT_BODY(products_vnni)
}

// y[r * ldy + n] for n in [n0, n1) and every row r (the loop inside the ISA's function: one call per range).
template <int Bits, bool Half>
__attribute__((target("avx2,fma,f16c"))) void range_avx2(const QMatrixView& m, const QuantRow* x, int64_t rows,
                                                          int64_t n0, int64_t n1, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < rows; ++r) y[r * ldy + n] = dot_avx2<Bits, Half>(m, n, x[r]) + (m.bias ? m.bias[n] : 0.f);
}

template <int Bits, bool Half>
__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"))) void range_vnni(
    const QMatrixView& m, const QuantRow* x, int64_t rows, int64_t n0, int64_t n1, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < rows; ++r) y[r * ldy + n] = dot_vnni<Bits, Half>(m, n, x[r]) + (m.bias ? m.bias[n] : 0.f);
}
#endif

using RangeFn = void (*)(const QMatrixView&, const QuantRow*, int64_t, int64_t, int64_t, float*, int64_t);

template <bool Half>
void range_portable(const QMatrixView& m, const QuantRow* x, int64_t rows, int64_t n0, int64_t n1, float* y,
                    int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < rows; ++r) y[r * ldy + n] = dot_portable<Half>(m, n, x[r]) + (m.bias ? m.bias[n] : 0.f);
}

template <bool Half>
RangeFn pick_half(int bits, Isa isa) {
#ifdef QD_X86
  if (isa == Isa::avx512vnni) return bits == 4 ? range_vnni<4, Half> : range_vnni<8, Half>;
  if (isa == Isa::avx2) return bits == 4 ? range_avx2<4, Half> : range_avx2<8, Half>;
#else
  (void)bits;
  (void)isa;
#endif
  return range_portable<Half>;
}

}  // namespace

Isa best_isa() {
  Isa best = Isa::portable;
#ifdef QD_X86
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
  qp.resize(k);
  dx.resize(blocks);
  sum.resize(blocks);
  for (int64_t i = 0; i < blocks; ++i) {
    const float* xb = x + 32 * i;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    dx[i] = d;
    int8_t* qb = q.data() + 32 * i;
    int8_t* pb = qp.data() + 32 * i;
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) {
      qb[j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
      s += qb[j];
    }
    sum[i] = d * static_cast<float>(s);
    for (int t = 0; t < 16; ++t) {
      pb[t] = qb[2 * t];
      pb[16 + t] = qb[2 * t + 1];
    }
  }
}

void qgemv(const QMatrixView& m, const QuantRow* x, int64_t rows, int64_t n0, int64_t n1, float* y, int64_t ldy,
           Isa isa) {
  (m.half ? pick_half<true>(m.bits, isa) : pick_half<false>(m.bits, isa))(m, x, rows, n0, n1, y, ldy);
}

}  // namespace mlx_serving
