// CPU kernel for causal GQA attention over the paged KV cache (prefill, decode and mixed rows)
//
// MLX's Linux CPU wheel computes scaled_dot_product_attention with a reference BLAS (~1.4 GFLOP/s
// measured, issue 24): 512-token prefill of SmolLM2-135M spent 3.9 of its 5.6 s in attention, and
// decode paid ~8 MLX operations per layer (gather, transposes, masked softmax, two matmuls). This
// primitive reads the cache through the block table itself and computes, for every query, the
// softmax attention over exactly its causal prefix, with an online softmax (Milakov & Gimelshein,
// "Online normalizer calculation for softmax", 2018; the FlashAttention tiling, Dao et al. 2022).
//
// Layout: q (B, H, T, D) float32 (the rotated queries), k and v (R, Hkv, D) float32 (the paged
// cache's flat token rows), block_table (B, W) int32, start (B,) int32 (each row's first query
// position), n_valid (B,) int32 (real queries per row; the rest is padding). Query j of row b sits
// at position p = start[b] + j and sees the keys at positions 0..p, found at flat row
// block_table[b, pos / bs] * bs + pos % bs. Head h reads KV head h / (H / Hkv) (mlx-lm's GQA). The
// output is (B, T, H, D) float32, zeros at padding queries.
//
// Quantized cache (kv_cache_dtype int8 / int4): k and v are MLX's affine layout (R, Hkv, D * bits / 32)
// uint32 (value c of a head vector in bits [bits * (c % per), ...) of word c / per, per = 32 / bits)
// with scales and biases (R, Hkv, D / group) float32; each block's key and value rows are
// dequantized (scale * q + bias, in float32) once per (row, KV head) and shared by all its query
// tiles (a prefill's; up to kSharedBytes per call, past that each tile dequantizes its own, as a
// one-tile row does), so the read is bits / 32 of the float cache's bytes. The values a query sees
// depend only on the stored rows: the invariance below holds unchanged. A 16-bit cache
// (kv_cache_dtype float16 / bfloat16): k and v (R, Hkv, D) float16 or bfloat16, each block's rows
// widened to float32 (exact) the same way.
//
// Storing (paged_attention_store, the native prefill's): the call's new K/V (N, Hkv, D) float32 are
// first stored at their cache rows by the CPU decode step's own store (kv_store.h: the dtype's
// rounding, or the Hadamard rotation and mx.quantize's rounding, bit for bit PagedKVCache.write's),
// on the same threads, the cache arrays written in place and returned; a quantized cache's queries
// are rotated into its basis before they are scaled and each output rotated back (8 head vectors at
// a time on the AVX2 path: hadamard8, the same bits as kv_store's hadamard, which is
// mx.hadamard_transform's). One primitive per layer where the generic path runs the rotation, the
// quantization and six scatters as MLX operations.
//
// The per-row and per-block loops (conversion, scores, softmax step, weighted sum, transposition,
// rotation; AVX2 or portable) are in attention_loops.cpp.
//
// Invariance: keys are visited in blocks of kSk at absolute positions (0, kSk, 2 kSk, ...), and
// every query keeps its own running maximum, sum and accumulator; a query's result depends only on
// its own vector and its prefix's keys and values, never on the other rows, the tile it shares or
// the call's T. So a row batched equals the row alone, a prefix-cache hit equals a miss, and a
// token recomputed by prefill after preemption equals its decode: bit for bit.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <optional>
#include <stdexcept>
#include <unordered_set>
#include <utility>
#include <vector>

