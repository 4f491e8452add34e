// The embedding lookup of a tied model read from its head's packed copy (issue 42): the head's
// packed matrix (pack.h) holds every value, scale and offset of the table, so the lookup gathers
// the rows it needs from there and MLX's copy of the table (33 MiB on SmolLM2-135M) is not kept.
// One MLX primitive over the ids; the rows are dequantized through PackedMatrix's accessors
// (value / scale / offset), in float32, as MLX's dequantize computes them: bit for bit MLX's lookup.

#include "embed_rows.h"

#include <algorithm>
#include <memory>
#include <stdexcept>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "pack.h"

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

namespace mx = mlx::core;

namespace mlx_serving {

namespace {

// Row r of m (column r of the packed matrix) into out (K floats): scale * q + offset per value, the
// product and the sum each rounded to float32 (no fused multiply-add: MLX's dequantize does not fuse).
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
void dequantize_row(const PackedMatrix& m, int64_t r, float* out) {
  for (int64_t i = 0; i < m.at.blocks; ++i) {
    const int64_t slot = m.param(r / kTileCols, i / 8, r % kTileCols) + i % 8;
    const float scale = m.scale(slot), offset = m.offset(slot);
    for (int j = 0; j < 32; ++j) {
      const float product = scale * static_cast<float>(m.value(r, i, j));
      out[32 * i + j] = product + offset;
    }
  }
}

class PackedRows : public mx::Primitive {
 public:
  PackedRows(mx::Stream stream, std::shared_ptr<const PackedMatrix> m) : mx::Primitive(stream), m_(std::move(m)) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    encoder.set_output_array(out);
    encoder.dispatch([m = m_, ids = inputs[0].data<int32_t>(), count = static_cast<int64_t>(inputs[0].size()),
                      y = out.data<float>()]() {
      for (int64_t t = 0; t < count; ++t) {
        const int64_t id = ids[t] < 0 ? ids[t] + m->n : ids[t];
        float* row = y + t * m->k;
        if (id >= 0 && id < m->n) {
          dequantize_row(*m, id, row);
        } else {
          std::fill(row, row + m->k, 0.f);
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("PackedRows has no GPU implementation");
  }

  const char* name() const override { return "PackedRows"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return m_ == static_cast<const PackedRows&>(other).m_;
  }

 private:
  std::shared_ptr<const PackedMatrix> m_;
};

}  // namespace

mx::array packed_rows(const QMatrix& m, const mx::array& ids) {
  if (!mx::issubdtype(ids.dtype(), mx::integer)) throw std::invalid_argument("packed_rows: ids must be integers");
  const auto dev = mx::Device(mx::Device::cpu);
  const int count = static_cast<int>(ids.size()), k = static_cast<int>(m.packed->k);
  mx::Shape shape = ids.shape();
  shape.push_back(k);
  mx::array flat = mx::contiguous(mx::astype(mx::reshape(ids, {count}, dev), mx::int32, dev), false, dev);
  mx::array rows({count, k}, mx::float32, std::make_shared<PackedRows>(mx::default_stream(dev), m.packed), {flat});
  return mx::reshape(rows, shape, dev);
}

}  // namespace mlx_serving
