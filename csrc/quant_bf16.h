// bf16 rows on packed GGUF blocks with AVX-512 BF16 (csrc/quant_cpu.cpp has the contract).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "cpu_math.h"
#include "quant_blocks.h"

namespace quant_kernel {

#if defined(ENGINE_QUANT_AVX512) && defined(__AVX512BF16__) && defined(__BMI2__)
// bf16 rows on AVX-512 BF16: the scale factored out of each sub-block. A sub-block's sums of x times the stored
// integers go a dim pair at a time through vdpbf16ps (the integers are exact in bf16, x is bf16 already), and
// then y += scale * sums + offset' * (the sub-block's sum of x). The weights are never rounded to bf16 (the
// dequantized bf16 model rounds them), and a weight costs a few integer operations, not a conversion and an
// FMA. The same steps in the same order at every row count: batch-invariant, within float32 rounding of the
// float64 product before the output's rounding to bf16 (tests/test_kernels_quant.py).
// Nibble types store q + 128, whose bf16 bits are 0x4300 | q (128 + q has the exponent of 128 and q in the 7
// mantissa bits, q < 128), so offset' = offset - 128 scale; the 8-bit types convert their int8 values.
#define ENGINE_QUANT_BF16 1
constexpr int BF16_ROWS = 8;   // rows a pass, up to 16 rows
constexpr int WIDE_ROWS = 16;  // rows a pass while 16 are left

#if defined(__AVX512VBMI__)
// vpmultishiftqb's bit offsets for Q6_K's top bits: lane c (qword c / 2, bytes 4 (c % 2) on) byte 0 at 2c,
// byte 2 at 32 + 2c (the other bytes are masked off after)
inline __m512i q6_shifts() {
  alignas(64) static constexpr uint8_t offsets[64] = {
      0,  0, 32, 0, 2,  0, 34, 0, 4,  0, 36, 0, 6,  0, 38, 0, 8,  0, 40, 0, 10, 0, 42, 0, 12, 0, 44, 0, 14, 0, 46, 0,
      16, 0, 48, 0, 18, 0, 50, 0, 20, 0, 52, 0, 22, 0, 54, 0, 24, 0, 56, 0, 26, 0, 58, 0, 28, 0, 60, 0, 30, 0, 62, 0};
  return _mm512_load_si512(offsets);
}
#endif

// vpshufb's index for the nibble types: in every 128-bit lane (rows 4L to 4L + 3), byte c of the 16 to bytes 0
// and 2 of lane c (bytes 1 and 3 zero)
inline __m512i nibble_spread() {
  alignas(64) static constexpr uint8_t index[64] = {
      0,  128, 0,  128, 1,  128, 1,  128, 2,  128, 2,  128, 3,  128, 3,  128, 4,  128, 4,  128, 5,  128,
      5,  128, 6,  128, 6,  128, 7,  128, 7,  128, 8,  128, 8,  128, 9,  128, 9,  128, 10, 128, 10, 128,
      11, 128, 11, 128, 12, 128, 12, 128, 13, 128, 13, 128, 14, 128, 14, 128, 15, 128, 15, 128};
  return _mm512_load_si512(index);
}

// The 16 rows' stored integers at dims k and k + 1 (k even) as bf16 pairs: lane c holds (q[k][c], q[k + 1][c]).
template <int64_t T>
inline __m512i pair_ints(const uint8_t* rec, const Traits& t, int64_t k) {
  if constexpr (eight_bit(T)) {  // rows 0-7's (dim k, dim k + 1) bytes, then rows 8-15's: already in pair order
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.low + k * 16));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.low + k * 16 + 16));
    const __m512bh both =
        _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)));
    __m512i bits;
    std::memcpy(&bits, &both, sizeof bits);
    return bits;
  } else {
    if constexpr (T == MXFP4) {  // each code through the table, then (dim k, dim k + 1) into lane c's halves
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.low + k * 8));
      const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(MXFP4_Q)), nibble = _mm_set1_epi8(15);
      const __m512i lo = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(lut, _mm_and_si128(v, nibble)));
      const __m512i hi = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(v, 4), nibble)));
      return _mm512_or_si512(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)), _mm512_set1_epi32(0x43004300));
    }
    // byte c: row c's dim k (low nibble) and dim k + 1 (high). The 16 bytes in every 128-bit lane; byte c to
    // bytes 0 and 2 of lane c (vpshufb), the high word shifted down 4 (vpsrlvw), then (q & 0x000F000F) |
    // 0x43004300 (one vpternlogd): three vector operations (the 16 rows' widening to dwords took five)
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.low + k * 8));
    const __m512i spread =
        _mm512_srlv_epi16(_mm512_shuffle_epi8(_mm512_broadcast_i32x4(v), nibble_spread()), _mm512_set1_epi32(4 << 16));
    __m512i q = _mm512_ternarylogic_epi32(spread, _mm512_set1_epi32(0x000F000F), _mm512_set1_epi32(0x43004300), 0xEA);
    if constexpr (high_one(T)) {
      uint32_t bits;  // dim k's 16 fifth bits, then dim k + 1's: row c's two at word bits 2c and 2c + 1, then
      std::memcpy(&bits, rec + t.high + k * 2, 4);  // 16 added to those words (bit 4 is clear: an or)
      const uint32_t words = _pdep_u32(bits & 0xFFFF, 0x55555555u) | _pdep_u32(bits >> 16, 0xAAAAAAAAu);
      q = _mm512_mask_add_epi16(q, static_cast<__mmask32>(words), q, _mm512_set1_epi16(16));
    } else if constexpr (T == Q6_K) {
#if defined(__AVX512VBMI__)
      // dims k and k + 1's words (row c's top two bits at 2c, 2c + 1) in one qword, copied to every qword: each
      // lane's byte 0 takes the 8 bits from 2c of dim k's word, its byte 2 from 32 + 2c (dim k + 1's)
      uint64_t both;
      std::memcpy(&both, rec + t.high + k * 4, 8);
      const __m512i top = _mm512_multishift_epi64_epi8(q6_shifts(), _mm512_set1_epi64(static_cast<int64_t>(both)));
      q = _mm512_ternarylogic_epi32(q, _mm512_slli_epi32(top, 4), _mm512_set1_epi32(0x00300030), 0xF8);
#else
      uint32_t bits[2];  // dims k and k + 1: row c's top two bits at 2c, 2c + 1
      std::memcpy(bits, rec + t.high + k * 4, 8);
      q = _mm512_mask_or_epi32(q, static_cast<__mmask16>(_pext_u32(bits[0], 0x55555555u)), q, _mm512_set1_epi32(16));
      q = _mm512_mask_or_epi32(q, static_cast<__mmask16>(_pext_u32(bits[0], 0xAAAAAAAAu)), q, _mm512_set1_epi32(32));
      q = _mm512_mask_or_epi32(q, static_cast<__mmask16>(_pext_u32(bits[1], 0x55555555u)), q,
                               _mm512_set1_epi32(16 << 16));
      q = _mm512_mask_or_epi32(q, static_cast<__mmask16>(_pext_u32(bits[1], 0xAAAAAAAAu)), q,
                               _mm512_set1_epi32(32 << 16));
#endif
    }
    return q;
  }
}

