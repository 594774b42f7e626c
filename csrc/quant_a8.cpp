// Products on packed blocks with int8 activations (--activation-quantization int8, docs/quantization.md): as
// llama.cpp multiplies its quantized files, each row of x is quantized to int8 per block of 32 dims and
// multiplied by the stored integers in int32 (AVX-512 VNNI's vpdpbusd), then scaled once per segment in float32.
// The packing is linear_quant's (csrc/quant_cpu.cpp); a part whose type carries A8_BIT takes this product.
//
// linear_a8_parts(x [M, K] float32 or bf16, packed, parts [P, 4] (type | A8_BIT, first column, columns, byte
// offset), bias [N] or empty, N) -> [M, N] in x's dtype.
// linear_quant_a8(x, packed [N / 16, K / B, record], qtype, bias, N, reference): one part; reference=True takes
// the portable loop (the tests check the two give the same bits).
//
// Per row and block of 32 dims: a = max |x|, d = a / 127, q = round-half-even(x * (127 / a)) (all 0 where a is 0),
// in IEEE float32 (this file is built without -ffast-math). A weight is s q_u + o with q_u its stored integer,
// unsigned (the 8-bit types' int8 plus 128), and s and o its sub-block's scale and offset (csrc/quant_cpu.cpp
// has them per type). Per segment (16 dims where sub-blocks are 16, else 32), row and column:
//   P = c X + sum q_u q, exact in int32 (c: the type's integer offset, Q4_0's -8, Q5_0's -16, Q6_K's -32,
//       the 8-bit types' -128, MXFP4's -12, else 0; X: the segment's sum of q);
//   acc = fma(float(P), s * d, acc), and for the types with offsets of their own (Q4_1, Q5_1, Q2_K, Q4_K,
//   Q5_K, the integer types) acc = fma(o, d * float(X), acc).
// y = acc + bias, rounded once to x's dtype. A row's steps do not depend on the other rows: batch-invariant.
#pragma GCC optimize("no-fast-math")
#include "ops.h"
#include "quant_a8.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace quant_kernel;

// Row m's quantized blocks: q [M][K], d [M][K / 32], the sums of q per 16 dims [M][K / 16].
struct A8Rows {
  int64_t rows, k;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum16;
};

template <typename X>
A8Rows quantize(const X* x, int64_t rows, int64_t k, bool reference) {
  A8Rows a{rows, k, std::vector<int8_t>(rows * k), std::vector<float>(rows * k / 32), std::vector<int32_t>(rows * k / 16)};
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    float block[32];
    for (int64_t m = begin; m < end; ++m)
      for (int64_t b = 0; b < k / 32; ++b) {
        for (int i = 0; i < 32; ++i) block[i] = static_cast<float>(x[m * k + b * 32 + i]);
        int8_t* q = a.q.data() + m * k + b * 32;
        a.d[m * (k / 32) + b] = quantize_block(block, q, reference);
        for (int h = 0; h < 2; ++h) {
          int32_t sum = 0;
          for (int i = 0; i < 16; ++i) sum += q[16 * h + i];
          a.sum16[m * (k / 16) + 2 * b + h] = sum;
        }
      }
  });
  return a;
}

