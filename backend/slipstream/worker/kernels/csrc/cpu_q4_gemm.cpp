// Linear layers with 4-bit weights (quantization=gguf / awq / gptq) on CPU, the weights read as
// they were shipped: GGUF's Q4_0 / Q4_1 / Q4_K blocks and AWQ / GPTQ groups all take the form
//
//   w[n, k] = d[n, g] * q[n, k] + m[n, g],   q in 0..15, g = k / G (G a multiple of 32)
//
// (Q4_0: m = -8d; Q4_1: its d and m; Q4_K: d = d_super * scale, m = -dmin * min per block of
// 32; AWQ / GPTQ: d = s, m = -s * z per group), with d and m float16 where the checkpoint's
// are (exact) and float32 where they are products (exact too).
//
// The activations are int8 per row and block of 32 (cpu_quant_rows.h, llama.cpp's Q8_0 rows,
// as the int8 product takes them). Per block the integer sums are exact; per group they are
// scaled and folded:
//
//   y[m, n] = sum_g  d[n, g] * T[m, n, g] + m[n, g] * S[m, g]          (+ outliers, + bias)
//   T[m, n, g] = sum_{b in g} sa[m, b] * sum_{k in b} q[n, k] * qa[m, k]
//   S[m, g]    = sum_{b in g} sa[m, b] * sum_{k in b} qa[m, k]
//
// AVX512-VNNI: vpdpbusd multiplies unsigned by signed bytes, four pairs a lane; the 4-bit
// weights are unsigned as they are (no offset to take off), unpacked from nibbles with an and
// and a shift. Elsewhere the same sums are plain loops the compiler vectorizes. A decode step
// at one sequence reads the weights once, so it is bound by their bytes: half of int8's.
// Outlier channels (cpu_quant_rows.h) are handled as in cpu_q8_gemm.cpp, their weight columns
// the blocks' own values in float32.
//
// Packed weight (slipstream/worker/layers/quantization/int4.py packs it): u8
// [N/32][K/32][4][2][16][4], panels of 32 output columns and blocks of 32 k; byte [j][c][l][i]
// of a block holds column c*16+l's k = 4j+i in its low nibble and k = 16+4j+i in its high one
// (GGML's order within a block: low nibbles the first 16 values, high the last 16). Scales
// [N/32][K/G][2][32]: d of the panel's 32 columns, then m. N padded to 32 with zero columns.
//
// Built with the other kernels by slipstream/worker/kernels/build.py:
// torch.ops.slipstream_cpu.q4_gemm, torch.ops.slipstream_cpu.q4_gemm_path.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_op_registration.h"
#include "cpu_parallel.h"
#include "cpu_products.h"
#include "cpu_quant_rows.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using slipstream_cpu::Outliers;
using slipstream_cpu::QuantRows;
using slipstream_cpu::finish_row;

constexpr int64_t kBlock = 32;  // K per block of nibbles
constexpr int64_t kLanes = 16;
constexpr int kVecs = 2;
constexpr int64_t kPanel = kLanes * kVecs;          // output columns per panel
constexpr int64_t kBlockBytes = kBlock * kPanel / 2;  // a panel's block: 512 bytes
constexpr int kRowTile = 4;                         // rows per register tile
constexpr int64_t kPrefetchBytes = 4096;
static_assert(kPanel == slipstream_cpu::kOutlierPanel,
              "the outlier weights come in the panels' columns");

bool g_force_portable = false;

