// The per-row and per-block loops of the native paged attention (paged_attention.cpp): the
// conversion of cached head vectors to float32, the scores of a key block, the online-softmax step,
// the weighted sum of values, the key block's transposition and the Hadamard rotation of a quantized
// cache's queries and outputs; each with AVX2 + FMA (+ F16C) and a portable loop, chosen by the
// caller's ``avx2`` (attention_loops.h).

#include "attention_loops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels.h"
#include "kv_store.h"
#include "mlx/types/half_types.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ATT_X86 1
#endif

namespace mx = mlx::core;

namespace mlx_serving::attention_loops {
namespace {

// out[0..d) = the 16-bit head vector at flat index idx, widened (exactly).
void widen(const Quant& q, int64_t idx, int64_t d, float* out) {
  const void* p = reinterpret_cast<const uint16_t*>(q.w) + idx * d;
  for (int64_t c = 0; c < d; ++c)
    out[c] = q.bf16 ? static_cast<float>(static_cast<const mx::bfloat16_t*>(p)[c])
                    : static_cast<float>(static_cast<const mx::float16_t*>(p)[c]);
}

// out[0..d) = the head vector at flat index idx (row * Hkv + head), dequantized.
void dequantize_portable(const Quant& q, int64_t idx, int64_t d, float* out) {
  const int per = 32 / q.bits;
  const uint32_t mask = (1u << q.bits) - 1;
  const uint32_t* w = q.w + idx * (d / per);
  const float* s = q.scales + idx * (d / q.group);
  const float* b = q.biases + idx * (d / q.group);
  for (int64_t c = 0; c < d; ++c) {
    const float x = static_cast<float>((w[c / per] >> (q.bits * (c % per))) & mask);
    out[c] = s[c / q.group] * x + b[c / q.group];
  }
}

// ---- scores: s[i][0..kSk) = q_i . K[0..kSk) for two queries, K given transposed (D, kSk) ----------

void scores_portable(const float* q0, const float* q1, const float* kt, int64_t d, float* s0, float* s1) {
  for (int s = 0; s < kSk; ++s) s0[s] = s1[s] = 0.f;
  for (int64_t c = 0; c < d; ++c) {
    const float a = q0[c], b = q1[c];
    const float* row = kt + c * kSk;
    for (int s = 0; s < kSk; ++s) {
      s0[s] += a * row[s];
      s1[s] += b * row[s];
    }
  }
}

// o[0..d) = o * corr + sum_s p[s] * v_s
void accumulate_portable(float* o, float corr, const float* p, const float* const* v, int n, int64_t d) {
  for (int64_t c = 0; c < d; ++c) o[c] *= corr;
  for (int s = 0; s < n; ++s) {
    const float w = p[s];
    const float* row = v[s];
    for (int64_t c = 0; c < d; ++c) o[c] += w * row[c];
  }
}

#ifdef ATT_X86
__attribute__((target("avx2,fma"))) void scores_avx2(const float* q0, const float* q1, const float* kt, int64_t d,
                                                       float* s0, float* s1) {
  __m256 a[4], b[4];
  for (int i = 0; i < 4; ++i) a[i] = b[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < d; ++c) {
    const __m256 x = _mm256_set1_ps(q0[c]), y = _mm256_set1_ps(q1[c]);
    const float* row = kt + c * kSk;
    for (int i = 0; i < 4; ++i) {
      const __m256 k = _mm256_loadu_ps(row + 8 * i);
      a[i] = _mm256_fmadd_ps(x, k, a[i]);
      b[i] = _mm256_fmadd_ps(y, k, b[i]);
    }
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(s0 + 8 * i, a[i]);
    _mm256_storeu_ps(s1 + 8 * i, b[i]);
  }
}

__attribute__((target("avx2,fma"))) void accumulate_avx2(float* o, float corr, const float* p, const float* const* v,
                                                           int n, int64_t d) {
  const __m256 vc = _mm256_set1_ps(corr);
  for (int64_t c0 = 0; c0 < d; c0 += 32) {  // d % 8 == 0 on this path; 4 accumulators at a time
    const int lanes = static_cast<int>(std::min<int64_t>(4, (d - c0) / 8));
    __m256 acc[4];
    for (int i = 0; i < lanes; ++i) acc[i] = _mm256_mul_ps(_mm256_loadu_ps(o + c0 + 8 * i), vc);
    for (int s = 0; s < n; ++s) {
      const __m256 w = _mm256_set1_ps(p[s]);
      for (int i = 0; i < lanes; ++i) acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v[s] + c0 + 8 * i), acc[i]);
    }
    for (int i = 0; i < lanes; ++i) _mm256_storeu_ps(o + c0 + 8 * i, acc[i]);
  }
}

