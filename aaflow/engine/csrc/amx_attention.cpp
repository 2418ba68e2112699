// Causal prefill attention for bf16 on Intel AMX tiles (flash style: scores never leave a block).
//
// out[t, h] = softmax_j(q[t, h] . k[j, h / G] * scale) v[j, h / G], over the keys j < t + offset + 1
// (and < S), G = H / Hkv query heads per kv head; head_dim 64. Also returns each row's log-sum-exp
// of its scaled scores, so that parts over disjoint keys can be merged.
//
// One task is 16 query rows of one head. Per block of up to 128 keys: the scores come from AMX
// (16 x 16 per tile, two 32-dim steps), the online softmax runs in AVX512 over fp32 (max, exp2,
// sum), the probabilities are rounded to bf16 (as flash rounds them) and multiplied with V on the
// tiles; the output accumulates in fp32 and is rescaled per block. K and V are first repacked into
// the tiles' pair-interleaved (VNNI) layout, once per kv head, zero-padded to whole blocks. Blocks
// past a row's last visible key are skipped, so causal work stops at the diagonal.
//
// Built with -mamx-tile -mamx-bf16 whatever the CPU; Python calls it only where the CPU has AMX.

#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "amx_tiles.h"
#include "simd_exp.h"

namespace {

using aaflow_simd::exp2_neg;
using aaflow_simd::first_lanes;
using aaflow_amx::configure_tiles;
using aaflow_amx::request_amx;

constexpr int kDim = 64;        // head_dim: two 32-wide bf16 steps of a tile
constexpr int kRows = 16;       // query rows of a task (a tile's rows)
constexpr int kBlockKeys = 128; // keys per softmax block
constexpr int kPackKeys = 32;   // V is packed in groups of 32 keys (a P tile's width)

// K of one kv head as QK^T's B tiles: per 16 keys, two tiles (dims 0-31, 32-63), each 16 rows of
// dim pairs x 16 keys: packed[g][half][r][n] = dword (dims 2r, 2r+1 of the half) of key 16g + n.
// A tile row is one gather (dword r of 16 keys), zero past the last key. Gathers, and one permute per
// V row, instead of element loops took a call over 2,000 keys (3 kv heads, 2 threads) with 3 / 24 /
// 192 query rows from 185 / 240 / 448 to 106 / 165 / 387 us (scatters down K's columns: 135 / 192 / 400).
void pack_keys(const uint16_t* k, int64_t row_stride, int64_t keys, int64_t padded, uint32_t* packed) {
  const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32(int(row_stride / 2)));  // keys apart, in dwords
  for (int64_t g = 0; g < padded / 16; ++g) {
    const __mmask16 present = first_lanes(keys - g * 16);
    for (int half = 0; half < 2; ++half) {
      uint32_t* tile = packed + (g * 2 + half) * 256;
      const auto* base = reinterpret_cast<const int*>(k + g * 16 * row_stride + half * 32);
      for (int r = 0; r < 16; ++r)
        _mm512_storeu_si512(tile + r * 16, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), present, rows, base + r, 4));
    }
  }
}

// V of one kv head as PV's B tiles: per 32 keys, four tiles (dims 16c..16c+15), each 16 rows of key
// pairs x 16 dims x 2: packed[j][c][r][n][e] = v[key 32j + 2r + e][16c + n]. A row is two keys' 16
// dims side by side, interleaved by one permute.
void pack_values(const uint16_t* v, int64_t row_stride, int64_t keys, int64_t padded, uint16_t* packed) {
  alignas(64) uint16_t order[32];
  for (int n = 0; n < 16; ++n) {
    order[2 * n] = uint16_t(n);
    order[2 * n + 1] = uint16_t(16 + n);
  }
  const __m512i interleave = _mm512_load_si512(order);
  auto dims = [&](int64_t key, int c) {  // key's dims 16c..16c+15, zero past the last key
    return key < keys ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + key * row_stride + c * 16))
                      : _mm256_setzero_si256();
  };
  for (int64_t j = 0; j < padded / kPackKeys; ++j) {
    for (int c = 0; c < 4; ++c) {
      uint16_t* tile = packed + (j * 4 + c) * 512;
      for (int r = 0; r < 16; ++r) {
        const int64_t key = j * kPackKeys + 2 * r;
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(dims(key, c)), dims(key + 1, c), 1);
        _mm512_storeu_si512(tile + r * 32, _mm512_permutexvar_epi16(interleave, both));
      }
    }
  }
}