// IEEE half -> float, exactly (normals, subnormals, infinities, NaN).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while ((m & 0x400u) == 0);
    bits = sign | ((112 - e) << 23) | ((m & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float meta(const float* p) { return *p; }
inline float meta(const uint16_t* p) { return half_to_float(*p); }

using Panel = slipstream_cpu::Q4Panel;

#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;
using slipstream_cpu::finish_tile;

inline __m512 load_meta(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_meta(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// R rows x kVecs vectors of one panel, over all of K.
template <int R, typename S>
void vnni_tile(const QuantRows& a, int64_t m0, const Panel& p, float* y, int64_t N,
               const float* bias) {
  const int64_t K = p.K, KB = K / kBlock, bpg = p.G / kBlock, groups = K / p.G;
  const S* sp = static_cast<const S*>(p.s);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 facc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) facc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 t[R][kVecs];
    float s_sum[R];
    for (int r = 0; r < R; ++r) {
      s_sum[r] = 0.f;
      for (int c = 0; c < kVecs; ++c) t[r][c] = _mm512_setzero_ps();
    }
    for (int64_t bi = 0; bi < bpg; ++bi) {
      const int64_t b = g * bpg + bi;
      const uint8_t* wb = p.w + b * kBlockBytes;
      for (int64_t line = 0; line < kBlockBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + line), _MM_HINT_T0);
      __m512i acc[R][kVecs];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        __m512i lo[kVecs], hi[kVecs];
        for (int c = 0; c < kVecs; ++c) {
          const __m512i raw = _mm512_loadu_si512(wb + (j * kVecs + c) * 64);
          lo[c] = _mm512_and_si512(raw, nibble);
          hi[c] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = a.q + (m0 + r) * K + b * kBlock + 4 * j;
          int32_t first, second;
          std::memcpy(&first, xq, 4);
          std::memcpy(&second, xq + 16, 4);
          const __m512i xa = _mm512_set1_epi32(first), xb = _mm512_set1_epi32(second);
          for (int c = 0; c < kVecs; ++c) {
            acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], lo[c], xa);
            acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], hi[c], xb);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 sa = _mm512_set1_ps(a.scale[(m0 + r) * KB + b]);
        s_sum[r] += a.ssum[(m0 + r) * KB + b];
        for (int c = 0; c < kVecs; ++c)
          t[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), sa, t[r][c]);
      }
    }
    const S* sg = sp + g * 2 * kPanel;
    for (int c = 0; c < kVecs; ++c) {
      const __m512 d = load_meta(sg + c * kLanes), m = load_meta(sg + kPanel + c * kLanes);
      for (int r = 0; r < R; ++r) {
        facc[r][c] = _mm512_fmadd_ps(d, t[r][c], facc[r][c]);
        facc[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(s_sum[r]), facc[r][c]);
      }
    }
  }
  finish_tile<R>(facc, a, m0, p.out_w, y, N, p.n0, p.cols, bias);
}

// Many rows (a prompt chunk): the panel's nibbles are widened once into bytes, laid out as
// the int8 kernel's (a block's eight quads of k, each two vectors of 16 columns x 4 k), so
// that each tile of rows reads them with a load and no unpacking, and holds more rows (6 where
// a group is one block: no per-group sums to keep). Each row's sums are the nibble tile's in
// another order of exact integer additions, folded alike: the same results.
// From this many rows of a task the panel is widened: fewer (a decode step) are bound by
// reading the nibbles, which the nibble tiles prefetch as they go.
constexpr int64_t kWideRows = 17;
constexpr int64_t kWideBlockBytes = kBlock * kPanel;  // 1 KB a block

void widen_panel(const Panel& p, uint8_t* wide) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < p.K / kBlock; ++b) {
    const uint8_t* wb = p.w + b * kBlockBytes;
    uint8_t* out = wide + b * kWideBlockBytes;
    for (int64_t line = 0; line < kBlockBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wb + kPrefetchBytes + line), _MM_HINT_T0);
    for (int j = 0; j < 4; ++j)
      for (int c = 0; c < kVecs; ++c) {
        const __m512i raw = _mm512_loadu_si512(wb + (j * kVecs + c) * 64);
        _mm512_storeu_si512(out + (j * kVecs + c) * 64, _mm512_and_si512(raw, nibble));
        _mm512_storeu_si512(out + ((j + 4) * kVecs + c) * 64,
                            _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble));
      }
  }
}

// R rows x kVecs vectors of a widened panel, over all of K; `single`: a group is one block.
template <int R, typename S, bool single>
void wide_tile(const QuantRows& a, int64_t m0, const Panel& p, const uint8_t* wide, float* y,
               int64_t N, const float* bias) {
  const int64_t K = p.K, KB = K / kBlock, bpg = p.G / kBlock, groups = K / p.G;
  const S* sp = static_cast<const S*>(p.s);
  __m512 facc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kVecs; ++c) facc[r][c] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 t[single ? 1 : R][kVecs];
    float s_sum[R];
    for (int r = 0; r < R; ++r) s_sum[r] = 0.f;
    if constexpr (!single)
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < kVecs; ++c) t[r][c] = _mm512_setzero_ps();
    __m512 ts[R][kVecs];  // single: this block's scaled sums
    for (int64_t bi = 0; bi < bpg; ++bi) {
      const int64_t b = g * bpg + bi;
      const uint8_t* wb = wide + b * kWideBlockBytes;
      __m512i acc[R][kVecs];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_setzero_si512();
      for (int quad = 0; quad < 8; ++quad) {
        __m512i w[kVecs];
        for (int c = 0; c < kVecs; ++c) w[c] = _mm512_loadu_si512(wb + (quad * kVecs + c) * 64);
        for (int r = 0; r < R; ++r) {
          int32_t four;
          std::memcpy(&four, a.q + (m0 + r) * K + b * kBlock + quad * 4, 4);
          const __m512i x = _mm512_set1_epi32(four);
          for (int c = 0; c < kVecs; ++c) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], w[c], x);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 sa = _mm512_set1_ps(a.scale[(m0 + r) * KB + b]);
        s_sum[r] += a.ssum[(m0 + r) * KB + b];
        for (int c = 0; c < kVecs; ++c) {
          if constexpr (single)  // fma(x, sa, 0): the nibble tile's first fold, exactly
            ts[r][c] = _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][c]), sa);
          else
            t[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][c]), sa, t[r][c]);
        }
      }
    }
    const S* sg = sp + g * 2 * kPanel;
    for (int c = 0; c < kVecs; ++c) {
      const __m512 d = load_meta(sg + c * kLanes), m = load_meta(sg + kPanel + c * kLanes);
      for (int r = 0; r < R; ++r) {
        facc[r][c] = _mm512_fmadd_ps(d, single ? ts[r][c] : t[single ? 0 : r][c], facc[r][c]);
        facc[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(s_sum[r]), facc[r][c]);
      }
    }
  }
  finish_tile<R>(facc, a, m0, p.out_w, y, N, p.n0, p.cols, bias);
}

