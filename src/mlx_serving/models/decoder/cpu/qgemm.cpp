// The int8 products of the CPU decoder (issue 39): y = x @ dequantize(w).T for 1 to many rows x,
// activations quantized per block of 32 to int8 (QuantRows' rounding, as llama.cpp's Q8_1), weights packed once when
// the decoder is made (pack.h): the decode step's products (1-32 rows a step) and the native
// prefill's (prefill.cpp) are this one kernel over one layout.
//
// Activations and weights are interleaved by groups of 8 blocks (BlockLayout), so one 32-byte
// load feeds one int32 lane per block: 8 multiply-accumulates (AVX-512 VNNI's vpdpbusd, or AVX2's
// vpmaddubsw + vpmaddwd) leave the 8 blocks' exact integer sums in the 8 lanes, with no horizontal
// sums; a last group of 1-4 blocks (SmolLM2's K = 576 is 18 blocks) takes two lanes per block, 4
// steps and one pairwise sum. 4-bit weights are read as they are stored: one 32-byte load, an and
// and a shift give two vectors' values. A micro tile keeps MR rows x 4 columns of these sums in
// registers: ymm tiles of up to 4 rows with VNNI's 32 vector registers, 2 on AVX2's 16; on VNNI, 5
// or 6 rows a zmm tile (a column pair per register, issue 41: a verify of 4-5 drafts in one pass
// over the weights). A range's rows run in tiles of 4 and a last one of 1-6 (1-2 on AVX2), each
// over all its columns: a one-row decode step computes no padding rows.
//
// Numerics: the integer sums are exact; each block's float scaling and accumulation take one order
// per ISA (s * dx per lane, one fused multiply-add per 8 blocks, the offsets' term beside it, one
// horizontal sum at the end; the portable loop block by block), so each (row, column) is bit for
// bit the same whatever the other rows, the tile it falls in and the thread that runs it.

#include "qgemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define QG_X86 1
#define QG_AVX2 __attribute__((target("avx2,fma,f16c")))
#define QG_VNNI __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#define QG_INLINE inline __attribute__((always_inline))
#endif

namespace mlx_serving {

namespace {

constexpr int64_t kRowPad = 4;      // QuantRows pads its rows to this (the largest micro tile's rows)
constexpr int64_t kRowChunk = 64;   // most rows a task runs its columns over
constexpr int64_t kMaxTiles = 16;   // most column tiles a task takes (64 columns)
constexpr int64_t kQuantRows = 4;   // rows per task of QuantRows::quantize
constexpr int64_t kMaxBlocks = 4;   // most blocks of 32 SwiGLU columns a qgemm_swiglu task takes

// Where a range's results go: value (r, c) at y[(r - r0) * ld + c - c0].
struct Out {
  float* y;
  int64_t ld, r0, c0;
  float& at(int64_t r, int64_t c) const { return y[(r - r0) * ld + c - c0]; }
};

// Rows [r0, r1) x columns [c0, c1), block by block.
void range_portable(const PackedMatrix& m, const QuantRows& x, int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                    const Out& y) {
  const BlockLayout& at = x.at;
  const int64_t g = at.groups;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) {
      const int8_t* xq = x.q.data() + r * at.row_bytes;
      float acc = 0.f, bacc = 0.f;
      for (int64_t i = 0; i < at.blocks; ++i) {
        int32_t d = 0;
        for (int j = 0; j < 32; ++j) d += m.value(c, i, j) * xq[at.offset(i, j / 4) + j % 4];
        const int64_t wi = m.param(c / kTileCols, i / 8, c % kTileCols) + i % 8, xi = (r * g + i / 8) * 8 + i % 8;
        acc += m.scale(wi) * x.dx[xi] * static_cast<float>(d);
        bacc += m.offset(wi) * x.sum[xi];
      }
      y.at(r, c) = acc + bacc + (m.bias.empty() ? 0.f : m.bias[c]);
    }
}

#ifdef QG_X86
// The tile's bias (its first ``cols`` columns; 0 for the rest and for a matrix without one).
QG_AVX2 inline __m128 bias_of(const PackedMatrix& p, int64_t c0, int64_t cols) {
  alignas(16) float b[kTileCols] = {0.f, 0.f, 0.f, 0.f};
  if (!p.bias.empty()) std::copy_n(p.bias.data() + c0, cols, b);
  return _mm_load_ps(b);
}

// One row's 4 results, fa[n] + fb[n] summed over their 8 lanes, plus the bias, into y[0..cols):
// per column ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) + bias, the 4 columns at once (the
// halves added, a 4 x 4 transpose, two more adds: the order of a horizontal sum of each).
QG_AVX2 inline void store_row(const __m256* fa, const __m256* fb, __m128 bias, int64_t cols, float* y) {
  __m128 h[kTileCols];
  for (int n = 0; n < kTileCols; ++n) {
    const __m256 v = _mm256_add_ps(fa[n], fb[n]);
    h[n] = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  }
  _MM_TRANSPOSE4_PS(h[0], h[1], h[2], h[3]);
  const __m128 s = _mm_add_ps(_mm_add_ps(_mm_add_ps(h[0], h[2]), _mm_add_ps(h[1], h[3])), bias);
  if (cols == kTileCols) {
    _mm_storeu_ps(y, s);
    return;
  }
  alignas(16) float out[kTileCols];
  _mm_store_ps(out, s);
  std::copy_n(out, cols, y);
}

template <bool Half>
QG_AVX2 inline __m256 params8(const void* base, int64_t slot) {
  if constexpr (Half)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + slot)));
  else return _mm256_loadu_ps(static_cast<const float*>(base) + slot);
}

