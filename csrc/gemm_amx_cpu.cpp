// bf16 products on AMX tiles whose every output is the same sum at any row count: the batch-invariant
// products of a CPU with AMX.
// Reference: at::linear (worker/models/layers.py Linear).
//
// linear_amx(x [M, K] bf16, packed, bias [N] or empty) -> [M, N] bf16: x W^T (+ bias), W packed by
//   pack_pairs ([N / 64, K / 2, 64, 2], or viewed as [N / 64, K / 32, 16, 64, 2]; a B tile of 16 dim
//   pairs x 16 columns is 16 rows 256 bytes apart, read in place); K a multiple of 32. Each output starts from a zeroed tile and takes one tile product per 32 dims, in k
//   order, then the bias in float32, rounded to bf16 once. No split of K, no other blocking: a row's result
//   is the same bits whether it is alone or one of 256 (a tile row's sums never meet another row's).
//
// A unit is 32 rows (two A tiles) by 32 columns (two B tiles), four float32 tiles of sums: per 32 dims two
// A loads, two B loads and four tile products. Units run column-block-major, so that a thread streams its
// weights once and every row block meets them in cache. A last tile of fewer than 16 rows is copied into
// a zeroed 16-row buffer (a tile load reads 16 rows); a block of one tile skips the second. The first row
// block of a column block asks for its weights 4 steps ahead (they come from memory).
//
// SmolLM2's 121 products of a step against linear_pairs and oneDNN (Xeon Sapphire Rapids, 2 vCPUs,
// 2026-12-02, python -m benchmarks.cpu_kernels): 1 row 15.5 ms (pairs 14.6, oneDNN 25.6), 4 rows 14.9
// (15.6, 24.6), 16 rows 15.1 (35.3, 24.4), 64 rows 31.6 (138.7, 31.7), 256 rows 98.4 (524, 94.2). Units
// of a whole 64-column group at one tile of rows were 10-20% slower at 1-16 rows (the 9-group products
// split 5:4 over two threads).
#include "ops.h"
#include "amx.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t TILE = 16;        // rows a tile; columns a float32 tile
constexpr int64_t DIMS = 32;        // bf16 dims an A tile row holds (16 pairs)
constexpr int64_t GROUP = 64;       // columns of one pack_pairs line
constexpr int64_t BLOCK_COLS = 32;  // columns a unit: two B tiles
constexpr int64_t AHEAD_STEPS = 4;  // B lines asked for this many steps of 32 dims ahead (8 KB a unit)

#if defined(ENGINE_AMX)
// The float32 sums of one tile, plus the bias, rounded into `rows` rows of y.
void store_tile(const float* sums, int64_t rows, const float* bias, c10::BFloat16* y, int64_t y_stride) {
  const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m256bh half = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(sums + r * TILE), b));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * y_stride), reinterpret_cast<const __m256i&>(half));
  }
}

// One unit: A tiles at a0 (and a1 when two), `steps` steps of 32 dims; B tiles at w, 256 bytes a dim pair.
// Tiles: sums 0-3 (0, 1: rows of a0; 2, 3: rows of a1), A 4-5, B 6-7.
// ahead: ask for the B lines AHEAD_STEPS steps on (the first row block of a column block, whose weights
// come from memory; the others find them in cache).
void unit(const c10::BFloat16* a0, const c10::BFloat16* a1, int64_t a_stride, bool two, const uint32_t* w,
          int64_t steps, float* sums, bool ahead) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* b = w + s * (DIMS / 2) * GROUP;
    if (ahead) {
      const char* next = reinterpret_cast<const char*>(b + AHEAD_STEPS * (DIMS / 2) * GROUP);
      for (int line = 0; line < 16; ++line) {
        _mm_prefetch(next + 256 * line, _MM_HINT_T0);
        _mm_prefetch(next + 256 * line + 64, _MM_HINT_T0);
      }
    }
    _tile_loadd(4, a0 + s * DIMS, a_stride);
    _tile_loadd(6, b, GROUP * 4);
    _tile_loadd(7, b + TILE, GROUP * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a1 + s * DIMS, a_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, TILE * 4);
  _tile_stored(1, sums + TILE * TILE, TILE * 4);
  if (two) {
    _tile_stored(2, sums + 2 * TILE * TILE, TILE * 4);
    _tile_stored(3, sums + 3 * TILE * TILE, TILE * 4);
  }
}

