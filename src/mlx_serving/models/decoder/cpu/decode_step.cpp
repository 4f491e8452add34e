// The CPU decode step (issue 39): the shared decoder's one-token forward (models/decoder/layers.py)
// as one MLX primitive, for rows that each decode one token.
//
// A step of SmolLM2-135M through MLX's operations was ~600 small operations (~20 us each: norms,
// RoPE, reshapes, K/V scatters) around the products and attention; here it is one primitive whose
// work runs on a thread pool kept alive across regions and steps (pool.h), per layer: RMSNorm ->
// int8 q/k/v product (+ bias) -> q/k RMSNorm (Qwen3) -> RoPE -> K/V written into the paged cache in
// place (kv_store.cpp: float32, float16 / bfloat16, or rotated int8 / int4, as the cache stores them) -> GQA attention over the row's prefix -> int8 o product + residual -> RMSNorm -> int8
// gate/up product -> SwiGLU (in the product's own tasks, rounded there for the next) -> int8 down
// product + residual; then the final norm and the head. The per-row element-wise work (norms,
// q/k norm + RoPE + K/V write, residuals) runs in pool regions over rows too, not on the caller
// alone (at 32 rows it was ~5 ms serial per step).
//
// Numerics: the products quantize their activations to int8 per block of 32 (qgemm.cpp); norms,
// RoPE, softmax and the residual stream are float32. Each row's computation is the same whatever
// its batchmates (the products and attention loop per row in a fixed order; work is split over
// output columns and heads, never inside one dot product): a row batched equals the row alone,
// bit for bit.
//
// The cache write is in place: the K/V arrays are inputs whose buffers the primitive's outputs
// share (copy_shared_buffer); the caller stores those outputs back as the cache, so every later
// reader depends on this step. A row writes only its own position (its own block).

#include "decode_step.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <utility>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/transforms.h"
#include "attend.h"
#include "kv_store.h"
#include "pack.h"
#include "pool.h"
#include "qgemm.h"
#include "qdot.h"

namespace mx = mlx::core;

namespace mlx_serving {

namespace {

mx::array ready(const mx::array& a) {
  mx::array c = mx::contiguous(a, false, mx::Device(mx::Device::cpu));
  c.eval();
  return c;
}

void need(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("cpu decoder: " + what);
}

void rms_norm(const float* x, const float* w, int64_t n, float eps, float* y) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
}

}  // namespace

QMatrix::QMatrix(mx::array w_, mx::array scales_, mx::array biases_, std::optional<mx::array> bias_, int bits_,
                 int group_size)
    : bits(bits_), group(group_size) {
  need(bits == 4 || bits == 8, "bits must be 4 or 8");
  need(group == 32 || group == 64 || group == 128, "group_size must be 32, 64 or 128");
  const mx::array w = ready(w_), scales = ready(scales_), biases = ready(biases_);
  need(w.dtype() == mx::uint32 && w.ndim() == 2, "w must be (N, K * bits / 32) uint32");
  const int64_t n = w.shape(0), k = static_cast<int64_t>(w.shape(1)) * 32 / bits;
  need(scales.dtype() == biases.dtype() && (scales.dtype() == mx::float32 || scales.dtype() == mx::float16),
       "scales and biases must be both float32 or both float16");
  need(scales.ndim() == 2 && scales.shape() == biases.shape() && scales.shape(0) == w.shape(0) &&
           scales.shape(1) * group == k && k % 32 == 0,
       "scales and biases must be (N, K / group_size)");
  std::optional<mx::array> bias;
  if (bias_) {
    bias = ready(mx::astype(*bias_, mx::float32));
    need(bias->ndim() == 1 && bias->shape(0) == w.shape(0), "bias must be (N,)");
  }
  packed = std::make_shared<const PackedMatrix>(pack({reinterpret_cast<const uint8_t*>(w.data<uint32_t>()),
                                                      scales.data<void>(), biases.data<void>(),
                                                      bias ? bias->data<float>() : nullptr,
                                                      scales.dtype() == mx::float16, bits, group, n, k}));
}

