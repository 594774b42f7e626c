// Int8 activations on packed blocks with AVX-512 VNNI, all the rows of a part (csrc/quant_a8.cpp has the
// contract): up to one pass of rows widens a group's integers in registers; more rows widen them CHUNK dims at a
// time into a tile that every pass reads from L1.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_a8.h"

namespace quant_kernel {

#if defined(ENGINE_A8_VNNI)
// The rows a pass at a time (A8_ROWS, the last pass the rest): the pass of rows r .. r + R - 1 holds row m's
// quad of dims (4i .. 4i + 3) at r * K / 4 + i * R + m, and its segment values at r * (K / seg) + s * R + m,
// so a pass's broadcasts lie at fixed offsets from one pointer.
inline int64_t pass_width(int64_t rows, int64_t r) { return std::min<int64_t>(A8_ROWS, rows - r); }

inline std::vector<int32_t> pass_quads(const A8Rows& a) {
  const int64_t quads = a.k / 4;
  std::vector<int32_t> out(a.rows * quads);
  for (int64_t r = 0; r < a.rows; r += pass_width(a.rows, r)) {
    const int64_t w = pass_width(a.rows, r);
    for (int64_t m = 0; m < w; ++m)
      for (int64_t i = 0; i < quads; ++i) std::memcpy(&out[r * quads + i * w + m], &a.q[(r + m) * a.k + 4 * i], 4);
  }
  return out;
}

// R rows against the widened segments [s0, s1) of one group (tile and so hold them from s0 on): P per segment in
// int32, then the float steps of the contract into acc (row m's 16 at acc + 16 m, carried from chunk to chunk).
template <int R, int64_t T>
void a8_pass(const int32_t* xq, const int32_t* start, const float* ds, const float* dx, int64_t s0, int64_t s1,
             int64_t seg, const __m512i* tile, const __m512* so, float* accs) {
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_load_ps(accs + 16 * m);
  const int64_t per = seg / 4;
  for (int64_t s = s0; s < s1; ++s) {
    __m512i p[R];
    for (int m = 0; m < R; ++m) p[m] = _mm512_set1_epi32(start[s * R + m]);
    for (int64_t i = 0; i < per; ++i) {
      const __m512i w = _mm512_load_si512(tile + (s - s0) * per + i);
      const int32_t* x = xq + (s * per + i) * R;
      for (int m = 0; m < R; ++m) p[m] = _mm512_dpbusd_epi32(p[m], w, _mm512_set1_epi32(x[m]));
    }
    const __m512 sc = so[2 * (s - s0)];
    for (int m = 0; m < R; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[m]), _mm512_mul_ps(sc, _mm512_set1_ps(ds[s * R + m])), acc[m]);
    if constexpr (free_offset(T)) {
      const __m512 off = so[2 * (s - s0) + 1];
      for (int m = 0; m < R; ++m) acc[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(dx[s * R + m]), acc[m]);
    }
  }
  for (int m = 0; m < R; ++m) _mm512_store_ps(accs + 16 * m, acc[m]);
}

// Up to A8_ROWS rows (one pass: a decode step) against one group, its integers widened in registers on the way
// (no tile): the same steps as a8_pass, in the same order.
template <int R, int64_t T>
void a8_fused(const int32_t* xq, const int32_t* start, const float* ds, const float* dx, int64_t k,
              const uint8_t* group, const Traits& t, float* accs) {
  constexpr int64_t seg = segment_of(T), per = seg / 4;
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < k / seg; ++s) {
    const int64_t first = s * seg, within = first % t.block;
    const uint8_t* rec = group + (first / t.block) * t.record;
    if constexpr (split_high(T)) prefetch_sub(group, t, T, s + PREFETCH_SUBS, k / seg);  // (their seg is a sub)
    __m512i p[R];
    for (int m = 0; m < R; ++m) p[m] = _mm512_set1_epi32(start[s * R + m]);
    for (int64_t i = 0; i < per; i += 2) {
      __m512i w[2];
      widen_chunk<T>(rec, t, within + 4 * i, w);
      const int32_t* x = xq + (s * per + i) * R;
      for (int m = 0; m < R; ++m) p[m] = _mm512_dpbusd_epi32(p[m], w[0], _mm512_set1_epi32(x[m]));
      for (int m = 0; m < R; ++m) p[m] = _mm512_dpbusd_epi32(p[m], w[1], _mm512_set1_epi32(x[R + m]));
    }
    __m512 sc, off;
    scales_of<T>(rec, t, within / t.sub, sc, off);
    for (int m = 0; m < R; ++m)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[m]), _mm512_mul_ps(sc, _mm512_set1_ps(ds[s * R + m])), acc[m]);
    if constexpr (free_offset(T))
      for (int m = 0; m < R; ++m) acc[m] = _mm512_fmadd_ps(off, _mm512_set1_ps(dx[s * R + m]), acc[m]);
  }
  for (int m = 0; m < R; ++m) _mm512_store_ps(accs + 16 * m, acc[m]);
}

// More rows: a group is widened CHUNK dims at a time (the tile stays in L1), and every pass reads each chunk.
constexpr int64_t CHUNK = 512;
// Up to one pass of rows widens in registers (a8_fused; on a Zen 4, Q5_0 [2048, 2048], 1 and 4 rows took 0.9-1.0x
// the tiles' time, 8 rows 0.8x); more rows take the tiles (at 12 and 16 rows, fused passes of 8 took 1.06-1.18x).
constexpr int64_t FUSED_MAX = A8_ROWS;

