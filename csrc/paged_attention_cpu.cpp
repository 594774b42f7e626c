// Paged decode attention for the CPU: one query token per sequence, keys and values read straight
// from the paged KV cache (no gather). Reference: worker/attention/torch_ref.py (decode branch).
//
// query:        [num_seqs, num_heads, head_dim]                       (contiguous)
// kv_cache:     [num_blocks, 2, block_size, num_kv_heads, head_dim]   (contiguous; 0 = key, 1 = value)
// block_tables: [num_seqs, max_blocks] int64
// seq_lens:     [num_seqs] int64, tokens in the cache for each sequence (the new one included)
// returns       [num_seqs, num_heads, head_dim]
//
// Work is split over (sequence, kv head); each task scores its query-head group against every
// cached token in float32, takes the softmax, then accumulates values. Loops over head_dim are
// plain so the compiler vectorizes them (-O3 -march=native).
#include <torch/extension.h>
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

template <typename scalar_t>
static void decode_attention_impl(const scalar_t* query, const scalar_t* cache, const int64_t* tables,
                                  const int64_t* seq_lens, scalar_t* out, int64_t num_seqs, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                                  float scale) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;            // between tokens of a block
  const int64_t half_stride = block_size * token_stride;           // key half -> value half
  const int64_t block_stride = 2 * half_stride;                    // between blocks
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t len = seq_lens[seq];
      const int64_t* table = tables + seq * max_blocks;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = query + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = load(src, d) * scale;
      }
      scores.assign(group * len, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const scalar_t* key = cache + table[t / block_size] * block_stride + (t % block_size) * token_stride +
                              kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_dim;
          float dot = 0.f;
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * load(key, d);
          scores[g * len + t] = dot;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
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
        const scalar_t* value = cache + table[t / block_size] * block_stride + half_stride +
                                (t % block_size) * token_stride + kv_head * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* a = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] += p * load(value, d);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = out + (seq * num_heads + kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_dim + d]);
      }
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
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(num_heads % num_kv_heads == 0 && kv_cache.size(4) == head_dim, "shape mismatch");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(query.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(),
                                    tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(),
                                    num_seqs, num_heads, num_kv_heads, head_dim, block_size, tables.size(1),
                                    static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)");
}