class Decoder {
 public:
  Decoder(const DecoderDims& d, std::vector<LayerWeights> layers, mx::array norm, QMatrix head,
          std::vector<float> inv_freq, int threads)
      : d_(d), layers_(std::move(layers)), norm_(std::move(norm)), head_(std::move(head)),
        inv_freq_(std::move(inv_freq)), pool_(threads) {}

  int64_t vocab() const { return head_.packed->n; }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  const DecoderDims& dims() const { return d_; }

  void step(const float* h_in, const int32_t* start, const int32_t* n_valid, const int32_t* table, int64_t b,
            int64_t w, const KvCache& kv, int64_t cache_rows, int64_t block_size, float* logits);

 private:
  void product(const QMatrix& m, const float* x, int64_t rows, int64_t k, float* y);
  void mlp_product(const LayerWeights& lw, const float* x, int64_t rows, float* y);
  void attend_rows(int64_t l, const KvCache& kv);
  int64_t cache_row(const int32_t* table, int64_t w, int64_t r, int64_t pos, int64_t cache_rows,
                    int64_t block_size) const {
    const int64_t blk = pos / block_size;
    const int64_t row = blk < w ? static_cast<int64_t>(table[rows_[r] * w + blk]) * block_size + pos % block_size : 0;
    return row < 0 || row >= cache_rows ? 0 : row;  // a table that does not cover it: the null block
  }

  DecoderDims d_;
  std::vector<LayerWeights> layers_;
  mx::array norm_;
  QMatrix head_;
  std::vector<float> inv_freq_;
  Pool pool_;
  std::mutex lock_;
  Isa isa_ = Isa::portable;
  // per-step buffers (compacted real rows)
  std::vector<int64_t> rows_, pos_, off_, idx_;  // idx_[off_[r] + p]: cache row of row r's position p
  std::vector<int64_t> grp_;  // row groups [grp_[i], grp_[i + 1]): one block table, consecutive positions
  std::vector<float> h_, x_, qkv_, att_, tmp_, out_;
  QuantRows qrows_, act_rows_;  // a product's activations, in the packed weights' layout; the SwiGLU's
};

// y (rows, n) = x (rows, k) float32 @ dequantize(m).T (+ bias), the activations rounded to int8 per
// block of 32 (QuantRows' rounding), the packed weights read as they lie whatever the rows (1-3
// rows run micro tiles of as many rows): each (row, column) bit for bit the same, so a row's result
// does not depend on how many rows share its step.
void Decoder::product(const QMatrix& m, const float* x, int64_t rows, int64_t k, float* y) {
  qrows_.quantize(x, rows, k, pool_);
  qgemm(*m.packed, qrows_, y, isa_, pool_);
}

// y (rows, hidden) = the MLP of x (rows, hidden): the gate/up product, its SwiGLU and that rounded
// for the down product in one region (qgemm_swiglu: no gate/up output written out and read back
// by another region, often on the other core), then the down product; each value bit for bit as
// product(gate_up), the SwiGLU row by row, then product(down) would give.
void Decoder::mlp_product(const LayerWeights& lw, const float* x, int64_t rows, float* y) {
  qrows_.quantize(x, rows, d_.hidden, pool_);
  qgemm_swiglu(*lw.gate_up.packed, qrows_, act_rows_, isa_, pool_);
  qgemm(*lw.down.packed, act_rows_, y, isa_, pool_);
}

