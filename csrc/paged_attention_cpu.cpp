// Paged attention for the CPU: query rows against keys and values read from the paged KV cache.
// Reference: worker/attention/torch_ref.py (decode).
//
// query:        [num_rows, num_heads, head_dim]                       (contiguous)
// kv_cache:     [num_blocks, 2, block_size, num_kv_heads, head_dim]   (contiguous; 0 = key, 1 = value), or
//               [num_blocks, 1, block_size, 1, head_dim]: multi-head latent attention's cache, whose one
//               row a token is its key and its value both (the caller keeps the value dims it needs;
//               worker/models/mla.py). That one takes avx512::latent_decode where its width is a multiple
//               of 64, else the portable kernel.
// block_tables: [num_rows, max_blocks] int64
// seq_lens:     [num_rows] int64, the row's position + 1: keys 0..seq_lens - 1 are its own and earlier
// window:       > 0: a row sees only its last `window` keys (a sliding-window layer: keys p - window < k <= p,
//               as Hugging Face's sliding masks); 0: all of them
// softcap:      > 0: each scaled score s becomes softcap * tanh(s / softcap) before the softmax (Gemma 2)
// sinks:        [num_heads] float32, or empty: each head's attention sink, a logit in the softmax's sum with
//               no value (gpt-oss): p_t = exp(s_t - m) / (sum_u exp(s_u - m) + exp(sink - m)), m the max of
//               the scores and the sink
// returns       [num_rows, num_heads, head_dim]
//
// A row is a decode token or a token of a prefill chunk. Decode rows: a task is one row and a run of
// its kv heads (all of them when there are enough rows to keep every thread busy, so each cache line
// is read once and in order). Prefill chunks arrive as runs of rows with one block table and lengths
// growing by one; in bf16 on a CPU with AVX-512 BF16 they run as tiles of up to 64 such rows whose keys
// are read once for the tile, with the matrix products on AMX where the CPU has it, else as AVX-512 BF16
// dot products (`tiled` below). Scores are float32, the softmax is exact (two passes), values are
// accumulated in float32 (the tiles weigh them in bf16).
#include "ops.h"
#include "cpu_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define ENGINE_TILES 1  // prefill rows as tiles: AVX-512 BF16 products, or AMX's where the CPU has it
#endif
#include "amx.h"  // ENGINE_AMX: the AMX tiles as well

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

// Exact softmax of one head's scores, in place (max first, so exp never overflows); `sink` (a head's
// attention sink, or null) joins the max and the sum.
static inline void softmax_in_place(float* s, int64_t len, const float* sink = nullptr) {
  float max_score = *std::max_element(s, s + len);
  if (sink != nullptr) max_score = std::max(max_score, *sink);
  float sum = 0.f;
  for (int64_t t = 0; t < len; ++t) {
    s[t] = exp_f32(s[t] - max_score);
    sum += s[t];
  }
  if (sink != nullptr) sum += exp_f32(*sink - max_score);
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < len; ++t) s[t] *= inv;
}

struct Shape {
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, heads_per_task;
  int64_t window = 0;   // keys a row sees at most (0: all)
  float softcap = 0.f;  // score soft-capping (0: none)
  const float* sinks = nullptr;  // [num_heads] attention sinks (null: none)
  int64_t halves = 2;  // 2: key and value halves; 1: the key row is the value row (latent attention)
  const float* sink(int64_t head) const { return sinks != nullptr ? sinks + head : nullptr; }
  int64_t first_key(int64_t len) const { return window > 0 && len > window ? len - window : 0; }
};

// Soft-capping of n scaled scores, in place: s -> cap * tanh(s / cap) (Gemma 2's attention logits).
static inline void soft_cap(float* s, int64_t n, float cap) {
  if (cap <= 0.f) return;
  const float inv = 1.f / cap;
  for (int64_t t = 0; t < n; ++t) s[t] = cap * std::tanh(s[t] * inv);
}

// How bf16 prefill rows run: one by one (the decode kernel's row), or as tiles whose products are
// AVX-512 BF16 instructions or AMX tile products. The best the build and the CPU allow unless
// use_prefill_tiles says otherwise (benchmarks and tests compare them on one machine).
enum class Tiles : int { none = 0, avx512_bf16 = 1, amx = 2 };
const char* const TILES_NAMES[] = {"", "avx512_bf16", "amx"};
std::atomic<int> chosen_tiles{-1};  // a Tiles, or -1: the best available

