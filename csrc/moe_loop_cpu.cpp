// The experts of a mixture-of-experts layer expert by expert, in one call: each expert present, in ascending
// id, takes its rows through its gate-and-up product, the activation and its down product, each product
// followed by the rows' adapters on that expert where given (lora_add), and adds them, weighted, into a
// float32 sum from 0. For experts kept as their quantized blocks (a GGUF file's, gpt-oss's MXFP4, a
// quantized checkpoint's integers), and for rows whose LoRA adapter targets the experts, where
// fused_experts' one parallel loop (csrc/moe_cpu.cpp) does not serve. Reference and contract:
// worker/models/experts.py Experts.packed_experts and Experts.adapted, then Experts.with_shared, whose
// numbers these are bit for bit (the same kernels and ATen ops in the same order, without Python between
// them: ~40 us an expert).
//
// expert_loop(x [T, H] float32 or bf16, ids [T, K] int64, weights [T, K] float32, w13, w2, b13 [E, 2I] or
//             empty, b2 [E, H] or empty, activation, alpha, limit, shared [T, H] or empty, shared_gate [T]
//             or empty, lora) -> [T, H] in x's dtype
//   w13, w2: fused_experts' packings (pack_rows' [E, 2I / 16, H, 16], or pack_pairs' [E, 2I / 64, H / 2,
//          64, 2]), or, for blocks, w13 uint8 (every expert's blocks) and w2 the table [E, P + 1, 4] int64:
//          per expert its gate-and-up product's P parts then its down product's one, each [GGML type, first
//          column, columns, byte offset into w13] (linear_quant_parts' parts).
//   activation: 0 silu(gate) * up, 1 gelu_tanh(gate) * up (the dense MLP's kernels), 2 gpt-oss's clamped
//          SwiGLU in ATen: (clamp(up, -limit, limit) + 1) * (g * sigmoid(alpha g)), g = clamp(gate, max=limit).
//   shared: a shared expert's output, added as Experts.with_shared adds it: out + T(sigmoid(float64
//          shared_gate)) * shared, or out + shared without a gate.
//   lora: none, or [a13 [E, slots, w, H], bt13 [E, slots, w, 2I], a2, bt2, row_slots [T], bounds13, ranks13,
//          bounds2, ranks2] (worker/lora/expert_slots.py): expert e's products add lora_add's with a[e], bt[e].
//   orders: none, or act-order blocks' input orders [orders13 [E, P, H], orders2 [E, 1, I]] int64: each part
//          takes its input's columns in its order (gather_columns) and runs as a product of its own, as
//          worker/models/layers.py Linear._quant_forward runs parts in orders of their own.
// A row's products and its sum over its own experts are its own: batch-invariant as the loop is.
#include "ops.h"

#include <vector>

