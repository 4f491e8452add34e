// The embedding lookup of a tied model read from its head's packed copy (embed_rows.cpp).
#pragma once

#include "decode_step.h"
#include "mlx/array.h"

namespace mlx_serving {

// Rows ``ids`` (any shape, an integer dtype) of dequantize(m) -> (*ids.shape, K) float32: the rows
// of m's (N, K) matrix read from its packed copy (pack.h), value j of block i of row r as
// ``scale * q + offset`` in float32 (the product rounded, then the sum), with the block's scale and
// offset: what mx.dequantize of the MLX table m was packed from gives, bit for bit, so that a tied
// head's packed copy serves the lookup and MLX's table need not be kept. A negative id counts from
// the end (as mx.take); an id outside [-N, N) gives a row of zeros (ids are read as int32). Raises std::invalid_argument
// for ids that are not integers.
mlx::core::array packed_rows(const QMatrix& m, const mlx::core::array& ids);

}  // namespace mlx_serving