// HEAD_DIM > 0 fixes head_dim at compile time (unrolled, vectorized loops); 0 reads it at run time.
template <typename scalar_t, int HEAD_DIM>
static void decode_attention_impl(const scalar_t* query, const scalar_t* cache, const int64_t* tables,
                                  const int64_t* seq_lens, scalar_t* out, Shape shape, float scale) {
  const int64_t head_dim = HEAD_DIM > 0 ? HEAD_DIM : shape.head_dim;
  TORCH_CHECK(head_dim <= 1024, "head_dim above 1024 is not supported");
  const int64_t group = shape.num_heads / shape.num_kv_heads;
  const int64_t kv_heads = shape.heads_per_task;           // kv heads handled by one task
  const int64_t num_q = kv_heads * group;                   // query heads handled by one task
  const int64_t tasks_per_seq = shape.num_kv_heads / kv_heads;
  const int64_t token_stride = shape.num_kv_heads * head_dim;
  const int64_t half_stride = shape.halves == 2 ? shape.block_size * token_stride : 0;  // key -> value
  const int64_t block_stride = shape.halves * shape.block_size * token_stride;
  at::parallel_for(0, shape.num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(num_q * head_dim), acc(num_q * head_dim), scores;
    std::vector<float> rows4(shape.halves == 1 ? 4 * head_dim : 0);  // latent rows: four keys in float32
    alignas(64) float row_f[HEAD_DIM > 0 ? HEAD_DIM : 1024];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / tasks_per_seq, first_kv = (task % tasks_per_seq) * kv_heads;
      const int64_t first = shape.first_key(seq_lens[seq]);  // the window's first key
      const int64_t len = seq_lens[seq] - first;
      const int64_t* table = tables + seq * shape.max_blocks;
      const scalar_t* q_src = query + (seq * shape.num_heads + first_kv * group) * head_dim;
      for (int64_t i = 0; i < num_q * head_dim; ++i) q[i] = load(q_src, i) * scale;
      scores.resize(num_q * len);
      const auto key_row = [&](int64_t t) {
        return cache + table[t / shape.block_size] * block_stride + (t % shape.block_size) * token_stride +
               first_kv * head_dim;
      };
      int64_t done = 0;
      if (shape.halves == 1) {  // latent rows: 4 keys at a time, each query dim read once for the four
        for (; done + 4 <= len; done += 4) {
          for (int64_t k = 0; k < 4; ++k)
            for (int64_t d = 0; d < head_dim; ++d) rows4[k * head_dim + d] = load(key_row(first + done + k), d);
          for (int64_t h = 0; h < num_q; ++h) {
            const float* __restrict__ qh = q.data() + h * head_dim;
            const float* __restrict__ r = rows4.data();
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) {
              s0 += qh[d] * r[d];
              s1 += qh[d] * r[head_dim + d];
              s2 += qh[d] * r[2 * head_dim + d];
              s3 += qh[d] * r[3 * head_dim + d];
            }
            scores[h * len + done] = s0, scores[h * len + done + 1] = s1;
            scores[h * len + done + 2] = s2, scores[h * len + done + 3] = s3;
          }
        }
      }
      for (int64_t i = done; i < len; ++i) {
        const int64_t t = first + i;
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
            scores[h * len + i] = dot;
          }
        }
      }
      for (int64_t h = 0; h < num_q; ++h) {
        soft_cap(scores.data() + h * len, len, shape.softcap);
        softmax_in_place(scores.data() + h * len, len, shape.sink(first_kv * group + h));
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      done = 0;
      if (shape.halves == 1) {  // latent rows (their values are the keys): 4 at a time into each sum
        for (; done + 4 <= len; done += 4) {
          for (int64_t k = 0; k < 4; ++k)
            for (int64_t d = 0; d < head_dim; ++d) rows4[k * head_dim + d] = load(key_row(first + done + k), d);
          for (int64_t h = 0; h < num_q; ++h) {
            const float* p = scores.data() + h * len + done;
            const float* __restrict__ r = rows4.data();
            float* __restrict__ a = acc.data() + h * head_dim;
            for (int64_t d = 0; d < head_dim; ++d)
              a[d] += p[0] * r[d] + p[1] * r[head_dim + d] + p[2] * r[2 * head_dim + d] + p[3] * r[3 * head_dim + d];
          }
        }
      }
      for (int64_t i = done; i < len; ++i) {
        const int64_t t = first + i;
        const scalar_t* row = cache + table[t / shape.block_size] * block_stride + half_stride +
                              (t % shape.block_size) * token_stride + first_kv * head_dim;
        for (int64_t kv = 0; kv < kv_heads; ++kv) {
          for (int64_t d = 0; d < head_dim; ++d) row_f[d] = load(row + kv * head_dim, d);
          for (int64_t g = 0; g < group; ++g) {
            const int64_t h = kv * group + g;
            const float p = scores[h * len + i];
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
template <typename scalar_t, int HEAD_DIM, int HINT = _MM_HINT_T0>
inline void prefetch_row(const scalar_t* row) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < static_cast<int64_t>(HEAD_DIM * sizeof(scalar_t)); b += 64)
    _mm_prefetch(bytes + b, static_cast<_mm_hint>(HINT));
}

// Scratch of one thread's decode rows, reused across its tasks.
template <typename scalar_t>
struct RowScratch {
  std::vector<float> scores;
  std::vector<const scalar_t*> keys;  // each token's key row of this kv head (its value: + half_stride)
  std::vector<const scalar_t*> next;  // the same for the thread's next task (decode)
};

// The key rows of kv head `kv` for the keys a row of length `len` sees (its window's, or all), then
// PREFETCH_AHEAD more copies of the last (prefetch targets); returns how many it sees. Once per row: a
// division per token and pass cost more than the row's math.
template <typename scalar_t, int HEAD_DIM>
int64_t key_rows(const scalar_t* cache, const int64_t* table, int64_t len, int64_t kv, const Shape& shape,
                 std::vector<const scalar_t*>& keys) {
  const int64_t block_size = shape.block_size;
  const int64_t token_stride = shape.num_kv_heads * HEAD_DIM;
  const int64_t block_stride = 2 * block_size * token_stride;
  const int64_t first = shape.first_key(len), seen = len - first;
  keys.resize(seen + PREFETCH_AHEAD);
  int64_t i = 0;
  for (int64_t blk = first / block_size, t0 = blk * block_size; t0 < len; t0 += block_size, ++blk) {
    const scalar_t* base = cache + table[blk] * block_stride + kv * HEAD_DIM;
    for (int64_t t = std::max(t0, first), end = std::min(t0 + block_size, len); t < end; ++t)
      keys[i++] = base + (t - t0) * token_stride;
  }
  for (int64_t t = seen; t < seen + PREFETCH_AHEAD; ++t) keys[t] = keys[seen - 1];
  return seen;
}

// One query row (one token) of one kv head's query-head group against the `len` keys at `keys`.
// q_src: the row's GROUP query heads of this kv head; dst: where their outputs go. Meanwhile the
// `next_len` rows at `next` (the thread's next task) are asked for into L2, its keys during the scores
// and its values during the weighted sum: read from memory one task ahead, a decode step's keys and
// values come in while the arithmetic runs (64 sequences x 164 tokens, from memory: 0.58 -> 0.38-0.41
// ms a layer; the rows' own 12-token lead alone leaves most of the read exposed). The scores also ask for
// each token's value into L2, for a thread's first task (nothing asked for it before it) and alone (one
// sequence, 3 kv heads of 64, 1,000 tokens from memory, Zen 4: 47-54 -> 43-48 us a layer; 16 sequences of
// 300 tokens the same).
template <typename scalar_t, int HEAD_DIM, int GROUP>
void attend_row(const scalar_t* q_src, const scalar_t* const* keys, int64_t len, const scalar_t* const* next,
                int64_t next_len, scalar_t* dst, const Shape& shape, float scale, std::vector<float>& scores,
                int64_t first_head) {
  constexpr int V = HEAD_DIM / 16;
  const int64_t half_stride = shape.block_size * shape.num_kv_heads * HEAD_DIM;
  const int64_t next_per_token = (next_len + len - 1) / len;  // the next task's rows asked for a token
  __m512 q[GROUP][V];
  for (int g = 0; g < GROUP; ++g)
    for (int v = 0; v < V; ++v) q[g][v] = _mm512_mul_ps(load16(q_src + g * HEAD_DIM + v * 16), _mm512_set1_ps(scale));
  const int64_t padded = (len + 15) / 16 * 16;
  scores.resize(GROUP * padded);
  // Scores, 16 tokens at a time.
  int64_t asked = 0;
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
      prefetch_row<scalar_t, HEAD_DIM, _MM_HINT_T1>(keys[t + PREFETCH_AHEAD] + half_stride);  // its value, into L2
      for (int64_t j = 0; j < next_per_token && asked < next_len; ++j)
        prefetch_row<scalar_t, HEAD_DIM, _MM_HINT_T1>(next[asked++]);
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
  for (int g = 0; g < GROUP; ++g) {
    soft_cap(scores.data() + g * padded, len, shape.softcap);
    softmax_in_place(scores.data() + g * padded, len, shape.sink(first_head + g));
  }
  // Values weighted by the probabilities, accumulated in registers.
  __m512 acc[GROUP][V];
  for (int g = 0; g < GROUP; ++g)
    for (int v = 0; v < V; ++v) acc[g][v] = _mm512_setzero_ps();
  asked = 0;
  for (int64_t t = 0; t < len; ++t) {
    const scalar_t* value = keys[t] + half_stride;
    prefetch_row<scalar_t, HEAD_DIM>(keys[t + PREFETCH_AHEAD] + half_stride);
    for (int64_t j = 0; j < next_per_token && asked < next_len; ++j)
      prefetch_row<scalar_t, HEAD_DIM, _MM_HINT_T1>(next[asked++] + half_stride);
    __m512 x[V];
    for (int v = 0; v < V; ++v) x[v] = load16(value + v * 16);
    for (int g = 0; g < GROUP; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * padded + t]);
      for (int v = 0; v < V; ++v) acc[g][v] = _mm512_fmadd_ps(p, x[v], acc[g][v]);
    }
  }
  alignas(64) float row[HEAD_DIM];
  for (int g = 0; g < GROUP; ++g) {
    for (int v = 0; v < V; ++v) _mm512_store_ps(row + v * 16, acc[g][v]);
    for (int d = 0; d < HEAD_DIM; ++d) dst[g * HEAD_DIM + d] = static_cast<scalar_t>(row[d]);
  }
}

