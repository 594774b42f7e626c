// Fused element-wise kernels for the CPU: each replaces a chain of eager torch ops (one pass over memory,
// one call instead of five to ten). Numerics follow Hugging Face's order of operations, including the
// rounding to the model dtype between steps, so float32 results equal the torch reference's up to
// summation order and bf16 results round the same way (references: worker/models/layers.py).
//
// rms_norm(x, weight, eps) -> out              out = weight * dtype(x * rsqrt(mean(x^2) + eps)); a float32
//                                              weight on bf16/fp16 x: dtype(x * rsqrt(..) * weight) (Gemma)
// fused_add_rms_norm(x, residual, weight, eps) in place: residual = dtype(x + residual);
//                                              x = rms_norm(residual)
// rotary_embedding(q, k, cos, sin, positions, interleaved)  in place, rotate-half pairs (i, i + R / 2), or
//                                              (2i, 2i + 1) interleaved; q [T, Hq, D] and k [T, Hk, D] may be
//                                              row-strided views (of a fused qkv); cos/sin [max_position, R]
//                                              float32, R <= D: the leading R dims rotate, the rest pass
// silu_and_mul(gate_up) -> out                 gate_up [T, 2I]: out = dtype(dtype(silu(gate)) * up)
// gelu_tanh_and_mul(gate_up) -> out            the same with GELU's tanh form (Gemma), tanh from exp_f32
// write_kv(k, v, kv_cache, block_ids, offsets) kv_cache[block_ids[t], 0|1, offsets[t]] = k[t] | v[t]
// argmax_rows(logits) -> [B] int64            float32 or bf16 [B, V]: the first index of each row's maximum
//                                              (torch.argmax for rows without NaN)
// gather_columns(x, order) -> out              x [M, K] (2- or 4-byte elements), order int64 [K]: out[m, j] =
//                                              x[m, order[j]] (an act-order product's inputs in its packed
//                                              weight's order; torch's index_select on dim 1 took 20-60 us)
#include "ops.h"
#include "cpu_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

template <typename scalar_t>
inline float to_float(scalar_t value) {
  return static_cast<float>(value);
}
template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 value) {  // the high half of a float32
  uint32_t bits = static_cast<uint32_t>(value.x) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// Rounds a float32 to the model dtype and back: what storing an intermediate tensor does in torch.
template <typename scalar_t>
inline float round_to(float value) {
  return to_float(static_cast<scalar_t>(value));
}
template <>
inline float round_to<float>(float value) {
  return value;
}
// bf16: round to nearest even with integer ops (as c10::BFloat16, NaN aside), which the compiler vectorizes.
inline uint16_t bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
template <>
inline float round_to<c10::BFloat16>(float value) {
  uint32_t bits = static_cast<uint32_t>(bf16_bits(value)) << 16;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}
template <typename scalar_t>
inline scalar_t from_float(float value) {
  return static_cast<scalar_t>(value);
}
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float value) {
  return c10::BFloat16(bf16_bits(value), c10::BFloat16::from_bits());
}

// Rows [begin, end) of work of `width` elements each: enough rows a task that waking a thread pays.
inline int64_t grain_for(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

// weight of x's dtype: Llama's rounding, weight * dtype(x * inv). A float32 weight with a narrower x: Gemma's,
// dtype(x * inv * weight), one rounding (the weight is 1 + w, made once at load). In float32 the two agree.
template <typename scalar_t, typename weight_t>
void rms_norm_row(const scalar_t* x, const weight_t* weight, scalar_t* out, int64_t hidden, float eps) {
  float sum = 0.f;
  for (int64_t i = 0; i < hidden; ++i) {
    const float v = to_float(x[i]);
    sum += v * v;
  }
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  if constexpr (std::is_same_v<scalar_t, weight_t>) {
    for (int64_t i = 0; i < hidden; ++i)
      out[i] = from_float<scalar_t>(to_float(weight[i]) * round_to<scalar_t>(to_float(x[i]) * inv));
  } else {
    for (int64_t i = 0; i < hidden; ++i) out[i] = from_float<scalar_t>(to_float(x[i]) * inv * weight[i]);
  }
}

// Calls f(weight pointer) with the weight as x's dtype or as float32 (an offset norm's 1 + w).
template <typename scalar_t, typename F>
void with_weight(const torch::Tensor& weight, const torch::Tensor& x, F&& f) {
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(-1) &&
                  (weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat),
              "weight must be a contiguous [hidden] of x's dtype or float32");
  if (weight.scalar_type() == x.scalar_type()) {
    f(weight.data_ptr<scalar_t>());
  } else {
    f(weight.data_ptr<float>());
  }
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, hidden] with contiguous rows");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  const int64_t rows = x.size(0), hidden = x.size(1), stride = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    with_weight<scalar_t>(weight, x, [&](const auto* wp) {
      at::parallel_for(0, rows, grain_for(hidden), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * stride, wp, op + r * hidden, hidden, eps);
      });
    });
  });
  return out;
}

