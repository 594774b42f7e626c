// Products on GGUF's quantized blocks kept packed (worker/quant/gguf_pack.py writes the layout), and the
// rows of such a weight dequantized (an embedding's lookup; the tests' whole-weight reference).
//
// Layout ("tiles"), uint8 [N / 16, K / B, RECORD]: for each group of 16 output rows and each GGUF block of B
// input dims, one record holding the 16 rows' block side by side (worker/quant/gguf_pack.py has each type's
// fields). Per input dim k, the 16 rows' low 4 bits are 8 bytes (byte j: row j in the low nibble, row j + 8
// in the high one); 5-bit types add 2 bytes of fifth bits (bit c: row c), Q6_K 4 bytes of top 2 bits (bits
// 2c, 2c + 1), Q8_0 holds 16 int8 instead. Scales per (row, sub-block of S dims) are kept as the file has
// them (f16 d, dmin, m; Q4_K/Q5_K's 6-bit scales and mins unpacked to bytes; Q6_K's int8 scales).
//
// quant_rows(packed, qtype, ids [T] int64, K, dtype) -> [T, K]: rows `ids` of the weight, dequantized.
// linear_quant(x [M, K] float32 or bf16, packed, qtype, bias [N] or empty, N) -> [M, N] in x's dtype.
//
// Every weight is fma(scale, q, offset) in float32 with q the stored unsigned (Q8_0: signed) integer:
//   Q4_0 d, -8d; Q5_0 d, -16d; Q8_0 d, 0; Q4_1 and Q5_1 d, m; Q4_K and Q5_K d * sc[j], -(dmin * m[j]);
//   Q6_K d * sc[j], -32 (d * sc[j]).
// Each scale and offset is an exact product and scale * q is exact, so this is the one rounding of the
// `gguf` package's numpy dequantization (d * (q - 8), d * q + m, d * q - dm, ...): the same float32 values.
// The product is linear_rows' (csrc/gemm_rows_cpu.cpp) on those values: y[m, n] = (one FMA chain over
// k = 0 .. K - 1 from 0) + bias[n], rounded once to x's dtype. So it equals linear_rows on the dequantized
// float32 weight bit for bit, at any row count and thread count (batch-invariant).
// Up to FUSED_ROWS rows dequantize in registers on the way to the FMAs (decode: the file's bytes are all
// that is read); more rows dequantize a group's K x 16 weights once into a float32 tile and run linear_rows'
// inner kernel on it.
#include "ops.h"

#include "cpu_math.h"
#include "gemm_rows.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using rows_kernel::COLS;
using rows_kernel::GROUP_PASS;
using rows_kernel::MAX_ROWS;
constexpr int64_t ROW_BLOCK = 96;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int FUSED_ROWS = 8;  // rows that dequantize in registers (AVX-512: 32 registers)
#else
constexpr int FUSED_ROWS = 4;
#endif

enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

// Where a type's fields lie in a record: f16 d[16] at 0, then (per type) dmin/m f16[16], scale bytes
// [subs][16], the low nibbles [B][8] (Q8_0: int8 [B][16]), and the high bits [B][2 or 4].
struct Traits {
  int64_t block, sub, record;
  int64_t second;  // f16 [16] after d: Q4_1/Q5_1's m, Q4_K/Q5_K's dmin; -1 if none
  int64_t scales;  // u8 (Q6_K int8) [subs][16] scales, Q4_K/Q5_K's mins after them; -1 if none
  int64_t low;     // the 4-bit (or Q8_0's 8-bit) values
  int64_t high;    // the high bits; -1 if none
  int high_bits;   // 0, 1 or 2
};

Traits traits_of(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return {32, 32, 288, -1, -1, 32, -1, 0};
    case Q4_1: return {32, 32, 320, 32, -1, 64, -1, 0};
    case Q5_0: return {32, 32, 352, -1, -1, 32, 288, 1};
    case Q5_1: return {32, 32, 384, 32, -1, 64, 320, 1};
    case Q8_0: return {32, 32, 544, -1, -1, 32, -1, 0};
    case Q4_K: return {256, 32, 2368, 32, 64, 320, -1, 0};
    case Q5_K: return {256, 32, 2880, 32, 64, 320, 2368, 1};
    case Q6_K: return {256, 16, 3360, -1, 32, 288, 2336, 2};
    default: TORCH_CHECK(false, "quantized products: GGML type ", qtype, " is not one of ours");
  }
}

[[maybe_unused]] inline float f16_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(ENGINE_ROWS_AVX2)
// AVX-512: the 16 rows of a group are one vector.
#define ENGINE_QUANT_AVX512 1
constexpr bool high_one(int64_t t) { return t == Q5_0 || t == Q5_1 || t == Q5_K; }

