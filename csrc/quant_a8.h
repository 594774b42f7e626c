// Int8 activations on packed blocks (csrc/quant_a8.cpp has the contract): each type's integer offset and
// segment, a block of x quantized, and a group's stored integers widened to bytes in vpdpbusd's order.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"

namespace quant_kernel {

constexpr int64_t A8_BIT = 256;  // on a part's type: the product takes int8 activations
constexpr int A8_ROWS = 8;       // rows a pass

// Row m's quantized blocks: q [M][K], d [M][K / 32], the sums of q per 16 dims [M][K / 16].
struct A8Rows {
  int64_t rows, k;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum16;
};

// The integer c with offset = c * scale (0: the type's offsets are floats of their own, or there are none).
constexpr int32_t int_offset(int64_t t) {
  return t == Q4_0 ? -8 : t == Q5_0 ? -16 : t == Q6_K ? -32 : t == MXFP4 ? -12 : eight_bit(t) ? -128 : 0;
}
constexpr bool free_offset(int64_t t) {
  return t == Q4_1 || t == Q5_1 || sub_mins(t) || float_scales(t);
}
// Dims a segment: the sub-block where it is 16 (Q2_K, Q6_K), else 32 (an activation block).
constexpr int64_t segment_of(int64_t t) { return t == Q2_K || t == Q6_K ? 16 : 32; }

#if defined(ENGINE_QUANT_AVX512) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define ENGINE_A8_VNNI 1
#endif

// 32 values to int8: returns d; q[i] = round-half-even(x[i] * (127 / max |x|)). reference: one at a time (the
// vector forms give the same bytes: the maximum is exact in any order, and vpmovsdb and vpackss saturate as the
// clamp does).
inline float quantize_block(const float* x, int8_t* q, bool reference) {
  if (!reference) {
#if defined(ENGINE_QUANT_AVX512)
    const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
    const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 f = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, f))));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, f))));
    return top / 127.0f;
#elif defined(ENGINE_ROWS_AVX2)
    __m256 v[4], top8 = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(x + 8 * i);
      top8 = _mm256_max_ps(top8, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v[i]));
    }
    __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(top8), _mm256_extractf128_ps(top8, 1));
    top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
    const float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
    const __m256 f = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    __m256i i32[4];
    for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], f));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),  // (vpackss interleaves the lanes' dwords)
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    return top / 127.0f;
#endif
  }
  float top = 0.0f;
  for (int i = 0; i < 32; ++i) top = std::max(top, std::fabs(x[i]));
  const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
  for (int i = 0; i < 32; ++i) q[i] = static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, std::nearbyint(x[i] * inverse))));
  return top / 127.0f;
}

// Per pass of up to `width` rows, row and segment: P's start (c X), d, and d * float(X). The pass of rows r ..
// r + w - 1 holds row m's at r * (K / seg) + s * w + m (the vector forms' broadcasts at fixed offsets).
struct PassSegments {
  std::vector<int32_t> start;
  std::vector<float> d, dx;
};

inline PassSegments pass_segments(const A8Rows& a, int64_t seg, int32_t c, int64_t width) {
  const int64_t segs = a.k / seg, per = seg / 16;
  PassSegments out{std::vector<int32_t>(a.rows * segs), std::vector<float>(a.rows * segs), std::vector<float>(a.rows * segs)};
  for (int64_t r = 0; r < a.rows; r += width) {
    const int64_t w = std::min(width, a.rows - r);
    for (int64_t m = 0; m < w; ++m)
      for (int64_t s = 0; s < segs; ++s) {
        int32_t x_sum = 0;
        for (int64_t h = 0; h < per; ++h) x_sum += a.sum16[(r + m) * (a.k / 16) + s * per + h];
        const float d = a.d[(r + m) * (a.k / 32) + s * seg / 32];
        const int64_t at = r * segs + s * w + m;
        out.start[at] = c * x_sum, out.d[at] = d, out.dx[at] = d * static_cast<float>(x_sum);
      }
  }
  return out;
}

#if defined(ENGINE_A8_VNNI)
// vpermt2b's indices from a chunk's low nibbles (0-63) and high ones (64-127), byte 16p + c (row c, pair p): lane
// c of the first quad takes pairs 0 and 1 (dims 0-3), of the second pairs 2 and 3 (dims 4-7)
struct QuadIndex {
  alignas(64) uint8_t bytes[2][64];
  constexpr QuadIndex() : bytes{} {
    for (int half = 0; half < 2; ++half)
      for (int c = 0; c < 16; ++c) {
        const int p = 2 * half;
        bytes[half][4 * c] = static_cast<uint8_t>(16 * p + c), bytes[half][4 * c + 1] = static_cast<uint8_t>(64 + 16 * p + c);
        bytes[half][4 * c + 2] = static_cast<uint8_t>(16 * p + 16 + c);
        bytes[half][4 * c + 3] = static_cast<uint8_t>(80 + 16 * p + c);
      }
  }
};
inline constexpr QuadIndex QUAD_INDEX{};
inline __m512i quad_index(int half) { return _mm512_load_si512(QUAD_INDEX.bytes[half]); }

