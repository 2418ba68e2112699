// y = x @ W.T (+ bias) for one row of x in bf16 (a decode step of one sequence), streaming W once.
//
// oneDNN's bf16 GEMM read SmolLM2's weights at 16-18 GB/s for one row here (Xeon with AMX, 2
// threads), where a plain read of memory runs at 31 GB/s: it is built for many rows. Here each
// thread takes a contiguous band of W's rows and reads them in order, four rows at a time (four
// independent AVX512-BF16 dot-product chains, their lanes summed by one shuffle tree): 21 GB/s, the
// 121 products of a decode step 12.6 against 14.8 ms. With more rows oneDNN wins (the dot products
// become the bound), so the engine sends only single rows here.
//
// Shapes: x [1, K] bf16 contiguous; W [N, K] bf16 contiguous, K % 32 == 0; bias [N] bf16 or empty.
// Returns y [1, N] bf16: fp32 sums (plus the bias) rounded once, to nearest even (NaN: torch's 0x7fc0).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>

#include "bf16.h"

namespace {

using namespace aaflow_bf16;

constexpr int64_t kGrain = 64;  // output rows per task

inline float bias_at(const uint16_t* bias, int64_t n) { return bias ? bf16_to_float(bias[n]) : 0.f; }

#if defined(__AVX512BF16__)
void band(const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t K, int64_t lo, int64_t hi,
          uint16_t* y) {
  int64_t n = lo;
  for (; n + 4 <= hi; n += 4) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t k = 0; k < K; k += 32) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
      for (int r = 0; r < 4; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(w + (n + r) * K + k), xv);
    }
    float sums[4];
    _mm_storeu_ps(sums, sum_lanes4(acc[0], acc[1], acc[2], acc[3]));
    for (int r = 0; r < 4; ++r) y[n + r] = float_to_bf16(sums[r] + bias_at(bias, n + r));
  }
  for (; n < hi; ++n) {  // the band's last rows, one at a time (summed as in a group: same bits)
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32)
      acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w + n * K + k), (__m512bh)_mm512_loadu_si512(x + k));
    y[n] = float_to_bf16(sum_lanes(acc) + bias_at(bias, n));
  }
}
#else
void band(const uint16_t* x, const uint16_t* w, const uint16_t* bias, int64_t K, int64_t lo, int64_t hi,
          uint16_t* y) {
  for (int64_t n = lo; n < hi; ++n) {
    float acc = 0.f;
    for (int64_t k = 0; k < K; ++k) acc += bf16_to_float(w[n * K + k]) * bf16_to_float(x[k]);
    y[n] = float_to_bf16(acc + bias_at(bias, n));
  }
}
#endif

torch::Tensor one_row_linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && w.dim() == 2 && x.size(1) == w.size(1),
              "x [1, K] and W [N, K] expected");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16, "bf16 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "x and W must be contiguous");
  TORCH_CHECK(w.size(1) % 32 == 0, "K must be a multiple of 32");
  const bool has_bias = bias.numel() > 0;
  TORCH_CHECK(!has_bias || (bias.scalar_type() == torch::kBFloat16 && bias.numel() == w.size(0) &&
                            bias.is_contiguous()), "bias must be bf16 [N]");
  const int64_t K = x.size(1), N = w.size(0);
  auto y = torch::empty({1, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const auto* bp = has_bias ? reinterpret_cast<const uint16_t*>(bias.data_ptr()) : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, N, kGrain, [&](int64_t lo, int64_t hi) { band(xp, wp, bp, K, lo, hi, yp); });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("one_row_linear", &one_row_linear, "y [1, N] = x [1, K] @ W [N, K].T (+ bias), bf16");
  m.attr("vectorized") =
#if defined(__AVX512BF16__)
      true;
#else
      false;
#endif
}
