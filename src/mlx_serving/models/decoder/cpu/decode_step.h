// The CPU decode step (decode_step.cpp): the shared decoder's one-token forward in one MLX primitive.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mlx/array.h"

namespace mlx_serving {

struct PackedMatrix;

// An affine-quantized matrix of the model, given in MLX's layout (see QMatrixView in qdot.h) and
// packed once, on construction, for the int8 products (pack.h): the packed copy is what the
// decoder and the native prefill read (shared between copies of this handle); the given arrays
// are not kept. Raises std::invalid_argument on a layout it does not take.
struct QMatrix {
  std::shared_ptr<const PackedMatrix> packed;
  int bits, group;
  QMatrix(mlx::core::array w, mlx::core::array scales, mlx::core::array biases, std::optional<mlx::core::array> bias,
          int bits, int group_size);
};

// One layer's weights: the fused q/k/v and gate/up matrices, norms (float32).
struct LayerWeights {
  mlx::core::array input_norm, post_norm;
  QMatrix qkv, o, gate_up, down;
  std::optional<mlx::core::array> q_norm, k_norm;
};

struct DecoderDims {
  int hidden, heads, kv_heads, head_dim, intermediate;
  float eps;
  bool rope_traditional;
  float rope_scale;  // positions are multiplied by it (1 / the "linear" factor)
};

class Decoder;

// The decoder as the Python module holds it (an opaque handle).
struct DecoderHandle {
  std::shared_ptr<Decoder> ptr;
};

// Build the decoder over ``layers`` (the norms shared, not copied; the matrices' packed copies shared); ``inv_freq`` (head_dim / 2,)
// float32 RoPE inverse frequencies; ``threads`` the pool's size. Raises std::invalid_argument on
// shapes or dtypes it does not take.
DecoderHandle make_decoder(const DecoderDims& dims, const std::vector<LayerWeights>& layers,
                                      const mlx::core::array& norm, const QMatrix& head,
                                      const mlx::core::array& inv_freq, int threads);

// One decode token per row: h (B, hidden) float32 embeddings, start (B,) int32 positions, n_valid
// (B,) int32 (1 real, 0 padding), block_table (B, W) int32 (``block_size`` tokens per block), keys / values the paged
// cache's per-layer arrays (R, Hkv, D) float32, float16 or bfloat16, or with ``bits`` 4 / 8 MLX's affine
// layout (R, Hkv, D * bits / 32) uint32 of the Hadamard-rotated vectors, ``scales`` then the per-layer key
// scales, key biases, value scales and value biases (R, Hkv, D / group) float32 (kv_store.h) ->
// [logits (B, vocab) float32, keys..., values..., scales...] (the cache arrays share the inputs' buffers:
// the new K/V are written in place). Raises std::invalid_argument on another layout.
std::vector<mlx::core::array> decode_step(const DecoderHandle& decoder, const mlx::core::array& h,
                                          const mlx::core::array& start, const mlx::core::array& n_valid,
                                          const mlx::core::array& block_table,
                                          const std::vector<mlx::core::array>& keys,
                                          const std::vector<mlx::core::array>& values, int block_size,
                                          const std::vector<mlx::core::array>& scales, int bits, int group);

// Reference pieces for the tests: y = x @ dequantize(m).T (+ bias) with int8 activations, (M, K)
// float32, on the calling thread, one row at a time (the one-row micro kernel).
mlx::core::array int8_matmul(const QMatrix& m, const mlx::core::array& x);
std::string decoder_isa();

}  // namespace mlx_serving
