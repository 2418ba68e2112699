// The decoder's elementwise steps in bf16, each fused into one pass over its rows: RMSNorm (with
// the residual add before it), RoPE on the q and k heads, and SiLU(gate) * up.
//
// torch runs each of these as several ops, every one a pass over memory with bf16 -> fp32 -> bf16
// conversions and a Python call: on a 2,500-token prefill of SmolLM2 (2 cores, Xeon with AMX) they
// took ~290 of ~1,000 ms, and ~1 ms of a one-sequence decode step's ~18. Each kernel rounds where
// torch's sequence of ops rounds, so results match torch's bit for bit except where torch's fp32
// sum of a row's squares is not the correctly rounded one (this kernel's is; see `norm_row`) or exp
// is approximated differently (SiLU): there a value may differ by one bf16 ulp. Rows are
// independent, so a row's result never depends on its batch.
//
// Plain C++ loops, vectorized by the compiler (-O3 -march=native, `omp simd`); rows split across
// torch's intra-op threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "bf16.h"

namespace {

using namespace aaflow_bf16;

constexpr int64_t kGrainElements = 1 << 15;  // elements per task: small batches stay on one thread

inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

// exp(x) in the manner of Cephes' expf (within ~1 fp32 ulp): x = n ln2 + r, exp(r) by a degree-6
// polynomial, times 2^n built in the exponent bits; inf above 88.72 (as expf overflows), and below
// -87.3 a value under 2^-125 (as good as 0 where it meets 1 + exp). Branch-free, so vectorized.
inline float exp_approx(float x) {
  const float c = std::min(std::max(x, -87.3f), 88.72f);
  const float n = std::nearbyint(c * 1.44269504088896341f);  // -126 .. 128
  const float r = (c - n * 0.693359375f) + n * 2.12194440e-4f;  // ln2 split in two for precision
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (int32_t(n) + 126) << 23;  // 2^(n-1): n = 128 stays finite here
  float half_scale;
  std::memcpy(&half_scale, &bits, sizeof half_scale);
  return x > 88.72f ? INFINITY : y * half_scale * 2.0f;
}

const uint16_t* in_ptr(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
uint16_t* out_ptr(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1,
              name, " must be bf16 [T, width] with contiguous rows");
}

void check_weight(const torch::Tensor& weight, int64_t H) {
  TORCH_CHECK(weight.numel() == H && weight.is_contiguous() && weight.scalar_type() == torch::kBFloat16,
              "weight must be bf16 [H]");
}

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(width, 1)); }

// y = w * bf16(x * rsqrt(mean(x^2) + eps)), as `w * F.rms_norm(x.float()).to(bf16)` rounds.
//
// The sum of squares is the correctly rounded fp32 sum, whatever the vector width: each square of
// a bf16 has at most 16 significant bits (exact in fp32), and their sum in double is exact (or,
// where the squares span more than ~2^27, within H * 2^-53 of it, far below an fp32 ulp), then
// rounded once. From there the fp32 steps are torch's: sum / H, + eps, 1 / sqrt. An fp32 sum in
// `omp simd` order (as this was) sums in lanes of the vector width the compiler picks (8 on AVX2,
// 16 with AVX512), so it rounded differently from torch's cascaded sum on some rows, and on AVX2
// one such row decided a greedy answer: in the prefill of SmolLM2's chat prompt "What is the
// capital of France?", mean(x^2) of one of 2,184 rows (layer 6) came out one fp32 ulp from torch's
// (which was the correctly rounded one), 5 of its elements of x * rstd lay that close to bf16
// rounding midpoints and rounded the other way, and through the layers above the last position's
// bf16 logits of "L" and "The" came out equal (25.25; transformers': 25.125 and 25.25), so greedy
// decoding took "L" (the lower id) and answered "L'Étoile, la Marseillaise, ..." instead of "The
// capital of France is Paris." (fp32's margin between the two is 0.1, under bf16's step of 0.125
// there: a near tie that any one-ulp difference may flip). Cost, measured on AVX2 (one thread,
// 2,500 rows of 576): 0.93-0.98 -> 1.15-1.23 ms a call (torch's ops: 2.7 ms); one row 2.2 -> 2.3 us.
void norm_row(const uint16_t* x, const uint16_t* w, float eps, int64_t H, uint16_t* y) {
  double squares = 0.0;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < H; ++i) {
    const float v = bf16_to_float(x[i]);
    squares += double(v * v);  // v * v is exact in fp32
  }
  const float rstd = 1.0f / std::sqrt(float(squares) / float(H) + eps);
#pragma omp simd
  for (int64_t i = 0; i < H; ++i)
    y[i] = float_to_bf16(bf16_to_float(w[i]) * round_bf16(bf16_to_float(x[i]) * rstd));
}

