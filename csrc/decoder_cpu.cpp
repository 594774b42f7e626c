// The decoder layers of a pre-norm, sandwich-norm or post-norm family in one call, for steps whose attention
// is all paged-kernel rows (decode, and prefill chunks short enough for the paged kernel). The same kernels,
// in the same order, as the Python layers in worker/models/decoder.py with the csrc ops: the results are
// identical; what goes is Python's per-op cost (module calls, views, bindings: ~100 us a layer, a tenth of a
// small decode step). worker/models/native.py says which models it runs and passes their weights.
//
// decoder_layers(x, layers, ropes, kv_caches, pools, config, layer_kinds, scalars, out_rows, lora_layers,
//                lora_meta) -> (output, residual): their sum is the hidden state after the last layer, of the
//                rows out_rows names (all rows when None)
//
// x:          [T, hidden]  the embedded tokens; becomes the residual stream (modified in place)
// layers:     per layer [input_norm, qkv, qkv_bias, o, post_norm, gate_up, down, q_norm, k_norm, qkv_pairs,
//             o_pairs, gate_up_pairs, down_pairs, post_attn_norm, post_mlp_norm, o_bias, gate_up_bias,
//             down_bias, input_norm_bias, post_norm_bias, then a mixture of experts' router, router_bias,
//             router_packing, w13, w2, b13, b2, shared_gate, shared_gate_packing, score_bias, moe_ints
//             [kind, top_k, renormalize, groups, top_groups, activation], moe_floats [scaling, alpha, limit],
//             then sinks, then the act-order input orders of qkv, o, gate_up and down, then latent attention's
//             q_a (weight, bias, packing), q_a_norm, kv_a (weight, bias, packing), kv_a_norm, uk and uv (each
//             head's linear_rows packing of W_UK^T and W_UV^T: [heads, ...]) and latent_ints [kv_lora_rank,
//             nope, rope, v, q_lora_rank] (empty but for DeepSeek's layers: the latent branch below), then
//             act-order experts' input orders (expert_loop's orders13 and orders2; empty: none)] (a plain
//             MLP's up product in gate_up's slots; a mixture of experts' shared expert in the MLP's, its
//             routing as route_experts and its experts as fused_experts take them, or, kept as their blocks,
//             expert_loop: w13 the bytes, w2 the parts' table); an empty tensor is an absent bias, norm,
//             packing, shared expert or mixture of experts (a dense MLP). A norm's weight of float32 under
//             a bf16 x is Gemma's 1 + w (rms_norm's one-rounding form). A 3-d packing is linear_rows' (batch-invariant: every row
//             count takes it; out features a multiple of 16), a 5-d one linear_amx's (batch-invariant too:
//             pack_pairs' viewed [N / 64, K / 32, 16, 64, 2]), a uint8 one GGUF blocks kept packed, its weight
//             slot linear_quant_parts' int64 parts (batch-invariant). An act-order product's order (GPTQ's
//             desc_act, compressed-tensors' actorder) is int64 [K], the input columns every part takes
//             (gather_columns first), or [parts, K], each part's own (each part then a product of its own,
//             as worker/models/layers.py Linear._quant_forward runs them); empty: none. Products of at most
//             config.pairs_rows rows use the pairs packing where given; the others oneDNN's packed weights
//             when config.packed, else at::linear on plain [out, in] ones.
// ropes:      cos, sin, positions of the global rotary, then of the local one where the model has it
// pools:      slot_block_ids, slot_offsets, block_tables, seq_lens of the KV pool, then of the windowed
//             layers' pool where the model keeps one (worker/kv_groups.py); block_tables and seq_lens give
//             one paged-attention row per token, as paged_decode_attention takes them
// config:     num_heads, num_kv_heads, head_dim, packed (0/1), pairs_rows, layout (0 pre, 1 sandwich:
//             the attention's and the MLP's outputs normed before their adds, 2 post: no norm before them,
//             their outputs normed, 3 parallel: out = (mlp(norm2(x)) + attn(norm1(x))) + x, GPT-NeoX's, 4
//             parallel with one norm: (x + attn(norm(x))) + mlp(norm(x)), StableLM's), MLP (0 SiLU-gated,
//             1 GELU(tanh)-gated, 2 GELU-gated, 3 GELU(tanh) plain, 4 GELU plain: the last three as the
//             Python layers compute them, in float32 through ATen), norm (0 RMS, 1 LayerNorm through ATen,
//             with the bias slots, 2 Command R's LayerNorm: its float32 formula, no bias), q/k norm (0 none,
//             1 per head, 2 over the whole projection, 3 a weight per head: [heads, head_dim], with the
//             layer's LayerNorm kind: StableLM's per-head LayerNorms, Command R's), interleaved rotary pairs (0/1; a rope's cos/sin may cover fewer dims
//             than a head's: partial rotary)
// layer_kinds: per layer window (0: none), rope (-1 none, 0 global, 1 local), pool (0, 1)
// scalars:    eps, scale, attention soft-cap (0: none), residual multiplier
// out_rows:   int64 [n], the rows whose hidden state the step scores (sampled tokens, prompt logprobs). Past
//             the last layer's KV write no other row is read, so its attention, o and MLP run on those rows
//             alone (as llama.cpp's inp_out_ids does): in a prefill step most of a layer's products.
// lora_layers, lora_meta: a step with LoRA rows (worker/lora/slots.py): per layer [a, bt] of qkv, o,
//             gate_up and down, then, for a mixture of experts, [a, bt] of the experts' gate_up and down
//             (worker/lora/expert_slots.py; empty where no adapter targets them); meta [row_slots, then bounds
//             and ranks of qkv, o, gate_up, down, then for the experts: holding (int64 [slots], 1 where the
//             slot's adapter targets them), bounds and ranks of gate_up and down] (an empty ranks: no slot's
//             adapter targets that product). lora_add follows each product they name; rows whose adapter
//             targets the experts take expert_loop with theirs, the others fused_experts.
#include "ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