QG_AVX2 inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

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

// One group's exact integer block sums, ia[m][n], for VECS (8, or 4 in a last ``pairs`` group)
// vectors of 32 activation bytes: the vector loop's count known when compiled, so it unrolls and
// the accumulators stay in registers.
#define QG_GROUP_SUMS(ACC, VECS)                                                                              \
  for (int m = 0; m < MR; ++m)                                                                                \
    for (int n = 0; n < kTileCols; ++n) ia[m][n] = _mm256_setzero_si256();                                   \
  if constexpr (Bits == 4) {                                                                                  \
    const __m256i m4 = _mm256_set1_epi8(0x0F);                                                                \
    _Pragma("GCC unroll 4") for (int v = 0; v < (VECS) / 2; ++v) {                                            \
      __m256i lo[kTileCols], hi[kTileCols];                                                                   \
      for (int n = 0; n < kTileCols; ++n) {                                                                   \
        const __m256i raw = load32(wg + n * cb + 32 * v);                                                     \
        lo[n] = _mm256_and_si256(raw, m4);                                                                    \
        hi[n] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);                                              \
      }                                                                                                       \
      for (int m = 0; m < MR; ++m) {                                                                          \
        const __m256i xl = load32(xr + m * rb + 32 * v), xh = load32(xr + m * rb + 32 * (v + (VECS) / 2));   \
        for (int n = 0; n < kTileCols; ++n) ia[m][n] = ACC(ACC(ia[m][n], lo[n], xl), hi[n], xh);              \
      }                                                                                                       \
    }                                                                                                         \
  } else {                                                                                                    \
    _Pragma("GCC unroll 8") for (int v = 0; v < (VECS); ++v) {                                                \
      __m256i wv[kTileCols];                                                                                  \
      for (int n = 0; n < kTileCols; ++n) wv[n] = load32(wg + n * cb + 32 * v);                               \
      for (int m = 0; m < MR; ++m) {                                                                          \
        const __m256i xv = load32(xr + m * rb + 32 * v);                                                      \
        for (int n = 0; n < kTileCols; ++n) ia[m][n] = ACC(ia[m][n], wv[n], xv);                              \
      }                                                                                                       \
    }                                                                                                         \
  }

