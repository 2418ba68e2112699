// The fp32 decode kernel's inner loops with AVX2 and FMA (decode_attention.cpp): scores of a chunk
// of keys for every head, their softmax, and the probabilities' sum of V, each K/V row read in place
// from the paged pool. Written for CPUs without native bf16, where the engine runs fp32 and torch's
// paths gather every context into a copy before attending it.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "simd_exp.h"

namespace aaflow_decode_fp32 {

using aaflow_simd::exp2_neg;
using aaflow_simd::kLog2e;

constexpr int64_t kPrefetchKeys = 8;

inline __m256 first_lanes(int64_t left) {  // all-ones in the first `left` of 8 lanes
  const __m256 index = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmp_ps(index, _mm256_set1_ps(float(std::min<int64_t>(left, 8))), _CMP_LT_OQ);
}

inline float lane_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// [sum a, sum b, sum c, sum d]; each sum's order never depends on the other vectors.
inline __m128 sum_lanes4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // per 128-bit half: a, b, c, d partial sums
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// Softmax of one head's scores (n of them) with its own max into `probs`; the max and sum returned.
inline void softmax_row(const float* scores, int64_t n, float* probs, float* max_out, float* sum_out) {
  const __m256 minus_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 vmax = minus_inf;
  for (int64_t j = 0; j < n; j += 8)
    vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(scores + j), first_lanes(n - j)));
  const float m = lane_max(vmax);
  const __m256 shift = _mm256_set1_ps(-m * kLog2e), c = _mm256_set1_ps(kLog2e);
  __m256 vsum = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) {
    const __m256 p = _mm256_and_ps(exp2_neg(_mm256_fmadd_ps(_mm256_loadu_ps(scores + j), c, shift)), first_lanes(n - j));
    vsum = _mm256_add_ps(vsum, p);
    _mm256_storeu_ps(probs + j, p);  // the buffers hold whole vectors past n
  }
  const __m128 s = sum_lanes4(vsum, _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
  *max_out = m;
  *sum_out = _mm_cvtss_f32(s);
}

inline void prefetch_row(const float* p, int D) {  // one kv head's row: D / 16 cache lines
  for (int d = 0; d < D; d += 16) _mm_prefetch(reinterpret_cast<const char*>(p + d), _MM_HINT_T0);
}

// Scores of keys [first, last) for every head: out[h * stride + j]. Four keys at a time for each
// query row, their rows read from L1 for the other rows of the same kv head.
template <int D>
void scores(const float* q, const float* k, const int64_t* slots, int64_t first, int64_t last, int64_t heads,
            int64_t kv_heads, int64_t stride, float* out) {
  const int64_t group = heads / kv_heads;
  for (int64_t j = first; j < last; j += 4) {
    const int64_t keys = std::min<int64_t>(4, last - j);
    for (int64_t t = 0; t < 4 && j + t + kPrefetchKeys < last; ++t)
      for (int64_t h = 0; h < kv_heads; ++h) prefetch_row(k + (slots[j + t + kPrefetchKeys] * kv_heads + h) * D, D);
    for (int64_t h = 0; h < kv_heads; ++h) {
      const float* kr[4];
      for (int t = 0; t < 4; ++t) kr[t] = k + (slots[j + std::min<int64_t>(t, keys - 1)] * kv_heads + h) * D;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = h * group + g;
        const float* qr = q + row * D;
        __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int d = 0; d < D; d += 8) {
          const __m256 qv = _mm256_loadu_ps(qr + d);
          for (int t = 0; t < 4; ++t) acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kr[t] + d), acc[t]);
        }
        float sums[4];
        _mm_storeu_ps(sums, sum_lanes4(acc[0], acc[1], acc[2], acc[3]));
        for (int64_t t = 0; t < keys; ++t) out[row * stride + j - first + t] = sums[t];
      }
    }
  }
}

// probs[h * stride + j] times V of keys [first, last) -> acc_out [H, D]: each output row's 64 dims
// at a time in eight registers.
template <int D>
void values(const float* probs, const float* v, const int64_t* slots, int64_t first, int64_t last, int64_t heads,
            int64_t kv_heads, int64_t stride, float* acc_out) {
  const int64_t group = heads / kv_heads;
  for (int64_t row = 0; row < heads; ++row) {
    const int64_t h = row / group;
    const float* p = probs + row * stride - first;
    for (int d0 = 0; d0 < D; d0 += 64) {
      __m256 acc[8];
      for (int a = 0; a < 8; ++a) acc[a] = _mm256_setzero_ps();
      for (int64_t j = first; j < last; ++j) {
        if (row % group == 0 && j + kPrefetchKeys < last) prefetch_row(v + (slots[j + kPrefetchKeys] * kv_heads + h) * D, D);
        const float* vr = v + (slots[j] * kv_heads + h) * D + d0;
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int a = 0; a < 8; ++a) acc[a] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vr + 8 * a), acc[a]);
      }
      for (int a = 0; a < 8; ++a) _mm256_storeu_ps(acc_out + row * D + d0 + 8 * a, acc[a]);
    }
  }
}

}  // namespace aaflow_decode_fp32
#endif
