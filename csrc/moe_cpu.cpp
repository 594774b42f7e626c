// The experts of a mixture-of-experts layer in one call: each expert present in the step takes its rows in
// one product (gate and up fused), the activation, the down product, and each row's experts are summed
// back in one fixed order. Reference: worker/models/experts.py Experts.reference (transformers' loop).
//
// fused_experts(x [T, H] float32 or bf16, ids [T, K] int64 (each row's experts, distinct, < E),
//               weights [T, K] float32, w13, w2, b13 [E, 2I] or empty, b2 [E, H] or empty,
//               activation, alpha, limit, shared [T, H] or empty, shared_gate [T] float32 or empty)
//   -> [T, H] in x's dtype
//   w13: each expert's [2I, H] gate-and-up weight (gate rows first), packed: pack_rows' layout stacked,
//        [E, 2I / 16, H, 16] (float32 or bf16), or pack_pairs' stacked, [E, 2I / 64, H / 2, 64, 2] (bf16,
//        AVX-512 BF16 builds); w2 likewise of each expert's [H, I] down weight.
//   activation: 0 silu(gate) * up; 1 gelu_tanh(gate) * up; 2 gpt-oss's clamped SwiGLU,
//        (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g) with g = min(gate, limit).
//   For each row t: out[t] = sum over its experts in ascending expert id of weights[t, k] * y_k, in float32
//   from 0, rounded once; y_k = (act(x[t] W13_e^T + b13_e) W2_e^T + b2_e), each product rounded to the
//   dtype as a product of the model is, the activation computed in float32 and rounded once.
//   shared: a shared expert's output (Qwen2-MoE), added as transformers adds it: out = T(T(sum) +
//   T(sigmoid(shared_gate[t]) * shared[t])), the sigmoid in float32 (exp_f32); no gate: times 1. Here, not
//   in torch, because torch's sigmoid of a [T, 1] tensor takes its scalar or its vector loop by T, and the
//   two differ in the last bit: a row's output would depend on how many rows share the step.
//
// Batch invariance: a row's products are its own (the product kernels keep each row's sums apart and in
// one order: csrc/gemm_rows.h, csrc/gemm_pairs.h), and its sum runs over its own experts in an order that
// its own choice fixes, so neither the other rows of the step nor which of them chose the same expert
// changes its result. Work units are (expert, pass of up to 6 of its rows, group of output columns), all
// of a product's units in one parallel loop: a step at 16 rows touches up to 16 K experts, and a loop per
// expert would pay the threads' hand-over that many times.
#include "ops.h"

#include "cpu_math.h"
#include "gemm_pairs.h"
#include "gemm_rows.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

struct Pass {
  int64_t expert, first, rows;  // rows [first, first + rows) of the sorted assignments
};

template <typename T>
inline float widen(T v) {
  return static_cast<float>(v);
}

// The gated activation of one value, as csrc/fused_cpu.cpp's act_and_mul computes it (the gate's activation
// rounded to T, then times up): the dense MLP's numbers.
template <typename T>
inline float act_of(int activation, float gate, float up, float alpha, float limit) {
  if (activation == 0) return widen(static_cast<T>(gate / (1.f + exp_f32(-gate)))) * up;
  if (activation == 1) {
    const float y = 0.7978845608028654f * (gate + 0.044715f * gate * gate * gate);
    return widen(static_cast<T>(0.5f * gate * (2.f - 2.f / (exp_f32(2.f * y) + 1.f)))) * up;
  }
  const float g = std::min(gate, limit), u = std::min(std::max(up, -limit), limit);
  return (u + 1.f) * (g / (1.f + exp_f32(-alpha * g)));
}

// The units of a product, (pass, group), expert by expert and group by group: a group's lines serve all of
// its expert's passes (a prefill's hundreds of rows) while they are in cache, as linear_pairs' blocks do.
std::vector<std::pair<int64_t, int64_t>> unit_order(const std::vector<Pass>& passes, int64_t groups) {
  std::vector<std::pair<int64_t, int64_t>> units;
  units.reserve(passes.size() * groups);
  for (size_t first = 0, last; first < passes.size(); first = last) {
    for (last = first; last < passes.size() && passes[last].expert == passes[first].expert;) ++last;
    for (int64_t g = 0; g < groups; ++g)
      for (size_t i = first; i < last; ++i) units.emplace_back(static_cast<int64_t>(i), g);
  }
  return units;
}