// Group k's sums scaled into fa: fa += float(ia) * (s * dx), lane by lane.
#define QG_GROUP_SCALE                                                                                        \
  for (int m = 0; m < MR; ++m) {                                                                              \
    const __m256 dx = _mm256_loadu_ps(x.dx.data() + ((r0 + m) * g + k) * 8);                                  \
    for (int n = 0; n < kTileCols; ++n) {                                                                     \
      const __m256 sc = _mm256_mul_ps(params8<Half>(sp, p.param(tile, k, n)), dx);                           \
      fa[m][n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[m][n]), sc, fa[m][n]);                                 \
    }                                                                                                         \
  }

// One micro tile: rows r0..r0+MR x the 4 columns of ``tile`` (results stored for its first
// ``cols``; the rest is padding). Per group: the exact integer block sums, then their scaling
// (fa); the offsets' term (fb: b * the block's quantized sum) in a loop of its own, after, in the
// same group order (lane by lane the same operations as when interleaved: bit for bit the same).
#define QG_MICRO(ACC)                                                                                         \
  const BlockLayout& at = x.at;                                                                               \
  const int64_t g = at.groups, rb = at.row_bytes, whole = at.pairs ? at.full : g;                             \
  const uint8_t* wt = p.q.data() + tile * p.tile_bytes();                                                     \
  const void* sp = Half ? static_cast<const void*>(p.s16.data()) : static_cast<const void*>(p.s32.data());    \
  const void* bp = Half ? static_cast<const void*>(p.b16.data()) : static_cast<const void*>(p.b32.data());    \
  __m256 fa[MR][kTileCols];                                                                                   \
  __m256i ia[MR][kTileCols];                                                                                  \
  for (int m = 0; m < MR; ++m)                                                                                \
    for (int n = 0; n < kTileCols; ++n) fa[m][n] = _mm256_setzero_ps();                                       \
  for (int64_t k = 0; k < whole; ++k) {                                                                       \
    const int64_t cb = 256 * Bits / 8;                                                                        \
    const int8_t* xr = x.q.data() + r0 * rb + k * 256;                                                        \
    const uint8_t* wg = wt + p.group_offset(k);                                                               \
    QG_GROUP_SUMS(ACC, 8)                                                                                     \
    QG_GROUP_SCALE                                                                                            \
  }                                                                                                           \
  if (at.pairs) { /* 1-4 blocks, two lanes each: 4 vectors; lanes 2j, 2j + 1 summed into lane j (4-7: 0) */   \
    const int64_t k = at.full, cb = 128 * Bits / 8;                                                           \
    const int8_t* xr = x.q.data() + r0 * rb + k * 256;                                                        \
    const uint8_t* wg = wt + p.group_offset(k);                                                               \
    QG_GROUP_SUMS(ACC, 4)                                                                                     \
    for (int m = 0; m < MR; ++m)                                                                              \
      for (int n = 0; n < kTileCols; ++n)                                                                     \
        ia[m][n] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(ia[m][n], _mm256_setzero_si256()),          \
                                               _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));                   \
    QG_GROUP_SCALE                                                                                            \
  }                                                                                                           \
  const int64_t c0 = tile * kTileCols;                                                                        \
  const __m128 bias4 = bias_of(p, c0, cols);                                                                  \
  for (int m = 0; m < MR; ++m) {                                                                              \
    __m256 fb[kTileCols];                                                                                     \
    for (int n = 0; n < kTileCols; ++n) fb[n] = _mm256_setzero_ps();                                          \
    for (int64_t k = 0; k < g; ++k) {                                                                         \
      const __m256 sm = _mm256_loadu_ps(x.sum.data() + ((r0 + m) * g + k) * 8);                               \
      for (int n = 0; n < kTileCols; ++n)                                                                     \
        fb[n] = _mm256_fmadd_ps(params8<Half>(bp, p.param(tile, k, n)), sm, fb[n]);                           \
    }                                                                                                         \
    store_row(fa[m], fb, bias4, cols, &y.at(r0 + m, c0));                                                      \
  }

#define QG_MICRO_ARGS const QuantRows &x, int64_t r0, const PackedMatrix &p, int64_t tile, int64_t cols, const Out &y

