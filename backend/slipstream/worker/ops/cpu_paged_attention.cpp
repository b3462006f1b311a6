// Paged decode attention for CPU: each decode row attends over its sequence's K/V blocks,
// read in place from the paged cache (no gather copy) and only once.
//
// A decode step reads every cached token of every sequence once in every layer (64
// sequences of 300 tokens: ~0.9 GB of fp32 K/V a step), so the kernel is bound by memory:
// the next tile's rows are prefetched while one is computed, and the arithmetic is kept
// small beside the loads (16 tokens' dot products summed across lanes together; softmax
// exponentials 16 at a time). bf16 caches are widened exactly as they are read.
//
// Built and loaded at run time by slipstream/worker/ops/cpu_kernels.py (g++, no pybind):
// torch.ops.slipstream_cpu.paged_decode_attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>











#include "cpu_attention_checks.h"
#include "cpu_paged_rows.h"
#include "cpu_parallel.h"
#include "cpu_vector.h"

namespace {

using slipstream_cpu::exp_nonpositive;
using slipstream_cpu::load16;
using slipstream_cpu::splat;
using slipstream_cpu::sum_lanes16;
using slipstream_cpu::v16;
using slipstream_cpu::v16u;

constexpr int64_t TILE = 16;  // tokens whose scores are computed (and summed) together
constexpr int64_t ACC = 16;   // vectors of value sums held in registers at once

struct Geometry {
  int64_t H, G, Hkv, D, block_size, token_stride, block_stride, max_blocks;
  int64_t q_row, q_head, o_row, o_head, table_stride;
  float scale, cap;
  int64_t window;
};

struct Scratch {
  std::vector<float> scores, acc, sums, tile;  // tile: a bf16 key tile widened
  std::vector<const void*> rows;  // the item's token rows (K then V), in order
};

// Pulls a tile's rows (the item's heads of each token) towards the core while the tile
// before it is computed: the cache is read from memory once a step, and the two threads'
// sums alone leave the memory system idle between their loads.
template <typename T>
inline void prefetch_rows(const T* const* rows, int64_t n, int64_t bytes) {
  for (int64_t t = 0; t < n; ++t) {
    const char* p = reinterpret_cast<const char*>(rows[t]);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
  }
}

// softmax numerators of s[0..n-1] in place (scores past n in the last vector ignored);
// returns their sum
inline float exponentiate(float* s, int64_t n) {
  const int64_t full = n / TILE * TILE;
  v16 mv = splat(-3.0e38f);
  for (int64_t i = 0; i < full; i += TILE) {
    const v16 x = load16(s + i);
    mv = x > mv ? x : mv;
  }
  float m = -3.0e38f;
  for (int i = 0; i < TILE; ++i) m = std::max(m, mv[i]);
  for (int64_t i = full; i < n; ++i) m = std::max(m, s[i]);
  v16 sum = {};
  for (int64_t i = 0; i < full; i += TILE) {
    const v16 e = exp_nonpositive(load16(s + i) - m);
    sum += e;
    *reinterpret_cast<v16u*>(s + i) = e;
  }
  float total = 0.f;
  for (int i = 0; i < TILE; ++i) total += sum[i];
  if (full < n) {
    v16 x = splat(-87.3f);
    for (int64_t i = full; i < n; ++i) x[i - full] = s[i] - m;
    const v16 e = exp_nonpositive(x);
    for (int64_t i = full; i < n; ++i) {
      s[i] = e[i - full];
      total += e[i - full];
    }
  }
  return total;
}

// One work item: query heads j0.. (nq of them, the G of each of its KV heads h0..) of one
// row, over its n visible tokens (rows k and v). ND: head_dim / 16.
template <int ND, typename T>
void attend_item(const Geometry& g, const float* q, float* o, const T* const* k,
                 const T* const* v, int64_t n, int64_t heads, Scratch& sc) {
  constexpr int64_t D = ND * 16;
  const int64_t nq = heads * g.G;
  const int64_t n_pad = (n + TILE - 1) / TILE * TILE;
  const int64_t row_bytes = heads * D * static_cast<int64_t>(sizeof(T));
  constexpr int64_t JG = ACC / ND > 0 ? ACC / ND : 1;  // query heads summed together
  sc.scores.resize((nq + JG) * n_pad);
  float* scores = sc.scores.data();
  std::fill(scores + nq * n_pad, scores + (nq + JG) * n_pad, 0.f);  // padding rows
  // Scores: 16 tokens' dot products with one query head summed across lanes at once.
  prefetch_rows(k, std::min<int64_t>(n, TILE), row_bytes);
  for (int64_t t0 = 0; t0 < n; t0 += TILE) {
    const int64_t tn = std::min<int64_t>(TILE, n - t0);
    if (t0 + TILE < n)
      prefetch_rows(k + t0 + TILE, std::min<int64_t>(TILE, n - t0 - TILE), row_bytes);
    const float* rows[TILE];
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t t = 0; t < TILE; ++t) rows[t] = k[t0 + std::min(t, tn - 1)];
    } else {  // bf16: widened once here, not once per query head
      const int64_t width = heads * D;
      sc.tile.resize(TILE * width);
      for (int64_t t = 0; t < TILE; ++t) {
        const T* src = k[t0 + std::min(t, tn - 1)];
        float* dst = sc.tile.data() + t * width;
        for (int64_t c = 0; c < width; c += 16) *reinterpret_cast<v16u*>(dst + c) = load16(src + c);
        rows[t] = dst;
      }
    }
    for (int64_t j = 0; j < nq; ++j) {
      const float* qj = q + j * g.q_head;
      const int64_t off = (j / g.G) * D;  // the KV head's place in the row
      v16 acc[TILE] = {};
#pragma GCC unroll 8
      for (int d = 0; d < ND; ++d) {
        const v16 qd = load16(qj + d * 16);
#pragma GCC unroll 16
        for (int64_t t = 0; t < TILE; ++t) acc[t] += qd * load16(rows[t] + off + d * 16);
      }
      v16 s = sum_lanes16(acc) * g.scale;
      if (g.cap > 0.f)
        for (int i = 0; i < TILE; ++i) s[i] = std::tanh(s[i] / g.cap) * g.cap;
      *reinterpret_cast<v16u*>(scores + j * n_pad + t0) = s;
    }
  }
  sc.sums.resize(nq);
  for (int64_t j = 0; j < nq; ++j) sc.sums[j] = exponentiate(scores + j * n_pad, n);
  // Values: out_j = sum_t p[j, t] v_t / sum_j; a group of query heads of one KV head keeps
  // its sums in registers through a tile of tokens.
  sc.acc.assign((nq + JG) * D, 0.f);
  prefetch_rows(v, std::min<int64_t>(n, TILE), row_bytes);
  for (int64_t t0 = 0; t0 < n; t0 += TILE) {
    const int64_t tn = std::min<int64_t>(TILE, n - t0);
    if (t0 + TILE < n)
      prefetch_rows(v + t0 + TILE, std::min<int64_t>(TILE, n - t0 - TILE), row_bytes);
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t j0 = h * g.G; j0 < (h + 1) * g.G; j0 += JG) {
        // always JG sums (a fixed count keeps them in registers); those past the KV head's
        // query heads read padding or the next head's weights and are not stored
        const int64_t jn = std::min<int64_t>(JG, (h + 1) * g.G - j0);
        v16 acc[JG][ND];
#pragma GCC unroll 16
        for (int64_t i = 0; i < JG; ++i)
#pragma GCC unroll 8
          for (int d = 0; d < ND; ++d) acc[i][d] = load16(sc.acc.data() + (j0 + i) * D + d * 16);
        const float* p = scores + j0 * n_pad + t0;
        for (int64_t t = 0; t < tn; ++t) {
          const T* row = v[t0 + t] + h * D;
          v16 vv[ND];
#pragma GCC unroll 8
          for (int d = 0; d < ND; ++d) vv[d] = load16(row + d * 16);
#pragma GCC unroll 16
          for (int64_t i = 0; i < JG; ++i) {
            const float pi = p[i * n_pad + t];
#pragma GCC unroll 8
            for (int d = 0; d < ND; ++d) acc[i][d] += pi * vv[d];
          }
        }
        for (int64_t i = 0; i < jn; ++i)
          for (int d = 0; d < ND; ++d)
            *reinterpret_cast<v16u*>(sc.acc.data() + (j0 + i) * D + d * 16) = acc[i][d];
      }
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    const float inv = 1.f / sc.sums[j];
    float* oj = o + j * g.o_head;
    for (int d = 0; d < ND; ++d)
      *reinterpret_cast<v16u*>(oj + d * 16) = load16(sc.acc.data() + j * D + d * 16) * inv;
  }
}

