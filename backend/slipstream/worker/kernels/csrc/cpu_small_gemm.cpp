// The fp32 linear layers on CPU: decode steps and prompt chunks, on one packed copy.
//
// With a handful of rows the product is bound by reading the weight once from memory, and
// oneDNN's inner product reads it at ~20 GB/s here against ~33 GB/s the memory gives a plain
// stream. This kernel streams a weight packed as [N/16][K][16] (16 output columns side by
// side, zero-padded) once per call: each 64-byte load of the weight feeds one FMA per row.
// Rows beyond a tile of 12 re-read the block from cache, not memory.
//
// From 32 rows on (prompt chunks, large decode batches) the product is bound by the FMAs, not
// the weight's bytes: tiles of 8 rows x 3 blocks (24 accumulators, 11 loads per 24 FMAs
// against 14 for 12 x 2) run over chunks of rows whose x stays in L2 while every block group
// passes over it. The outputs of whole blocks are stored as vectors. On the AMD EPYC (Zen 4)
// VMs here a decoder layer's four products ran at 0.99-1.01x oneDNN's time from 128 to 2,048
// rows (the 12 x 2 tiles alone: 1.11-1.19x), so one packed copy serves both kinds of step.
//
// Built with cpu_paged_attention.cpp by slipstream/worker/kernels/build.py:
// torch.ops.slipstream_cpu.pack_small_gemm_weight, torch.ops.slipstream_cpu.small_gemm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "cpu_parallel.h"
#include "cpu_quant_rows.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;  // output columns per packed block
constexpr int kRowTile = 12;    // rows sharing one pass over a block pair (24 accumulators)

#if defined(__AVX512F__)
// One row's sums for `nblocks` whole blocks from column n0: y[n0 + ...] = acc + bias.
inline void store_blocks(const __m512* acc, int nblocks, float* __restrict y, int64_t n0,
                         const float* __restrict bias) {
  for (int b = 0; b < nblocks; ++b) {
    __m512 v = acc[b];
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0 + b * kLanes));
    _mm512_storeu_ps(y + n0 + b * kLanes, v);
  }
}
#endif

// acc[m][b] (b: one of two column blocks) += x[m, k] * w[b][k] over k; then y = acc + bias.
template <int M>
void tile(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t K,
          int nblocks, float* __restrict y, int64_t ldy, int64_t n0, int64_t N,
          const float* __restrict bias) {
#if defined(__AVX512F__)
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const float* w1 = w + K * kLanes;
  if (nblocks == 2) {
    for (int64_t k = 0; k < K; ++k) {
      const __m512 a = _mm512_loadu_ps(w + k * kLanes);
      const __m512 b = _mm512_loadu_ps(w1 + k * kLanes);
      for (int m = 0; m < M; ++m) {
        const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
        acc[m][0] = _mm512_fmadd_ps(xv, a, acc[m][0]);
        acc[m][1] = _mm512_fmadd_ps(xv, b, acc[m][1]);
      }
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      const __m512 a = _mm512_loadu_ps(w + k * kLanes);
      for (int m = 0; m < M; ++m)
        acc[m][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * ldx + k]), a, acc[m][0]);
    }
  }
  if (n0 + nblocks * kLanes <= N) {  // whole blocks: vector stores
    for (int m = 0; m < M; ++m) store_blocks(acc[m], nblocks, y + m * ldy, n0, bias);
    return;
  }
  alignas(64) float out[2][kLanes];
  for (int m = 0; m < M; ++m) {
    _mm512_store_ps(out[0], acc[m][0]);
    _mm512_store_ps(out[1], acc[m][1]);
    for (int b = 0; b < nblocks; ++b)
      for (int64_t j = 0; j < kLanes && n0 + b * kLanes + j < N; ++j) {
        const int64_t n = n0 + b * kLanes + j;
        y[m * ldy + n] = out[b][j] + (bias ? bias[n] : 0.f);
      }
  }
#else
  float acc[M][2][kLanes] = {};
  for (int b = 0; b < nblocks; ++b) {
    const float* wb = w + b * K * kLanes;
    for (int64_t k = 0; k < K; ++k)
      for (int m = 0; m < M; ++m) {
        const float xv = x[m * ldx + k];
#pragma omp simd
        for (int64_t j = 0; j < kLanes; ++j) acc[m][b][j] += xv * wb[k * kLanes + j];
      }
  }
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < nblocks; ++b)
      for (int64_t j = 0; j < kLanes && n0 + b * kLanes + j < N; ++j) {
        const int64_t n = n0 + b * kLanes + j;
        y[m * ldy + n] = acc[m][b][j] + (bias ? bias[n] : 0.f);
      }
#endif
}

#if defined(__AVX512F__)
constexpr int kWideRows = 8;    // the many-row tile: 8 rows x 3 blocks (24 accumulators)
constexpr int kWideBlocks = 3;
constexpr int64_t kChunkBytes = 384 * 1024;  // the rows of x one task keeps in L2