template <int MR, int Bits, bool Half>
QG_AVX2 void micro_avx2(QG_MICRO_ARGS) {
  QG_MICRO(acc_avx2<Bits>)
}

// 1-4 rows on VNNI: the AVX2 kernel's ymm tiles with VNNI's multiply-add.
QG_VNNI inline __m256i acc_vnni(__m256i a, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(a, w, x); }

template <int MR, int Bits, bool Half>
QG_VNNI void micro_vnni_ymm(QG_MICRO_ARGS) {
  QG_MICRO(acc_vnni)
}

using MicroFn = void (*)(QG_MICRO_ARGS);

// The micro kernels of one ISA and weight format: fn[mr] for mr = 1..most rows.
struct Micros {
  MicroFn fn[7];
  int most;
};

template <int Bits, bool Half>
Micros avx2_of() {
  return {{nullptr, micro_avx2<1, Bits, Half>, micro_avx2<2, Bits, Half>}, 2};
}

// AVX-512 VNNI, 5 or 6 rows (issue 41: a verify of 4-5 drafts): a column pair (columns 2p, 2p + 1
// of a tile) per zmm register, lanes 0-7 the first column's 8 blocks and 8-15 the second's, each
// lane the same operations in the same order as the ymm kernel's lane (so the same results bit for
// bit). A micro tile is MR rows x the tile's 4 columns: 2 MR int32 sums and 2 MR float
// accumulators, in registers up to 6 rows (the ymm kernel's 4 x 4 sums fill AVX-512's 32 registers
// from 4 rows), so 5 and 6 rows are one pass over the weights instead of a 4-row and a 1- or 2-row
// pass. Each activation vector is loaded once (broadcast to both halves) for 2 multiply-adds, each
// weight vector (its 4-bit unpacking) once for MR rows. Zen 4 runs a zmm op on two 256-bit halves:
// the same multiply-adds per cycle as ymm, half the instructions. Fewer rows run the ymm kernel:
// zmm tiles of 1-4 rows measured no faster at 2-4 rows and slower at one row, whose product streams
// the weights from memory (docs/benchmarks.md, "Multi-row products").
constexpr int kWideRows = 6;

// 32 bytes (a vector of int8 activations) or 8 floats, the same in both 256-bit halves.
QG_VNNI QG_INLINE __m512i bcast_bytes(const int8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
QG_VNNI QG_INLINE __m512 bcast_floats(const float* p) {
  return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

// Stored vector v of the columns at ``col`` and ``col`` + cb (a pair's: cb, a column's bytes in the
// group), side by side.
QG_VNNI QG_INLINE __m512i pair_vector(const uint8_t* col, int64_t cb, int v) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(load32(col + 32 * v)), load32(col + cb + 32 * v), 1);
}

// A pair's 16 scales or offsets (8 per column, the columns' slots side by side) as float32.
template <bool Half>
QG_VNNI QG_INLINE __m512 params16(const void* base, int64_t slot) {
  if constexpr (Half)
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + slot)));
  else return _mm512_loadu_ps(static_cast<const float*>(base) + slot);
}

// One group's exact integer block sums of the tile's two pairs for MR rows, ia[m][pair], from Vecs
// vectors of 32 activation bytes (8, or 4 in a last ``pairs`` group); ``wp``: the tile's group,
// column n's vectors at n * cb.
template <int MR, int Bits, int Vecs>
QG_VNNI QG_INLINE void tile_sums(const uint8_t* wp, int64_t cb, const int8_t* xr, int64_t rb,
                                 __m512i (&ia)[MR][2]) {
  for (int m = 0; m < MR; ++m) ia[m][0] = ia[m][1] = _mm512_setzero_si512();
  if constexpr (Bits == 4) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
    for (int v = 0; v < Vecs / 2; ++v) {
      __m512i lo[2], hi[2];
      for (int q = 0; q < 2; ++q) {
        const __m512i raw = pair_vector(wp + 2 * q * cb, cb, v);
        lo[q] = _mm512_and_si512(raw, m4);
        hi[q] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
      }
      for (int m = 0; m < MR; ++m) {
        const __m512i xl = bcast_bytes(xr + m * rb + 32 * v), xh = bcast_bytes(xr + m * rb + 32 * (v + Vecs / 2));
        for (int q = 0; q < 2; ++q) ia[m][q] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ia[m][q], lo[q], xl), hi[q], xh);
      }
    }
  } else {
#pragma GCC unroll 8
    for (int v = 0; v < Vecs; ++v) {
      const __m512i w[2] = {pair_vector(wp, cb, v), pair_vector(wp + 2 * cb, cb, v)};
      for (int m = 0; m < MR; ++m) {
        const __m512i xv = bcast_bytes(xr + m * rb + 32 * v);
        for (int q = 0; q < 2; ++q) ia[m][q] = _mm512_dpbusd_epi32(ia[m][q], w[q], xv);
      }
    }
  }
}

