// Linear layers with bf16 weights (dtype=bfloat16) on a CPU with AVX512-BF16 and no AMX (Zen 4,
// Cooper Lake): the weight packed in panels of 32 output columns, read by vdpbf16ps.
//
// y[M, N] = bf16(x)[M, K] · w[N, K]ᵀ + bias, every sum in float32, y float32 or bf16 (rounded
// once, as oneDNN's bf16 products hand it on).
//
// A decode step streams every weight from memory once: oneDNN's bf16 GEMM read the model's
// weights at ~13 GB/s there (a task per small block of columns, restarting the hardware
// prefetcher), this kernel prefetches a panel's next lines as it goes and gives each thread a
// run of panels. At prompt sizes it keeps 12 rows x 2 vectors of sums in registers (24
// vdpbf16ps a pair of k against 14 loads). The packed layout is also the only copy of the
// weight: a tied input embedding looks its rows up in it (slipstream.worker.bf16_weight).
//
// Packed weight: bf16 [N/32][K/2][2][16][2] (panels of 32 output columns, two vectors of 16
// lanes, each lane a pair of consecutive k); N padded to 32 with zero columns.
//
// Built with the other kernels by slipstream/worker/kernels/build.py:
// torch.ops.slipstream_cpu.bf16_gemm, torch.ops.slipstream_cpu.bf16_gemm_path.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "cpu_op_registration.h"
#include "cpu_parallel.h"
#include "cpu_products.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;
constexpr int kVecs = 2;
constexpr int64_t kPanel = kLanes * kVecs;  // output columns per panel
constexpr int kRowTile = 12;
constexpr int64_t kPrefetchBytes = 4096;
// Only tiles this small prefetch: at 1-4 rows the kernel waits on memory and the prefetches
// keep more lines in flight (SmolLM2's layers, one row: 20.7 -> 24.3 GB/s); from 8 rows the
// prefetch instructions stalled the products more than they hid (8 rows: 19.6 -> 14.8 GB/s).
constexpr int kPrefetchRows = 4;

bool g_force_portable = false;

inline float widen(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 (NaN kept a NaN).
inline uint16_t narrow(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

struct Out {
  float* f32;     // one of the two
  uint16_t* bf16;
  int64_t N;
  const float* bias;

#if defined(__AVX512F__)
  // 16 whole columns as vectors: a tile's scalar stores took ~1/6 of a 64-row product's time.
  // bf16 rounds as narrow() does (nearest even, a NaN kept a NaN), lane by lane.
  void store16(int64_t m, int64_t n0, __m512 v) const {
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + n0));
    if (f32) {
      _mm512_storeu_ps(f32 + m * N + n0, v);
      return;
    }
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i high = _mm512_srli_epi32(bits, 16);
    const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    __m512i half = _mm512_srli_epi32(up, 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    half = _mm512_mask_mov_epi32(half, nan, _mm512_or_si512(high, _mm512_set1_epi32(0x40)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(bf16 + m * N + n0),
                        _mm512_cvtepi32_epi16(half));
  }
#endif

  void store(int64_t m, int64_t n0, const float* vals, int64_t cols) const {
    for (int64_t c = 0; c < cols; ++c) {
      const float v = vals[c] + (bias ? bias[n0 + c] : 0.f);
      if (f32)
        f32[m * N + n0 + c] = v;
      else
        bf16[m * N + n0 + c] = narrow(v);
    }
  }
};

#if defined(__AVX512BF16__)
constexpr bool kDp = true;

// `first`: the panel's first row tile, which streams its weights from memory (prefetched
// ahead); the tiles after it find them in the core's cache.
template <int R, bool first>
void dp_tile(const uint16_t* __restrict x, int64_t m0, int64_t K, const uint16_t* __restrict wp,
             const Out& out, int64_t n0, int64_t cols) {
  __m512 acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_ps();
  const uint16_t* xr = x + m0 * K;
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    const uint16_t* wk = wp + kp * kPanel * 2;
    if (first && R <= kPrefetchRows && (kp & 7) == 0)  // 1 KB a step of 8 pairs: 16 lines
      for (int64_t line = 0; line < 8 * kPanel * 2 * 2; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wk) + kPrefetchBytes + line, _MM_HINT_T0);
    __m512bh w[kVecs];
    for (int c = 0; c < kVecs; ++c) w[c] = (__m512bh)_mm512_loadu_si512(wk + c * kLanes * 2);
    for (int r = 0; r < R; ++r) {
      // The pair of x broadcast by each product's own memory operand ({1to16}), which the
      // load unit does, rather than once into a register by a shuffle that shares the
      // products' pipes (that capped the kernel at ~75% of vdpbf16ps's rate). The compiler
      // folds a broadcast into its use only when it has one use: each product gets its own
      // pointer, which it cannot prove equal to the other's.
      const int32_t* pair = reinterpret_cast<const int32_t*>(xr + r * K + 2 * kp);
      for (int c = 0; c < kVecs; ++c) {
        const int32_t* own = pair;
        asm("" : "+r"(own));
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w[c], (__m512bh)_mm512_set1_epi32(*own));
      }
    }
  }
  if (cols == kPanel) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kVecs; ++c) out.store16(m0 + r, n0 + c * kLanes, acc[r][c]);
    return;
  }
  alignas(64) float vals[kPanel];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < kVecs; ++c) _mm512_store_ps(vals + c * kLanes, acc[r][c]);
    out.store(m0 + r, n0, vals, cols);
  }
}

