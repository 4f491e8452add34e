// The int8 GEMM of the native prefill (issue 39): y = x @ dequantize(w).T for many rows x at once,
// activations quantized per block of 32 to int8 as the decode step's products (qdot.cpp).
//
// Where a GEMV loop (qgemv) unpacks every weight block again for every row and sums each block's
// 8 int32 lanes horizontally, here a task unpacks a panel of 32 weight columns once into bytes
// (4-bit nibbles spread out) and reuses it across all the rows (or a chunk of them, where the
// panels are too few for the threads). Activations and unpacked weights are interleaved by groups
// of 8 blocks (BlockLayout), so one 32-byte load feeds one int32 lane per block: 8
// multiply-accumulates (AVX-512 VNNI's vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd) leave the 8
// blocks' exact integer sums in the 8 lanes, with no horizontal sums; a last group of 1-4 blocks
// (SmolLM2's K = 576 is 18 blocks) takes two lanes per block, 4 steps and one pairwise sum, not 8
// steps with half the lanes idle. A micro tile keeps 4 rows x 4 columns (2 x 4 on AVX2, which has
// 16 registers) of these sums in registers.
//
// Numerics: the integer sums are exact, and each block's float scaling and accumulation follow
// qgemv's order on the same ISA (s * dx per lane, one fused multiply-add per 8 blocks, the offsets'
// term beside it, the same horizontal sum at the end; the portable loop block by block), so every
// (row, column) is bit for bit qgemv's: independent of the other rows, the tile it falls in and
// the thread that runs it.

#include "qgemm.h"

#include <algorithm>
#include <cstring>

#include "mlx/types/half_types.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QG_X86 1
#define QG_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QG_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#endif

namespace mlx_serving {

namespace {

constexpr int64_t kRowPad = 4;   // QuantRows pads its rows to this (the largest micro tile's rows)
constexpr int64_t kNR = 4;       // the most columns per micro tile (a panel is padded to it)
constexpr int64_t kPanel = 32;   // weight columns a task unpacks
constexpr int64_t kMinChunk = 64;  // fewest rows a task runs its panel over

float param(const void* p, bool half, int64_t i) {
  return half ? static_cast<float>(static_cast<const mlx::core::float16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// Copy the 32 values of block i into its place in a row laid out as ``at`` says.
template <typename T>
void interleave(const T* block, int64_t i, const BlockLayout& at, T* row) {
  for (int ch = 0; ch < 8; ++ch) std::memcpy(row + at.offset(i, ch), block + 4 * ch, 4 * sizeof(T));
}

#ifdef QG_X86
QG_AVX2 void spread_nibbles_avx2(const uint8_t* in, uint8_t* out) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in)), m4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(raw, m4), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m4);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi8(lo, hi));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm_unpackhi_epi8(lo, hi));
}
#endif

// The 32 4-bit values of one block (16 bytes, value 2t in byte t's low nibble) as 32 bytes.
void spread_nibbles(const uint8_t* in, uint8_t* out, bool vector) {
#ifdef QG_X86
  if (vector) return spread_nibbles_avx2(in, out);
#else
  (void)vector;
#endif
  for (int t = 0; t < 16; ++t) {
    out[2 * t] = in[t] & 0xF;
    out[2 * t + 1] = in[t] >> 4;
  }
}

// Weight columns [n0, n0 + cols) unpacked to one byte per value in the QuantRows order, the
// columns padded to kNR with zeros; scales / offsets as float, 8 per group (padding 0).
struct Panel {
  int64_t n0 = 0, cols = 0;
  std::vector<uint8_t> q;  // padded columns x at.row_bytes
  std::vector<float> s, b;

  void unpack(const QMatrixView& m, int64_t first, int64_t last, const BlockLayout& at, bool vector) {
    n0 = first;
    cols = last - first;
    const int64_t padded = (cols + kNR - 1) / kNR * kNR, groups = at.groups;
    q.assign(padded * at.row_bytes, 0);
    s.assign(padded * groups * 8, 0.f);
    b.assign(padded * groups * 8, 0.f);
    const int64_t blocks = m.k / 32, per = m.group / 32, row_groups = m.k / m.group, row_bytes = m.k * m.bits / 8;
    uint8_t v[32];
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t* w = m.w + (first + c) * row_bytes;
      for (int64_t i = 0; i < blocks; ++i) {
        if (m.bits == 4) {
          spread_nibbles(w + 16 * i, v, vector);
        } else {
          std::memcpy(v, w + 32 * i, 32);
        }
        interleave(v, i, at, q.data() + c * at.row_bytes);
        const int64_t slot = (c * groups + i / 8) * 8 + i % 8, src = (first + c) * row_groups + i / per;
        s[slot] = param(m.scales, m.half, src);
        b[slot] = param(m.biases, m.half, src);
      }
    }
  }
};