template <int R, typename S>
void wide_tile_of(bool single, const QuantRows& a, int64_t m, const Panel& p,
                  const uint8_t* wide, float* y, int64_t N, const float* bias) {
  if (single)
    wide_tile<R, S, true>(a, m, p, wide, y, N, bias);
  else
    wide_tile<(R > 4 ? 4 : R), S, false>(a, m, p, wide, y, N, bias);
}

template <typename S>
void vnni_rows(const QuantRows& a, int64_t m0, int64_t m1, const Panel& p, float* y, int64_t N,
               const float* bias) {
  if (m1 - m0 >= kWideRows) {
    thread_local std::vector<uint8_t> wide;
    wide.resize(p.K / kBlock * kWideBlockBytes);
    widen_panel(p, wide.data());
    const bool single = p.G == kBlock;
    const int tile = single ? 6 : 4;
    for (int64_t m = m0; m < m1; m += tile) {
      switch (std::min<int64_t>(tile, m1 - m)) {
        case 1: wide_tile_of<1, S>(single, a, m, p, wide.data(), y, N, bias); break;
        case 2: wide_tile_of<2, S>(single, a, m, p, wide.data(), y, N, bias); break;
        case 3: wide_tile_of<3, S>(single, a, m, p, wide.data(), y, N, bias); break;
        case 4: wide_tile_of<4, S>(single, a, m, p, wide.data(), y, N, bias); break;
        case 5: wide_tile_of<5, S>(single, a, m, p, wide.data(), y, N, bias); break;
        default: wide_tile_of<6, S>(single, a, m, p, wide.data(), y, N, bias); break;
      }
    }
    return;
  }
  for (int64_t m = m0; m < m1; m += kRowTile) {
    switch (std::min<int64_t>(kRowTile, m1 - m)) {
      case 1: vnni_tile<1, S>(a, m, p, y, N, bias); break;
      case 2: vnni_tile<2, S>(a, m, p, y, N, bias); break;
      case 3: vnni_tile<3, S>(a, m, p, y, N, bias); break;
      default: vnni_tile<4, S>(a, m, p, y, N, bias); break;
    }
  }
}
#else
constexpr bool kVnni = false;
#endif

// Portable: one row at a time, the panel's 32 columns as vectorizable int32 sums, folded in
// the order the VNNI tile folds them.
template <typename S>
void portable_rows(const QuantRows& a, int64_t m0, int64_t m1, const Panel& p, float* y,
                   int64_t N, const float* bias) {
  const int64_t K = p.K, KB = K / kBlock, bpg = p.G / kBlock, groups = K / p.G;
  const S* sp = static_cast<const S*>(p.s);
  for (int64_t m = m0; m < m1; ++m) {
    const int8_t* xq = a.q + m * K;
    float facc[kPanel] = {};
    for (int64_t g = 0; g < groups; ++g) {
      float t[kPanel] = {};
      float s_sum = 0.f;
      for (int64_t bi = 0; bi < bpg; ++bi) {
        const int64_t b = g * bpg + bi;
        const uint8_t* wb = p.w + b * kBlockBytes;
        int32_t acc[kPanel] = {};
        for (int j = 0; j < 4; ++j) {
          const int8_t* xa = xq + b * kBlock + 4 * j;
          for (int c = 0; c < kVecs; ++c) {
            const uint8_t* w4 = wb + (j * kVecs + c) * 64;
#pragma omp simd
            for (int64_t l = 0; l < kLanes; ++l) {
              int32_t s = 0;
              for (int i = 0; i < 4; ++i) {
                const int32_t byte = w4[l * 4 + i];
                s += (byte & 15) * int32_t(xa[i]) + (byte >> 4) * int32_t(xa[16 + i]);
              }
              acc[c * kLanes + l] += s;
            }
          }
        }
        const float sa = a.scale[m * KB + b];
        s_sum += a.ssum[m * KB + b];
        for (int64_t l = 0; l < kPanel; ++l) t[l] = std::fma(float(acc[l]), sa, t[l]);
      }
      const S* sg = sp + g * 2 * kPanel;
      for (int64_t l = 0; l < kPanel; ++l) {
        facc[l] = std::fma(meta(sg + l), t[l], facc[l]);
        facc[l] = std::fma(meta(sg + kPanel + l), s_sum, facc[l]);
      }
    }
    finish_row(facc, a, m, p.out_w, y, N, p.n0, p.cols, bias);
  }
}

}  // namespace

