// The per-row and per-block loops of the native paged attention (attention_loops.cpp), each on the
// AVX2 path (``avx2``: avx2_path's answer) or the portable one; the same bits where a comment says so.
#pragma once

#include <cstdint>

namespace mlx_serving::attention_loops {

constexpr int kSk = 32;  // keys per block

// A quantized cache side (keys or values); bits 0: a float32 cache; 16: a float16 (bfloat16 with
// ``bf16``) cache whose rows ``w`` points to.
struct Quant {
  const uint32_t* w = nullptr;
  const float* scales = nullptr;
  const float* biases = nullptr;
  int bits = 0, group = 0;
  bool bf16 = false;
};

// True when the AVX2 loops run for head vectors of d values (the CPU has AVX2, FMA and F16C, d % 8 == 0).
bool avx2_path(int64_t d);

// out[0..d) = the 16-bit (q.bits 16, widened exactly) or quantized (dequantized: scale * q + bias in
// float32) head vector at flat index idx (row * Hkv + head).
void convert_row(const Quant& q, int64_t idx, int64_t d, bool avx2, float* out);

// s0[0..kSk) = q0 . K[s], s1 likewise for q1, K given transposed (d, kSk) in kt.
void scores(const float* q0, const float* q1, const float* kt, int64_t d, float* s0, float* s1, bool avx2);

// The online-softmax step of one query over one key block: sc[0..n) become exp(sc - top) (lanes n..kSk
// zero on the AVX2 path); returns their sum and sets *top (the running maximum after the block, from
// m) and *corr (exp(m - top): 0 on the first block, m = -inf).
float softmax(float* sc, int n, float m, float* top, float* corr, bool avx2);

// o[0..d) = o * corr + sum over s < n of p[s] * v[s].
void accumulate(float* o, float corr, const float* p, const float* const* v, int n, int64_t d, bool avx2);

// kt (d, kSk) = the kSk rows rows[0..kSk) of d values, transposed.
void transpose_block(const float* const* rows, int64_t d, float* kt, bool avx2);

// hadamard (kv_store.h: mx.hadamard_transform's bits) of each of the n head vectors rows[0..n) of d
// values (a power of 2) in place: 8 at a time on the AVX2 path, the same bits.
void rotate_all(float* const* rows, int64_t n, int64_t d, bool avx2);

}  // namespace mlx_serving::attention_loops