template <int64_t T>
inline void scales_of(const uint8_t* rec, const Traits& t, int64_t j, __m512& s, __m512& o) {
  s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
  if constexpr (T == Q4_0 || T == Q5_0) {
    o = _mm512_mul_ps(s, _mm512_set1_ps(T == Q4_0 ? -8.0f : -16.0f));
  } else if constexpr (T == Q8_0) {
    o = _mm512_setzero_ps();
  } else if constexpr (T == Q4_1 || T == Q5_1) {
    o = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + t.second)));
  } else if constexpr (T == Q4_K || T == Q5_K) {
    const int64_t subs = t.block / t.sub;
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.scales + j * 16));
    const __m128i mn = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.scales + (subs + j) * 16));
    s = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + t.second)));
    const __m512 dm = _mm512_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
    o = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dm), _mm512_set1_epi32(INT32_MIN)));
  } else {  // Q6_K
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.scales + j * 16));
    s = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
    o = _mm512_mul_ps(s, _mm512_set1_ps(-32.0f));
  }
}

template <int64_t T>
inline __m512 unpack(const uint8_t* rec, const Traits& t, int64_t k) {
  if constexpr (T == Q8_0) {
    return _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.low + k * 16))));
  } else {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + t.low + k * 8));
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i both = _mm_unpacklo_epi64(_mm_and_si128(v, nibble), _mm_and_si128(_mm_srli_epi16(v, 4), nibble));
    __m512i q = _mm512_cvtepu8_epi32(both);
    if constexpr (high_one(T)) {
      uint16_t bits;
      std::memcpy(&bits, rec + t.high + k * 2, 2);
      q = _mm512_mask_or_epi32(q, static_cast<__mmask16>(bits), q, _mm512_set1_epi32(16));
    } else if constexpr (T == Q6_K) {
      uint32_t bits;
      std::memcpy(&bits, rec + t.high + k * 4, 4);
      const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i top = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(bits)), shifts),
                                           _mm512_set1_epi32(3));
      q = _mm512_or_si512(q, _mm512_slli_epi32(top, 4));
    }
    return _mm512_cvtepi32_ps(q);
  }
}

// Dims k and k + 1 (k even) at once: one 16-byte load holds both dims' nibbles.
template <int64_t T>
inline void unpack_two(const uint8_t* rec, const Traits& t, int64_t k, __m512& first, __m512& second) {
  if constexpr (T == Q8_0) {
    first = unpack<T>(rec, t, k);
    second = unpack<T>(rec, t, k + 1);
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.low + k * 8));
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(v, nibble), hi = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);
    __m512i a = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi));
    __m512i b = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(lo, hi));
    if constexpr (high_one(T)) {
      uint32_t bits;
      std::memcpy(&bits, rec + t.high + k * 2, 4);
      const __m512i sixteen = _mm512_set1_epi32(16);
      a = _mm512_mask_or_epi32(a, static_cast<__mmask16>(bits), a, sixteen);
      b = _mm512_mask_or_epi32(b, static_cast<__mmask16>(bits >> 16), b, sixteen);
    } else if constexpr (T == Q6_K) {
      uint64_t bits;
      std::memcpy(&bits, rec + t.high + k * 4, 8);
      const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      const __m512i three = _mm512_set1_epi32(3);
      const __m512i ta = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(bits)), shifts), three);
      const __m512i tb = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(static_cast<int>(bits >> 32)), shifts), three);
      a = _mm512_or_si512(a, _mm512_slli_epi32(ta, 4));
      b = _mm512_or_si512(b, _mm512_slli_epi32(tb, 4));
    }
    first = _mm512_cvtepi32_ps(a);
    second = _mm512_cvtepi32_ps(b);
  }
}

template <int64_t T>
void dequant_record(const uint8_t* rec, const Traits& t, float* w) {
  for (int64_t j = 0; j < t.block / t.sub; ++j) {
    __m512 s, o;
    scales_of<T>(rec, t, j, s, o);
    for (int64_t k = j * t.sub; k < (j + 1) * t.sub; ++k)
      _mm512_storeu_ps(w + k * 16, _mm512_fmadd_ps(s, unpack<T>(rec, t, k), o));
  }
}

template <int ROWS, int64_t T>
void fused_pass(const float* x, int64_t k, const uint8_t* group, const Traits& t, float* sums) {
  __m512 acc[FUSED_ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t blocks = k / t.block, subs = t.block / t.sub;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = group + b * t.record;
    for (int64_t j = 0; j < subs; ++j) {
      __m512 s, o;
      scales_of<T>(rec, t, j, s, o);
      const int64_t first = j * t.sub;
      const float* xs = x + b * t.block + first;
      for (int64_t d = 0; d < t.sub; d += 2) {
        __m512 qa, qb;
        unpack_two<T>(rec, t, first + d, qa, qb);
        const __m512 wa = _mm512_fmadd_ps(s, qa, o), wb = _mm512_fmadd_ps(s, qb, o);
        for (int m = 0; m < ROWS; ++m) {
          acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * k + d]), wa, acc[m]);
          acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xs[m * k + d + 1]), wb, acc[m]);
        }
      }
    }
  }
  for (int m = 0; m < ROWS; ++m) _mm512_storeu_ps(sums + m * COLS, acc[m]);
}
#elif defined(ENGINE_ROWS_AVX2)
constexpr bool high_one(int64_t t) { return t == Q5_0 || t == Q5_1 || t == Q5_K; }