// r[j] = column j of the 8 x 8 matrix whose row i is r[i] (in place; its own inverse).
__attribute__((target("avx2,fma"))) inline void transpose8x8(__m256* r) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  // For j < 4, r[j] holds column j of rows 0-3 in its low half and column j + 4 of rows 0-3 in
  // its high half; r[j + 4] the same for rows 4-7: pair up the 128-bit halves.
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm256_permute2f128_ps(r[j], r[j + 4], 0x20);
    t[j + 4] = _mm256_permute2f128_ps(r[j], r[j + 4], 0x31);
  }
  for (int j = 0; j < 8; ++j) r[j] = t[j];
}

// kt[c * kSk + s0 + i] = rows[i][c] for 8 key rows and c in [c0, c0 + 8): an 8 x 8 transpose.
__attribute__((target("avx2,fma"))) void transpose8_avx2(const float* const* rows, int64_t c0, float* kt, int s0) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i] + c0);
  transpose8x8(r);
  for (int j = 0; j < 8; ++j) _mm256_storeu_ps(kt + (c0 + j) * kSk + s0, r[j]);
}

constexpr int64_t kMaxRotated = 256;  // the widest head vector hadamard8 rotates (wider: one at a time)

// hadamard (kv_store.cpp: mx.hadamard_transform's butterflies and scale) of the 8 vectors rows[0..8)
// of d values in place (d a power of 2, 8 <= d <= kMaxRotated), the 8 side by side in the lanes:
// each value goes through the same additions, subtractions and product as there, so the same bits.
__attribute__((target("avx2,fma"))) void hadamard8(float* const* rows, int64_t d) {
  const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(static_cast<int>(d)));  // as hadamard() computes it
  __m256 x[kMaxRotated], r[8];
  for (int64_t c0 = 0; c0 < d; c0 += 8) {
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows[i] + c0);
    transpose8x8(r);
    for (int j = 0; j < 8; ++j) x[c0 + j] = r[j];
  }
  const int64_t half = d / 2;
  for (int64_t h = 1; h < d; h <<= 1)
    for (int64_t i = 0; i < half; ++i) {
      const int64_t k = i & (h - 1), j = ((i - k) << 1) + k;
      const __m256 a = x[j], b = x[j + h];
      x[j] = _mm256_add_ps(a, b);
      x[j + h] = _mm256_sub_ps(a, b);
      if (h == half) {
        x[j] = _mm256_mul_ps(x[j], scale);
        x[j + h] = _mm256_mul_ps(x[j + h], scale);
      }
    }
  for (int64_t c0 = 0; c0 < d; c0 += 8) {
    for (int j = 0; j < 8; ++j) r[j] = x[c0 + j];
    transpose8x8(r);
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(rows[i] + c0, r[i]);
  }
}

// exp(x) for 8 lanes: Cephes' expf (range reduction by ln 2 in two parts, a degree-5 polynomial,
// 2^n through the exponent bits; ~1 ulp), 0 below -87.3 (where float32's exp underflows).
__attribute__((target("avx2,fma"))) __m256 exp_avx2(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3762626647949f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// The online-softmax step of one query over one key block: sc[0..n) become exp(sc - top), lanes
// n..kSk zero; returns their sum (summed in a fixed order) and sets *top and *corr.
__attribute__((target("avx2,fma"))) float softmax_avx2(float* sc, int n, float m, float* top, float* corr) {
  float t = m;
  for (int s = 0; s < n; ++s) t = std::max(t, sc[s]);
  const __m256 vt = _mm256_set1_ps(t);
  __m256 sum = _mm256_setzero_ps();
  for (int i = 0; i < kSk / 8; ++i) {
    const __m256i lane = _mm256_add_epi32(_mm256_set1_epi32(8 * i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane));
    const __m256 e = _mm256_and_ps(live, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(sc + 8 * i), vt)));
    _mm256_storeu_ps(sc + 8 * i, e);
    sum = _mm256_add_ps(sum, e);
  }
  *top = t;
  *corr = _mm256_cvtss_f32(exp_avx2(_mm256_set1_ps(m - t)));  // m = -inf on the first block: 0
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
}

