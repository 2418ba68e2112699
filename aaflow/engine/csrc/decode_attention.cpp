// Decode attention over the paged KV pool in bf16: each query row attends over its own context,
// read in place by slot, in one pass. Every context is split into chunks of 256 keys at fixed
// positions; a chunk is a work item on torch's intra-op threads, which attends its keys for every
// head (scores in fp32, softmax with its own max, probabilities rounded to bf16 for the product
// with V, as flash rounds them) and leaves (max, sum, fp32 output) per head. A second parallel pass
// merges each row's chunks in chunk order, and, given one, a part over other keys (the shared
// prefix of cascade attention: its output and log-sum-exp), so a row's result does not depend on
// the batch it runs in or on how the threads share the work. Returns each row's log-sum-exp too.
//
// One pass instead of the former two (scores, torch's softmax, values) took a decode step (SmolLM2,
// 30 layers, Xeon with AMX, 2 threads) of 64 sequences x 40 keys from 38.6 to 36.4 ms, 32 x 1k from
// 73.5 to 70.4 ms, 8 x 4k from 65.2 to 63.3 ms; as cascade's rest and merge, 64 x (2,000 shared +
// 100 own) from 76 to 65 ms.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "bf16.h"
#include "simd_exp.h"

namespace {

using namespace aaflow_bf16;

constexpr int64_t kChunk = 256;  // keys per work item
constexpr float kLog2e = 1.4426950408889634f;

struct WorkItems {  // (row, first key) of each chunk of each context
  std::vector<int64_t> row, first;
  std::vector<int64_t> begin;  // [N + 1]: row n's items are [begin[n], begin[n + 1])
};

WorkItems chunk_contexts(const int64_t* lengths, int64_t rows) {
  WorkItems items;
  items.begin.push_back(0);
  for (int64_t n = 0; n < rows; ++n) {
    for (int64_t j = 0; j < lengths[n]; j += kChunk) {
      items.row.push_back(n);
      items.first.push_back(j);
    }
    items.begin.push_back(int64_t(items.row.size()));
  }
  return items;
}

struct ChunkOut {  // one work item's result for each head: softmax max and sum, unnormalized output
  float* max;      // [H]
  float* sum;      // [H]
  float* acc;      // [H, D]
};

// Softmax of one head's scores (n of them) with its own max: probabilities rounded to bf16 into
// `probs` (zero-padded to an even count), the max and the fp32 sum returned.
void softmax_row(const float* scores, int64_t n, uint16_t* probs, float* max_out, float* sum_out) {
  float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
#if defined(__AVX512BF16__)
  __m512 vmax = _mm512_set1_ps(m);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = aaflow_simd::first_lanes(n - j);
    vmax = _mm512_mask_max_ps(vmax, lanes, vmax, _mm512_maskz_loadu_ps(lanes, scores + j));
  }
  m = _mm512_reduce_max_ps(vmax);
  const __m512 shift = _mm512_set1_ps(-m * kLog2e), c = _mm512_set1_ps(kLog2e);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = aaflow_simd::first_lanes(n - j);
    __m512 p = aaflow_simd::exp2_neg(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, scores + j), c, shift));
    p = _mm512_maskz_mov_ps(lanes, p);
    vsum = _mm512_add_ps(vsum, p);
    _mm256_mask_storeu_epi16(probs + j, lanes, (__m256i)_mm512_cvtneps_pbh(p));
  }
  sum = _mm512_reduce_add_ps(vsum);
#else
  for (int64_t j = 0; j < n; ++j) m = std::max(m, scores[j]);
  for (int64_t j = 0; j < n; ++j) {
    const float p = std::exp(scores[j] - m);
    sum += p;
    probs[j] = float_to_bf16(p);
  }
#endif
  if (n % 2) probs[n] = 0;
  *max_out = m;
  *sum_out = sum;
}

// Any head dim, plain C++: scores, softmax, and the probabilities' sum of V for one chunk.
template <int D>
void attend_chunk(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* slots, int64_t first,
                  int64_t last, int64_t heads, int64_t kv_heads, float* scores, uint16_t* probs, ChunkOut out) {
  const int64_t group = heads / kv_heads, n = last - first;
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t kvh = h / group;
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* kr = k + (slots[first + j] * kv_heads + kvh) * D;
      float s = 0.f;
      for (int d = 0; d < D; ++d) s += bf16_to_float(q[h * D + d]) * bf16_to_float(kr[d]);
      scores[j] = s;
    }
    softmax_row(scores, n, probs, out.max + h, out.sum + h);
    float* acc = out.acc + h * D;
    std::fill(acc, acc + D, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      const uint16_t* vr = v + (slots[first + j] * kv_heads + kvh) * D;
      const float p = bf16_to_float(probs[j]);
      for (int d = 0; d < D; ++d) acc[d] += p * bf16_to_float(vr[d]);
    }
  }
}