// A last ``pairs`` group's sums: lanes 2j, 2j + 1 of each column summed into its lane j (4-7: 0).
QG_VNNI QG_INLINE __m512i pairs_to_blocks(__m512i a) {
  const __m512i s = _mm512_add_epi32(a, _mm512_srli_epi64(a, 32));
  return _mm512_maskz_permutexvar_epi32(0x0F0F, _mm512_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0, 8, 10, 12, 14, 0, 0, 0, 0),
                                        s);
}

// Group k's sums scaled into fa, lane by lane: fa += float(ia) * (s * dx) (``slot``: pair 0's
// scales of the group, pair 1's 16 further; ``dx``: the first row's 8 of the group, the next
// rows ``ld`` further).
template <int MR, bool Half>
QG_VNNI QG_INLINE void scale_group(const void* sp, int64_t slot, const float* dx, int64_t ld,
                                   const __m512i (&ia)[MR][2], __m512 (&fa)[MR][2]) {
  const __m512 s[2] = {params16<Half>(sp, slot), params16<Half>(sp, slot + 16)};
  for (int m = 0; m < MR; ++m) {
    const __m512 d = bcast_floats(dx + m * ld);
    for (int q = 0; q < 2; ++q)
      fa[m][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m][q]), _mm512_mul_ps(s[q], d), fa[m][q]);
  }
}

// One row's pair of results (its first ``cols``, 0-2), fa + fb summed over each column's 8 lanes,
// plus the bias: per column ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)) + bias, store_row's order.
QG_VNNI QG_INLINE void store_pair(__m512 fa, __m512 fb, __m128 bias, int64_t cols, float* y) {
  const __m512 v = _mm512_add_ps(fa, fb);
  const __m128 h0 = _mm_add_ps(_mm512_castps512_ps128(v), _mm512_extractf32x4_ps(v, 1));
  const __m128 h1 = _mm_add_ps(_mm512_extractf32x4_ps(v, 2), _mm512_extractf32x4_ps(v, 3));
  const __m128 s = _mm_add_ps(_mm_unpacklo_ps(h0, h1), _mm_unpackhi_ps(h0, h1));  // a + c, b + d per column
  const __m128 r = _mm_add_ps(_mm_add_ps(s, _mm_movehl_ps(s, s)), bias);
  if (cols >= 2) _mm_storel_pi(reinterpret_cast<__m64*>(y), r);
  else if (cols == 1) _mm_store_ss(y, r);
}