// Each row's heads attend over the row's prefix in layer ``l``'s cache, read as stored (attend.h:
// float16 / bfloat16 widened, int8 / int4 dequantized in the kernel's vectors, the query rotated into
// the cache's Hadamard basis and the output back: kv_cache.PagedKVCache.rotate). The rows of a group
// (``grp_``: one stream's rows at consecutive positions, a verify's k + 1) share their prefix: a
// group's query heads of one KV head run as one call, each key and value read once for all of them.
void Decoder::attend_rows(int64_t l, const KvCache& kv) {
  const int64_t a = static_cast<int64_t>(rows_.size()), h = d_.heads, dd = d_.head_dim, hkv = d_.kv_heads;
  const int64_t width = (h + 2 * hkv) * dd, group = h / hkv, groups = static_cast<int64_t>(grp_.size()) - 1;
  // One task per (group of rows, KV head) while that still spreads the work (the largest group's task
  // at most half a thread's share), else per (row, KV head) when there are at least as many as threads,
  // else per (row, query head), so that every thread has work; the query heads of a task run together
  // (~1.8x less work per head than alone). A head's result is the same either way (attend.h).
  int64_t largest = 0;
  for (int64_t i = 0; i < groups; ++i) largest = std::max(largest, grp_[i + 1] - grp_[i]);
  const bool grouped = 2 * largest * pool_.threads() <= a * hkv;
  const int64_t per = grouped || a * hkv >= pool_.threads() ? group : 1;
  const int64_t tasks = grouped ? groups * hkv : a * h / per;
  pool_.run(tasks, [&](int64_t t) {
    thread_local std::vector<Query> heads;
    heads.clear();
    const int64_t lo = grouped ? grp_[t / hkv] : t * per / h, hi = grouped ? grp_[t / hkv + 1] : lo + 1;
    const int64_t first = grouped ? t % hkv * group : t * per % h;
    for (int64_t r = lo; r < hi; ++r)
      for (int64_t j = first; j < first + per; ++j)
        heads.push_back({qkv_.data() + r * width + j * dd, att_.data() + (r * h + j) * dd, pos_[r] + 1});
    attend_heads(kv, kv.keys[l], kv.values[l], first / group, idx_.data() + off_[hi - 1], heads.data(),
                 static_cast<int64_t>(heads.size()), isa_);
  });
}