namespace {

enum Weight {
  kInputNorm, kQkv, kQkvBias, kO, kPostNorm, kGateUp, kDown, kQNorm, kKNorm,
  kQkvPairs, kOPairs, kGateUpPairs, kDownPairs, kPostAttnNorm, kPostMlpNorm, kOBias, kGateUpBias,
  kDownBias, kInputNormBias, kPostNormBias, kRouter, kRouterBias, kRouterPacking, kW13, kW2, kB13, kB2,
  kSharedGate, kSharedGatePacking, kScoreBias, kMoeInts, kMoeFloats, kSinks, kQkvOrder, kOOrder,
  kGateUpOrder, kDownOrder, kQA, kQABias, kQAPacking, kQANorm, kKvA, kKvABias, kKvAPacking, kKvANorm, kUk, kUv,
  kLatentInts, kExpertOrders13, kExpertOrders2, kNumWeights
};
enum Layout { kPre, kSandwich, kPost, kParallel, kParallelShared };
enum Activation { kSiluGated, kGeluTanhGated, kGeluGated, kGeluTanhPlain, kGeluPlain };
enum QkNorm { kNoQkNorm, kHeadNorm, kProjNorm, kHeadEachNorm };
enum NormKind { kRmsNorm, kLayerNorm, kCohereNorm };

std::optional<at::Tensor> present(const at::Tensor& t) {
  return t.numel() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// What worker/models/layers.py Linear.forward calls: few rows against the pairs packing, else oneDNN's
// product on a weight packed at load.
struct Product {
  bool packed;
  int64_t pairs_rows;
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                        const at::Tensor& pairs, const at::Tensor& order = at::Tensor()) const;
};

at::Tensor Product::operator()(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                               const at::Tensor& pairs, const at::Tensor& order) const {
  if (pairs.scalar_type() == at::kByte) return linear_blocks(x, pairs, weight, bias, order);  // weight: the parts
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
                                          std::vector<torch::Tensor> ropes, std::vector<torch::Tensor> kv_caches,
                                          std::vector<torch::Tensor> pools, std::vector<int64_t> config,
                                          std::vector<int64_t> layer_kinds, std::vector<double> scalars,
                                          std::optional<torch::Tensor> out_rows,
                                          std::optional<std::vector<std::vector<torch::Tensor>>> lora_layers,
                                          std::optional<std::vector<torch::Tensor>> lora_meta) {
  TORCH_CHECK(config.size() == 10 && scalars.size() == 4,
              "config: heads, kv heads, head_dim, packed, pairs_rows, layout, MLP, q/k norm, interleaved, norm; "
              "scalars: eps, scale, soft-cap, residual multiplier");
  TORCH_CHECK(layers.size() == kv_caches.size() && !layers.empty(), "one KV cache per layer");
  TORCH_CHECK(layer_kinds.size() == 3 * layers.size(), "window, rope and pool per layer");
  TORCH_CHECK((ropes.size() == 3 || ropes.size() == 6) && (pools.size() == 4 || pools.size() == 8),
              "ropes: cos, sin, positions, once or twice; pools: slots, offsets, tables, lengths, once or twice");
  TORCH_CHECK(x.dim() == 2, "x must be [tokens, hidden]");
  for (size_t p = 0; p < pools.size(); p += 4)
    TORCH_CHECK(pools[p + 2].size(0) == x.size(0) && pools[p + 3].size(0) == x.size(0),
                "one attention row per token");
  const int64_t heads = config[0], kv_heads = config[1], head_dim = config[2];
  const Product linear{config[3] != 0, config[4]};
  const int64_t layout = config[5], activation = config[6], qk_norm = config[7];
  const bool interleaved = config[8] != 0, layer_norms = config[9] != kRmsNorm;
  const int64_t norm_kind = config[9];
  TORCH_CHECK(layout >= kPre && layout <= kParallelShared && activation >= kSiluGated &&
                  activation <= kGeluPlain && qk_norm >= 0 && qk_norm <= kHeadEachNorm && norm_kind >= 0 &&
                  norm_kind <= kCohereNorm && (qk_norm != kHeadEachNorm || layer_norms),
              "unknown layout, MLP, norm or q/k norm");
  const double eps = scalars[0], scale = scalars[1], softcap = scalars[2], multiplier = scalars[3];
  const int64_t tokens = x.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  TORCH_CHECK(!out_rows || (out_rows->dim() == 1 && out_rows->scalar_type() == at::kLong),
              "out_rows must be int64 [n]");
  TORCH_CHECK(lora_layers.has_value() == lora_meta.has_value(), "lora_layers and lora_meta go together");
  TORCH_CHECK(!lora_layers || (lora_layers->size() == layers.size() &&
                                (lora_meta->size() == 9 || lora_meta->size() == 14)),
              "LoRA factors per layer; meta: row_slots, then bounds and ranks of four products (and the experts')");
  at::Tensor lora_rows = lora_meta ? (*lora_meta)[0] : at::Tensor();
  const auto scaled = [&](at::Tensor t) { return multiplier != 1.0 ? t.mul(multiplier) : t; };
  // Command R's LayerNorm (worker/models/norms.py CohereLayerNorm): float32 mean and variance, no bias; a
  // [heads, d] weight normalizes each head of a [T, heads, d] x
  const auto cohere_norm = [&](const at::Tensor& t, const at::Tensor& weight) {
    const at::Tensor x32 = t.to(at::kFloat);
    const at::Tensor mean = x32.mean(-1, true);
    const at::Tensor variance = (x32 - mean).pow(2).mean(-1, true);
    const at::Tensor normed = (x32 - mean) * at::rsqrt(variance + eps);
    return (weight.to(at::kFloat) * normed).to(t.scalar_type());
  };
  // A layer's input or post norm: RMS on the kernel, or LayerNorm through ATen (as F.layer_norm).
  const auto norm = [&](const at::Tensor& t, const at::Tensor& weight, const at::Tensor& bias) {
    if (!layer_norms) return rms_norm(t, weight, eps);
    if (norm_kind == kCohereNorm) return cohere_norm(t, weight);
    return at::layer_norm(t, {t.size(-1)}, weight, present(bias), eps);
  };
  // q or k [T, heads, d] with a weight per head: Command R's norm, or a LayerNorm per head (StableLM's)
  const auto each_head_norm = [&](const at::Tensor& t, const at::Tensor& weight) {
    if (norm_kind == kCohereNorm) return cohere_norm(t, weight);
    std::vector<at::Tensor> each;
    for (int64_t h = 0; h < t.size(1); ++h)
      each.push_back(at::layer_norm(t.select(1, h), {t.size(-1)}, weight[h], std::nullopt, eps));
    return at::stack(each, 1);
  };
  // residual += x, then x = norm(residual): in place on the kernel (RMS), as new tensors otherwise.
  const auto add_and_norm = [&](at::Tensor& t, at::Tensor& residual, const at::Tensor& weight,
                                const at::Tensor& bias) {
    if (!layer_norms) {
      fused_add_rms_norm(t, residual, weight, eps);
      return;
    }
    residual = at::add(t, residual);
    t = norm(residual, weight, bias);
  };
  // activation(x) as worker/models/mlp.py computes it off the kernels: float32, rounded once
  const auto gelu = [&](const at::Tensor& t, bool tanh) {
    return at::gelu(t.to(at::kFloat), tanh ? "tanh" : "none").to(t.scalar_type());
  };

  // A product of a latent-attention layer, whose widths need not be the packing's: linear_rows told the
  // width, a pair packing padded to 64 columns cut back (worker/models/layers.py Linear.forward).
  const auto sized = [&](const at::Tensor& in, const at::Tensor& weight, const at::Tensor& bias,
                         const at::Tensor& packing, int64_t width) {
    if (packing.dim() == 3 && packing.scalar_type() != at::kByte) return linear_rows(in, packing, bias, width);
    const at::Tensor y = linear(in, weight, bias, packing);
    return y.size(1) == width ? y : y.narrow(1, 0, width);
  };
  // Multi-head latent attention in the absorbed form, as worker/models/mla.py LatentAttention.forward runs
  // it with the csrc kernels: q (through q_a and its norm where the model compresses it), the latent row
  // (kv_a: the normed compressed KV and the rotated shared key) written to the cache, each head's query
  // taken to the latent space (W_UK), one paged_decode_attention row per token over the latents, each head's
  // weighted latent taken to its values (W_UV), then o. Returns o's output for the scored rows.
  const auto latent_attention = [&](const at::Tensor& h, const std::vector<at::Tensor>& w, at::Tensor& cache,
                                    const at::Tensor& block_ids, const at::Tensor& offsets, at::Tensor tables,
                                    at::Tensor lens, const std::optional<at::Tensor>& scored) {
    const int64_t* dims = w[kLatentInts].data_ptr<int64_t>();
    const int64_t rank = dims[0], nope = dims[1], rot = dims[2], v_dim = dims[3], q_rank = dims[4];
    const at::Tensor none = at::empty({0}, at::kFloat);
    at::Tensor q;
    if (q_rank) {
      const at::Tensor compressed_q = sized(h, w[kQA], w[kQABias], w[kQAPacking], q_rank);
      q = sized(rms_norm(compressed_q, w[kQANorm], eps), w[kQkv], none, w[kQkvPairs], heads * (nope + rot));
    } else {
      q = sized(h, w[kQkv], none, w[kQkvPairs], heads * (nope + rot));
    }
    q = q.view({tokens, heads, nope + rot});
    const at::Tensor compressed = sized(h, w[kKvA], w[kKvABias], w[kKvAPacking], rank + rot);
    at::Tensor latent = at::empty_like(compressed);
    latent.narrow(1, 0, rank).copy_(rms_norm(compressed.narrow(1, 0, rank).contiguous(), w[kKvANorm], eps));
    at::Tensor q_pe = q.narrow(2, nope, rot).contiguous();
    at::Tensor k_pe = compressed.narrow(1, rank, rot).contiguous().view({tokens, 1, rot});
    rotary_embedding(q_pe, k_pe, ropes[0], ropes[1], ropes[2], interleaved);
    latent.narrow(1, rank, rot).copy_(k_pe.select(1, 0));
    cache.select(3, 0).select(1, 0).index_put_({block_ids, offsets}, latent);  // [blocks, block_size, D]
    if (scored) {  // past the cache write, only the rows scored
      q = q.index_select(0, *scored);
      q_pe = q_pe.index_select(0, *scored);
      tables = tables.index_select(0, *scored);
      lens = lens.index_select(0, *scored);
    }
    const int64_t rows = q.size(0);
    if (rows == 0) return at::empty({0, x.size(1)}, x.options());
    // each head's [rows, d] times its packed matrix -> [rows, heads, width]
    const auto absorbed = [&](const at::Tensor& in, const at::Tensor& packs, int64_t width) {
      std::vector<at::Tensor> each;
      for (int64_t head = 0; head < heads; ++head)
        each.push_back(linear_rows(in.select(1, head).contiguous(), packs[head], none, width));
      return at::stack(each, 1);
    };
    const at::Tensor q_latent = at::cat({absorbed(q.narrow(2, 0, nope), w[kUk], rank), q_pe}, -1);
    const at::Tensor attended =
        paged_decode_attention(q_latent.contiguous(), cache, tables, lens, scale, 0, 0.0, none).narrow(-1, 0, rank);
    const at::Tensor values = absorbed(attended, w[kUv], v_dim);  // [rows, heads, v]
    return sized(values.reshape({-1, heads * v_dim}), w[kO], w[kOBias], w[kOPairs], x.size(1));
  };

  at::Tensor hidden, residual;
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto& w = layers[l];
    TORCH_CHECK(w.size() == kNumWeights, "each layer has ", int(kNumWeights), " weight slots");
    const int64_t window = layer_kinds[3 * l], rope = layer_kinds[3 * l + 1], pool = 4 * layer_kinds[3 * l + 2];
    TORCH_CHECK(rope < 0 || 3 * rope + 2 < int64_t(ropes.size()), "layer ", l, " takes a rope not given");
    TORCH_CHECK(pool + 3 < int64_t(pools.size()), "layer ", l, " takes a KV pool not given");
    LayerLora lora;
    if (lora_layers) lora = LayerLora{&(*lora_layers)[l], &*lora_meta};
    at::Tensor h;
    if (layout == kPost) {  // attention reads the stream itself
      residual = l == 0 ? x : at::add(hidden, residual);
      h = residual;
    } else if (l == 0) {
      residual = x;
      h = norm(x, w[kInputNorm], w[kInputNormBias]);
    } else {
      add_and_norm(hidden, residual, w[kInputNorm], w[kInputNormBias]);  // hidden: the norm; residual: the sum
      h = hidden;
    }
    if (w[kLatentInts].numel()) {  // multi-head latent attention (worker/models/mla.py LatentAttention)
      hidden = latent_attention(h, w, kv_caches[l], pools[pool], pools[pool + 1], pools[pool + 2], pools[pool + 3],
                                l + 1 == layers.size() ? out_rows : std::nullopt);
      if (out_rows && l + 1 == layers.size()) {
        residual = residual.index_select(0, *out_rows);
        h = h.index_select(0, *out_rows);
        if (out_rows->numel() == 0) return {residual.clone(), residual};
      }
    } else {
      at::Tensor qkv = linear(h, w[kQkv], w[kQkvBias], w[kQkvPairs], w[kQkvOrder]);  // [T, q + 2 kv]
      lora.add(0, h, qkv, lora_rows);
      at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
      if (qk_norm == kProjNorm) {
        q = rms_norm(q, w[kQNorm], eps);
        k = rms_norm(k, w[kKNorm], eps);
      }
      q = q.view({tokens, heads, head_dim});
      k = k.view({tokens, kv_heads, head_dim});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, kv_heads, head_dim});
      if (qk_norm == kHeadNorm) {
        q = head_norm(q, w[kQNorm], eps);
        k = head_norm(k, w[kKNorm], eps);
      } else if (qk_norm == kHeadEachNorm) {
        q = each_head_norm(q, w[kQNorm]);
        k = each_head_norm(k, w[kKNorm]);
      }
      if (rope >= 0) rotary_embedding(q, k, ropes[3 * rope], ropes[3 * rope + 1], ropes[3 * rope + 2], interleaved);
      write_kv(k, v, kv_caches[l], pools[pool], pools[pool + 1]);
      at::Tensor tables = pools[pool + 2], lens = pools[pool + 3];
      int64_t rows = tokens;
      if (out_rows && l + 1 == layers.size()) {  // the last layer: only the scored rows go on
        q = q.index_select(0, *out_rows);
        tables = tables.index_select(0, *out_rows);
        lens = lens.index_select(0, *out_rows);
        residual = residual.index_select(0, *out_rows);
        h = h.index_select(0, *out_rows);
        if (lora_layers) lora_rows = lora_rows.index_select(0, *out_rows);
        rows = out_rows->numel();
        if (rows == 0) return {residual.clone(), residual};  // no row scored: the KV write was all
      }
      const at::Tensor attention =
          paged_decode_attention(q.contiguous(), kv_caches[l], tables, lens, scale, window, softcap, w[kSinks]);
      const at::Tensor attended = attention.view({rows, q_size});  // [rows, heads * d]
      hidden = linear(attended, w[kO], w[kOBias], w[kOPairs], w[kOOrder]);
      lora.add(1, attended, hidden, lora_rows);
    }
    if (w[kPostAttnNorm].numel()) hidden = rms_norm(hidden, w[kPostAttnNorm], eps);
    hidden = scaled(hidden);
    at::Tensor attended_out;  // the parallel layouts: the attention branch, added after the MLP's
    if (layout == kParallel) {
      attended_out = hidden;
      h = norm(residual, w[kPostNorm], w[kPostNormBias]);
    } else if (layout == kParallelShared) {
      residual = at::add(residual, hidden);  // (x + attn), the MLP's input the layer's one norm
    } else if (layout == kPost) {  // the MLP reads the stream
      residual = at::add(hidden, residual);
      h = residual;
    } else {
      add_and_norm(hidden, residual, w[kPostNorm], w[kPostNormBias]);
      h = hidden;
    }
    // the dense MLP, or a mixture of experts' shared expert (LoRA: dense models only)
    const auto mlp = [&](const at::Tensor& in) {
      at::Tensor gate_up = linear(in, w[kGateUp], w[kGateUpBias], w[kGateUpPairs], w[kGateUpOrder]);
      lora.add(2, in, gate_up, lora_rows);
      at::Tensor activated;
      if (activation == kSiluGated) {
        activated = silu_and_mul(gate_up);
      } else if (activation == kGeluTanhGated) {
        activated = gelu_tanh_and_mul(gate_up);
      } else if (activation == kGeluGated) {
        const int64_t inter = gate_up.size(1) / 2;
        activated = gelu(gate_up.narrow(1, 0, inter), false).mul(gate_up.narrow(1, inter, inter));
      } else {
        activated = gelu(gate_up, activation == kGeluTanhPlain);
      }
      at::Tensor out = linear(activated, w[kDown], w[kDownBias], w[kDownPairs], w[kDownOrder]);
      lora.add(3, activated, out, lora_rows);
      return out;
    };
    if (w[kW13].numel()) {  // a mixture of experts (worker/models/moe.py SparseMoE)
      const int64_t* moe = w[kMoeInts].data_ptr<int64_t>();
      const double* numbers = w[kMoeFloats].data_ptr<double>();
      const bool blocks = w[kW13].scalar_type() == at::kByte;  // experts kept as their blocks (w2: the table)
      const int64_t experts = blocks ? w[kW2].size(0) : w[kW13].size(0);
      const at::Tensor logits =  // a router packed for linear_rows is padded to 16 columns: asked for its own
          w[kRouterPacking].dim() == 3 ? linear_rows(h, w[kRouterPacking], w[kRouterBias], experts)
                                       : linear(h, w[kRouter], w[kRouterBias], w[kRouterPacking]);
      const auto routed = route_experts(logits, moe[0], moe[1], moe[2] != 0, numbers[0], w[kScoreBias], moe[3], moe[4]);
      at::Tensor shared, shared_gate;
      if (w[kDown].numel() || w[kDownPairs].numel()) {
        shared = mlp(h);
        if (w[kSharedGate].numel() || w[kSharedGatePacking].numel())
          shared_gate = linear(h, w[kSharedGate], w[kScoreBias].new_empty({0}), w[kSharedGatePacking]).narrow(1, 0, 1).to(at::kFloat)
                            .reshape({-1});
      }
      // the experts of rows (all, or a subset: `pick` their indices); expert_lora: those rows' adapters on the
      // experts, expert by expert (worker/models/moe.py SparseMoE.with_adapters)
      const auto experts_of = [&](const at::Tensor& pick, bool expert_lora) {
        const auto rows_of = [&](const at::Tensor& t) {
          return !t.defined() || !pick.defined() ? t : t.index_select(0, pick);
        };
        const at::Tensor in = rows_of(h), ids = rows_of(routed[0]), weights = rows_of(routed[1]);
        const at::Tensor shared_in = rows_of(shared), gate_in = rows_of(shared_gate);
        const at::Tensor none = at::empty({0}, at::kFloat);
        if (!blocks && !expert_lora)
          return fused_experts(in, ids, weights, w[kW13], w[kW2], w[kB13], w[kB2], moe[5], numbers[1], numbers[2],
                               shared_in, gate_in);
        std::optional<std::vector<at::Tensor>> adapters;
        if (expert_lora) {
          const auto& f = (*lora_layers)[l];
          adapters = std::vector<at::Tensor>{f[8], f[9], f[10], f[11], rows_of(lora_rows), (*lora_meta)[10],
                                             (*lora_meta)[11], (*lora_meta)[12], (*lora_meta)[13]};
        }
        std::optional<std::vector<at::Tensor>> orders;
        if (w[kExpertOrders13].numel()) orders = std::vector<at::Tensor>{w[kExpertOrders13], w[kExpertOrders2]};
        return expert_loop(in, ids, weights, w[kW13], w[kW2], w[kB13], w[kB2], moe[5], numbers[1], numbers[2],
                           shared_in.defined() ? shared_in : none, gate_in.defined() ? gate_in : none, adapters,
                           orders);
      };
      // rows whose adapter targets this layer's experts (meta[9]: 1 for each slot holding such an adapter)
      at::Tensor adapted;
      if (lora_layers && lora_meta->size() == 14 && (*lora_layers)[l].size() == 12 && (*lora_layers)[l][8].numel()) {
        const at::Tensor holding = (*lora_meta)[9];
        const at::Tensor mask = (lora_rows >= 0) & (holding.index_select(0, lora_rows.clamp_min(0)) != 0);
        adapted = at::nonzero(mask).flatten();
        if (adapted.numel()) {
          const at::Tensor others = at::nonzero(mask.logical_not()).flatten();
          hidden = at::empty_like(h);
          if (others.numel()) hidden.index_copy_(0, others, experts_of(others, false));
          hidden.index_copy_(0, adapted, experts_of(adapted, true));
        }
      }
      if (!adapted.defined() || !adapted.numel()) hidden = experts_of(at::Tensor(), false);
    } else {
      hidden = mlp(h);
    }
    if (w[kPostMlpNorm].numel()) hidden = rms_norm(hidden, w[kPostMlpNorm], eps);
    hidden = scaled(hidden);
    if (layout == kParallel) hidden = at::add(hidden, attended_out);  // (mlp + attn), x the residual
  }
  return {hidden, residual};
}