// The portable loop: rows against one group of 16 columns, the contract's steps one value at a time.
template <int64_t T, typename O>
void reference_group(const A8Rows& a, const uint8_t* group, const Traits& t, const float* bias, O* y, int64_t ldy) {
  const int64_t k = a.k, seg = segment_of(T);
  for (int64_t m = 0; m < a.rows; ++m) {
    float acc[16] = {};
    for (int64_t s = 0; s < k / seg; ++s) {
      const int64_t first = s * seg, b = first / t.block, j = (first % t.block) / t.sub;
      const uint8_t* rec = group + b * t.record;
      float scale[16], offset[16];
      scales_of<T>(rec, t, j, scale, offset);
      const float d = a.d[m * (k / 32) + first / 32];
      int32_t x_sum = 0;
      for (int64_t h = first / 16; h < (first + seg) / 16; ++h) x_sum += a.sum16[m * (k / 16) + h];
      for (int c = 0; c < 16; ++c) {
        int32_t p = int_offset(T) * x_sum;
        for (int64_t i = 0; i < seg; ++i) {
          const int64_t kk = first % t.block + i;
          int32_t q = static_cast<int32_t>(q_of<T>(rec, t, kk, c));
          if constexpr (eight_bit(T)) q += 128;
          p += q * a.q[m * k + first + i];
        }
        acc[c] = std::fma(static_cast<float>(p), scale[c] * d, acc[c]);
        if constexpr (free_offset(T)) acc[c] = std::fma(offset[c], d * static_cast<float>(x_sum), acc[c]);
      }
    }
    for (int c = 0; c < 16; ++c) y[m * ldy + c] = static_cast<O>(bias != nullptr ? acc[c] + bias[c] : acc[c]);
  }
}

#if defined(ENGINE_A8_VNNI)
// The rows a pass at a time (A8_ROWS, the last pass the rest): the pass of rows r .. r + R - 1 holds row m's
// quad of dims (4i .. 4i + 3) at r * K / 4 + i * R + m, and its segment values at r * (K / seg) + s * R + m,
// so a pass's broadcasts lie at fixed offsets from one pointer.
inline int64_t pass_width(int64_t rows, int64_t r) { return std::min<int64_t>(A8_ROWS, rows - r); }

std::vector<int32_t> pass_quads(const A8Rows& a) {
  const int64_t quads = a.k / 4;
  std::vector<int32_t> out(a.rows * quads);
  for (int64_t r = 0; r < a.rows; r += pass_width(a.rows, r)) {
    const int64_t w = pass_width(a.rows, r);
    for (int64_t m = 0; m < w; ++m)
      for (int64_t i = 0; i < quads; ++i) std::memcpy(&out[r * quads + i * w + m], &a.q[(r + m) * a.k + 4 * i], 4);
  }
  return out;
}

// Per pass, row and segment: P's start (c X), d, and d * float(X).
struct PassSegments {
  std::vector<int32_t> start;
  std::vector<float> d, dx;
};

