// The CPU decode step's KV cache writes (kv_store.h), in each layout kv_cache.py stores (the reads:
// attend.cpp).
//
// Writes are MLX's own, bit for bit, so a block written by the decode step equals one written by the
// generic forward (prefill, the "matmul" path): float16 / bfloat16 through MLX's conversion types
// (round to nearest even), int8 / int4 as PagedKVCache.write does, mx.hadamard_transform (MLX's CPU
// butterfly order, hadamard.cpp) then, for int8, mx.quantize's affine rounding (quantized.cpp's
// quantize: the group's edge value exact, scale and bias float32), for int4 kv_quantizer.fit_int4's
// least-squares scale and bias (fit_group4).

#include "kv_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "mlx/ops.h"

#include "mlx/types/half_types.h"

namespace mx = mlx::core;

namespace mlx_serving {

namespace {

int bits_of(KvKind kind) { return kind == KvKind::kQ8 ? 8 : 4; }

// mx.quantize of one group of ``group`` float32 values (quantized.cpp's affine quantize).
void quantize_group(const float* w, int64_t group, int bits, uint32_t* out, float* scale_out, float* bias_out) {
  const float n_bins = static_cast<float>((1 << bits) - 1);
  const float eps = 1e-7f;
  float w_min = std::numeric_limits<float>::infinity();
  float w_max = -w_min;
  for (int64_t j = 0; j < group; ++j) {
    w_max = std::max(w_max, w[j]);
    w_min = std::min(w_min, w[j]);
  }
  const bool mask = std::abs(w_min) > std::abs(w_max);
  float scale = std::max((w_max - w_min) / n_bins, eps);
  scale = mask ? scale : -scale;
  const float edge = mask ? w_min : w_max;
  const float q0 = std::rint(edge / scale);
  float bias = 0;
  if (q0 != 0) {
    scale = edge / q0;
    bias = edge;
  }
  const int per = 32 / bits;
  for (int64_t j = 0; j < group / per; ++j) {
    uint64_t word = 0;
    for (int k = 0; k < per; ++k) {
      float x = std::rint((w[j * per + k] - bias) / scale);
      x = std::min(std::max(x, 0.0f), n_bins);
      word |= static_cast<uint64_t>(x) << (k * bits);
    }
    out[j] = static_cast<uint32_t>(word);
  }
  *scale_out = scale;
  *bias_out = bias;
}

// kv_quantizer.py's int4 fit (its docstring): the [min, max] shrink of least squared error, then kRefits
// Lloyd steps, float32, each operation and sum order as the MLX ops compute them (no contraction: one
// operation per statement), so the bytes equal kv_quantizer.fit_int4's.
constexpr int kShrinks = 5;  // kv_quantizer.SHRINK: 1 - 0.05 j, j < 5 (rounded from double as Python does)
constexpr int kRefits = 2;   // kv_quantizer.REFITS
constexpr float kLevels = 15.0f;
const float kEps = static_cast<float>(1e-7);

// kv_quantizer._pair_sum: halves added pairwise; ``a`` (n, a power of 2) is overwritten.
float pair_sum(float* a, int64_t n) {
  for (int64_t h = n / 2; h >= 1; h /= 2)
    for (int64_t j = 0; j < h; ++j) a[j] = a[j] + a[j + h];
  return a[0];
}

float code(float x, float scale, float bias) {
  const float inv = 1.0f / scale;
  const float t = x - bias;
  const float u = t * inv;
  return std::min(std::max(std::rint(u), 0.0f), kLevels);
}

float fit_error(const float* x, int64_t n, float scale, float bias, float* tmp) {
  for (int64_t j = 0; j < n; ++j) {
    const float r0 = code(x[j], scale, bias) * scale;
    const float r1 = r0 + bias;
    const float r = r1 - x[j];
    tmp[j] = r * r;
  }
  return pair_sum(tmp, n);
}

// kv_quantizer._refit: the least-squares scale and bias of the codes for (scale, bias).
void refit(const float* x, int64_t n, float& scale, float& bias, float* tmp) {
  float* q = tmp;
  float* qq = tmp + n;
  float* qx = tmp + 2 * n;
  float* xs = tmp + 3 * n;
  for (int64_t j = 0; j < n; ++j) {
    q[j] = code(x[j], scale, bias);
    qq[j] = q[j] * q[j];
    qx[j] = q[j] * x[j];
    xs[j] = x[j];
  }
  const float sq = pair_sum(q, n), sx = pair_sum(xs, n), sqq = pair_sum(qq, n), sqx = pair_sum(qx, n);
  const float fn = static_cast<float>(n);
  const float a = fn * sqq, b = sq * sq;
  const float den = a - b;
  const float c = fn * sqx, e = sq * sx;
  const float num = c - e;
  const float fit = num / (den > 0 ? den : 1.0f);
  if (!(den > 0) || !(std::abs(fit) >= kEps)) return;
  scale = fit;
  const float m = fit * sq;
  const float t = sx - m;
  bias = t * (1.0f / fn);
}

// kv_quantizer.fit_int4 of one group of ``group`` (<= 128) float32 values (MLX's 4-bit words).
void fit_group4(const float* w, int64_t group, uint32_t* out, float* scale_out, float* bias_out) {
  float tmp[4 * 128];
  float lo = std::numeric_limits<float>::infinity(), hi = -lo;
  for (int64_t j = 0; j < group; ++j) {
    hi = std::max(hi, w[j]);
    lo = std::min(lo, w[j]);
  }
  float best = std::numeric_limits<float>::infinity(), scale = 0, bias = 0;
  for (int a = 0; a < kShrinks; ++a) {
    const float shrink = static_cast<float>(1.0 - 0.05 * a);
    const float l = lo * shrink, h = hi * shrink;
    const float s = std::max((h - l) / kLevels, kEps);
    const float err = fit_error(w, group, s, l, tmp);
    if (err < best || a == 0) {
      best = err;
      scale = s;
      bias = l;
    }
  }
  for (int r = 0; r < kRefits; ++r) refit(w, group, scale, bias, tmp);
  for (int64_t j = 0; j < group / 8; ++j) {
    uint32_t word = 0;
    for (int k = 0; k < 8; ++k) word |= static_cast<uint32_t>(code(w[j * 8 + k], scale, bias)) << (k * 4);
    out[j] = word;
  }
  *scale_out = scale;
  *bias_out = bias;
}

}  // namespace

void hadamard(float* x, int64_t n) {
  const float scale = 1.0f / std::sqrt(static_cast<int>(n));  // ops.cpp's default scale, as it computes it
  const int64_t half = n / 2;
  for (int64_t h = 1; h < n; h <<= 1)
    for (int64_t i = 0; i < half; ++i) {
      const int64_t k = i & (h - 1), j = ((i - k) << 1) + k;
      const float a = x[j], b = x[j + h];
      x[j] = a + b;
      x[j + h] = a - b;
      if (h == half) {
        x[j] *= scale;
        x[j + h] *= scale;
      }
    }
}

void KvCache::store(const KvSide& side, int64_t row, float* x) const {
  const int64_t n = hkv * d;
  switch (kind) {
    case KvKind::kF32:
      std::memcpy(static_cast<float*>(side.data) + row * n, x, sizeof(float) * n);
      return;
    case KvKind::kF16: {
      auto* dst = static_cast<mx::float16_t*>(side.data) + row * n;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<mx::float16_t>(x[i]);
      return;
    }
    case KvKind::kBF16: {
      auto* dst = static_cast<mx::bfloat16_t*>(side.data) + row * n;
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<mx::bfloat16_t>(x[i]);
      return;
    }
    default: {
      const int bits = bits_of(kind);
      const int64_t words = d * bits / 32, groups = d / group;
      for (int64_t hd = 0; hd < hkv; ++hd) {
        float* v = x + hd * d;
        hadamard(v, d);
        const int64_t at = row * hkv + hd;
        for (int64_t g = 0; g < groups; ++g) {
          uint32_t* out = static_cast<uint32_t*>(side.data) + at * words + g * group * bits / 32;
          if (bits == 4)
            fit_group4(v + g * group, group, out, side.scales + at * groups + g, side.biases + at * groups + g);
          else
            quantize_group(v + g * group, group, bits, out, side.scales + at * groups + g,
                           side.biases + at * groups + g);
        }
      }
    }
  }
}

std::vector<mx::array> kv_quantize(const mx::array& x, int bits, int group) {
  const int64_t d = x.ndim() == 2 ? x.shape(1) : 0;
  if (x.dtype() != mx::float32 || d == 0 || (d & (d - 1)) != 0 || (bits != 4 && bits != 8) ||
      (group != 32 && group != 64 && group != 128) || d % group != 0)
    throw std::invalid_argument("kv_quantize: x (N, D) float32 with D a power of 2, bits 4 or 8, group 32/64/128 dividing D");
  mx::array c = mx::contiguous(x, false, mx::Device(mx::Device::cpu));
  c.eval();
  const int n = x.shape(0), words = static_cast<int>(d) * bits / 32, groups = static_cast<int>(d / group);
  std::vector<uint32_t> w(static_cast<size_t>(n) * words);
  std::vector<float> s(static_cast<size_t>(n) * groups), b(s.size()), row(c.data<float>(), c.data<float>() + c.size());
  const KvCache kv{bits == 8 ? KvKind::kQ8 : KvKind::kQ4, 1, d, group, {}, {}};
  for (int i = 0; i < n; ++i) kv.store({w.data(), s.data(), b.data()}, i, row.data() + i * d);
  return {mx::array(w.begin(), {n, words}, mx::uint32), mx::array(s.begin(), {n, groups}, mx::float32),
          mx::array(b.begin(), {n, groups}, mx::float32)};
}

}  // namespace mlx_serving