// Any head size: one dot product and one axpy per token and head.
template <typename T>
void attend_item_any(const Geometry& g, const float* q, float* o, const T* const* k,
                     const T* const* v, int64_t n, int64_t heads, Scratch& sc) {
  const int64_t D = g.D, nq = heads * g.G;
  sc.scores.resize(nq * n);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < nq; ++j) {
      const T* kt = k[t] + (j / g.G) * D;
      const float* qj = q + j * g.q_head;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qj[d] * slipstream_cpu::widen(kt[d]);
      s *= g.scale;
      if (g.cap > 0.f) s = std::tanh(s / g.cap) * g.cap;
      sc.scores[j * n + t] = s;
    }
  sc.sums.resize(nq);
  for (int64_t j = 0; j < nq; ++j) sc.sums[j] = exponentiate(sc.scores.data() + j * n, n);
  sc.acc.assign(nq * D, 0.f);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < nq; ++j) {
      const T* vt = v[t] + (j / g.G) * D;
      const float p = sc.scores[j * n + t];
      float* a = sc.acc.data() + j * D;
      for (int64_t d = 0; d < D; ++d) a[d] += p * slipstream_cpu::widen(vt[d]);
    }
  for (int64_t j = 0; j < nq; ++j)
    for (int64_t d = 0; d < D; ++d) o[j * g.o_head + d] = sc.acc[j * D + d] / sc.sums[j];
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

