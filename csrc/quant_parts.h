// The checks every product on packed parts makes of its arguments: linear_quant_parts (csrc/quant_cpu.cpp),
// linear_a8_parts (csrc/quant_a8.cpp) and linear_w8a8_parts (csrc/quant_w8a8.cpp). A product there takes x
// float32 or bf16 [M, K], packed contiguous uint8, parts int64 [P, 4] (type, first column, columns, byte offset)
// whose columns together are the N outputs, and bias [N] or empty; `op` names the product in each error.
#pragma once

#include <torch/extension.h>

#include <cstdint>

#include "gemm_rows.h"

namespace parts_checks {

using rows_kernel::COLS;  // a part's columns come in groups of 16 (the packings' group)

// The call's x, packed, parts and bias; returns the bias in float32, or an undefined tensor where there is none.
inline torch::Tensor checked_call(const char* op, const torch::Tensor& x, const torch::Tensor& packed,
                                  const torch::Tensor& parts, const torch::Tensor& bias, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16), op,
              ": x is float32 or bf16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous(), op, ": packed is contiguous uint8");
  TORCH_CHECK(parts.scalar_type() == at::kLong && parts.dim() == 2 && parts.size(1) == 4 && parts.is_contiguous(), op,
              ": parts is int64 [P, 4]: type, first column, columns, byte offset");
  const bool has_bias = bias.defined() && bias.numel() > 0;
  TORCH_CHECK(!has_bias || bias.numel() == out_features, op, ": bias size");
  return has_bias ? bias.to(at::kFloat).contiguous() : torch::Tensor();
}

// Part i (columns [start, start + width), at byte `offset`, each group of 16 columns `group_bytes` long) lies
// within the N outputs and the packing's `packed_bytes`.
inline void check_part(const char* op, int64_t i, int64_t start, int64_t width, int64_t offset, int64_t group_bytes,
                       int64_t out_features, int64_t packed_bytes) {
  TORCH_CHECK(width % COLS == 0 && start >= 0 && start + width <= out_features, op, ": part ", i, " columns");
  TORCH_CHECK(offset >= 0 && offset + width / COLS * group_bytes <= packed_bytes, op, ": part ", i,
              " lies past the packing");
}

// The parts' columns, summed, are the N outputs.
inline void check_covered(const char* op, int64_t covered, int64_t out_features) {
  TORCH_CHECK(covered == out_features, op, ": the parts cover ", covered, " of ", out_features, " columns");
}

}  // namespace parts_checks