// One query row of kv head `kv`, of length `len`, against the keys of its block table it sees (a RowKernel).
template <typename scalar_t, int HEAD_DIM, int GROUP>
void decode_row(const scalar_t* q_src, const scalar_t* cache, const int64_t* table, int64_t len, int64_t kv,
                scalar_t* dst, const Shape& shape, float scale, RowScratch<scalar_t>& scratch) {
  const int64_t seen = key_rows<scalar_t, HEAD_DIM>(cache, table, len, kv, shape, scratch.keys);
  attend_row<scalar_t, HEAD_DIM, GROUP>(q_src, scratch.keys.data(), seen, nullptr, 0, dst, shape, scale,
                                        scratch.scores, kv * GROUP);
}

template <typename scalar_t, int HEAD_DIM, int GROUP>
void decode(const scalar_t* query, const scalar_t* cache, const int64_t* tables, const int64_t* seq_lens,
            scalar_t* out, Shape shape, float scale) {
  // One task: one (sequence, kv head); each kv head's group of query heads shares its keys and values.
  // A thread's tasks run in order, each asking for the next one's rows while it runs. With fewer of them
  // than threads (one sequence of a model with one kv head: Gemma 3 270M), a task is one of the two halves
  // of a group: each reads the keys and values, and a head's arithmetic does not depend on the heads beside
  // it in its task (the same bits either way). Halves at 2 to 3 tasks a thread were slower (Zen 4).
  constexpr int FIRST = GROUP > 1 ? GROUP / 2 : 1;  // heads of a group's first half
  const int64_t units = shape.num_seqs * shape.num_kv_heads;
  const int64_t parts = GROUP > 1 && units < at::get_num_threads() ? 2 : 1;
  at::parallel_for(0, units * parts, 1, [&](int64_t begin, int64_t end) {
    RowScratch<scalar_t> scratch;
    auto rows_of = [&](int64_t task, std::vector<const scalar_t*>& keys) {  // how many keys it sees
      const int64_t seq = task / parts / shape.num_kv_heads, kv = task / parts % shape.num_kv_heads;
      return key_rows<scalar_t, HEAD_DIM>(cache, tables + seq * shape.max_blocks, seq_lens[seq], kv, shape, keys);
    };
    int64_t len = begin < end ? rows_of(begin, scratch.keys) : 0;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / parts / shape.num_kv_heads, kv = task / parts % shape.num_kv_heads;
      const int64_t offset = (seq * shape.num_heads + kv * GROUP) * HEAD_DIM;
      const int64_t next_len = task + 1 < end ? rows_of(task + 1, scratch.next) : 0;
      if (parts == 1) {
        attend_row<scalar_t, HEAD_DIM, GROUP>(query + offset, scratch.keys.data(), len, scratch.next.data(),
                                              next_len, out + offset, shape, scale, scratch.scores, kv * GROUP);
      } else if constexpr (GROUP > 1) {
        if (task % 2 == 0) {
          attend_row<scalar_t, HEAD_DIM, FIRST>(query + offset, scratch.keys.data(), len, scratch.next.data(),
                                                next_len, out + offset, shape, scale, scratch.scores, kv * GROUP);
        } else {
          const int64_t half = offset + FIRST * HEAD_DIM;
          attend_row<scalar_t, HEAD_DIM, GROUP - FIRST>(query + half, scratch.keys.data(), len, scratch.next.data(),
                                                        next_len, out + half, shape, scale, scratch.scores,
                                                        kv * GROUP + FIRST);
        }
      }
      std::swap(scratch.keys, scratch.next);
      len = next_len;
    }
  });
}

// Consecutive query rows that share a block table and whose lengths grow by one: tokens of one prefill
// chunk, each seeing the keys up to itself.
struct Tile {
  int64_t first, rows;
};
// Rows a tile at most: more rows share one copy of the keys; 16, 32 and 64 measured (64 best by 3-25%).
constexpr int64_t TILE_ROWS = 64;