void Decoder::step(const float* h_in, const int32_t* start, const int32_t* n_valid, const int32_t* table, int64_t b,
                   int64_t w, const KvCache& kv, int64_t cache_rows, int64_t block_size, float* logits) {
  std::lock_guard<std::mutex> guard(lock_);
  isa_ = best_isa();
  const int64_t hid = d_.hidden, hh = d_.heads, hkv = d_.kv_heads, dd = d_.head_dim;
  const int64_t width = (hh + 2 * hkv) * dd, half = dd / 2, v = vocab();
  rows_.clear();
  pos_.clear();
  for (int64_t r = 0; r < b; ++r)
    if (n_valid[r] > 0) {
      rows_.push_back(r);
      pos_.push_back(start[r]);
    }
  std::memset(logits, 0, sizeof(float) * b * v);  // padding rows: zeros
  const int64_t a = static_cast<int64_t>(rows_.size());
  if (a == 0) return;
  off_.assign(a + 1, 0);
  for (int64_t r = 0; r < a; ++r) off_[r + 1] = off_[r] + pos_[r] + 1;
  idx_.resize(off_[a]);
  for (int64_t r = 0; r < a; ++r)
    for (int64_t p = 0; p <= pos_[r]; ++p) idx_[off_[r] + p] = cache_row(table, w, r, p, cache_rows, block_size);
  grp_.assign(1, 0);
  for (int64_t r = 1; r < a; ++r)
    if (pos_[r] != pos_[r - 1] + 1 ||
        std::memcmp(table + rows_[r] * w, table + rows_[r - 1] * w, sizeof(int32_t) * w) != 0)
      grp_.push_back(r);
  grp_.push_back(a);
  h_.resize(a * hid);
  x_.resize(a * hid);
  qkv_.resize(a * width);
  att_.resize(a * hh * dd);
  tmp_.resize(a * hid);
  out_.resize(a * v);
  for (int64_t r = 0; r < a; ++r) std::memcpy(h_.data() + r * hid, h_in + rows_[r] * hid, sizeof(float) * hid);
  // RoPE angles of each row's position (shared by every layer and head)
  std::vector<float> cs(a * half), sn(a * half);
  for (int64_t r = 0; r < a; ++r)
    for (int64_t i = 0; i < half; ++i) {
      const float theta = static_cast<float>(pos_[r]) * d_.rope_scale * inv_freq_[i];
      cs[r * half + i] = std::cos(theta);
      sn[r * half + i] = std::sin(theta);
    }
  auto rope = [&](float* x, int64_t r) {
    for (int64_t i = 0; i < half; ++i) {
      const float c = cs[r * half + i], s = sn[r * half + i];
      const int64_t i0 = d_.rope_traditional ? 2 * i : i, i1 = d_.rope_traditional ? 2 * i + 1 : i + half;
      const float x0 = x[i0], x1 = x[i1];
      x[i0] = x0 * c - x1 * s;
      x[i1] = x0 * s + x1 * c;
    }
  };
  const int64_t nl = num_layers();
  pool_.run(a, [&](int64_t r) {
    rms_norm(h_.data() + r * hid, layers_[0].input_norm.data<float>(), hid, d_.eps, x_.data() + r * hid);
  });
  for (int64_t l = 0; l < nl; ++l) {
    const LayerWeights& lw = layers_[l];
    product(lw.qkv, x_.data(), a, hid, qkv_.data());
    pool_.run(a, [&](int64_t r) {
      float* q = qkv_.data() + r * width;
      float* k = q + hh * dd;
      float* vv = k + hkv * dd;
      std::vector<float> tmp(dd);
      for (int64_t i = 0; i < hh + hkv; ++i) {
        float* x = q + i * dd;  // q heads, then k heads
        if (lw.q_norm) {
          rms_norm(x, (i < hh ? *lw.q_norm : *lw.k_norm).data<float>(), dd, d_.eps, tmp.data());
          std::memcpy(x, tmp.data(), sizeof(float) * dd);
        }
        rope(x, r);
      }
      const int64_t row = idx_[off_[r] + pos_[r]];
      kv.store(kv.keys[l], row, k);  // k and v are not read again here: a quantized store rotates them in place
      kv.store(kv.values[l], row, vv);
    });
    attend_rows(l, kv);
    product(lw.o, att_.data(), a, hh * dd, tmp_.data());
    pool_.run(a, [&](int64_t r) {
      float* hr = h_.data() + r * hid;
      const float* tr = tmp_.data() + r * hid;
      for (int64_t i = 0; i < hid; ++i) hr[i] += tr[i];
      rms_norm(hr, lw.post_norm.data<float>(), hid, d_.eps, x_.data() + r * hid);
    });
    mlp_product(lw, x_.data(), a, tmp_.data());
    const float* next = l + 1 < nl ? layers_[l + 1].input_norm.data<float>() : norm_.data<float>();
    pool_.run(a, [&](int64_t r) {
      float* hr = h_.data() + r * hid;
      const float* tr = tmp_.data() + r * hid;
      for (int64_t i = 0; i < hid; ++i) hr[i] += tr[i];
      rms_norm(hr, next, hid, d_.eps, x_.data() + r * hid);
    });
  }
  product(head_, x_.data(), a, hid, out_.data());
  for (int64_t r = 0; r < a; ++r) std::memcpy(logits + rows_[r] * v, out_.data() + r * v, sizeof(float) * v);
}