// One product of every pass: y[a, :] = x_a W_e^T (+ b_e) for the sorted assignments a, rounded to T.
// x: the assignments' rows in float32 [A, k] (rows layout) or bf16 [A, k] (pairs layout).
template <typename T>
void experts_product(const std::vector<Pass>& passes, const torch::Tensor& x, const torch::Tensor& packed,
                     const float* bias, int64_t n, torch::Tensor& y) {
  const int64_t k = x.size(1);
  T* out = y.data_ptr<T>();
  if (packed.dim() == 4) {  // pack_rows' layout: [E, groups, k, 16]
    using rows_kernel::COLS;
    const int64_t groups = packed.size(1);
    const float* xs = x.data_ptr<float>();
    const T* w = packed.data_ptr<T>();
    const auto units = unit_order(passes, groups);
    at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
      float sums[rows_kernel::MAX_ROWS * COLS];
      for (int64_t unit = begin; unit < end; ++unit) {
        const Pass& p = passes[units[unit].first];
        const int64_t g = units[unit].second, cols = std::min(COLS, n - g * COLS);
        rows_kernel::GROUP_PASS<T>[p.rows](xs + p.first * k, k, w + (p.expert * groups + g) * k * COLS, sums);
        const float* b = bias != nullptr ? bias + p.expert * n + g * COLS : nullptr;
        for (int64_t m = 0; m < p.rows; ++m)
          for (int64_t c = 0; c < cols; ++c)
            out[(p.first + m) * n + g * COLS + c] = static_cast<T>(sums[m * COLS + c] + (b != nullptr ? b[c] : 0.f));
      }
    });
    return;
  }
#if defined(ENGINE_PAIRS)
  using pairs_kernel::GROUP;
  using pairs_kernel::MAX_ROWS;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const int64_t groups = packed.size(1), kpairs = k / 2;
    // each pass's dim pairs, its rows side by side (linear_pairs' layout)
    std::vector<uint32_t> xp(passes.size() * kpairs * MAX_ROWS);
    const auto* xs = reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>());
    at::parallel_for(0, static_cast<int64_t>(passes.size()), 4, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        for (int64_t r = 0; r < passes[i].rows; ++r)
          for (int64_t kp = 0; kp < kpairs; ++kp)
            xp[(i * kpairs + kp) * MAX_ROWS + r] = xs[(passes[i].first + r) * kpairs + kp];
    });
    const auto* wp = reinterpret_cast<const uint32_t*>(packed.data_ptr<c10::BFloat16>());
    const auto units = unit_order(passes, groups);
    const auto weights_of = [&](int64_t unit) {
      return wp + (passes[units[unit].first].expert * groups + units[unit].second) * kpairs * GROUP;
    };
    at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t i = units[unit].first, g = units[unit].second;
        const Pass& p = passes[i];
        // the thread's next unit's lines asked for into L2 one a dim pair, while this one runs: a decode
        // step's experts come from memory, and a unit alone is too short to hide its first reads (unless
        // the next unit is another pass over the same lines, already here)
        const uint32_t* here = weights_of(unit);
        const uint32_t* next = unit + 1 < end ? weights_of(unit + 1) : nullptr;
        const bool ahead = next != nullptr && next != here;
        pairs_kernel::GROUP_ROWS<_MM_HINT_T1>[p.rows](
            xp.data() + i * kpairs * MAX_ROWS, here, kpairs,
            bias != nullptr ? bias + p.expert * n + g * GROUP : nullptr, out + p.first * n + g * GROUP, n,
            ahead ? next : nullptr, ahead ? kpairs : 0, 1);
      }
    });
    return;
  }
#endif
  TORCH_CHECK(false, "fused_experts: pack_pairs' layout needs a bf16 model and a build with AVX-512 BF16");
}

