// Products of up to a few hundred rows (decode steps, short prefill steps) against bf16 weights, with
// AVX-512 BF16 dot products.
// Reference: at::linear (worker/models/layers.py Linear).
//
// pack_pairs(weight [N, K] bf16) -> [N / 64, K / 2, 64, 2] bf16: for each group of 64 output columns, for
//   each pair of input dims, the 64 columns' two weights side by side: one 256-byte line a dim pair,
//   read once, in order, by a product (`linear_pairs`).
// linear_pairs(x [M, K] bf16, packed, bias [N] or empty) -> [M, N] bf16: x W^T (+ bias), float32 sums
//   rounded once, as oneDNN's product does; vdpbf16ps sums each pair of products before adding it.
//
// At a few rows a step's products are bound by reading the weights (~270 MB for SmolLM2). On an EPYC (Zen 4:
// AVX-512 BF16, no AMX) oneDNN's kernels read them at ~16 GB/s, where a plain sum reads them at ~28 GB/s;
// here each weight line is read once per call, in order, and every row it meets is done with it (up to 6 rows
// x 64 columns of float32 sums in registers). The step's 121 products, 30 layers' copies (2026-11-30): 9.6 vs
// 17.0 ms at 1 row, 15.3 vs 20.2 at 16, 48.7 vs 54.2 at 64, level at 96-256, 5-10% slower from 512 rows on,
// each product alone; in the model, where each product's weights come from memory, whole steps ran faster
// this way up to 512 rows (worker/models/layers.py PAIRS_ROWS). More rows go in passes of 6 that reuse a
// group's lines from cache, each pass asking for a share of the next group's lines; the threads split (group,
// pass) units. What each of these choices measured: benchmarks/results/2026-11-29-lab-notes-performance.md, "On a CPU without AMX".
#include "ops.h"

#include "gemm_pairs.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <memory>

namespace {

using pairs_kernel::GROUP;
using pairs_kernel::MAX_ROWS;
#if defined(ENGINE_PAIRS)
using pairs_kernel::AHEAD_ROWS;
using pairs_kernel::GROUP_ROWS;
using pairs_kernel::MANY_PASSES;
#endif
constexpr int64_t BLOCK_PASSES = 32;  // passes of rows a block: 192 rows, their dim pairs 216-576 KB
constexpr int64_t COPY_GRAIN_PASSES = 4;  // passes of rows a thread copies at least

}  // namespace

bool pairs_available() {
#if defined(ENGINE_PAIRS)
  return true;
#else
  return false;
#endif
}

torch::Tensor pack_pairs(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_pairs takes a 2-d bf16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % GROUP == 0 && k % 2 == 0, "pack_pairs: out features a multiple of 64, in features even");
  const auto w = weight.contiguous();
  auto packed = torch::empty({n / GROUP, k / 2, GROUP, 2}, weight.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, n / GROUP, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t kp = 0; kp < k / 2; ++kp)
        for (int64_t c = 0; c < GROUP; ++c) {
          uint16_t* out = dst + ((g * (k / 2) + kp) * GROUP + c) * 2;
          const uint16_t* row = src + (g * GROUP + c) * k + 2 * kp;
          out[0] = row[0];
          out[1] = row[1];
        }
  });
  return packed;
}

torch::Tensor linear_pairs(torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "linear_pairs takes 2-d bf16 rows");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == GROUP && packed.size(3) == 2, "weight from pack_pairs");
  const int64_t rows = x.size(0), k = x.size(1), groups = packed.size(0), n = groups * GROUP;
  TORCH_CHECK(packed.size(1) * 2 == k, "linear_pairs: in features differ");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || bias.numel() == n, "linear_pairs: bias size");
  auto y = torch::empty({rows, n}, x.options());
#if defined(ENGINE_PAIRS)
  const int64_t kpairs = k / 2;
  const auto xc = x.contiguous();
  const torch::Tensor bias32 = has_bias ? bias.to(at::kFloat).contiguous() : torch::Tensor();
  const float* b = has_bias ? bias32.data_ptr<float>() : nullptr;
  // The rows' dim pairs, MAX_ROWS rows side by side per dim pair, one pass of rows after another; the
  // slots past a short last pass's rows stay unset (group_rows<ROWS> reads its ROWS only). Passes are
  // copied on both threads once there are enough of them to pay for the handover.
  const int64_t passes = (rows + MAX_ROWS - 1) / MAX_ROWS;
  auto rows_of = [&](int64_t p) { return static_cast<int>(std::min<int64_t>(MAX_ROWS, rows - p * MAX_ROWS)); };
  std::unique_ptr<uint32_t[]> xp_buffer(new uint32_t[passes * kpairs * MAX_ROWS]);
  uint32_t* const xp = xp_buffer.get();
  const auto* xs = reinterpret_cast<const uint32_t*>(xc.data_ptr<c10::BFloat16>());
  at::parallel_for(0, passes, COPY_GRAIN_PASSES, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      uint32_t* dst = xp + p * kpairs * MAX_ROWS;
      for (int64_t r = 0; r < rows_of(p); ++r) {
        const uint32_t* src = xs + (p * MAX_ROWS + r) * kpairs;
        for (int64_t kp = 0; kp < kpairs; ++kp) dst[kp * MAX_ROWS + r] = src[kp];
      }
    }
  });
  const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
  auto* out = y.data_ptr<c10::BFloat16>();
  // Each thread streams its own run of (group, pass) units, group by group; every pass of rows reuses a
  // group's lines from cache. Units rather than whole groups, so that a group count the threads do not
  // divide (SmolLM2's o and down products have 9, its qkv 15) splits one group's passes instead of leaving
  // one thread a whole group behind. Many rows go in blocks of passes, so that a block's rows stay in
  // cache while the groups go by. The next group's lines are asked for a share each pass, so that reading
  // them overlaps this group's products (a first pass of 6 rows reading its lines from memory is bound by
  // the read).
  at::parallel_for(0, groups * passes, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p0 = 0; p0 < passes; p0 += BLOCK_PASSES) {
      const int64_t p1 = std::min(passes, p0 + BLOCK_PASSES), share = (kpairs + (p1 - p0) - 1) / (p1 - p0);
      const auto* kernels = p1 - p0 >= MANY_PASSES ? GROUP_ROWS<_MM_HINT_T0> : GROUP_ROWS<_MM_HINT_T1>;
      for (int64_t g = begin / passes; g * passes < end; ++g) {
        const bool ahead = (g + 1) * passes < end && rows >= AHEAD_ROWS;
        for (int64_t p = std::max(p0, begin - g * passes); p < std::min(p1, end - g * passes); ++p) {
          const int64_t first = (p - p0) * share;
          const int64_t lines = ahead ? std::max<int64_t>(0, std::min(share, kpairs - first)) : 0;
          kernels[rows_of(p)](xp + p * kpairs * MAX_ROWS, wp + g * kpairs * GROUP, kpairs,
                              b != nullptr ? b + g * GROUP : nullptr, out + p * MAX_ROWS * n + g * GROUP, n,
                              wp + ((g + 1) * kpairs + first) * GROUP, lines, kpairs / share);
        }
      }
    }
  });
#else
  TORCH_CHECK(false, "linear_pairs needs a build with AVX-512 BF16");
#endif
  return y;
}
