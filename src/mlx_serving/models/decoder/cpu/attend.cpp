// The CPU decode step's attention (attend.h, issue 39): per (row, KV head), the query heads sharing
// that KV head in one pass over the row's prefix.
//
// Per group of up to 4 heads: the scores of every key (each key widened or dequantized once, a whole
// head vector in 16 / 8-lane vectors, for all the heads), one softmax pass per head (a vectorized exp:
// Cephes' polynomial, the exponent applied as 2^n), then the weighted sum of the values, the heads'
// sums held in registers while the values pass (each value vector loaded once for all the heads).
// float16 is widened with F16C / AVX-512 conversions, bfloat16 by a shift, int8 / int4 unpacked
// into 32-bit lanes and dequantized with one fused multiply-add (scale * q + bias). The instruction
// set is the decoder's (qdot.h's best_isa, runtime-picked); the portable loops are the same kernel
// over one-lane "vectors".
//
// Numerics: float32 throughout; every sum of a head runs in one order that depends only on n, d
// and the instruction set (never on the other heads, rows or threads): batch-invariant.

#include "attend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "mlx/ops.h"
#include "mlx/types/half_types.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ATTEND_X86 1
#endif

namespace mlx_serving {

namespace {

// A stored head vector: its elements (float kinds) or words, and its groups' scales and biases.
struct Ref {
  const char* data;
  const float* s;
  const float* b;
};

// One layer side's head vectors of KV head ``g`` at the row's keys (key p at cache row rows[p]); a
// quantized side's ``groups`` scales per vector, element c's at c >> ``shift`` (the group a power of 2).
struct Keys {
  const char* data;
  const float* scales;
  const float* biases;
  const int64_t* rows;
  int64_t hkv, g, d, shift, groups, row_bytes;