// One micro tile: rows r0..r0+MR x the 4 columns of ``tile`` (results stored for its first
// ``cols``; the rest is padding). Per group: the exact integer block sums, then their scaling
// (fa); the offsets' term (fb: b * the block's quantized sum) in a loop of its own, row by row,
// in the same group order (lane by lane the AVX2 kernel's operations and order).
template <int MR, int Bits, bool Half>
QG_VNNI void micro_vnni(QG_MICRO_ARGS) {
  const BlockLayout& at = x.at;
  const int64_t g = at.groups, rb = at.row_bytes, whole = at.pairs ? at.full : g;
  const uint8_t* wt = p.q.data() + tile * p.tile_bytes();
  const void* sp = Half ? static_cast<const void*>(p.s16.data()) : static_cast<const void*>(p.s32.data());
  const void* bp = Half ? static_cast<const void*>(p.b16.data()) : static_cast<const void*>(p.b32.data());
  const int8_t* xq = x.q.data() + r0 * rb;
  const float* dx = x.dx.data() + r0 * g * 8;
  const float* sum = x.sum.data() + r0 * g * 8;
  __m512 fa[MR][2];
  __m512i ia[MR][2];
  for (int m = 0; m < MR; ++m) fa[m][0] = fa[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < whole; ++k) {
    tile_sums<MR, Bits, 8>(wt + p.group_offset(k), p.column_bytes(k), xq + k * 256, rb, ia);
    scale_group<MR, Half>(sp, p.param(tile, k, 0), dx + k * 8, g * 8, ia, fa);
  }
  if (at.pairs) {
    const int64_t k = at.full;
    tile_sums<MR, Bits, 4>(wt + p.group_offset(k), p.column_bytes(k), xq + k * 256, rb, ia);
    for (int m = 0; m < MR; ++m)
      for (int q = 0; q < 2; ++q) ia[m][q] = pairs_to_blocks(ia[m][q]);
    scale_group<MR, Half>(sp, p.param(tile, k, 0), dx + k * 8, g * 8, ia, fa);
  }
  const int64_t c0 = tile * kTileCols;
  const __m128 bias01 = bias_of(p, c0, std::min<int64_t>(cols, 2));
  const __m128 bias23 = bias_of(p, c0 + 2, std::max<int64_t>(cols - 2, 0));
  for (int m = 0; m < MR; ++m) {
    __m512 fb[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < g; ++k) {
      const __m512 sm = bcast_floats(sum + (m * g + k) * 8);
      const int64_t slot = p.param(tile, k, 0);
      for (int q = 0; q < 2; ++q) fb[q] = _mm512_fmadd_ps(params16<Half>(bp, slot + 16 * q), sm, fb[q]);
    }
    float* ym = &y.at(r0 + m, c0);
    store_pair(fa[m][0], fb[0], bias01, std::min<int64_t>(cols, 2), ym);
    store_pair(fa[m][1], fb[1], bias23, cols - 2, ym + 2);
  }
}

template <int Bits, bool Half>
Micros vnni_of() {
  return {{nullptr, micro_vnni_ymm<1, Bits, Half>, micro_vnni_ymm<2, Bits, Half>, micro_vnni_ymm<3, Bits, Half>,
           micro_vnni_ymm<4, Bits, Half>, micro_vnni<5, Bits, Half>, micro_vnni<6, Bits, Half>},
          kWideRows};
}

Micros micros(Isa isa, int bits, bool half) {
  if (isa == Isa::avx512vnni) {
    if (bits == 4) return half ? vnni_of<4, true>() : vnni_of<4, false>();
    return half ? vnni_of<8, true>() : vnni_of<8, false>();
  }
  if (bits == 4) return half ? avx2_of<4, true>() : avx2_of<4, false>();
  return half ? avx2_of<8, true>() : avx2_of<8, false>();
}

// The rows of the next micro tile with ``left`` rows to go: all of them when a kernel takes them,
// else 4 (the ymm kernel's most; AVX2: 2), so that the last tile has 1-6 rows.
int64_t tile_rows(const Micros& mi, int64_t left) { return left <= mi.most ? left : std::min<int64_t>(mi.most, 4); }
#endif

// Activation rounding (QuantRows): for a weight group with scale s and offset b (w = s q + b, q
// unsigned) and an activation block x ~ dx xq, sum_j x_j w_j = s dx sum_j xq_j q_j + b sum_j x_j.
// The integer sums are exact and the offset term uses the block's quantized sum dx sum_j xq_j
// (with b ~ -8 s for 4-bit weights, the exact float sum would leave the rounding errors of the two
// terms uncorrelated, ~3x the error measured). The only approximation is the rounding to 8 bits
// (at most half a step, 1/254 of the block's largest value): the product is exactly that of the
// rounded x.