namespace {

class DecodeStep : public mx::Primitive {
 public:
  // ``kind`` / ``group``: the cache's layout (kv_store.h); inputs 4.. are the keys, the values and, for a
  // quantized cache, the key scales, key biases, value scales and value biases, one array per layer each.
  DecodeStep(mx::Stream stream, std::shared_ptr<Decoder> decoder, int block_size, KvKind kind, int group)
      : mx::Primitive(stream), dec_(std::move(decoder)), block_size_(block_size), kind_(kind), group_(group) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const int64_t nl = dec_->num_layers();
    auto& logits = outputs[0];
    logits.set_data(mx::allocator::malloc(logits.nbytes()));
    std::vector<std::pair<mx::array, void*>> copies;
    std::vector<void*> cache(inputs.size(), nullptr);  // each cache input's buffer as the step writes it
    for (size_t i = 4; i < inputs.size(); ++i) cache[i] = in_place(inputs[i], outputs[i - 3], copies);
    KvCache kv{kind_, dec_->dims().kv_heads, dec_->dims().head_dim, group_, {}, {}};
    auto ptr = [&](int64_t part, int64_t l) { return cache[4 + part * nl + l]; };
    const bool quant = kv.quantized();
    for (int64_t l = 0; l < nl; ++l) {
      auto scales = [&](int64_t part) { return quant ? static_cast<float*>(ptr(part, l)) : nullptr; };
      kv.keys.push_back({ptr(0, l), scales(2), scales(3)});
      kv.values.push_back({ptr(1, l), scales(4), scales(5)});
    }
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& x : inputs) encoder.set_input_array(x);
    for (auto& x : outputs) encoder.set_output_array(x);
    const auto& table = inputs[3];
    encoder.dispatch([dec = dec_, hp = inputs[0].data<float>(), sp = inputs[1].data<int32_t>(),
                      np = inputs[2].data<int32_t>(), tp = table.data<int32_t>(), b = inputs[0].shape(0),
                      w = table.shape(1), kv = std::move(kv), rows = inputs[4].shape(0), bs = block_size_,
                      lp = logits.data<float>(), copies = std::move(copies)]() {
      for (const auto& [src, dst] : copies) copy_strided(src, dst);
      dec->step(hp, sp, np, tp, b, w, kv, rows, bs, lp);
    });
  }

  // The cache array ``out`` over the buffer of ``in`` when that is row-contiguous (the cache's own,
  // as always), else over a new buffer that ``copies`` fills before the step runs; the step writes
  // the new K/V through the returned pointer.
  static void* in_place(const mx::array& in, mx::array& out, std::vector<std::pair<mx::array, void*>>& copies) {
    if (in.flags().row_contiguous) {
      out.copy_shared_buffer(in);
    } else {
      out.set_data(mx::allocator::malloc(out.nbytes()));
      copies.emplace_back(in, out.data<void>());
    }
    return out.data<void>();
  }

  // ``src`` of any strides, element by element in row-major order, into the contiguous ``dst``.
  static void copy_strided(const mx::array& src, void* dst) {
    const size_t item = src.itemsize();
    const auto* from = static_cast<const char*>(src.data<void>());
    auto* to = static_cast<char*>(dst);
    std::vector<int64_t> at(src.ndim(), 0);
    for (size_t n = 0; n < src.size(); ++n, to += item) {
      int64_t off = 0;
      for (size_t d = 0; d < at.size(); ++d) off += at[d] * src.strides()[d];
      std::memcpy(to, from + off * static_cast<int64_t>(item), item);
      for (size_t d = at.size(); d-- > 0 && ++at[d] == src.shape(d);) at[d] = 0;
    }
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("CpuDecodeStep has no GPU implementation");
  }

  const char* name() const override { return "CpuDecodeStep"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    std::vector<mx::Shape> shapes = {{inputs[0].shape(0), static_cast<int>(dec_->vocab())}};
    for (size_t i = 4; i < inputs.size(); ++i) shapes.push_back(inputs[i].shape());
    return shapes;
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeStep&>(other);
    return dec_ == o.dec_ && block_size_ == o.block_size_ && kind_ == o.kind_ && group_ == o.group_;
  }


 private:
  std::shared_ptr<Decoder> dec_;
  int block_size_;
  KvKind kind_;
  int group_;
};

}  // namespace