  Ref at(int64_t p) const {
    const int64_t i = rows[p] * hkv + g;
    if (scales == nullptr) return {data + i * row_bytes, nullptr, nullptr};
    return {data + i * row_bytes, scales + i * groups, biases + i * groups};
  }
};

int64_t stored_bytes(KvKind kind, int64_t d) {
  switch (kind) {
    case KvKind::kF32: return 4 * d;
    case KvKind::kQ8: return d;
    case KvKind::kQ4: return d / 2;
    default: return 2 * d;
  }
}

Keys keys_of(const KvCache& kv, const KvSide& side, int64_t g, const int64_t* rows) {
  int64_t shift = 0;
  while (kv.quantized() && (int64_t{1} << shift) < kv.group) ++shift;
  return {static_cast<const char*>(side.data), side.scales, side.biases, rows, kv.hkv, g, kv.d, shift,
          kv.d >> shift, stored_bytes(kv.kind, kv.d)};
}

// Cephes' expf constants (range reduction by ln 2 in two parts, degree-5 polynomial).
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f, kExpMin = -87.33654f;

namespace portable {

#define ATT_TARGET

struct S {
  using V = float;
  static constexpr int W = 1;
  static V zero() { return 0.f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V x) { *p = x; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V max(V a, V b) { return std::max(a, b); }
  static float sum(V a) { return a; }
  static float hmax(V a) { return a; }
  static V exp(V a) { return std::exp(a); }
  template <KvKind K>
  static V widen(const Ref& r, int64_t c, int64_t shift) {
    if constexpr (K == KvKind::kF32) {
      return reinterpret_cast<const float*>(r.data)[c];
    } else if constexpr (K == KvKind::kF16) {
      return static_cast<float>(reinterpret_cast<const mlx::core::float16_t*>(r.data)[c]);
    } else if constexpr (K == KvKind::kBF16) {
      return static_cast<float>(reinterpret_cast<const mlx::core::bfloat16_t*>(r.data)[c]);
    } else {
      const auto* bytes = reinterpret_cast<const uint8_t*>(r.data);
      const int q = K == KvKind::kQ8 ? bytes[c] : (bytes[c / 2] >> (4 * (c & 1))) & 15;
      return r.s[c >> shift] * static_cast<float>(q) + r.b[c >> shift];
    }
  }
};

#include "attend_simd.h"

#undef ATT_TARGET

}  // namespace portable

#ifdef ATTEND_X86

namespace avx2 {

#define ATT_TARGET __attribute__((target("avx2,fma,f16c")))

struct S {
  using V = __m256;
  static constexpr int W = 8;
  ATT_TARGET static V zero() { return _mm256_setzero_ps(); }
  ATT_TARGET static V set1(float x) { return _mm256_set1_ps(x); }
  ATT_TARGET static V load(const float* p) { return _mm256_loadu_ps(p); }
  ATT_TARGET static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  ATT_TARGET static V add(V a, V b) { return _mm256_add_ps(a, b); }
  ATT_TARGET static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  ATT_TARGET static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  ATT_TARGET static V max(V a, V b) { return _mm256_max_ps(a, b); }
  ATT_TARGET static float sum(V a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
  }
  ATT_TARGET static float hmax(V a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
  }
  // exp(a) for a <= 0 (the softmax's shifted scores); 0 below kExpMin (-inf included).
  ATT_TARGET static V exp(V a) {
    const V lo = _mm256_set1_ps(kExpMin);
    const V under = _mm256_cmp_ps(a, lo, _CMP_LT_OQ);
    const V x = _mm256_max_ps(a, lo);
    const V n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
    V p = _mm256_set1_ps(kP0);
    for (const float k : {kP1, kP2, kP3, kP4, kP5}) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(k));
    const V y = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
  }
  template <KvKind K>
  ATT_TARGET static V widen(const Ref& r, int64_t c, int64_t shift) {
    if constexpr (K == KvKind::kF32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(r.data) + 8 * c);
    } else if constexpr (K == KvKind::kF16 || K == KvKind::kBF16) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r.data + 16 * c));
      if constexpr (K == KvKind::kF16) return _mm256_cvtph_ps(h);
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      __m128i q8;
      if constexpr (K == KvKind::kQ8) {
        q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.data + 8 * c));
      } else {
        int32_t word;
        std::memcpy(&word, r.data + 4 * c, 4);
        const __m128i b = _mm_cvtsi32_si128(word), nib = _mm_set1_epi8(15);
        q8 = _mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib));
      }
      const V q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q8));
      const int64_t i = (8 * c) >> shift;
      return _mm256_fmadd_ps(q, _mm256_set1_ps(r.s[i]), _mm256_set1_ps(r.b[i]));
    }
  }
};

#include "attend_simd.h"

#undef ATT_TARGET

}  // namespace avx2

namespace avx512 {

#define ATT_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq")))

struct S {
  using V = __m512;
  static constexpr int W = 16;
  ATT_TARGET static V zero() { return _mm512_setzero_ps(); }
  ATT_TARGET static V set1(float x) { return _mm512_set1_ps(x); }
  ATT_TARGET static V load(const float* p) { return _mm512_loadu_ps(p); }
  ATT_TARGET static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  ATT_TARGET static V add(V a, V b) { return _mm512_add_ps(a, b); }
  ATT_TARGET static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  ATT_TARGET static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  ATT_TARGET static V max(V a, V b) { return _mm512_max_ps(a, b); }
  ATT_TARGET static float sum(V a) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    return avx2::S::sum(h);
  }
  ATT_TARGET static float hmax(V a) {
    const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    return avx2::S::hmax(h);
  }
  // exp(a) for a <= 0; 0 below kExpMin (-inf included).
  ATT_TARGET static V exp(V a) {
    const __mmask16 keep = _mm512_cmp_ps_mask(a, _mm512_set1_ps(kExpMin), _CMP_GE_OQ);
    const V x = _mm512_max_ps(a, _mm512_set1_ps(kExpMin));
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
    V p = _mm512_set1_ps(kP0);
    for (const float k : {kP1, kP2, kP3, kP4, kP5}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(k));
    const V y = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(y, n));
  }
  template <KvKind K>
  ATT_TARGET static V widen(const Ref& r, int64_t c, int64_t shift) {
    if constexpr (K == KvKind::kF32) {
      return _mm512_loadu_ps(reinterpret_cast<const float*>(r.data) + 16 * c);
    } else if constexpr (K == KvKind::kF16 || K == KvKind::kBF16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.data + 32 * c));
      if constexpr (K == KvKind::kF16) return _mm512_cvtph_ps(h);
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      __m128i q8;
      if constexpr (K == KvKind::kQ8) {
        q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r.data + 16 * c));
      } else {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(r.data + 8 * c)), nib = _mm_set1_epi8(15);
        q8 = _mm_unpacklo_epi8(_mm_and_si128(b, nib), _mm_and_si128(_mm_srli_epi16(b, 4), nib));
      }
      const V q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q8));
      const int64_t i = (16 * c) >> shift;
      return _mm512_fmadd_ps(q, _mm512_set1_ps(r.s[i]), _mm512_set1_ps(r.b[i]));
    }
  }
};

