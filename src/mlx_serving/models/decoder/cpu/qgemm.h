// The int8 products of the CPU decoder (qgemm.cpp): activation rows against one packed affine 4- or
// 8-bit matrix (pack.h), for one row (a decode step of one stream) as for 512 (a prefill chunk).
#pragma once

#include <cstdint>
#include <vector>

#include "pack.h"
#include "pool.h"
#include "qdot.h"

namespace mlx_serving {

// M activation rows rounded to int8 per block of 32, as llama.cpp's Q8_1: x[j] ~ dx * q[j] with
// dx = max |x| / 127 over the block and q[j] = x[j] * (127 / max |x|) rounded to the nearest
// integer (ties to even), and the block's sum dx * sum(q) (the weights' offset term reads it).
// ``q`` is laid out as the packed weights' values (BlockLayout, ``at.row_bytes`` per row), ``dx``
// / ``sum`` 8 per group (padding 0). Rows are padded to a multiple of 4 with zeros. The vector
// and portable roundings give the same bytes.
struct QuantRows {
  int64_t rows = 0, k = 0;
  BlockLayout at;
  std::vector<int8_t> q;        // padded rows x at.row_bytes
  std::vector<float> dx, sum;   // padded rows x at.groups x 8
  // Quantize x (rows, k) float32 (k a multiple of 32), tasks of 4 rows over ``pool``.
  void quantize(const float* x, int64_t rows, int64_t k, Pool& pool);
  // Size for ``rows`` x ``k`` values, all zero (what quantize and qgemm_swiglu fill).
  void shape(int64_t rows, int64_t k);
};

// y[r * m.n + c] = sum_j dequantize(w)[c, j] x_r[j] (+ bias[c]) for every row r of ``x`` and every
// column c of ``m`` (y (rows, n) float32), work split over ``pool`` by (column chunk, row chunk).
// Per block, the integer sum of the int8 activations by the unsigned weights is exact; each
// block's float scaling and accumulation take one fixed order per ISA (vector paths: s * dx per
// lane, one fused multiply-add per 8 blocks, the offsets' term beside it, one horizontal sum at
// the end; the portable loop block by block), so each (row, column) is bit for bit the same
// whatever the other rows, the tile it falls in and the thread that runs it.
void qgemm(const PackedMatrix& m, const QuantRows& x, float* y, Isa isa, Pool& pool);

// The gate/up product and the SwiGLU after it: ``m`` (2 I, K) holds the gate columns then the up
// columns (I a multiple of 32); act (rows, I) = silu(x @ gate.T) * (x @ up.T), computed as
// g / (1 + exp(-g)) * u in float32 (the decode step's formula) and rounded as quantize rounds
// it, for the down product. Work split over ``pool`` by (chunk of 32-column blocks, row chunk):
// a task computes its blocks' gate and up columns itself, so each rounded act value is bit for
// bit quantize(SwiGLU(qgemm(m, x))).
void qgemm_swiglu(const PackedMatrix& m, const QuantRows& x, QuantRows& act, Isa isa, Pool& pool);

// The same for rows [r0, r1) and columns [c0, c1) (c0 a multiple of kTileCols) on the calling thread.
void qgemm_range(const PackedMatrix& m, const QuantRows& x, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float* y,
                 Isa isa);

}  // namespace mlx_serving