// The 16 rows' scales and offsets for sub-block j of a record: (s0, o0) rows 0-7, (s1, o1) rows 8-15.
template <int64_t T>
inline void scales_of(const uint8_t* rec, const Traits& t, int64_t j, __m256& s0, __m256& s1, __m256& o0,
                      __m256& o1) {
  s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec)));
  s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 16)));
  const __m256 sign = _mm256_set1_ps(-0.0f);
  if constexpr (T == Q4_0 || T == Q5_0) {
    const __m256 bias = _mm256_set1_ps(T == Q4_0 ? -8.0f : -16.0f);
    o0 = _mm256_mul_ps(s0, bias);
    o1 = _mm256_mul_ps(s1, bias);
  } else if constexpr (T == Q8_0) {
    o0 = o1 = _mm256_setzero_ps();
  } else if constexpr (T == Q4_1 || T == Q5_1) {
    o0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.second)));
    o1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.second + 16)));
  } else if constexpr (T == Q4_K || T == Q5_K) {
    const int64_t subs = t.block / t.sub;
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.scales + j * 16));
    const __m128i mn = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.scales + (subs + j) * 16));
    s0 = _mm256_mul_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)));
    s1 = _mm256_mul_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sc, 8))));
    const __m256 m0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.second)));
    const __m256 m1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.second + 16)));
    o0 = _mm256_xor_ps(sign, _mm256_mul_ps(m0, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn))));
    o1 = _mm256_xor_ps(sign, _mm256_mul_ps(m1, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(mn, 8)))));
  } else {  // Q6_K
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.scales + j * 16));
    s0 = _mm256_mul_ps(s0, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    s1 = _mm256_mul_ps(s1, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    const __m256 bias = _mm256_set1_ps(-32.0f);
    o0 = _mm256_mul_ps(s0, bias);
    o1 = _mm256_mul_ps(s1, bias);
  }
}

// The 16 rows' stored integers at dim k of a record, as float32: rows 0-7 in q0, 8-15 in q1.
template <int64_t T>
inline void unpack(const uint8_t* rec, const Traits& t, int64_t k, __m256& q0, __m256& q1) {
  if constexpr (T == Q8_0) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.low + k * 16));
    q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
    q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
  } else {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + t.low + k * 8));
    const __m128i nibble = _mm_set1_epi8(15);
    __m256i i0 = _mm256_cvtepu8_epi32(_mm_and_si128(v, nibble));
    __m256i i1 = _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), nibble));
    if constexpr (high_one(T)) {
      uint16_t bits;
      std::memcpy(&bits, rec + t.high + k * 2, 2);
      const __m256i h = _mm256_set1_epi32(bits), one = _mm256_set1_epi32(1);
      const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), eight = _mm256_set1_epi32(8);
      i0 = _mm256_or_si256(i0, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(h, lanes), one), 4));
      i1 = _mm256_or_si256(
          i1, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(h, _mm256_add_epi32(lanes, eight)), one), 4));
    } else if constexpr (T == Q6_K) {
      uint32_t bits;
      std::memcpy(&bits, rec + t.high + k * 4, 4);
      const __m256i h = _mm256_set1_epi32(static_cast<int>(bits)), three = _mm256_set1_epi32(3);
      const __m256i lanes = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14), sixteen = _mm256_set1_epi32(16);
      i0 = _mm256_or_si256(i0, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(h, lanes), three), 4));
      i1 = _mm256_or_si256(
          i1, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(h, _mm256_add_epi32(lanes, sixteen)), three), 4));
    }
    q0 = _mm256_cvtepi32_ps(i0);
    q1 = _mm256_cvtepi32_ps(i1);
  }
}

// A record's weights, dims [0, B) of its 16 rows, into w[k * 16 + c].
template <int64_t T>
void dequant_record(const uint8_t* rec, const Traits& t, float* w) {
  for (int64_t j = 0; j < t.block / t.sub; ++j) {
    __m256 s0, s1, o0, o1, q0, q1;
    scales_of<T>(rec, t, j, s0, s1, o0, o1);
    for (int64_t k = j * t.sub; k < (j + 1) * t.sub; ++k) {
      unpack<T>(rec, t, k, q0, q1);
      _mm256_storeu_ps(w + k * 16, _mm256_fmadd_ps(s0, q0, o0));
      _mm256_storeu_ps(w + k * 16 + 8, _mm256_fmadd_ps(s1, q1, o1));
    }
  }
}