#if defined(__AVX512BF16__)
// D = 64 with AVX512-BF16: bf16 pairs straight into vdpbf16ps, one kv head at a time so that its
// query rows (scores) or output rows (values) stay in registers; the rows of the keys ahead are
// prefetched (a context's slots jump between pages, which the hardware does not follow).
inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }

inline void prefetch_row(const uint16_t* p) {  // one kv head's 64 bf16: two cache lines
  _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(p + 32), _MM_HINT_T0);
}

constexpr int64_t kPrefetchKeys = 16;
constexpr int64_t kMaxGroup = 8;

// Scores of keys [first, last) for every head: scores[h * kChunk + j], fp32.
void scores_bf16(const uint16_t* q, const uint16_t* k, const int64_t* slots, int64_t first, int64_t last,
                 int64_t heads, int64_t kv_heads, float* scores) {
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
        for (int64_t t = 0; t < keys; ++t) scores[row * kChunk + j - first + t] = sums[t];
      }
    }
  }
}

// Output dim of element e of the four accumulators: unpacking two keys' rows word by word works
// within 128-bit lanes, so accumulator a lane L holds dims 8L..8L+3 (a even) or 8L+4..8L+7 (a odd),
// plus 32 for the second half of the row.
inline int unpacked_dim(int a, int e) { return (a / 2) * 32 + (e / 4) * 8 + (a % 2) * 4 + e % 4; }

// probs[h * kChunk + j] (bf16, zero-padded to pairs) times V of keys [first, last) -> acc [H, D].
void values_bf16(const uint16_t* probs, const uint16_t* v, const int64_t* slots, int64_t first, int64_t last,
                 int64_t heads, int64_t kv_heads, float* acc_out) {
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
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(int(pairs[((h * group + g) * kChunk + j - first) / 2]));
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
#endif

template <int D>
void attend_item(const uint16_t* q, const uint16_t* k, const uint16_t* v, const int64_t* slots, int64_t first,
                 int64_t last, int64_t heads, int64_t kv_heads, std::vector<float>& scores,
                 std::vector<uint16_t>& probs, ChunkOut out) {
#if defined(__AVX512BF16__)
  if (D == 64 && heads / kv_heads <= kMaxGroup) {
    scores_bf16(q, k, slots, first, last, heads, kv_heads, scores.data());
    for (int64_t h = 0; h < heads; ++h)
      softmax_row(scores.data() + h * kChunk, last - first, probs.data() + h * kChunk, out.max + h, out.sum + h);
    values_bf16(probs.data(), v, slots, first, last, heads, kv_heads, out.acc);
    return;
  }
#endif
  attend_chunk<D>(q, k, v, slots, first, last, heads, kv_heads, scores.data(), probs.data(), out);
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& slots, const torch::Tensor& lengths) {
  for (const auto* t : {&q, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->is_contiguous(),
                "decode attention kernel: q, K and V must be contiguous bf16 tensors");
  TORCH_CHECK(k_cache.dim() == 3 && q.dim() == 3 && q.size(1) % k_cache.size(1) == 0 &&
                  k_cache.sizes() == v_cache.sizes() && q.size(2) == k_cache.size(2),
              "decode attention kernel: q [N, H, D], K and V [slots, Hkv, D] with H a multiple of Hkv");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.dim() == 2 && slots.is_contiguous() &&
                  slots.size(0) == q.size(0),
              "decode attention kernel: slots must be a contiguous int64 [N, ctx] tensor");
  TORCH_CHECK(lengths.scalar_type() == torch::kLong && lengths.numel() == q.size(0) && lengths.is_contiguous(),
              "decode attention kernel: one int64 length per query row");
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t n = 0; n < lengths.numel(); ++n)
    TORCH_CHECK(lp[n] >= 1 && lp[n] <= slots.size(1), "decode attention kernel: row ", n, " has length ", lp[n],
                ", outside [1, ", slots.size(1), "]");
}

