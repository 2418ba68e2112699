// The bf16 decode kernel's inner loops with AVX512-BF16 (decode_attention.cpp): scores of a chunk of
// keys for every head, their softmax with the probabilities rounded to bf16, and the probabilities'
// sum of V. Only compiled where the CPU has AVX512-BF16.
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "bf16.h"
#include "simd_exp.h"

namespace aaflow_decode_bf16 {

using namespace aaflow_bf16;
using aaflow_simd::kLog2e;

constexpr int64_t kPrefetchKeys = 16;
constexpr int64_t kMaxGroup = 8;

// Softmax of one head's scores (n of them) with its own max: probabilities rounded to bf16 into
// `probs` (zero-padded to an even count), the max and the fp32 sum returned.
inline void softmax_row(const float* scores, int64_t n, uint16_t* probs, float* max_out, float* sum_out) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = aaflow_simd::first_lanes(n - j);
    vmax = _mm512_mask_max_ps(vmax, lanes, vmax, _mm512_maskz_loadu_ps(lanes, scores + j));
  }
  const float m = _mm512_reduce_max_ps(vmax);
  const __m512 shift = _mm512_set1_ps(-m * kLog2e), c = _mm512_set1_ps(kLog2e);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = aaflow_simd::first_lanes(n - j);
    __m512 p = aaflow_simd::exp2_neg(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, scores + j), c, shift));
    p = _mm512_maskz_mov_ps(lanes, p);
    vsum = _mm512_add_ps(vsum, p);
    _mm256_mask_storeu_epi16(probs + j, lanes, (__m256i)_mm512_cvtneps_pbh(p));
  }
  if (n % 2) probs[n] = 0;
  *max_out = m;
  *sum_out = _mm512_reduce_add_ps(vsum);
}

// bf16 pairs straight into vdpbf16ps, one kv head at a time so that its query rows (scores) or
// output rows (values) stay in registers; the rows of the keys ahead are prefetched (a context's
// slots jump between pages, which the hardware does not follow). D = 64.
inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline void prefetch_row(const uint16_t* p) {  // one kv head's 64 bf16: two cache lines
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + 32), _MM_HINT_T0);
}

// Scores of keys [first, last) for every head: scores[h * stride + j], fp32.
inline void scores(const uint16_t* q, const uint16_t* k, const int64_t* slots, int64_t first, int64_t last,
                   int64_t heads, int64_t kv_heads, int64_t stride, float* out) {
  constexpr int D = 64;
  const int64_t group = heads / kv_heads;
  for (int64_t j = first; j < last; j += 4) {
    const int64_t keys = std::min<int64_t>(4, last - j);
    for (int64_t t = 0; t < 4 && j + t + kPrefetchKeys < last; ++t)
      for (int64_t h = 0; h < kv_heads; ++h) prefetch_row(k + (slots[j + t + kPrefetchKeys] * kv_heads + h) * D);
    for (int64_t h = 0; h < kv_heads; ++h) {
      __m512bh k0[4], k1[4];
      for (int t = 0; t < 4; ++t) {
        const uint16_t* kr = k + (slots[j + std::min<int64_t>(t, keys - 1)] * kv_heads + h) * D;
        k0[t] = load_bh(kr);
        k1[t] = load_bh(kr + 32);
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t row = h * group + g;
        const __m512bh q0 = load_bh(q + row * D), q1 = load_bh(q + row * D + 32);
        __m512 acc[4];
        for (int t = 0; t < 4; ++t)
          acc[t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q0, k0[t]), q1, k1[t]);
        float sums[4];
        _mm_storeu_ps(sums, sum_lanes4(acc[0], acc[1], acc[2], acc[3]));
        for (int64_t t = 0; t < keys; ++t) out[row * stride + j - first + t] = sums[t];
      }
    }
  }
}

// Output dim of element e of the four accumulators: unpacking two keys' rows word by word works
// within 128-bit lanes, so accumulator a lane L holds dims 8L..8L+3 (a even) or 8L+4..8L+7 (a odd),
// plus 32 for the second half of the row.
inline int unpacked_dim(int a, int e) { return (a / 2) * 32 + (e / 4) * 8 + (a % 2) * 4 + e % 4; }

// probs[h * stride + j] (bf16, zero-padded to pairs) times V of keys [first, last) -> acc [H, D].
inline void values(const uint16_t* probs, const uint16_t* v, const int64_t* slots, int64_t first, int64_t last,
                   int64_t heads, int64_t kv_heads, int64_t stride, float* acc_out) {
  constexpr int D = 64;
  const int64_t group = heads / kv_heads;
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(probs);
  for (int64_t h = 0; h < kv_heads; ++h) {
    __m512 acc[kMaxGroup][4];
    for (int64_t g = 0; g < group; ++g)
      for (int a = 0; a < 4; ++a) acc[g][a] = _mm512_setzero_ps();
    for (int64_t j = first; j < last; j += 2) {
      if (j + kPrefetchKeys + 1 < last) {
        prefetch_row(v + (slots[j + kPrefetchKeys] * kv_heads + h) * D);
        prefetch_row(v + (slots[j + kPrefetchKeys + 1] * kv_heads + h) * D);
      }
      const uint16_t* ra = v + (slots[j] * kv_heads + h) * D;
      const uint16_t* rb = j + 1 < last ? v + (slots[j + 1] * kv_heads + h) * D : ra;  // its probability is 0
      const __m512i a0 = _mm512_loadu_si512(ra), a1 = _mm512_loadu_si512(ra + 32);
      const __m512i b0 = _mm512_loadu_si512(rb), b1 = _mm512_loadu_si512(rb + 32);
      const __m512bh vv[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, b0), (__m512bh)_mm512_unpackhi_epi16(a0, b0),
                              (__m512bh)_mm512_unpacklo_epi16(a1, b1), (__m512bh)_mm512_unpackhi_epi16(a1, b1)};
      for (int64_t g = 0; g < group; ++g) {
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(int(pairs[((h * group + g) * stride + j - first) / 2]));
        for (int a = 0; a < 4; ++a) acc[g][a] = _mm512_dpbf16_ps(acc[g][a], vv[a], pv);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* dst = acc_out + (h * group + g) * D;
      for (int a = 0; a < 4; ++a) {
        float lanes[16];
        _mm512_storeu_ps(lanes, acc[g][a]);
        for (int e = 0; e < 16; ++e) dst[unpacked_dim(a, e)] = lanes[e];
      }
    }
  }
}

}  // namespace aaflow_decode_bf16
#endif