// ROWS rows (float32, row stride k) against one group's records: sums[m][c], dequantized in registers.
template <int ROWS, int64_t T>
void fused_pass(const float* x, int64_t k, const uint8_t* group, const Traits& t, float* sums) {
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
  const int64_t blocks = k / t.block, subs = t.block / t.sub;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = group + b * t.record;
    for (int64_t j = 0; j < subs; ++j) {
      __m256 s0, s1, o0, o1;
      scales_of<T>(rec, t, j, s0, s1, o0, o1);
      const int64_t first = j * t.sub;
      const float* xs = x + b * t.block + first;
      for (int64_t d = 0; d < t.sub; ++d) {
        __m256 q0, q1;
        unpack<T>(rec, t, first + d, q0, q1);
        const __m256 w0 = _mm256_fmadd_ps(s0, q0, o0), w1 = _mm256_fmadd_ps(s1, q1, o1);
#define ENGINE_ROW(m)                                       \
  if constexpr (ROWS > m) {                                 \
    const __m256 xv = _mm256_broadcast_ss(xs + m * k + d);  \
    a##m = _mm256_fmadd_ps(xv, w0, a##m);                   \
    b##m = _mm256_fmadd_ps(xv, w1, b##m);                   \
  }
        ENGINE_ROW(0) ENGINE_ROW(1) ENGINE_ROW(2) ENGINE_ROW(3)
#undef ENGINE_ROW
      }
    }
  }
  const __m256 los[4] = {a0, a1, a2, a3}, his[4] = {b0, b1, b2, b3};
  for (int m = 0; m < ROWS; ++m) {
    _mm256_storeu_ps(sums + m * COLS, los[m]);
    _mm256_storeu_ps(sums + m * COLS + 8, his[m]);
  }
}
#else
// The portable path (no AVX2): the same values, one row at a time.
template <int64_t T>
inline void scales_of(const uint8_t* rec, const Traits& t, int64_t j, float* scale, float* offset) {
  for (int c = 0; c < 16; ++c) {
    const float d = f16_to_float(rec + 2 * c);
    if constexpr (T == Q4_0 || T == Q5_0 || T == Q8_0) {
      scale[c] = d;
      offset[c] = T == Q4_0 ? -8.0f * d : T == Q5_0 ? -16.0f * d : 0.0f;
    } else if constexpr (T == Q4_1 || T == Q5_1) {
      scale[c] = d;
      offset[c] = f16_to_float(rec + t.second + 2 * c);
    } else if constexpr (T == Q4_K || T == Q5_K) {
      const int64_t subs = t.block / t.sub;
      scale[c] = d * static_cast<float>(rec[t.scales + j * 16 + c]);
      offset[c] = -(f16_to_float(rec + t.second + 2 * c) * static_cast<float>(rec[t.scales + (subs + j) * 16 + c]));
    } else {  // Q6_K
      scale[c] = d * static_cast<float>(static_cast<int8_t>(rec[t.scales + j * 16 + c]));
      offset[c] = -32.0f * scale[c];
    }
  }
}

template <int64_t T>
inline float q_of(const uint8_t* rec, const Traits& t, int64_t k, int c) {
  if constexpr (T == Q8_0) {
    return static_cast<float>(static_cast<int8_t>(rec[t.low + k * 16 + c]));
  } else {
    const uint8_t byte = rec[t.low + k * 8 + (c & 7)];
    int q = c < 8 ? (byte & 15) : (byte >> 4);
    if (t.high_bits == 1) {
      uint16_t bits;
      std::memcpy(&bits, rec + t.high + k * 2, 2);
      q |= ((bits >> c) & 1) << 4;
    } else if (t.high_bits == 2) {
      uint32_t bits;
      std::memcpy(&bits, rec + t.high + k * 4, 4);
      q |= ((bits >> (2 * c)) & 3) << 4;
    }
    return static_cast<float>(q);
  }
}

template <int64_t T>
void dequant_record(const uint8_t* rec, const Traits& t, float* w) {
  float scale[16], offset[16];
  for (int64_t j = 0; j < t.block / t.sub; ++j) {
    scales_of<T>(rec, t, j, scale, offset);
    for (int64_t k = j * t.sub; k < (j + 1) * t.sub; ++k)
      for (int c = 0; c < 16; ++c) w[k * 16 + c] = std::fma(scale[c], q_of<T>(rec, t, k, c), offset[c]);
  }
}
#endif

// A group's K x 16 weights into tile (linear_rows' layout for one group).
template <int64_t T>
void dequant_group(const uint8_t* group, const Traits& t, int64_t k, float* tile) {
  for (int64_t b = 0; b < k / t.block; ++b) dequant_record<T>(group + b * t.record, t, tile + b * t.block * COLS);
}

