// Linear layers with int8 weights and int8 activations (quantization=int8) on CPU.
//
// Both operands are quantized in blocks of 32 along K, each block with its own float32 scale
// (llama.cpp's Q8_0 x Q8_0 scheme): the weight once at load (symmetric, per output column and
// block), the activations per product (symmetric, per row and block). The products of a block
// are summed exactly in int32, then widened and scaled into a float32 sum:
//
//   y[m, n] = sum_b  sw[n, b] * sa[m, b] * sum_{k in b} qw[n, k] * qa[m, k]   (+ bias[n])
//
// Quantizing activations per row alone (one scale for 576 or 1,536 values) cost SmolLM2
// +5.4% perplexity; per block of 32 it is +1.2-1.4%, about weight-only int8's own loss.
// Integer sums are exact, so every path (AVX512-VNNI or portable) computes the same block sums,
// and a row's result does not depend on the rows beside it.
//
// Outlier channels: a few input channels (k, found per layer at load) carry values 10-20x
// the rest (the residual stream's), and a block holding one gets a scale that flattens its
// other 31 values. Those channels are left out of the blocks (zeroed before quantizing, their
// weight columns zero in the blocks) and added exactly in float32 from their own weight
// columns: y += x[:, idx] · w_out (LLM.int8()'s decomposition). On SmolLM2, 8 a layer take
// the mean KL against fp32 from 0.0038 to 0.0014 (perplexity +1.35% -> +0.38%).
//
// AVX512-VNNI (Zen 4, Ice Lake and later Xeons): vpdpbusd multiplies unsigned by signed bytes,
// four pairs a lane. The weights are the unsigned operand, stored as qw + 128; the extra
// 128 * sum(qa) of a block is taken off with the activation's scale: t = acc * sa + comp with
// comp[m, b] = -128 * sa[m, b] * sum_{k in b} qa[m, k] (-128 times cpu_quant_rows.h's ssum).
// Elsewhere the same sums are plain loops the compiler vectorizes.
//
// Packed weight (slipstream.worker.cpu_q8_weight packs it): u8 [N/32][K/4][2][16][4] (panels
// of 32 output columns, two vectors of 16 lanes, each lane four consecutive k), scales f32
// [N/32][K/32][32]; N padded to 32 with zero columns.
//
// Built with the other kernels by slipstream/worker/kernels/build.py:
// torch.ops.slipstream_cpu.q8_gemm, torch.ops.slipstream_cpu.q8_gemm_path.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_op_registration.h"
#include "cpu_parallel.h"
#include "cpu_products.h"
#include "cpu_quant_rows.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // K per scale
constexpr int64_t kLanes = 16;  // output columns per vector
constexpr int kVecs = 2;        // vectors per panel
constexpr int64_t kPanel = kLanes * kVecs;
static_assert(kPanel == slipstream_cpu::kOutlierPanel,
              "the outlier weights come in the panels' columns");
constexpr int kRowTile = 6;   // rows per register tile (kRowTile x kVecs x 2 accumulators)
// Weights are prefetched this far ahead of the quad being read: a decode step streams every
// layer's weights from memory once, and the hardware prefetcher alone (restarting at every
// task's panel) kept that at ~14 of the ~27 GB/s a plain read gets.
constexpr int64_t kPrefetchBytes = 4096;

bool g_force_portable = false;

using slipstream_cpu::Outliers;
using slipstream_cpu::QuantRows;
using slipstream_cpu::finish_row;

#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
using slipstream_cpu::finish_tile;

// R rows x kVecs vectors of one panel, over all of K.
template <int R>
void vnni_tile(const QuantRows& a, int64_t m0, int64_t K, const uint8_t* __restrict wp,
               const float* __restrict sp, const float* __restrict op, float* y, int64_t N,
               int64_t n0, int64_t cols, const float* bias) {
  const int64_t KB = K / kBlock;
  __m512 facc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) facc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < KB; ++b) {
    __m512i acc[R][kVecs];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_si512();
    const uint8_t* wb = wp + b * (kBlock / 4) * kPanel * 4;
    // a block's weights are 1 KB: 16 lines, read past the panel's end into the next one's
    for (int64_t line = 0; line < kBlock * kPanel; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + line), _MM_HINT_T0);
    for (int64_t quad = 0; quad < kBlock / 4; ++quad) {
      __m512i w[kVecs];
      for (int c = 0; c < kVecs; ++c)
        w[c] = _mm512_loadu_si512(wb + (quad * kVecs + c) * kLanes * 4);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, a.q + (m0 + r) * K + b * kBlock + quad * 4, 4);
        const __m512i x = _mm512_set1_epi32(four);
        for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], w[c], x);
      }
    }
    __m512 sw[kVecs];
    for (int c = 0; c < kVecs; ++c) sw[c] = _mm512_loadu_ps(sp + b * kPanel + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 sa = _mm512_set1_ps(a.scale[(m0 + r) * KB + b]);
      const __m512 comp = _mm512_set1_ps(-128.f * a.ssum[(m0 + r) * KB + b]);
      for (int c = 0; c < kVecs; ++c) {
        const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), sa, comp);
        facc[r][c] = _mm512_fmadd_ps(t, sw[c], facc[r][c]);
      }
    }
  }
  finish_tile<R>(facc, a, m0, op, y, N, n0, cols, bias);
}

