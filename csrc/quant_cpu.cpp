// Products on GGUF's quantized blocks kept packed (worker/quant/gguf_pack.py writes the layout), and on the
// integer weights of AWQ, GPTQ and compressed-tensors checkpoints in the same layout (worker/quant/int_pack.py), and the
// rows of such a weight dequantized (an embedding's lookup; the tests' whole-weight reference).
//
// Layout ("tiles"), uint8 [N / 16, K / B, RECORD]: for each group of 16 output rows and each GGUF block of B
// input dims, one record holding the 16 rows' block side by side (worker/quant/gguf_pack.py has each type's
// fields). Per pair of input dims (k, k + 1), the 16 rows' low 4 bits are 16 bytes (byte c: row c's dim k in
// the low nibble, dim k + 1 in the high one); per dim, 5-bit types add 2 bytes of fifth bits (bit c: row c),
// Q6_K 4 bytes of top 2 bits (bits 2c, 2c + 1); Q8_0 holds 16 int8 a dim instead. Scales per (row, sub-block of S dims) are kept as the file has
// them (f16 d, dmin, m; Q4_K/Q5_K's 6-bit and Q2_K's 4-bit scales and mins unpacked to bytes; Q6_K's int8
// scales; Q2_K's 2-bit values are stored as nibbles).
//
// quant_rows(packed, qtype, ids [T] int64, K, dtype) -> [T, K]: rows `ids` of the weight, dequantized.
// linear_quant(x [M, K] float32 or bf16, packed, qtype, bias [N] or empty, N, amx=True) -> [M, N] in x's dtype;
//   amx=False keeps bf16 rows off the AMX form (the tests' way to check both forms on a CPU with AMX).
//
// Every weight is fma(scale, q, offset) in float32 with q the stored unsigned (Q8_0: signed) integer:
//   Q4_0 d, -8d; Q5_0 d, -16d; Q8_0 d, 0; Q4_1 and Q5_1 d, m; Q2_K, Q4_K and Q5_K d * sc[j], -(dmin * m[j]);
//   Q6_K d * sc[j], -32 (d * sc[j]); the integer types (I4_G*, I8_G64) their float32 s and o as stored;
//   MXFP4 2^(e - 128), -12 of it, on its code's value twice plus 12 (csrc/quant_blocks.h).
// Each scale and offset is an exact product and scale * q is exact, so this is the one rounding of the
// `gguf` package's numpy dequantization (d * (q - 8), d * q + m, d * q - dm, ...): the same float32 values.
// The product is linear_rows' (csrc/gemm_rows_cpu.cpp) on those values: y[m, n] = (one FMA chain over
// k = 0 .. K - 1 from 0) + bias[n], rounded once to x's dtype. So it equals linear_rows on the dequantized
// float32 weight bit for bit, at any row count and thread count (batch-invariant).
// bf16 rows take the factored form (the scale out of each sub-block): on AMX tiles where the CPU has them
// (quant_amx.h), else with AVX-512 BF16 (quant_bf16.h); one form at every row count on a CPU.
// Up to FUSED_ROWS rows dequantize in registers on the way to the FMAs (decode: the file's bytes are all
// that is read); more rows dequantize a group's K x 16 weights once into a float32 tile and run linear_rows'
// inner kernel on it.
#include "ops.h"

#include "gemm_rows.h"
#include "quant_a8.h"
#include "quant_amx.h"
#include "quant_bf16_run.h"
#include "quant_parts.h"
#include "quant_blocks.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using namespace quant_kernel;
using rows_kernel::COLS;
using rows_kernel::GROUP_PASS;
using rows_kernel::MAX_ROWS;
constexpr int64_t ROW_BLOCK = 96;

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


void check_packing(const torch::Tensor& packed, const Traits& t, int64_t k) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous(),
              "quantized products: packed is a contiguous uint8 [N / 16, K / B, record] tensor");
  TORCH_CHECK(k % t.block == 0 && packed.size(1) == k / t.block && packed.size(2) == t.record,
              "quantized products: the packing does not match K = ", k, " (blocks of ", t.block, ")");
}

}  // namespace

bool quant_type_supported(int64_t qtype) {
  switch (qtype) {
    case Q2_K: case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: case Q4_K: case Q5_K: case Q6_K:
    case I4_G32: case I4_G64: case I4_G128: case I8_G64: case MXFP4: return true;
    default: return false;
  }
}