// Block i's 32 values (natural order) into row ``q``'s places (BlockLayout), its scale and sum.
inline void place_block(const BlockLayout& at, int64_t i, const int8_t* v, float d, int32_t s, int8_t* q,
                        float* dx, float* sum) {
  for (int ch = 0; ch < 8; ++ch) std::memcpy(q + at.offset(i, ch), v + 4 * ch, 4);
  dx[(i / 8) * 8 + i % 8] = d;
  sum[(i / 8) * 8 + i % 8] = d * static_cast<float>(s);
}

// Blocks [i0, i1) of a row (x: their values, (i1 - i0) x 32 float32) rounded one by one into the
// row's places (``q``, ``dx``, ``sum``: the row's).
void quantize_portable(const float* x, const BlockLayout& at, int64_t i0, int64_t i1, int8_t* q, float* dx,
                       float* sum) {
  for (int64_t i = i0; i < i1; ++i) {
    const float* xb = x + 32 * (i - i0);
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int8_t v[32];
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) {
      v[j] = static_cast<int8_t>(std::nearbyint(xb[j] * inv));
      s += v[j];
    }
    place_block(at, i, v, d, s, q, dx, sum);
  }
}

#ifdef QG_X86
// The same rounding 8 lanes at a time: the largest |x| by max (exact in any order; a NaN is
// skipped, as std::max skips it), the product by 127 / max rounded by the current mode (ties to
// even, as nearbyint), the int32 values packed to int8 (each within +-127, no saturation).
QG_AVX2 void quantize_avx2(const float* x, const BlockLayout& at, int64_t i0, int64_t i1, int8_t* q, float* dx,
                           float* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = i0; i < i1; ++i) {
    const float* xb = x + 32 * (i - i0);
    __m256 v[4], top = _mm256_setzero_ps();
    for (int t = 0; t < 4; ++t) {
      v[t] = _mm256_loadu_ps(xb + 8 * t);
      top = _mm256_max_ps(_mm256_andnot_ps(sign, v[t]), top);
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
    const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    const __m256 scale = _mm256_set1_ps(inv);
    __m256i n[4];
    for (int t = 0; t < 4; ++t) n[t] = _mm256_cvtps_epi32(_mm256_mul_ps(v[t], scale));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3])), order);
    alignas(32) int8_t out[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), bytes);
    place_block(at, i, out, d, _mm_cvtsi128_si32(s4), q, dx, sum);
  }
}
#endif

// Blocks [i0, i1) of row r of ``rows`` from x (their values), with the vector rounding where the
// CPU has it (the same bytes as the portable loop's).
void quantize_blocks(const float* x, QuantRows& rows, int64_t r, int64_t i0, int64_t i1) {
  const BlockLayout& at = rows.at;
  int8_t* q = rows.q.data() + r * at.row_bytes;
  float* dx = rows.dx.data() + r * at.groups * 8;
  float* sum = rows.sum.data() + r * at.groups * 8;
#ifdef QG_X86
  if (best_isa() != Isa::portable) return quantize_avx2(x, at, i0, i1, q, dx, sum);
#endif
  quantize_portable(x, at, i0, i1, q, dx, sum);
}

// Rows [r0, r1) x columns [c0, c1) into ``y`` on the calling thread.
void range(const PackedMatrix& m, const QuantRows& x, int64_t r0, int64_t r1, int64_t c0, int64_t c1, const Out& y,
           Isa isa) {
#ifdef QG_X86
  if (isa != Isa::portable) {
    // Rows a micro tile at a time, each over all the columns: one long stream of the weights for
    // the hardware prefetcher (a second tile of rows then reads them from L2).
    const Micros mi = micros(isa, m.bits, m.half);
    for (int64_t r = r0, mr = 0; r < r1; r += mr) {
      mr = tile_rows(mi, r1 - r);
      for (int64_t tile = c0 / kTileCols; tile * kTileCols < c1; ++tile)
        mi.fn[mr](x, r, m, tile, std::min<int64_t>(kTileCols, c1 - tile * kTileCols), y);
    }
    return;
  }
#endif
  range_portable(m, x, r0, r1, c0, c1, y);
}

}  // namespace