#include "attend_simd.h"

#undef ATT_TARGET

}  // namespace avx512

#endif  // ATTEND_X86

// The vector width the kernel runs with: 16 (AVX-512), 8 (AVX2) or 1 (portable).
int lanes(Isa isa, int64_t d) {
#ifdef ATTEND_X86
  if (isa == Isa::avx512vnni && d % 16 == 0) return 16;
  if (isa != Isa::portable && d % 8 == 0) return 8;
#endif
  (void)isa;
  (void)d;
  return 1;
}

// hadamard (kv_store.h) of x (d) with the kernel's instruction set (w lanes): the same result.
void rotate(float* x, int64_t d, int64_t w) {
#ifdef ATTEND_X86
  if (w == 16) return avx512::rotate(x, d);
  if (w == 8) return avx2::rotate(x, d);
#endif
  (void)w;
  portable::rotate(x, d);
}

struct Scratch {
  std::vector<float> qs, sc, sums, o;
  std::vector<int64_t> lens;
};

}  // namespace

void attend_heads(const KvCache& kv, const KvSide& ks, const KvSide& vs, int64_t g, const int64_t* rows,
                  const Query* heads, int64_t m, Isa isa) {
  thread_local Scratch t;
  const int64_t d = kv.d, w = lanes(isa, d);
  const bool quant = kv.quantized();
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  int64_t n = 0;
  t.lens.resize(m);
  t.qs.resize(m * d);
  for (int64_t j = 0; j < m; ++j) {
    float* qj = t.qs.data() + j * d;
    std::copy(heads[j].q, heads[j].q + d, qj);
    if (quant) rotate(qj, d, w);
    for (int64_t c = 0; c < d; ++c) qj[c] *= scale;
    t.lens[j] = heads[j].n;
    n = std::max(n, heads[j].n);
  }
  const int64_t ns = (n + w - 1) / w * w;
  t.sc.resize(m * ns);
  t.sums.resize(m);
  t.o.resize(m * d);
  const Keys keys = keys_of(kv, ks, g, rows), vals = keys_of(kv, vs, g, rows);
  auto go = [&](auto* run) {
    run(kv.kind, keys, vals, t.lens.data(), n, t.qs.data(), m, t.sc.data(), ns, t.sums.data(), t.o.data());
  };
#ifdef ATTEND_X86
  if (w == 16) go(avx512::run);
  else if (w == 8) go(avx2::run);
  else
#endif
    go(portable::run);
  // summed in this thread's buffer, written out once: a neighbouring task's output may share a cache
  // line with this one's, and another thread writing it would bounce the line per sum
  for (int64_t j = 0; j < m; ++j) {
    float* o = t.o.data() + j * d;
    const float inv = 1.f / t.sums[j];
    for (int64_t c = 0; c < d; ++c) o[c] *= inv;
    if (quant) rotate(o, d, w);
    std::copy(o, o + d, heads[j].out);
  }
}

namespace {

void need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("attend: " + what);
}

mlx::core::array ready(const mlx::core::array& a) {
  mlx::core::array c = mlx::core::contiguous(a, false, mlx::core::Device(mlx::core::Device::cpu));
  c.eval();
  return c;
}