template <typename scalar_t>
using RowKernel = void (*)(const scalar_t*, const scalar_t*, const int64_t*, int64_t, int64_t, scalar_t*,
                           const Shape&, float, RowScratch<scalar_t>&);

#if defined(ENGINE_TILES)


// 2^x of 16 floats to ~4e-5 relative (degree-4 polynomial of the fraction, scalef for the integer
// part): enough for probabilities that are then rounded to bf16 (2^-9).
inline __m512 exp2_16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);  // [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(9.6181291e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 16 x 16 32-bit elements transposed in registers.
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // r[4i + j] now holds, in each 128-bit lane L, column j of rows 4i..4i+3 restricted to lane L.
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_i32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(t[j], t[8 + j], 0xdd);
  }
}

// The two products of a tile task, for 16 query vectors at a time, in the layouts `tiled` prepares:
//   q:      [16 vectors][HEAD_DIM] bf16
//   keys:   [key block of 16][HEAD_DIM / 2 dim pairs][16 keys] bf16 pairs
//   values: [key block of 32][HEAD_DIM / 16 dim groups][16 key pairs][16 dims][2] bf16
//   probs:  [16 vectors][padded] bf16, scores: [16 vectors][padded] float32
// scores() fills keys [0, span) rounded up to 32 (the buffers hold `padded` >= that, zero past the
// keys); outputs() gives dim groups n0..n0 + 3 of the 16 vectors' P V as result[n - n0][vector][16 dims].

#if defined(ENGINE_AMX)
// On AMX tiles: the vectors in tmm1..tmm4 (32 dims each), two key blocks in flight (tmm0 with tmm5, tmm6
// with tmm7); P V into four output tiles (tmm4..7), 32 keys at a time.
template <int HEAD_DIM>
struct AmxProducts {
  static constexpr int KD = HEAD_DIM / 32;  // query / key tiles along head_dim
  bool configured = false;
  void begin() {
    if (configured) return;
    static const TileConfig config;
    _tile_loadconfig(&config);
    configured = true;
  }
  ~AmxProducts() {
    if (configured) _tile_release();
  }
  void scores(const uint16_t* qv, const uint32_t* keys, float* scores, int64_t padded, int64_t span) {
    const int64_t span16 = (span + 15) / 16 * 16;
    _tile_loadd(1, qv, HEAD_DIM * 2);
    if constexpr (KD > 1) _tile_loadd(2, qv + 32, HEAD_DIM * 2);
    if constexpr (KD > 2) _tile_loadd(3, qv + 64, HEAD_DIM * 2);
    if constexpr (KD > 3) _tile_loadd(4, qv + 96, HEAD_DIM * 2);
    for (int64_t t0 = 0; t0 < span16; t0 += 32) {
      const bool two = t0 + 16 < span16;
      const uint32_t* ka = keys + (t0 / 16) * (HEAD_DIM / 2) * 16;
      const uint32_t* kb = ka + (HEAD_DIM / 2) * 16;
      _tile_zero(0);
      _tile_zero(6);
      // Spelled out per 32-dim slice: the tile intrinsics take their register numbers as literals.
      _tile_loadd(5, ka, 64);
      _tile_dpbf16ps(0, 1, 5);
      if (two) {
        _tile_loadd(7, kb, 64);
        _tile_dpbf16ps(6, 1, 7);
      }
      if constexpr (KD > 1) {
        _tile_loadd(5, ka + 256, 64);
        _tile_dpbf16ps(0, 2, 5);
        if (two) {
          _tile_loadd(7, kb + 256, 64);
          _tile_dpbf16ps(6, 2, 7);
        }
      }
      if constexpr (KD > 2) {
        _tile_loadd(5, ka + 512, 64);
        _tile_dpbf16ps(0, 3, 5);
        if (two) {
          _tile_loadd(7, kb + 512, 64);
          _tile_dpbf16ps(6, 3, 7);
        }
      }
      if constexpr (KD > 3) {
        _tile_loadd(5, ka + 768, 64);
        _tile_dpbf16ps(0, 4, 5);
        if (two) {
          _tile_loadd(7, kb + 768, 64);
          _tile_dpbf16ps(6, 4, 7);
        }
      }
      _tile_stored(0, scores + t0, padded * 4);
      if (two) _tile_stored(6, scores + t0 + 16, padded * 4);
    }
  }
  void outputs(const uint16_t* probs, const uint16_t* values, int64_t padded, int64_t span32, int n0,
               float (*result)[256]) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t t0 = 0; t0 < span32; t0 += 32) {
      _tile_loadd(0, probs + t0, padded * 2);
      const uint16_t* vb = values + t0 * HEAD_DIM + n0 * 16 * 32;
      _tile_loadd(1, vb, 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(1, vb + 512, 64);
      _tile_dpbf16ps(5, 0, 1);
      _tile_loadd(1, vb + 1024, 64);
      _tile_dpbf16ps(6, 0, 1);
      _tile_loadd(1, vb + 1536, 64);
      _tile_dpbf16ps(7, 0, 1);
    }
    _tile_stored(4, result[0], 64);
    _tile_stored(5, result[1], 64);
    _tile_stored(6, result[2], 64);
    _tile_stored(7, result[3], 64);
  }
};
#endif

