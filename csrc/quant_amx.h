// bf16 rows on packed blocks with AMX tiles: quant_bf16.h's factored product, its dim-pair sums taken by
// tdpbf16ps (csrc/quant_cpu.cpp has the contract).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "amx.h"
#include "quant_bf16.h"

namespace quant_kernel {

#if defined(ENGINE_AMX) && defined(ENGINE_QUANT_BF16)
// Per group of 16 columns and sub-block, the stored integers of the sub-block's dim pairs (pair_ints: exact in
// bf16) are written once as B tiles of up to 16 dim pairs; each pass of up to 16 rows loads its x as an A tile
// and sums the sub-block in one tile of float32 (one tile product per 32 dims, in k order), and then, as the
// AVX-512 form does, acc = fma(scale, sums, acc) and acc = fma(offset', xsum, acc). The same steps for a row
// at every row count (a tile row's sums never meet another row's): batch-invariant. tdpbf16ps does not add a
// pair's two products as vdpbf16ps does, so a CPU with AMX takes this form at every row count.
#define ENGINE_QUANT_AMX 1
constexpr int64_t AMX_ROWS = 16;  // rows a pass: one A tile

// Tiles: 0 and 3 the sums (rows x 16 float32), 1 and 4 A (rows x dims bf16), 2 and 5 B (dims / 2 pairs x 16
// columns).
struct alignas(64) QuantTiles {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  QuantTiles(int64_t m, int64_t dims) {
    colsb[0] = 64, rows[0] = static_cast<uint8_t>(m);
    colsb[1] = static_cast<uint16_t>(dims * 2), rows[1] = static_cast<uint8_t>(m);
    colsb[2] = 64, rows[2] = static_cast<uint8_t>(dims / 2);
    colsb[3] = 64, rows[3] = static_cast<uint8_t>(m);
    colsb[4] = colsb[1], rows[4] = rows[1];
    colsb[5] = colsb[2], rows[5] = rows[2];
  }
};

template <int64_t T>
void run_amx(const c10::BFloat16* x, int64_t rows, int64_t k, const uint8_t* w, const Traits& t, const float* bias,
             c10::BFloat16* out, int64_t n, int64_t ldy) {
  const int64_t groups = n / COLS, group_bytes = (k / t.block) * t.record, subs = k / t.sub;
  const int64_t per_block = t.block / t.sub, dims = std::min<int64_t>(t.sub, 32), chunks = t.sub / dims;
  const std::vector<float> xsum = sub_block_sums(x, rows, k, t.sub);
  const int64_t passes = (rows + AMX_ROWS - 1) / AMX_ROWS;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint32_t b[2][4 * 16 * COLS];  // a sub-block's B tiles (up to 128 dims), two sub-blocks in turn
    alignas(64) float sums[AMX_ROWS * COLS];
    std::vector<float> acc(rows * COLS);
    int64_t configured = -1;
    // acc += the sums of tile `tile` (rows r0 .. r0 + m of sub-block si) times its scale, plus offset' * xsum
    const auto epilogue = [&](int tile, int64_t si, int64_t r0, int64_t m, const __m512& s, const __m512& o) {
      if (tile == 0)
        _tile_stored(0, sums, COLS * 4);
      else
        _tile_stored(3, sums, COLS * 4);
      for (int64_t r = 0; r < m; ++r) {
        float* a = acc.data() + (r0 + r) * COLS;
        __m512 v = _mm512_fmadd_ps(s, _mm512_load_ps(sums + r * COLS), _mm512_loadu_ps(a));
        v = _mm512_fmadd_ps(o, _mm512_set1_ps(xsum[(r0 + r) * subs + si]), v);
        _mm512_storeu_ps(a, v);
      }
    };
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = w + g * group_bytes;
      std::fill(acc.begin(), acc.end(), 0.0f);
      __m512 scale[2], offset[2];  // sub-blocks j's at j & 1 (one pass: j is read back two steps after it is built)
      const auto build = [&](int64_t si) {
        const int64_t record = (si / per_block) * t.record, first = (si % per_block) * t.sub;
        uint32_t* bs = b[si & 1];
        for (int64_t p = 0; p < t.sub / 2; ++p)
          _mm512_store_si512(bs + p * COLS, pair_ints<T>(group + record, t, first + 2 * p));
        scales_of<T>(group + record, t, si % per_block, scale[si & 1], offset[si & 1]);
        offset[si & 1] = shifted_offset<T>(scale[si & 1], offset[si & 1]);
      };
      if (passes == 1) {
        // One pass of rows (decode), in a pipeline: step j builds sub-block j's B tiles, issues j - 1's tile
        // products (its B tiles written a step before) and reads back j - 2's sums (tiles 0 and 3 in turn,
        // A and B in tiles 1, 2 or 4, 5), so that the tiles work while the integers are unpacked.
        if (configured < 0) {
          const QuantTiles tiles(rows, dims);
          _tile_loadconfig(&tiles);
          configured = rows;
        }
        for (int64_t j = 0; j < subs + 2; ++j) {
          if (j >= 2) epilogue(j & 1 ? 3 : 0, j - 2, 0, rows, scale[j & 1], offset[j & 1]);
          if (j >= 1 && j <= subs) {
            const int64_t si = j - 1;
            const uint32_t* bs = b[si & 1];
            for (int64_t c = 0; c < chunks; ++c) {
              if (si & 1) {
                if (c == 0) _tile_zero(3);
                _tile_loadd(4, x + si * t.sub + c * dims, k * 2);
                _tile_loadd(5, bs + c * (dims / 2) * COLS, COLS * 4);
                _tile_dpbf16ps(3, 4, 5);
              } else {
                if (c == 0) _tile_zero(0);
                _tile_loadd(1, x + si * t.sub + c * dims, k * 2);
                _tile_loadd(2, bs + c * (dims / 2) * COLS, COLS * 4);
                _tile_dpbf16ps(0, 1, 2);
              }
            }
          }
          if (j < subs) build(j);
        }
      } else {
        for (int64_t si = 0; si < subs; ++si) {
          build(si);
          for (int64_t pass = 0; pass < passes; ++pass) {
            const int64_t r0 = pass * AMX_ROWS, m = std::min(AMX_ROWS, rows - r0);
            if (m != configured) {
              const QuantTiles tiles(m, dims);
              _tile_loadconfig(&tiles);
              configured = m;
            }
            _tile_zero(0);
            for (int64_t c = 0; c < chunks; ++c) {
              _tile_loadd(1, x + r0 * k + si * t.sub + c * dims, k * 2);
              _tile_loadd(2, b[si & 1] + c * (dims / 2) * COLS, COLS * 4);
              _tile_dpbf16ps(0, 1, 2);
            }
            epilogue(0, si, r0, m, scale[si & 1], offset[si & 1]);
          }
        }
      }
      const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias + g * COLS) : _mm512_setzero_ps();
      for (int64_t r = 0; r < rows; ++r) {
        __m512 sum = _mm512_loadu_ps(acc.data() + r * COLS);
        if (bias != nullptr) sum = _mm512_add_ps(sum, bv);
        const __m256bh half = _mm512_cvtneps_pbh(sum);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldy + g * COLS),
                            reinterpret_cast<const __m256i&>(half));
      }
    }
    if (configured >= 0) _tile_release();
  });
}
#endif

}  // namespace quant_kernel