template <typename O>
void store_row(const float* sums, const float* bias, O* y, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) y[c] = static_cast<O>(bias != nullptr ? sums[c] + bias[c] : sums[c]);
}

// y[m * ldy + c] for the n = 16 x groups columns of one packing.
template <int64_t T, typename O>
void run(const float* xs, int64_t rows, int64_t k, const uint8_t* w, const Traits& t, const float* bias, O* out,
         int64_t n, int64_t ldy) {
  const int64_t groups = n / COLS, group_bytes = (k / t.block) * t.record;
#if defined(ENGINE_ROWS_AVX2)
  if (rows <= FUSED_ROWS) {
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      float sums[FUSED_ROWS * COLS];
      for (int64_t g = begin; g < end; ++g) {
        const uint8_t* group = w + g * group_bytes;
        switch (rows) {
          case 1: fused_pass<1, T>(xs, k, group, t, sums); break;
          case 2: fused_pass<2, T>(xs, k, group, t, sums); break;
          case 3: fused_pass<3, T>(xs, k, group, t, sums); break;
#if defined(ENGINE_QUANT_AVX512)
          case 4: fused_pass<4, T>(xs, k, group, t, sums); break;
          case 5: fused_pass<5, T>(xs, k, group, t, sums); break;
          case 6: fused_pass<6, T>(xs, k, group, t, sums); break;
          case 7: fused_pass<7, T>(xs, k, group, t, sums); break;
          default: fused_pass<8, T>(xs, k, group, t, sums); break;
#else
          default: fused_pass<4, T>(xs, k, group, t, sums); break;
#endif
        }
        for (int64_t m = 0; m < rows; ++m)
          store_row<O>(sums + m * COLS, bias != nullptr ? bias + g * COLS : nullptr, out + m * ldy + g * COLS, COLS);
      }
    });
    return;
  }
#endif
  const int64_t blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
  at::parallel_for(0, blocks * groups, 1, [&](int64_t begin, int64_t end) {
    float sums[MAX_ROWS * COLS];
    std::vector<float> tile(k * COLS);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t block = unit / groups, g = unit % groups;
      dequant_group<T>(w + g * group_bytes, t, k, tile.data());
      const int64_t last = std::min(rows, (block + 1) * ROW_BLOCK);
      for (int64_t r = block * ROW_BLOCK; r < last; r += MAX_ROWS) {
        const int pass = static_cast<int>(std::min<int64_t>(MAX_ROWS, last - r));
        GROUP_PASS<float>[pass](xs + r * k, k, tile.data(), sums);
        for (int m = 0; m < pass; ++m)
          store_row<O>(sums + m * COLS, bias != nullptr ? bias + g * COLS : nullptr, out + (r + m) * ldy + g * COLS,
                       COLS);
      }
    }
  });
}


#if defined(ENGINE_QUANT_AVX512) && defined(__AVX512BF16__) && defined(__BMI2__)
// bf16 rows on AVX-512 BF16: the scale factored out of each sub-block. A sub-block's sums of x times the stored
// integers go a dim pair at a time through vdpbf16ps (the integers are exact in bf16, x is bf16 already), and
// then y += scale * sums + offset' * (the sub-block's sum of x). The weights are never rounded to bf16 (the
// dequantized bf16 model rounds them), and a weight costs a few integer operations, not a conversion and an
// FMA. The same steps in the same order at every row count: batch-invariant, within float32 rounding of the
// float64 product before the output's rounding to bf16 (tests/test_kernels_quant.py).
// Nibble types store q + 128, whose bf16 bits are 0x4300 | q (128 + q has the exponent of 128 and q in the 7
// mantissa bits, q < 128), so offset' = offset - 128 scale; Q8_0 converts its int8 values.
#define ENGINE_QUANT_BF16 1
constexpr int BF16_ROWS = 8;  // rows a pass