// y[0:R, n0:n0+48] = x[0:R] · the 3 blocks at w (all whole) + bias.
void wide_tile(const float* __restrict x, int64_t ldx, const float* __restrict w, int64_t K,
               float* __restrict y, int64_t ldy, int64_t n0, const float* __restrict bias) {
  constexpr int R = kWideRows, B = kWideBlocks;
  __m512 acc[R][B];
  for (int m = 0; m < R; ++m)
    for (int b = 0; b < B; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 wv[B];
    for (int b = 0; b < B; ++b) wv[b] = _mm512_loadu_ps(w + (b * K + k) * kLanes);
    for (int m = 0; m < R; ++m) {
      const __m512 xv = _mm512_set1_ps(x[m * ldx + k]);
      for (int b = 0; b < B; ++b) acc[m][b] = _mm512_fmadd_ps(xv, wv[b], acc[m][b]);
    }
  }
  for (int m = 0; m < R; ++m) store_blocks(acc[m], B, y + m * ldy, n0, bias);
}
#endif

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, int, float*, int64_t,
                        int64_t, int64_t, const float*);
constexpr TileFn kTiles[kRowTile + 1] = {nullptr,  tile<1>, tile<2>,  tile<3>,  tile<4>,
                                         tile<5>,  tile<6>, tile<7>,  tile<8>,  tile<9>,
                                         tile<10>, tile<11>, tile<12>};

// Rows [m0, m1) against `nb` (1 or 2) blocks at w, in tiles of up to 12 rows.
void rows_of(const float* x, int64_t m0, int64_t m1, int64_t ldx, const float* w, int64_t K,
             int nb, float* y, int64_t N, int64_t n0, const float* bias) {
  for (; m0 < m1; m0 += kRowTile) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowTile, m1 - m0));
    kTiles[rows](x + m0 * ldx, ldx, w, K, nb, y + m0 * N, N, n0, N, bias);
  }
}

#if defined(__AVX512F__)
// Many rows: tasks of (a chunk of rows, a group of 3 blocks), chunk by chunk; the rows past
// the last whole 8-row tile, and a ragged last group, take the 12 x 2 tiles.
void many_rows(const float* x, int64_t M, int64_t K, int64_t ldx, const float* w,
               int64_t blocks, float* y, int64_t N, const float* bias) {
  const int64_t groups = (blocks + kWideBlocks - 1) / kWideBlocks;
  // A decode batch is one chunk: each weight block is read from memory once.
  const int64_t fit = std::max<int64_t>(kWideRows, kChunkBytes / (K * 4) / kWideRows * kWideRows);
  const int64_t chunk = M <= fit ? M : fit;
  const int64_t chunks = (M + chunk - 1) / chunk;
  slipstream_cpu::dynamic_for(groups * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t % groups, m1 = std::min(M, (t / groups + 1) * chunk);
      const int64_t b0 = g * kWideBlocks, b1 = std::min(blocks, b0 + kWideBlocks);
      const float* wg = w + b0 * K * kLanes;
      int64_t m0 = t / groups * chunk;
      if (b1 - b0 == kWideBlocks && b1 * kLanes <= N)
        for (; m0 + kWideRows <= m1; m0 += kWideRows)
          wide_tile(x + m0 * ldx, ldx, wg, K, y + m0 * N, N, b0 * kLanes, bias);
      for (int64_t p = b0; p < b1; p += 2) {
        const int nb = static_cast<int>(std::min<int64_t>(2, b1 - p));
        rows_of(x, m0, m1, ldx, w + p * K * kLanes, K, nb, y, N, p * kLanes, bias);
      }
    }
  });
}
#endif

// [N, K] -> [ceil(N/16), K, 16], the columns past N zero.
at::Tensor pack_small_gemm_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "pack_small_gemm_weight: a float32 [N, K] weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t blocks = (N + kLanes - 1) / kLanes;
  at::Tensor padded = at::zeros({blocks * kLanes, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({blocks, kLanes, K}).transpose(1, 2).contiguous();
}

// y = x · weightᵀ + bias for x [M, K] (rows contiguous), the weight packed as above.
at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                      const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat,
              "small_gemm: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "small_gemm: x must be [M, K], rows contiguous");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == kLanes &&
                  packed.size(1) == x.size(1) && packed.size(0) * kLanes >= N,
              "small_gemm: weight not packed for this input");
  const float* b = slipstream_cpu::product_bias("small_gemm", bias, N);
  const int64_t M = x.size(0), K = x.size(1), ldx = x.stride(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = packed.size(0);
#if defined(__AVX512F__)
  if (M >= 4 * kWideRows) {
    many_rows(xp, M, K, ldx, wp, blocks, yp, N, b);
    return y;
  }
#endif
  const int64_t pairs = (blocks + 1) / 2;
  // Each task: one pair of column blocks, every row tile; the pair stays in cache meanwhile.
  // Taken one pair at a time (~2-3 us of work each): a stalled thread's share moves on.
  slipstream_cpu::dynamic_for(pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int nb = static_cast<int>(std::min<int64_t>(2, blocks - 2 * p));
      rows_of(xp, 0, M, ldx, wp + 2 * p * K * kLanes, K, nb, yp, N, 2 * p * kLanes, b);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slipstream_cpu, m) {
  m.def("pack_small_gemm_weight(Tensor weight) -> Tensor");
  m.def("small_gemm(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(slipstream_cpu, CPU, m) {
  m.impl("pack_small_gemm_weight", &pack_small_gemm_weight);
  m.impl("small_gemm", &small_gemm);
}
