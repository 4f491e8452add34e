// The native prefill's products (issue 39): MLX primitives computing a quantized projection of
// many rows with int8 activations (qgemm.cpp), for the shared decoder's prefill forward on the
// "native" path (models/decoder/cpu/prefill.py): norms and RoPE stay MLX operations.
// The MLP's down product takes the gate/up product's output and computes its SwiGLU itself (the
// decode step's formula, row by row on the pool) before quantizing it: one primitive instead of
// MLX's split, sigmoid and two multiplies over strided views.
//
// The weights are the matrix's packed copy (pack.h), made once with the decoder (QMatrix): no call
// unpacks them. The GEMM runs on one pool kept alive across calls (pool.h), made for the first
// call's thread count (again when a call asks for another); calls take turns on it (a mutex), as
// MLX runs the primitives of one CPU stream one after another anyway. The quantized rows' buffer
// is kept too. The native prefill's attention (paged_attention.cpp with threads > 0) runs on the
// same pool (run_on_prefill_pool): no OpenMP team spinning beside it, which on a busy machine cost
// several times the attention's own CPU time.

#include "prefill.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

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
std::unique_ptr<Pool> pool;  // guarded by pool_lock, as the buffers below
QuantRows quant_rows;
std::vector<float> gated;  // the SwiGLU rows of a fused down product (rows x k)

constexpr int64_t kSwigluRows = 4;  // rows per pool task of the SwiGLU

// out (rows, k) = silu(gate) * up of gate_up (rows, 2k) = [gate | up], as the decode step computes
// it (g / (1 + exp(-g)) * u, in float32), rows split over the pool.
void swiglu_rows(const float* gate_up, int64_t rows, int64_t k, float* out, Pool& p) {
  p.run((rows + kSwigluRows - 1) / kSwigluRows, [&](int64_t task) {
    for (int64_t r = task * kSwigluRows; r < std::min(rows, (task + 1) * kSwigluRows); ++r) {
      const float* g = gate_up + r * 2 * k;
      float* o = out + r * k;
      for (int64_t i = 0; i < k; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * g[k + i];
    }
  });
}

Pool& pool_of(int threads) {  // the caller holds pool_lock
  if (!pool || pool->threads() != threads) pool = std::make_unique<Pool>(threads);
  return *pool;
}

// y = x @ m (x quantized per block first); with ``swiglu`` x is (rows, 2 m.k) gate/up rows whose
// SwiGLU is the product's input.
void run(const PackedMatrix& m, const float* x, int64_t rows, float* y, int threads, bool swiglu) {
  std::lock_guard<std::mutex> guard(pool_lock);
  Pool& p = pool_of(threads);
  if (swiglu) {
    gated.resize(static_cast<size_t>(rows * m.k));
    swiglu_rows(x, rows, m.k, gated.data(), p);
    x = gated.data();
  }
  quant_rows.quantize(x, rows, m.k, p);
  qgemm(m, quant_rows, y, best_isa(), p);
}

class Int8Matmul : public mx::Primitive {
 public:
  Int8Matmul(mx::Stream stream, std::shared_ptr<const PackedMatrix> m, int threads, bool swiglu)
      : mx::Primitive(stream), m_(std::move(m)), threads_(threads), swiglu_(swiglu) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(inputs[0]);
    encoder.set_output_array(out);
    encoder.dispatch([m = m_, x = inputs[0].data<float>(), rows = static_cast<int64_t>(inputs[0].shape(0)),
                      y = out.data<float>(), threads = threads_,
                      swiglu = swiglu_]() { run(*m, x, rows, y, threads, swiglu); });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("Int8QuantizedMatmul has no GPU implementation");
  }

  const char* name() const override { return swiglu_ ? "Int8SwigluMatmul" : "Int8QuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Int8Matmul&>(other);
    return m_ == o.m_ && threads_ == o.threads_ && swiglu_ == o.swiglu_;
  }

 private:
  std::shared_ptr<const PackedMatrix> m_;
  int threads_;
  bool swiglu_;
};

// The product's primitive over x (..., width) float32, width = K (2 K with ``swiglu``).
mx::array product(const char* what, const QMatrix& m, const mx::array& x, int threads, bool swiglu) {
  const auto need = [what](bool ok, const std::string& why) {
    if (!ok) throw std::invalid_argument(std::string(what) + ": " + why);
  };
  need(threads >= 1, "threads must be at least 1");
  const int k = static_cast<int>(m.packed->k), n = static_cast<int>(m.packed->n), width = swiglu ? 2 * k : k;
  need(x.dtype() == mx::float32 && x.ndim() >= 1 && x.shape(-1) == width,
       std::string(swiglu ? "gate_up must be (..., 2 K)" : "x must be (..., K)") + " float32 with K = " +
           std::to_string(k));
  const auto dev = mx::Device(mx::Device::cpu);
  const int rows = static_cast<int>(x.size() / width);
  mx::Shape shape = x.shape();
  shape.back() = n;
  mx::array y({rows, n}, mx::float32,
              std::make_shared<Int8Matmul>(mx::default_stream(dev), m.packed, threads, swiglu),
              {mx::contiguous(mx::reshape(x, {rows, width}, dev), false, dev)});
  return mx::reshape(y, shape, dev);
}

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
  return product("int8_packed_matmul", m, x, threads, false);
}

mx::array int8_swiglu_matmul(const QMatrix& m, const mx::array& gate_up, int threads) {
  return product("int8_swiglu_matmul", m, gate_up, threads, true);
}

void run_on_prefill_pool(int threads, int64_t count, const std::function<void(int64_t)>& fn) {
  std::lock_guard<std::mutex> guard(pool_lock);
  pool_of(threads).run(count, fn);
}

}  // namespace mlx_serving
