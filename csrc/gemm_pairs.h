// linear_pairs' inner kernel (csrc/gemm_cpu.cpp has the contract and the measurements): up to 6 bf16 rows
// against one group of 64 output columns of pack_pairs' layout with vdpbf16ps, each row's sums its own.
// Shared by linear_pairs and the fused experts step (csrc/moe_cpu.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>

#include "cpu_math.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define ENGINE_PAIRS 1
#endif

namespace pairs_kernel {

constexpr int64_t GROUP = 64;  // output columns of one packed line: four vectors of 16 float32 sums
constexpr int MAX_ROWS = 6;    // rows a pass: 6 x 4 sums + 4 weight vectors + 1 broadcast in 32 registers

#if defined(ENGINE_PAIRS)
// ROWS rows (their dim pairs at xp[kp * MAX_ROWS + m]) against one group of 64 columns. Meanwhile, one in
// `every` dim pairs, one line of the next group's weights at `ahead` is asked for: `ahead_lines` in all.
template <int ROWS, int HINT>
void group_rows(const uint32_t* xp, const uint32_t* wp, int64_t kpairs, const float* bias, c10::BFloat16* y,
                int64_t y_stride, const uint32_t* ahead, int64_t ahead_lines, int64_t every) {
  __m512 acc[ROWS][4];
  for (int m = 0; m < ROWS; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  int64_t next_kp = 0, issued = 0;
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    const uint32_t* line = wp + kp * GROUP;
    _mm_prefetch(reinterpret_cast<const char*>(line + 16 * GROUP), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(line + 16 * GROUP + 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(line + 16 * GROUP + 32), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(line + 16 * GROUP + 48), _MM_HINT_T0);
    if (kp == next_kp && issued < ahead_lines) {
      const char* next = reinterpret_cast<const char*>(ahead + issued * GROUP);
      for (int b = 0; b < 256; b += 64) _mm_prefetch(next + b, static_cast<_mm_hint>(HINT));
      ++issued;
      next_kp += every;
    }
    __m512bh w[4];
    for (int j = 0; j < 4; ++j) w[j] = as_bf16_pairs(_mm512_loadu_si512(line + 16 * j));
    for (int m = 0; m < ROWS; ++m) {
      const __m512bh x = as_bf16_pairs(_mm512_set1_epi32(static_cast<int32_t>(xp[kp * MAX_ROWS + m])));
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], w[j], x);
    }
  }
  for (int m = 0; m < ROWS; ++m)
    for (int j = 0; j < 4; ++j) {
      __m512 sum = acc[m][j];
      if (bias != nullptr) sum = _mm512_add_ps(sum, _mm512_loadu_ps(bias + 16 * j));
      const __m256bh half = _mm512_cvtneps_pbh(sum);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * y_stride + 16 * j),
                          reinterpret_cast<const __m256i&>(half));
    }
}

using GroupRows = void (*)(const uint32_t*, const uint32_t*, int64_t, const float*, c10::BFloat16*, int64_t,
                           const uint32_t*, int64_t, int64_t);
// By rows, and by where the next group's lines go: into L2 while a group takes a few passes, straight into
// L1 while it takes many (each pass then asks for a few lines only); measured both ways at 1-64 rows.
template <int HINT>
constexpr GroupRows GROUP_ROWS[MAX_ROWS + 1] = {nullptr,             group_rows<1, HINT>, group_rows<2, HINT>,
                                                group_rows<3, HINT>, group_rows<4, HINT>, group_rows<5, HINT>,
                                                group_rows<6, HINT>};
constexpr int64_t MANY_PASSES = 4;
// Below this many rows the passes after the first are too short to hide a read (7-8 rows were 3-4% slower
// with the next group asked for, 10-16 rows 10-17% faster).
constexpr int64_t AHEAD_ROWS = 10;
#endif

}  // namespace pairs_kernel