#include "attention_loops.h"
#include "kernels.h"
#include "kv_store.h"
#include "prefill.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace mlx_serving {
namespace {

using namespace attention_loops;

constexpr int kTq = 16;  // queries of one head per work unit

struct Geometry {
  int64_t b, h, hkv, t, d, w, bs, rows;
  float scale;
  bool rotate = false;  // queries rotated into the quantized cache's Hadamard basis, outputs back out
};

// ---- one work unit: up to kTq queries of every head of one KV head of one row ------------------

struct Scratch {
  std::vector<float> q, o, m, l, kt, s, kd, vd;
  std::vector<const float*> k, v;
  std::vector<float*> rotated;  // the head vectors a quantized cache's rotation turns
};

// The row pointers of one key or value block: into ``buf`` (kSk rows of d) where the quantized or
// 16-bit rows ``idx`` are converted to float32.
void convert_block(const Quant& q, const int64_t* idx, int64_t d, bool avx2, float* buf, const float** rows) {
  for (int s = 0; s < kSk; ++s) {
    convert_row(q, idx[s], d, avx2, buf + s * d);
    rows[s] = buf + s * d;
  }
}

// The cache: float32 rows (k, v) or converted ones (kq, vq).
struct Cache {
  const float *k, *v;
  Quant kq, vq;
};

// Key block s0 of KV head g of row b (its first ns positions; the rest read the null block): the
// key and value row pointers in ``krows`` / ``vrows`` (into the float32 cache, or into ``kd`` / ``vd``
// where converted) and the keys transposed into ``kt`` (d, kSk).
void load_block(const Cache& c, const int32_t* table, int64_t b, int64_t g, int64_t s0, int ns, const Geometry& ge,
                bool avx2, float* kt, float* kd, float* vd, const float** krows, const float** vrows) {
  const int64_t d = ge.d;
  int64_t idx[kSk];
  for (int s = 0; s < kSk; ++s) {
    const int64_t pos = s0 + s;
    int64_t row = pos / ge.bs < ge.w ? static_cast<int64_t>(table[b * ge.w + pos / ge.bs]) * ge.bs + pos % ge.bs : -1;
    if (row < 0 || row >= ge.rows || s >= ns) row = 0;  // past the span, or a table that does not cover it: the null block
    idx[s] = row * ge.hkv + g;
    if (!c.kq.bits) {
      krows[s] = c.k + idx[s] * d;
      vrows[s] = c.v + idx[s] * d;
    }
  }
  if (c.kq.bits) {
    convert_block(c.kq, idx, d, avx2, kd, krows);
    convert_block(c.vq, idx, d, avx2, vd, vrows);
  }
  transpose_block(krows, d, kt, avx2);
}

// A (row, KV head)'s prefix converted to float32 once for all its query tiles: block after block,
// its keys transposed (d, kSk) then its values (kSk, d); null: each unit converts its own.
struct Shared {
  const float* blocks = nullptr;
};

void unit(const float* q, const Cache& c, const int32_t* table, int64_t b, int64_t g, int64_t j0, int64_t j1,
          int64_t start, const Geometry& ge, bool avx2, const Shared& shared, float* out, Scratch& w) {
  const int64_t group = ge.h / ge.hkv, d = ge.d, nq = group * (j1 - j0);
  w.q.resize(nq * d);  // every buffer but the running o, m and l is written before it is read
  w.o.assign(nq * d, 0.f);
  w.m.assign(nq, -std::numeric_limits<float>::infinity());
  w.l.assign(nq, 0.f);
  w.kt.resize(d * kSk);
  w.s.resize(2 * kSk);
  w.k.resize(kSk);
  w.v.resize(kSk);
  if (c.kq.bits && !shared.blocks) {
    w.kd.resize(kSk * d);
    w.vd.resize(kSk * d);
  }
  // Query i = r * (j1 - j0) + (j - j0) is head g * group + r at token j; scaled first, as MLX does.
  for (int64_t r = 0; r < group; ++r)
    for (int64_t j = j0; j < j1; ++j) {
      const float* src = q + (((b * ge.h + g * group + r) * ge.t) + j) * d;
      std::copy(src, src + d, w.q.data() + (r * (j1 - j0) + (j - j0)) * d);
    }
  if (ge.rotate) {  // into the cache's basis: mx.hadamard_transform's bits (kv_store.cpp), before the scale
    w.rotated.resize(nq);
    for (int64_t e = 0; e < nq; ++e) w.rotated[e] = w.q.data() + e * d;
    rotate_all(w.rotated.data(), nq, d, avx2);
  }
  for (int64_t i = 0; i < nq * d; ++i) w.q[i] *= ge.scale;
  const int64_t last = start + j1 - 1;  // the furthest position any query here sees
  for (int64_t s0 = 0; s0 <= last; s0 += kSk) {
    const int ns = static_cast<int>(std::min<int64_t>(kSk, last + 1 - s0));
    const float* kt = w.kt.data();
    if (shared.blocks) {  // converted before (its lanes past ns may hold real rows, not the null block: unread)
      kt = shared.blocks + (s0 / kSk) * 2 * kSk * d;
      for (int s = 0; s < kSk; ++s) w.v[s] = kt + (kSk + s) * d;
    } else {
      load_block(c, table, b, g, s0, ns, ge, avx2, w.kt.data(), w.kd.data(), w.vd.data(), w.k.data(), w.v.data());
    }
    for (int64_t i = 0; i < nq; i += 2) {
      const int64_t i1 = std::min(i + 1, nq - 1);  // an odd last query is computed twice, kept once
      const float* q0 = w.q.data() + i * d;
      const float* q1 = w.q.data() + i1 * d;
      scores(q0, q1, kt, d, w.s.data(), w.s.data() + kSk, avx2);
      for (int64_t e = i; e <= i1; ++e) {
        float* sc = w.s.data() + (e - i) * kSk;
        const int64_t pos = start + j0 + e % (j1 - j0);
        const int n = static_cast<int>(std::min<int64_t>(ns, pos + 1 - s0));
        if (n <= 0) continue;  // this block lies past the query: it never sees it
        float top, corr;
        const float sum = softmax(sc, n, w.m[e], &top, &corr, avx2);
        w.m[e] = top;
        w.l[e] = w.l[e] * corr + sum;
        float* o = w.o.data() + e * d;
        accumulate(o, corr, sc, w.v.data(), n, d, avx2);
      }
    }
  }
  for (int64_t e = 0; e < nq; ++e) {
    const int64_t r = e / (j1 - j0), j = j0 + e % (j1 - j0);
    float* dst = out + ((b * ge.t + j) * ge.h + g * group + r) * d;
    const float* o = w.o.data() + e * d;
    const float inv = 1.f / w.l[e];
    for (int64_t c = 0; c < d; ++c) dst[c] = o[c] * inv;
    if (ge.rotate) w.rotated[e] = dst;
  }
  if (ge.rotate) rotate_all(w.rotated.data(), nq, d, avx2);  // back out of the cache's basis
}

// fn(0), ..., fn(count - 1): on the native prefill's pool (threads > 0), else on OpenMP's threads
// (in parallel only when ``parallel``).
void for_each(int threads, int64_t count, bool parallel, const std::function<void(int64_t)>& fn) {
  if (threads > 0) {
    run_on_prefill_pool(threads, count, fn);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1) if (parallel)
  for (int64_t u = 0; u < count; ++u) fn(u);
}

constexpr int64_t kSharedBytes = int64_t{1} << 26;  // the most converted prefixes one call holds (64 MiB)

void attention(const float* q, const Cache& c, const int32_t* table, const int32_t* start, const int32_t* n_valid,
               float* out, const Geometry& ge, int threads) {
  std::memset(out, 0, sizeof(float) * ge.b * ge.t * ge.h * ge.d);  // padding queries stay zero
  struct Work {
    int64_t b, g, j0, j1;
  };
  std::vector<Work> units;
  double cost = 0;
  for (int64_t b = 0; b < ge.b; ++b) {
    const int64_t n = std::min<int64_t>(n_valid[b], ge.t);
    for (int64_t j0 = 0; j0 < n; j0 += kTq) {
      const int64_t j1 = std::min(n, j0 + kTq);
      for (int64_t g = 0; g < ge.hkv; ++g) units.push_back({b, g, j0, j1});
      cost += static_cast<double>(ge.h) * (j1 - j0) * (start[b] + j1) * ge.d;
    }
  }
  const bool avx2 = avx2_path(ge.d);
  const bool parallel = cost >= (1 << 17);
  // A converted cache (16-bit or quantized): the prefix of each (row, KV head) with several query
  // tiles converted once, before them, instead of by each tile (as many as kSharedBytes holds).
  std::vector<Shared> shared(static_cast<size_t>(ge.b * ge.hkv));
  std::vector<float> buf;
  struct Block {
    int64_t b, g, s0;
    int ns;
    size_t at;  // its keys (d, kSk) then its values (kSk, d) in buf
  };
  std::vector<Block> blocks;
  if (c.kq.bits) {
    const int64_t d = ge.d, per = 2 * kSk * d;  // floats per block
    size_t total = 0;
    for (int64_t b = 0; b < ge.b; ++b) {
      const int64_t n = std::min<int64_t>(n_valid[b], ge.t), span = start[b] + n, nb = (span + kSk - 1) / kSk;
      if (n <= kTq || static_cast<int64_t>(sizeof(float) * (total + ge.hkv * nb * per)) > kSharedBytes) continue;
      for (int64_t g = 0; g < ge.hkv; ++g)
        for (int64_t i = 0; i < nb; ++i, total += per)
          blocks.push_back({b, g, i * kSk, static_cast<int>(std::min<int64_t>(kSk, span - i * kSk)), total});
    }
    buf.resize(total);
    for (const Block& x : blocks)
      if (x.s0 == 0) shared[x.b * ge.hkv + x.g] = {buf.data() + x.at};
    for_each(threads, static_cast<int64_t>(blocks.size()), parallel, [&](int64_t u) {
      thread_local std::vector<float> kd;
      const float *krows[kSk], *vrows[kSk];
      const Block& x = blocks[u];
      kd.resize(kSk * d);
      load_block(c, table, x.b, x.g, x.s0, x.ns, ge, avx2, buf.data() + x.at, kd.data(), buf.data() + x.at + kSk * d,
                 krows, vrows);
    });
  }
  for_each(threads, static_cast<int64_t>(units.size()), parallel, [&](int64_t u) {
    thread_local Scratch w;
    const Work& x = units[u];
    unit(q, c, table, x.b, x.g, x.j0, x.j1, start[x.b], ge, avx2, shared[x.b * ge.hkv + x.g], out, w);
  });
}

// ---- the new K/V stored before they are attended (paged_attention_store) ------------------------

constexpr int64_t kStoreTokens = 8;  // tokens per task of the store

// Store the new tokens' K/V ``k``, ``v`` (n, Hkv, D) float32 at the cache rows ``rows`` (n,) as the
// decode step stores them (KvCache::store: the dtype's rounding, or rotated and quantized). A row
// written twice keeps the later token's (MLX's scatter, in order: the padding tokens' null block);
// a row outside [0, cache_rows) is not written.
void store_tokens(const KvCache& cache, const float* k, const float* v, const int32_t* rows, int64_t n,
                  int64_t cache_rows, int threads) {
  std::vector<char> keep(static_cast<size_t>(n), 0);
  std::unordered_set<int32_t> seen;
  for (int64_t i = n - 1; i >= 0; --i)
    keep[i] = rows[i] >= 0 && rows[i] < cache_rows && seen.insert(rows[i]).second;
  const int64_t width = cache.hkv * cache.d;
  for_each(threads, (n + kStoreTokens - 1) / kStoreTokens, n * width >= (1 << 14), [&](int64_t task) {
    thread_local std::vector<float> x;  // store() rotates a quantized cache's vectors in place
    x.resize(static_cast<size_t>(width));
    for (int64_t i = task * kStoreTokens; i < std::min(n, (task + 1) * kStoreTokens); ++i) {
      if (!keep[i]) continue;
      for (const auto& [src, side] : {std::pair{k, &cache.keys[0]}, std::pair{v, &cache.values[0]}}) {
        std::copy(src + i * width, src + (i + 1) * width, x.begin());
        cache.store(*side, rows[i], x.data());
      }
    }
  });
}

KvKind kind_of(mx::Dtype dtype, int bits) {
  if (bits) return bits == 8 ? KvKind::kQ8 : KvKind::kQ4;
  return dtype == mx::float32 ? KvKind::kF32 : dtype == mx::float16 ? KvKind::kF16 : KvKind::kBF16;
}

class PagedAttention : public mx::Primitive {
 public:
  // bits 0: a float cache (inputs q, k, v, table, start, n_valid); 4 or 8: k and v quantized, their
  // scales and biases the inputs 6..9 (k scales, k biases, v scales, v biases). ``store``: three more
  // inputs, the new K/V and their cache rows, stored first; the outputs after the attention's are
  // the cache arrays (k, v, then the scales and biases) over the inputs' buffers, written in place.
  PagedAttention(mx::Stream stream, float scale, int block_size, int group_size, int bits, int threads, bool store)
      : mx::Primitive(stream),
        scale_(scale),
        block_size_(block_size),
        group_size_(group_size),
        bits_(bits),
        threads_(threads),
        store_(store) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const auto& q = inputs[0];
    const auto& k = inputs[1];
    const auto& table = inputs[3];
    auto& y = outputs[0];
    y.set_data(mx::allocator::malloc(y.nbytes()));
    const std::vector<size_t> held = bits_ ? std::vector<size_t>{1, 2, 6, 7, 8, 9} : std::vector<size_t>{1, 2};
    std::vector<const void*> at(inputs.size());  // each cache input's buffer as the attention reads it
    for (size_t i = 0; i < held.size(); ++i) {
      const auto& in = inputs[held[i]];
      if (store_) {  // the cache array written in place: its output shares the (row-contiguous) buffer
        if (!in.flags().row_contiguous)
          throw std::runtime_error("paged_attention_cpu: a cache array is not contiguous");
        outputs[1 + i].copy_shared_buffer(in);
      }
      at[held[i]] = (store_ ? outputs[1 + i] : in).data<void>();
    }
    const Geometry ge{q.shape(0), q.shape(1), k.shape(1), q.shape(2), q.shape(3), table.shape(1), block_size_,
                      k.shape(0), scale_, store_ && bits_ != 0};
    Quant kq, vq;
    const float *kp = nullptr, *vp = nullptr;
    const auto words = [&](size_t i) { return static_cast<const uint32_t*>(at[i]); };
    const auto floats = [&](size_t i) { return static_cast<const float*>(at[i]); };
    if (bits_) {
      kq = {words(1), floats(6), floats(7), bits_, group_size_};
      vq = {words(2), floats(8), floats(9), bits_, group_size_};
    } else if (k.dtype() != mx::float32) {
      const bool bf16 = k.dtype() == mx::bfloat16;
      kq = {words(1), nullptr, nullptr, 16, 0, bf16};
      vq = {words(2), nullptr, nullptr, 16, 0, bf16};
    } else {
      kp = floats(1);
      vp = floats(2);
    }
    KvCache cache{kind_of(k.dtype(), bits_), ge.hkv, ge.d, group_size_, {}, {}};
    const auto side = [&](size_t data, size_t scales) {
      return KvSide{const_cast<void*>(at[data]), bits_ ? const_cast<float*>(floats(scales)) : nullptr,
                    bits_ ? const_cast<float*>(floats(scales + 1)) : nullptr};
    };
    cache.keys.push_back(side(1, 6));
    cache.values.push_back(side(2, 8));
    const size_t nk = inputs.size() - 3;  // the new K/V and their rows (store_)
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    for (auto& a : outputs) encoder.set_output_array(a);
    encoder.dispatch([qp = q.data<float>(), kp, vp, kq, vq, tp = table.data<int32_t>(), sp = inputs[4].data<int32_t>(),
                      np = inputs[5].data<int32_t>(), yp = y.data<float>(), ge, threads = threads_,
                      cache = std::move(cache), store = store_,
                      newk = store_ ? inputs[nk].data<float>() : nullptr,
                      newv = store_ ? inputs[nk + 1].data<float>() : nullptr,
                      rows = store_ ? inputs[nk + 2].data<int32_t>() : nullptr,
                      n = store_ ? inputs[nk + 2].size() : size_t{0}]() {
      if (store) store_tokens(cache, newk, newv, rows, static_cast<int64_t>(n), ge.rows, threads);
      attention(qp, {kp, vp, kq, vq}, tp, sp, np, yp, ge, threads);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("PagedAttentionCPU has no GPU implementation");
  }

  const char* name() const override { return store_ ? "PagedAttentionStoreCPU" : "PagedAttentionCPU"; }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& q = inputs[0];
    std::vector<mx::Shape> shapes = {{q.shape(0), q.shape(2), q.shape(1), q.shape(3)}};
    if (store_)
      for (size_t i : bits_ ? std::vector<size_t>{1, 2, 6, 7, 8, 9} : std::vector<size_t>{1, 2})
        shapes.push_back(inputs[i].shape());
    return shapes;
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PagedAttention&>(other);
    return scale_ == o.scale_ && block_size_ == o.block_size_ && group_size_ == o.group_size_ && bits_ == o.bits_ &&
           threads_ == o.threads_ && store_ == o.store_;
  }

