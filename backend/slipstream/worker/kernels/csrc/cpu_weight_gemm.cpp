// Linear layers with bf16 weights for a few rows (decode steps) on a CPU where oneDNN does not
// run bf16 products natively (neither AVX512-BF16 nor AMX: it would emulate them).
//
// y[M, N] = x[M, K] · w[N, K]ᵀ + bias, x and y float32, w bfloat16 in the layout the model
// stores it ([N, K], rows contiguous: the only resident copy; prompt chunks read the same
// tensor through oneDNN's fp32 GEMM on a widened copy). Products accumulate in float32. A
// decode step reads every weight once, so the product is bound by that read: bf16 halves its
// bytes against fp32.
//
// With AVX512-BF16 (where oneDNN is unavailable) each row of x is rounded to bf16 once and
// the dot products run on vdpbf16ps (32 products a lane group, fp32 sums). Elsewhere the
// weights are widened to fp32 a tile at a time and the dot products are plain loops the
// compiler vectorizes (AVX2 or AVX-512).
//
// Built with the other kernels by slipstream/worker/kernels/build.py:
// torch.ops.slipstream_cpu.weight_gemm, torch.ops.slipstream_cpu.weight_gemm_path.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_op_registration.h"
#include "cpu_parallel.h"
#include "cpu_quant_rows.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Tests set this to run the portable path on a CPU that has AVX512-BF16 too.
bool g_force_portable = false;

constexpr int kCols = 4;     // output columns per task tile (their weight rows stay in L1)
constexpr int kRowTile = 6;  // rows per register tile (kRowTile x kCols accumulators)

#if defined(__AVX512BF16__)
constexpr bool kDpBf16 = true;

template <int R, int C>
void dp_tile(const uint16_t* __restrict x, int64_t K, const uint16_t* __restrict w,
             float out[R][C]) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[C];
    for (int c = 0; c < C; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}

template <int C>
void dp_rows(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, float* y, int64_t N,
             int64_t n0, const float* bias) {
  for (int64_t m0 = 0; m0 < M; m0 += kRowTile) {
    float out[kRowTile][C];
    const int rows = static_cast<int>(std::min<int64_t>(kRowTile, M - m0));
    const uint16_t* xm = x + m0 * K;
    switch (rows) {
      case 1: dp_tile<1, C>(xm, K, w, reinterpret_cast<float(*)[C]>(out)); break;
      case 2: dp_tile<2, C>(xm, K, w, reinterpret_cast<float(*)[C]>(out)); break;
      case 3: dp_tile<3, C>(xm, K, w, reinterpret_cast<float(*)[C]>(out)); break;
      case 4: dp_tile<4, C>(xm, K, w, reinterpret_cast<float(*)[C]>(out)); break;
      case 5: dp_tile<5, C>(xm, K, w, reinterpret_cast<float(*)[C]>(out)); break;
      default: dp_tile<6, C>(xm, K, w, out); break;
    }
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < C; ++c) {
        const int64_t n = n0 + c;
        y[(m0 + r) * N + n] = out[r][c] + (bias ? bias[n] : 0.f);
      }
  }
}
#else
constexpr bool kDpBf16 = false;
#endif

// Portable: the tile's weight rows widened to fp32, then vectorizable dot products.
void widen_rows(const uint16_t* w, int64_t n0, int cols, int64_t K, float* out) {
  const uint16_t* src = w + n0 * K;
#pragma omp simd
  for (int64_t i = 0; i < cols * K; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    out[i] = f;
  }
}

void fp32_rows(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w, int cols,
               float* y, int64_t N, int64_t n0, const float* bias) {
  for (int64_t m = 0; m < M; ++m)
    for (int c = 0; c < cols; ++c) {
      const float* xm = x + m * ldx;
      const float* wc = w + c * K;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t k = 0; k < K; ++k) sum += xm[k] * wc[k];
      const int64_t n = n0 + c;
      y[m * N + n] = sum + (bias ? bias[n] : 0.f);
    }
}

#if defined(__AVX512BF16__)
void dp_bf16_gemm(const at::Tensor& x, const uint16_t* w, const float* b, float* yp, int64_t N,
                  int64_t tiles, int64_t grain) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xb = x.to(at::kBFloat16).contiguous();  // each row rounded once, not per column
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  slipstream_cpu::dynamic_for(tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kCols;
      const int cols = static_cast<int>(std::min<int64_t>(kCols, N - n0));
      const uint16_t* wt = w + n0 * K;
      switch (cols) {
        case 1: dp_rows<1>(xp, M, K, wt, yp, N, n0, b); break;
        case 2: dp_rows<2>(xp, M, K, wt, yp, N, n0, b); break;
        case 3: dp_rows<3>(xp, M, K, wt, yp, N, n0, b); break;
        default: dp_rows<4>(xp, M, K, wt, yp, N, n0, b); break;
      }
    }
  });
}
#endif

at::Tensor weight_gemm(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "weight_gemm: x must be float32 [M, K], rows contiguous");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1),
              "weight_gemm: weight must be [N, K] contiguous, K as x's");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "weight_gemm: weight must be bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % 32 == 0, "weight_gemm: K must be a multiple of 32");
  const float* b = slipstream_cpu::product_bias("weight_gemm", bias, N);
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kCols - 1) / kCols;
  // ~16 columns a task: small enough that a preempted thread's share moves on.
  const int64_t grain = std::max<int64_t>(1, 16 / kCols);
#if defined(__AVX512BF16__)
  if (!g_force_portable) {
    dp_bf16_gemm(x, wp, b, yp, N, tiles, grain);
    return y;
  }
#endif
  const float* xp = x.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  slipstream_cpu::dynamic_for(tiles, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(static_cast<size_t>(kCols) * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kCols;
      const int cols = static_cast<int>(std::min<int64_t>(kCols, N - n0));
      widen_rows(wp, n0, cols, K, buf.data());
      fp32_rows(xp, ldx, M, K, buf.data(), cols, yp, N, n0, b);
    }
  });
  return y;
}

}  // namespace

SLIPSTREAM_CPU_PRODUCT(weight_gemm, "weight_gemm(Tensor x, Tensor w, Tensor? bias) -> Tensor",
                       kDpBf16, "avx512_bf16", g_force_portable)