// With AVX-512 BF16 (vdpbf16ps: 16 lanes, each the sum of two bf16 products into float32), for CPUs
// without AMX. Scores: a lane is a key; each dim pair of a vector is broadcast against the 16 keys' pair
// at that dim pair; 8 vectors x 32 keys of accumulators. P V: a lane is a dim; each key pair of a
// vector's probabilities is broadcast against the 16 dims' values at that key pair; 4 vectors x 4 dim
// groups of accumulators.
template <int HEAD_DIM>
struct Avx512Bf16Products {
  static constexpr int ND = HEAD_DIM / 16;
  void begin() {}
  void scores(const uint16_t* qv, const uint32_t* keys, float* scores, int64_t padded, int64_t span) {
    const int64_t span32 = (span + 31) / 32 * 32;
    for (int c0 = 0; c0 < 16; c0 += 8)
      for (int64_t t0 = 0; t0 < span32; t0 += 32) {
        const uint32_t* ka = keys + (t0 / 16) * (HEAD_DIM / 2) * 16;
        const uint32_t* kb = ka + (HEAD_DIM / 2) * 16;
        __m512 acc[8][2];
        for (int c = 0; c < 8; ++c) acc[c][0] = acc[c][1] = _mm512_setzero_ps();
        for (int p = 0; p < HEAD_DIM / 2; ++p) {
          const __m512bh k0 = as_bf16_pairs(_mm512_loadu_si512(ka + p * 16));
          const __m512bh k1 = as_bf16_pairs(_mm512_loadu_si512(kb + p * 16));
          for (int c = 0; c < 8; ++c) {
            int32_t pair;
            std::memcpy(&pair, qv + (c0 + c) * HEAD_DIM + 2 * p, sizeof pair);
            const __m512bh q = as_bf16_pairs(_mm512_set1_epi32(pair));
            acc[c][0] = _mm512_dpbf16_ps(acc[c][0], k0, q);
            acc[c][1] = _mm512_dpbf16_ps(acc[c][1], k1, q);
          }
        }
        for (int c = 0; c < 8; ++c) {
          _mm512_storeu_ps(scores + (c0 + c) * padded + t0, acc[c][0]);
          _mm512_storeu_ps(scores + (c0 + c) * padded + t0 + 16, acc[c][1]);
        }
      }
  }
  void outputs(const uint16_t* probs, const uint16_t* values, int64_t padded, int64_t span32, int n0,
               float (*result)[256]) {
    const int groups = std::min(4, ND - n0);
    for (int c0 = 0; c0 < 16; c0 += 4) {
      __m512 acc[4][4];
      for (int c = 0; c < 4; ++c)
        for (int n = 0; n < 4; ++n) acc[c][n] = _mm512_setzero_ps();
      for (int64_t t0 = 0; t0 < span32; t0 += 32)
        for (int kp = 0; kp < 16; ++kp) {
          const uint16_t* vb = values + t0 * HEAD_DIM + n0 * 512 + kp * 32;
          __m512bh v[4];
          for (int n = 0; n < 4; ++n) v[n] = as_bf16_pairs(n < groups ? _mm512_loadu_si512(vb + n * 512) : _mm512_setzero_si512());
          for (int c = 0; c < 4; ++c) {
            int32_t pair;
            std::memcpy(&pair, probs + (c0 + c) * padded + t0 + 2 * kp, sizeof pair);
            const __m512bh p = as_bf16_pairs(_mm512_set1_epi32(pair));
            for (int n = 0; n < 4; ++n) acc[c][n] = _mm512_dpbf16_ps(acc[c][n], v[n], p);
          }
        }
      for (int c = 0; c < 4; ++c)
        for (int n = 0; n < groups; ++n) _mm512_store_ps(result[n] + (c0 + c) * 16, acc[c][n]);
    }
  }
};

