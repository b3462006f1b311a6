// Activations quantized per row and block of 32 (int8, symmetric), as the int8 and 4-bit
// weight products take them (cpu_q8_gemm.cpp, cpu_q4_gemm.cpp): llama.cpp's Q8_0 rows.
//
// A row's block b holds q (s8, |q| <= 127), its scale s (x ~= q * s) and ssum = s * sum(q),
// the block's sum in the row's units: an int8 weight stored as q + 128 takes 128 * ssum off
// its sums, a 4-bit weight w = d * q + m adds m * ssum. A few outlier channels (found per
// layer at load) are left out of the blocks (zeroed before quantizing) and kept as they are
// in float32; a permutation of K (GPTQ's act-order) is applied as the row is read.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_parallel.h"

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

}  // namespace slipstream_cpu
