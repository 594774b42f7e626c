// GGUF blocks kept packed (csrc/quant_cpu.cpp has the layout and the contract): each type's fields in a
// record, and reading 16 rows' scales, offsets and stored integers for the kernels, per instruction set
// (AVX-512, AVX2, a portable loop beside them). Shared by the float32 products and the bf16 ones.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#include "gemm_rows.h"

namespace quant_kernel {

using rows_kernel::COLS;
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int FUSED_ROWS = 8;  // rows that dequantize in registers (AVX-512: 32 registers)
#else
constexpr int FUSED_ROWS = 4;
#endif

enum QType : int64_t { Q2_K = 10, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
                       // integer weights of safetensors checkpoints (AWQ, GPTQ, compressed-tensors; worker/quant/
                       // int_pack.py): 4-bit groups of 32, 64 or 128 dims, 8-bit blocks of 64, each with a float32
                       // scale and offset per (row, group)
                       I4_G32 = 100, I4_G64 = 101, I4_G128 = 102, I8_G64 = 103,
                       // gpt-oss's MXFP4 (worker/quant/int_pack.py): E2M1 codes, an E8M0 exponent per 32
                       MXFP4 = 105 };

// MXFP4's code c is twice its E2M1 value as an integer in [-12, 12], stored plus 12 (q in [0, 24]), with scale
// 2^(e - 128) and offset -12 scale: fma(scale, q, offset) is the E2M1 value times 2^(e - 127), exactly.
constexpr uint8_t MXFP4_Q[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// The integer types' scale and offset are float32 [16] each, at 0 and 64 (the GGUF types' d is f16 at 0).
constexpr bool float_scales(int64_t t) { return t >= I4_G32 && t != MXFP4; }
// Signed 8-bit values stored a dim pair per 16-bit word (Q8_0's layout); the other types store nibbles.
constexpr bool eight_bit(int64_t t) { return t == Q8_0 || t == I8_G64; }
// A scale and a min per sub-block (d * sc[j], -(dmin * m[j])): Q4_K, Q5_K, and Q2_K (4-bit ones, stored a byte each).
constexpr bool sub_mins(int64_t t) { return t == Q2_K || t == Q4_K || t == Q5_K; }

// Where a type's fields lie in a record: f16 d[16] at 0, then (per type) dmin/m f16[16], scale bytes
// [subs][16], the low nibbles [B / 2][16] (Q8_0: int8 [B / 2][16][2]), and the high bits [B][2 or 4].
struct Traits {
  int64_t block, sub, record;
  int64_t second;  // f16 [16] after d: Q4_1/Q5_1's m, Q2_K/Q4_K/Q5_K's dmin; -1 if none
  int64_t scales;  // u8 (Q6_K int8) [subs][16] scales, Q2_K/Q4_K/Q5_K's mins after them; -1 if none
  int64_t low;     // the 4-bit (or Q8_0's 8-bit) values
  int64_t high;    // the high bits; -1 if none
  int high_bits;   // 0, 1 or 2
};

inline Traits traits_of(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return {32, 32, 288, -1, -1, 32, -1, 0};
    case Q4_1: return {32, 32, 320, 32, -1, 64, -1, 0};
    case Q5_0: return {32, 32, 352, -1, -1, 32, 288, 1};
    case Q5_1: return {32, 32, 384, 32, -1, 64, 320, 1};
    case Q8_0: return {32, 32, 544, -1, -1, 32, -1, 0};
    case Q2_K: return {256, 16, 2624, 32, 64, 576, -1, 0};  // its 2-bit values kept as nibbles
    case Q4_K: return {256, 32, 2368, 32, 64, 320, -1, 0};
    case Q5_K: return {256, 32, 2880, 32, 64, 320, 2368, 1};
    case Q6_K: return {256, 16, 3360, -1, 32, 288, 2336, 2};
    case I4_G32: return {32, 32, 128 + 8 * 32, 64, -1, 128, -1, 0};
    case I4_G64: return {64, 64, 128 + 8 * 64, 64, -1, 128, -1, 0};
    case I4_G128: return {128, 128, 128 + 8 * 128, 64, -1, 128, -1, 0};
    case I8_G64: return {64, 64, 128 + 16 * 64, 64, -1, 128, -1, 0};
    case MXFP4: return {32, 32, 16 + 8 * 32, -1, 0, 16, -1, 0};  // E8M0 exponents u8 [16], then the codes
    default: TORCH_CHECK(false, "quantized products: GGML type ", qtype, " is not one of ours");
  }
}

// f(std::integral_constant<int64_t, qtype>) for a type of ours.
template <typename F>
inline void dispatch_type(int64_t qtype, F&& f) {
  switch (qtype) {
    case Q2_K: f(std::integral_constant<int64_t, Q2_K>{}); break;
    case Q4_0: f(std::integral_constant<int64_t, Q4_0>{}); break;
    case Q4_1: f(std::integral_constant<int64_t, Q4_1>{}); break;
    case Q5_0: f(std::integral_constant<int64_t, Q5_0>{}); break;
    case Q5_1: f(std::integral_constant<int64_t, Q5_1>{}); break;
    case Q8_0: f(std::integral_constant<int64_t, Q8_0>{}); break;
    case Q4_K: f(std::integral_constant<int64_t, Q4_K>{}); break;
    case Q5_K: f(std::integral_constant<int64_t, Q5_K>{}); break;
    case Q6_K: f(std::integral_constant<int64_t, Q6_K>{}); break;
    case I4_G32: f(std::integral_constant<int64_t, I4_G32>{}); break;
    case I4_G64: f(std::integral_constant<int64_t, I4_G64>{}); break;
    case I4_G128: f(std::integral_constant<int64_t, I4_G128>{}); break;
    case I8_G64: f(std::integral_constant<int64_t, I8_G64>{}); break;
    case MXFP4: f(std::integral_constant<int64_t, MXFP4>{}); break;
    default: TORCH_CHECK(false, "quantized products: GGML type ", qtype, " is not one of ours");
  }
}

// Q5_K and Q6_K keep a sub-block's high bits 2 KB past its nibbles: two streams a record, which the hardware
// prefetchers follow badly (one row on a Zen 4 read them at 8-10 GB/s, Q4_K at 24). A pass asks for sub-block
// `ahead`'s nibbles and high bits PREFETCH_SUBS sub-blocks before it multiplies them (Q5_K 1.6x, Q6_K 1.4x at one
// row: benchmarks/gguf_types.py); the types whose integers lie in one stream run as fast without.
constexpr int64_t PREFETCH_SUBS = 8;
constexpr bool split_high(int64_t t) { return t == Q5_K || t == Q6_K; }

// (always inlined: GCC takes an outlined function of prefetches alone for one without effects, and drops the call)
[[gnu::always_inline]] inline void prefetch_sub(const uint8_t* group, const Traits& t, int64_t qtype, int64_t ahead, int64_t subs) {
  if (ahead >= subs) return;
  const int64_t per_block = t.block / t.sub, at = (ahead % per_block) * t.sub;
  const uint8_t* rec = group + (ahead / per_block) * t.record;
  const int64_t per_dim = eight_bit(qtype) ? 16 : 8;  // bytes of the 16 rows' integers a dim (high bits apart)
  for (int64_t line = 0; line < t.sub * per_dim; line += 64) __builtin_prefetch(rec + t.low + at * per_dim + line);
  for (int64_t line = 0; line < t.sub * 2 * t.high_bits; line += 64)
    __builtin_prefetch(rec + t.high + at * 2 * t.high_bits + line);
}

[[maybe_unused]] inline float f16_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// One sub-block's 16 scales and offsets, and one stored integer, one row at a time: the portable path's, and
// the int8-activation reference's (csrc/quant_a8.cpp). The same values as the vector forms below.
template <int64_t T>
inline void scales_of(const uint8_t* rec, const Traits& t, int64_t j, float* scale, float* offset) {
  for (int c = 0; c < 16; ++c) {
    if constexpr (T == MXFP4) {
      const uint32_t bits = static_cast<uint32_t>(rec[c]) << 23;
      std::memcpy(scale + c, &bits, 4);
      scale[c] *= 0.5f;
      offset[c] = -12.0f * scale[c];
      continue;
    }
    if constexpr (float_scales(T)) {
      std::memcpy(scale + c, rec + 4 * c, 4);
      std::memcpy(offset + c, rec + t.second + 4 * c, 4);
      continue;
    }
    const float d = f16_to_float(rec + 2 * c);
    if constexpr (T == Q4_0 || T == Q5_0 || T == Q8_0) {
      scale[c] = d;
      offset[c] = T == Q4_0 ? -8.0f * d : T == Q5_0 ? -16.0f * d : 0.0f;
    } else if constexpr (T == Q4_1 || T == Q5_1) {
      scale[c] = d;
      offset[c] = f16_to_float(rec + t.second + 2 * c);
    } else if constexpr (sub_mins(T)) {
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
  if constexpr (eight_bit(T)) {
    return static_cast<float>(static_cast<int8_t>(rec[t.low + (k / 2) * 32 + 2 * c + k % 2]));
  } else {
    const uint8_t byte = rec[t.low + (k / 2) * 16 + c];
    int q = k % 2 ? (byte >> 4) : (byte & 15);
    if constexpr (T == MXFP4) q = MXFP4_Q[q];
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

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(ENGINE_ROWS_AVX2)
// AVX-512: the 16 rows of a group are one vector.
#define ENGINE_QUANT_AVX512 1
constexpr bool high_one(int64_t t) { return t == Q5_0 || t == Q5_1 || t == Q5_K; }

template <int64_t T>
inline void scales_of(const uint8_t* rec, const Traits& t, int64_t j, __m512& s, __m512& o) {
  if constexpr (T == MXFP4) {  // 2^(e - 127) from the exponent bits, halved (exact; e = 0 gives 0)
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec)));
    s = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(e, 23)), _mm512_set1_ps(0.5f));
    o = _mm512_mul_ps(s, _mm512_set1_ps(-12.0f));
    return;
  }
  if constexpr (float_scales(T)) {
    s = _mm512_loadu_ps(reinterpret_cast<const float*>(rec));
    o = _mm512_loadu_ps(reinterpret_cast<const float*>(rec + t.second));
    return;
  }
  s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
  if constexpr (T == Q4_0 || T == Q5_0) {
    o = _mm512_mul_ps(s, _mm512_set1_ps(T == Q4_0 ? -8.0f : -16.0f));
  } else if constexpr (T == Q8_0) {
    o = _mm512_setzero_ps();
  } else if constexpr (T == Q4_1 || T == Q5_1) {
    o = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + t.second)));
  } else if constexpr (sub_mins(T)) {
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
  if constexpr (eight_bit(T)) {  // 16-bit words (row c's dim k, dim k + 1): the low or the high byte, signed
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + t.low + (k / 2) * 32));
    const __m256i q = k % 2 ? _mm256_srai_epi16(words, 8) : _mm256_srai_epi16(_mm256_slli_epi16(words, 8), 8);
    return _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(q));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.low + (k / 2) * 16));
    const __m128i nibble = _mm_set1_epi8(15);
    __m128i codes = _mm_and_si128(k % 2 ? _mm_srli_epi16(v, 4) : v, nibble);
    if constexpr (T == MXFP4) codes = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(MXFP4_Q)), codes);
    __m512i q = _mm512_cvtepu8_epi32(codes);
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
  if constexpr (eight_bit(T)) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + t.low + k * 16));
    first = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_srai_epi16(_mm256_slli_epi16(words, 8), 8)));
    second = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_srai_epi16(words, 8)));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.low + k * 8));  // dims k, k + 1
    const __m128i nibble = _mm_set1_epi8(15);
    __m128i lo = _mm_and_si128(v, nibble), hi = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);
    if constexpr (T == MXFP4) {
      const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(MXFP4_Q));
      lo = _mm_shuffle_epi8(lut, lo), hi = _mm_shuffle_epi8(lut, hi);
    }
    __m512i a = _mm512_cvtepu8_epi32(lo);
    __m512i b = _mm512_cvtepu8_epi32(hi);
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
      if constexpr (split_high(T)) prefetch_sub(group, t, T, b * subs + j + PREFETCH_SUBS, blocks * subs);
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
  if constexpr (T == MXFP4) {
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec));
    const __m256 half = _mm256_set1_ps(0.5f), bias = _mm256_set1_ps(-12.0f);
    s0 = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(e), 23)), half);
    s1 = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(e, 8)), 23)), half);
    o0 = _mm256_mul_ps(s0, bias), o1 = _mm256_mul_ps(s1, bias);
    return;
  }
  if constexpr (float_scales(T)) {
    const float* f = reinterpret_cast<const float*>(rec);
    s0 = _mm256_loadu_ps(f), s1 = _mm256_loadu_ps(f + 8);
    o0 = _mm256_loadu_ps(f + t.second / 4), o1 = _mm256_loadu_ps(f + t.second / 4 + 8);
    return;
  }
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
  } else if constexpr (sub_mins(T)) {
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
  if constexpr (eight_bit(T)) {  // 16-bit words (row c's dim k, dim k + 1): the low or the high byte, signed
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + t.low + (k / 2) * 32));
    const __m256i q = k % 2 ? _mm256_srai_epi16(words, 8) : _mm256_srai_epi16(_mm256_slli_epi16(words, 8), 8);
    q0 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(q)));
    q1 = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm256_extracti128_si256(q, 1)));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.low + (k / 2) * 16));
    __m128i nibbles = _mm_and_si128(k % 2 ? _mm_srli_epi16(v, 4) : v, _mm_set1_epi8(15));
    if constexpr (T == MXFP4)
      nibbles = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(MXFP4_Q)), nibbles);
    __m256i i0 = _mm256_cvtepu8_epi32(nibbles);
    __m256i i1 = _mm256_cvtepu8_epi32(_mm_srli_si128(nibbles, 8));
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
      if constexpr (split_high(T)) prefetch_sub(group, t, T, b * subs + j + PREFETCH_SUBS, blocks * subs);
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
void dequant_record(const uint8_t* rec, const Traits& t, float* w) {
  float scale[16], offset[16];
  for (int64_t j = 0; j < t.block / t.sub; ++j) {
    scales_of<T>(rec, t, j, scale, offset);
    for (int64_t k = j * t.sub; k < (j + 1) * t.sub; ++k)
      for (int c = 0; c < 16; ++c) w[k * 16 + c] = std::fma(scale[c], q_of<T>(rec, t, k, c), offset[c]);
  }
}
#endif

}  // namespace quant_kernel