// Rows [r0, r1) x the panel's columns, block by block in qgemv's portable order.
void panel_portable(const QuantRows& x, int64_t r0, int64_t r1, const Panel& p, const float* bias, float* y,
                    int64_t ldy) {
  const BlockLayout& at = x.at;
  const int64_t g = at.groups;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = 0; c < p.cols; ++c) {
      float acc = 0.f, bacc = 0.f;
      for (int64_t i = 0; i < at.blocks; ++i) {
        const int8_t* xq = x.q.data() + r * at.row_bytes;
        const uint8_t* wq = p.q.data() + c * at.row_bytes;
        int32_t d = 0;
        for (int ch = 0; ch < 8; ++ch)
          for (int t = 0; t < 4; ++t) d += wq[at.offset(i, ch) + t] * xq[at.offset(i, ch) + t];
        const int64_t wi = (c * g + i / 8) * 8 + i % 8, xi = (r * g + i / 8) * 8 + i % 8;
        acc += p.s[wi] * x.dx[xi] * static_cast<float>(d);
        bacc += p.b[wi] * x.sum[xi];
      }
      y[r * ldy + p.n0 + c] = acc + bacc + (bias ? bias[p.n0 + c] : 0.f);
    }
}

#ifdef QG_X86
QG_AVX2 inline float hsum8(__m256 v) {  // qdot.cpp's order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// a + the int32 sums of 4 products each (8 lanes) of unsigned weights by signed activations.
template <int Bits>
QG_AVX2 inline __m256i acc_avx2(__m256i a, __m256i w, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Bits == 4) {
    return _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));  // no int16 saturation
  } else {  // 255 * 127 * 2 would saturate vpmaddubsw's int16: nibble by nibble
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i hi = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(w, 4), m4), x), ones);
    const __m256i lo = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_and_si256(w, m4), x), ones);
    return _mm256_add_epi32(a, _mm256_add_epi32(_mm256_slli_epi32(hi, 4), lo));
  }
}

QG_VNNI inline __m256i acc_vnni(__m256i a, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(a, w, x); }

// One micro tile: rows r0..r0+MR x columns c0..c0+NR of the panel (results stored for the first
// ``rows`` x ``cols`` of them; the rest is padding).
#define QG_MICRO(ACC)                                                                                        \
  const int64_t g = x.at.groups, rb = x.at.row_bytes;                                                        \
  __m256 fa[MR][NR], fb[MR][NR];                                                                             \
  for (int m = 0; m < MR; ++m)                                                                               \
    for (int n = 0; n < NR; ++n) fa[m][n] = fb[m][n] = _mm256_setzero_ps();                                 \
  for (int64_t k = 0; k < g; ++k) {                                                                          \
    const bool pairs = x.at.pairs && k == x.at.full; /* 1-4 blocks, two lanes each: 4 steps */              \
    __m256i ia[MR][NR];                                                                                      \
    for (int m = 0; m < MR; ++m)                                                                             \
      for (int n = 0; n < NR; ++n) ia[m][n] = _mm256_setzero_si256();                                       \
    const int8_t* xr = x.q.data() + r0 * rb + k * 256;                                                       \
    const uint8_t* wr = p.q.data() + c0 * rb + k * 256;                                                      \
    for (int ch = 0; ch < (pairs ? 4 : 8); ++ch) {                                                           \
      __m256i wv[NR];                                                                                        \
      for (int n = 0; n < NR; ++n) wv[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + n * rb + 32 * ch)); \
      for (int m = 0; m < MR; ++m) {                                                                         \
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + m * rb + 32 * ch));     \
        for (int n = 0; n < NR; ++n) ia[m][n] = ACC(ia[m][n], wv[n], xv);                                  \
      }                                                                                                      \
    }                                                                                                        \
    if (pairs) /* lanes 2j, 2j + 1 summed into lane j (lanes 4-7: 0) */                                      \
      for (int m = 0; m < MR; ++m)                                                                           \
        for (int n = 0; n < NR; ++n)                                                                         \
          ia[m][n] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(ia[m][n], _mm256_setzero_si256()),       \
                                                 _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));                \
    for (int m = 0; m < MR; ++m) {                                                                           \
      const __m256 dx = _mm256_loadu_ps(x.dx.data() + ((r0 + m) * g + k) * 8);                               \
      const __m256 sm = _mm256_loadu_ps(x.sum.data() + ((r0 + m) * g + k) * 8);                              \
      for (int n = 0; n < NR; ++n) {                                                                        \
        const __m256 sc = _mm256_mul_ps(_mm256_loadu_ps(p.s.data() + ((c0 + n) * g + k) * 8), dx);           \
        fa[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[m][n]), sc, fa[m][n]);                              \
        fb[m][n] = _mm256_fmadd_ps(_mm256_loadu_ps(p.b.data() + ((c0 + n) * g + k) * 8), sm, fb[m][n]);      \
      }                                                                                                      \
    }                                                                                                        \
  }                                                                                                          \
  for (int64_t m = 0; m < rows; ++m)                                                                         \
    for (int64_t n = 0; n < cols; ++n)                                                                       \
      y[(r0 + m) * ldy + p.n0 + c0 + n] = hsum8(_mm256_add_ps(fa[m][n], fb[m][n])) + (bias ? bias[p.n0 + c0 + n] : 0.f);

