// The experts of a mixture-of-experts layer kept as their quantized blocks (a GGUF file's, gpt-oss's MXFP4,
// a quantized checkpoint's integers), in one call: each expert present, in ascending id, takes its rows
// through its gate-and-up product and its down product on the blocks (linear_quant_parts, or
// linear_w8a8_parts for W8A8 parts), and adds them, weighted, into a float32 sum from 0. Reference and
// contract: worker/models/experts.py Experts.packed_experts, whose numbers these are bit for bit (the same
// kernels and ATen ops in the same order, without Python between them: ~40 us an expert).
//
// fused_quant_experts(x [T, H] float32 or bf16, ids [T, K] int64, weights [T, K] float32, bytes uint8
//                     (every expert's blocks), table [E, P + 1, 4] int64, b13 [E, 2I] or empty, b2 [E, H]
//                     or empty, activation, alpha, limit, shared [T, H] or empty, shared_gate [T] or empty)
//   -> [T, H] in x's dtype
//   table: per expert, its gate-and-up product's P parts then its down product's one, each [GGML type,
//          first column, columns, byte offset into bytes] (linear_quant_parts' parts).
//   activation: 0 silu(gate) * up, 1 gelu_tanh(gate) * up (the dense MLP's kernels), 2 gpt-oss's clamped
//          SwiGLU in ATen: (clamp(up, -limit, limit) + 1) * (g * sigmoid(alpha g)), g = clamp(gate, max=limit).
//   shared: a shared expert's output, added as Experts.with_shared adds it: out + T(sigmoid(float64
//          shared_gate)) * shared, or out + shared without a gate.
// A row's products and its sum over its own experts are its own: batch-invariant as the loop is.
#include "ops.h"

#include <vector>

torch::Tensor fused_quant_experts(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor bytes,
                                  torch::Tensor table, torch::Tensor b13, torch::Tensor b2, int64_t activation,
                                  double alpha, double limit, torch::Tensor shared, torch::Tensor shared_gate) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && weights.sizes() == ids.sizes() && ids.size(0) == x.size(0),
              "fused_quant_experts: x [T, H], ids and weights [T, K]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat, "ids int64, weights float32");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 3 && table.size(1) >= 2 && table.size(2) == 4 &&
                  table.is_contiguous(),
              "fused_quant_experts: table is int64 [E, P + 1, 4]");
  TORCH_CHECK(activation >= 0 && activation <= 2, "fused_quant_experts: activation 0, 1 or 2");
  const int64_t experts = table.size(0), parts = table.size(1) - 1, hidden = x.size(1);
  const int64_t* t = table.data_ptr<int64_t>();
  auto out = at::zeros({x.size(0), hidden}, x.options().dtype(at::kFloat));
  // each expert present, in ascending id: its rows (row-major order over ids, as torch.where gives them)
  std::vector<std::vector<int64_t>> rows(experts), slots(experts);
  const at::Tensor ids_c = ids.contiguous();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  const int64_t k = ids.size(1);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < experts, "fused_quant_experts: an expert id out of range");
    rows[id[i]].push_back(i / k);
    slots[id[i]].push_back(i % k);
  }
  const auto product = [&](const at::Tensor& in, int64_t expert, int64_t first, int64_t count,
                           const at::Tensor& bias) {
    const at::Tensor runs = table[expert].narrow(0, first, count).contiguous();
    const int64_t* run = runs.data_ptr<int64_t>();
    int64_t columns = 0;
    for (int64_t p = 0; p < count; ++p) columns += run[4 * p + 2];
    const at::Tensor b = bias.numel() ? bias[expert] : bias;
    if (run[0] == 104) return linear_w8a8_parts(in, bytes, runs, b, columns);  // W8A8 (csrc/quant_w8a8.cpp)
    return linear_quant_parts(in, bytes, runs, b, columns);
  };
  for (int64_t e = 0; e < experts; ++e) {
    if (rows[e].empty()) continue;
    const at::Tensor at_rows = torch::tensor(rows[e], at::kLong), at_slots = torch::tensor(slots[e], at::kLong);
    const at::Tensor both = product(x.index_select(0, at_rows), e, 0, parts, b13);
    at::Tensor hidden_rows;
    if (activation == 0) {
      hidden_rows = silu_and_mul(both);
    } else if (activation == 1) {
      hidden_rows = gelu_tanh_and_mul(both);
    } else {
      const int64_t inter = both.size(1) / 2;
      const at::Tensor gate = both.narrow(1, 0, inter).clamp_max(limit);
      const at::Tensor up = both.narrow(1, inter, inter).clamp(-limit, limit);
      hidden_rows = (up + 1) * (gate * at::sigmoid(gate * alpha));
    }
    const at::Tensor y = product(hidden_rows, e, parts, 1, b2);
    const at::Tensor w = weights.index({at_rows, at_slots}).unsqueeze(1);
    out.index_add_(0, at_rows, y.to(at::kFloat) * w);
  }
  at::Tensor result = out.to(x.scalar_type());
  if (shared.numel() && shared_gate.numel())
    return result + at::sigmoid(shared_gate.reshape({-1, 1}).to(at::kDouble)).to(shared.scalar_type()) * shared;
  return shared.numel() ? result + shared : result;
}
