// Scalar math for the csrc kernels, written so that loops calling it vectorize (-O3 -march=native).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// exp(x) in float32 to about 1 ulp (Cephes' expf: 2^n times a degree-7 polynomial on [-ln2/2, ln2/2]),
// branch-free so that loops calling it vectorize; std::exp is a libm call per element. The argument is
// clamped to the range where the result is a normal float.
static inline float exp_f32(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}


#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

// 32 bf16 as the 16 pairs vdpbf16ps multiplies (a bit copy; the compiler emits no instruction).
static inline __m512bh as_bf16_pairs(__m512i x) {
  __m512bh r;
  std::memcpy(&r, &x, sizeof r);
  return r;
}
#endif