struct Task {
  const uint16_t* q;         // this task's first row, head h
  int64_t q_stride;          // elements between rows
  int rows;                  // <= 16 valid rows
  int64_t first_row;         // t of row 0
  const uint32_t* packed_k;  // the head's kv head
  const uint16_t* packed_v;
  int64_t keys, offset;
  float scale;
  uint16_t* out;             // row 0's output, out_stride elements between rows
  int64_t out_stride;
  float* lse;                // row 0's log-sum-exp, contiguous rows
};

void run_task(const Task& task) {
  alignas(64) uint16_t q_pad[kRows * kDim];
  alignas(64) float scores[kRows * kBlockKeys];   // [16][128]
  alignas(64) uint16_t probs[kRows * kBlockKeys]; // [16][128] bf16
  alignas(64) float part[kRows * kDim];           // P V of one block [16][64]
  alignas(64) float acc[kRows * kDim];            // running output
  alignas(64) float row_max[kRows], alpha[kRows];
  float row_sum[kRows];
  int64_t limit[kRows];                           // keys row i may see
  const uint16_t* q = task.q;
  int64_t q_bytes = task.q_stride * 2;
  if (task.rows < kRows) {  // a short last task: its rows padded with zeros
    std::fill(q_pad, q_pad + kRows * kDim, uint16_t(0));
    for (int i = 0; i < task.rows; ++i) std::copy(q + i * task.q_stride, q + i * task.q_stride + kDim, q_pad + i * kDim);
    q = q_pad;
    q_bytes = kDim * 2;
  }
  int64_t last = 0, first_limit = task.keys;
  for (int i = 0; i < kRows; ++i) {
    limit[i] = i < task.rows ? std::min(task.keys, task.first_row + i + task.offset + 1) : 1;
    last = std::max(last, limit[i]);
    first_limit = std::min(first_limit, limit[i]);
    row_max[i] = -INFINITY;
    row_sum[i] = 0.0f;
  }
  std::fill(acc, acc + kRows * kDim, 0.0f);
  const float c = task.scale * aaflow_simd::kLog2e;
  _tile_loadd(0, q, q_bytes);       // dims 0-31
  _tile_loadd(1, q + 32, q_bytes);  // dims 32-63
  for (int64_t base = 0; base < last; base += kBlockKeys) {
    const int n16 = int(std::min<int64_t>(kBlockKeys, last - base) + 15) / 16;  // 16-key score tiles
    const int n32 = (n16 + 1) / 2;                                             // 32-key P tiles
    for (int s = 0; s < n16; s += 4) {  // up to four score tiles at once: tiles 2-5, K in 6-7
      const int count = std::min(4, n16 - s);
      for (int t = 0; t < count; ++t) {
        const uint32_t* kt = task.packed_k + ((base / 16 + s + t) * 2) * 256;
        switch (t) {  // tile numbers must be constants
          case 0: _tile_zero(2); _tile_loadd(6, kt, 64); _tile_loadd(7, kt + 256, 64);
                  _tile_dpbf16ps(2, 0, 6); _tile_dpbf16ps(2, 1, 7); _tile_stored(2, scores + (s + 0) * 16, kBlockKeys * 4); break;
          case 1: _tile_zero(3); _tile_loadd(6, kt, 64); _tile_loadd(7, kt + 256, 64);
                  _tile_dpbf16ps(3, 0, 6); _tile_dpbf16ps(3, 1, 7); _tile_stored(3, scores + (s + 1) * 16, kBlockKeys * 4); break;
          case 2: _tile_zero(4); _tile_loadd(6, kt, 64); _tile_loadd(7, kt + 256, 64);
                  _tile_dpbf16ps(4, 0, 6); _tile_dpbf16ps(4, 1, 7); _tile_stored(4, scores + (s + 2) * 16, kBlockKeys * 4); break;
          default: _tile_zero(5); _tile_loadd(6, kt, 64); _tile_loadd(7, kt + 256, 64);
                  _tile_dpbf16ps(5, 0, 6); _tile_dpbf16ps(5, 1, 7); _tile_stored(5, scores + (s + 3) * 16, kBlockKeys * 4); break;
        }
      }
    }
    const int width = n32 * 32;  // softmax columns: whole P tiles
    const bool whole = first_limit - base >= width;  // every row sees every column: no masks
    alignas(64) float block_max[kRows];
    for (int i = 0; i < kRows; ++i) {  // each row's max over its visible keys
      const float* srow = scores + i * kBlockKeys;
      __m512 vmax = _mm512_set1_ps(-INFINITY);
      for (int j = 0; j < width; j += 16) {
        __m512 s = _mm512_loadu_ps(srow + j);
        if (!whole) s = _mm512_mask_blend_ps(first_lanes(limit[i] - base - j), _mm512_set1_ps(-INFINITY), s);
        vmax = _mm512_max_ps(vmax, s);
      }
      block_max[i] = _mm512_reduce_max_ps(vmax);
    }
    const __m512 vc = _mm512_set1_ps(c), old_max = _mm512_load_ps(row_max);  // the 16 rows at once
    const __m512 new_max = _mm512_max_ps(old_max, _mm512_load_ps(block_max));
    _mm512_store_ps(alpha, exp2_neg(_mm512_mul_ps(_mm512_sub_ps(old_max, new_max), vc)));  // rescales what came before
    _mm512_store_ps(row_max, new_max);
    for (int i = 0; i < kRows; ++i) {  // probabilities, rounded to bf16 for the product with V
      const float* srow = scores + i * kBlockKeys;
      const __m512 shift = _mm512_set1_ps(-row_max[i] * c);
      __m512 vsum = _mm512_setzero_ps();
      for (int j = 0; j < width; j += 16) {
        __m512 p = exp2_neg(_mm512_fmadd_ps(_mm512_loadu_ps(srow + j), vc, shift));
        if (!whole) p = _mm512_maskz_mov_ps(first_lanes(limit[i] - base - j), p);
        vsum = _mm512_add_ps(vsum, p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + i * kBlockKeys + j), (__m256i)_mm512_cvtneps_pbh(p));
      }
      row_sum[i] = row_sum[i] * alpha[i] + _mm512_reduce_add_ps(vsum);
    }
    _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5);  // P V, dims 16c..16c+15 in tile 2 + c
    for (int j = 0; j < n32; ++j) {
      const uint16_t* vt = task.packed_v + ((base / kPackKeys + j) * 4) * 512;
      _tile_loadd(6, probs + j * 32, kBlockKeys * 2);
      _tile_loadd(7, vt, 64); _tile_dpbf16ps(2, 6, 7);
      _tile_loadd(7, vt + 512, 64); _tile_dpbf16ps(3, 6, 7);
      _tile_loadd(7, vt + 1024, 64); _tile_dpbf16ps(4, 6, 7);
      _tile_loadd(7, vt + 1536, 64); _tile_dpbf16ps(5, 6, 7);
    }
    _tile_stored(2, part, kDim * 4); _tile_stored(3, part + 16, kDim * 4);
    _tile_stored(4, part + 32, kDim * 4); _tile_stored(5, part + 48, kDim * 4);
    for (int i = 0; i < kRows; ++i) {  // acc = acc * alpha + P V
      const __m512 va = _mm512_set1_ps(alpha[i]);
      for (int d = i * kDim; d < (i + 1) * kDim; d += 16)
        _mm512_store_ps(acc + d, _mm512_fmadd_ps(_mm512_load_ps(acc + d), va, _mm512_load_ps(part + d)));
    }
  }
  for (int i = 0; i < task.rows; ++i) {
    const __m512 inv = _mm512_set1_ps(1.0f / row_sum[i]);
    for (int d = 0; d < kDim; d += 16) {
      __m256bh o = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc + i * kDim + d), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(task.out + i * task.out_stride + d), (__m256i)o);
    }
    task.lse[i] = row_max[i] * task.scale + std::log(row_sum[i]);
  }
}