template <int64_t T>
inline __m512 shifted_offset(const __m512& s, const __m512& o) {
  if constexpr (eight_bit(T)) return o;
  return _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), s, o);  // o - 128 s, one rounding
}

// The steps after a sub-block's sums, one row's 16 columns (factored_pass and tile_pass both take them, so the
// two forms give the same bits): acc = fma(scale, sums, acc), then acc = fma(offset', xsum, acc).
[[gnu::always_inline]] inline void add_sub_block(float* acc, const __m512& s, const __m512& o, const __m512& part,
                                                 float xsum) {
  const __m512 a = _mm512_fmadd_ps(s, part, _mm512_load_ps(acc));
  _mm512_store_ps(acc, _mm512_fmadd_ps(o, _mm512_set1_ps(xsum), a));
}

// A row's 16 sums, plus the bias, rounded once to bf16.
[[gnu::always_inline]] inline void store_sums(const float* acc, const float* bias, c10::BFloat16* y) {
  __m512 sum = _mm512_load_ps(acc);
  if (bias != nullptr) sum = _mm512_add_ps(sum, _mm512_loadu_ps(bias));
  const __m256bh half = _mm512_cvtneps_pbh(sum);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), reinterpret_cast<const __m256i&>(half));
}

// ROWS rows (a pass) against one group of 16 columns: xp the pass's dim pairs (pair kp of row m at kp * ROWS + m),
// xsum its sub-blocks' sums (si * ROWS + m). Per row and column, each sub-block's dot products run from 0 in
// dim-pair order, then acc = fma(scale, sums, acc) and acc = fma(offset', xsum, acc): the same steps at every
// ROWS (a row's bits never depend on the others). acc lives in L1 (it changes once a sub-block).
template <int ROWS, int64_t T>
void factored_pass(const uint32_t* xp, const float* xsum, int64_t k, const uint8_t* group, const Traits& t,
                   const float* bias, c10::BFloat16* y, int64_t ldy) {
  const int64_t per_block = t.block / t.sub, subs = k / t.sub;
  alignas(64) float acc[ROWS][16] = {};
  for (int64_t si = 0; si < subs; ++si) {
    const uint8_t* record = group + (si / per_block) * t.record;
    const int64_t first = (si % per_block) * t.sub;  // within the record
    if constexpr (split_high(T)) prefetch_sub(group, t, T, si + PREFETCH_SUBS, subs);
    __m512 part[ROWS];
    for (int m = 0; m < ROWS; ++m) part[m] = _mm512_setzero_ps();
    for (int64_t d = 0; d < t.sub; d += 2) {
      const int64_t kp = (si * t.sub + d) / 2;
      const __m512bh w = as_bf16_pairs(pair_ints<T>(record, t, first + d));
      for (int m = 0; m < ROWS; ++m) {
        const __m512bh xb = as_bf16_pairs(_mm512_set1_epi32(static_cast<int32_t>(xp[kp * ROWS + m])));
        part[m] = _mm512_dpbf16_ps(part[m], w, xb);
      }
    }
    __m512 s, o;
    scales_of<T>(record, t, si % per_block, s, o);
    o = shifted_offset<T>(s, o);
    for (int m = 0; m < ROWS; ++m) add_sub_block(acc[m], s, o, part[m], xsum[si * ROWS + m]);
  }
  for (int m = 0; m < ROWS; ++m) store_sums(acc[m], bias, y + m * ldy);
}

