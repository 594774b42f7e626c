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
#include "cpu_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
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

// Exact softmax of one head's scores, in place (max first, so exp never overflows).
static inline void softmax_in_place(float* s, int64_t len) {
  const float max_score = *std::max_element(s, s + len);
  float sum = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    s[t] = exp_f32(s[t] - max_score);
    sum += s[t];
  }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
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
      for (int64_t h = 0; h < num_q; ++h) softmax_in_place(scores.data() + h * len, len);
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

#if defined(__AVX512F__)
#include <immintrin.h>

// The AVX-512 path: HEAD_DIM and the query-group size GROUP fixed at compile time, so the group's
// queries and output accumulators stay in registers. Scores are computed 16 tokens at a time: one
// vector of partial products per token, then 16 vectors reduced together (a transpose-and-add tree of
// about 3 instructions a token instead of a horizontal sum each). float32 and bf16 caches.
namespace avx512 {

template <typename scalar_t>
inline __m512 load16(const scalar_t* p);
template <>
inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// r[i] = sum of the 16 lanes of a[i], i < 16.
inline __m512 sum16(const __m512 (&a)[16]) {
  __m512 u[4];
  for (int j = 0; j < 4; ++j) {
    const __m512 *x = a + 4 * j;
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
    // Each 128-bit lane k: [x0, x1, x2, x3 summed over their lane k].
    u[j] = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Rows of one head are short (128 bytes in bf16) and strided: ask for the row 12 tokens ahead (4 was
// 30-40% slower for 64 sequences of 200 tokens once the row addresses were precomputed).
constexpr int64_t PREFETCH_AHEAD = 12;
template <typename scalar_t, int HEAD_DIM>
inline void prefetch_row(const scalar_t* row) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < static_cast<int64_t>(HEAD_DIM * sizeof(scalar_t)); b += 64)
    _mm_prefetch(bytes + b, _MM_HINT_T0);
}

template <typename scalar_t, int HEAD_DIM, int GROUP>
void decode(const scalar_t* query, const scalar_t* cache, const int64_t* tables, const int64_t* seq_lens,
            scalar_t* out, Shape shape, float scale) {
  constexpr int V = HEAD_DIM / 16;
  const int64_t block_size = shape.block_size;
  const int64_t token_stride = shape.num_kv_heads * HEAD_DIM;
  const int64_t half_stride = block_size * token_stride;
  const int64_t block_stride = 2 * half_stride;
  // One task: one (sequence, kv head); each kv head's group of query heads shares its keys and values.
  at::parallel_for(0, shape.num_seqs * shape.num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const scalar_t*> keys;  // each token's key row of this kv head (its value: + half_stride)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / shape.num_kv_heads, kv = task % shape.num_kv_heads;
      const int64_t len = seq_lens[seq];
      const int64_t* table = tables + seq * shape.max_blocks;
      // Row addresses once, block by block: a division per token and pass cost more than the row's math.
      keys.resize(len + PREFETCH_AHEAD);
      for (int64_t t0 = 0, blk = 0; t0 < len; t0 += block_size, ++blk) {
        const scalar_t* base = cache + table[blk] * block_stride + kv * HEAD_DIM;
        const int64_t n = std::min(block_size, len - t0);
        for (int64_t i = 0; i < n; ++i) keys[t0 + i] = base + i * token_stride;
      }
      for (int64_t t = len; t < len + PREFETCH_AHEAD; ++t) keys[t] = keys[len - 1];  // prefetch targets
      const scalar_t* q_src = query + (seq * shape.num_heads + kv * GROUP) * HEAD_DIM;
      __m512 q[GROUP][V];
      for (int g = 0; g < GROUP; ++g)
        for (int v = 0; v < V; ++v)
          q[g][v] = _mm512_mul_ps(load16(q_src + g * HEAD_DIM + v * 16), _mm512_set1_ps(scale));
      const int64_t padded = (len + 15) / 16 * 16;
      scores.resize(GROUP * padded);
      // Scores, 16 tokens at a time.
      for (int64_t t0 = 0; t0 < len; t0 += 16) {
        __m512 part[GROUP][16];
        const int64_t n = std::min<int64_t>(16, len - t0);
        for (int64_t i = 0; i < 16; ++i) {
          if (i >= n) {
            for (int g = 0; g < GROUP; ++g) part[g][i] = _mm512_setzero_ps();
            continue;
          }
          const int64_t t = t0 + i;
          const scalar_t* key = keys[t];
          prefetch_row<scalar_t, HEAD_DIM>(keys[t + PREFETCH_AHEAD]);
          __m512 k[V];
          for (int v = 0; v < V; ++v) k[v] = load16(key + v * 16);
          for (int g = 0; g < GROUP; ++g) {
            __m512 acc = _mm512_mul_ps(q[g][0], k[0]);
            for (int v = 1; v < V; ++v) acc = _mm512_fmadd_ps(q[g][v], k[v], acc);
            part[g][i] = acc;
          }
        }
        for (int g = 0; g < GROUP; ++g) _mm512_storeu_ps(scores.data() + g * padded + t0, sum16(part[g]));
      }
      for (int g = 0; g < GROUP; ++g) softmax_in_place(scores.data() + g * padded, len);
      // Values weighted by the probabilities, accumulated in registers.
      __m512 acc[GROUP][V];
      for (int g = 0; g < GROUP; ++g)
        for (int v = 0; v < V; ++v) acc[g][v] = _mm512_setzero_ps();
      for (int64_t t = 0; t < len; ++t) {
        const scalar_t* value = keys[t] + half_stride;
        prefetch_row<scalar_t, HEAD_DIM>(keys[t + PREFETCH_AHEAD] + half_stride);
        __m512 x[V];
        for (int v = 0; v < V; ++v) x[v] = load16(value + v * 16);
        for (int g = 0; g < GROUP; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * padded + t]);
          for (int v = 0; v < V; ++v) acc[g][v] = _mm512_fmadd_ps(p, x[v], acc[g][v]);
        }
      }
      scalar_t* dst = out + (seq * shape.num_heads + kv * GROUP) * HEAD_DIM;
      alignas(64) float row[HEAD_DIM];
      for (int g = 0; g < GROUP; ++g) {
        for (int v = 0; v < V; ++v) _mm512_store_ps(row + v * 16, acc[g][v]);
        for (int d = 0; d < HEAD_DIM; ++d) dst[g * HEAD_DIM + d] = static_cast<scalar_t>(row[d]);
      }
    }
  });
}