namespace slipstream_cpu {

void q4_panel_rows(const QuantRows& a, int64_t m0, int64_t m1, const Q4Panel& p, float* y,
                   int64_t N, const float* bias) {
#if defined(__AVX512VNNI__)
  if (!g_force_portable) {
    if (p.half)
      vnni_rows<uint16_t>(a, m0, m1, p, y, N, bias);
    else
      vnni_rows<float>(a, m0, m1, p, y, N, bias);
    return;
  }
#endif
  if (p.half)
    portable_rows<uint16_t>(a, m0, m1, p, y, N, bias);
  else
    portable_rows<float>(a, m0, m1, p, y, N, bias);
}

}  // namespace slipstream_cpu

namespace {

template <typename S>
void run(const QuantRows& a, int64_t M, int64_t K, int64_t G, int64_t N, const uint8_t* wp,
         const S* sp, const Outliers& o, const float* bias, float* y) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  slipstream_cpu::for_panel_rows(panels, M, [&](int64_t pi, int64_t m0, int64_t m1) {
    const Panel p{wp + pi * kPanel * K / 2,
                  sp + pi * 2 * kPanel * (K / G),
                  o.w ? o.w + pi * o.k * kPanel : nullptr,
                  K,
                  G,
                  pi * kPanel,
                  std::min(kPanel, N - pi * kPanel),
                  std::is_same_v<S, uint16_t>};
    slipstream_cpu::q4_panel_rows(a, m0, m1, p, y, N, bias);
  });
}

at::Tensor q4_gemm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                   int64_t G, int64_t N, const c10::optional<at::Tensor>& bias,
                   const c10::optional<at::Tensor>& outlier_idx,
                   const c10::optional<at::Tensor>& outlier_w,
                   const c10::optional<at::Tensor>& perm) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "q4_gemm: x must be float32 [M, K], rows contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0 && K > 0, "q4_gemm: K must be a positive multiple of 32");
  TORCH_CHECK(G % kBlock == 0 && G > 0 && K % G == 0,
              "q4_gemm: the group must be a multiple of 32 that divides K");
  const int64_t panels = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(N > 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == panels * kPanel * K / 2,
              "q4_gemm: packed weight must be uint8 [N/32, K/32, 4, 2, 16, 4] for this K and N");
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) &&
                  scales.is_contiguous() && scales.numel() == panels * 2 * kPanel * (K / G),
              "q4_gemm: scales must be float32 or float16 [N/32, K/G, 2, 32]");
  const slipstream_cpu::QuantizedProduct q = slipstream_cpu::quantized_product(
      "q4_gemm", x, N, panels, bias, outlier_idx, outlier_w, perm);
  if (M == 0) return q.y;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = q.y.data_ptr<float>();
  if (scales.scalar_type() == at::kHalf) {
    run(q.x.rows, M, K, G, N, wp, reinterpret_cast<const uint16_t*>(scales.data_ptr()),
        q.outliers, q.bias, yp);
  } else {
    run(q.x.rows, M, K, G, N, wp, scales.data_ptr<float>(), q.outliers, q.bias, yp);
  }
  return q.y;
}

}  // namespace

SLIPSTREAM_CPU_PRODUCT(q4_gemm,
                       "q4_gemm(Tensor x, Tensor packed, Tensor scales, int group, int n, "
                       "Tensor? bias, Tensor? outlier_idx=None, Tensor? outlier_w=None, "
                       "Tensor? perm=None) -> Tensor",
                       kVnni, "avx512_vnni", g_force_portable)