// The rows a pass takes from row r on: WIDE_ROWS while that many are left, then up to BF16_ROWS.
inline int64_t pass_width(int64_t rows, int64_t r) {
  return rows - r >= WIDE_ROWS ? WIDE_ROWS : std::min<int64_t>(BF16_ROWS, rows - r);
}

// All the rows against one group, pass by pass (xp and xsum as pass_rows lays them out).
template <int64_t T>
void factored_passes(const uint32_t* xp, const float* xsum, int64_t rows, int64_t k, const uint8_t* group,
                     const Traits& t, const float* bias, c10::BFloat16* y, int64_t ldy) {
  const int64_t kpairs = k / 2, subs = k / t.sub;
  for (int64_t r = 0; r < rows;) {
    const int64_t width = pass_width(rows, r);
    const uint32_t* xr = xp + r * kpairs;
    const float* sr = xsum + r * subs;
    c10::BFloat16* yr = y + r * ldy;
#define ENGINE_PASS(R) \
  case R: factored_pass<R, T>(xr, sr, k, group, t, bias, yr, ldy); break;
    switch (width) {
      ENGINE_PASS(1) ENGINE_PASS(2) ENGINE_PASS(3) ENGINE_PASS(4) ENGINE_PASS(5) ENGINE_PASS(6) ENGINE_PASS(7)
      ENGINE_PASS(BF16_ROWS)
      default: factored_pass<WIDE_ROWS, T>(xr, sr, k, group, t, bias, yr, ldy); break;
    }
#undef ENGINE_PASS
    r += width;
  }
}

// Each row's sums of x over the sub-blocks of `sub` dims, in k order: row m's at m * K / sub (the offsets'
// factor in the factored forms).
inline std::vector<float> sub_block_sums(const c10::BFloat16* x, int64_t rows, int64_t k, int64_t sub) {
  const int64_t subs = k / sub;
  std::vector<float> xsum(rows * subs);
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t si = 0; si < subs; ++si) {
      float sum = 0.0f;
      for (int64_t d = 0; d < sub; ++d) sum += static_cast<float>(x[m * k + si * sub + d]);
      xsum[m * subs + si] = sum;
    }
  return xsum;
}

#endif

}  // namespace quant_kernel