 private:
  float scale_;
  int block_size_, group_size_, bits_, threads_;  // threads 0: OpenMP's
  bool store_;
};

// The checked, contiguous inputs of the primitive: q, k, v, block_table, start, n_valid and, for a
// quantized cache, the k scales, k biases, v scales and v biases. Raises std::invalid_argument.
std::vector<mx::array> checked_inputs(const mx::array& q, const mx::array& k, const mx::array& v,
                                      const mx::array& block_table, const mx::array& start, const mx::array& n_valid,
                                      int block_size, const std::optional<mx::array>& k_scales,
                                      const std::optional<mx::array>& k_biases,
                                      const std::optional<mx::array>& v_scales,
                                      const std::optional<mx::array>& v_biases, int group_size, int bits, int threads) {
  if (threads < 0) throw std::invalid_argument("paged_attention_cpu: threads must be 0 (OpenMP's) or more");
  const bool quantized = k_scales.has_value();
  if (quantized != (k_biases && v_scales && v_biases && bits != 0))
    throw std::invalid_argument("paged_attention_cpu: a quantized cache needs k/v scales and biases and bits");
  const bool wide = k.dtype() == mx::float32 || k.dtype() == mx::float16 || k.dtype() == mx::bfloat16;
  if (q.dtype() != mx::float32 || k.shape() != v.shape() || k.dtype() != v.dtype() ||
      (quantized ? k.dtype() != mx::uint32 : !wide))
    throw std::invalid_argument(
        "paged_attention_cpu: q must be float32, and k, v float32, float16 or bfloat16 (uint32 when quantized)");
  if (block_table.dtype() != mx::int32 || start.dtype() != mx::int32 || n_valid.dtype() != mx::int32)
    throw std::invalid_argument("paged_attention_cpu: block_table, start and n_valid must be int32");
  const int64_t d = q.ndim() == 4 ? q.shape(3) : 0;
  if (q.ndim() != 4 || k.ndim() != 3 || k.shape(2) * (quantized ? 32 / bits : 1) != d || k.shape(1) < 1 ||
      q.shape(1) % k.shape(1) != 0)
    throw std::invalid_argument("paged_attention_cpu: q (B, H, T, D) and k, v (R, Hkv, D) with H % Hkv == 0 expected");
  if (block_table.ndim() != 2 || block_table.shape(0) != q.shape(0) || start.ndim() != 1 ||
      start.shape(0) != q.shape(0) || n_valid.shape() != start.shape() || block_size < 1)
    throw std::invalid_argument("paged_attention_cpu: block_table (B, W), start (B,) and n_valid (B,) expected");
  const auto s = mx::Device(mx::Device::cpu);
  std::vector<mx::array> inputs = {mx::contiguous(q, false, s),           mx::contiguous(k, false, s),
                                   mx::contiguous(v, false, s),           mx::contiguous(block_table, false, s),
                                   mx::contiguous(start, false, s),       mx::contiguous(n_valid, false, s)};
  if (quantized) {
    if ((bits != 4 && bits != 8) || (group_size != 32 && group_size != 64 && group_size != 128) || d % group_size)
      throw std::invalid_argument("paged_attention_cpu: bits 4 or 8 and a group of 32, 64 or 128 dividing D expected");
    for (const auto* a : {&*k_scales, &*k_biases, &*v_scales, &*v_biases}) {
      if (a->dtype() != mx::float32 || a->ndim() != 3 || a->shape(0) != k.shape(0) || a->shape(1) != k.shape(1) ||
          a->shape(2) != d / group_size)
        throw std::invalid_argument("paged_attention_cpu: scales and biases (R, Hkv, D / group) float32 expected");
      inputs.push_back(mx::contiguous(*a, false, s));
    }
  }
  return inputs;
}

}  // namespace

