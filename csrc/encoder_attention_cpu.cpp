// Attention of encoder inputs that see each other both ways (BERT; bidirectional, no mask, no cache), each
// input one segment of the step's rows, attended to by itself alone.
// Reference: torch's scaled_dot_product_attention over one segment (worker/models/bert.py BertLayer).
//
// encoder_attention(q, k, v [T, H * D] float32 or bf16, each row contiguous, any row stride (column slices
//   of a fused qkv product), segments int64 [S, 2] (segment s is rows [start, end)), heads H,
//   scale) -> [T, H * D] of q's dtype: softmax(scale q k^T) v per segment and head, in float32, rounded
//   once at the end.
//
// A (segment, head) is one unit of work on one thread: its keys transposed and its values in float32 in
// the thread's scratch, then query rows in blocks of ROWS. Each score is one sum over the head's dims in
// order, each output one sum over the segment's keys in order, so a segment's result depends on nothing
// else in the step (batch-invariant) nor on the thread count. bf16 with AVX-512 BF16 takes
// attend_unit_pairs (two dims, or two keys, a vdpbf16ps step). torch's CPU flash kernel took 5.3-7.8 ms a
// layer for 28 inputs of ~73 tokens (12 heads of 32 dims), a call per input, where this takes 1.8 (bf16);
// 30 ms for Whisper-base's 1,500 frames, where this takes 13.8 (benchmarks/results/
// 2026-12-06-lab-notes-encoder-attention-zen4.md has the measurements). The bf16 form's softmax is one pass
// (the rows' maxima kept while the scores are made, powers of two by scalef, the weights rounded to bf16 as
// they are summed) and its keys are gathered 16 at a time: Whisper's 14.5-14.9 -> 13.1-13.4 ms, BERT's 1.6
// -> 1.35, in turns on Zen 4 (2026-12-07-lab-notes-speech-attention-zen4.md).
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