torch::Tensor expert_loop(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w13,
                          torch::Tensor w2, torch::Tensor b13, torch::Tensor b2, int64_t activation, double alpha,
                          double limit, torch::Tensor shared, torch::Tensor shared_gate,
                          std::optional<std::vector<torch::Tensor>> lora,
                          std::optional<std::vector<torch::Tensor>> orders) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && weights.sizes() == ids.sizes() && ids.size(0) == x.size(0),
              "expert_loop: x [T, H], ids and weights [T, K]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat, "ids int64, weights float32");
  TORCH_CHECK(activation >= 0 && activation <= 2, "expert_loop: activation 0, 1 or 2");
  TORCH_CHECK(!lora || (lora->size() == 9 && (*lora)[4].size(0) == x.size(0)),
              "expert_loop: lora is a13, bt13, a2, bt2, row_slots [T], bounds and ranks of both");
  const bool blocks = w13.scalar_type() == at::kByte;
  TORCH_CHECK(!blocks || (w2.scalar_type() == at::kLong && w2.dim() == 3 && w2.size(1) >= 2 && w2.size(2) == 4 &&
                          w2.is_contiguous()),
              "expert_loop: blocks take a table int64 [E, P + 1, 4]");
  TORCH_CHECK(blocks || w13.dim() == 4 || w13.dim() == 5, "expert_loop: w13 packed for pack_rows or pack_pairs");
  TORCH_CHECK(!orders || (blocks && orders->size() == 2), "expert_loop: orders [orders13, orders2], for blocks");
  const int64_t experts = blocks ? w2.size(0) : w13.size(0), parts = blocks ? w2.size(1) - 1 : 0;
  auto out = at::zeros({x.size(0), x.size(1)}, x.options().dtype(at::kFloat));
  // each expert present, in ascending id: its rows (row-major order over ids, as torch.where gives them)
  std::vector<std::vector<int64_t>> rows(experts), slots(experts);
  const at::Tensor ids_c = ids.contiguous();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  const int64_t k = ids.size(1);
  for (int64_t i = 0; i < ids.numel(); ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < experts, "expert_loop: an expert id out of range");
    rows[id[i]].push_back(i / k);
    slots[id[i]].push_back(i % k);
  }
  // expert e's gate-and-up (down false) or down product of in, as worker/models/experts.py Experts.product
  const auto product = [&](const at::Tensor& in, int64_t e, bool down) {
    const at::Tensor& bias = down ? b2 : b13;
    const at::Tensor b = bias.numel() ? bias[e] : bias;
    if (!blocks) {
      const at::Tensor packed = (down ? w2 : w13)[e];
      if (packed.dim() == 4) return linear_pairs(in.contiguous(), packed, b);
      return linear_rows(in.contiguous(), packed, b, packed.size(0) * packed.size(2));
    }
    const at::Tensor runs = w2[e].narrow(0, down ? parts : 0, down ? 1 : parts).contiguous();
    return linear_blocks(in, w13, runs, b, orders ? (*orders)[down ? 1 : 0][e] : at::Tensor());
  };
  for (int64_t e = 0; e < experts; ++e) {
    if (rows[e].empty()) continue;
    const at::Tensor at_rows = torch::tensor(rows[e], at::kLong), at_slots = torch::tensor(slots[e], at::kLong);
    const at::Tensor row_slots = lora ? (*lora)[4].index_select(0, at_rows) : at::Tensor();
    const auto adapt = [&](int which, const at::Tensor& in, at::Tensor& y) {  // 0: gate-and-up, 1: down
      if (lora) lora_add(in.contiguous(), y, (*lora)[2 * which][e], (*lora)[2 * which + 1][e], row_slots,
                         (*lora)[5 + 2 * which], (*lora)[6 + 2 * which]);
    };
    const at::Tensor xr = x.index_select(0, at_rows);
    at::Tensor both = product(xr, e, false);
    adapt(0, xr, both);
    at::Tensor hidden;
    if (activation == 0) {
      hidden = silu_and_mul(both);
    } else if (activation == 1) {
      hidden = gelu_tanh_and_mul(both);
    } else {
      const int64_t inter = both.size(1) / 2;
      const at::Tensor gate = both.narrow(1, 0, inter).clamp_max(limit);
      const at::Tensor up = both.narrow(1, inter, inter).clamp(-limit, limit);
      hidden = (up + 1) * (gate * at::sigmoid(gate * alpha));
    }
    at::Tensor y = product(hidden, e, true);
    adapt(1, hidden, y);
    const at::Tensor w = weights.index({at_rows, at_slots}).unsqueeze(1);
    out.index_add_(0, at_rows, y.to(at::kFloat) * w);
  }
  at::Tensor result = out.to(x.scalar_type());
  if (shared.numel() && shared_gate.numel())
    return result + at::sigmoid(shared_gate.reshape({-1, 1}).to(at::kDouble)).to(shared.scalar_type()) * shared;
  return shared.numel() ? result + shared : result;
}
