// The weights re-laid out once for the int8 products (issue 39), as llama.cpp's repacked Q4 layouts
// ("q4_0_8x8": several columns' blocks interleaved in the order the GEMM's micro kernel reads):
// every call of the products then reads the weights as they lie, with no per-call unpacking of
// nibbles, interleaving or conversion, whatever its number of rows. 4-bit weights stay nibbles
// (two of BlockLayout's vectors in one), so the packed matrix is the size of MLX's.

#include "pack.h"

#include <cstring>

#include "mlx/types/half_types.h"

namespace mlx_serving {

namespace {

// Column c of m (MLX's layout) as BlockLayout's unpacked bytes (``row``: at.row_bytes, zeroed).
void unpack_column(const QMatrixView& m, int64_t c, const BlockLayout& at, uint8_t* row) {
  const int64_t row_bytes = m.k * m.bits / 8;
  const uint8_t* w = m.w + c * row_bytes;
  uint8_t v[32];
  for (int64_t i = 0; i < at.blocks; ++i) {
    if (m.bits == 4) {
      for (int t = 0; t < 16; ++t) {  // MLX: value 2t in byte t's low nibble, 2t + 1 in its high one
        v[2 * t] = w[16 * i + t] & 0xF;
        v[2 * t + 1] = w[16 * i + t] >> 4;
      }
    } else {
      std::memcpy(v, w + 32 * i, 32);
    }
    for (int ch = 0; ch < 8; ++ch) std::memcpy(row + at.offset(i, ch), v + 4 * ch, 4);
  }
}

// Group g of an unpacked column into its place: 8-bit as it is, 4-bit vector v | vector v + C/2 << 4.
void place_group(const uint8_t* group, int64_t bytes, int bits, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, group, bytes);
    return;
  }
  const int64_t half = bytes / 2;
  for (int64_t e = 0; e < half; ++e) out[e] = static_cast<uint8_t>(group[e] | (group[half + e] << 4));
}

template <typename T>
void place_params(const QMatrixView& m, const void* src, int64_t c, const PackedMatrix& p, std::vector<T>& dst) {
  const int64_t per = m.group / 32, row_groups = m.k / m.group;
  for (int64_t i = 0; i < p.at.blocks; ++i)
    dst[p.param(c / kTileCols, i / 8, c % kTileCols) + i % 8] = static_cast<const T*>(src)[c * row_groups + i / per];
}

}  // namespace

int PackedMatrix::value(int64_t c, int64_t i, int j) const {
  const int64_t g = i / 8, u = at.offset(i, j / 4) - g * 256 + j % 4;  // within the group, unpacked
  const uint8_t* col = q.data() + (c / kTileCols) * tile_bytes() + group_offset(g) + (c % kTileCols) * column_bytes(g);
  if (bits == 8) return col[u];
  const int64_t half = at.group_bytes(g) / 2;
  return u < half ? col[u] & 0xF : col[u - half] >> 4;
}

namespace {
float from_half(const std::vector<uint16_t>& v, int64_t i) {
  return static_cast<float>(reinterpret_cast<const mlx::core::float16_t*>(v.data())[i]);
}
}  // namespace

float PackedMatrix::scale(int64_t slot) const { return half ? from_half(s16, slot) : s32[slot]; }

float PackedMatrix::offset(int64_t slot) const { return half ? from_half(b16, slot) : b32[slot]; }

PackedMatrix pack(const QMatrixView& m) {
  PackedMatrix p;
  p.n = m.n;
  p.k = m.k;
  p.bits = m.bits;
  p.half = m.half;
  p.at = BlockLayout(m.k);
  p.tiles = (m.n + kTileCols - 1) / kTileCols;
  p.q.assign(p.tiles * p.tile_bytes(), 0);
  const int64_t params = p.tiles * p.at.groups * kTileCols * 8;
  if (p.half) {
    p.s16.assign(params, 0);
    p.b16.assign(params, 0);
  } else {
    p.s32.assign(params, 0.f);
    p.b32.assign(params, 0.f);
  }
  if (m.bias) p.bias.assign(m.bias, m.bias + m.n);
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < m.n; ++c) {
    std::vector<uint8_t> row(p.at.row_bytes, 0);
    unpack_column(m, c, p.at, row.data());
    uint8_t* tile = p.q.data() + (c / kTileCols) * p.tile_bytes();
    for (int64_t g = 0; g < p.at.groups; ++g)
      place_group(row.data() + g * 256, p.at.group_bytes(g), p.bits,
                  tile + p.group_offset(g) + (c % kTileCols) * p.column_bytes(g));
    if (p.half) {
      place_params(m, m.scales, c, p, p.s16);
      place_params(m, m.biases, c, p, p.b16);
    } else {
      place_params(m, m.scales, c, p, p.s32);
      place_params(m, m.biases, c, p, p.b32);
    }
  }
  return p;
}

}  // namespace mlx_serving