namespace {

// query rows a block: as many accumulators of 16 key scores (or of 16 output dims), each one AVX-512
// register or two AVX2 ones (16 of those in all)
#if defined(__AVX512F__)
constexpr int64_t ROWS = 8;
#else
constexpr int64_t ROWS = 4;
#endif
constexpr int64_t KEYS = 16;  // key scores a block of the score pass

// 16 float32 lanes: one AVX-512 register, two AVX2 ones, four SSE ones (GCC's vector extension)
typedef float F16 __attribute__((vector_size(64)));

inline F16 load16(const float* p) {
  F16 x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline void store16(float* p, F16 x) { std::memcpy(p, &x, sizeof x); }

template <typename T>
inline float as_float(T x) {
  return static_cast<float>(x);
}

// The row's n scores -> exp(score - max) in place; returns 1 / their sum. Apart, so that its loops vectorize
// (inside attend_unit's row loop GCC left the exp loop scalar).
[[gnu::noinline]] float exp_row(float* row, int64_t n) {
  float top = row[0];
  for (int64_t j = 1; j < n; ++j) top = std::max(top, row[j]);
  for (int64_t j = 0; j < n; ++j) row[j] = exp_f32(row[j] - top);
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) sum += row[j];
  return 1.f / sum;
}

// One (segment, head): rows [begin, end) of q, k, v at column `col`, into out (row stride out_stride).
template <typename T>
void attend_unit(const T* q, const T* k, const T* v, int64_t stride, int64_t begin, int64_t end, int64_t col,
                 int64_t dim, float scale, T* out, int64_t out_stride, std::vector<float>& scratch) {
  const int64_t n = end - begin, keys = (n + KEYS - 1) / KEYS * KEYS, width = (dim + 15) / 16 * 16;
  scratch.resize(static_cast<size_t>(dim * keys + n * width + ROWS * keys + ROWS * dim));
  float* kt = scratch.data();    // [dim][keys]: the keys transposed, zeros past n
  float* vf = kt + dim * keys;   // [n][width]: zeros past dim
  float* s = vf + n * width;     // [ROWS][keys]: a block's scores, then weights
  float* qf = s + ROWS * keys;   // [ROWS][dim]
  for (int64_t j = 0; j < keys; ++j)
    for (int64_t d = 0; d < dim; ++d)
      kt[d * keys + j] = j < n ? as_float(k[(begin + j) * stride + col + d]) : 0.f;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < width; ++d) vf[j * width + d] = d < dim ? as_float(v[(begin + j) * stride + col + d]) : 0.f;
  for (int64_t r0 = 0; r0 < n; r0 += ROWS) {
    const int64_t rows = std::min(ROWS, n - r0);
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t d = 0; d < dim; ++d)
        qf[r * dim + d] = r < rows ? as_float(q[(begin + r0 + r) * stride + col + d]) : 0.f;
    // scores: for each block of 16 keys, ROWS x 16 sums over the dims in order
    for (int64_t j0 = 0; j0 < keys; j0 += KEYS) {
      F16 acc[ROWS];
#pragma GCC unroll 8
      for (int64_t r = 0; r < ROWS; ++r) acc[r] = F16{};
      for (int64_t d = 0; d < dim; ++d) {
        const F16 line = load16(kt + d * keys + j0);
#pragma GCC unroll 8
        for (int64_t r = 0; r < ROWS; ++r) acc[r] += qf[r * dim + d] * line;
      }
#pragma GCC unroll 8
      for (int64_t r = 0; r < ROWS; ++r) store16(s + r * keys + j0, acc[r] * scale);
    }
    // softmax over the n keys of each row, in float32
    float inv_sum[ROWS];
    for (int64_t r = 0; r < ROWS; ++r) inv_sum[r] = exp_row(s + r * keys, n);
    // outputs: ROWS x dim sums over the keys in order, in blocks of 16 dims (vf's rows padded to 16)
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
      F16 acc[ROWS];
#pragma GCC unroll 8
      for (int64_t r = 0; r < ROWS; ++r) acc[r] = F16{};
      for (int64_t j = 0; j < n; ++j) {
        const F16 line = load16(vf + j * width + d0);
#pragma GCC unroll 8
        for (int64_t r = 0; r < ROWS; ++r) acc[r] += s[r * keys + j] * line;
      }
      const int64_t cols = std::min<int64_t>(16, dim - d0);
      for (int64_t r = 0; r < rows; ++r) {
        float sums[16];
        store16(sums, acc[r] * inv_sum[r]);
        for (int64_t d = 0; d < cols; ++d) out[(begin + r0 + r) * out_stride + col + d0 + d] = static_cast<T>(sums[d]);
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
inline uint32_t bf16_pair(const c10::BFloat16* p) {
  uint32_t x;
  std::memcpy(&x, p, sizeof x);
  return x;
}

inline __m512bh broadcast_pair(uint32_t x) { return as_bf16_pairs(_mm512_set1_epi32(static_cast<int32_t>(x))); }

// The first `count` of 16 lanes (none below 0, all from 16).
inline __mmask16 lanes_below(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : count <= 0 ? 0 : static_cast<__mmask16>((1u << count) - 1);
}

// ROWS rows' scores against 32 keys (two lines of 16) over the head's dim pairs: 16 accumulators, so that each
// line and each broadcast pair feeds several vdpbf16ps (one of each a vdpbf16ps left the loads the limit).
// The scores are stored times `scale` (log2(e) folded in: softmax_row takes powers of two), and each row's
// running maximum `top` (16 lanes a row, in memory: kept in registers across blocks, they pushed the
// block's key lines out of them) takes the block's keys that exist (`valid` of the 32; zeros pad the rest).
[[gnu::noinline]] void score_block(const uint32_t* kt2, int64_t keys, int64_t j0, const uint32_t* q2,
                                   int64_t dpairs, float scale, float* s, float* top, int64_t valid) {
  __m512 acc[ROWS][2];
#pragma GCC unroll 8
  for (int64_t r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dpairs; ++d) {
    const __m512bh a = as_bf16_pairs(_mm512_loadu_si512(kt2 + d * keys + j0));
    const __m512bh b = as_bf16_pairs(_mm512_loadu_si512(kt2 + d * keys + j0 + 16));
#pragma GCC unroll 8
    for (int64_t r = 0; r < ROWS; ++r) {
      const __m512bh x = broadcast_pair(q2[r * dpairs + d]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, x);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, x);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  const __mmask16 lo = lanes_below(valid), hi = lanes_below(valid - 16);
#pragma GCC unroll 8
  for (int64_t r = 0; r < ROWS; ++r) {
    const __m512 first = _mm512_mul_ps(acc[r][0], sc), second = _mm512_mul_ps(acc[r][1], sc);
    _mm512_storeu_ps(s + r * keys + j0, first);
    _mm512_storeu_ps(s + r * keys + j0 + 16, second);
    __m512 most = _mm512_loadu_ps(top + 16 * r);
    most = _mm512_mask_max_ps(most, lo, most, first);
    _mm512_storeu_ps(top + 16 * r, _mm512_mask_max_ps(most, hi, most, second));
  }
}

// 2^x for x <= 0 (an exponent, and a polynomial in the rest, |f| <= 1/2: Taylor to f^6, relative error
// ~1.2e-7); scalef takes exponents far below the normal floats to zero.
inline __m512 exp2_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5403530393e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// One row's softmax weights in one pass over its scores (log2 units, `top` their maximum): 2^(s - top) for
// the n keys that exist, zero past them, rounded to bf16 pairs into p; returns 1 / their float32 sum.
inline float softmax_row(const float* row, int64_t n, int64_t keys, float top, uint32_t* p) {
  const __m512 m = _mm512_set1_ps(top);
  __m512 sum_lo = _mm512_setzero_ps(), sum_hi = _mm512_setzero_ps();
  for (int64_t j = 0; j < keys; j += 32) {  // keys is a multiple of 32
    const __m512 lo = _mm512_maskz_mov_ps(lanes_below(n - j), exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + j), m)));
    const __m512 hi =
        _mm512_maskz_mov_ps(lanes_below(n - j - 16), exp2_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + j + 16), m)));
    sum_lo = _mm512_add_ps(sum_lo, lo);
    sum_hi = _mm512_add_ps(sum_hi, hi);
    const __m512bh both = _mm512_cvtne2ps_pbh(hi, lo);
    _mm512_storeu_si512(p + j / 2, reinterpret_cast<const __m512i&>(both));
  }
  return 1.f / _mm512_reduce_add_ps(_mm512_add_ps(sum_lo, sum_hi));
}

