// 2^x in AVX512 and AVX2 for the engine's softmax kernels.
#pragma once

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>

namespace aaflow_simd {

constexpr float kLog2e = 1.4426950408889634f;  // e^x = 2^(x * kLog2e)

// 2^f for f in [-0.5, 0.5], degree 6, highest power first.
constexpr float kExp2Poly[7] = {1.535336188319500e-4f, 1.339887440266574e-3f, 9.618437357674640e-3f,
                                5.550332471162809e-2f, 2.402264791363012e-1f, 6.931472028550421e-1f, 1.0f};

#if defined(__AVX512F__)
inline __m512 fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 splat(float x, __m512) { return _mm512_set1_ps(x); }
#endif
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 splat(float x, __m256) { return _mm256_set1_ps(x); }
#endif

template <typename V>
inline V exp2_fraction(V f) {  // 2^f, f in [-0.5, 0.5]
  V p = splat(kExp2Poly[0], f);
  for (int i = 1; i < 7; ++i) p = fmadd(p, f, splat(kExp2Poly[i], f));
  return p;
}

#if defined(__AVX512F__)
// 2^x for x <= 0: x = n + f, f in [-0.5, 0.5], 2^f by the polynomial. Clamped at -126 (the smallest
// normal; below it the CPU would take slow denormal assists), so masked keys are zeroed by their
// callers, not here.
inline __m512 exp2_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_scalef_ps(exp2_fraction(_mm512_sub_ps(x, n)), n);
}

inline __mmask16 first_lanes(long left) {  // the first `left` of 16 lanes
  return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// The same in AVX2, clamped at -125 so that 2^n times the fraction's value stays a normal number.
inline __m256 exp2_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-125.0f));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(exp2_fraction(_mm256_sub_ps(x, n)), _mm256_castsi256_ps(scale));
}
#endif

}  // namespace aaflow_simd
#endif