alignas(64) constexpr int16_t kPairOrder[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// The 16 rows' stored integers at dims k and k + 1 (k even) as bf16 pairs: lane c holds (q[k][c], q[k + 1][c]).
template <int64_t T>
inline __m512i pair_ints(const uint8_t* rec, const Traits& t, int64_t k) {
  if constexpr (T == Q8_0) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.low + k * 16));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.low + (k + 1) * 16));
    const __m512bh both =
        _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)));
    __m512i bits;
    std::memcpy(&bits, &both, sizeof bits);
    return _mm512_permutexvar_epi16(_mm512_load_si512(kPairOrder), bits);
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.low + k * 8));
    const __m128i nibble = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(v, nibble), hi = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);
    const __m128i rows_lo = _mm_unpacklo_epi8(lo, _mm_srli_si128(lo, 8));  // rows 0-7: (k, k + 1) byte pairs
    const __m128i rows_hi = _mm_unpacklo_epi8(hi, _mm_srli_si128(hi, 8));  // rows 8-15
    __m512i q = _mm512_cvtepu8_epi16(_mm256_set_m128i(rows_hi, rows_lo));
    if constexpr (high_one(T)) {
      uint32_t bits;  // dim k's 16 fifth bits, then dim k + 1's
      std::memcpy(&bits, rec + t.high + k * 2, 4);
      const __mmask32 set = _pdep_u32(bits & 0xFFFF, 0x55555555u) | _pdep_u32(bits >> 16, 0xAAAAAAAAu);
      q = _mm512_mask_add_epi16(q, set, q, _mm512_set1_epi16(16));
    } else if constexpr (T == Q6_K) {
      uint32_t bits[2];  // dims k and k + 1: row c's top two bits at 2c, 2c + 1
      std::memcpy(bits, rec + t.high + k * 4, 8);
      const uint32_t fifth = _pdep_u32(_pext_u32(bits[0], 0x55555555u), 0x55555555u) |
                             _pdep_u32(_pext_u32(bits[1], 0x55555555u), 0xAAAAAAAAu);
      const uint32_t sixth = _pdep_u32(_pext_u32(bits[0], 0xAAAAAAAAu), 0x55555555u) |
                             _pdep_u32(_pext_u32(bits[1], 0xAAAAAAAAu), 0xAAAAAAAAu);
      q = _mm512_mask_add_epi16(q, fifth, q, _mm512_set1_epi16(16));
      q = _mm512_mask_add_epi16(q, sixth, q, _mm512_set1_epi16(32));
    }
    return _mm512_or_si512(q, _mm512_set1_epi16(0x4300));
  }
}

template <int64_t T>
inline __m512 shifted_offset(const __m512& s, const __m512& o) {
  if constexpr (T == Q8_0) return o;
  return _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), s, o);  // o - 128 s, one rounding
}

// ROWS rows: xp their dim pairs (row m at m * K / 2), xsum their sub-blocks' sums (row m at m * subs); the 16
// rows of one group from its records (TILE false) or from a tile of pair_ints and scales made once (TILE true).
template <int ROWS, int64_t T, bool TILE>
void factored_pass(const uint32_t* xp, const float* xsum, int64_t k, const uint8_t* group, const Traits& t,
                   const uint32_t* tile_q, const float* tile_s, const float* tile_o, const float* bias,
                   c10::BFloat16* y, int64_t ldy) {
  const int64_t kpairs = k / 2, per_block = t.block / t.sub, subs = k / t.sub;
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t si = 0; si < subs; ++si) {
    const uint8_t* rec = group + (si / per_block) * t.record;
    const int64_t first = (si % per_block) * t.sub;  // within the record
    __m512 s, o;
    if constexpr (TILE) {
      s = _mm512_loadu_ps(tile_s + si * 16);
      o = _mm512_loadu_ps(tile_o + si * 16);
    } else {
      scales_of<T>(rec, t, si % per_block, s, o);
      o = shifted_offset<T>(s, o);
    }
    __m512 part[ROWS];
    for (int m = 0; m < ROWS; ++m) part[m] = _mm512_setzero_ps();
    for (int64_t d = 0; d < t.sub; d += 2) {
      const int64_t kp = (si * t.sub + d) / 2;
      __m512i ints;
      if constexpr (TILE) ints = _mm512_loadu_si512(tile_q + kp * 16);
      else ints = pair_ints<T>(rec, t, first + d);
      const __m512bh w = as_bf16_pairs(ints);
      for (int m = 0; m < ROWS; ++m)
        part[m] = _mm512_dpbf16_ps(part[m], w, as_bf16_pairs(_mm512_set1_epi32(static_cast<int32_t>(xp[m * kpairs + kp]))));
    }
    for (int m = 0; m < ROWS; ++m) {
      acc[m] = _mm512_fmadd_ps(s, part[m], acc[m]);
      acc[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsum[m * subs + si]), acc[m]);
    }
  }
  for (int m = 0; m < ROWS; ++m) {
    const __m512 sum = bias != nullptr ? _mm512_add_ps(acc[m], _mm512_loadu_ps(bias)) : acc[m];
    const __m256bh half = _mm512_cvtneps_pbh(sum);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * ldy), reinterpret_cast<const __m256i&>(half));
  }
}

