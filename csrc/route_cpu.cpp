// A mixture-of-experts router's choice, row by row: which experts each token takes and their weights.
// Reference: worker/models/moe.py SparseMoE.route_reference (transformers' routers, in torch).
//
// route_experts(logits [T, E] float32 or bf16, kind, top_k, renormalize, scaling, score_bias [E] float32 or
//               empty, groups, top_groups) -> (ids [T, K] int64, weights [T, K] float32)
//   kind 0 "softmax" (Mixtral, Qwen): p = softmax(logits) in float32; the top k of p; renormalized to sum
//        to 1 where `renormalize`.
//   kind 1 "topk_softmax" (gpt-oss): the top k logits, softmaxed among themselves.
//   kind 2 "softmax_grouped" (DeepSeek-V2's group_limited_greedy): p as kind 0; the experts in `groups`
//        groups, the `top_groups` groups of the highest best p eligible; the top k of p among them.
//   kind 3 "sigmoid_grouped" (DeepSeek-V3): s = sigmoid(logits); chosen by s + score_bias, groups ranked by
//        the sum of their two best; weights the chosen s, renormalized (over sum + 1e-20) where `renormalize`.
//   Every kind's weights end times `scaling`. Ties go to the lower expert id (torch.topk's order is not
//   specified). Each row alone, in one order: a token's experts and weights never depend on the batch.
#include "ops.h"
#include "cpu_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

// The k indices of the largest values (the lower index first among equals), in descending value.
void top_indices(const float* values, int64_t n, int64_t k, std::vector<int64_t>& order) {
  order.resize(n);
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  });
  order.resize(k);
}

void softmax(float* p, int64_t n) {
  const float top = *std::max_element(p, p + n);
  float sum = 0.f;
  for (int64_t i = 0; i < n; ++i) sum += (p[i] = exp_f32(p[i] - top));
  for (int64_t i = 0; i < n; ++i) p[i] /= sum;
}

// Sets the experts outside the `top_groups` best groups (by `group_score`) of `choice` to `fill`.
template <typename GroupScore>
void keep_best_groups(float* choice, int64_t experts, int64_t groups, int64_t top_groups, float fill,
                      GroupScore group_score, std::vector<float>& scores, std::vector<int64_t>& order) {
  const int64_t size = experts / groups;
  scores.resize(groups);
  for (int64_t g = 0; g < groups; ++g) scores[g] = group_score(choice + g * size, size);
  top_indices(scores.data(), groups, top_groups, order);
  std::vector<char> kept(groups, 0);
  for (int64_t g : order) kept[g] = 1;
  for (int64_t g = 0; g < groups; ++g)
    if (!kept[g]) std::fill(choice + g * size, choice + (g + 1) * size, fill);
}

}  // namespace

std::vector<torch::Tensor> route_experts(torch::Tensor logits, int64_t kind, int64_t top_k, bool renormalize,
                                         double scaling, torch::Tensor score_bias, int64_t groups,
                                         int64_t top_groups) {
  TORCH_CHECK(logits.dim() == 2, "route_experts: logits [T, E]");
  TORCH_CHECK(kind >= 0 && kind <= 3, "route_experts: kind 0-3");
  const auto l32 = logits.to(at::kFloat).contiguous();
  const int64_t tokens = l32.size(0), experts = l32.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "route_experts: top_k within the experts");
  TORCH_CHECK(kind < 2 || (groups >= 1 && experts % groups == 0 && top_groups >= 1 && top_groups <= groups),
              "route_experts: groups divide the experts, top_groups within them");
  const bool has_bias = score_bias.defined() && score_bias.numel() > 0;
  TORCH_CHECK(kind != 3 || (has_bias && score_bias.numel() == experts && score_bias.scalar_type() == at::kFloat),
              "route_experts: sigmoid_grouped takes a float32 score_bias [E]");
  const auto bias_c = has_bias ? score_bias.contiguous() : torch::Tensor();
  const float* bias = has_bias ? bias_c.data_ptr<float>() : nullptr;
  auto ids = torch::empty({tokens, top_k}, logits.options().dtype(at::kLong));
  auto weights = torch::empty({tokens, top_k}, logits.options().dtype(at::kFloat));
  const float* in = l32.data_ptr<float>();
  int64_t* id = ids.data_ptr<int64_t>();
  float* wt = weights.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> p(experts), choice(experts), scratch;
    std::vector<int64_t> order, group_order;
    for (int64_t t = begin; t < end; ++t) {
      std::copy(in + t * experts, in + (t + 1) * experts, p.begin());
      float* w = wt + t * top_k;
      if (kind == 1) {
        top_indices(p.data(), experts, top_k, order);
        for (int64_t k = 0; k < top_k; ++k) w[k] = p[order[k]];
        softmax(w, top_k);
      } else {
        if (kind == 3) {
          for (int64_t e = 0; e < experts; ++e) {
            p[e] = 1.f / (1.f + exp_f32(-p[e]));
            choice[e] = p[e] + bias[e];
          }
          keep_best_groups(choice.data(), experts, groups, top_groups, -INFINITY, [](const float* c, int64_t n) {
            float a = -INFINITY, b = -INFINITY;  // the two best
            for (int64_t i = 0; i < n; ++i) {
              if (c[i] > a) { b = a; a = c[i]; } else if (c[i] > b) { b = c[i]; }
            }
            return a + b;
          }, scratch, group_order);
        } else {
          softmax(p.data(), experts);
          choice = p;
          if (kind == 2)
            keep_best_groups(choice.data(), experts, groups, top_groups, 0.f, [](const float* c, int64_t n) {
              return *std::max_element(c, c + n);
            }, scratch, group_order);
        }
        top_indices(choice.data(), experts, top_k, order);
        float sum = 0.f;
        for (int64_t k = 0; k < top_k; ++k) sum += (w[k] = kind == 2 ? choice[order[k]] : p[order[k]]);
        if (renormalize)
          for (int64_t k = 0; k < top_k; ++k) w[k] /= kind == 3 ? sum + 1e-20f : sum;
      }
      for (int64_t k = 0; k < top_k; ++k) {
        id[t * top_k + k] = order[k];
        w[k] *= static_cast<float>(scaling);
      }
    }
  });
  return {ids, weights};
}
