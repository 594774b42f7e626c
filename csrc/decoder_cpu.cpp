// The decoder layers of the Llama family in one call, for steps whose attention is all paged-kernel rows
// (decode, and prefill chunks short enough for the paged kernel). The same kernels, in the same order, as
// the Python layers in worker/models/llama.py with the csrc ops: the results are identical; what goes is
// Python's per-op cost (module calls, views, bindings: ~100 us a layer, a tenth of a small decode step).
//
// decoder_layers(x, layers, cos, sin, positions, kv_caches, slot_block_ids, slot_offsets, block_tables,
//                seq_lens, config, scalars, out_rows) -> (output, residual): their sum is the hidden state
//                after the last layer, of the rows out_rows names (all rows when None)
//
// x:         [T, hidden]  the embedded tokens; becomes the residual stream (modified in place)
// layers:    per layer [input_norm, qkv, qkv_bias, o, post_norm, gate_up, down, q_norm, k_norm, qkv_pairs,
//            o_pairs, gate_up_pairs, down_pairs]; an empty tensor is an absent bias, norm or packing.
//            A 3-d packing is linear_rows' (batch-invariant: every row count takes it; out features a
//            multiple of 16), a 5-d one linear_amx's (batch-invariant too: pack_pairs' viewed
//            [N / 64, K / 32, 16, 64, 2]). Products of at most config.pairs_rows rows use the pairs packing where given;
//            the others oneDNN's packed weights when config.packed, else at::linear on plain [out, in] ones.
// block_tables, seq_lens: one paged-attention row per token, as paged_decode_attention takes them
// config:    num_heads, num_kv_heads, head_dim, packed (0/1), pairs_rows; floats: eps, scale
// out_rows:  int64 [n], the rows whose hidden state the step scores (sampled tokens, prompt logprobs). Past
//            the last layer's KV write no other row is read, so its attention, o and MLP run on those rows
//            alone (as llama.cpp's inp_out_ids does): in a prefill step most of a layer's products.
// lora_layers, lora_meta: a step with LoRA rows (worker/lora/slots.py): per layer [a, bt] of qkv, o,
//            gate_up and down; meta [row_slots, then bounds and ranks of qkv, o, gate_up, down] (an empty
//            ranks: no slot's adapter targets that product). lora_add follows each product they name.
#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

namespace {

enum Weight {
  kInputNorm, kQkv, kQkvBias, kO, kPostNorm, kGateUp, kDown, kQNorm, kKNorm,
  kQkvPairs, kOPairs, kGateUpPairs, kDownPairs, kNumWeights
};

std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.numel() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// What worker/models/layers.py Linear.forward calls: few rows against the pairs packing, else oneDNN's
// product on a weight packed at load.
struct Product {
  bool packed;
  int64_t pairs_rows;
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                        const at::Tensor& pairs) const;
};