template <typename T>
void run(at::Tensor& out, const at::Tensor& query, const T* k_base, const T* v_base,
         const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& rows,
         const Geometry& g) {
  const int64_t num_seqs = seq_lens.size(0);
  const float* q_base = query.data_ptr<float>();
  float* o_base = out.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  // A work item is one sequence with all its KV heads, so that K and V are read as whole
  // token rows (Hkv * D contiguous values), each once; with fewer sequences than threads an
  // item is one (sequence, KV head) pair instead.
  const int64_t heads = num_seqs >= at::get_num_threads() ? g.Hkv : 1;
  const int64_t items_per_seq = g.Hkv / heads;
  // Items are taken one at a time: sequences differ in length, and a thread stalled by
  // another process must not hold up the rest.
  slipstream_cpu::dynamic_for(num_seqs * items_per_seq, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch sc;  // per thread, not per call: dynamic_for calls this per item
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / items_per_seq;
      const int64_t h0 = (item % items_per_seq) * heads;  // first KV head
      const int64_t len = lens[seq];
      const int64_t first = g.window > 0 ? std::max<int64_t>(0, len - g.window) : 0;
      const int64_t n = len - first;
      const float* q = q_base + row_of[seq] * g.q_row + h0 * g.G * g.q_head;
      float* o = o_base + row_of[seq] * g.o_row + h0 * g.G * g.o_head;
      if (n <= 0) {
        for (int64_t j = 0; j < heads * g.G; ++j)
          std::fill(o + j * g.o_head, o + j * g.o_head + g.D, 0.f);
        continue;
      }
      TORCH_CHECK((len + g.block_size - 1) / g.block_size <= g.max_blocks,
                  "block table too short");
      const int32_t* table = tables + seq * g.table_stride;
      sc.rows.resize(2 * n);
      const T** k = reinterpret_cast<const T**>(sc.rows.data());
      const T** v = k + n;
      slipstream_cpu::paged_rows(k_base, table, g.block_size, g.block_stride, g.token_stride,
                                 h0 * g.D, first, len, k);
      slipstream_cpu::paged_rows(v_base, table, g.block_size, g.block_stride, g.token_stride,
                                 h0 * g.D, first, len, v);
      switch (g.D) {
        case 16: attend_item<1>(g, q, o, k, v, n, heads, sc); break;
        case 32: attend_item<2>(g, q, o, k, v, n, heads, sc); break;
        case 64: attend_item<4>(g, q, o, k, v, n, heads, sc); break;
        case 128: attend_item<8>(g, q, o, k, v, n, heads, sc); break;
        default: attend_item_any(g, q, o, k, v, n, heads, sc); break;
      }
    }
  });
}

// out[rows[i]] = softmax(scale * q k^T) v over sequence i's first seq_lens[i] cached tokens
// (the last sliding_window of them when > 0; scores tanh-capped when softcap > 0). The caches
// are fp32 or bf16; every sum runs in fp32.
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& rows, double scale,
                            int64_t sliding_window, double softcap) {
  check(out, query, key_cache, value_cache, block_tables, seq_lens, rows);
  Geometry g;
  g.H = query.size(1);
  g.D = query.size(2);
  g.block_size = key_cache.size(1);
  g.Hkv = key_cache.size(2);
  g.G = g.H / g.Hkv;
  g.token_stride = g.Hkv * g.D;
  g.block_stride = g.block_size * g.token_stride;
  g.max_blocks = block_tables.size(1);
  g.q_row = query.stride(0);
  g.q_head = query.stride(1);
  g.o_row = out.stride(0);
  g.o_head = out.stride(1);
  g.table_stride = block_tables.stride(0);
  g.scale = static_cast<float>(scale);
  g.cap = static_cast<float>(softcap);
  g.window = sliding_window;
  if (key_cache.scalar_type() == at::kBFloat16) {
    run(out, query, reinterpret_cast<const uint16_t*>(key_cache.data_ptr()),
        reinterpret_cast<const uint16_t*>(value_cache.data_ptr()), block_tables, seq_lens, rows,
        g);
  } else {
    run(out, query, key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), block_tables,
        seq_lens, rows, g);
  }
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