PassSegments pass_segments(const A8Rows& a, int64_t seg, int32_t c) {
  const int64_t segs = a.k / seg, per = seg / 16;
  PassSegments out{std::vector<int32_t>(a.rows * segs), std::vector<float>(a.rows * segs), std::vector<float>(a.rows * segs)};
  for (int64_t r = 0; r < a.rows; r += pass_width(a.rows, r)) {
    const int64_t w = pass_width(a.rows, r);
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

// R rows against the widened segments [s0, s1) of one group (tile and so hold them from s0 on): P per segment in
// int32, then the float steps of the contract into acc (row m's 16 at acc + 16 m, carried from chunk to chunk).
template <int R, int64_t T>
void a8_pass(const int32_t* xq, const int32_t* start, const float* ds, const float* dx, int64_t s0, int64_t s1,
             int64_t seg, const __m512i* tile, const __m512* so, float* accs) {
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_load_ps(accs + 16 * m);
  const int64_t per = seg / 4;
  for (int64_t s = s0; s < s1; ++s) {
    __m512i p[R];
    for (int m = 0; m < R; ++m) p[m] = _mm512_set1_epi32(start[s * R + m]);
    for (int64_t i = 0; i < per; ++i) {
      const __m512i w = _mm512_load_si512(tile + (s - s0) * per + i);
      const int32_t* x = xq + (s * per + i) * R;
      for (int m = 0; m < R; ++m) p[m] = _mm512_dpbusd_epi32(p[m], w, _mm512_set1_epi32(x[m]));
    }
    const __m512 sc = so[2 * (s - s0)];
    for (int m = 0; m < R; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[m]), _mm512_mul_ps(sc, _mm512_set1_ps(ds[s * R + m])), acc[m]);
    if constexpr (free_offset(T)) {
      const __m512 off = so[2 * (s - s0) + 1];
      for (int m = 0; m < R; ++m) acc[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(dx[s * R + m]), acc[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_store_ps(accs + 16 * m, acc[m]);
}

// Up to A8_ROWS rows (one pass: a decode step) against one group, its integers widened in registers on the way
// (no tile): the same steps as a8_pass, in the same order.
template <int R, int64_t T>
void a8_fused(const int32_t* xq, const int32_t* start, const float* ds, const float* dx, int64_t k,
              const uint8_t* group, const Traits& t, float* accs) {
  constexpr int64_t seg = segment_of(T), per = seg / 4;
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < k / seg; ++s) {
    const int64_t first = s * seg, within = first % t.block;
    const uint8_t* rec = group + (first / t.block) * t.record;
    __m512i p[R];
    for (int m = 0; m < R; ++m) p[m] = _mm512_set1_epi32(start[s * R + m]);
    for (int64_t i = 0; i < per; i += 2) {
      __m512i w[2];
      widen_chunk<T>(rec, t, within + 4 * i, w);
      const int32_t* x = xq + (s * per + i) * R;
      for (int m = 0; m < R; ++m) p[m] = _mm512_dpbusd_epi32(p[m], w[0], _mm512_set1_epi32(x[m]));
      for (int m = 0; m < R; ++m) p[m] = _mm512_dpbusd_epi32(p[m], w[1], _mm512_set1_epi32(x[R + m]));
    }
    __m512 sc, off;
    scales_of<T>(rec, t, within / t.sub, sc, off);
    for (int m = 0; m < R; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[m]), _mm512_mul_ps(sc, _mm512_set1_ps(ds[s * R + m])), acc[m]);
    if constexpr (free_offset(T))
      for (int m = 0; m < R; ++m) acc[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(dx[s * R + m]), acc[m]);
  }
  for (int m = 0; m < R; ++m) _mm512_store_ps(accs + 16 * m, acc[m]);
}

// More rows: a group is widened CHUNK dims at a time (the tile stays in L1) and every pass of rows runs over each
// chunk.
constexpr int64_t CHUNK = 512;
// Up to one pass of rows widens in registers (a8_fused; on a Zen 4, Q5_0 [2048, 2048], 1 and 4 rows took 0.9-1.0x
// the tiles' time, 8 rows 0.8x); more rows take the tiles (at 12 and 16 rows, fused passes of 8 took 1.06-1.18x).
constexpr int64_t FUSED_MAX = A8_ROWS;

template <int64_t T, typename O>
void run_vnni(const std::vector<int32_t>& quads, const A8Rows& a, const uint8_t* w, const Traits& t,
              const float* bias, O* out, int64_t n, int64_t ldy) {
  const int64_t k = a.k, rows = a.rows, seg = segment_of(T), segs = k / seg, group_bytes = (k / t.block) * t.record;
  const int64_t chunk = std::max(CHUNK / t.block, int64_t{1}) * t.block;
  const PassSegments ps = pass_segments(a, seg, int_offset(T));
  at::parallel_for(0, n / COLS, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512i> tile(chunk / 4);
    std::vector<__m512> so(2 * chunk / seg);
    std::vector<__m512> accs(rows);
    for (int64_t g = begin; g < end; ++g) {
      float* acc = reinterpret_cast<float*>(accs.data());
      const bool fused = rows <= FUSED_MAX;
      for (int64_t r = 0; fused && r < rows; r += pass_width(rows, r)) {  // widened in registers, pass by pass
        const uint8_t* group = w + g * group_bytes;
        const int32_t* xq = quads.data() + r * (k / 4);
        const int32_t* st = ps.start.data() + r * segs;
        const float* ds = ps.d.data() + r * segs;
        const float* dx = ps.dx.data() + r * segs;
        switch (pass_width(rows, r)) {
#define ENGINE_FUSED(R) \
  case R: a8_fused<R, T>(xq, st, ds, dx, k, group, t, acc + 16 * r); break;
          ENGINE_FUSED(1) ENGINE_FUSED(2) ENGINE_FUSED(3) ENGINE_FUSED(4) ENGINE_FUSED(5) ENGINE_FUSED(6)
          ENGINE_FUSED(7)
#undef ENGINE_FUSED
          default: a8_fused<A8_ROWS, T>(xq, st, ds, dx, k, group, t, acc + 16 * r);
        }
      }
      if (!fused) std::fill(accs.begin(), accs.end(), _mm512_setzero_ps());
      for (int64_t k0 = 0; k0 < k && !fused; k0 += chunk) {
        const int64_t dims = std::min(chunk, k - k0), s0 = k0 / seg, s1 = (k0 + dims) / seg;
        const uint8_t* bytes = w + g * group_bytes + (k0 / t.block) * t.record;
        widen_group<T>(bytes, t, dims, tile.data(), so.data());
        // with several passes, the bytes that follow (the next chunk, or the next group's first) are asked for
        // while the passes run (the hardware prefetchers stop at the pause; one pass streams as fast without)
        const int64_t read = (dims / t.block) * t.record;
        const uint8_t* next = bytes + read;
        if (rows > A8_ROWS)
          for (int64_t line = 0; line < read && next + line < w + end * group_bytes; line += 64)
            __builtin_prefetch(next + line);
        for (int64_t r = 0; r < rows; r += pass_width(rows, r)) {
          const int32_t* xq = quads.data() + r * (k / 4);
          const int32_t* st = ps.start.data() + r * segs;
          const float* ds = ps.d.data() + r * segs;
          const float* dx = ps.dx.data() + r * segs;
          switch (pass_width(rows, r)) {
#define ENGINE_PASS(R) \
  case R: a8_pass<R, T>(xq, st, ds, dx, s0, s1, seg, tile.data(), so.data(), acc + 16 * r); break;
            ENGINE_PASS(1) ENGINE_PASS(2) ENGINE_PASS(3) ENGINE_PASS(4) ENGINE_PASS(5) ENGINE_PASS(6) ENGINE_PASS(7)
#undef ENGINE_PASS
            default: a8_pass<A8_ROWS, T>(xq, st, ds, dx, s0, s1, seg, tile.data(), so.data(), acc + 16 * r); break;
          }
        }
      }
      const float* b = bias != nullptr ? bias + g * COLS : nullptr;
      for (int64_t m = 0; m < rows; ++m)
        for (int c = 0; c < 16; ++c)
          out[m * ldy + g * COLS + c] = static_cast<O>(b != nullptr ? acc[16 * m + c] + b[c] : acc[16 * m + c]);
    }
  });
}
#endif

template <int64_t T, typename O>
void run_a8(const std::vector<int32_t>& quads, const A8Rows& a, const uint8_t* w, const Traits& t,
            const float* bias, O* out, int64_t n, int64_t ldy, bool reference) {
#if defined(ENGINE_A8_VNNI)
  if (!reference) {
    run_vnni<T, O>(quads, a, w, t, bias, out, n, ldy);
    return;
  }
#endif
  (void)quads;
  const int64_t group_bytes = (a.k / t.block) * t.record;
  at::parallel_for(0, n / COLS, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      reference_group<T, O>(a, w + g * group_bytes, t, bias != nullptr ? bias + g * COLS : nullptr, out + g * COLS,
                            ldy);
  });
}

torch::Tensor a8_parts(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& parts,
                       const torch::Tensor& bias, int64_t out_features, bool reference) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "linear_a8: x is float32 or bf16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), "linear_a8: packed is contiguous uint8");
  TORCH_CHECK(parts.scalar_type() == at::kLong && parts.dim() == 2 && parts.size(1) == 4 && parts.is_contiguous(),
              "linear_a8: parts is int64 [P, 4]: type, first column, columns, byte offset");
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 32 == 0, "linear_a8: K = ", k, " is not whole blocks of 32");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || bias.numel() == out_features, "linear_a8: bias size");
  const torch::Tensor bias32 = has_bias ? bias.to(at::kFloat).contiguous() : torch::Tensor();
  const torch::Tensor xc = x.contiguous();
  auto y = torch::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  const A8Rows a = x.scalar_type() == at::kFloat ? quantize(xc.data_ptr<float>(), rows, k, reference)
                                                 : quantize(xc.data_ptr<c10::BFloat16>(), rows, k, reference);