// Pass r's rows: their quads and their segment values (pass_quads, pass_segments).
struct PassInputs {
  const int32_t* quads;
  const int32_t* start;
  const float *d, *dx;
};

inline PassInputs pass_at(const std::vector<int32_t>& quads, const PassSegments& ps, int64_t k, int64_t segs,
                          int64_t r) {
  return {quads.data() + r * (k / 4), ps.start.data() + r * segs, ps.d.data() + r * segs, ps.dx.data() + r * segs};
}

// Up to A8_ROWS rows against one group, widened in registers: their sums into acc (row m's 16 at acc + 16 m).
template <int64_t T>
void group_fused(const PassInputs& x, int64_t rows, int64_t k, const uint8_t* group, const Traits& t, float* acc) {
  switch (rows) {
#define ENGINE_FUSED(R) \
  case R: a8_fused<R, T>(x.quads, x.start, x.d, x.dx, k, group, t, acc); break;
    ENGINE_FUSED(1) ENGINE_FUSED(2) ENGINE_FUSED(3) ENGINE_FUSED(4) ENGINE_FUSED(5) ENGINE_FUSED(6) ENGINE_FUSED(7)
#undef ENGINE_FUSED
    default: a8_fused<A8_ROWS, T>(x.quads, x.start, x.d, x.dx, k, group, t, acc);
  }
}

// All the rows against one group, CHUNK dims at a time through the tile: their sums into acc. With several
// passes, the bytes that follow the chunk (the next chunk, or the next group's first, short of `stop`) are
// asked for while the passes run: the hardware prefetchers stop at the pause (one pass streams as fast without).
template <int64_t T>
void group_tiled(const std::vector<int32_t>& quads, const PassSegments& ps, int64_t rows, int64_t k,
                 const uint8_t* group, const uint8_t* stop, const Traits& t, __m512i* tile, __m512* so, float* acc) {
  constexpr int64_t seg = segment_of(T);
  const int64_t segs = k / seg, chunk = std::max(CHUNK / t.block, int64_t{1}) * t.block;
  std::fill(acc, acc + 16 * rows, 0.0f);
  for (int64_t k0 = 0; k0 < k; k0 += chunk) {
    const int64_t dims = std::min(chunk, k - k0), s0 = k0 / seg, s1 = (k0 + dims) / seg;
    const uint8_t* bytes = group + (k0 / t.block) * t.record;
    widen_group<T>(bytes, t, dims, tile, so);
    const int64_t read = (dims / t.block) * t.record;
    if (rows > A8_ROWS)
      for (int64_t line = 0; line < read && bytes + read + line < stop; line += 64)
        __builtin_prefetch(bytes + read + line);
    for (int64_t r = 0; r < rows; r += pass_width(rows, r)) {
      const PassInputs x = pass_at(quads, ps, k, segs, r);
      switch (pass_width(rows, r)) {
#define ENGINE_PASS(R) \
  case R: a8_pass<R, T>(x.quads, x.start, x.d, x.dx, s0, s1, seg, tile, so, acc + 16 * r); break;
        ENGINE_PASS(1) ENGINE_PASS(2) ENGINE_PASS(3) ENGINE_PASS(4) ENGINE_PASS(5) ENGINE_PASS(6) ENGINE_PASS(7)
#undef ENGINE_PASS
        default: a8_pass<A8_ROWS, T>(x.quads, x.start, x.d, x.dx, s0, s1, seg, tile, so, acc + 16 * r); break;
      }
    }
  }
}

// The rows against the n / 16 groups of one part, the groups over the threads; y in O (out's row stride ldy).
template <int64_t T, typename O>
void run_vnni(const std::vector<int32_t>& quads, const A8Rows& a, const uint8_t* w, const Traits& t,
              const float* bias, O* out, int64_t n, int64_t ldy) {
  constexpr int64_t seg = segment_of(T);
  const int64_t k = a.k, rows = a.rows, segs = k / seg, group_bytes = (k / t.block) * t.record;
  const int64_t chunk = std::max(CHUNK / t.block, int64_t{1}) * t.block;
  const PassSegments ps = pass_segments(a, seg, int_offset(T), A8_ROWS);
  at::parallel_for(0, n / COLS, 1, [&](int64_t begin, int64_t end) {
    const bool tiled = rows > FUSED_MAX;  // (the fused passes need no tile: 10 KB less to clear a call)
    std::vector<__m512i> tile(tiled ? chunk / 4 : 0);
    std::vector<__m512> so(tiled ? 2 * chunk / seg : 0), accs(rows);
    float* acc = reinterpret_cast<float*>(accs.data());
    for (int64_t g = begin; g < end; ++g) {
      const uint8_t* group = w + g * group_bytes;
      if (!tiled)
        for (int64_t r = 0; r < rows; r += pass_width(rows, r))
          group_fused<T>(pass_at(quads, ps, k, segs, r), pass_width(rows, r), k, group, t, acc + 16 * r);
      else
        group_tiled<T>(quads, ps, rows, k, group, w + end * group_bytes, t, tile.data(), so.data(), acc);
      const float* b = bias != nullptr ? bias + g * COLS : nullptr;
      for (int64_t m = 0; m < rows; ++m)
        for (int c = 0; c < 16; ++c)
          out[m * ldy + g * COLS + c] = static_cast<O>(b != nullptr ? acc[16 * m + c] + b[c] : acc[16 * m + c]);
    }
  });
}
#endif

}  // namespace quant_kernel