at::Tensor Product::operator()(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& pairs) const {
  if (pairs.dim() == 3) return linear_rows(x, pairs, bias, pairs.size(0) * pairs.size(2));  // batch-invariant
  if (pairs.dim() == 5) return linear_amx(x, pairs, bias);                                  // batch-invariant
  if (pairs.numel() && x.size(0) <= pairs_rows) return linear_pairs(x, pairs, bias);
  if (!packed) return at::linear(x, weight, present(bias));
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(weight);
  stack.emplace_back(bias.numel() ? c10::IValue(bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack.back().toTensor();
}

at::Tensor head_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {  // x: [T, heads, d]
  return rms_norm(x.reshape({-1, x.size(-1)}), weight, eps).view(x.sizes());
}

}  // namespace

namespace {

// The LoRA products of one layer's four fused products, for a step with adapter rows.
struct LayerLora {
  const std::vector<torch::Tensor>* factors = nullptr;  // [a, bt] x (qkv, o, gate_up, down)
  const std::vector<torch::Tensor>* meta = nullptr;     // [row_slots, (bounds, ranks) x 4]
  void add(int product, const at::Tensor& x, at::Tensor& y, const at::Tensor& row_slots) const {
    if (factors == nullptr) return;
    const at::Tensor& ranks = (*meta)[2 + 2 * product];
    if (!ranks.numel() || !x.size(0)) return;
    lora_add(x.contiguous(), y, (*factors)[2 * product], (*factors)[2 * product + 1], row_slots,
             (*meta)[1 + 2 * product], ranks);
  }
};

}  // namespace

std::vector<torch::Tensor> decoder_layers(torch::Tensor x, std::vector<std::vector<torch::Tensor>> layers,
                                          torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                                          std::vector<torch::Tensor> kv_caches, torch::Tensor slot_block_ids,
                                          torch::Tensor slot_offsets, torch::Tensor block_tables,
                                          torch::Tensor seq_lens, std::vector<int64_t> config,
                                          std::vector<double> scalars, std::optional<torch::Tensor> out_rows,
                                          std::optional<std::vector<std::vector<torch::Tensor>>> lora_layers,
                                          std::optional<std::vector<torch::Tensor>> lora_meta) {
  TORCH_CHECK(config.size() == 5 && scalars.size() == 2,
              "config: heads, kv heads, head_dim, packed, pairs_rows; eps, scale");
  TORCH_CHECK(layers.size() == kv_caches.size() && !layers.empty(), "one KV cache per layer");
  TORCH_CHECK(x.dim() == 2 && block_tables.size(0) == x.size(0) && seq_lens.size(0) == x.size(0),
              "one attention row per token");
  const int64_t heads = config[0], kv_heads = config[1], head_dim = config[2];
  const Product linear{config[3] != 0, config[4]};
  const double eps = scalars[0], scale = scalars[1];
  const int64_t tokens = x.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  TORCH_CHECK(!out_rows || (out_rows->dim() == 1 && out_rows->scalar_type() == at::kLong),
              "out_rows must be int64 [n]");
  TORCH_CHECK(lora_layers.has_value() == lora_meta.has_value(), "lora_layers and lora_meta go together");
  TORCH_CHECK(!lora_layers || (lora_layers->size() == layers.size() && lora_meta->size() == 9),
              "LoRA factors per layer; meta: row_slots, then bounds and ranks of four products");
  at::Tensor lora_rows = lora_meta ? (*lora_meta)[0] : at::Tensor();

  at::Tensor hidden, residual;
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto& w = layers[l];
    TORCH_CHECK(w.size() == kNumWeights, "each layer has ", int(kNumWeights), " weight slots");
    LayerLora lora;
    if (lora_layers) lora = LayerLora{&(*lora_layers)[l], &*lora_meta};
    if (l == 0) {
      residual = x;
      hidden = rms_norm(x, w[kInputNorm], eps);
    } else {
      fused_add_rms_norm(hidden, residual, w[kInputNorm], eps);  // hidden: the norm; residual: the sum
    }
    at::Tensor qkv = linear(hidden, w[kQkv], w[kQkvBias], w[kQkvPairs]);  // [T, q + 2 kv]
    lora.add(0, hidden, qkv, lora_rows);
    at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, heads, head_dim});
    at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, head_dim});
    if (w[kQNorm].numel() && w[kKNorm].numel()) {
      q = head_norm(q, w[kQNorm], eps);
      k = head_norm(k, w[kKNorm], eps);
    }
    rotary_embedding(q, k, cos, sin, positions);
    write_kv(k, v, kv_caches[l], slot_block_ids, slot_offsets);
    at::Tensor tables = block_tables, lens = seq_lens;
    int64_t rows = tokens;
    if (out_rows && l + 1 == layers.size()) {  // the last layer: only the scored rows go on
      q = q.index_select(0, *out_rows);
      tables = block_tables.index_select(0, *out_rows);
      lens = seq_lens.index_select(0, *out_rows);
      residual = residual.index_select(0, *out_rows);
      if (lora_layers) lora_rows = lora_rows.index_select(0, *out_rows);
      rows = out_rows->numel();
      if (rows == 0) return {residual.clone(), residual};  // no row scored: the KV write was all
    }
    const at::Tensor attention =
        paged_decode_attention(q.contiguous(), kv_caches[l], tables, lens, scale, 0, 0.0);  // [rows, heads, d]
    const at::Tensor attended = attention.view({rows, q_size});
    hidden = linear(attended, w[kO], at::Tensor(), w[kOPairs]);
    lora.add(1, attended, hidden, lora_rows);
    fused_add_rms_norm(hidden, residual, w[kPostNorm], eps);
    at::Tensor gate_up = linear(hidden, w[kGateUp], at::Tensor(), w[kGateUpPairs]);
    lora.add(2, hidden, gate_up, lora_rows);
    const at::Tensor activated = silu_and_mul(gate_up);
    hidden = linear(activated, w[kDown], at::Tensor(), w[kDownPairs]);
    lora.add(3, activated, hidden, lora_rows);
  }
  return {hidden, residual};
}