template <typename T>
torch::Tensor run(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights,
                  const torch::Tensor& w13, const torch::Tensor& w2, const float* b13, const float* b2,
                  int activation, float alpha, float limit, const T* shared, const float* shared_gate) {
  const int64_t tokens = x.size(0), hidden = x.size(1), top = ids.size(1), experts = w13.size(0);
  const bool rows_layout = w13.dim() == 4;
  const int64_t inter = rows_layout ? w2.size(2) : w2.size(2) * 2;  // I (pairs: w2 holds I / 2 dim pairs)
  const int64_t* id = ids.data_ptr<int64_t>();
  // the assignments (t, k) sorted by expert, then by row: counting sort
  std::vector<int64_t> start(experts + 1, 0), order(tokens * top), slot_of(tokens * top);
  for (int64_t a = 0; a < tokens * top; ++a) {
    TORCH_CHECK(id[a] >= 0 && id[a] < experts, "fused_experts: expert id ", id[a], " out of range");
    ++start[id[a] + 1];
  }
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t a = 0; a < tokens * top; ++a) {
    order[next[id[a]]] = a;
    slot_of[a] = next[id[a]]++;
  }
  std::vector<Pass> passes;
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t r = start[e]; r < start[e + 1]; r += 6) passes.push_back({e, r, std::min<int64_t>(6, start[e + 1] - r)});
  const int64_t assigned = tokens * top;
  const auto wide = at::kFloat;
  // the assignments' rows, in the layout their product reads
  torch::Tensor xa = rows_layout ? torch::empty({assigned, hidden}, x.options().dtype(wide))
                                 : torch::empty({assigned, hidden}, x.options());
  const T* xs = x.data_ptr<T>();
  at::parallel_for(0, assigned, 16, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      const T* src = xs + (order[s] / top) * hidden;
      if (rows_layout) {
        float* dst = xa.data_ptr<float>() + s * hidden;
        for (int64_t h = 0; h < hidden; ++h) dst[h] = widen(src[h]);
      } else {
        std::copy(src, src + hidden, xa.data_ptr<T>() + s * hidden);
      }
    }
  });
  auto gate_up = torch::empty({assigned, 2 * inter}, x.options());
  experts_product<T>(passes, xa, w13, b13, 2 * inter, gate_up);
  auto act = torch::empty({assigned, inter}, x.options().dtype(rows_layout ? wide : x.scalar_type()));
  const T* gu = gate_up.data_ptr<T>();
  at::parallel_for(0, assigned, 16, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s)
      for (int64_t i = 0; i < inter; ++i) {
        const T value = static_cast<T>(
            act_of<T>(activation, widen(gu[s * 2 * inter + i]), widen(gu[s * 2 * inter + inter + i]), alpha, limit));
        if (rows_layout)
          act.data_ptr<float>()[s * inter + i] = widen(value);
        else
          act.data_ptr<T>()[s * inter + i] = value;
      }
  });
  auto down = torch::empty({assigned, hidden}, x.options());
  experts_product<T>(passes, act, w2, b2, hidden, down);
  auto out = torch::empty({tokens, hidden}, x.options());
  const T* ys = down.data_ptr<T>();
  const float* wt = weights.data_ptr<float>();
  T* o = out.data_ptr<T>();
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> ks(top);
    std::vector<float> sum(hidden);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t k = 0; k < top; ++k) ks[k] = k;
      std::sort(ks.begin(), ks.end(), [&](int64_t a, int64_t b) { return id[t * top + a] < id[t * top + b]; });
      std::fill(sum.begin(), sum.end(), 0.f);
      for (int64_t k : ks) {
        const float w = wt[t * top + k];
        const T* y = ys + slot_of[t * top + k] * hidden;
        for (int64_t h = 0; h < hidden; ++h) sum[h] += w * widen(y[h]);
      }
      if (shared == nullptr) {
        for (int64_t h = 0; h < hidden; ++h) o[t * hidden + h] = static_cast<T>(sum[h]);
        continue;
      }
      const float gate = shared_gate != nullptr ? 1.f / (1.f + exp_f32(-shared_gate[t])) : 1.f;
      for (int64_t h = 0; h < hidden; ++h) {
        const T part = static_cast<T>(gate * widen(shared[t * hidden + h]));
        o[t * hidden + h] = static_cast<T>(widen(static_cast<T>(sum[h])) + widen(part));
      }
    }
  });
  return out;
}

}  // namespace