// Prefill rows a tile at a time (bf16 in, float32 products): a task is one (tile of a chunk's rows, kv
// head), whose query vectors (rows x the kv head's query-head group) go 16 at a time through
// scores = Q K^T, an exact softmax per vector over its own causal length (AVX-512), then P V, the two
// products by `Products` (AMX tiles, or AVX-512 BF16). The task's keys and values are copied once into
// the pair-interleaved layout both read (keys: [dim pair][key][2]; values: [key pair][dim][2]), zero
// beyond the tile's longest row. Single-row tiles (decode rows of a mixed step) take the decode kernel's
// row. The probabilities are rounded to bf16 for the P V product (as GPU flash kernels do), their sums
// are kept in float32.
template <int HEAD_DIM, typename Products>
void tiled(const c10::BFloat16* query, const c10::BFloat16* cache, const int64_t* tables, const int64_t* seq_lens,
           c10::BFloat16* out, Shape shape, float scale, const std::vector<Tile>& tiles,
           RowKernel<c10::BFloat16> row) {
  static_assert(HEAD_DIM % 32 == 0 && HEAD_DIM <= 128, "4 query tiles at most");
  constexpr int KD = HEAD_DIM / 32;  // 32-dim slices of a key row
  constexpr int ND = HEAD_DIM / 16;  // 16-dim groups of an output row
  using bf16 = c10::BFloat16;
  const int64_t group = shape.num_heads / shape.num_kv_heads;
  const int64_t block_size = shape.block_size;
  const int64_t token_stride = shape.num_kv_heads * HEAD_DIM;
  const int64_t half_stride = block_size * token_stride;
  const int64_t block_stride = 2 * half_stride;
  const int64_t num_tasks = static_cast<int64_t>(tiles.size()) * shape.num_kv_heads;
  // Tasks handed out one at a time, the costliest first: a chunk's later tiles see more keys (a fresh
  // 2,000-token prompt's last tile has 125 times the work of its first), so fixed halves of the range
  // would leave one thread with most of the work.
  std::vector<int64_t> order(tiles.size());
  std::iota(order.begin(), order.end(), 0);
  const auto cost = [&](int64_t i) { return tiles[i].rows * seq_lens[tiles[i].first + tiles[i].rows - 1]; };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    RowScratch<bf16> scratch;
    Products products;
    std::vector<uint32_t> keys;      // [key block of 16][KD][16 dim pairs][16 keys]: bf16 pairs
    std::vector<uint16_t> values;    // [key block of 32][ND][16 key pairs][16 dims][2]
    std::vector<uint16_t> q;         // [vectors][HEAD_DIM]
    std::vector<float> scores;       // [16][padded]
    std::vector<uint16_t> probs;     // [16][padded32]
    alignas(64) float result[4][256];
    for (int64_t i = next++; i < num_tasks; i = next++) {
      const Tile tile = tiles[order[i / shape.num_kv_heads]];
      const int64_t kv = i % shape.num_kv_heads;
      const int64_t* table = tables + tile.first * shape.max_blocks;
      if (tile.rows == 1) {
        const int64_t offset = (tile.first * shape.num_heads + kv * group) * HEAD_DIM;
        row(query + offset, cache, table, seq_lens[tile.first], kv, out + offset, shape, scale, scratch);
        continue;
      }
      products.begin();
      const int64_t len = seq_lens[tile.first + tile.rows - 1];  // the longest row: the tile's last
      const int64_t padded = (len + 31) / 32 * 32;
      keys.resize(padded * HEAD_DIM / 2);
      values.resize(padded * HEAD_DIM);
      const auto row_of = [&](int64_t t) {  // key row of token t, or nullptr past the tile's keys
        return t < len ? cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + kv * HEAD_DIM
                       : nullptr;
      };
      // Keys, 16 tokens at a time: [16 tokens][dim pairs] -> [dim pairs][16 tokens], 16 x 16 at a time.
      for (int64_t t0 = 0; t0 < padded; t0 += 16) {
        for (int kd = 0; kd < KD; ++kd) {
          __m512i r[16];
          for (int j = 0; j < 16; ++j) {
            const bf16* key = row_of(t0 + j);
            r[j] = key ? _mm512_loadu_si512(key + kd * 32) : _mm512_setzero_si512();
          }
          transpose16(r);
          uint32_t* dst = keys.data() + (t0 / 16) * (HEAD_DIM / 2) * 16 + kd * 256;
          for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p * 16, r[p]);
        }
      }
      // Values, two tokens at a time: their rows interleaved dim by dim, 16 dims a 64-byte row.
      const __m512i lo_dims = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                               38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i hi_dims = _mm512_add_epi16(lo_dims, _mm512_set1_epi16(16));
      for (int64_t t = 0; t < padded; t += 2) {
        const bf16 *a = row_of(t), *b = row_of(t + 1);
        uint16_t* dst = values.data() + (t / 32) * 32 * HEAD_DIM + ((t % 32) / 2) * 32;
        for (int kd = 0; kd < KD; ++kd) {
          const __m512i x = a ? _mm512_loadu_si512(a + half_stride + kd * 32) : _mm512_setzero_si512();
          const __m512i y = b ? _mm512_loadu_si512(b + half_stride + kd * 32) : _mm512_setzero_si512();
          _mm512_storeu_si512(dst + (2 * kd) * 512, _mm512_permutex2var_epi16(x, lo_dims, y));
          _mm512_storeu_si512(dst + (2 * kd + 1) * 512, _mm512_permutex2var_epi16(x, hi_dims, y));
        }
      }
      const int64_t num_vectors = tile.rows * group;
      const int64_t num_padded = (num_vectors + 15) / 16 * 16;
      q.assign(num_padded * HEAD_DIM, 0);
      for (int64_t j = 0; j < num_vectors; ++j) {
        const bf16* src = query + ((tile.first + j / group) * shape.num_heads + kv * group + j % group) * HEAD_DIM;
        std::memcpy(q.data() + j * HEAD_DIM, src, HEAD_DIM * sizeof(bf16));
      }
      scores.resize(16 * padded);
      probs.resize(16 * padded);
      for (int64_t j0 = 0; j0 < num_padded; j0 += 16) {
        int64_t lens[16];
        for (int c = 0; c < 16; ++c)
          lens[c] = j0 + c < num_vectors ? seq_lens[tile.first + (j0 + c) / group] : 0;
        const int64_t span = *std::max_element(lens, lens + 16);
        const int64_t span32 = (span + 31) / 32 * 32;
        products.scores(q.data() + j0 * HEAD_DIM, keys.data(), scores.data(), padded, span);
        // Softmax per vector over its own keys; probabilities in bf16, zero past them. Sums kept apart.
        float inv_sum[16];
        const float log2_scale = scale * 1.44269504088896341f;  // exp(scale * s) = 2^(log2_scale * s)
        for (int c = 0; c < 16; ++c) {
          const float* sc = scores.data() + c * padded;
          uint16_t* p = probs.data() + c * padded;
          const int64_t n = lens[c];
          const auto valid = [n](int64_t t) -> __mmask16 {
            return t + 16 <= n ? 0xffff : t >= n ? 0 : static_cast<__mmask16>((1u << (n - t)) - 1);
          };
          __m512 top = _mm512_set1_ps(-INFINITY);
          for (int64_t t = 0; t < n; t += 16) top = _mm512_max_ps(top, _mm512_mask_loadu_ps(top, valid(t), sc + t));
          const __m512 vscale = _mm512_set1_ps(log2_scale);
          const __m512 offset = _mm512_set1_ps(n > 0 ? _mm512_reduce_max_ps(top) * log2_scale : 0.f);
          __m512 sum = _mm512_setzero_ps();
          for (int64_t t = 0; t < span32; t += 16) {
            const __m512 e = _mm512_maskz_mov_ps(valid(t), exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(sc + t), vscale, offset)));
            sum = _mm512_add_ps(sum, e);
            const __m256bh half = _mm512_cvtneps_pbh(e);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), reinterpret_cast<const __m256i&>(half));
          }
          inv_sum[c] = n > 0 ? 1.f / _mm512_reduce_add_ps(sum) : 0.f;
        }
        // Outputs, four 16-dim groups at a time.
        for (int n0 = 0; n0 < ND; n0 += 4) {
          products.outputs(probs.data(), values.data(), padded, span32, n0, result);
          for (int n = n0; n < std::min(n0 + 4, ND); ++n)
            for (int c = 0; c < 16 && j0 + c < num_vectors; ++c) {
              const int64_t j = j0 + c;
              bf16* dst = out + ((tile.first + j / group) * shape.num_heads + kv * group + j % group) * HEAD_DIM + n * 16;
              const __m256bh half = _mm512_cvtneps_pbh(
                  _mm512_mul_ps(_mm512_load_ps(result[n - n0] + c * 16), _mm512_set1_ps(inv_sum[c])));
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<const __m256i&>(half));
            }
        }
      }
    }
  });
}
#endif

