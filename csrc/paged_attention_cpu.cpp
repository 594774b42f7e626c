// Paged decode attention for the CPU: one query token per sequence, keys and values read straight
// from the paged KV cache (no gather). Reference: worker/attention/torch_ref.py (decode).
//
// query:        [num_seqs, num_heads, head_dim]                       (contiguous)
// kv_cache:     [num_blocks, 2, block_size, num_kv_heads, head_dim]   (contiguous; 0 = key, 1 = value)
// block_tables: [num_seqs, max_blocks] int64
// seq_lens:     [num_seqs] int64, tokens in the cache for each sequence (the new one included)
// returns       [num_seqs, num_heads, head_dim]
//
// A task is one sequence and a run of its kv heads (all of them when there are enough sequences to
// keep every thread busy, so each cache line is read once and in order). Scores are float32, the
// softmax is exact (two passes), values are accumulated in float32.
#include "ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// Element loads to float. bfloat16 is the high half of a float32: a shift the compiler vectorizes.
template <typename scalar_t>
static inline float load(const scalar_t* p, int64_t i) {
  return static_cast<float>(p[i]);
}
template <>
inline float load<c10::BFloat16>(const c10::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

struct Shape {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, heads_per_task;
};

// HEAD_DIM > 0 fixes head_dim at compile time (unrolled, vectorized loops); 0 reads it at run time.
template <typename scalar_t, int HEAD_DIM>
static void decode_attention_impl(const scalar_t* query, const scalar_t* cache, const int64_t* tables,
                                  const int64_t* seq_lens, scalar_t* out, Shape shape, float scale) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : shape.head_dim;
  TORCH_CHECK(head_dim <= 512, "head_dim above 512 is not supported");
  const int64_t group = shape.num_heads / shape.num_kv_heads;
  const int64_t kv_heads = shape.heads_per_task;           // kv heads handled by one task
  const int64_t num_q = kv_heads * group;                   // query heads handled by one task
  const int64_t tasks_per_seq = shape.num_kv_heads / kv_heads;
  const int64_t token_stride = shape.num_kv_heads * head_dim;
  const int64_t half_stride = shape.block_size * token_stride;
  const int64_t block_stride = 2 * half_stride;
  at::parallel_for(0, shape.num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(num_q * head_dim), acc(num_q * head_dim), scores;
    alignas(64) float row_f[HEAD_DIM > 0 ? HEAD_DIM : 512];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / tasks_per_seq, first_kv = (task % tasks_per_seq) * kv_heads;
      const int64_t len = seq_lens[seq];
      const int64_t* table = tables + seq * shape.max_blocks;
      const scalar_t* q_src = query + (seq * shape.num_heads + first_kv * group) * head_dim;
      for (int64_t i = 0; i < num_q * head_dim; ++i) q[i] = load(q_src, i) * scale;
      scores.resize(num_q * len);
      for (int64_t t = 0; t < len; ++t) {
        const scalar_t* row = cache + table[t / shape.block_size] * block_stride +
                              (t % shape.block_size) * token_stride + first_kv * head_dim;
        for (int64_t kv = 0; kv < kv_heads; ++kv) {
          // Convert the key once for the whole query-head group that shares it.
          for (int64_t d = 0; d < head_dim; ++d) row_f[d] = load(row + kv * head_dim, d);
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g;
            const float* __restrict__ qh = q.data() + h * head_dim;
            float dot = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * row_f[d];
            scores[h * len + t] = dot;
          }
        }
      }
      for (int64_t h = 0; h < num_q; ++h) {
        float* s = scores.data() + h * len;
        const float max_score = *std::max_element(s, s + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - max_score);
          sum += s[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) s[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const scalar_t* row = cache + table[t / shape.block_size] * block_stride + half_stride +
                              (t % shape.block_size) * token_stride + first_kv * head_dim;
        for (int64_t kv = 0; kv < kv_heads; ++kv) {
          for (int64_t d = 0; d < head_dim; ++d) row_f[d] = load(row + kv * head_dim, d);
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g;
            const float p = scores[h * len + t];
            float* __restrict__ a = acc.data() + h * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row_f[d];
          }
        }
      }
      scalar_t* dst = out + (seq * shape.num_heads + first_kv * group) * head_dim;
      for (int64_t i = 0; i < num_q * head_dim; ++i) dst[i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [seqs, heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be a contiguous 5-d tensor");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(), "query and kv_cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(query);
  Shape shape{query.size(0), query.size(1), kv_cache.size(3), query.size(2), kv_cache.size(2), tables.size(1), 0};
  TORCH_CHECK(shape.num_heads % shape.num_kv_heads == 0 && kv_cache.size(4) == shape.head_dim, "shape mismatch");
  // Few sequences: split each over its kv heads so that every thread has work.
  shape.heads_per_task = shape.num_seqs >= 4 * at::get_num_threads() ? shape.num_kv_heads : 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto impl) {
      impl(query.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
           lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), shape, static_cast<float>(scale));
    };
    switch (shape.head_dim) {
      case 64: run(decode_attention_impl<scalar_t, 64>); break;
      case 128: run(decode_attention_impl<scalar_t, 128>); break;
      case 32: run(decode_attention_impl<scalar_t, 32>); break;
      default: run(decode_attention_impl<scalar_t, 0>);
    }
  });
  return out;
}
