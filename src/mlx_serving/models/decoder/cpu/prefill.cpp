// The native prefill's product (issue 39): an MLX primitive computing a quantized projection of
// many rows with int8 activations (qgemm.cpp), for the shared decoder's prefill forward on the
// "native" path (models/decoder/cpu/prefill.py): norms, RoPE and attention stay MLX operations.
//
// The weights are the matrix's packed copy (pack.h), made once with the decoder (QMatrix): no call
// unpacks them. The GEMM runs on one pool kept alive across calls (pool.h), made for the first call's thread
// count (again when a call asks for another); calls take turns on it (a mutex), as MLX runs the
// primitives of one CPU stream one after another anyway. The quantized rows' buffer is kept too.

#include "prefill.h"

#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "pack.h"
#include "qgemm.h"

namespace mx = mlx::core;

namespace mlx_serving {

namespace {

void need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("int8_quantized_matmul: " + what);
}

std::mutex pool_lock;
std::unique_ptr<Pool> pool;  // guarded by pool_lock, as rows
QuantRows quant_rows;

void run(const PackedMatrix& m, const float* x, int64_t rows, float* y, int threads) {
  std::lock_guard<std::mutex> guard(pool_lock);
  if (!pool || pool->threads() != threads) pool = std::make_unique<Pool>(threads);
  quant_rows.quantize(x, rows, m.k, *pool);
  qgemm(m, quant_rows, y, best_isa(), *pool);
}

class Int8Matmul : public mx::Primitive {
 public:
  Int8Matmul(mx::Stream stream, std::shared_ptr<const PackedMatrix> m, int threads)
      : mx::Primitive(stream), m_(std::move(m)), threads_(threads) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    encoder.set_output_array(out);
    encoder.dispatch([m = m_, x = inputs[0].data<float>(), rows = static_cast<int64_t>(inputs[0].shape(0)),
                      y = out.data<float>(), threads = threads_]() { run(*m, x, rows, y, threads); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("Int8QuantizedMatmul has no GPU implementation");
  }

  const char* name() const override { return "Int8QuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Int8Matmul&>(other);
    return m_ == o.m_ && threads_ == o.threads_;
  }

 private:
  std::shared_ptr<const PackedMatrix> m_;
  int threads_;
};

}  // namespace

mx::array int8_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                const mx::array& biases, int group_size, int bits, int threads) {
  need(bits == 4 || bits == 8, "bits must be 4 or 8, got " + std::to_string(bits));
  need(group_size == 32 || group_size == 64 || group_size == 128,
       "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  need(threads >= 1, "threads must be at least 1");
  need(w.dtype() == mx::uint32 && w.ndim() == 2, "w must be (N, K * bits / 32) uint32");
  const int k = w.shape(1) * 32 / bits, n = w.shape(0);
  need(k % group_size == 0, "K must be a multiple of group_size");
  need(scales.dtype() == biases.dtype() && (scales.dtype() == mx::float32 || scales.dtype() == mx::float16),
       "scales and biases must be both float32 or both float16");
  need(scales.ndim() == 2 && scales.shape() == biases.shape() && scales.shape(0) == n &&
           scales.shape(1) * group_size == k,
       "scales and biases must be (N, K / group_size)");
  need(x.dtype() == mx::float32 && x.ndim() >= 1 && x.shape(-1) == k,
       "x must be (..., K) float32 with K = " + std::to_string(k));
  return int8_packed_matmul(QMatrix(w, scales, biases, std::nullopt, bits, group_size), x, threads);
}

mx::array int8_packed_matmul(const QMatrix& m, const mx::array& x, int threads) {
  need(threads >= 1, "threads must be at least 1");
  const int k = static_cast<int>(m.packed->k), n = static_cast<int>(m.packed->n);
  need(x.dtype() == mx::float32 && x.ndim() >= 1 && x.shape(-1) == k,
       "x must be (..., K) float32 with K = " + std::to_string(k));
  const auto dev = mx::Device(mx::Device::cpu);
  const int rows = static_cast<int>(x.size() / k);
  mx::Shape shape = x.shape();
  shape.back() = n;
  mx::array y({rows, n}, mx::float32, std::make_shared<Int8Matmul>(mx::default_stream(dev), m.packed, threads),
              {mx::contiguous(mx::reshape(x, {rows, k}, dev), false, dev)});
  return mx::reshape(y, shape, dev);
}

}  // namespace mlx_serving