#if defined(ENGINE_A8_VNNI)
  const std::vector<int32_t> quads = reference ? std::vector<int32_t>() : pass_quads(a);
#else
  const std::vector<int32_t> quads;
#endif
  const int64_t* p = parts.data_ptr<int64_t>();
  int64_t covered = 0;
  for (int64_t i = 0; i < parts.size(0); ++i) {
    const int64_t type = p[4 * i], start = p[4 * i + 1], width = p[4 * i + 2], offset = p[4 * i + 3];
    TORCH_CHECK(type & A8_BIT, "linear_a8: part ", i, " is type ", type, ", not one for int8 activations");
    const int64_t qtype = type & ~A8_BIT;
    const Traits t = traits_of(qtype);
    TORCH_CHECK(k % t.block == 0, "linear_a8: K = ", k, " is not whole blocks of ", t.block);
    TORCH_CHECK(width % COLS == 0 && start >= 0 && start + width <= out_features, "linear_a8: part ", i, " columns");
    TORCH_CHECK(offset >= 0 && offset + width / COLS * (k / t.block) * t.record <= packed.numel(),
                "linear_a8: part ", i, " lies past the packing");
    covered += width;
    const uint8_t* w = packed.data_ptr<uint8_t>() + offset;
    const float* b = has_bias ? bias32.data_ptr<float>() + start : nullptr;
    dispatch_type(qtype, [&](auto tag) {
      constexpr int64_t T = decltype(tag)::value;
      if (x.scalar_type() == at::kFloat)
        run_a8<T, float>(quads, a, w, t, b, y.data_ptr<float>() + start, width, out_features, reference);
      else
        run_a8<T, c10::BFloat16>(quads, a, w, t, b, y.data_ptr<c10::BFloat16>() + start, width, out_features,
                                 reference);
    });
  }
  TORCH_CHECK(covered == out_features, "linear_a8: the parts cover ", covered, " of ", out_features, " columns");
  return y;
}

}  // namespace

torch::Tensor linear_a8_parts(torch::Tensor x, torch::Tensor packed, torch::Tensor parts, torch::Tensor bias,
                              int64_t out_features) {
  return a8_parts(x, packed, parts, bias, out_features, false);
}

torch::Tensor linear_quant_a8(torch::Tensor x, torch::Tensor packed, int64_t qtype, torch::Tensor bias,
                              int64_t out_features, bool reference) {
  const Traits t = traits_of(qtype);
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(1) == x.size(1) / t.block &&
                  packed.size(2) == t.record && x.size(1) % t.block == 0,
              "linear_quant_a8: the packing does not match K = ", x.size(1));
  TORCH_CHECK(out_features == packed.size(0) * COLS, "linear_quant_a8: out_features is 16 x the groups");
  const torch::Tensor parts =
      torch::tensor({qtype | A8_BIT, int64_t{0}, out_features, int64_t{0}}, torch::kLong).view({1, 4});
  return a8_parts(x, packed.contiguous().view({-1}), parts, bias, out_features, reference);
}