// 4 rows' outputs in LINES lines of 16 dims from d0, over the key pairs: 4 x LINES accumulators.
template <int LINES>
void output_block(const uint32_t* v2, int64_t width, int64_t d0, const uint32_t* p, int64_t kpairs,
                  int64_t used_pairs, float* sums) {
  __m512 acc[4][LINES];
  for (int r = 0; r < 4; ++r)
    for (int l = 0; l < LINES; ++l) acc[r][l] = _mm512_setzero_ps();
  for (int64_t jp = 0; jp < used_pairs; ++jp) {
    __m512bh line[LINES];
    for (int l = 0; l < LINES; ++l) line[l] = as_bf16_pairs(_mm512_loadu_si512(v2 + jp * width + d0 + 16 * l));
    for (int r = 0; r < 4; ++r) {
      const __m512bh x = broadcast_pair(p[r * kpairs + jp]);
      for (int l = 0; l < LINES; ++l) acc[r][l] = _mm512_dpbf16_ps(acc[r][l], line[l], x);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int l = 0; l < LINES; ++l) _mm512_storeu_ps(sums + r * width + d0 + 16 * l, acc[r][l]);
}

// The same for bf16 with AVX-512 BF16 (head dims even): vdpbf16ps sums two dims (scores) or two keys
// (outputs) a step, half the instructions. The keys go as pairs of dims [dim / 2][keys], the values as
// pairs of keys [keys / 2][width], each row's weights rounded to bf16 for the outputs' products (as torch's
// CPU flash kernel rounds them for its second product); the sum they are divided by stays float32.
void attend_unit_pairs(const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v, int64_t stride,
                       int64_t begin, int64_t end, int64_t col, int64_t dim, float scale, c10::BFloat16* out,
                       int64_t out_stride, std::vector<float>& scratch) {
  const int64_t n = end - begin, keys = (n + 31) / 32 * 32, width = (dim + 15) / 16 * 16;
  const int64_t dpairs = dim / 2, kpairs = keys / 2;
  const float scale2 = scale * 1.44269504088896341f;  // scores in log2 units: softmax_row takes powers of 2
  // float32 slots: kt2 [dpairs][keys], v2 [kpairs][width], s [ROWS][keys], p [ROWS][keys / 2],
  // q2 [ROWS][dpairs], sums [ROWS][width]
  scratch.resize(static_cast<size_t>(dpairs * keys + kpairs * width + ROWS * keys + ROWS * kpairs +
                                     ROWS * dpairs + ROWS * width));
  auto* kt2 = reinterpret_cast<uint32_t*>(scratch.data());
  auto* v2 = kt2 + dpairs * keys;
  float* s = reinterpret_cast<float*>(v2 + kpairs * width);
  auto* p = reinterpret_cast<uint32_t*>(s + ROWS * keys);
  auto* q2 = p + ROWS * kpairs;
  float* sums = reinterpret_cast<float*>(q2 + ROWS * dpairs);
  // 16 keys' dim pair d gathered into one line of kt2 (stored key by key, each dim pair's line was a store
  // to another cache line: 7% of a Whisper layer's attention)
  const __m512i key_rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(static_cast<int32_t>(stride)));
  for (int64_t j0 = 0; j0 < keys; j0 += 16) {
    const __mmask16 exist = lanes_below(n - j0);
    const c10::BFloat16* first = k + (begin + std::min(j0, n - 1)) * stride + col;
    for (int64_t d = 0; d < dpairs; ++d)  // element offsets (scale 2: any row stride, even or odd)
      _mm512_storeu_si512(kt2 + d * keys + j0,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), exist, key_rows, first + 2 * d, 2));
  }
  const auto* vbits = reinterpret_cast<const uint16_t*>(v);
  for (int64_t jp = 0; jp < kpairs; ++jp)
    for (int64_t d = 0; d < width; ++d) {
      const int64_t j = 2 * jp;
      const uint32_t lo = j < n && d < dim ? vbits[(begin + j) * stride + col + d] : 0u;
      const uint32_t hi = j + 1 < n && d < dim ? vbits[(begin + j + 1) * stride + col + d] : 0u;
      v2[jp * width + d] = lo | (hi << 16);
    }
  for (int64_t r0 = 0; r0 < n; r0 += ROWS) {
    const int64_t rows = std::min(ROWS, n - r0);
    for (int64_t r = 0; r < ROWS; ++r)
      for (int64_t d = 0; d < dpairs; ++d)
        q2[r * dpairs + d] = r < rows ? bf16_pair(q + (begin + r0 + r) * stride + col + 2 * d) : 0u;
    float top[ROWS * 16];
    std::fill(top, top + ROWS * 16, std::numeric_limits<float>::lowest());
    for (int64_t j0 = 0; j0 < keys; j0 += 32) score_block(kt2, keys, j0, q2, dpairs, scale2, s, top, n - j0);
    float inv_sum[ROWS];
    for (int64_t r = 0; r < ROWS; ++r)
      inv_sum[r] = softmax_row(s + r * keys, n, keys, _mm512_reduce_max_ps(_mm512_loadu_ps(top + 16 * r)), p + r * kpairs);
    const int64_t used_pairs = (n + 1) / 2;
    for (int64_t r4 = 0; r4 < ROWS; r4 += 4) {
      if (r4 >= rows) break;
      for (int64_t d0 = 0; d0 < width; d0 += 64) {
        const int64_t lines = std::min<int64_t>(4, (width - d0) / 16);
        const uint32_t* pr = p + r4 * kpairs;
        float* sr = sums + r4 * width;
        if (lines == 4) output_block<4>(v2, width, d0, pr, kpairs, used_pairs, sr);
        else if (lines == 3) output_block<3>(v2, width, d0, pr, kpairs, used_pairs, sr);
        else if (lines == 2) output_block<2>(v2, width, d0, pr, kpairs, used_pairs, sr);
        else output_block<1>(v2, width, d0, pr, kpairs, used_pairs, sr);
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < dim; ++d)
        out[(begin + r0 + r) * out_stride + col + d] = static_cast<c10::BFloat16>(sums[r * width + d] * inv_sum[r]);
  }
}
#define ENGINE_ENCODER_PAIRS 1
#endif