mx::array paged_attention(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& block_table,
                          const mx::array& start, const mx::array& n_valid, float scale, int block_size,
                          const std::optional<mx::array>& k_scales, const std::optional<mx::array>& k_biases,
                          const std::optional<mx::array>& v_scales, const std::optional<mx::array>& v_biases,
                          int group_size, int bits, int threads) {
  auto inputs = checked_inputs(q, k, v, block_table, start, n_valid, block_size, k_scales, k_biases, v_scales,
                               v_biases, group_size, bits, threads);
  const bool quantized = k_scales.has_value();
  const auto s = mx::Device(mx::Device::cpu);
  return mx::array({q.shape(0), q.shape(2), q.shape(1), q.shape(3)}, mx::float32,
                   std::make_shared<PagedAttention>(mx::default_stream(s), scale, block_size, quantized ? group_size : 0,
                                                    quantized ? bits : 0, threads, false),
                   std::move(inputs));
}

std::vector<mx::array> paged_attention_store(const mx::array& q, const mx::array& new_k, const mx::array& new_v,
                                             const mx::array& rows, const mx::array& k, const mx::array& v,
                                             const mx::array& block_table, const mx::array& start,
                                             const mx::array& n_valid, float scale, int block_size,
                                             const std::optional<mx::array>& k_scales,
                                             const std::optional<mx::array>& k_biases,
                                             const std::optional<mx::array>& v_scales,
                                             const std::optional<mx::array>& v_biases, int group_size, int bits,
                                             int threads) {
  auto inputs = checked_inputs(q, k, v, block_table, start, n_valid, block_size, k_scales, k_biases, v_scales,
                               v_biases, group_size, bits, threads);
  const bool quantized = k_scales.has_value();
  const int64_t hkv = k.shape(1), d = q.shape(3);
  if (new_k.dtype() != mx::float32 || new_v.dtype() != mx::float32 || new_k.ndim() != 3 ||
      new_k.shape() != new_v.shape() || new_k.shape(1) != hkv || new_k.shape(2) != d)
    throw std::invalid_argument("paged_attention_store: new_k and new_v must be (N, Hkv, D) float32");
  if (rows.dtype() != mx::int32 || rows.ndim() != 1 || rows.shape(0) != new_k.shape(0))
    throw std::invalid_argument("paged_attention_store: rows must be (N,) int32");
  if (quantized && (d & (d - 1)) != 0)
    throw std::invalid_argument("paged_attention_store: a quantized cache needs a power-of-2 head_dim (its rotation)");
  const auto s = mx::Device(mx::Device::cpu);
  for (const auto* a : {&new_k, &new_v, &rows}) inputs.push_back(mx::contiguous(*a, false, s));
  std::vector<mx::Shape> shapes = {{q.shape(0), q.shape(2), q.shape(1), q.shape(3)}};
  std::vector<mx::Dtype> dtypes = {mx::float32};
  for (size_t i : quantized ? std::vector<size_t>{1, 2, 6, 7, 8, 9} : std::vector<size_t>{1, 2}) {
    shapes.push_back(inputs[i].shape());
    dtypes.push_back(inputs[i].dtype());
  }
  return mx::array::make_arrays(std::move(shapes), dtypes,
                                std::make_shared<PagedAttention>(mx::default_stream(s), scale, block_size,
                                                                 quantized ? group_size : 0, quantized ? bits : 0,
                                                                 threads, true),
                                inputs);
}

}  // namespace mlx_serving
