// LoRA's low-rank products for the rows that use an adapter, in one call per fused product (BGMV's shape):
//
// lora_add(x, y, a, bt, row_slots, bounds, ranks): y[r] += B_s (A_s x[r]) for each row r whose slot s =
//   row_slots[r] is >= 0 (rows of the base model, -1, are not touched).
//
// x:         [n, in]  the product's input, float32 or bf16
// y:         [n, out] its output, the same dtype, updated in place (the sum is rounded once, in float32)
// a:         [S, P * R, in]  each slot's A factors, part p's rank-R block at rows p * R (zeros past its rank)
// bt:        [S, P * R, out] each slot's B factors, transposed and scaled; part p's block reaches only its
//            own out columns bounds[p] .. bounds[p + 1] (q, k and v of a fused qkv product)
// row_slots: int64 [n]; bounds: int64 [P + 1]; ranks: int64 [S, P], each slot's rank in each part (<= R;
//            0 where its adapter does not target the part: the k past it are zeros, and skipped)
//
// Rows are taken a slot at a time, in chunks of up to kChunk rows that share each read of the slot's factors
// (a decode step's rows of one adapter: its factors come from memory once, not once a row); the chunks
// spread over the threads. Each row's sums run in one fixed order, whatever its chunk and thread: a row's
// result does not depend on the batch (batch-invariant). The loops over `in` and over out columns are
// contiguous and vectorize (-O3 -march=native -ffast-math).
#include "ops.h"

#include "cpu_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <cstring>
#include <utility>
#include <vector>