// Multi-head latent attention's rows (halves 1: a token's one latent row is its key and its value), with
// the latent width a multiple of 64 (DeepSeek's 512 + 64). A task is one row and a run of its heads (all of
// them when the rows keep every thread busy; else the heads split so that they do, a decode step of one
// row too). Scores come 4 keys x 4 heads at a time (16 sums in registers; the 4 keys in float32 in a
// small buffer, each key and query vector loaded once for the four it meets), each sum reduced across its
// lanes once; the softmax is the portable kernel's; the weighted sum runs 4 heads x 64 dims at a time over
// the keys in order, read from the cache. float32 throughout, one order per row whatever the batch.
template <typename scalar_t>
void latent_decode(const scalar_t* query, const scalar_t* cache, const int64_t* tables, const int64_t* seq_lens,
                   scalar_t* out, Shape shape, float scale) {
  const int64_t dim = shape.head_dim, vectors = dim / 16, heads = shape.num_heads;
  const int64_t threads = at::get_num_threads();
  const int64_t splits =
      std::min<int64_t>(heads, std::max<int64_t>(1, (2 * threads + shape.num_seqs - 1) / shape.num_seqs));
  const int64_t per_task = (heads + splits - 1) / splits, tasks_per_seq = (heads + per_task - 1) / per_task;
  const int64_t block_stride = shape.block_size * dim;  // [blocks, 1, block_size, 1, dim]
  at::parallel_for(0, shape.num_seqs * tasks_per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q, scores, acc;
    std::vector<const scalar_t*> rows;
    alignas(64) float four[4 * 1024];  // 4 keys in float32
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / tasks_per_seq, first_head = (task % tasks_per_seq) * per_task;
      const int64_t count = std::min(per_task, heads - first_head), padded_heads = (count + 3) / 4 * 4;
      const int64_t first = shape.first_key(seq_lens[seq]), len = seq_lens[seq] - first;
      const int64_t padded = (len + 3) / 4 * 4;
      const int64_t* table = tables + seq * shape.max_blocks;
      rows.resize(len);
      for (int64_t i = 0; i < len; ++i) {
        const int64_t t = first + i;
        rows[i] = cache + table[t / shape.block_size] * block_stride + (t % shape.block_size) * dim;
      }
      q.assign(padded_heads * dim, 0.f);
      const scalar_t* q_src = query + (seq * heads + first_head) * dim;
      const __m512 scales = _mm512_set1_ps(scale);
      for (int64_t h = 0; h < count; ++h)
        for (int64_t v = 0; v < vectors; ++v)
          _mm512_storeu_ps(q.data() + h * dim + 16 * v, _mm512_mul_ps(load16(q_src + h * dim + 16 * v), scales));
      scores.resize(padded_heads * padded);
      for (int64_t t0 = 0; t0 < padded; t0 += 4) {
        for (int64_t b = 0; b < 4; ++b)
          for (int64_t v = 0; v < vectors; ++v)
            _mm512_store_ps(four + b * dim + 16 * v, t0 + b < len ? load16(rows[t0 + b] + 16 * v) : _mm512_setzero_ps());
        for (int64_t h0 = 0; h0 < padded_heads; h0 += 4) {
          __m512 sum[4][4];
          for (int a = 0; a < 4; ++a)
            for (int b = 0; b < 4; ++b) sum[a][b] = _mm512_setzero_ps();
          const float* q0 = q.data() + h0 * dim;
          for (int64_t v = 0; v < vectors; ++v) {
            __m512 k[4];
            for (int b = 0; b < 4; ++b) k[b] = _mm512_load_ps(four + b * dim + 16 * v);
            for (int a = 0; a < 4; ++a) {
              const __m512 qa = _mm512_loadu_ps(q0 + a * dim + 16 * v);
              for (int b = 0; b < 4; ++b) sum[a][b] = _mm512_fmadd_ps(qa, k[b], sum[a][b]);
            }
          }
          for (int a = 0; a < 4; ++a)
            for (int b = 0; b < 4; ++b) scores[(h0 + a) * padded + t0 + b] = _mm512_reduce_add_ps(sum[a][b]);
        }
      }
      for (int64_t h = 0; h < count; ++h) softmax_in_place(scores.data() + h * padded, len);
      for (int64_t h = count; h < padded_heads; ++h) std::fill_n(scores.data() + h * padded, padded, 0.f);
      acc.resize(padded_heads * dim);
      for (int64_t v0 = 0; v0 < vectors; v0 += 4)
        for (int64_t h0 = 0; h0 < padded_heads; h0 += 4) {
          __m512 sum[4][4];
          for (int a = 0; a < 4; ++a)
            for (int b = 0; b < 4; ++b) sum[a][b] = _mm512_setzero_ps();
          const float* p = scores.data() + h0 * padded;
          for (int64_t t = 0; t < len; ++t) {
            const scalar_t* k = rows[t] + 16 * v0;
            __m512 kv[4];
            for (int b = 0; b < 4; ++b) kv[b] = load16(k + 16 * b);
            for (int a = 0; a < 4; ++a) {
              const __m512 pa = _mm512_set1_ps(p[a * padded + t]);
              for (int b = 0; b < 4; ++b) sum[a][b] = _mm512_fmadd_ps(pa, kv[b], sum[a][b]);
            }
          }
          for (int a = 0; a < 4; ++a)
            for (int b = 0; b < 4; ++b) _mm512_storeu_ps(acc.data() + (h0 + a) * dim + 16 * (v0 + b), sum[a][b]);
        }
      scalar_t* dst = out + (seq * heads + first_head) * dim;
      for (int64_t i = 0; i < count * dim; ++i) dst[i] = static_cast<scalar_t>(acc[i]);
    }
  });
}

// The AVX-512 kernels for this shape: decode (one row per sequence), its row, the tiled prefill kernel;
// null when the portable kernel serves.
template <typename scalar_t>
using Kernel = void (*)(const scalar_t*, const scalar_t*, const int64_t*, const int64_t*, scalar_t*, Shape, float);
template <typename scalar_t>
using TiledKernel = void (*)(const scalar_t*, const scalar_t*, const int64_t*, const int64_t*, scalar_t*, Shape,
                             float, const std::vector<Tile>&, RowKernel<scalar_t>);
template <typename scalar_t>
struct Kernels {
  Kernel<scalar_t> decode = nullptr;
  RowKernel<scalar_t> row = nullptr;
  TiledKernel<scalar_t> tiled[3] = {};  // by Tiles: none, AVX-512 BF16, AMX
};

template <typename scalar_t, int HEAD_DIM, int GROUP>
Kernels<scalar_t> kernels() {
  Kernels<scalar_t> picked{decode<scalar_t, HEAD_DIM, GROUP>, decode_row<scalar_t, HEAD_DIM, GROUP>};
#if defined(ENGINE_TILES)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16> && HEAD_DIM <= 128) {  // (four query tiles at most)
    picked.tiled[static_cast<int>(Tiles::avx512_bf16)] = tiled<HEAD_DIM, Avx512Bf16Products<HEAD_DIM>>;
#if defined(ENGINE_AMX)
    picked.tiled[static_cast<int>(Tiles::amx)] = tiled<HEAD_DIM, AmxProducts<HEAD_DIM>>;
#endif
  }
#endif
  return picked;
}