template <int D>
std::vector<torch::Tensor> attend(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                  const torch::Tensor& slots, const torch::Tensor& lengths,
                                  const c10::optional<torch::Tensor>& pre_out, const c10::optional<torch::Tensor>& pre_lse) {
  const int64_t rows = q.size(0), heads = q.size(1), kv_heads = k_cache.size(1), ctx = slots.size(1);
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const WorkItems items = chunk_contexts(lp, rows);
  const int64_t n_items = int64_t(items.row.size());
  std::vector<float> stats(n_items * heads * 2), acc(n_items * heads * D);  // [items, 2, H], [items, H, D]
  at::parallel_for(0, n_items, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> scores(heads * kChunk);
    std::vector<uint16_t> probs(heads * kChunk + 2);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t n = items.row[i], first = items.first[i];
      const ChunkOut out{stats.data() + i * heads * 2, stats.data() + i * heads * 2 + heads, acc.data() + i * heads * D};
      attend_item<D>(qp + n * heads * D, kp, vp, sp + n * ctx, first, std::min(first + kChunk, lp[n]), heads,
                     kv_heads, scores, probs, out);
    }
  });
  auto out = torch::empty({rows, heads, D}, q.options());
  auto lse = torch::empty({rows, heads}, q.options().dtype(torch::kFloat));
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  float* lsep = lse.data_ptr<float>();
  const uint16_t* pre_op = pre_out ? reinterpret_cast<const uint16_t*>(pre_out->data_ptr()) : nullptr;
  const float* pre_lp = pre_lse ? pre_lse->data_ptr<float>() : nullptr;
  at::parallel_for(0, rows * heads, 16, [&](int64_t lo, int64_t hi) {  // merge each (row, head)'s chunks in order
    float o[D];
    for (int64_t rh = lo; rh < hi; ++rh) {
      const int64_t n = rh / heads, h = rh % heads;
      float top = pre_lp ? pre_lp[rh] : -std::numeric_limits<float>::infinity();
      for (int64_t i = items.begin[n]; i < items.begin[n + 1]; ++i) top = std::max(top, stats[i * heads * 2 + h]);
      float total = 0.f;
      std::fill(o, o + D, 0.f);
      for (int64_t i = items.begin[n]; i < items.begin[n + 1]; ++i) {
        const float w = std::exp(stats[i * heads * 2 + h] - top);
        total += w * stats[i * heads * 2 + heads + h];
        const float* a = acc.data() + (i * heads + h) * D;
        for (int d = 0; d < D; ++d) o[d] += w * a[d];
      }
      if (pre_lp) {  // the other part's output is already normalized: its weight is exp(its lse)
        const float w = std::exp(pre_lp[rh] - top);
        total += w;
        for (int d = 0; d < D; ++d) o[d] += w * bf16_to_float(pre_op[rh * D + d]);
      }
      for (int d = 0; d < D; ++d) op[rh * D + d] = float_to_bf16(o[d] / total);
      lsep[rh] = top + std::log(total);
    }
  });
  return {out, lse};
}

}  // namespace

// q: [N, H, D] bf16, already scaled; k_cache, v_cache: [slots, Hkv, D] bf16; slots: [N, ctx] int64
// (row n's first lengths[n] entries are its keys); optionally pre_out [N, H, D] bf16 and pre_lse
// [N, H] fp32, attention over other keys to merge in -> (out [N, H, D] bf16, lse [N, H] fp32)
std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                            torch::Tensor slots, torch::Tensor lengths,
                                            c10::optional<torch::Tensor> pre_out, c10::optional<torch::Tensor> pre_lse) {
  check_inputs(q, k_cache, v_cache, slots, lengths);
  TORCH_CHECK(pre_out.has_value() == pre_lse.has_value(), "decode attention kernel: give pre_out and pre_lse together");
  if (pre_out) {
    TORCH_CHECK(pre_out->scalar_type() == torch::kBFloat16 && pre_out->is_contiguous() && pre_out->sizes() == q.sizes(),
                "decode attention kernel: pre_out must be a contiguous bf16 tensor shaped like q");
    TORCH_CHECK(pre_lse->scalar_type() == torch::kFloat && pre_lse->is_contiguous() && pre_lse->dim() == 2 &&
                    pre_lse->size(0) == q.size(0) && pre_lse->size(1) == q.size(1),
                "decode attention kernel: pre_lse must be a contiguous fp32 [N, H] tensor");
  }
  switch (k_cache.size(2)) {
    case 64: return attend<64>(q, k_cache, v_cache, slots, lengths, pre_out, pre_lse);
    case 128: return attend<128>(q, k_cache, v_cache, slots, lengths, pre_out, pre_lse);
    default: TORCH_CHECK(false, "decode attention kernel: head dim ", k_cache.size(2), " is not built (64, 128)");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "bf16 attention of query rows over paged K/V, in one pass",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("lengths"),
        py::arg("pre_out") = py::none(), py::arg("pre_lse") = py::none());
}
