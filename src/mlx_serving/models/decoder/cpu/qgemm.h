// The int8 GEMM of the native prefill (qgemm.cpp): many activation rows against one affine 4- or
// 8-bit matrix, each weight tile unpacked once and reused across the rows.
#pragma once

#include <cstdint>
#include <vector>

#include "pool.h"
#include "qdot.h"

namespace mlx_serving {

// Where the values of a row's K / 32 blocks lie in QuantRows' layout: in groups of 8 blocks, a
// group's 256 bytes interleaved so that byte 32 ch + 4 j + t is value 4 ch + t of the group's
// block j (one 32-byte load feeds 8 blocks, one int32 lane each). A last group of 1-4 blocks
// (``pairs``) takes 128 bytes, two lanes per block: byte 32 (ch % 4) + 4 (2 j + ch / 4) + t.
// A last group of 5-7 blocks is a whole group padded with zero blocks.
struct BlockLayout {
  int64_t blocks = 0, full = 0, groups = 0, row_bytes = 0;  // full: whole groups; groups: with the last
  bool pairs = false;
  explicit BlockLayout(int64_t k = 0)
      : blocks(k / 32), full(blocks / 8), groups((blocks + 7) / 8), pairs(blocks % 8 != 0 && blocks % 8 <= 4) {
    row_bytes = full * 256 + (blocks % 8 == 0 ? 0 : pairs ? 128 : 256);
  }
  int64_t offset(int64_t i, int ch) const {  // of value 4 ch of block i
    const int64_t g = i / 8, j = i % 8;
    return pairs && g == full ? full * 256 + 32 * (ch % 4) + 4 * (2 * j + ch / 4) : g * 256 + 32 * ch + 4 * j;
  }
};

// M activation rows quantized as QuantRow does (per block of 32, the same rounding), laid out for
// the GEMM (BlockLayout, ``at.row_bytes`` per row); ``dx`` / ``sum`` per block as QuantRow's, 8 per
// group (padding 0). Rows are padded to a multiple of 4 with zeros.
struct QuantRows {
  int64_t rows = 0, k = 0;
  BlockLayout at;
  std::vector<int8_t> q;        // padded rows x at.row_bytes
  std::vector<float> dx, sum;   // padded rows x at.groups x 8
  // Quantize x (rows, k) float32 (k a multiple of 32), rows split over ``pool``.
  void quantize(const float* x, int64_t rows, int64_t k, Pool& pool);
};

// y[r * n + c] = sum_j dequantize(w)[c, j] x_r[j] (+ bias[c]) for every row r of ``x`` and every
// column c of ``m`` (y (rows, n) float32), work split over ``pool`` by (column panel, row chunk).
// Each (row, column) is the same computation as qgemv's on the same ISA (the integer block sums
// are exact; the float scaling and accumulation follow qgemv's order): the result is bit for bit
// the decode step's product, whatever the row's batchmates or its place among the rows.
void qgemm(const QMatrixView& m, const QuantRows& x, float* y, Isa isa, Pool& pool);

}  // namespace mlx_serving