template <bool first>
void dp_tile_of(int rows, const uint16_t* x, int64_t m, int64_t K, const uint16_t* wp,
                const Out& out, int64_t n0, int64_t cols) {
  switch (rows) {
    case 1: dp_tile<1, first>(x, m, K, wp, out, n0, cols); break;
    case 2: dp_tile<2, first>(x, m, K, wp, out, n0, cols); break;
    case 3: dp_tile<3, first>(x, m, K, wp, out, n0, cols); break;
    case 4: dp_tile<4, first>(x, m, K, wp, out, n0, cols); break;
    case 5: dp_tile<5, first>(x, m, K, wp, out, n0, cols); break;
    case 6: dp_tile<6, first>(x, m, K, wp, out, n0, cols); break;
    case 7: dp_tile<7, first>(x, m, K, wp, out, n0, cols); break;
    case 8: dp_tile<8, first>(x, m, K, wp, out, n0, cols); break;
    case 9: dp_tile<9, first>(x, m, K, wp, out, n0, cols); break;
    case 10: dp_tile<10, first>(x, m, K, wp, out, n0, cols); break;
    case 11: dp_tile<11, first>(x, m, K, wp, out, n0, cols); break;
    default: dp_tile<12, first>(x, m, K, wp, out, n0, cols); break;
  }
}

void dp_rows(const uint16_t* x, int64_t m0, int64_t m1, int64_t K, const uint16_t* wp,
             const Out& out, int64_t n0, int64_t cols) {
  for (int64_t m = m0; m < m1; m += kRowTile) {
    const int rows = static_cast<int>(std::min<int64_t>(kRowTile, m1 - m));
    if (m == m0)
      dp_tile_of<true>(rows, x, m, K, wp, out, n0, cols);
    else
      dp_tile_of<false>(rows, x, m, K, wp, out, n0, cols);
  }
}
#else
constexpr bool kDp = false;
#endif

// Portable: one row at a time, the panel's columns as vectorizable float32 sums.
void portable_rows(const uint16_t* x, int64_t m0, int64_t m1, int64_t K, const uint16_t* wp,
                   const Out& out, int64_t n0, int64_t cols) {
  for (int64_t m = m0; m < m1; ++m) {
    const uint16_t* xm = x + m * K;
    float acc[kPanel] = {};
    for (int64_t kp = 0; kp < K / 2; ++kp) {
      const float x0 = widen(xm[2 * kp]), x1 = widen(xm[2 * kp + 1]);
      const uint16_t* wk = wp + kp * kPanel * 2;
#pragma omp simd
      for (int64_t l = 0; l < kPanel; ++l)
        acc[l] += widen(wk[2 * l]) * x0 + widen(wk[2 * l + 1]) * x1;
    }
    out.store(m, n0, acc, cols);
  }
}

}  // namespace

namespace slipstream_cpu {

void bf16_panel_rows(const uint16_t* x, int64_t m0, int64_t m1, int64_t K, const uint16_t* wp,
                     float* f32, uint16_t* bf16, int64_t N, const float* bias, int64_t n0,
                     int64_t cols) {
  const Out out{f32, bf16, N, bias};
#if defined(__AVX512BF16__)
  if (!g_force_portable) {
    dp_rows(x, m0, m1, K, wp, out, n0, cols);
    return;
  }
#endif
  portable_rows(x, m0, m1, K, wp, out, n0, cols);
}

}  // namespace slipstream_cpu

namespace {

at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                     const c10::optional<at::Tensor>& bias, bool bf16_out) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
                  x.dim() == 2,
              "bf16_gemm: x must be float32 or bfloat16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 2 == 0, "bf16_gemm: K must be even");
  const int64_t panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.numel() == panels * kPanel * K,
              "bf16_gemm: packed weight must be bfloat16 [N/32, K/2, 2, 16, 2] for this K and N");
  const float* b = slipstream_cpu::product_bias("bf16_gemm", bias, N);
  at::Tensor y = at::empty({M, N}, x.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (M == 0) return y;
  // each row rounded to bf16 once, as oneDNN's bf16 product takes it
  const at::Tensor xb = x.to(at::kBFloat16).contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  Out out{bf16_out ? nullptr : y.data_ptr<float>(),
          bf16_out ? reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) : nullptr, N, b};
  slipstream_cpu::for_panel_rows(panels, M, [&](int64_t p, int64_t m0, int64_t m1) {
    const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
    const uint16_t* wpp = wp + p * kPanel * K;
    slipstream_cpu::bf16_panel_rows(xp, m0, m1, K, wpp, out.f32, out.bf16, N, b, n0, cols);
  });
  return y;
}

}  // namespace

SLIPSTREAM_CPU_PRODUCT(bf16_gemm,
                       "bf16_gemm(Tensor x, Tensor packed, int n, Tensor? bias, bool bf16_out) "
                       "-> Tensor",
                       kDp, "avx512_bf16", g_force_portable)