void check(const torch::Tensor& x, const char* name, int64_t heads) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "amx attention: ", name, " must be bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 3 && x.size(1) == heads && x.size(2) == kDim && x.stride(2) == 1 && x.stride(1) == kDim,
              "amx attention: ", name, " must be [n, ", heads, ", 64] with heads contiguous, got ", x.sizes(), " strides ", x.strides());
}

}  // namespace

// q [T, H, 64], k and v [S, Hkv, 64] (bf16, any row stride); query t sees keys j <= t + offset.
// -> (out [T, H, 64] bf16, lse [H, T] fp32)
std::vector<torch::Tensor> attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t offset, double scale) {
  TORCH_CHECK(request_amx(), "amx attention: the kernel refused AMX state (arch_prctl XTILEDATA)");
  const int64_t T = q.size(0), H = q.size(1), S = k.size(0), Hkv = k.size(1);
  check(q, "q", H);
  check(k, "k", Hkv);
  check(v, "v", Hkv);
  TORCH_CHECK(H % Hkv == 0 && v.size(0) == S, "amx attention: q heads ", H, " over kv heads ", Hkv, ", keys ", S, " vs values ", v.size(0));
  TORCH_CHECK(offset >= 0 && S > 0, "amx attention: offset ", offset, " must be >= 0 and keys > 0");
  const int64_t padded = (S + kBlockKeys - 1) / kBlockKeys * kBlockKeys;
  auto packed_k = torch::empty({Hkv, padded * kDim / 2}, torch::kInt32);
  auto packed_v = torch::empty({Hkv, padded * kDim}, torch::kInt16);
  auto out = torch::empty({T, H, kDim}, q.options());
  auto lse = torch::empty({H, T}, q.options().dtype(torch::kFloat32));
  const auto* kp = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v.data_ptr());
  auto* pk = reinterpret_cast<uint32_t*>(packed_k.data_ptr());
  auto* pv = reinterpret_cast<uint16_t*>(packed_v.data_ptr());