DecoderHandle make_decoder(const DecoderDims& dims, const std::vector<LayerWeights>& layers,
                                      const mx::array& norm, const QMatrix& head, const mx::array& inv_freq,
                                      int threads) {
  need(!layers.empty(), "no layers");
  need(dims.heads % dims.kv_heads == 0 && dims.head_dim % 2 == 0, "heads must be a multiple of kv_heads");
  need(dims.hidden % 32 == 0 && (dims.heads * dims.head_dim) % 32 == 0 && dims.intermediate % 32 == 0,
       "hidden, heads * head_dim and intermediate must be multiples of 32");
  std::vector<LayerWeights> own;
  auto vec = [](const mx::array& a, int64_t n, const char* what) {
    mx::array c = ready(mx::astype(a, mx::float32));
    need(c.ndim() == 1 && c.shape(0) == n, std::string(what) + " has the wrong shape");
    return c;
  };
  const int64_t qkv_out = (dims.heads + 2 * dims.kv_heads) * dims.head_dim;
  auto check = [](const QMatrix& m, int64_t n, int64_t k, const char* what) {
    need(m.packed->n == n && m.packed->k == k, std::string(what) + " has the wrong shape");
  };
  for (const auto& l : layers) {
    check(l.qkv, qkv_out, dims.hidden, "qkv");
    check(l.o, dims.hidden, dims.heads * dims.head_dim, "o_proj");
    check(l.gate_up, 2 * dims.intermediate, dims.hidden, "gate_up");
    check(l.down, dims.hidden, dims.intermediate, "down_proj");
    need(l.q_norm.has_value() == l.k_norm.has_value(), "q_norm and k_norm come together");
    LayerWeights c = l;
    c.input_norm = vec(l.input_norm, dims.hidden, "input_layernorm");
    c.post_norm = vec(l.post_norm, dims.hidden, "post_attention_layernorm");
    if (l.q_norm) {
      c.q_norm = vec(*l.q_norm, dims.head_dim, "q_norm");
      c.k_norm = vec(*l.k_norm, dims.head_dim, "k_norm");
    }
    own.push_back(std::move(c));
  }
  check(head, head.packed->n, dims.hidden, "the head");
  mx::array f = vec(inv_freq, dims.head_dim / 2, "inv_freq");
  std::vector<float> freqs(f.data<float>(), f.data<float>() + f.size());
  return {std::make_shared<Decoder>(dims, std::move(own), vec(norm, dims.hidden, "norm"), head, std::move(freqs),
                                    threads)};
}

namespace {

// The cache layout of ``keys`` (their dtype; uint32: ``bits``) after checking every array's shape.
KvKind kv_kind(const DecoderDims& d, const std::vector<mx::array>& keys, const std::vector<mx::array>& scales,
               int bits, int group) {
  if (bits == 0) {
    const mx::Dtype t = keys[0].dtype();
    need((t == mx::float32 || t == mx::float16 || t == mx::bfloat16) && scales.empty(),
         "a float cache's keys and values must be float32, float16 or bfloat16 (no scales)");
    return t == mx::float32 ? KvKind::kF32 : t == mx::float16 ? KvKind::kF16 : KvKind::kBF16;
  }
  need(bits == 4 || bits == 8, "bits must be 0 (a float cache), 4 or 8");
  need((group == 32 || group == 64 || group == 128) && d.head_dim % group == 0 &&
           (d.head_dim & (d.head_dim - 1)) == 0,
       "a quantized cache needs a power-of-2 head_dim and a group of 32, 64 or 128 dividing it");
  need(keys[0].dtype() == mx::uint32, "a quantized cache's keys and values must be uint32");
  need(scales.size() == 4 * keys.size(), "a quantized cache needs key/value scales and biases per layer");
  for (const auto& s : scales)
    need(s.dtype() == mx::float32 && s.ndim() == 3 && s.shape(0) == keys[0].shape(0) && s.shape(1) == d.kv_heads &&
             s.shape(2) == d.head_dim / group,
         "scales and biases must be (R, kv_heads, head_dim / group) float32");
  return bits == 8 ? KvKind::kQ8 : KvKind::kQ4;
}

}  // namespace

