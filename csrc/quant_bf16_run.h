// bf16 rows on packed GGUF blocks with AVX-512 BF16, all the rows of a product: the passes of quant_bf16.h over
// the groups, and from TILE_MIN_ROWS rows on the tiles (csrc/quant_cpu.cpp has the contract).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "quant_bf16.h"

namespace quant_kernel {

#if defined(ENGINE_QUANT_BF16)
// Many rows (a prefill): four groups' integers are widened once, all K of them, into bf16 pairs beside their
// scales, and passes of 6 rows run over them as linear_pairs' kernel does (6 rows x 64 columns of sums in
// registers, csrc/gemm_pairs.h), the weights read from L2. Per row the steps of factored_pass in its order: the
// same bits at every row count.
// From 64 rows on (at 48 and 64 the two forms were level; at 512 and 1,600 rows this one took 0.78-0.85x the
// time; 16 or 32 rows in passes of 4 took 1.2-1.3x): benchmarks/results/2026-12-07-lab-notes-quant-tiles-zen4.md.
constexpr int TILE_ROWS = 6, TILE_GROUPS = 4;
constexpr int64_t TILE_MIN_ROWS = 64;

// The groups' dim pairs (pair kp of group j at kp * 4 + j) and, per sub-block si and group j, scale and offset'
// at (si * 4 + j) * 2 and + 1.
template <int64_t T>
void widen_groups(const uint8_t* group, int64_t group_bytes, int64_t k, const Traits& t, __m512i* pairs,
                  __m512* scales) {
  const int64_t per_block = t.block / t.sub, subs = k / t.sub, npairs = t.sub / 2;
  for (int64_t si = 0; si < subs; ++si)
    for (int j = 0; j < TILE_GROUPS; ++j) {
      const uint8_t* record = group + j * group_bytes + (si / per_block) * t.record;
      const int64_t first = (si % per_block) * t.sub;
      for (int64_t d = 0; d < npairs; ++d)
        _mm512_store_si512(pairs + (si * npairs + d) * TILE_GROUPS + j, pair_ints<T>(record, t, first + 2 * d));
      __m512 sc, off;
      scales_of<T>(record, t, si % per_block, sc, off);
      scales[(si * TILE_GROUPS + j) * 2] = sc;
      scales[(si * TILE_GROUPS + j) * 2 + 1] = shifted_offset<T>(sc, off);
    }
}

// 6 rows (pair kp of row m at xp[kp * 6 + m], sum si at xsum[si * 6 + m]) against the widened groups.
[[gnu::noinline]] inline void tile_pass(const uint32_t* xp, const float* xsum, const __m512i* pairs,
                                        const __m512* scales, int64_t subs, int64_t npairs, const float* bias,
                                        c10::BFloat16* y, int64_t ldy) {
  alignas(64) float acc[TILE_ROWS][TILE_GROUPS][16] = {};
  for (int64_t si = 0; si < subs; ++si) {
    __m512 part[TILE_ROWS][TILE_GROUPS];
    for (int m = 0; m < TILE_ROWS; ++m)
      for (int j = 0; j < TILE_GROUPS; ++j) part[m][j] = _mm512_setzero_ps();
    for (int64_t kp = si * npairs; kp < (si + 1) * npairs; ++kp) {
      __m512bh w[TILE_GROUPS];
      for (int j = 0; j < TILE_GROUPS; ++j) w[j] = as_bf16_pairs(_mm512_load_si512(pairs + kp * TILE_GROUPS + j));
      for (int m = 0; m < TILE_ROWS; ++m) {
        const __m512bh xb = as_bf16_pairs(_mm512_set1_epi32(static_cast<int32_t>(xp[kp * TILE_ROWS + m])));
        for (int j = 0; j < TILE_GROUPS; ++j) part[m][j] = _mm512_dpbf16_ps(part[m][j], w[j], xb);
      }
    }
    for (int j = 0; j < TILE_GROUPS; ++j) {
      const __m512 sc = scales[(si * TILE_GROUPS + j) * 2], off = scales[(si * TILE_GROUPS + j) * 2 + 1];
      for (int m = 0; m < TILE_ROWS; ++m) add_sub_block(acc[m][j], sc, off, part[m][j], xsum[si * TILE_ROWS + m]);
    }
  }
  for (int m = 0; m < TILE_ROWS; ++m)
    for (int j = 0; j < TILE_GROUPS; ++j)
      store_sums(acc[m][j], bias != nullptr ? bias + j * 16 : nullptr, y + m * ldy + j * 16);
}

// The rows' dim pairs and sub-block sums a pass at a time: the pass of rows r to r + R - 1 holds row m's pair kp at
// r * K / 2 + kp * R + m and its sum si at r * subs + si * R + m, so that a pass's broadcasts lie at fixed offsets
// from one pointer. `width` gives a pass's rows from row r on.
struct PassRows {
  std::vector<uint32_t> pairs;
  std::vector<float> sums;
};

template <typename Width>
PassRows pass_rows(const uint32_t* xp, const float* xsum, int64_t rows, int64_t kpairs, int64_t subs, Width width) {
  PassRows out{std::vector<uint32_t>(rows * kpairs), std::vector<float>(rows * subs)};
  for (int64_t r = 0; r < rows;) {
    const int64_t w = width(rows, r);
    for (int64_t m = 0; m < w; ++m) {
      for (int64_t kp = 0; kp < kpairs; ++kp) out.pairs[r * kpairs + kp * w + m] = xp[(r + m) * kpairs + kp];
      for (int64_t si = 0; si < subs; ++si) out.sums[r * subs + si * w + m] = xsum[(r + m) * subs + si];
    }
    r += w;
  }
  return out;
}

// Rows [first, first + rows) against the groups [g0, groups) by factored passes, the groups over the threads.
template <int64_t T>
void run_factored(const uint32_t* xp, const float* xsum, int64_t first, int64_t rows, int64_t k, const uint8_t* w,
                  const Traits& t, const float* bias, c10::BFloat16* out, int64_t g0, int64_t groups, int64_t ldy) {
  if (rows <= 0 || g0 >= groups) return;
  const int64_t kpairs = k / 2, subs = k / t.sub, group_bytes = (k / t.block) * t.record;
  const PassRows passes = pass_rows(xp + first * kpairs, xsum + first * subs, rows, kpairs, subs, pass_width);
  at::parallel_for(g0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      factored_passes<T>(passes.pairs.data(), passes.sums.data(), rows, k, w + g * group_bytes, t,
                         bias != nullptr ? bias + g * COLS : nullptr, out + first * ldy + g * COLS, ldy);
  });
}

