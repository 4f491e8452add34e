// The weights of an affine 4- or 8-bit matrix re-laid out once, when the decoder is made, in the
// order the int8 products' micro kernel reads them (pack.cpp; read by qgemm.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "qdot.h"

namespace mlx_serving {

// Where the values of a row's K / 32 blocks lie, unpacked (one byte per value): in groups of 8
// blocks, a group's 256 bytes interleaved so that byte 32 ch + 4 j + t is value 4 ch + t of the
// group's block j (one 32-byte load feeds 8 blocks, one int32 lane each). A last group of 1-4
// blocks (``pairs``) takes 128 bytes, two lanes per block: byte 32 (ch % 4) + 4 (2 j + ch / 4) + t.
// A last group of 5-7 blocks is a whole group padded with zero blocks. The activations (QuantRows)
// are stored so; the weights (PackedMatrix) so, or with two 32-byte vectors in one (4 bits).
struct BlockLayout {
  int64_t blocks = 0, full = 0, groups = 0, row_bytes = 0;  // full: whole groups; groups: with the last
  bool pairs = false;
  explicit BlockLayout(int64_t k = 0)
      : blocks(k / 32), full(blocks / 8), groups((blocks + 7) / 8), pairs(blocks % 8 != 0 && blocks % 8 <= 4) {
    row_bytes = full * 256 + (blocks % 8 == 0 ? 0 : pairs ? 128 : 256);
  }
  int64_t offset(int64_t i, int ch) const {  // of value 4 ch of block i
    const int64_t g = i / 8, j = i % 8;
    return pairs && g == full ? full * 256 + 32 * (ch % 4) + 4 * (2 * j + ch / 4) : g * 256 + 32 * ch + 4 * j;
  }
  int64_t group_bytes(int64_t g) const { return pairs && g == full ? 128 : 256; }  // unpacked
};

// Columns of a tile of the packed matrix: the micro kernel's columns.
constexpr int64_t kTileCols = 4;

// An affine-quantized (N, K) matrix in the micro kernel's order. Columns in tiles of kTileCols
// (the last padded with zero columns); a tile holds, group of 8 blocks by group, its 4 columns'
// values of the group one after another, each in BlockLayout's order: 8-bit values as they are
// (256 bytes, 128 for a last ``pairs`` group); 4-bit values two vectors to a byte, vector v of
// the group's C (8, or 4 for ``pairs``) in the low nibbles and vector v + C / 2 in the high
// nibbles of 32 bytes (128, or 64, bytes a column: the size of MLX's nibbles), so one 32-byte
// load and an and / a shift give two vectors. Scales and offsets one per block (a group of 64 or
// 128 repeats its own), 8 per (tile, group, column) (padding 0), in their own dtype (``half``:
// float16 bits; float32 otherwise). ``bias`` (N,) float32 or empty.
struct PackedMatrix {
  int64_t n = 0, k = 0, tiles = 0;
  int bits = 4;
  bool half = false;
  BlockLayout at;
  std::vector<uint8_t> q;        // tiles x (at.row_bytes * bits / 8) x kTileCols
  std::vector<uint16_t> s16, b16;  // half: tiles x at.groups x kTileCols x 8
  std::vector<float> s32, b32;     // not half: likewise
  std::vector<float> bias;

  int64_t tile_bytes() const { return kTileCols * at.row_bytes * bits / 8; }
  int64_t group_offset(int64_t g) const { return kTileCols * g * 256 * bits / 8; }  // within a tile
  int64_t column_bytes(int64_t g) const { return at.group_bytes(g) * bits / 8; }    // of group g
  int64_t param(int64_t tile, int64_t g, int64_t col) const { return ((tile * at.groups + g) * kTileCols + col) * 8; }
  // Weight value j (0..31, unsigned) of block i of column c (the portable loop's read).
  int value(int64_t c, int64_t i, int j) const;
  float scale(int64_t slot) const;
  float offset(int64_t slot) const;
};

// ``m`` (MLX's layout, ``m.bias`` copied when set) re-laid out as PackedMatrix, columns split over
// OpenMP's threads. The result owns its bytes: ``m``'s arrays are not needed by it afterwards.
PackedMatrix pack(const QMatrixView& m);

}  // namespace mlx_serving
