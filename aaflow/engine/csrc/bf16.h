// bf16 <-> fp32 conversions and an AVX512 lane sum shared by the engine's C++ kernels.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace aaflow_bf16 {

inline float bf16_to_float(uint16_t x) {
  uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

#if defined(__AVX512BF16__)
inline __m128 sum_lanes4(__m512 a, __m512 b, __m512 c, __m512 d) {  // -> [sum a, sum b, sum c, sum d]
  __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
  abcd = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, 0x4E));
  abcd = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, 0xB1));
  return _mm512_castps512_ps128(abcd);  // 128-bit lane 0: a, b, c, d in that order
}

// One vector's lane sum in the order `sum_lanes4` sums each of its four (a's sum never depends on
// b, c, d), so a product gives the same bits whether it was computed alone or in a group of four.
inline float sum_lanes(__m512 a) {
  const __m512 zero = _mm512_setzero_ps();
  return _mm_cvtss_f32(sum_lanes4(a, zero, zero, zero));
}
#endif

}  // namespace aaflow_bf16