namespace {

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

constexpr int64_t kChunk = 8;   // rows of one slot that share each read of its factors
constexpr int64_t kBlock = 64;  // output columns summed at once

// One slot's rows (a chunk of them): each factor row is read once for all of them (L1 after the first).
// Each row's sums run in one fixed order whatever the chunk: over i for its dot products, over k for its
// outputs; so a row's result does not depend on which rows share its chunk.
template <typename T>
void lora_chunk(const T* x, T* y, const T* as, const T* bs, const int64_t* rows, int64_t m, const int64_t* bounds,
                const int64_t* used, int64_t in, int64_t out, int64_t parts, int64_t rank, float* xin, float* xa) {
  const int64_t width = parts * rank;
  for (int64_t j = 0; j < m; ++j) {
    const T* xr = x + rows[j] * in;
    for (int64_t i = 0; i < in; ++i) xin[j * in + i] = to_float(xr[i]);
  }
  for (int64_t p = 0; p < parts; ++p) {
    for (int64_t k = 0; k < used[p]; ++k) {
      const T* factor = as + (p * rank + k) * in;
      for (int64_t j = 0; j < m; ++j) {
        const float* xj = xin + j * in;
        float sum = 0.f;
        for (int64_t i = 0; i < in; ++i) sum += xj[i] * to_float(factor[i]);
        xa[j * width + p * rank + k] = sum;
      }
    }
  }
  // y[j, o] += sum over k (ascending) of xa[j, k] * bt[k, o], kBlock columns at a time (a block of sums the
  // compiler keeps in vector registers)
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t first = bounds[p], last = bounds[p + 1], ranks = used[p];
    if (ranks == 0) continue;
    const T* block = bs + p * rank * out;
    for (int64_t o = first; o < last; o += kBlock) {
      const int64_t n = std::min<int64_t>(kBlock, last - o);
      for (int64_t j = 0; j < m; ++j) {
        const float* coefficients = xa + j * width + p * rank;
        float sums[kBlock] = {};
        for (int64_t k = 0; k < ranks; ++k) {
          const float scale = coefficients[k];
          const T* column = block + k * out + o;
          for (int64_t q = 0; q < n; ++q) sums[q] += scale * to_float(column[q]);
        }
        T* yr = y + rows[j] * out + o;
        for (int64_t q = 0; q < n; ++q) yr[q] = static_cast<T>(to_float(yr[q]) + sums[q]);
      }
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr bool kFastBf16 = true;
#else
constexpr bool kFastBf16 = false;
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 with AVX-512 BF16: each dot product in vdpbf16ps (bf16 pairs, float32 sums) over 32 inputs at a time,
// each output column block as 16 float32 lanes; the same fixed order for every row.
inline float dot_bf16(const at::BFloat16* x, const at::BFloat16* f, int64_t in) {
  __m512 even = _mm512_setzero_ps(), odd = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= in; i += 64) {
    even = _mm512_dpbf16_ps(even, as_bf16_pairs(_mm512_loadu_si512(x + i)), as_bf16_pairs(_mm512_loadu_si512(f + i)));
    odd = _mm512_dpbf16_ps(odd, as_bf16_pairs(_mm512_loadu_si512(x + i + 32)),
                           as_bf16_pairs(_mm512_loadu_si512(f + i + 32)));
  }
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(even, odd));
  for (; i < in; ++i) sum += to_float(x[i]) * to_float(f[i]);
  return sum;
}

inline __m512 load_bf16(const at::BFloat16* p) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

template <>
void lora_chunk(const at::BFloat16* x, at::BFloat16* y, const at::BFloat16* as, const at::BFloat16* bs,
                const int64_t* rows, int64_t m, const int64_t* bounds, const int64_t* used, int64_t in, int64_t out,
                int64_t parts, int64_t rank, float* /*xin*/, float* xa) {
  const int64_t width = parts * rank;
  for (int64_t p = 0; p < parts; ++p)
    for (int64_t k = 0; k < used[p]; ++k) {
      const at::BFloat16* factor = as + (p * rank + k) * in;
      for (int64_t j = 0; j < m; ++j) xa[j * width + p * rank + k] = dot_bf16(x + rows[j] * in, factor, in);
    }
  // y[j, o] += sum over k (ascending) of xa[j, k] * bt[k, o]: 64 columns at a time in four registers
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t first = bounds[p], last = bounds[p + 1], ranks = used[p];
    if (ranks == 0) continue;
    const at::BFloat16* block = bs + p * rank * out;
    int64_t o = first;
    for (; o + 64 <= last; o += 64) {
      for (int64_t j = 0; j < m; ++j) {
        const float* coefficients = xa + j * width + p * rank;
        __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
        for (int64_t k = 0; k < ranks; ++k) {
          const __m512 scale = _mm512_set1_ps(coefficients[k]);
          const at::BFloat16* column = block + k * out + o;
          c0 = _mm512_fmadd_ps(scale, load_bf16(column), c0);
          c1 = _mm512_fmadd_ps(scale, load_bf16(column + 16), c1);
          c2 = _mm512_fmadd_ps(scale, load_bf16(column + 32), c2);
          c3 = _mm512_fmadd_ps(scale, load_bf16(column + 48), c3);
        }
        at::BFloat16* yr = y + rows[j] * out + o;
        const __m512 sums[4] = {c0, c1, c2, c3};
        for (int q = 0; q < 4; ++q) {
          const __m512 total = _mm512_add_ps(load_bf16(yr + 16 * q), sums[q]);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(yr + 16 * q), (__m256i)_mm512_cvtneps_pbh(total));
        }
      }
    }
    for (; o < last; ++o)  // a part's last columns past a multiple of 64
      for (int64_t j = 0; j < m; ++j) {
        float sum = 0.f;
        for (int64_t k = 0; k < ranks; ++k) sum += xa[j * width + p * rank + k] * to_float(block[k * out + o]);
        at::BFloat16* yr = y + rows[j] * out;
        yr[o] = static_cast<at::BFloat16>(to_float(yr[o]) + sum);
      }
  }
}
#endif

