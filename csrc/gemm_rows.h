// The batch-invariant product's inner kernel (csrc/gemm_rows_cpu.cpp has the contract and the reasons):
// up to 6 float32 rows against one group of 16 output columns of pack_rows' layout, each output one chain
// of FMAs in k order. Shared by linear_rows and the fused experts step (csrc/moe_cpu.cpp).
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ENGINE_ROWS_AVX2 1
#endif

namespace rows_kernel {


constexpr int64_t COLS = 16;   // output columns of a group
constexpr int MAX_ROWS = 6;    // rows of a pass

inline float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// Weights of one input dim (16 columns) as float32 vectors.
#if defined(ENGINE_ROWS_AVX2)
template <typename W>
inline void load_cols(const W* w, __m256& lo, __m256& hi);
template <>
inline void load_cols<float>(const float* w, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}
template <>
inline void load_cols<c10::BFloat16>(const c10::BFloat16* w, __m256& lo, __m256& hi) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(bits)), 16));
  hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(bits, 1)), 16));
}

// ROWS rows (float32, row stride k) against one group: sums[m][c] for c < 16. NOTE: the accumulators are
// named variables, not an array: GCC kept an array's copy on the stack, 12 stores a step (40 GFLOPS on two
// threads against 90+ this way, AMD EPYC AVX2, 2026-12-01).
template <int ROWS, typename W>
void group_pass(const float* x, int64_t k, const W* w, float* sums) {
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0, b4 = a0,
         a5 = a0, b5 = a0;
  for (int64_t d = 0; d < k; ++d) {
    __m256 lo, hi;
    load_cols<W>(w + d * COLS, lo, hi);
#define ENGINE_ROW(m)                                                    \
  if constexpr (ROWS > m) {                                              \
    const __m256 xv = _mm256_broadcast_ss(x + m * k + d);                \
    a##m = _mm256_fmadd_ps(xv, lo, a##m);                                \
    b##m = _mm256_fmadd_ps(xv, hi, b##m);                                \
  }
    ENGINE_ROW(0) ENGINE_ROW(1) ENGINE_ROW(2) ENGINE_ROW(3) ENGINE_ROW(4) ENGINE_ROW(5)
#undef ENGINE_ROW
  }
  const __m256 los[6] = {a0, a1, a2, a3, a4, a5}, his[6] = {b0, b1, b2, b3, b4, b5};
  for (int m = 0; m < ROWS; ++m) {
    _mm256_storeu_ps(sums + m * COLS, los[m]);
    _mm256_storeu_ps(sums + m * COLS + 8, his[m]);
  }
}
#else
template <typename W>
inline float weight_of(const W* w, int64_t i);
template <>
inline float weight_of<float>(const float* w, int64_t i) {
  return w[i];
}
template <>
inline float weight_of<c10::BFloat16>(const c10::BFloat16* w, int64_t i) {
  return bf16_to_float(reinterpret_cast<const uint16_t*>(w)[i]);
}

template <int ROWS, typename W>
void group_pass(const float* x, int64_t k, const W* w, float* sums) {
  float acc[ROWS][COLS] = {};
  for (int64_t d = 0; d < k; ++d)
    for (int m = 0; m < ROWS; ++m)
      for (int64_t c = 0; c < COLS; ++c) acc[m][c] = std::fma(x[m * k + d], weight_of<W>(w, d * COLS + c), acc[m][c]);
  for (int m = 0; m < ROWS; ++m) std::memcpy(sums + m * COLS, acc[m], sizeof(acc[m]));
}
#endif

template <typename W>
using GroupPass = void (*)(const float*, int64_t, const W*, float*);
template <typename W>
constexpr GroupPass<W> GROUP_PASS[MAX_ROWS + 1] = {nullptr,           group_pass<1, W>, group_pass<2, W>,
                                                   group_pass<3, W>, group_pass<4, W>, group_pass<5, W>,
                                                   group_pass<6, W>};

}  // namespace rows_kernel