// The Q5 types' fifth bits onto a chunk's nibbles (byte 16p + c, row c of pair p): qword 2p + h takes dim 2p + odd's
// 16-bit word (bit c: row c) in its low word, and its byte j the 8 bits from 8h + j - 4 (mod 64), so that bit 4 is
// row 8h + j's
inline __m512i q5_top(const __m512i& nibbles, const __m512i& words, int odd) {
  alignas(64) static constexpr uint8_t shifts[64] = {
      60, 61, 62, 63, 0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 60, 61, 62, 63, 0,  1,  2,  3,  4,  5,  6,  7,  8,  9,
      10, 11, 60, 61, 62, 63, 0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 60, 61, 62, 63, 0,  1,  2,  3,  4,  5,  6,  7,
      8,  9,  10, 11};
  alignas(64) static constexpr uint16_t picks[2][32] = {
      {0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 6, 0, 0, 0, 6, 0, 0, 0},
      {1, 0, 0, 0, 1, 0, 0, 0, 3, 0, 0, 0, 3, 0, 0, 0, 5, 0, 0, 0, 5, 0, 0, 0, 7, 0, 0, 0, 7, 0, 0, 0}};
  const __m512i spread = _mm512_permutexvar_epi16(_mm512_load_si512(picks[odd]), words);
  const __m512i top = _mm512_multishift_epi64_epi8(_mm512_load_si512(shifts), spread);
  return _mm512_ternarylogic_epi32(nibbles, top, _mm512_set1_epi8(0x10), 0xF8);  // nibbles | (top & 0x10)
}

// Q6_K's top bits onto a chunk's nibbles (byte 16p + c): qword 2p + h holds dim word w (p's dim) twice, and its byte
// j takes the 8 bits from 2c - 4 (c = 8h + j), so that bits 4 and 5 are row c's two
inline __m512i q6_top(const __m512i& nibbles, const __m256i& words, const __m512i& pick) {
  alignas(64) static constexpr uint8_t shifts[64] = {
      28, 30, 32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 28, 30, 32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52,
      54, 56, 58, 28, 30, 32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 28, 30, 32, 34, 36, 38, 40, 42, 44, 46,
      48, 50, 52, 54, 56, 58};
  const __m512i doubled = _mm512_permutexvar_epi32(pick, _mm512_castsi256_si512(words));
  const __m512i top = _mm512_multishift_epi64_epi8(_mm512_load_si512(shifts), doubled);
  return _mm512_ternarylogic_epi32(nibbles, top, _mm512_set1_epi8(0x30), 0xF8);  // nibbles | (top & 0x30)
}

// Dims d .. d + 7 of a record (d a multiple of 8) as two quads: lane c of quad i holds row c's dims d + 4i .. + 3.
template <int64_t T>
inline void widen_chunk(const uint8_t* rec, const Traits& t, int64_t d, __m512i* out) {
  if constexpr (eight_bit(T)) {  // pair p's 32 bytes: word c is row c's (dim 2p, 2p + 1); words c and 16 + c to lane c
    alignas(64) static constexpr uint16_t words[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i index = _mm512_load_si512(words), flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int i = 0; i < 2; ++i)
      out[i] = _mm512_xor_si512(_mm512_permutexvar_epi16(index, _mm512_loadu_si512(rec + t.low + (d + 4 * i) * 16)), flip);
  } else {
    const __m512i v = _mm512_loadu_si512(rec + t.low + d * 8), nibble = _mm512_set1_epi8(15);
    __m512i lo = _mm512_and_si512(v, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    if constexpr (T == MXFP4) {
      const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(MXFP4_Q)));
      lo = _mm512_shuffle_epi8(lut, lo), hi = _mm512_shuffle_epi8(lut, hi);
    }
    if constexpr (T == Q5_0 || T == Q5_1 || T == Q5_K) {  // dims d + 2p's 16 bits onto lo's pair p, d + 2p + 1's onto hi's
      const __m512i words = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.high + d * 2)));
      lo = q5_top(lo, words, 0);
      hi = q5_top(hi, words, 1);
    } else if constexpr (T == Q6_K) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + t.high + d * 4));
      lo = q6_top(lo, words, _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6));
      hi = q6_top(hi, words, _mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7));
    }
    out[0] = _mm512_permutex2var_epi8(lo, quad_index(0), hi);
    out[1] = _mm512_permutex2var_epi8(lo, quad_index(1), hi);
  }
}

// One group's stored integers, all K, in quads (tile[i]: dims 4i .. 4i + 3), and per segment its scale and offset
// (so[2s], so[2s + 1]).
template <int64_t T>
void widen_group(const uint8_t* group, const Traits& t, int64_t k, __m512i* tile, __m512* so) {
  constexpr int64_t seg = segment_of(T);
  for (int64_t b = 0; b < k / t.block; ++b) {
    const uint8_t* rec = group + b * t.record;
    for (int64_t j = 0; j < t.block / t.sub; ++j) {
      __m512 s, o;
      scales_of<T>(rec, t, j, s, o);
      for (int64_t d = j * t.sub; d < (j + 1) * t.sub; d += seg) {
        const int64_t at = (b * t.block + d) / seg;
        so[2 * at] = s, so[2 * at + 1] = o;
      }
    }
    for (int64_t d = 0; d < t.block; d += 8) widen_chunk<T>(rec, t, d, tile + (b * t.block + d) / 4);
  }
}
#endif

}  // namespace quant_kernel