template <typename T>
void attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const int64_t* bounds,
            int64_t count, int64_t heads, int64_t dim, float scale, torch::Tensor& out) {
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t stride = q.stride(0), out_stride = out.stride(0);
  // q, k and v share a row stride (views of one fused product, or three tensors of one shape); their
  // offsets from q's data differ, so each is addressed from its own pointer
  at::parallel_for(0, count * heads, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scratch;
    for (int64_t unit = first; unit < last; ++unit) {
      const int64_t seg = unit / heads, head = unit % heads;
#if defined(ENGINE_ENCODER_PAIRS)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (dim % 2 == 0) {
          attend_unit_pairs(qp, kp, vp, stride, bounds[2 * seg], bounds[2 * seg + 1], head * dim, dim, scale, op,
                            out_stride, scratch);
          continue;
        }
      }
#endif
      attend_unit<T>(qp, kp, vp, stride, bounds[2 * seg], bounds[2 * seg + 1], head * dim, dim, scale, op,
                     out_stride, scratch);
    }
  });
}

}  // namespace

torch::Tensor encoder_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor segments,
                                int64_t heads, double scale) {
  TORCH_CHECK(q.dim() == 2 && k.sizes() == q.sizes() && v.sizes() == q.sizes(), "encoder_attention: q, k, v [T, H*D]");
  TORCH_CHECK(q.stride(1) == 1 && k.stride(1) == 1 && v.stride(1) == 1, "encoder_attention: rows contiguous");
  TORCH_CHECK(k.stride(0) == q.stride(0) && v.stride(0) == q.stride(0), "encoder_attention: one row stride");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "encoder_attention: one dtype");
  TORCH_CHECK(heads > 0 && q.size(1) % heads == 0, "encoder_attention: heads divide the width");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 2, "encoder_attention: segments [S, 2]");
  const auto b = segments.to(at::kLong).contiguous();
  const int64_t count = b.size(0), rows = q.size(0);
  const int64_t* bp = b.data_ptr<int64_t>();
  for (int64_t s = 0; s < count; ++s)
    TORCH_CHECK(0 <= bp[2 * s] && bp[2 * s] < bp[2 * s + 1] && bp[2 * s + 1] <= rows,
                "encoder_attention: rows of segment ", s);
  // rows no segment covers stay zero
  auto out = torch::zeros({rows, q.size(1)}, q.options());
  const int64_t dim = q.size(1) / heads;
  const float sc = static_cast<float>(scale);
  if (q.scalar_type() == at::kFloat) {
    attend<float>(q, k, v, bp, count, heads, dim, sc, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    attend<c10::BFloat16>(q, k, v, bp, count, heads, dim, sc, out);
  } else {
    TORCH_CHECK(false, "encoder_attention takes float32 or bf16");
  }
  return out;
}
