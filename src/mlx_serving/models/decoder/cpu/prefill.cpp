// The native prefill's products (issue 39): MLX primitives computing a quantized projection of
// many rows with int8 activations (qgemm.cpp), for the shared decoder's prefill forward on the
// "native" path (models/decoder/cpu/prefill.py): norms and RoPE stay MLX operations.
// The MLP's down product takes the gate/up product's output and computes its SwiGLU itself (the
// decode step's formula, row by row on the pool) before quantizing it: one primitive instead of
// MLX's split, sigmoid and two multiplies over strided views.
//
// The GEMM runs on one pool kept alive across calls (pool.h), made for the first call's thread
// count (again when a call asks for another); calls take turns on it (a mutex), as MLX runs the
// primitives of one CPU stream one after another anyway. The quantized rows' buffer is kept too.
// The native prefill's attention (paged_attention.cpp with threads > 0) runs on the same pool
// (run_on_prefill_pool): no OpenMP team spinning beside it, which on a busy machine cost several
// times the attention's own CPU time.

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
#include "qgemm.h"

namespace mx = mlx::core;

namespace mlx_serving {

namespace {

std::mutex pool_lock;
std::unique_ptr<Pool> pool;  // guarded by pool_lock, as rows
QuantRows quant_rows;
std::vector<float> gated;  // the SwiGLU rows of a fused down product (rows x k), guarded by pool_lock

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

// y = x @ m (x quantized per block first); with ``swiglu`` x is (rows, 2 m.k) gate/up rows whose
// SwiGLU is the product's input.
// Fewer rows than the GEMM's row tile (the head's one row per prompt): the decode step's product
// (qgemv, the same bits as the GEMM's) over column ranges on the pool, no weight tile unpacked for
// rows that are not there (~6x less work for one row of SmolLM2's head).
constexpr int64_t kGemmMinRows = 4;
constexpr int64_t kGemvColumns = 512;  // columns per pool task
std::vector<QuantRow> gemv_rows;       // guarded by pool_lock

void gemv(const QMatrixView& m, const float* x, int64_t rows, float* y, Pool& p) {
  gemv_rows.resize(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) gemv_rows[r].quantize(x + r * m.k, m.k);
  const Isa isa = best_isa();
  p.run((m.n + kGemvColumns - 1) / kGemvColumns, [&](int64_t task) {
    qgemv(m, gemv_rows.data(), rows, task * kGemvColumns, std::min(m.n, (task + 1) * kGemvColumns), y, m.n, isa);
  });
}

Pool& pool_of(int threads) {  // the caller holds pool_lock
  if (!pool || pool->threads() != threads) pool = std::make_unique<Pool>(threads);
  return *pool;
}

void run(const QMatrixView& m, const float* x, int64_t rows, float* y, int threads, bool swiglu) {
  std::lock_guard<std::mutex> guard(pool_lock);
  pool_of(threads);
  if (swiglu) {
    gated.resize(static_cast<size_t>(rows * m.k));
    swiglu_rows(x, rows, m.k, gated.data(), *pool);
    x = gated.data();
  }
  if (rows < kGemmMinRows) {
    gemv(m, x, rows, y, *pool);
    return;
  }
  quant_rows.quantize(x, rows, m.k, *pool);
  qgemm(m, quant_rows, y, best_isa(), *pool);
}

class Int8Matmul : public mx::Primitive {
 public:
  Int8Matmul(mx::Stream stream, int bits, int group, int threads, bool swiglu)
      : mx::Primitive(stream), bits_(bits), group_(group), threads_(threads), swiglu_(swiglu) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    const auto& w = inputs[1];
    const QMatrixView m{reinterpret_cast<const uint8_t*>(w.data<uint32_t>()),
                        inputs[2].data<void>(),
                        inputs[3].data<void>(),
                        nullptr,
                        inputs[2].dtype() == mx::float16,
                        bits_,
                        group_,
                        static_cast<int64_t>(w.shape(0)),
                        static_cast<int64_t>(w.shape(1)) * 32 / bits_};
    encoder.dispatch([m, x = inputs[0].data<float>(), rows = static_cast<int64_t>(inputs[0].shape(0)),
                      y = out.data<float>(), threads = threads_, swiglu = swiglu_]() {
      run(m, x, rows, y, threads, swiglu);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("Int8QuantizedMatmul has no GPU implementation");
  }

  const char* name() const override { return swiglu_ ? "Int8SwigluMatmul" : "Int8QuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Int8Matmul&>(other);
    return bits_ == o.bits_ && group_ == o.group_ && threads_ == o.threads_ && swiglu_ == o.swiglu_;
  }

 private:
  int bits_, group_, threads_;
  bool swiglu_;
};

// The product's primitive over x (..., width) float32, width = K (2 K with ``swiglu``), after
// checking the arguments (``what``: the function named in the errors).
mx::array product(const char* what, const mx::array& x, const mx::array& w, const mx::array& scales,
                  const mx::array& biases, int group_size, int bits, int threads, bool swiglu) {
  const auto need = [what](bool ok, const std::string& why) {
    if (!ok) throw std::invalid_argument(std::string(what) + ": " + why);
  };
  need(bits == 4 || bits == 8, "bits must be 4 or 8, got " + std::to_string(bits));
  need(group_size == 32 || group_size == 64 || group_size == 128,
       "group_size must be 32, 64 or 128, got " + std::to_string(group_size));
  need(threads >= 1, "threads must be at least 1");
  need(w.dtype() == mx::uint32 && w.ndim() == 2, "w must be (N, K * bits / 32) uint32");
  const int k = w.shape(1) * 32 / bits, n = w.shape(0), width = swiglu ? 2 * k : k;
  need(k % group_size == 0, "K must be a multiple of group_size");
  need(scales.dtype() == biases.dtype() && (scales.dtype() == mx::float32 || scales.dtype() == mx::float16),
       "scales and biases must be both float32 or both float16");
  need(scales.ndim() == 2 && scales.shape() == biases.shape() && scales.shape(0) == n &&
           scales.shape(1) * group_size == k,
       "scales and biases must be (N, K / group_size)");
  need(x.dtype() == mx::float32 && x.ndim() >= 1 && x.shape(-1) == width,
       std::string(swiglu ? "gate_up must be (..., 2 K)" : "x must be (..., K)") + " float32 with K = " +
           std::to_string(k));
  const auto dev = mx::Device(mx::Device::cpu);
  const int rows = static_cast<int>(x.size() / width);
  mx::Shape shape = x.shape();
  shape.back() = n;
  std::vector<mx::array> inputs = {mx::contiguous(mx::reshape(x, {rows, width}, dev), false, dev),
                                   mx::contiguous(w, false, dev), mx::contiguous(scales, false, dev),
                                   mx::contiguous(biases, false, dev)};
  mx::array y({rows, n}, mx::float32,
              std::make_shared<Int8Matmul>(mx::default_stream(dev), bits, group_size, threads, swiglu),
              std::move(inputs));
  return mx::reshape(y, shape, dev);
}

}  // namespace

void run_on_prefill_pool(int threads, int64_t count, const std::function<void(int64_t)>& fn) {
  std::lock_guard<std::mutex> guard(pool_lock);
  pool_of(threads).run(count, fn);
}

mx::array int8_quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                                const mx::array& biases, int group_size, int bits, int threads) {
  return product("int8_quantized_matmul", x, w, scales, biases, group_size, bits, threads, false);
}

mx::array int8_swiglu_matmul(const mx::array& gate_up, const mx::array& w, const mx::array& scales,
                             const mx::array& biases, int group_size, int bits, int threads) {
  return product("int8_swiglu_matmul", gate_up, w, scales, biases, group_size, bits, threads, true);
}

}  // namespace mlx_serving