template <int64_t T>
void run_pairs(const c10::BFloat16* x, int64_t rows, int64_t k, const uint8_t* w, const Traits& t, const float* bias,
               c10::BFloat16* out, int64_t n, int64_t ldy) {
  const int64_t groups = n / COLS, group_bytes = (k / t.block) * t.record, kpairs = k / 2, subs = k / t.sub;
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(x);  // row m's dim pairs at m * kpairs
  std::vector<float> xsum(rows * subs);  // each row's sub-block sums, in k order
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t si = 0; si < subs; ++si) {
      float sum = 0.0f;
      for (int64_t d = 0; d < t.sub; ++d) sum += static_cast<float>(x[m * k + si * t.sub + d]);
      xsum[m * subs + si] = sum;
    }
  const int64_t passes = (rows + BF16_ROWS - 1) / BF16_ROWS;
  const bool tile = passes > 1;  // a group's integers and scales widened once, read by every pass
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> tile_q(tile ? kpairs * COLS : 0);
    std::vector<float> tile_s(tile ? subs * COLS : 0), tile_o(tile ? subs * COLS : 0);
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = w + g * group_bytes;
      const float* b = bias != nullptr ? bias + g * COLS : nullptr;
      if (tile) {
        for (int64_t si = 0; si < subs; ++si) {
          const uint8_t* rec = group + (si / (t.block / t.sub)) * t.record;
          const int64_t j = si % (t.block / t.sub);
          __m512 s, o;
          scales_of<T>(rec, t, j, s, o);
          _mm512_storeu_ps(tile_s.data() + si * COLS, s);
          _mm512_storeu_ps(tile_o.data() + si * COLS, shifted_offset<T>(s, o));
          for (int64_t d = 0; d < t.sub; d += 2)
            _mm512_storeu_si512(tile_q.data() + (si * t.sub + d) / 2 * COLS, pair_ints<T>(rec, t, j * t.sub + d));
        }
      }
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t r = pass * BF16_ROWS;
        const int count = static_cast<int>(std::min<int64_t>(BF16_ROWS, rows - r));
        const uint32_t* xr = xp + r * kpairs;
        const float* sr = xsum.data() + r * subs;
        c10::BFloat16* yr = out + r * ldy + g * COLS;
        const uint32_t* tq = tile_q.data();
        const float *ts = tile_s.data(), *to = tile_o.data();
#define ENGINE_PASS(R)                                                                  \
  case R:                                                                               \
    if (tile) factored_pass<R, T, true>(xr, sr, k, group, t, tq, ts, to, b, yr, ldy);   \
    else factored_pass<R, T, false>(xr, sr, k, group, t, tq, ts, to, b, yr, ldy);       \
    break;
        switch (count) {
          ENGINE_PASS(1) ENGINE_PASS(2) ENGINE_PASS(3) ENGINE_PASS(4) ENGINE_PASS(5) ENGINE_PASS(6) ENGINE_PASS(7)
          ENGINE_PASS(8)
        }
#undef ENGINE_PASS
      }
    }
  });
}
#endif

template <typename F>
void dispatch(int64_t qtype, F&& f) {
  switch (qtype) {
    case Q4_0: f(std::integral_constant<int64_t, Q4_0>{}); break;
    case Q4_1: f(std::integral_constant<int64_t, Q4_1>{}); break;
    case Q5_0: f(std::integral_constant<int64_t, Q5_0>{}); break;
    case Q5_1: f(std::integral_constant<int64_t, Q5_1>{}); break;
    case Q8_0: f(std::integral_constant<int64_t, Q8_0>{}); break;
    case Q4_K: f(std::integral_constant<int64_t, Q4_K>{}); break;
    case Q5_K: f(std::integral_constant<int64_t, Q5_K>{}); break;
    case Q6_K: f(std::integral_constant<int64_t, Q6_K>{}); break;
    default: TORCH_CHECK(false, "quantized products: GGML type ", qtype, " is not one of ours");
  }
}

void check_packing(const torch::Tensor& packed, const Traits& t, int64_t k) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous(),
              "quantized products: packed is a contiguous uint8 [N / 16, K / B, record] tensor");
  TORCH_CHECK(k % t.block == 0 && packed.size(1) == k / t.block && packed.size(2) == t.record,
              "quantized products: the packing does not match K = ", k, " (blocks of ", t.block, ")");
}

}  // namespace

bool quant_type_supported(int64_t qtype) {
  switch (qtype) {
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case Q4_K: case Q5_K: case Q6_K: return true;
    default: return false;
  }
}