// widen with 8 lanes (d % 8 == 0): F16C's conversion, or bfloat16's bits shifted up (both exact).
__attribute__((target("avx2,fma,f16c"))) void widen_avx2(const Quant& q, int64_t idx, int64_t d, float* out) {
  const uint16_t* p = reinterpret_cast<const uint16_t*>(q.w) + idx * d;
  for (int64_t c = 0; c < d; c += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + c));
    _mm256_storeu_ps(out + c, q.bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                     : _mm256_cvtph_ps(h));
  }
}

// dequantize_portable with 8 lanes (d % 8 == 0; a group is a multiple of 32 values, so 8 lanes
// share one scale and bias); the same scale * q + bias per value, fused.
__attribute__((target("avx2,fma"))) void dequantize_avx2(const Quant& q, int64_t idx, int64_t d, float* out) {
  const int per = 32 / q.bits;
  const uint32_t* w = q.w + idx * (d / per);
  const float* s = q.scales + idx * (d / q.group);
  const float* b = q.biases + idx * (d / q.group);
  for (int64_t c = 0; c < d; c += 8) {
    __m256i x;
    if (q.bits == 8) {
      x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + c / 4)));
    } else {  // 4 bits: the 8 nibbles of one word, low first
      const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
      x = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w[c / 8])), shifts),
                           _mm256_set1_epi32(0xf));
    }
    const __m256 vs = _mm256_set1_ps(s[c / q.group]), vb = _mm256_set1_ps(b[c / q.group]);
    _mm256_storeu_ps(out + c, _mm256_fmadd_ps(vs, _mm256_cvtepi32_ps(x), vb));
  }
}
#endif

// The same step with the C library's exp (the portable path).
float softmax_portable(float* sc, int n, float m, float* top, float* corr) {
  float t = m;
  for (int s = 0; s < n; ++s) t = std::max(t, sc[s]);
  float sum = 0.f;
  for (int s = 0; s < n; ++s) {
    sc[s] = std::exp(sc[s] - t);
    sum += sc[s];
  }
  *top = t;
  *corr = std::exp(m - t);  // exp(-inf) = 0 on the first block
  return sum;
}

}  // namespace

bool avx2_path(int64_t d) {
#ifdef ATT_X86
  return cpu_has_avx2() && d % 8 == 0;
#else
  (void)d;
  return false;
#endif
}

// hadamard of each of the n head vectors rows[0..n) of d values in place: 8 at a time on the AVX2
// path, the same bits.
void rotate_all(float* const* rows, int64_t n, int64_t d, bool avx2) {
  int64_t i = 0;
#ifdef ATT_X86
  if (avx2 && d <= kMaxRotated)
    for (; i + 8 <= n; i += 8) hadamard8(rows + i, d);
#endif
  (void)avx2;
  for (; i < n; ++i) hadamard(rows[i], d);
}

void convert_row(const Quant& q, int64_t idx, int64_t d, bool avx2, float* out) {
#ifdef ATT_X86
  if (avx2) {
    if (q.bits == 16) widen_avx2(q, idx, d, out);
    else dequantize_avx2(q, idx, d, out);
    return;
  }
#endif
  (void)avx2;
  if (q.bits == 16) widen(q, idx, d, out);
  else dequantize_portable(q, idx, d, out);
}

void scores(const float* q0, const float* q1, const float* kt, int64_t d, float* s0, float* s1, bool avx2) {
#ifdef ATT_X86
  if (avx2) return scores_avx2(q0, q1, kt, d, s0, s1);
#endif
  (void)avx2;
  scores_portable(q0, q1, kt, d, s0, s1);
}

float softmax(float* sc, int n, float m, float* top, float* corr, bool avx2) {
#ifdef ATT_X86
  if (avx2) return softmax_avx2(sc, n, m, top, corr);
#endif
  (void)avx2;
  return softmax_portable(sc, n, m, top, corr);
}

void accumulate(float* o, float corr, const float* p, const float* const* v, int n, int64_t d, bool avx2) {
#ifdef ATT_X86
  if (avx2) return accumulate_avx2(o, corr, p, v, n, d);
#endif
  (void)avx2;
  accumulate_portable(o, corr, p, v, n, d);
}

void transpose_block(const float* const* rows, int64_t d, float* kt, bool avx2) {
#ifdef ATT_X86
  if (avx2) {
    for (int s = 0; s < kSk; s += 8)
      for (int64_t col = 0; col < d; col += 8) transpose8_avx2(rows + s, col, kt, s);
    return;
  }
#endif
  (void)avx2;
  for (int s = 0; s < kSk; ++s)
    for (int64_t col = 0; col < d; ++col) kt[col * kSk + s] = rows[s][col];
}

}  // namespace mlx_serving::attention_loops