template <typename scalar_t, int HEAD_DIM>
Kernels<scalar_t> pick_group(int64_t group) {
  switch (group) {
    case 1: return kernels<scalar_t, HEAD_DIM, 1>();
    case 2: return kernels<scalar_t, HEAD_DIM, 2>();
    case 3: return kernels<scalar_t, HEAD_DIM, 3>();
    case 4: return kernels<scalar_t, HEAD_DIM, 4>();
    case 5: return kernels<scalar_t, HEAD_DIM, 5>();
    case 6: return kernels<scalar_t, HEAD_DIM, 6>();
    case 7: return kernels<scalar_t, HEAD_DIM, 7>();
    case 8: return kernels<scalar_t, HEAD_DIM, 8>();
    default: return {};
  }
}

template <typename scalar_t>
Kernels<scalar_t> pick(int64_t head_dim, int64_t group) {
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    switch (head_dim) {
      case 64: return pick_group<scalar_t, 64>(group);
      case 128: return pick_group<scalar_t, 128>(group);
      case 256: return pick_group<scalar_t, 256>(group);  // (Gemma's; its prefill rows are rows, not tiles)
      default: return {};
    }
  }
  return {};
}

// The rows as tiles of at most TILE_ROWS; none when no two rows form a run (a decode step).
inline std::vector<Tile> find_tiles(const int64_t* tables, const int64_t* seq_lens, int64_t rows, int64_t width) {
  std::vector<Tile> tiles;
  bool runs = false;
  for (int64_t r = 0; r < rows; ++r) {
    if (r > 0 && tiles.back().rows < TILE_ROWS && seq_lens[r] == seq_lens[r - 1] + 1 &&
        std::equal(tables + r * width, tables + (r + 1) * width, tables + (r - 1) * width)) {
      ++tiles.back().rows;
      runs = true;
    } else {
      tiles.push_back({r, 1});
    }
  }
  if (!runs) tiles.clear();
  return tiles;
}

}  // namespace avx512
#endif

// The best tiles this build and CPU run (AMX needs the kernel's permission too).
static Tiles best_tiles() {
#if defined(ENGINE_AMX)
  if (amx_permitted()) return Tiles::amx;
#endif
#if defined(ENGINE_TILES)
  return Tiles::avx512_bf16;
#else
  return Tiles::none;
#endif
}

static Tiles current_tiles() {
  const int chosen = chosen_tiles;
  return chosen < 0 ? best_tiles() : static_cast<Tiles>(chosen);
}

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor kv_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, double scale, int64_t window, double softcap,
                                     torch::Tensor sinks) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [seqs, heads, head_dim]");
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous(), "kv_cache must be a contiguous 5-d tensor");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type(), "query and kv_cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables");
  auto tables = block_tables.contiguous();
  auto lens = seq_lens.contiguous();
  auto out = torch::empty_like(query);
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must not be negative");
  TORCH_CHECK(kv_cache.size(1) == 2 || (kv_cache.size(1) == 1 && kv_cache.size(3) == 1),
              "kv_cache: [blocks, 2, block_size, kv_heads, head_dim] or a latent [blocks, 1, block_size, 1, width]");
  Shape shape{query.size(0), query.size(1), kv_cache.size(3), query.size(2), kv_cache.size(2), tables.size(1), 0,
              window, static_cast<float>(softcap)};
  shape.halves = kv_cache.size(1);
  TORCH_CHECK(shape.num_heads % shape.num_kv_heads == 0 && kv_cache.size(4) == shape.head_dim, "shape mismatch");
  const bool has_sinks = sinks.defined() && sinks.numel() > 0;
  TORCH_CHECK(!has_sinks || (sinks.scalar_type() == at::kFloat && sinks.numel() == shape.num_heads),
              "sinks must be float32 [num_heads] or empty");
  const torch::Tensor sinks_c = has_sinks ? sinks.contiguous() : torch::Tensor();
  shape.sinks = has_sinks ? sinks_c.data_ptr<float>() : nullptr;
  // Few sequences: split each over its kv heads so that every thread has work.
  shape.heads_per_task = shape.num_seqs >= 4 * at::get_num_threads() ? shape.num_kv_heads : 1;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](auto impl) {
      impl(query.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
           lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), shape, static_cast<float>(scale));
    };
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
      if (shape.halves == 1 && shape.head_dim % 64 == 0 && !softcap && !has_sinks)
        return run(avx512::latent_decode<scalar_t>);  // latent rows (DeepSeek's 576 wide)
    }
    const int64_t group = shape.num_heads / shape.num_kv_heads;
    const auto avx = avx512::pick<scalar_t>(shape.head_dim, group);
    if (avx.decode != nullptr && shape.halves == 2) {
      // Rows of prefill chunks (runs of rows that share a table, lengths growing by one): as tiles.
      // NOTE: a window, soft-capping or sinks take the rows' path (the tiles read every key from the first)
      const auto tiled = window || softcap || has_sinks ? nullptr : avx.tiled[static_cast<int>(current_tiles())];
      if (tiled != nullptr) {
        const auto tiles = avx512::find_tiles(tables.data_ptr<int64_t>(), lens.data_ptr<int64_t>(),
                                              shape.num_seqs, shape.max_blocks);
        if (!tiles.empty()) {
          return tiled(query.data_ptr<scalar_t>(), kv_cache.data_ptr<scalar_t>(), tables.data_ptr<int64_t>(),
                       lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), shape, static_cast<float>(scale),
                       tiles, avx.row);
        }
      }
      // Every other row: the register-blocked decode kernel, at every batch size (a row alone and in a batch
      // take the same arithmetic)
      return run(avx.decode);
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

bool has_amx() {
  return best_tiles() == Tiles::amx;
}

std::string prefill_tiles() {
  return TILES_NAMES[static_cast<int>(current_tiles())];
}

std::string use_prefill_tiles(const std::string& kind) {
  int wanted = -1;
  for (int i = 0; i < 3; ++i)
    if (kind == TILES_NAMES[i] || (i == 0 && kind == "none")) wanted = i;
  TORCH_CHECK(wanted >= 0 || kind == "auto", "prefill tiles: 'auto', 'none', 'avx512_bf16' or 'amx', not '", kind, "'");
  TORCH_CHECK(wanted <= static_cast<int>(best_tiles()), "prefill tiles '", kind, "' are not available here (best: '",
              TILES_NAMES[static_cast<int>(best_tiles())], "')");
  chosen_tiles = wanted;
  return prefill_tiles();
}