KvKind kind_of(const mlx::core::array& k, int bits) {
  if (bits == 8 || bits == 4) {
    need(k.dtype() == mlx::core::uint32, "a quantized k / v must be uint32");
    return bits == 8 ? KvKind::kQ8 : KvKind::kQ4;
  }
  need(bits == 0, "bits must be 0, 4 or 8");
  const auto t = k.dtype();
  need(t == mlx::core::float32 || t == mlx::core::float16 || t == mlx::core::bfloat16,
       "k / v must be float32, float16 or bfloat16");
  return t == mlx::core::float32 ? KvKind::kF32 : t == mlx::core::float16 ? KvKind::kF16 : KvKind::kBF16;
}

}  // namespace

mlx::core::array attend(const mlx::core::array& q_, const mlx::core::array& k_, const mlx::core::array& v_,
                        const mlx::core::array& rows_, int g, const std::vector<mlx::core::array>& scales_, int bits,
                        int group, const std::vector<int>& lengths) {
  const KvKind kind = kind_of(k_, bits);
  const mlx::core::array q = ready(mlx::core::astype(q_, mlx::core::float32)), k = ready(k_), v = ready(v_);
  const mlx::core::array rows = ready(mlx::core::astype(rows_, mlx::core::int64));
  need(q.ndim() == 2 && k.ndim() == 3 && k.shape() == v.shape() && k.dtype() == v.dtype() && rows.ndim() == 1 &&
           rows.size() > 0,
       "q (m, D), k and v (R, Hkv, D) of one dtype, rows (n,) with n > 0 expected");
  const int64_t d = q.shape(1), hkv = k.shape(1), words = bits ? d * bits / 32 : d;
  need(k.shape(2) == words && g >= 0 && g < hkv, "k / v's last axis must be D (D * bits / 32 quantized), 0 <= g < Hkv");
  const int64_t* r = rows.data<int64_t>();
  for (size_t i = 0; i < rows.size(); ++i) need(r[i] >= 0 && r[i] < k.shape(0), "a row is out of range");
  std::vector<mlx::core::array> scales;
  for (const auto& s : scales_) scales.push_back(ready(mlx::core::astype(s, mlx::core::float32)));
  const bool quant = bits != 0;
  need(quant ? (group == 32 || group == 64 || group == 128) && d % group == 0 && (d & (d - 1)) == 0 &&
                   scales.size() == 4
             : scales.empty(),
       "a quantized cache needs a power-of-2 D, a group of 32, 64 or 128 dividing it and 4 scale arrays");
  for (const auto& s : scales)
    need(s.ndim() == 3 && s.shape(0) == k.shape(0) && s.shape(1) == hkv && s.shape(2) == d / group,
         "scales and biases must be (R, Hkv, D / group)");
  auto ptr = [&](size_t i) { return quant ? const_cast<float*>(scales[i].data<float>()) : nullptr; };
  const KvCache kv{kind, hkv, d, quant ? group : 0, {}, {}};
  const KvSide ks{const_cast<void*>(k.data<void>()), ptr(0), ptr(1)};
  const KvSide vs{const_cast<void*>(v.data<void>()), ptr(2), ptr(3)};
  const int64_t m = q.shape(0), n = static_cast<int64_t>(rows.size());
  need(lengths.empty() || static_cast<int64_t>(lengths.size()) == m, "lengths must be empty or one per query head");
  std::vector<float> out(q.size());
  std::vector<Query> heads(m);
  for (int64_t j = 0; j < m; ++j) {
    const int64_t len = lengths.empty() ? n : lengths[j];
    need(len >= 1 && len <= n, "a length must be in [1, len(rows)]");
    heads[j] = {q.data<float>() + j * d, out.data() + j * d, len};
  }
  attend_heads(kv, ks, vs, g, r, heads.data(), m, best_isa());
  return mlx::core::array(out.begin(), q.shape(), mlx::core::float32);
}

}  // namespace mlx_serving