#endif

}  // namespace

torch::Tensor linear_amx(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_amx takes 2-d bf16 rows");
  // pack_pairs' [N / 64, K / 2, 64, 2], or the same as [N / 64, K / 32, 16, 64, 2] (how decoder_layers
  // tells these products from linear_pairs')
  const int64_t d = packed.dim();
  TORCH_CHECK((d == 4 || d == 5) && packed.size(d - 2) == GROUP && packed.size(d - 1) == 2 && packed.is_contiguous(),
              "weight from pack_pairs");
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0) * GROUP;
  TORCH_CHECK((d == 4 ? packed.size(1) : packed.size(1) * packed.size(2)) * 2 == k, "linear_amx: in features differ");
  TORCH_CHECK(k % DIMS == 0, "linear_amx: in features a multiple of 32");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || bias.numel() == n, "linear_amx: bias size");
  auto y = torch::empty({rows, n}, x.options());
#if defined(ENGINE_AMX)
  TORCH_CHECK(amx_permitted(), "linear_amx: this CPU or kernel does not let the process use AMX");
  if (rows == 0) return y;
  const auto xc = x.contiguous();
  const torch::Tensor bias32 = has_bias ? bias.to(at::kFloat).contiguous() : torch::Tensor();
  const float* bias_data = has_bias ? bias32.data_ptr<float>() : nullptr;
  const auto* xs = xc.data_ptr<c10::BFloat16>();
  // The last tile's rows, zero below them, when fewer than 16.
  const int64_t full_tiles = rows / TILE, tail = rows % TILE, tiles = (rows + TILE - 1) / TILE;
  std::vector<c10::BFloat16> tail_rows(tail ? TILE * k : 0, c10::BFloat16(0.f));
  if (tail) std::memcpy(tail_rows.data(), xs + full_tiles * TILE * k, tail * k * sizeof(c10::BFloat16));
  auto tile_rows = [&](int64_t t) { return t < full_tiles ? xs + t * TILE * k : tail_rows.data(); };
  const int64_t blocks = (tiles + 1) / 2, col_blocks = n / BLOCK_COLS, kpairs = k / 2;
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
  auto* out = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, col_blocks * blocks, 1, [&](int64_t begin, int64_t end) {
    TileConfig config;
    _tile_loadconfig(&config);
    alignas(64) float sums[4 * TILE * TILE];
    for (int64_t u = begin; u < end; ++u) {
      const int64_t c = u / blocks, rb = u % blocks, t0 = 2 * rb;
      const bool two = t0 + 1 < tiles;
      const int64_t col = c * BLOCK_COLS, g = col / GROUP;
      const uint32_t* w = wp + g * kpairs * GROUP + col % GROUP;
      unit(tile_rows(t0), two ? tile_rows(t0 + 1) : nullptr, k * 2, two, w, k / DIMS, sums, rb == 0);
      for (int64_t t = 0; t < (two ? 2 : 1); ++t) {
        const int64_t first = (t0 + t) * TILE, valid = std::min(TILE, rows - first);
        for (int64_t j = 0; j < 2; ++j)
          store_tile(sums + (2 * t + j) * TILE * TILE, valid,
                     bias_data != nullptr ? bias_data + col + j * TILE : nullptr, out + first * n + col + j * TILE,
                     n);
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "linear_amx needs a build with AMX (and a CPU with it)");
#endif
  return y;
}