std::vector<mx::array> decode_step(const DecoderHandle& handle, const mx::array& h,
                                   const mx::array& start, const mx::array& n_valid, const mx::array& block_table,
                                   const std::vector<mx::array>& keys, const std::vector<mx::array>& values,
                                   int block_size, const std::vector<mx::array>& scales, int bits, int group) {
  need(handle.ptr != nullptr && block_size > 0, "a built decoder and block_size > 0 expected");
  const auto& decoder = handle.ptr;
  const auto& d = decoder->dims();
  const int64_t nl = decoder->num_layers();
  need(h.dtype() == mx::float32 && h.ndim() == 2 && h.shape(1) == d.hidden, "h must be (B, hidden) float32");
  need(start.dtype() == mx::int32 && n_valid.dtype() == mx::int32 && block_table.dtype() == mx::int32,
       "start, n_valid and block_table must be int32");
  need(start.ndim() == 1 && start.shape(0) == h.shape(0) && n_valid.shape() == start.shape() &&
           block_table.ndim() == 2 && block_table.shape(0) == h.shape(0),
       "start (B,), n_valid (B,) and block_table (B, W) expected");
  need(static_cast<int64_t>(keys.size()) == nl && static_cast<int64_t>(values.size()) == nl,
       "one key and one value array per layer expected");
  const KvKind kind = kv_kind(d, keys, scales, bits, group);
  const int width = bits ? d.head_dim * bits / 32 : d.head_dim;
  const auto dev = mx::Device(mx::Device::cpu);
  std::vector<mx::array> inputs = {mx::contiguous(h, false, dev), mx::contiguous(start, false, dev),
                                   mx::contiguous(n_valid, false, dev), mx::contiguous(block_table, false, dev)};
  std::vector<mx::Shape> shapes = {{h.shape(0), static_cast<int>(decoder->vocab())}};
  std::vector<mx::Dtype> dtypes = {mx::float32};
  for (const auto* side : {&keys, &values, &scales})
    for (const auto& a : *side) {
      need(side == &scales || (a.dtype() == keys[0].dtype() && a.ndim() == 3 && a.shape(1) == d.kv_heads &&
                               a.shape(2) == width && a.shape() == keys[0].shape()),
           "keys and values must be (R, kv_heads, head_dim) (head_dim * bits / 32 quantized), all one dtype");
      inputs.push_back(a);  // no contiguous node per array and step: the primitive copies one that is not
      shapes.push_back(a.shape());
      dtypes.push_back(a.dtype());
    }
  return mx::array::make_arrays(
      std::move(shapes), dtypes,
      std::make_shared<DecodeStep>(mx::default_stream(dev), decoder, block_size, kind, bits ? group : 0),
      std::move(inputs));
}

mx::array int8_matmul(const QMatrix& m, const mx::array& x) {
  mx::array xc = ready(mx::astype(x, mx::float32));
  const PackedMatrix& p = *m.packed;
  need(xc.ndim() == 2 && xc.shape(1) == p.k, "x must be (M, K) float32");
  const int64_t rows = xc.shape(0);
  Pool one(1);
  QuantRows q;
  q.quantize(xc.data<float>(), rows, p.k, one);
  std::vector<float> y(rows * p.n);
  const Isa isa = best_isa();
  for (int64_t r = 0; r < rows; ++r) qgemm_range(p, q, r, r + 1, 0, p.n, y.data(), isa);
  return mx::array(y.begin(), {static_cast<int>(rows), static_cast<int>(p.n)}, mx::float32);
}

std::string decoder_isa() { return isa_name(best_isa()); }

}  // namespace mlx_serving
