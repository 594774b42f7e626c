// W8A8 products (compressed-tensors' int8 weights with int8 activations, as vLLM serves them): each row of x
// quantized to int8 as vLLM does it per token, the dot products summed exactly in int32, then scaled once.
//
// linear_w8a8_parts(x [M, K] float32 or bf16, packed uint8, parts int64 [P, 4] (type, first column, columns,
// byte offset) as linear_quant_parts, bias [N] or empty, N) -> [M, N] in x's dtype.
//
// Per row: scale = max |x| / 127 and q = round-half-even(x / scale) in [-128, 127] (an all-zero row: q = 0), in
// IEEE float32 as torch computes them (this file is built without -ffast-math's reciprocal rewrites). Then
// y[m, n] = float(sum_k q[m, k] w[n, k]) * (scale[m] * w_scale[n]) + bias[n], rounded once to x's dtype; the
// sum is exact in int32, so every row count and thread count gives the same bits (batch-invariant).
//
// Layout (worker/quant/int_pack.py, type I8_A8 = 104): per 16 output rows and block of 64 input dims, a
// 1,152-byte record: the rows' weight scales f32 [16] (the same in every block: channel-wise), the block's
// weight sums per row int32 [16], then int8 [16 quads][16 rows][4]: a row's 4 consecutive dims side by side,
// as vpdpbusd multiplies them. AVX-512 VNNI adds 4 products a lane an instruction, on unsigned activations
// (q + 128) whose excess 128 sum(w) the block sums take back; AVX2 (vpmaddubsw, vpmaddwd) sums q w itself; elsewhere
// a portable loop sums the same ints.
// On a CPU with AMX, passes of AMX_FROM rows or more take tdpbusd on tiles: a block's record is a B tile as it
// lies (16 quads x 16 columns x 4 bytes), each pass's activations an A tile. The int32 sums are exact in any
// order, so both forms give the same bits and a row's result does not depend on which one its pass took.
#pragma GCC optimize("no-fast-math")
#include "ops.h"
#include "amx.h"
#include "gemm_rows.h"
#include "quant_parts.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using rows_kernel::COLS;  // a group's columns, the other packings' too
constexpr int64_t I8_A8 = 104, BLOCK = 64, RECORD = 128 + 16 * BLOCK, ROWS = 8;
#if defined(ENGINE_AMX) && defined(__AMX_INT8__)
#define ENGINE_W8A8_AMX 1
constexpr int64_t AMX_ROWS = 16, AMX_FROM = 4;  // rows a tile pass; passes of fewer rows take vpdpbusd

// Tiles: 0 the int32 sums (rows x 16 columns), 1 A (rows x 64 activations), 2 B (16 quads x 16 columns x 4).
struct alignas(64) W8A8Tiles {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit W8A8Tiles(int64_t m) {
    colsb[0] = 64, rows[0] = static_cast<uint8_t>(m);
    colsb[1] = 64, rows[1] = static_cast<uint8_t>(m);
    colsb[2] = 64, rows[2] = 16;
  }
};

// Rows [0, m) of u (m <= 16) against one group's records on tiles: the same int32 sums as group_sums.
void group_sums_amx(const uint8_t* u, int64_t m, int64_t k, const uint8_t* group, int32_t* sums) {
  const int64_t blocks = k / BLOCK;
  __m512i wsum = _mm512_setzero_si512();
  _tile_zero(0);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = group + b * RECORD;
    wsum = _mm512_add_epi32(wsum, _mm512_loadu_si512(rec + 64));
    _tile_loadd(1, u + b * BLOCK, k);
    _tile_loadd(2, rec + 128, 64);
    _tile_dpbusd(0, 1, 2);
  }
  _tile_stored(0, sums, COLS * 4);
  const __m512i excess = _mm512_slli_epi32(wsum, 7);
  for (int64_t r = 0; r < m; ++r)
    _mm512_storeu_si512(sums + r * COLS, _mm512_sub_epi32(_mm512_loadu_si512(sums + r * COLS), excess));
}
#endif