namespace {

// The parts of one product into y's columns [start, start + out_features) each.
void run_parts(const torch::Tensor& x, const uint8_t* bytes, int64_t num_bytes, const int64_t* parts,
               int64_t num_parts, const float* bias, torch::Tensor& y) {
  const int64_t rows = x.size(0), k = x.size(1), n = y.size(1);
#if defined(ENGINE_QUANT_BF16)
  const bool pairs = x.scalar_type() == at::kBFloat16;  // the bf16 path takes bf16 rows as they are
  const torch::Tensor xb = pairs ? x.contiguous() : torch::Tensor();
  TORCH_CHECK(!pairs || k % 2 == 0, "quantized products: K is even");
#else
  const bool pairs = false;
#endif
  const torch::Tensor x32 = pairs ? torch::Tensor() : x.to(at::kFloat).contiguous();
  for (int64_t p = 0; p < num_parts; ++p) {
    const int64_t qtype = parts[4 * p], start = parts[4 * p + 1], width = parts[4 * p + 2], offset = parts[4 * p + 3];
    const Traits t = traits_of(qtype);
    TORCH_CHECK(k % t.block == 0, "quantized products: K = ", k, " is not whole blocks of ", t.block);
    TORCH_CHECK(width % COLS == 0 && start >= 0 && start + width <= n, "quantized products: part ", p, " columns");
    TORCH_CHECK(offset >= 0 && offset + width / COLS * (k / t.block) * t.record <= num_bytes,
                "quantized products: part ", p, " lies past the packing");
    const uint8_t* w = bytes + offset;
    const float* b = bias != nullptr ? bias + start : nullptr;
    dispatch(qtype, [&](auto type) {
      constexpr int64_t T = decltype(type)::value;
#if defined(ENGINE_QUANT_BF16)
      if (y.scalar_type() == at::kBFloat16) {
        run_pairs<T>(xb.data_ptr<c10::BFloat16>(), rows, k, w, t, b, y.data_ptr<c10::BFloat16>() + start, width, n);
        return;
      }
#endif
      if (y.scalar_type() == at::kFloat)
        run<T, float>(x32.data_ptr<float>(), rows, k, w, t, b, y.data_ptr<float>() + start, width, n);
      else
        run<T, c10::BFloat16>(x32.data_ptr<float>(), rows, k, w, t, b, y.data_ptr<c10::BFloat16>() + start, width, n);
    });
  }
}

}  // namespace

torch::Tensor linear_quant_parts(torch::Tensor x, torch::Tensor packed, torch::Tensor parts, torch::Tensor bias,
                                 int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "linear_quant: x [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "linear_quant: float32 or bf16 x");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "linear_quant: packed is contiguous uint8");
  TORCH_CHECK(parts.scalar_type() == at::kLong && parts.dim() == 2 && parts.size(1) == 4 && parts.is_contiguous(),
              "linear_quant: parts is int64 [P, 4]: GGML type, first column, columns, byte offset");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || bias.numel() == out_features, "linear_quant: bias size");
  const torch::Tensor bias32 = has_bias ? bias.to(at::kFloat).contiguous() : torch::Tensor();
  auto y = torch::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
  int64_t covered = 0;
  for (int64_t p = 0; p < parts.size(0); ++p) covered += parts.data_ptr<int64_t>()[4 * p + 2];
  TORCH_CHECK(covered == out_features, "linear_quant: the parts cover ", covered, " of ", out_features, " columns");
  run_parts(x, packed.data_ptr<uint8_t>(), packed.numel(), parts.data_ptr<int64_t>(), parts.size(0),
            has_bias ? bias32.data_ptr<float>() : nullptr, y);
  return y;
}

torch::Tensor linear_quant(torch::Tensor x, torch::Tensor packed, int64_t qtype, torch::Tensor bias,
                           int64_t out_features) {
  const Traits t = traits_of(qtype);
  TORCH_CHECK(x.dim() == 2, "linear_quant: x [M, K]");
  check_packing(packed, t, x.size(1));
  TORCH_CHECK(out_features == packed.size(0) * COLS, "linear_quant: out_features is 16 x the groups");
  const torch::Tensor parts = torch::tensor({qtype, int64_t{0}, out_features, int64_t{0}}, torch::kLong).view({1, 4});
  return linear_quant_parts(x, packed.view({-1}), parts, bias, out_features);
}

torch::Tensor quant_rows(torch::Tensor packed, int64_t qtype, torch::Tensor ids, int64_t in_features,
                         c10::ScalarType dtype) {
  const Traits t = traits_of(qtype);
  check_packing(packed, t, in_features);
  TORCH_CHECK(ids.dim() == 1, "quant_rows: ids [T]");
  const torch::Tensor index = ids.to(at::kLong).contiguous();
  const int64_t* id = index.data_ptr<int64_t>();
  const int64_t rows = index.size(0), k = in_features, group_bytes = (k / t.block) * t.record;
  for (int64_t i = 0; i < rows; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < packed.size(0) * COLS, "quant_rows: row ", id[i], " is out of range");
  auto out = torch::empty({rows, k}, torch::dtype(at::kFloat));
  float* o = out.data_ptr<float>();
  const uint8_t* w = packed.data_ptr<uint8_t>();
  dispatch(qtype, [&](auto type) {
    constexpr int64_t T = decltype(type)::value;
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> block(t.block * COLS);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t g = id[i] / COLS, c = id[i] % COLS;
        for (int64_t b = 0; b < k / t.block; ++b) {
          dequant_record<T>(w + g * group_bytes + b * t.record, t, block.data());
          for (int64_t d = 0; d < t.block; ++d) o[i * k + b * t.block + d] = block[d * COLS + c];
        }
      }
    });
  });
  return dtype == at::kFloat ? out : out.to(dtype);
}