#define QG_MICRO_ARGS                                                                                        \
  const QuantRows &x, int64_t r0, int64_t rows, const Panel &p, int64_t c0, int64_t cols, const float *bias, float *y, \
      int64_t ldy

template <int MR, int NR, int Bits>
QG_AVX2 void micro_avx2(QG_MICRO_ARGS) {
  QG_MICRO(acc_avx2<Bits>)
}

template <int MR, int NR>
QG_VNNI void micro_vnni(QG_MICRO_ARGS) {
  QG_MICRO(acc_vnni)
}

using MicroFn = void (*)(QG_MICRO_ARGS);

template <int MR, int NR>
void panel_tiles(MicroFn micro, const QuantRows& x, int64_t r0, int64_t r1, const Panel& p, const float* bias,
                 float* y, int64_t ldy) {
  for (int64_t r = r0; r < r1; r += MR)
    for (int64_t c = 0; c < p.cols; c += NR)
      micro(x, r, std::min<int64_t>(MR, r1 - r), p, c, std::min<int64_t>(NR, p.cols - c), bias, y, ldy);
}
#endif

void run_panel(const QMatrixView& m, const QuantRows& x, int64_t r0, int64_t r1, const Panel& p, float* y, Isa isa) {
#ifdef QG_X86
  if (isa == Isa::avx512vnni) return panel_tiles<4, 4>(micro_vnni<4, 4>, x, r0, r1, p, m.bias, y, m.n);
  if (isa == Isa::avx2)
    return panel_tiles<2, 4>(m.bits == 4 ? micro_avx2<2, 4, 4> : micro_avx2<2, 4, 8>, x, r0, r1, p, m.bias, y, m.n);
#else
  (void)isa;
#endif
  panel_portable(x, r0, r1, p, m.bias, y, m.n);
}

}  // namespace

void QuantRows::quantize(const float* x, int64_t n_rows, int64_t n_k, Pool& pool) {
  rows = n_rows;
  k = n_k;
  at = BlockLayout(k);
  const int64_t blocks = at.blocks, groups = at.groups, padded = (rows + kRowPad - 1) / kRowPad * kRowPad;
  q.assign(padded * at.row_bytes, 0);
  dx.assign(padded * groups * 8, 0.f);
  sum.assign(padded * groups * 8, 0.f);
  constexpr int64_t kPer = 16;  // rows per task
  pool.run((rows + kPer - 1) / kPer, [&](int64_t t) {
    thread_local QuantRow row;
    for (int64_t r = t * kPer; r < std::min(rows, (t + 1) * kPer); ++r) {
      row.quantize(x + r * k, k);
      for (int64_t i = 0; i < blocks; ++i) {
        interleave(row.q.data() + 32 * i, i, at, q.data() + r * at.row_bytes);
        dx[(r * groups + i / 8) * 8 + i % 8] = row.dx[i];
        sum[(r * groups + i / 8) * 8 + i % 8] = row.sum[i];
      }
    }
  });
}

void qgemm(const QMatrixView& m, const QuantRows& x, float* y, Isa isa, Pool& pool) {
  // Rows split into chunks only where the panels are too few to keep the threads busy (each
  // chunk unpacks its panel again); chunks of a multiple of 4 rows (QuantRows' padding).
  if (x.rows == 0 || m.n == 0) return;
  const int64_t panels = (m.n + kPanel - 1) / kPanel, wanted = 4 * pool.threads();
  const int64_t chunks = std::clamp<int64_t>((wanted + panels - 1) / panels, 1, (x.rows + kMinChunk - 1) / kMinChunk);
  const int64_t chunk = ((x.rows + chunks - 1) / chunks + kRowPad - 1) / kRowPad * kRowPad;
  pool.run(panels * chunks, [&](int64_t t) {
    thread_local Panel p;
    const int64_t n0 = (t / chunks) * kPanel, r0 = (t % chunks) * chunk;
    if (r0 >= x.rows) return;
    p.unpack(m, n0, std::min(m.n, n0 + kPanel), x.at, isa != Isa::portable);
    run_panel(m, x, r0, std::min(x.rows, r0 + chunk), p, y, isa);
  });
}

}  // namespace mlx_serving