// Row m's int8 values plus 128 (uint8) into u, its scale into scale[m].
template <typename T>
void quantize_rows(const T* x, int64_t rows, int64_t k, uint8_t* u, float* scale) {
  for (int64_t m = 0; m < rows; ++m) {
    const T* row = x + m * k;
    float top = 0.0f;
    for (int64_t i = 0; i < k; ++i) top = std::max(top, std::fabs(static_cast<float>(row[i])));
    const float s = top / 127.0f;
    scale[m] = s;
    for (int64_t i = 0; i < k; ++i) {
      const float q = s > 0.0f ? std::nearbyint(static_cast<float>(row[i]) / s) : 0.0f;
      u[m * k + i] = static_cast<uint8_t>(static_cast<int32_t>(std::min(127.0f, std::max(-128.0f, q))) + 128);
    }
  }
}

// Rows [0, R) of u against one group's records: the exact int32 sums of q * w, per row and column.
template <int R>
void group_sums(const uint8_t* u, int64_t k, const uint8_t* group, int32_t* sums) {
  const int64_t blocks = k / BLOCK;
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
  __m512i acc[R];
  __m512i wsum = _mm512_setzero_si512();
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_si512();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* rec = group + b * RECORD;
    wsum = _mm512_add_epi32(wsum, _mm512_loadu_si512(rec + 64));
    for (int64_t j = 0; j < BLOCK / 4; ++j) {
      const __m512i w = _mm512_loadu_si512(rec + 128 + j * 64);
      for (int m = 0; m < R; ++m) {
        int32_t quad;
        std::memcpy(&quad, u + m * k + b * BLOCK + j * 4, 4);
        acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_set1_epi32(quad), w);
      }
    }
  }
  const __m512i excess = _mm512_slli_epi32(wsum, 7);  // the activations' + 128, times each row's weights
  for (int m = 0; m < R; ++m) _mm512_storeu_si512(sums + m * COLS, _mm512_sub_epi32(acc[m], excess));
#elif defined(__AVX2__)
  if constexpr (R > 4) {  // (passes of 4: 8 int32 registers)
    group_sums<4>(u, k, group, sums);
    group_sums<R - 4>(u + 4 * k, k, group, sums + 4 * COLS);
  } else {
    // vpmaddubsw on |w| and q signed as w is (vpsignb): no pair saturates int16, as |w| <= 128 and |q| <= 127
    // (|x / scale| <= 127 up to rounding); vpmaddwd adds the pairs in int32
    const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(static_cast<char>(0x80));
    __m256i acc[2 * R];
    for (int i = 0; i < 2 * R; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* rec = group + b * RECORD;
      for (int64_t j = 0; j < BLOCK / 4; ++j) {
        const __m256i w[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 128 + j * 64)),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 128 + j * 64 + 32))};
        const __m256i size[2] = {_mm256_abs_epi8(w[0]), _mm256_abs_epi8(w[1])};
        for (int m = 0; m < R; ++m) {
          int32_t quad;
          std::memcpy(&quad, u + m * k + b * BLOCK + j * 4, 4);
          const __m256i q = _mm256_xor_si256(_mm256_set1_epi32(quad), flip);  // u - 128
          for (int h = 0; h < 2; ++h)
            acc[2 * m + h] = _mm256_add_epi32(
                acc[2 * m + h], _mm256_madd_epi16(_mm256_maddubs_epi16(size[h], _mm256_sign_epi8(q, w[h])), ones));
        }
      }
    }
    for (int m = 0; m < R; ++m)
      for (int h = 0; h < 2; ++h) _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + m * COLS + 8 * h), acc[2 * m + h]);
  }
#else
  for (int m = 0; m < R; ++m)
    for (int c = 0; c < COLS; ++c) {
      int32_t sum = 0;
      for (int64_t b = 0; b < blocks; ++b) {
        const int8_t* w = reinterpret_cast<const int8_t*>(group + b * RECORD + 128);
        for (int64_t d = 0; d < BLOCK; ++d)
          sum += (static_cast<int32_t>(u[m * k + b * BLOCK + d]) - 128) * w[(d / 4) * 64 + c * 4 + d % 4];
      }
      sums[m * COLS + c] = sum;
    }
#endif
}

