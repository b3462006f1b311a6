// Activations quantized per row and block of 32 (int8, symmetric), as the int8 and 4-bit
// weight products take them (cpu_q8_gemm.cpp, cpu_q4_gemm.cpp): llama.cpp's Q8_0 rows.
//
// A row's block b holds q (s8, |q| <= 127), its scale s (x ~= q * s) and ssum = s * sum(q),
// the block's sum in the row's units: an int8 weight stored as q + 128 takes 128 * ssum off
// its sums, a 4-bit weight w = d * q + m adds m * ssum. A few outlier channels (found per
// layer at load) are left out of the blocks (zeroed before quantizing) and kept as they are
// in float32; a permutation of K (GPTQ's act-order) is applied as the row is read.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_parallel.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace slipstream_cpu {

constexpr int64_t kQuantBlock = 32;  // K per activation scale

// Quantized rows, [M][K] q and [M][K/32] scale and ssum; the outlier channels' values
// [M][k] as they are.
struct QuantRows {
  const int8_t* q;
  const float* scale;
  const float* ssum;
  const float* out;
  int64_t k;  // outlier channels (0: none)
};

// The outlier channels' weight columns, float32 [N/32][k][32] (a panel's k x 32 together).
struct Outliers {
  const int64_t* idx = nullptr;  // [k], channels of the (permuted) K
  const float* w = nullptr;
  int64_t k = 0;
};

// Row x [K] -> q [K], scale and ssum [K/32] (one compiled copy, in cpu_q8_gemm.cpp: every
// product and the decode stack quantize alike).
void quantize_row(const float* x, int64_t K, int8_t* q, float* scale, float* ssum);

// Rows [0, M) of x (row stride ldx); perm: K-space channel j reads x[:, perm[j]] (or null).
inline void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, const Outliers& o,
                          const int64_t* perm, int8_t* q, float* scale, float* ssum,
                          float* out) {
  const int64_t KB = K / kQuantBlock;
  dynamic_for(M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row((o.k || perm) ? K : 0);
    for (int64_t m = begin; m < end; ++m) {
      const float* xm = x + m * ldx;
      if (perm) {
        for (int64_t j = 0; j < K; ++j) row[j] = xm[perm[j]];
      } else if (o.k) {
        std::copy(xm, xm + K, row.begin());
      }
      if (o.k) {  // the outliers left out of the blocks, kept as they are
        for (int64_t j = 0; j < o.k; ++j) {
          out[m * o.k + j] = row[o.idx[j]];
          row[o.idx[j]] = 0.f;
        }
      }
      if (perm || o.k) xm = row.data();
      quantize_row(xm, K, q + m * K, scale + m * KB, ssum + m * KB);
    }
  });
}

// A product's bias [N] (float32), or null; `op` names the product in errors.
inline const float* product_bias(const char* op, const c10::optional<at::Tensor>& bias,
                                 int64_t n) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              op, ": bias must be float32 [N]");
  return bias->data_ptr<float>();
}

// A product's outlier channels (int64 [k], of its K) and their weight columns (float32
// [N/32, k, 32]), checked.
inline Outliers product_outliers(const char* op, const c10::optional<at::Tensor>& idx,
                                 const c10::optional<at::Tensor>& w, int64_t panels, int64_t K) {
  Outliers o;
  if (!idx.has_value() || !idx->defined() || idx->numel() == 0) return o;
  o.k = idx->numel();
  TORCH_CHECK(idx->scalar_type() == at::kLong && idx->is_contiguous(), op,
              ": outlier_idx must be int64 [k]");
  TORCH_CHECK(w.has_value() && w->defined() && w->scalar_type() == at::kFloat &&
                  w->is_contiguous() && w->numel() == panels * o.k * 32,
              op, ": outlier_w must be float32 [N/32, k, 32]");
  o.idx = idx->data_ptr<int64_t>();
  o.w = w->data_ptr<float>();
  for (int64_t j = 0; j < o.k; ++j)
    TORCH_CHECK(o.idx[j] >= 0 && o.idx[j] < K, op, ": outlier channel out of range");
  return o;
}

// The last of a product's sums: its outlier channels' products added (their weights float32
// [k][32], one 32-column panel's), the bias added and the output columns [n0, n0 + cols) of
// y [M][N] written. The int8 and 4-bit products end their rows alike.
constexpr int64_t kOutlierPanel = 32;

inline void store_row(float* y, int64_t N, int64_t m, int64_t n0, const float* vals,
                      int64_t cols, const float* bias) {
  float* out = y + m * N + n0;
  for (int64_t c = 0; c < cols; ++c) out[c] = vals[c] + (bias ? bias[n0 + c] : 0.f);
}

