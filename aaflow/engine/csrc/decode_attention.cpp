// Decode attention over the paged KV pool, in bf16 or fp32: each query row attends over its own
// context, read in place by slot, in one pass. Every context is split into chunks of 256 keys at
// fixed positions; a chunk is a work item on torch's intra-op threads, which attends its keys for
// every head (scores in fp32, softmax with its own max; in bf16 the probabilities rounded to bf16 for
// the product with V, as flash rounds them) and leaves (max, sum, fp32 output) per head. A second
// parallel pass merges each row's chunks in chunk order, and, given one, a part over other keys (the
// shared prefix of cascade attention: its output and log-sum-exp), so a row's result does not depend
// on the batch it runs in or on how the threads share the work. Returns each row's log-sum-exp too.
// The inner loops: AVX512-BF16 for bf16 (decode_bf16.h), AVX2 and FMA for fp32 (decode_fp32.h),
// plain C++ otherwise.
//
// One pass instead of the former two (scores, torch's softmax, values) took a decode step (SmolLM2,
// 30 layers, Xeon with AMX, 2 threads) of 64 sequences x 40 keys from 38.6 to 36.4 ms, 32 x 1k from
// 73.5 to 70.4 ms, 8 x 4k from 65.2 to 63.3 ms; as cascade's rest and merge, 64 x (2,000 shared +
// 100 own) from 76 to 65 ms.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16.h"
#include "decode_bf16.h"
#include "decode_fp32.h"

namespace {

using namespace aaflow_bf16;

constexpr int64_t kChunk = 256;  // keys per work item

// Elements of the pool: bf16 (as uint16_t) or fp32.
inline float to_float(uint16_t x) { return bf16_to_float(x); }
inline float to_float(float x) { return x; }
inline void store(float x, uint16_t* dst) { *dst = float_to_bf16(x); }
inline void store(float x, float* dst) { *dst = x; }

struct WorkItems {  // (row, first key) of each chunk of each context
  std::vector<int64_t> row, first;
  std::vector<int64_t> begin;  // [N + 1]: row n's items are [begin[n], begin[n + 1])
};

// The order the items run in: items over the same keys (rows whose contexts begin with the same
// cached blocks: readers of one document) one after the other, so that the chunk's K and V (256
// keys: 192 kB at 3 kv heads of 64 bf16) come from cache for all but the first of them instead of
// from memory for each. Same keys: the same first and last slot and length (a guess that can only
// cost cache hits, never change a result: every item computes alone, and each row's items merge in
// chunk order whatever order they ran in). Otherwise in row order.
std::vector<int64_t> run_order(const WorkItems& items, const int64_t* slots, const int64_t* lengths, int64_t ctx) {
  const int64_t n = int64_t(items.row.size());
  std::vector<int64_t> order(n);
  std::vector<std::array<int64_t, 3>> key(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t* s = slots + items.row[i] * ctx;
    const int64_t first = items.first[i], last = std::min(first + kChunk, lengths[items.row[i]]);
    key[i] = {s[first], s[last - 1], last - first};
    order[i] = i;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return key[a] < key[b]; });
  return order;
}

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

// Softmax of one head's scores (n of them) with its own max into `probs` (bf16 ones zero-padded to
// an even count); the max and the fp32 sum returned.
template <typename P>
void softmax_row(const float* scores, int64_t n, P* probs, float* max_out, float* sum_out) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<P, uint16_t>) return aaflow_decode_bf16::softmax_row(scores, n, probs, max_out, sum_out);
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<P, float>) return aaflow_decode_fp32::softmax_row(scores, n, probs, max_out, sum_out);
#endif
  float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, scores[j]);
  for (int64_t j = 0; j < n; ++j) {
    const float p = std::exp(scores[j] - m);
    sum += p;
    store(p, probs + j);
  }
  if (n % 2) probs[n] = 0;
  *max_out = m;
  *sum_out = sum;
}

// Any head dim, plain C++: scores, softmax, and the probabilities' sum of V for one chunk.
template <int D, typename T>
void attend_chunk(const T* q, const T* k, const T* v, const int64_t* slots, int64_t first, int64_t last,
                  int64_t heads, int64_t kv_heads, float* scores, T* probs, ChunkOut out) {
  const int64_t group = heads / kv_heads, n = last - first;
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t kvh = h / group;
    for (int64_t j = 0; j < n; ++j) {
      const T* kr = k + (slots[first + j] * kv_heads + kvh) * D;
      float s = 0.f;
      for (int d = 0; d < D; ++d) s += to_float(q[h * D + d]) * to_float(kr[d]);
      scores[j] = s;
    }
    softmax_row(scores, n, probs, out.max + h, out.sum + h);
    float* acc = out.acc + h * D;
    std::fill(acc, acc + D, 0.f);
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = v + (slots[first + j] * kv_heads + kvh) * D;
      const float p = to_float(probs[j]);
      for (int d = 0; d < D; ++d) acc[d] += p * to_float(vr[d]);
    }
  }
}

template <int D, typename T>
void attend_item(const T* q, const T* k, const T* v, const int64_t* slots, int64_t first, int64_t last,
                 int64_t heads, int64_t kv_heads, std::vector<float>& scores, std::vector<T>& probs, ChunkOut out) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t> && D == 64) {
    if (heads / kv_heads <= aaflow_decode_bf16::kMaxGroup) {
      aaflow_decode_bf16::scores(q, k, slots, first, last, heads, kv_heads, kChunk, scores.data());
      for (int64_t h = 0; h < heads; ++h)
        softmax_row(scores.data() + h * kChunk, last - first, probs.data() + h * kChunk, out.max + h, out.sum + h);
      aaflow_decode_bf16::values(probs.data(), v, slots, first, last, heads, kv_heads, kChunk, out.acc);
      return;
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float> && D % 64 == 0) {
    aaflow_decode_fp32::scores<D>(q, k, slots, first, last, heads, kv_heads, kChunk, scores.data());
    for (int64_t h = 0; h < heads; ++h)
      softmax_row(scores.data() + h * kChunk, last - first, probs.data() + h * kChunk, out.max + h, out.sum + h);
    aaflow_decode_fp32::values<D>(probs.data(), v, slots, first, last, heads, kv_heads, kChunk, out.acc);
    return;
  }
#endif
  attend_chunk<D, T>(q, k, v, slots, first, last, heads, kv_heads, scores.data(), probs.data(), out);
}