template <typename T>
void lora_rows(const T* x, T* y, const T* a, const T* bt, const int64_t* row_slots, const int64_t* bounds,
               const int64_t* ranks, int64_t n, int64_t num_slots, int64_t in, int64_t out, int64_t parts,
               int64_t rank) {
  const int64_t width = parts * rank;
  std::vector<std::vector<int64_t>> by_slot(num_slots);  // each slot's rows, in order
  for (int64_t r = 0; r < n; ++r)
    if (row_slots[r] >= 0) by_slot[row_slots[r]].push_back(r);
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (slot, first index into its rows)
  for (int64_t s = 0; s < num_slots; ++s)
    for (int64_t first = 0; first < static_cast<int64_t>(by_slot[s].size()); first += kChunk) chunks.emplace_back(s, first);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    // float32 copies of the rows: only the portable path reads them
    const bool buffers = !kFastBf16 || !std::is_same_v<T, at::BFloat16>;
    std::vector<float> xin(buffers ? kChunk * in : 0), xa(kChunk * width);
    for (int64_t c = begin; c < end; ++c) {
      const auto [s, first] = chunks[c];
      const int64_t m = std::min<int64_t>(kChunk, static_cast<int64_t>(by_slot[s].size()) - first);
      lora_chunk(x, y, a + s * width * in, bt + s * width * out, by_slot[s].data() + first, m, bounds, ranks + s * parts,
                 in, out, parts, rank, xin.data(), xa.data());
    }
  });
}

}  // namespace

void lora_add(torch::Tensor x, torch::Tensor y, torch::Tensor a, torch::Tensor bt, torch::Tensor row_slots,
              torch::Tensor bounds, torch::Tensor ranks) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x [n, in] and y [n, out]");
  TORCH_CHECK(a.dim() == 3 && bt.dim() == 3 && a.size(0) == bt.size(0) && a.size(1) == bt.size(1),
              "a [S, P * R, in] and bt [S, P * R, out]");
  TORCH_CHECK(a.size(2) == x.size(1) && bt.size(2) == y.size(1), "a and bt fit x and y");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  bt.scalar_type() == x.scalar_type(),
              "x, y, a and bt share a dtype");
  TORCH_CHECK(row_slots.scalar_type() == at::kLong && row_slots.numel() == x.size(0), "row_slots: int64 [n]");
  TORCH_CHECK(bounds.scalar_type() == at::kLong && bounds.dim() == 1 && bounds.numel() >= 2, "bounds: int64 [P + 1]");
  TORCH_CHECK(ranks.scalar_type() == at::kLong && ranks.numel() == a.size(0) * (bounds.numel() - 1) &&
                  ranks.is_contiguous(),
              "ranks: int64 [S, P]");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && a.is_contiguous() && bt.is_contiguous(), "contiguous");
  const int64_t parts = bounds.numel() - 1;
  TORCH_CHECK(a.size(1) % parts == 0, "P * R rows per slot");
  const int64_t rank = a.size(1) / parts;
  const int64_t* slots = row_slots.data_ptr<int64_t>();
  const int64_t* ends = bounds.data_ptr<int64_t>();
  const int64_t* used = ranks.data_ptr<int64_t>();
  TORCH_CHECK(ends[parts] <= y.size(1), "bounds within out");
  for (int64_t s = 0; s < ranks.numel(); ++s) TORCH_CHECK(used[s] >= 0 && used[s] <= rank, "ranks <= R");
  for (int64_t r = 0; r < x.size(0); ++r) TORCH_CHECK(slots[r] < a.size(0), "row_slots < S");
  if (x.scalar_type() == at::kFloat) {
    lora_rows(x.data_ptr<float>(), y.data_ptr<float>(), a.data_ptr<float>(), bt.data_ptr<float>(), slots, ends,
              used, x.size(0), a.size(0), x.size(1), y.size(1), parts, rank);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "float32 or bf16");
    lora_rows(x.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), a.data_ptr<at::BFloat16>(),
              bt.data_ptr<at::BFloat16>(), slots, ends, used, x.size(0), a.size(0), x.size(1), y.size(1), parts,
              rank);
  }
}