void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() && x.dim() == 2,
              "x and residual must be contiguous [rows, hidden] of one shape");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type(), "x and residual must share a dtype");
  const int64_t rows = x.size(0), hidden = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    with_weight<scalar_t>(weight, x, [&](const auto* wp) {
      at::parallel_for(0, rows, grain_for(hidden), [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
          scalar_t* xr = xp + r * hidden;
          scalar_t* rr = rp + r * hidden;
          for (int64_t i = 0; i < hidden; ++i) rr[i] = from_float<scalar_t>(to_float(xr[i]) + to_float(rr[i]));
          rms_norm_row(rr, wp, xr, hidden, eps);
        }
      });
    });
  });
}

namespace {

// Each head's leading `rotary` dims (all of them, or fewer: partial rotary) rotate in pairs (i, i + rotary / 2)
// (HF's rotate_half), or (2i, 2i + 1) when interleaved (GLM, Command R); the rest of the head passes.
template <typename scalar_t>
void rotate_heads(scalar_t* base, int64_t row_stride, int64_t num_heads, int64_t head_dim, int64_t rotary,
                  bool interleaved, int64_t t, const float* cos, const float* sin) {
  const int64_t half = rotary / 2;
  scalar_t* row = base + t * row_stride;
  for (int64_t h = 0; h < num_heads; ++h) {
    scalar_t* x = row + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
      const float x1 = to_float(x[a]), x2 = to_float(x[b]);
      const float c1 = round_to<scalar_t>(cos[a]), s1 = round_to<scalar_t>(sin[a]);
      const float c2 = round_to<scalar_t>(cos[b]), s2 = round_to<scalar_t>(sin[b]);
      // x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product stored, then the sum.
      x[a] = from_float<scalar_t>(round_to<scalar_t>(x1 * c1) + round_to<scalar_t>(-x2 * s1));
      x[b] = from_float<scalar_t>(round_to<scalar_t>(x2 * c2) + round_to<scalar_t>(x1 * s2));
    }
  }
}

}  // namespace

void rotary_embedding(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin,
                      torch::Tensor positions, bool interleaved) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2), "q, k shapes");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k.stride(2) == 1 && k.stride(1) == k.size(2),
              "q and k heads must be contiguous within a token");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k dtypes differ");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(1) <= q.size(2) && cos.size(1) % 2 == 0 && cos.sizes() == sin.sizes(),
              "cos/sin must be contiguous float32 [max_position, rotary dims], at most head_dim, even");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.numel() == q.size(0), "int64 positions [T]");
  auto pos = positions.contiguous();
  const int64_t tokens = q.size(0), head_dim = q.size(2), rotary = cos.size(1), max_position = cos.size(0);
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(pp[t] >= 0 && pp[t] < max_position, "position out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary_embedding", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    const float* cp = cos.data_ptr<float>();
    const float* sp = sin.data_ptr<float>();
    const int64_t width = (q.size(1) + k.size(1)) * head_dim;
    at::parallel_for(0, tokens, grain_for(width), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cp + pp[t] * rotary;
        const float* s = sp + pp[t] * rotary;
        rotate_heads(qp, q.stride(0), q.size(1), head_dim, rotary, interleaved, t, c, s);
        rotate_heads(kp, k.stride(0), k.size(1), head_dim, rotary, interleaved, t, c, s);
      }
    });
  });
}

namespace {

// out = dtype(dtype(act(gate)) * up) for gate_up [T, 2I]: the gated MLPs' middle, act in float32.
template <typename Act>
torch::Tensor act_and_mul(const torch::Tensor& gate_up, Act act) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "act_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain_for(inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * stride;
        const scalar_t* up = gate + inter;
        scalar_t* o = op + r * inter;
        for (int64_t i = 0; i < inter; ++i)
          o[i] = from_float<scalar_t>(round_to<scalar_t>(act(to_float(gate[i]))) * to_float(up[i]));
      }
    });
  });
  return out;
}

}  // namespace

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  return act_and_mul(gate_up, [](float g) { return g / (1.f + exp_f32(-g)); });
}

torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up) {
  return act_and_mul(gate_up, [](float g) {
    const float y = 0.7978845608028654f * (g + 0.044715f * g * g * g);  // sqrt(2 / pi) (g + 0.044715 g^3)
    const float t = 1.f - 2.f / (exp_f32(2.f * y) + 1.f);               // tanh(y)
    return 0.5f * g * (1.f + t);
  });
}

void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor kv_cache, torch::Tensor block_ids,
              torch::Tensor offsets) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be a contiguous 5-d tensor");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.scalar_type() == kv_cache.scalar_type() &&
                  v.scalar_type() == kv_cache.scalar_type(),
              "k and v must be [T, kv_heads, head_dim] of the cache's dtype");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2),
              "k and v heads must be contiguous within a token");
  TORCH_CHECK(k.size(1) == kv_cache.size(3) && k.size(2) == kv_cache.size(4), "k/v and cache shapes differ");
  TORCH_CHECK(block_ids.scalar_type() == at::kLong && offsets.scalar_type() == at::kLong &&
                  block_ids.numel() == k.size(0) && offsets.numel() == k.size(0),
              "int64 block_ids and offsets [T]");
  auto blocks = block_ids.contiguous();
  auto offs = offsets.contiguous();
  const int64_t tokens = k.size(0), num_blocks = kv_cache.size(0), block_size = kv_cache.size(2);
  const int64_t token_bytes = k.size(1) * k.size(2) * k.element_size();
  const int64_t half_bytes = block_size * token_bytes;
  const int64_t* bp = blocks.data_ptr<int64_t>();
  const int64_t* op = offs.data_ptr<int64_t>();
  auto* cache = static_cast<char*>(kv_cache.data_ptr());
  const auto* kp = static_cast<const char*>(k.data_ptr());
  const auto* vp = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(bp[t] >= 0 && bp[t] < num_blocks && op[t] >= 0 && op[t] < block_size, "slot out of range");
    char* slot = cache + bp[t] * 2 * half_bytes + op[t] * token_bytes;
    std::memcpy(slot, kp + t * k_stride, token_bytes);
    std::memcpy(slot + half_bytes, vp + t * v_stride, token_bytes);
  }
}

template <typename scalar_t>
void argmax_rows_impl(const torch::Tensor& logits, torch::Tensor& out) {
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  const scalar_t* lp = logits.data_ptr<scalar_t>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain_for(vocab), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* row = lp + r * stride;
      float best = to_float(row[0]);
      for (int64_t i = 1; i < vocab; ++i) best = std::max(best, to_float(row[i]));  // vectorized
      int64_t index = 0;
      while (index < vocab - 1 && to_float(row[index]) != best) ++index;
      op[r] = index;
    }
  });
}

torch::Tensor argmax_rows(torch::Tensor logits) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16,
              "logits must be float32 or bfloat16");
  TORCH_CHECK(logits.size(1) > 0, "empty rows");
  auto out = torch::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  if (logits.scalar_type() == at::kFloat) {
    argmax_rows_impl<float>(logits, out);
  } else {
    argmax_rows_impl<c10::BFloat16>(logits, out);  // exact: every bfloat16 is a float32
  }
  return out;
}

namespace {

template <typename T>
void gather_columns_impl(const torch::Tensor& x, const int64_t* order, torch::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), stride = x.stride(0);
  const T* in = static_cast<const T*>(x.data_ptr());
  T* o = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, rows, std::max<int64_t>(1, 8192 / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t j = 0; j < k; ++j) o[m * k + j] = in[m * stride + order[j]];
  });
}

}  // namespace

torch::Tensor gather_columns(torch::Tensor x, torch::Tensor order) {
  check_rows(x, "x");
  TORCH_CHECK(order.scalar_type() == at::kLong && order.dim() == 1 && order.size(0) == x.size(1) &&
                  order.is_contiguous(),
              "gather_columns: order is a contiguous int64 [K] for x [M, K]");
  const int64_t k = x.size(1);
  const int64_t* o = order.data_ptr<int64_t>();
  for (int64_t j = 0; j < k; ++j) TORCH_CHECK(o[j] >= 0 && o[j] < k, "gather_columns: order[", j, "] is out of range");
  auto out = torch::empty({x.size(0), k}, x.options());
  if (x.element_size() == 2) {
    gather_columns_impl<uint16_t>(x, o, out);
  } else {
    TORCH_CHECK(x.element_size() == 4, "gather_columns: 2- or 4-byte elements");
    gather_columns_impl<uint32_t>(x, o, out);
  }
  return out;
}