// The AVX-512 kernel for this shape, or nullptr (the portable kernel then serves).
template <typename scalar_t>
using Kernel = void (*)(const scalar_t*, const scalar_t*, const int64_t*, const int64_t*, scalar_t*, Shape, float);

template <typename scalar_t, int HEAD_DIM>
Kernel<scalar_t> pick_group(int64_t group) {
  switch (group) {
    case 1: return decode<scalar_t, HEAD_DIM, 1>;
    case 2: return decode<scalar_t, HEAD_DIM, 2>;
    case 3: return decode<scalar_t, HEAD_DIM, 3>;
    case 4: return decode<scalar_t, HEAD_DIM, 4>;
    case 5: return decode<scalar_t, HEAD_DIM, 5>;
    case 6: return decode<scalar_t, HEAD_DIM, 6>;
    case 7: return decode<scalar_t, HEAD_DIM, 7>;
    case 8: return decode<scalar_t, HEAD_DIM, 8>;
    default: return nullptr;
  }
}

template <typename scalar_t>
Kernel<scalar_t> pick(int64_t head_dim, int64_t group) {
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    switch (head_dim) {
      case 64: return pick_group<scalar_t, 64>(group);
      case 128: return pick_group<scalar_t, 128>(group);
      default: return nullptr;
    }
  }
  return nullptr;
}

}  // namespace avx512
#endif

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
#if defined(__AVX512F__)
    // Enough (sequence, kv head) tasks for every thread: the register-blocked kernel.
    const int64_t group = shape.num_heads / shape.num_kv_heads;
    if (shape.num_seqs * shape.num_kv_heads >= at::get_num_threads()) {
      if (auto kernel = avx512::pick<scalar_t>(shape.head_dim, group)) return run(kernel);
    }
#endif
    switch (shape.head_dim) {
      case 64: run(decode_attention_impl<scalar_t, 64>); break;
      case 128: run(decode_attention_impl<scalar_t, 128>); break;
      case 32: run(decode_attention_impl<scalar_t, 32>); break;
      default: run(decode_attention_impl<scalar_t, 0>);
    }
  });
  return out;
}
