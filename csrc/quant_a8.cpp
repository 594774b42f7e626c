// Products on packed blocks with int8 activations (--activation-quantization int8, docs/quantization.md): as
// llama.cpp multiplies its quantized files, each row of x is quantized to int8 per block of 32 dims and
// multiplied by the stored integers in int32 (AVX-512 VNNI's vpdpbusd, or AVX2's vpmaddubsw and vpmaddwd:
// csrc/quant_a8_avx2.h), then scaled once per segment in float32.
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
#include "quant_a8_avx2.h"
#include "quant_a8_run.h"
#include "quant_parts.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace quant_kernel;

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


template <int64_t T, typename O>
void run_a8(const std::vector<int32_t>& quads, const A8Rows& a, const uint8_t* w, const Traits& t,
            const float* bias, O* out, int64_t n, int64_t ldy, bool reference) {
#if defined(ENGINE_A8_VNNI)
  if (!reference) {
    run_vnni<T, O>(quads, a, w, t, bias, out, n, ldy);
    return;
  }
#elif defined(ENGINE_A8_AVX2)
  if (!reference) {
    run_avx2<T, O>(a, w, t, bias, out, n, ldy);
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
  const torch::Tensor bias32 = parts_checks::checked_call("linear_a8", x, packed, parts, bias, out_features);
  const bool has_bias = bias32.defined();
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 32 == 0, "linear_a8: K = ", k, " is not whole blocks of 32");
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
    parts_checks::check_part("linear_a8", i, start, width, offset, (k / t.block) * t.record, out_features, packed.numel());
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
  parts_checks::check_covered("linear_a8", covered, out_features);
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