template <typename T>
void run(const T* x, int64_t rows, int64_t k, const uint8_t* bytes, int64_t start, int64_t width, int64_t offset,
         const float* bias, T* y, int64_t n, const uint8_t* u, const float* scale) {
  const int64_t groups = width / COLS, group_bytes = (k / BLOCK) * RECORD;
#if defined(ENGINE_W8A8_AMX)
  const bool tiles = rows >= AMX_FROM && amx_permitted();
#else
  [[maybe_unused]] const bool tiles = false;
#endif
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t sums[16 * COLS];
    int64_t configured = -1;
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = bytes + offset + g * group_bytes;
      float w_scale[COLS];
      std::memcpy(w_scale, group, sizeof w_scale);
      for (int64_t r = 0; r < rows;) {
        const uint8_t* ur = u + r * k;
        int pass = static_cast<int>(std::min<int64_t>(ROWS, rows - r));
#if defined(ENGINE_W8A8_AMX)
        if (tiles && rows - r >= AMX_FROM) {
          pass = static_cast<int>(std::min<int64_t>(AMX_ROWS, rows - r));
          if (pass != configured) {
            const W8A8Tiles config(pass);
            _tile_loadconfig(&config);
            configured = pass;
          }
          group_sums_amx(ur, pass, k, group, sums);
        } else
#endif
        switch (pass) {
          case 1: group_sums<1>(ur, k, group, sums); break;
          case 2: group_sums<2>(ur, k, group, sums); break;
          case 3: group_sums<3>(ur, k, group, sums); break;
          case 4: group_sums<4>(ur, k, group, sums); break;
          case 5: group_sums<5>(ur, k, group, sums); break;
          case 6: group_sums<6>(ur, k, group, sums); break;
          case 7: group_sums<7>(ur, k, group, sums); break;
          default: group_sums<8>(ur, k, group, sums); break;
        }
        for (int m = 0; m < pass; ++m)
          for (int c = 0; c < COLS; ++c) {
            const int64_t col = start + g * COLS + c;
            const float value = std::fma(static_cast<float>(sums[m * COLS + c]), scale[r + m] * w_scale[c],
                                         bias != nullptr ? bias[col] : 0.0f);
            y[(r + m) * n + col] = static_cast<T>(value);
          }
        r += pass;
      }
    }
#if defined(ENGINE_W8A8_AMX)
    if (configured >= 0) _tile_release();
#endif
  });
}

}  // namespace

torch::Tensor linear_w8a8_parts(torch::Tensor x, torch::Tensor packed, torch::Tensor parts, torch::Tensor bias,
                                int64_t out_features) {
  const torch::Tensor bias32 = parts_checks::checked_call("linear_w8a8", x, packed, parts, bias, out_features);
  const bool has_bias = bias32.defined();
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % BLOCK == 0, "linear_w8a8: K = ", k, " is not whole blocks of ", BLOCK);
  const torch::Tensor xc = x.contiguous();
  auto y = torch::empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  std::vector<uint8_t> u(rows * k);
  std::vector<float> scale(rows);
  if (x.scalar_type() == at::kFloat)
    quantize_rows(xc.data_ptr<float>(), rows, k, u.data(), scale.data());
  else
    quantize_rows(xc.data_ptr<c10::BFloat16>(), rows, k, u.data(), scale.data());
  const int64_t* p = parts.data_ptr<int64_t>();
  int64_t covered = 0;
  for (int64_t i = 0; i < parts.size(0); ++i) {
    const int64_t type = p[4 * i], start = p[4 * i + 1], width = p[4 * i + 2], offset = p[4 * i + 3];
    TORCH_CHECK(type == I8_A8, "linear_w8a8: part ", i, " is type ", type, ", not int8 weights for int8 rows");
    parts_checks::check_part("linear_w8a8", i, start, width, offset, (k / BLOCK) * RECORD, out_features, packed.numel());
    covered += width;
    const float* b = has_bias ? bias32.data_ptr<float>() : nullptr;
    if (x.scalar_type() == at::kFloat)
      run(xc.data_ptr<float>(), rows, k, packed.data_ptr<uint8_t>(), start, width, offset, b, y.data_ptr<float>(),
          out_features, u.data(), scale.data());
    else
      run(xc.data_ptr<c10::BFloat16>(), rows, k, packed.data_ptr<uint8_t>(), start, width, offset, b,
          y.data_ptr<c10::BFloat16>(), out_features, u.data(), scale.data());
  }
  parts_checks::check_covered("linear_w8a8", covered, out_features);
  return y;
}
