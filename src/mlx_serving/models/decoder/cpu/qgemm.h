// The int8 GEMM of the native prefill (qgemm.cpp): many activation rows against one affine 4- or
// 8-bit matrix, each weight tile unpacked once and reused across the rows.
#pragma once

#include <cstdint>
#include <vector>

#include "pool.h"
#include "qdot.h"

namespace mlx_serving {

// M activation rows quantized as QuantRow does (per block of 32, the same rounding), laid out for
// the GEMM: the K / 32 blocks of a row in groups of 8 (the last group padded with zero blocks), a
// group's 256 bytes interleaved so that byte 32 s + 4 j + t is value 4 s + t of the group's block j
// (one 32-byte load feeds 8 blocks, one int32 lane each); ``dx`` / ``sum`` per block as QuantRow's,
// 8 per group (padding 0). Rows are padded to a multiple of 4 with zeros.
struct QuantRows {
  int64_t rows = 0, k = 0, groups = 0;
  std::vector<int8_t> q;        // padded rows x groups x 256
  std::vector<float> dx, sum;   // padded rows x groups x 8
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