void check_inputs(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& slots, const torch::Tensor& lengths) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kFloat,
              "decode attention kernel: q must be bf16 or fp32, not ", q.scalar_type());
  for (const auto* t : {&q, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == q.scalar_type() && t->is_contiguous(),
                "decode attention kernel: q, K and V must be contiguous tensors of one dtype (bf16 or fp32)");
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

template <int D, typename T>
std::vector<torch::Tensor> attend(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                  const torch::Tensor& slots, const torch::Tensor& lengths,
                                  const c10::optional<torch::Tensor>& pre_out, const c10::optional<torch::Tensor>& pre_lse) {
  const int64_t rows = q.size(0), heads = q.size(1), kv_heads = k_cache.size(1), ctx = slots.size(1);
  const auto* qp = reinterpret_cast<const T*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const T*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const T*>(v_cache.data_ptr());
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  const WorkItems items = chunk_contexts(lp, rows);
  const int64_t n_items = int64_t(items.row.size());
  const std::vector<int64_t> order = run_order(items, sp, lp, ctx);
  std::vector<float> stats(n_items * heads * 2), acc(n_items * heads * D);  // [items, 2, H], [items, H, D]
  at::parallel_for(0, n_items, 1, [&](int64_t lo, int64_t hi) {  // contiguous runs of `order` per thread
    std::vector<float> scores(heads * kChunk);
    std::vector<T> probs(heads * kChunk + 2);
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t i = order[p], n = items.row[i], first = items.first[i];
      const ChunkOut out{stats.data() + i * heads * 2, stats.data() + i * heads * 2 + heads, acc.data() + i * heads * D};
      attend_item<D, T>(qp + n * heads * D, kp, vp, sp + n * ctx, first, std::min(first + kChunk, lp[n]), heads,
                     kv_heads, scores, probs, out);
    }
  });
  auto out = torch::empty({rows, heads, D}, q.options());
  auto lse = torch::empty({rows, heads}, q.options().dtype(torch::kFloat));
  auto* op = reinterpret_cast<T*>(out.data_ptr());
  float* lsep = lse.data_ptr<float>();
  const T* pre_op = pre_out ? reinterpret_cast<const T*>(pre_out->data_ptr()) : nullptr;
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
        for (int d = 0; d < D; ++d) o[d] += w * to_float(pre_op[rh * D + d]);
      }
      for (int d = 0; d < D; ++d) store(o[d] / total, op + rh * D + d);
      lsep[rh] = top + std::log(total);
    }
  });
  return {out, lse};
}

template <typename T>
std::vector<torch::Tensor> attend_dim(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                      const torch::Tensor& slots, const torch::Tensor& lengths,
                                      const c10::optional<torch::Tensor>& pre_out,
                                      const c10::optional<torch::Tensor>& pre_lse) {
  switch (k_cache.size(2)) {
    case 64: return attend<64, T>(q, k_cache, v_cache, slots, lengths, pre_out, pre_lse);
    case 128: return attend<128, T>(q, k_cache, v_cache, slots, lengths, pre_out, pre_lse);
    default: TORCH_CHECK(false, "decode attention kernel: head dim ", k_cache.size(2), " is not built (64, 128)");
  }
}

}  // namespace

// q: [N, H, D] bf16 or fp32, already scaled; k_cache, v_cache: [slots, Hkv, D] of q's dtype; slots:
// [N, ctx] int64 (row n's first lengths[n] entries are its keys); optionally pre_out [N, H, D] of q's
// dtype and pre_lse [N, H] fp32, attention over other keys to merge in -> (out [N, H, D] of q's
// dtype, lse [N, H] fp32)
std::vector<torch::Tensor> decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                            torch::Tensor slots, torch::Tensor lengths,
                                            c10::optional<torch::Tensor> pre_out, c10::optional<torch::Tensor> pre_lse) {
  check_inputs(q, k_cache, v_cache, slots, lengths);
  TORCH_CHECK(pre_out.has_value() == pre_lse.has_value(), "decode attention kernel: give pre_out and pre_lse together");
  if (pre_out) {
    TORCH_CHECK(pre_out->scalar_type() == q.scalar_type() && pre_out->is_contiguous() && pre_out->sizes() == q.sizes(),
                "decode attention kernel: pre_out must be a contiguous tensor of q's dtype and shape");
    TORCH_CHECK(pre_lse->scalar_type() == torch::kFloat && pre_lse->is_contiguous() && pre_lse->dim() == 2 &&
                    pre_lse->size(0) == q.size(0) && pre_lse->size(1) == q.size(1),
                "decode attention kernel: pre_lse must be a contiguous fp32 [N, H] tensor");
  }
  if (q.scalar_type() == torch::kFloat) return attend_dim<float>(q, k_cache, v_cache, slots, lengths, pre_out, pre_lse);
  return attend_dim<uint16_t>(q, k_cache, v_cache, slots, lengths, pre_out, pre_lse);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "bf16 or fp32 attention of query rows over paged K/V, in one pass",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("lengths"),
        py::arg("pre_out") = py::none(), py::arg("pre_lse") = py::none());
}
