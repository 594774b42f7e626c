// Products whose every output row is computed the same way whatever else is in the batch: the batch-
// invariant path (docs/batch-invariance.md), for float32 and for bf16 where the CPU has no bf16 arithmetic.
// Reference: at::linear (worker/models/layers.py Linear).
//
// pack_rows(weight [N, K] float32 or bf16) -> [ceil(N / 16), K, 16], same dtype: for each group of 16
//   output columns, for each input dim, the 16 columns' weights side by side (zero past N).
// linear_rows(x [M, K], packed, bias [N] or empty) -> [M, N] in x's dtype (x and the weight share it):
//   y[m, n] = (sum over k = 0, 1, ..., K - 1 of x[m, k] * w[n, k], one fused multiply-add after another
//   in float32, from 0) + bias[n], rounded once to the dtype.
//
// Why: MKL's and oneDNN's products pick their kernels, blockings and K-splits by the number of rows, so a
// row's sums depend on how many rows share the product (float32, MKL 2024.2, AMD EPYC AVX2, 2026-12-01:
// row 0 of a 576 x 1536 product differed from its single-row result at every M tested from 2 to 512).
// Here each output is one chain of FMAs in k order, done by one thread: neither the rows beside it nor
// the thread count changes it. (The portable loop, for CPUs without AVX2 and FMA, makes the same chain
// with std::fma.)
// Rows go in passes of up to 6 against one group's 16 columns (12 accumulators in 16 AVX2 registers); a
// group's K x 16 weights are read once per call and reused from cache by every pass. At one row the
// weights stream at 25-33 GB/s, the machine's 30 GB/s of a plain sum (AVX2 EPYC, 2026-12-01); asking for
// lines 4 KiB ahead measured no faster (21.3 vs 16.4-19.4 ms for SmolLM2's 538 MB), so it does not.
#include "ops.h"

#include "gemm_rows.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using rows_kernel::COLS;
using rows_kernel::GROUP_PASS;
using rows_kernel::MAX_ROWS;
constexpr int64_t ROW_BLOCK = 96;  // rows whose passes run against a group before the next group

template <typename T>
void store_row(const float* sums, const float* bias, T* y, int64_t cols) {
  for (int64_t c = 0; c < cols; ++c) y[c] = static_cast<T>(bias != nullptr ? sums[c] + bias[c] : sums[c]);
}

template <typename T>
void run(const torch::Tensor& x, const torch::Tensor& packed, const float* bias, torch::Tensor& y) {
  const int64_t rows = x.size(0), k = x.size(1), n = y.size(1), groups = packed.size(0);
  // The rows in float32 once (bf16 widens exactly); the products read them from there.
  const torch::Tensor x32 = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  const float* xs = x32.data_ptr<float>();
  const T* w = packed.data_ptr<T>();
  T* out = y.data_ptr<T>();
  const int64_t blocks = (rows + ROW_BLOCK - 1) / ROW_BLOCK;
  // Units of (row block, group), a block's groups in a run: a thread's groups reuse its rows from cache and
  // each group's weights serve the block's passes. Which thread does a unit changes no result.
  at::parallel_for(0, blocks * groups, 1, [&](int64_t begin, int64_t end) {
    float sums[MAX_ROWS * COLS];
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t block = unit / groups, g = unit % groups;
      const int64_t cols = std::min(COLS, n - g * COLS);
      const int64_t last = std::min(rows, (block + 1) * ROW_BLOCK);
      for (int64_t r = block * ROW_BLOCK; r < last; r += MAX_ROWS) {
        const int pass = static_cast<int>(std::min<int64_t>(MAX_ROWS, last - r));
        GROUP_PASS<T>[pass](xs + r * k, k, w + g * k * COLS, sums);
        for (int m = 0; m < pass; ++m)
          store_row<T>(sums + m * COLS, bias != nullptr ? bias + g * COLS : nullptr, out + (r + m) * n + g * COLS,
                       cols);
      }
    }
  });
}

}  // namespace

torch::Tensor pack_rows(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_rows takes a 2-d weight");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "pack_rows takes float32 or bf16");
  const int64_t n = weight.size(0), k = weight.size(1), groups = (n + COLS - 1) / COLS;
  auto padded = torch::zeros({groups * COLS, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  // [groups, 16, k] -> [groups, k, 16]
  return padded.view({groups, COLS, k}).transpose(1, 2).contiguous();
}

torch::Tensor linear_rows(torch::Tensor x, torch::Tensor packed, torch::Tensor bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 3 && packed.size(2) == COLS, "linear_rows: x [M, K], packed from pack_rows");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "linear_rows: x and the weight share a dtype");
  TORCH_CHECK(packed.size(1) == x.size(1), "linear_rows: in features differ");
  TORCH_CHECK(out_features > (packed.size(0) - 1) * COLS && out_features <= packed.size(0) * COLS,
              "linear_rows: out_features does not match the packing");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || bias.numel() == out_features, "linear_rows: bias size");
  const torch::Tensor bias32 = has_bias ? bias.to(at::kFloat).contiguous() : torch::Tensor();
  const float* b = has_bias ? bias32.data_ptr<float>() : nullptr;
  auto y = torch::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return y;
  if (x.scalar_type() == at::kFloat) {
    run<float>(x, packed.contiguous(), b, y);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "linear_rows takes float32 or bf16");
    run<c10::BFloat16>(x, packed.contiguous(), b, y);
  }
  return y;
}
