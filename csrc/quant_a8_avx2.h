// Int8 activations on packed blocks with AVX2 (csrc/quant_a8.cpp has the contract), on CPUs without AVX-512
// VNNI and VBMI (a Zen 3; a Skylake or Cascade Lake Xeon). vpmaddubsw multiplies a weight's unsigned integer by
// a row's int8 and adds each pair in int16, vpmaddwd adds those pairs into int32: P exact, as vpdpbusd gives it,
// so the bits are those of the other forms. No pair can saturate int16: the nibble types' integers are at most
// 63 (2 x 63 x 127 < 2^15); the 8-bit types multiply |q_s| (at most 128) by the row's int8 signed as q_s is
// (vpsignb), and their P is sum q_s q, the contract's -128 X + sum q_u q.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_a8.h"

namespace quant_kernel {

#if defined(ENGINE_ROWS_AVX2) && !defined(ENGINE_A8_VNNI)
#define ENGINE_A8_AVX2 1

// Two registers of quads (a row's 4 consecutive dims in an int32 lane) hold a group's 16 rows: the first rows
// 0-3 and 8-11, the second 4-7 and 12-15 (the order vpunpck leaves them in). QUAD_ROW[i]: the row in lane i.
constexpr int QUAD_ROW[16] = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15};

// Sub-block j's scales and offsets for the 16 rows, in the quads' row order.
template <int64_t T>
inline void quad_scales(const uint8_t* rec, const Traits& t, int64_t j, __m256 s[2], __m256 o[2]) {
  __m256 s0, s1, o0, o1;
#if defined(ENGINE_QUANT_AVX512)
  __m512 s16, o16;
  scales_of<T>(rec, t, j, s16, o16);
  s0 = _mm512_castps512_ps256(s16), o0 = _mm512_castps512_ps256(o16);
  s1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s16), 1));
  o1 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(o16), 1));
#else
  scales_of<T>(rec, t, j, s0, s1, o0, o1);
#endif
  s[0] = _mm256_permute2f128_ps(s0, s1, 0x20), s[1] = _mm256_permute2f128_ps(s0, s1, 0x31);
  o[0] = _mm256_permute2f128_ps(o0, o1, 0x20), o[1] = _mm256_permute2f128_ps(o0, o1, 0x31);
}

// Dims d .. d + 3 of a record (d a multiple of 4) as two registers of quads: the stored integers (the 8-bit
// types' signed, the others' unsigned).
template <int64_t T>
inline void widen_quads(const uint8_t* rec, const Traits& t, int64_t d, __m256i w[2]) {
  __m256i first, second;  // word c: row c's dims (d, d + 1), and (d + 2, d + 3)
  if constexpr (eight_bit(T)) {
    first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + t.low + (d / 2) * 32));
    second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + t.low + (d / 2 + 1) * 32));
  } else {  // 16 bytes a dim pair (byte c: row c, the first dim in the low nibble): the two pairs' lanes
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + t.low + d * 8));
    const __m256i nibble = _mm256_set1_epi8(15);
    __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
    if constexpr (T == MXFP4) {
      const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(MXFP4_Q)));
      lo = _mm256_shuffle_epi8(lut, lo), hi = _mm256_shuffle_epi8(lut, hi);
    }
    const __m256i rows_low = _mm256_unpacklo_epi8(lo, hi), rows_high = _mm256_unpackhi_epi8(lo, hi);
    first = _mm256_permute2x128_si256(rows_low, rows_high, 0x20);
    second = _mm256_permute2x128_si256(rows_low, rows_high, 0x31);
  }
  w[0] = _mm256_unpacklo_epi16(first, second);
  w[1] = _mm256_unpackhi_epi16(first, second);
  if constexpr (T == Q5_0 || T == Q5_1 || T == Q5_K) {
    // dim d + j's 16-bit word (bit c: row c) to byte 4r + j of each lane: its low byte to lane 0, its high to lane
    // 1; then bit r (the first register) or 4 + r (the second) of int32 lane r to bit 4 of its bytes
    int64_t words;
    std::memcpy(&words, rec + t.high + d * 2, 8);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi64x(words), _mm256_setr_epi8(0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5,
                                                    7, 1, 3, 5, 7, 1, 3, 5, 7));
    const __m256i bit = _mm256_set1_epi8(0x10);
    w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_sllv_epi32(spread, _mm256_setr_epi32(4, 3, 2, 1, 4, 3, 2, 1)), bit));
    w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_srlv_epi32(spread, _mm256_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3)), bit));
  } else if constexpr (T == Q6_K) {
    // dim d + j's 32 bits (bits 2c, 2c + 1: row c): byte 4j + c / 4 to byte 4r + j, then bits 2r of lane r to 4
    const __m256i bits = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.high + d * 4)));
    const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6), three = _mm256_set1_epi8(3);
    const __m256i pick[2] = {_mm256_setr_epi8(0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 0, 4, 8, 12, 2, 6, 10, 14, 2, 6, 10,
                                              14, 2, 6, 10, 14, 2, 6, 10, 14),
                             _mm256_setr_epi8(1, 5, 9, 13, 1, 5, 9, 13, 1, 5, 9, 13, 1, 5, 9, 13, 3, 7, 11, 15, 3, 7,
                                              11, 15, 3, 7, 11, 15, 3, 7, 11, 15)};
    for (int i = 0; i < 2; ++i) {
      const __m256i top = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(bits, pick[i]), shifts), three);
      w[i] = _mm256_or_si256(w[i], _mm256_slli_epi16(top, 4));
    }
  }
}