// x: [T, H] bf16, weight: [H] bf16 -> [T, H] bf16
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t T = x.size(0), H = x.size(1);
  check_weight(weight, H);
  auto y = torch::empty({T, H}, x.options());
  const uint16_t *xp = in_ptr(x), *wp = in_ptr(weight);
  uint16_t* yp = out_ptr(y);
  const int64_t stride = x.stride(0);
  at::parallel_for(0, T, grain_rows(H), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) norm_row(xp + t * stride, wp, float(eps), H, yp + t * H);
  });
  return y;
}

// h, delta: [T, H] bf16 -> (h + delta, rms_norm(h + delta)), the sum rounded to bf16 first, as torch adds.
std::vector<torch::Tensor> add_rms_norm(const torch::Tensor& h, const torch::Tensor& delta,
                                        const torch::Tensor& weight, double eps) {
  check_rows(h, "h");
  check_rows(delta, "delta");
  TORCH_CHECK(h.sizes() == delta.sizes(), "h and delta must have one shape");
  const int64_t T = h.size(0), H = h.size(1);
  check_weight(weight, H);
  auto sum = torch::empty({T, H}, h.options());
  auto y = torch::empty({T, H}, h.options());
  const uint16_t *hp = in_ptr(h), *dp = in_ptr(delta), *wp = in_ptr(weight);
  uint16_t *sp = out_ptr(sum), *yp = out_ptr(y);
  const int64_t hs = h.stride(0), ds = delta.stride(0);
  at::parallel_for(0, T, grain_rows(H), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const uint16_t *hr = hp + t * hs, *dr = dp + t * ds;
      uint16_t* sr = sp + t * H;
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) sr[i] = float_to_bf16(bf16_to_float(hr[i]) + bf16_to_float(dr[i]));
      norm_row(sr, wp, float(eps), H, yp + t * H);
    }
  });
  return {sum, y};
}

// qk: [T, R, D] bf16 (rows of R heads; each head contiguous, heads D apart), cos, sin: [T, D] bf16
// -> [T, R, D]: x * cos + rotate_half(x) * sin, each product and the sum rounded to bf16 as torch does.
torch::Tensor rotate(const torch::Tensor& qk, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(qk.dim() == 3 && qk.scalar_type() == torch::kBFloat16 && qk.stride(2) == 1 &&
                  qk.stride(1) == qk.size(2), "qk must be bf16 [T, R, D] with contiguous heads");
  const int64_t T = qk.size(0), R = qk.size(1), D = qk.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "head dim must be even");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == D && t->is_contiguous() &&
                    t->scalar_type() == torch::kBFloat16, "cos and sin must be contiguous bf16 [T, D]");
  auto y = torch::empty({T, R, D}, qk.options());
  const uint16_t *xp = in_ptr(qk), *cp = in_ptr(cos), *sp = in_ptr(sin);
  uint16_t* yp = out_ptr(y);
  const int64_t stride = qk.stride(0);
  at::parallel_for(0, T, grain_rows(R * D), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const uint16_t *c = cp + t * D, *s = sp + t * D;
      for (int64_t r = 0; r < R; ++r) {
        const uint16_t* x = xp + t * stride + r * D;
        uint16_t* out = yp + (t * R + r) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = bf16_to_float(x[i]), b = bf16_to_float(x[i + half]);
          out[i] = float_to_bf16(round_bf16(a * bf16_to_float(c[i])) + round_bf16(-b * bf16_to_float(s[i])));
          out[i + half] = float_to_bf16(round_bf16(b * bf16_to_float(c[i + half])) +
                                        round_bf16(a * bf16_to_float(s[i + half])));
        }
      }
    }
  });
  return y;
}

// gate_up: [T, 2I] bf16 (gate, then up) -> [T, I] bf16: bf16(silu(gate)) * up, rounded as torch rounds.
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  auto y = torch::empty({T, I}, gate_up.options());
  const uint16_t* gp = in_ptr(gate_up);
  uint16_t* yp = out_ptr(y);
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, T, grain_rows(2 * I), [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const uint16_t *g = gp + t * stride, *u = g + I;
      uint16_t* out = yp + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) {
        const float x = bf16_to_float(g[i]);
        out[i] = float_to_bf16(round_bf16(x / (1.0f + exp_approx(-x))) * bf16_to_float(u[i]));
      }
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "w * rms_norm(x) for bf16 rows");
  m.def("add_rms_norm", &add_rms_norm, "(h + delta, rms_norm(h + delta)) for bf16 rows");
  m.def("rotate", &rotate, "RoPE of bf16 heads by cos and sin");
  m.def("silu_mul", &silu_mul, "silu(gate) * up for bf16 rows holding gate then up");
}
