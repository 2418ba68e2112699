// y = x @ W.T (+ bias) for a few rows of x in bf16 (decode steps, small prefill chunks) on Intel
// AMX tiles, streaming W once from a tile-ordered copy.
//
// With few rows a product is bound by reading the weights, not by the dot products, and oneDNN's
// bf16 GEMM read SmolLM2's at 13-20 GB/s here (Xeon with AMX, 2 threads: its 121 products 11.8 ms
// at 8 rows, 16.2 ms at 64). Here W is stored once more as AMX B tiles in the order they are read:
// per 16 outputs, its K/32 tiles of 16 rows (pairs of k) x 16 outputs x 2 (VNNI); a thread takes a
// band of 32 outputs at a time and streams its two runs of tiles, each tile multiplied with every
// 16-row tile of x (read in place, it stays in cache; a last partial tile is copied into zero-padded
// rows): 7.4 ms at 8 rows, 12.1 at 64. linear.py sends it up to AMX_MAX_ROWS rows (AMX_MAX_ROWS_LONG_K
// for long reductions, which oneDNN orders by row count; any number in deterministic mode); past ~200 rows
// oneDNN's blocking wins.
//
// Each output is one fp32 sum over k in the same order whatever the number of rows: a row's result
// does not depend on the others in x.
//
// Shapes: x [M, K] bf16 contiguous; packed [N / 16, K / 32, 16, 16, 2] bf16 (linear.py's `pack_for_amx`);
// bias [N] bf16 or empty; K % 32 == 0, N % 32 == 0. Returns y [M, N] bf16: fp32 sums (plus the
// bias) rounded once, to nearest even.
//
// Built with -mamx-tile -mamx-bf16 whatever the CPU; Python calls it only where the CPU has AMX.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "bf16.h"

namespace {

using aaflow_bf16::bf16_to_float;
using aaflow_bf16::float_to_bf16;
using aaflow_amx::configure_tiles;
using aaflow_amx::request_amx;

constexpr int64_t kTileBytes = 1024;  // a B tile: 16 rows x 64 bytes
constexpr int64_t kBandOutputs = 32;  // outputs a task computes: two B tiles side by side

// Two 16-row tiles of x (x1 null: one) times outputs [n0, n0 + 32): tiles 0-3 accumulate (row tile
// i, output tile j) as 2i + j, 4-5 hold x, 6-7 W.
void band_rows(const uint16_t* x0, const uint16_t* x1, int64_t K, const uint16_t* packed, int64_t n0,
               float* acc /* [32][32] */) {
  const int64_t k_tiles = K / 32;
  const char* w0 = reinterpret_cast<const char*>(packed) + (n0 / 16) * k_tiles * kTileBytes;
  const char* w1 = w0 + k_tiles * kTileBytes;
  const bool two_row_tiles = x1 != nullptr;
  const int64_t stride = K * 2;
  _tile_zero(0);
  _tile_zero(1);
  if (two_row_tiles) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    _tile_loadd(6, w0 + kt * kTileBytes, 64);
    _tile_loadd(7, w1 + kt * kTileBytes, 64);
    _tile_loadd(4, x0 + kt * 32, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two_row_tiles) {
      _tile_loadd(5, x1 + kt * 32, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, 32 * 4);
  _tile_stored(1, acc + 16, 32 * 4);
  if (two_row_tiles) {
    _tile_stored(2, acc + 16 * 32, 32 * 4);
    _tile_stored(3, acc + 16 * 32 + 16, 32 * 4);
  }
}

void check(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.is_contiguous(),
              "x must be bf16 [M, K], contiguous");
  TORCH_CHECK(packed.dim() == 5 && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 16 && packed.size(4) == 2,
              "packed must be pack_for_amx's bf16 [N / 16, K / 32, 16, 16, 2]");
  TORCH_CHECK(packed.size(1) * 32 == x.size(1), "x's K (", x.size(1), ") must match the packed weight's (",
              packed.size(1) * 32, ")");
  TORCH_CHECK(packed.size(0) % 2 == 0, "N must be a multiple of 32");
  TORCH_CHECK(x.size(0) >= 1, "x needs at least one row");
  TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == torch::kBFloat16 && bias.is_contiguous() &&
                                    bias.numel() == packed.size(0) * 16), "bias must be bf16 [N]");
}

torch::Tensor amx_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias) {
  check(x, packed, bias);
  TORCH_CHECK(request_amx(), "the kernel could not enable AMX (arch_prctl refused)");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * 16;
  const int64_t padded_rows = (M + 15) / 16 * 16, whole_rows = M / 16 * 16;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  std::vector<uint16_t> tail(padded_rows > whole_rows ? 16 * K : 0, 0);  // a last, partial row tile, zero past M
  if (!tail.empty()) std::memcpy(tail.data(), xp + whole_rows * K, (M - whole_rows) * K * sizeof(uint16_t));
  auto row_tile = [&](int64_t m) { return m < whole_rows ? xp + m * K : tail.data(); };  // x's rows m..m+15
  auto y = torch::empty({M, N}, x.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* bp = bias.numel() ? reinterpret_cast<const uint16_t*>(bias.data_ptr()) : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, N / kBandOutputs, 1, [&](int64_t lo, int64_t hi) {
    configure_tiles();
    alignas(64) float acc[32 * 32];
    for (int64_t band = lo; band < hi; ++band) {
      const int64_t n0 = band * kBandOutputs;
      for (int64_t m0 = 0; m0 < padded_rows; m0 += 32) {
        band_rows(row_tile(m0), padded_rows - m0 > 16 ? row_tile(m0 + 16) : nullptr, K, wp, n0, acc);
        for (int64_t r = 0; r < 32 && m0 + r < M; ++r) {
          uint16_t* out = yp + (m0 + r) * N + n0;
          for (int64_t c = 0; c < kBandOutputs; ++c)
            out[c] = float_to_bf16(acc[r * 32 + c] + (bp ? bf16_to_float(bp[n0 + c]) : 0.f));
        }
      }
    }
    _tile_release();
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("ready", &request_amx, "whether Linux granted this process AMX state");
  m.def("amx_linear", &amx_linear, "y [M, N] = x [M, K] @ W.T (+ bias), W as pack_for_amx's AMX tiles, bf16");
}