void vnni_rows(const QuantRows& a, int64_t m0, int64_t m1, int64_t K, const uint8_t* wp,
               const float* sp, const float* op, float* y, int64_t N, int64_t n0, int64_t cols,
               const float* bias) {
  for (int64_t m = m0; m < m1; m += kRowTile) {
    switch (std::min<int64_t>(kRowTile, m1 - m)) {
      case 1: vnni_tile<1>(a, m, K, wp, sp, op, y, N, n0, cols, bias); break;
      case 2: vnni_tile<2>(a, m, K, wp, sp, op, y, N, n0, cols, bias); break;
      case 3: vnni_tile<3>(a, m, K, wp, sp, op, y, N, n0, cols, bias); break;
      case 4: vnni_tile<4>(a, m, K, wp, sp, op, y, N, n0, cols, bias); break;
      case 5: vnni_tile<5>(a, m, K, wp, sp, op, y, N, n0, cols, bias); break;
      default: vnni_tile<6>(a, m, K, wp, sp, op, y, N, n0, cols, bias); break;
    }
  }
}
#else
constexpr bool kVnni = false;
#endif

// Portable: one row at a time, the panel's 32 columns as vectorizable int32 sums.
void portable_rows(const QuantRows& a, int64_t m0, int64_t m1, int64_t K, const uint8_t* wp,
                   const float* sp, const float* op, float* y, int64_t N, int64_t n0,
                   int64_t cols, const float* bias) {
  const int64_t KB = K / kBlock;
  for (int64_t m = m0; m < m1; ++m) {
    const int8_t* xq = a.q + m * K;
    float facc[kPanel] = {};
    for (int64_t b = 0; b < KB; ++b) {
      int32_t acc[kPanel] = {};
      const uint8_t* wb = wp + b * (kBlock / 4) * kPanel * 4;
      for (int64_t quad = 0; quad < kBlock / 4; ++quad) {
        const int8_t* x4 = xq + b * kBlock + quad * 4;
        for (int c = 0; c < kVecs; ++c) {
          const uint8_t* w4 = wb + (quad * kVecs + c) * kLanes * 4;
#pragma omp simd
          for (int64_t l = 0; l < kLanes; ++l) {
            int32_t s = 0;
            for (int j = 0; j < 4; ++j) s += int32_t(w4[l * 4 + j]) * int32_t(x4[j]);
            acc[c * kLanes + l] += s;
          }
        }
      }
      const float sa = a.scale[m * KB + b], comp = -128.f * a.ssum[m * KB + b];
      const float* sw = sp + b * kPanel;
      for (int64_t l = 0; l < kPanel; ++l)
        facc[l] = std::fma(std::fma(float(acc[l]), sa, comp), sw[l], facc[l]);
    }
    finish_row(facc, a, m, op, y, N, n0, cols, bias);
  }
}

}  // namespace

namespace slipstream_cpu {

void quantize_row(const float* x, int64_t K, int8_t* q, float* scale, float* ssum) {
  for (int64_t b = 0; b < K / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
    float amax = 0.f;
    for (int64_t i = 0; i < kQuantBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t sum = 0;
    for (int64_t i = 0; i < kQuantBlock; ++i) {
      // nearest, ties to even (the default rounding mode), as torch.round
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
      const int32_t c = std::min(127, std::max(-127, v));
      q[b * kQuantBlock + i] = static_cast<int8_t>(c);
      sum += c;
    }
    const float s = amax / 127.f;
    scale[b] = s;
    ssum[b] = s * static_cast<float>(sum);
  }
}

void q8_panel_rows(const QuantRows& a, int64_t m0, int64_t m1, int64_t K, const uint8_t* wp,
                   const float* sp, const float* op, float* y, int64_t N, int64_t n0,
                   int64_t cols, const float* bias) {
#if defined(__AVX512VNNI__)
  if (!g_force_portable) {
    vnni_rows(a, m0, m1, K, wp, sp, op, y, N, n0, cols, bias);
    return;
  }
#endif
  portable_rows(a, m0, m1, K, wp, sp, op, y, N, n0, cols, bias);
}

}  // namespace slipstream_cpu

namespace {

at::Tensor q8_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                   int64_t N, const c10::optional<at::Tensor>& bias,
                   const c10::optional<at::Tensor>& outlier_idx,
                   const c10::optional<at::Tensor>& outlier_w) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "q8_gemm: x must be float32 [M, K], rows contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "q8_gemm: K must be a multiple of 32");
  const int64_t panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == panels * kPanel * K,
              "q8_gemm: packed weight must be uint8 [N/32, K/4, 2, 16, 4] for this K and N");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == panels * kPanel * (K / kBlock),
              "q8_gemm: scales must be float32 [N/32, K/32, 32]");
  const slipstream_cpu::QuantizedProduct q = slipstream_cpu::quantized_product(
      "q8_gemm", x, N, panels, bias, outlier_idx, outlier_w, c10::nullopt);
  if (M == 0) return q.y;
  const QuantRows& a = q.x.rows;
  const Outliers& o = q.outliers;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = q.y.data_ptr<float>();
  slipstream_cpu::for_panel_rows(panels, M, [&](int64_t p, int64_t m0, int64_t m1) {
    const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
    const uint8_t* wpp = wp + p * kPanel * K;
    const float* spp = sp + p * kPanel * (K / kBlock);
    const float* opp = o.w ? o.w + p * o.k * kPanel : nullptr;
    slipstream_cpu::q8_panel_rows(a, m0, m1, K, wpp, spp, opp, yp, N, n0, cols, q.bias);
  });
  return q.y;
}

}  // namespace

SLIPSTREAM_CPU_PRODUCT(q8_gemm,
                       "q8_gemm(Tensor x, Tensor packed, Tensor scales, int n, Tensor? bias, "
                       "Tensor? outlier_idx=None, Tensor? outlier_w=None) -> Tensor",
                       kVnni, "avx512_vnni", g_force_portable)