namespace {

// The parts of one product into y's columns [start, start + out_features) each.
// amx: bf16 rows take the AMX form (quant_amx.h) where the build and the CPU have it.
void run_parts(const torch::Tensor& x, const uint8_t* bytes, int64_t num_bytes, const int64_t* parts,
               int64_t num_parts, const float* bias, torch::Tensor& y, bool amx) {
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
    parts_checks::check_part("linear_quant", p, start, width, offset, (k / t.block) * t.record, n, num_bytes);
    const uint8_t* w = bytes + offset;
    const float* b = bias != nullptr ? bias + start : nullptr;
    dispatch_type(qtype, [&](auto type) {
      constexpr int64_t T = decltype(type)::value;
#if defined(ENGINE_QUANT_AMX)
      if (y.scalar_type() == at::kBFloat16 && amx && amx_permitted()) {
        run_amx<T>(xb.data_ptr<c10::BFloat16>(), rows, k, w, t, b, y.data_ptr<c10::BFloat16>() + start, width, n);
        return;
      }
#endif
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

namespace {

torch::Tensor quant_parts(torch::Tensor x, torch::Tensor packed, torch::Tensor parts, torch::Tensor bias,
                          int64_t out_features, bool amx) {
  if (parts.scalar_type() == at::kLong && parts.numel() && (parts.data_ptr<int64_t>()[0] & A8_BIT))
    return linear_a8_parts(x, packed, parts, bias, out_features);  // int8 activations (csrc/quant_a8.cpp; its checks)
  const torch::Tensor bias32 = parts_checks::checked_call("linear_quant", x, packed, parts, bias, out_features);
  auto y = torch::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
  int64_t covered = 0;
  for (int64_t p = 0; p < parts.size(0); ++p) covered += parts.data_ptr<int64_t>()[4 * p + 2];
  parts_checks::check_covered("linear_quant", covered, out_features);
  run_parts(x, packed.data_ptr<uint8_t>(), packed.numel(), parts.data_ptr<int64_t>(), parts.size(0),
            bias32.defined() ? bias32.data_ptr<float>() : nullptr, y, amx);
  return y;
}

}  // namespace

torch::Tensor linear_quant_parts(torch::Tensor x, torch::Tensor packed, torch::Tensor parts, torch::Tensor bias,
                                 int64_t out_features) {
  return quant_parts(x, packed, parts, bias, out_features, true);
}

torch::Tensor linear_blocks(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& parts,
                            const torch::Tensor& bias, const torch::Tensor& order) {
  const int64_t* part = parts.data_ptr<int64_t>();
  const auto product = [&](const torch::Tensor& rows, const torch::Tensor& runs, const torch::Tensor& b,
                           int64_t columns) {
    if (part[0] == 104) return linear_w8a8_parts(rows, packed, runs, b, columns);  // W8A8 (csrc/quant_w8a8.cpp)
    return linear_quant_parts(rows, packed, runs, b, columns);
  };
  int64_t columns = 0;
  for (int64_t p = 0; p < parts.size(0); ++p) columns += part[4 * p + 2];
  if (!order.defined() || !order.numel()) return product(x, parts, bias, columns);
  if (order.dim() == 1) return product(gather_columns(x.contiguous(), order), parts, bias, columns);
  TORCH_CHECK(order.dim() == 2 && order.size(0) == parts.size(0), "an act-order product: one order per part");
  std::vector<torch::Tensor> outputs;
  for (int64_t p = 0; p < parts.size(0); ++p) {  // each part a product of its own, on its own order of x
    const int64_t start = part[4 * p + 1], width = part[4 * p + 2];
    torch::Tensor run = parts.narrow(0, p, 1).clone();
    run.data_ptr<int64_t>()[1] = 0;  // the part's columns alone
    const torch::Tensor b = bias.numel() ? bias.narrow(0, start, width) : bias;
    outputs.push_back(product(gather_columns(x.contiguous(), order[p]), run, b, width));
  }
  return torch::cat(outputs, 1);
}

torch::Tensor linear_quant(torch::Tensor x, torch::Tensor packed, int64_t qtype, torch::Tensor bias,
                           int64_t out_features, bool amx) {
  const Traits t = traits_of(qtype);
  TORCH_CHECK(x.dim() == 2, "linear_quant: x [M, K]");
  check_packing(packed, t, x.size(1));
  TORCH_CHECK(out_features == packed.size(0) * COLS, "linear_quant: out_features is 16 x the groups");
  const torch::Tensor parts = torch::tensor({qtype, int64_t{0}, out_features, int64_t{0}}, torch::kLong).view({1, 4});
  return quant_parts(x, packed.view({-1}), parts, bias, out_features, amx);
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
  dispatch_type(qtype, [&](auto type) {
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