torch::Tensor fused_experts(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w13,
                            torch::Tensor w2, torch::Tensor b13, torch::Tensor b2, int64_t activation, double alpha,
                            double limit, torch::Tensor shared, torch::Tensor shared_gate) {
  TORCH_CHECK(x.dim() == 2 && ids.dim() == 2 && ids.size(0) == x.size(0) && weights.sizes() == ids.sizes(),
              "fused_experts: x [T, H], ids and weights [T, K]");
  TORCH_CHECK(ids.scalar_type() == at::kLong && weights.scalar_type() == at::kFloat,
              "fused_experts: ids int64, weights float32");
  TORCH_CHECK((w13.dim() == 4 && w2.dim() == 4) || (w13.dim() == 5 && w2.dim() == 5),
              "fused_experts: w13 and w2 both in pack_rows' or both in pack_pairs' layout, stacked by expert");
  TORCH_CHECK(w13.scalar_type() == x.scalar_type() && w2.scalar_type() == x.scalar_type(),
              "fused_experts: the weights share x's dtype");
  TORCH_CHECK(activation >= 0 && activation <= 2, "fused_experts: activation 0, 1 or 2");
  const bool rows_layout = w13.dim() == 4;
  const int64_t hidden = x.size(1);
  TORCH_CHECK(rows_layout ? w13.size(2) == hidden : w13.size(2) * 2 == hidden, "fused_experts: hidden size differs");
  const int64_t inter = rows_layout ? w2.size(2) : w2.size(2) * 2;
  TORCH_CHECK(rows_layout ? w13.size(1) * 16 >= 2 * inter : w13.size(1) * 64 == 2 * inter,
              "fused_experts: w13 is not [E, 2I, H] packed");
  TORCH_CHECK(rows_layout ? w2.size(1) * 16 >= hidden : w2.size(1) * 64 == hidden,
              "fused_experts: w2 is not [E, H, I] packed");
  const bool has_b13 = b13.defined() && b13.numel() > 0, has_b2 = b2.defined() && b2.numel() > 0;
  TORCH_CHECK(!has_b13 || b13.numel() == w13.size(0) * 2 * inter, "fused_experts: b13 is [E, 2I]");
  TORCH_CHECK(!has_b2 || b2.numel() == w13.size(0) * hidden, "fused_experts: b2 is [E, H]");
  const torch::Tensor b13f = has_b13 ? b13.to(at::kFloat).contiguous() : torch::Tensor();
  const torch::Tensor b2f = has_b2 ? b2.to(at::kFloat).contiguous() : torch::Tensor();
  const float* b13p = has_b13 ? b13f.data_ptr<float>() : nullptr;
  const float* b2p = has_b2 ? b2f.data_ptr<float>() : nullptr;
  const auto xc = x.contiguous(), idc = ids.contiguous(), wc = weights.contiguous();
  const auto w13c = w13.contiguous(), w2c = w2.contiguous();
  const bool has_shared = shared.defined() && shared.numel() > 0;
  const bool has_gate = shared_gate.defined() && shared_gate.numel() > 0;
  TORCH_CHECK(!has_shared || (shared.sizes() == x.sizes() && shared.scalar_type() == x.scalar_type()),
              "fused_experts: shared is [T, H] in x's dtype");
  TORCH_CHECK(!has_gate || (has_shared && shared_gate.numel() == x.size(0) && shared_gate.scalar_type() == at::kFloat),
              "fused_experts: shared_gate is float32 [T], with shared");
  const auto shared_c = has_shared ? shared.contiguous() : torch::Tensor();
  const auto gate_c = has_gate ? shared_gate.contiguous() : torch::Tensor();
  const float* gate_p = has_gate ? gate_c.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat)
    return run<float>(xc, idc, wc, w13c, w2c, b13p, b2p, static_cast<int>(activation), static_cast<float>(alpha),
                      static_cast<float>(limit), has_shared ? shared_c.data_ptr<float>() : nullptr, gate_p);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "fused_experts takes float32 or bf16");
  return run<c10::BFloat16>(xc, idc, wc, w13c, w2c, b13p, b2p, static_cast<int>(activation),
                            static_cast<float>(alpha), static_cast<float>(limit),
                            has_shared ? shared_c.data_ptr<c10::BFloat16>() : nullptr, gate_p);
}