void QuantRows::shape(int64_t n_rows, int64_t n_k) {
  rows = n_rows;
  k = n_k;
  at = BlockLayout(k);
  const int64_t padded = (rows + kRowPad - 1) / kRowPad * kRowPad;
  q.assign(padded * at.row_bytes, 0);
  dx.assign(padded * at.groups * 8, 0.f);
  sum.assign(padded * at.groups * 8, 0.f);
}

void QuantRows::quantize(const float* x, int64_t n_rows, int64_t n_k, Pool& pool) {
  shape(n_rows, n_k);
  pool.run((rows + kQuantRows - 1) / kQuantRows, [&](int64_t t) {
    for (int64_t r = t * kQuantRows; r < std::min(rows, (t + 1) * kQuantRows); ++r)
      quantize_blocks(x + r * k, *this, r, 0, at.blocks);
  });
}

void qgemm_range(const PackedMatrix& m, const QuantRows& x, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float* y,
                 Isa isa) {
  range(m, x, r0, r1, c0, c1, {y, m.n, 0, 0}, isa);
}

void qgemm(const PackedMatrix& m, const QuantRows& x, float* y, Isa isa, Pool& pool) {
  // Tasks of a chunk of columns (8 or more tasks per thread where the columns allow, at most 64
  // columns) by a chunk of rows (at most kRowChunk).
  if (x.rows == 0 || m.n == 0) return;
  const int64_t wanted = 8 * pool.threads();
  const int64_t per = std::clamp<int64_t>((m.tiles + wanted - 1) / wanted, 1, kMaxTiles);
  const int64_t col_chunks = (m.tiles + per - 1) / per, row_chunks = (x.rows + kRowChunk - 1) / kRowChunk;
  pool.run(col_chunks * row_chunks, [&](int64_t t) {
    const int64_t c0 = (t / row_chunks) * per * kTileCols, r0 = (t % row_chunks) * kRowChunk;
    range(m, x, r0, std::min(x.rows, r0 + kRowChunk), c0, std::min(m.n, c0 + per * kTileCols), {y, m.n, 0, 0}, isa);
  });
}

void qgemm_swiglu(const PackedMatrix& m, const QuantRows& x, QuantRows& act, Isa isa, Pool& pool) {
  // Tasks of a chunk of SwiGLU blocks (8 or more tasks per thread where the blocks allow, at most
  // kMaxBlocks) by a chunk of rows; each computes its gate and up columns into buffers of its own,
  // then the SwiGLU and its blocks' rounding, so no output leaves the core unrounded.
  const int64_t inter = m.n / 2, blocks = inter / 32;
  act.shape(x.rows, inter);
  if (x.rows == 0 || blocks == 0) return;
  const int64_t wanted = 8 * pool.threads();
  const int64_t per = std::clamp<int64_t>((blocks + wanted - 1) / wanted, 1, kMaxBlocks);
  const int64_t chunks = (blocks + per - 1) / per, row_chunks = (x.rows + kRowChunk - 1) / kRowChunk;
  pool.run(chunks * row_chunks, [&](int64_t t) {
    thread_local std::vector<float> gate, up, out;
    const int64_t i0 = (t / row_chunks) * per, i1 = std::min(blocks, i0 + per), c0 = 32 * i0, w = 32 * (i1 - i0);
    const int64_t r0 = (t % row_chunks) * kRowChunk, r1 = std::min(x.rows, r0 + kRowChunk);
    gate.resize((r1 - r0) * w);
    up.resize((r1 - r0) * w);
    out.resize(w);
    range(m, x, r0, r1, c0, c0 + w, {gate.data(), w, r0, c0}, isa);
    range(m, x, r0, r1, inter + c0, inter + c0 + w, {up.data(), w, r0, inter + c0}, isa);
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gate.data() + (r - r0) * w;
      const float* u = up.data() + (r - r0) * w;
      for (int64_t i = 0; i < w; ++i) out[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
      quantize_blocks(out.data(), act, r, i0, i1);
    }
  });
}

}  // namespace mlx_serving