// Each group's integers are widened once a pass: passes of 16 rows widen them half as often as passes of 8 did
// (a Qwen2.5-0.5B Q4_K_M decode step at 16 rows, one thread: 3-10% faster). From TILE_MIN_ROWS rows on, groups
// of four are widened once for all the rows (tile_pass); the rows and groups past whole passes and quads take
// the factored passes.
template <int64_t T>
void run_pairs(const c10::BFloat16* x, int64_t rows, int64_t k, const uint8_t* w, const Traits& t, const float* bias,
               c10::BFloat16* out, int64_t n, int64_t ldy) {
  const int64_t groups = n / COLS, kpairs = k / 2, subs = k / t.sub;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);
  const std::vector<float> xsum = sub_block_sums(x, rows, k, t.sub);
  if (rows < TILE_MIN_ROWS || groups < TILE_GROUPS) {
    run_factored<T>(xp, xsum.data(), 0, rows, k, w, t, bias, out, 0, groups, ldy);
    return;
  }
  const int64_t tiled_rows = rows / TILE_ROWS * TILE_ROWS, quads = groups / TILE_GROUPS;
  const int64_t group_bytes = (k / t.block) * t.record;
  const PassRows passes = pass_rows(xp, xsum.data(), tiled_rows, kpairs, subs,
                                    [](int64_t, int64_t) { return int64_t{TILE_ROWS}; });
  at::parallel_for(0, quads, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> pairs(kpairs * TILE_GROUPS);
    std::vector<__m512> scales(subs * TILE_GROUPS * 2);
    for (int64_t q = begin; q < end; ++q) {
      const int64_t g = q * TILE_GROUPS;
      widen_groups<T>(w + g * group_bytes, group_bytes, k, t, pairs.data(), scales.data());
      for (int64_t r = 0; r < tiled_rows; r += TILE_ROWS)
        tile_pass(passes.pairs.data() + r * kpairs, passes.sums.data() + r * subs, pairs.data(), scales.data(), subs,
                  t.sub / 2, bias != nullptr ? bias + g * COLS : nullptr, out + r * ldy + g * COLS, ldy);
    }
  });
  run_factored<T>(xp, xsum.data(), 0, tiled_rows, k, w, t, bias, out, quads * TILE_GROUPS, groups, ldy);
  run_factored<T>(xp, xsum.data(), tiled_rows, rows - tiled_rows, k, w, t, bias, out, 0, groups, ldy);
}
#endif

}  // namespace quant_kernel
