// Paged decode attention for CPU: each decode row attends over its sequence's K/V blocks,
// read in place from the paged cache (no gather copy) and only once.
//
// Built and loaded at run time by slipstream/worker/ops/cpu_kernels.py (g++, no pybind):
// torch.ops.slipstream_cpu.paged_decode_attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_attention_checks.h"
#include "cpu_parallel.h"

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void check(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
           const at::Tensor& value_cache, const at::Tensor& block_tables,
           const at::Tensor& seq_lens, const at::Tensor& rows) {
  slipstream_cpu::check_attention_io("paged_decode_attention", out, query, key_cache,
                                     value_cache, block_tables);
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens int32");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous(), "rows int64");
  TORCH_CHECK(rows.size(0) == seq_lens.size(0) && block_tables.size(0) == seq_lens.size(0),
              "one row, one block table and one length per sequence");
}

// out[rows[i]] = softmax(scale * q k^T) v over sequence i's first seq_lens[i] cached tokens
// (the last sliding_window of them when > 0; scores tanh-capped when softcap > 0).
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& rows, double scale,
                            int64_t sliding_window, double softcap) {
  check(out, query, key_cache, value_cache, block_tables, seq_lens, rows);
  const int64_t num_seqs = seq_lens.size(0);
  const int64_t H = query.size(1), D = query.size(2);
  const int64_t block_size = key_cache.size(1), Hkv = key_cache.size(2), G = H / Hkv;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t token_stride = Hkv * D, block_stride = block_size * token_stride;
  const int64_t q_row = query.stride(0), q_head = query.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const int64_t table_stride = block_tables.stride(0);
  const float* q_base = query.data_ptr<float>();
  float* o_base = out.data_ptr<float>();
  const float* k_base = key_cache.data_ptr<float>();
  const float* v_base = value_cache.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(softcap);

  // A work item is one sequence with all its KV heads, so that K and V are read as whole
  // token rows (Hkv * D contiguous floats), each once; with fewer sequences than threads an
  // item is one (sequence, KV head) pair instead.
  const int64_t heads_per_item = num_seqs >= at::get_num_threads() ? Hkv : 1;
  const int64_t items_per_seq = Hkv / heads_per_item;
  // Items are taken one at a time: sequences differ in length, and a thread stalled by
  // another process must not hold up the rest.
  slipstream_cpu::dynamic_for(num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    // Per thread, not per call: dynamic_for calls this once per item.
    thread_local std::vector<float> scores, acc, sums;
    acc.resize(heads_per_item * G * D);
    sums.resize(heads_per_item * G);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / items_per_seq;
      const int64_t h0 = (item % items_per_seq) * heads_per_item;  // first KV head
      const int64_t nq = heads_per_item * G;  // query heads of this item
      const int64_t len = lens[seq];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t n = len - first;
      const float* q = q_base + row_of[seq] * q_row + h0 * G * q_head;
      float* o = o_base + row_of[seq] * o_row + h0 * G * o_head;
      if (n <= 0) {
        for (int64_t j = 0; j < nq; ++j) std::fill(o + j * o_head, o + j * o_head + D, 0.f);
        continue;
      }
      TORCH_CHECK((len + block_size - 1) / block_size <= max_blocks, "block table too short");
      const int32_t* table = tables + seq * table_stride;
      scores.resize(nq * n);
      // scores[j, t]: query head j (of this item) against every visible token t
      for (int64_t t = first; t < len; ++t) {
        const float* k = k_base + table[t / block_size] * block_stride +
                         (t % block_size) * token_stride + h0 * D;
        for (int64_t j = 0; j < nq; ++j) {
          float s = dot(q + j * q_head, k + (j / G) * D, D) * fscale;
          if (cap > 0.f) s = std::tanh(s / cap) * cap;
          scores[j * n + (t - first)] = s;
        }
      }
      // softmax per query head, kept unnormalised (divided once at the end)
      for (int64_t j = 0; j < nq; ++j) {
        float* s = scores.data() + j * n;
        float m = s[0];
        for (int64_t i = 1; i < n; ++i) m = std::max(m, s[i]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; ++i) {
          s[i] = std::exp(s[i] - m);
          sum += s[i];
        }
        sums[j] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = first; t < len; ++t) {
        const float* v = v_base + table[t / block_size] * block_stride +
                         (t % block_size) * token_stride + h0 * D;
        for (int64_t j = 0; j < nq; ++j)
          axpy(acc.data() + j * D, scores[j * n + (t - first)], v + (j / G) * D, D);
      }
      for (int64_t j = 0; j < nq; ++j) {
        const float inv = 1.f / sums[j];
        float* oj = o + j * o_head;
        const float* aj = acc.data() + j * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) oj[d] = aj[d] * inv;
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(slipstream_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor seq_lens, Tensor rows, float scale, "
      "int sliding_window, float softcap) -> ()");
}

TORCH_LIBRARY_IMPL(slipstream_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