#pragma omp parallel for schedule(static)
  for (int64_t h = 0; h < 2 * Hkv; ++h) {
    if (h < Hkv) pack_keys(kp + h * kDim, k.stride(0), S, padded, pk + h * padded * kDim / 2);
    else pack_values(vp + (h - Hkv) * kDim, v.stride(0), S, padded, pv + (h - Hkv) * padded * kDim);
  }
  const int64_t blocks = (T + kRows - 1) / kRows, group = H / Hkv;
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  auto* lp = lse.data_ptr<float>();
#pragma omp parallel
  {
    configure_tiles();
#pragma omp for schedule(dynamic, 1)
    for (int64_t n = 0; n < blocks * H; ++n) {
      const int64_t h = n / blocks, b = blocks - 1 - n % blocks;  // a head's blocks together (its K, V stay cached), longest first
      Task task{qp + b * kRows * q.stride(0) + h * kDim, q.stride(0), int(std::min<int64_t>(kRows, T - b * kRows)), b * kRows,
                pk + (h / group) * padded * kDim / 2, pv + (h / group) * padded * kDim, S, offset, float(scale),
                op + (b * kRows * H + h) * kDim, H * kDim, lp + h * T + b * kRows};
      run_task(task);
    }
    _tile_release();
  }
  return {out, lse};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention", &attention, "causal bf16 attention on AMX tiles -> (out [T, H, 64], lse [H, T])");
  m.def("ready", &request_amx, "whether Linux granted this process AMX state (asked once)");
}