// One row's 32 sums.
inline void finish_row(float* facc, const QuantRows& a, int64_t m, const float* out_w, float* y,
                       int64_t N, int64_t n0, int64_t cols, const float* bias) {
  for (int64_t j = 0; j < a.k; ++j)
    for (int64_t l = 0; l < kOutlierPanel; ++l)
      facc[l] = std::fma(a.out[m * a.k + j], out_w[j * kOutlierPanel + l], facc[l]);
  store_row(y, N, m, n0, facc, cols, bias);
}

#if defined(__AVX512F__)
// A tile's sums: rows [m0, m0 + R), two vectors of 16 columns each.
template <int R>
inline void finish_tile(__m512 (&facc)[R][2], const QuantRows& a, int64_t m0,
                        const float* out_w, float* y, int64_t N, int64_t n0, int64_t cols,
                        const float* bias) {
  constexpr int kVecs = 2;
  constexpr int64_t kLanes = kOutlierPanel / kVecs;
  for (int64_t j = 0; j < a.k; ++j) {
    __m512 w[kVecs];
    for (int c = 0; c < kVecs; ++c)
      w[c] = _mm512_loadu_ps(out_w + j * kOutlierPanel + c * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 xo = _mm512_set1_ps(a.out[(m0 + r) * a.k + j]);
      for (int c = 0; c < kVecs; ++c) facc[r][c] = _mm512_fmadd_ps(xo, w[c], facc[r][c]);
    }
  }
  alignas(64) float vals[kOutlierPanel];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < kVecs; ++c) _mm512_store_ps(vals + c * kLanes, facc[r][c]);
    store_row(y, N, m0 + r, n0, vals, cols, bias);
  }
}
#endif

// x [M, K] (float32, rows contiguous) quantized: the buffers and their view.
struct QuantizedActivations {
  at::Tensor q, scale, ssum, out;
  QuantRows rows;
};

inline QuantizedActivations quantize_activations(const at::Tensor& x, const Outliers& o,
                                                 const int64_t* perm) {
  const int64_t M = x.size(0), K = x.size(1), KB = K / kQuantBlock;
  QuantizedActivations a;
  a.q = at::empty({M, K}, x.options().dtype(at::kChar));
  a.scale = at::empty({M, KB}, x.options());
  a.ssum = at::empty({M, KB}, x.options());
  a.out = at::empty({M, o.k}, x.options());
  quantize_rows(x.data_ptr<float>(), x.stride(0), M, K, o, perm, a.q.data_ptr<int8_t>(),
                a.scale.data_ptr<float>(), a.ssum.data_ptr<float>(), a.out.data_ptr<float>());
  a.rows = {a.q.data_ptr<int8_t>(), a.scale.data_ptr<float>(), a.ssum.data_ptr<float>(),
            a.out.data_ptr<float>(), o.k};
  return a;
}

// A product's act-order permutation of K (int64 [K]), checked, or null.
inline const int64_t* product_perm(const char* op, const c10::optional<at::Tensor>& perm,
                                   int64_t K) {
  if (!perm.has_value() || !perm->defined() || perm->numel() == 0) return nullptr;
  TORCH_CHECK(perm->scalar_type() == at::kLong && perm->is_contiguous() && perm->numel() == K, op,
              ": perm must be int64 [K]");
  const int64_t* pp = perm->data_ptr<int64_t>();
  for (int64_t j = 0; j < K; ++j)
    TORCH_CHECK(pp[j] >= 0 && pp[j] < K, op, ": perm entry out of range");
  return pp;
}

// What the int8 and 4-bit products start from alike, x [M, K] (float32, rows contiguous)
// having been checked: the bias, outliers and permutation checked, the output y [M, N], and
// x quantized (where M > 0).
struct QuantizedProduct {
  const float* bias;
  Outliers outliers;
  at::Tensor y;
  QuantizedActivations x;
};

inline QuantizedProduct quantized_product(const char* op, const at::Tensor& x, int64_t N,
                                          int64_t panels, const c10::optional<at::Tensor>& bias,
                                          const c10::optional<at::Tensor>& outlier_idx,
                                          const c10::optional<at::Tensor>& outlier_w,
                                          const c10::optional<at::Tensor>& perm) {
  const int64_t M = x.size(0), K = x.size(1);
  QuantizedProduct p;
  p.bias = product_bias(op, bias, N);
  p.outliers = product_outliers(op, outlier_idx, outlier_w, panels, K);
  const int64_t* pp = product_perm(op, perm, K);
  p.y = at::empty({M, N}, x.options());
  if (M > 0) p.x = quantize_activations(x, p.outliers, pp);
  return p;
}

}  // namespace slipstream_cpu