constexpr int A8_AVX2_ROWS = 4;  // rows a pass: 2 int32 and 2 float registers each (16 registers)

// R rows (row m's int8 at x + m * k, its segment values at start[m], ds[m], dx[m]) against one segment of
// widened quads (w[2i], w[2i + 1]: dims 4i ..), then the float steps of the contract into acc[2m], acc[2m + 1].
template <int R, int64_t T>
inline void a8_segment(const int8_t* x, int64_t k, const int32_t* start, const float* ds, const float* dx,
                       const __m256i* w, int64_t quads, const __m256 s[2], const __m256 o[2],
                       __m256* acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i p[2 * R];
  for (int m = 0; m < R; ++m) p[2 * m] = p[2 * m + 1] = _mm256_set1_epi32(start[m]);
  for (int64_t i = 0; i < quads; ++i) {
    __m256i u[2] = {w[2 * i], w[2 * i + 1]};
    if constexpr (eight_bit(T)) u[0] = _mm256_abs_epi8(u[0]), u[1] = _mm256_abs_epi8(u[1]);
    for (int m = 0; m < R; ++m) {
      int32_t quad;
      std::memcpy(&quad, x + m * k + 4 * i, 4);
      const __m256i xq = _mm256_set1_epi32(quad);
      for (int h = 0; h < 2; ++h) {
        const __m256i xs = eight_bit(T) ? _mm256_sign_epi8(xq, w[2 * i + h]) : xq;
        p[2 * m + h] = _mm256_add_epi32(p[2 * m + h], _mm256_madd_epi16(_mm256_maddubs_epi16(u[h], xs), ones));
      }
    }
  }
  for (int m = 0; m < R; ++m)
    for (int h = 0; h < 2; ++h) {
      __m256 a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p[2 * m + h]), _mm256_mul_ps(s[h], _mm256_set1_ps(ds[m])),
                                 acc[2 * m + h]);
      if constexpr (free_offset(T)) a = _mm256_fmadd_ps(o[h], _mm256_set1_ps(dx[m]), a);
      acc[2 * m + h] = a;
    }
}

// All the rows against one group, a segment at a time: its quads widened once, then every pass of rows.
template <int64_t T>
void a8_group_avx2(const A8Rows& a, const PassSegments& ps, const uint8_t* group, const Traits& t, __m256* acc) {
  constexpr int64_t seg = segment_of(T), quads = seg / 4;
  const int64_t k = a.k, segs = k / seg;
  for (int64_t m = 0; m < 2 * a.rows; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t s = 0; s < segs; ++s) {
    const int64_t first = s * seg, within = first % t.block;
    const uint8_t* rec = group + (first / t.block) * t.record;
    if constexpr (split_high(T)) prefetch_sub(group, t, T, s + PREFETCH_SUBS, segs);  // (their seg is a sub)
    __m256i w[2 * quads];
    for (int64_t i = 0; i < quads; ++i) widen_quads<T>(rec, t, within + 4 * i, w + 2 * i);
    __m256 sc[2], off[2];
    quad_scales<T>(rec, t, within / t.sub, sc, off);
    for (int64_t r = 0; r < a.rows; r += A8_AVX2_ROWS) {
      const int8_t* x = a.q.data() + r * k + first;
      const int64_t width = std::min<int64_t>(A8_AVX2_ROWS, a.rows - r), at = r * segs + s * width;
      const int32_t* st = ps.start.data() + at;
      const float *ds = ps.d.data() + at, *dx = ps.dx.data() + at;
      switch (width) {
        case 1: a8_segment<1, T>(x, k, st, ds, dx, w, quads, sc, off, acc + 2 * r); break;
        case 2: a8_segment<2, T>(x, k, st, ds, dx, w, quads, sc, off, acc + 2 * r); break;
        case 3: a8_segment<3, T>(x, k, st, ds, dx, w, quads, sc, off, acc + 2 * r); break;
        default: a8_segment<A8_AVX2_ROWS, T>(x, k, st, ds, dx, w, quads, sc, off, acc + 2 * r);
      }
    }
  }
}

// The rows against the n / 16 groups of one part, the groups over the threads; y in O (out's row stride ldy).
template <int64_t T, typename O>
void run_avx2(const A8Rows& a, const uint8_t* w, const Traits& t, const float* bias, O* out, int64_t n, int64_t ldy) {
  const int64_t group_bytes = (a.k / t.block) * t.record, rows = a.rows;
  // (the 8-bit types' P is sum q_s q: no start)
  const PassSegments ps = pass_segments(a, segment_of(T), eight_bit(T) ? 0 : int_offset(T), A8_AVX2_ROWS);
  at::parallel_for(0, n / COLS, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m256> accs(2 * rows);
    for (int64_t g = begin; g < end; ++g) {
      a8_group_avx2<T>(a, ps, w + g * group_bytes, t, accs.data());
      const float* acc = reinterpret_cast<const float*>(accs.data());
      const float* b = bias != nullptr ? bias + g * COLS : nullptr;
      for (int64_t m = 0; m < rows; ++m)
        for (int i = 0; i < 16; ++i) {
          const int c = QUAD_ROW[i];
          out[m * ldy + g * COLS + c] = static_cast<O>(b != nullptr ? acc[16 * m + i] + b[c] : acc[16 * m + i]);
        }
    }
  });
}
#endif

}  // namespace quant_kernel
