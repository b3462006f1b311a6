// Paged decode attention for CPU: each decode row attends over its sequence's K/V blocks,
// read in place from the paged cache (no gather copy) and only once.
//
// A decode step reads every cached token of every sequence once in every layer (64
// sequences of 300 tokens: ~0.9 GB of fp32 K/V a step), so the kernel is bound by memory:
// the next tile's rows are prefetched while one is computed, and the arithmetic is kept
// small beside the loads (16 tokens' dot products summed across lanes together; softmax
// exponentials 16 at a time). bf16 caches are widened exactly as they are read.
//
// Built and loaded at run time by slipstream/worker/kernels/build.py (g++, no pybind):
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
#include "cpu_op_registration.h"
#include "cpu_paged_rows.h"
#include "cpu_parallel.h"
#include "cpu_products.h"
#include "cpu_vector.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using slipstream_cpu::exp_nonpositive;
using slipstream_cpu::load16;
using slipstream_cpu::splat;
using slipstream_cpu::sum_lanes16;
using slipstream_cpu::v16;
using slipstream_cpu::v16u;

constexpr int64_t TILE = 16;  // tokens whose scores are computed (and summed) together
constexpr int64_t ACC = 16;   // vectors of value sums held in registers at once

using Geometry = slipstream_cpu::AttentionGeometry;

struct Scratch {
  std::vector<float> scores, acc, sums, tile;  // tile: a bf16 key tile widened
  std::vector<uint16_t> q_bf16;                // the item's query heads rounded to bf16
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

// Scores of query heads [0, nq) against the n keys, 16 tokens' dot products with one query
// head summed across lanes at once: scores[j * n_pad + t].
template <int ND, typename T>
void scores_fp32(const Geometry& g, const float* q, const T* const* k, int64_t n, int64_t nq,
                 int64_t n_pad, int64_t heads, float* scores, Scratch& sc) {
  constexpr int64_t D = ND * 16;
  const int64_t row_bytes = heads * D * static_cast<int64_t>(sizeof(T));
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
}

#if defined(__AVX512BF16__)
// Prefetches of a tile's rows handed out a few at a time between the dot products: issued all
// at once (96 lines a tile) they stalled the core on its line-fill buffers.
struct SpreadPrefetch {
  const uint16_t* const* rows = nullptr;
  int64_t n = 0, lines = 0, next = 0;  // n rows of `lines` 64-byte lines each

  void start(const uint16_t* const* r, int64_t count, int64_t row_lines) {
    rows = r, n = count, lines = row_lines, next = 0;
  }
  void issue(int64_t count) {
    for (const int64_t end = std::min(n * lines, next + count); next < end; ++next)
      __builtin_prefetch(reinterpret_cast<const char*>(rows[next / lines]) + next % lines * 64,
                         0, 2);
  }
};

// A bf16 cache on a CPU with AVX512-BF16: each query head rounded to bf16 once, and q.k on
// vdpbf16ps straight from the cached rows (products exact, sums in fp32), as vLLM's bf16
// model computes it; widening every key and summing in fp32 took three times the arithmetic.
// While a tile's scores are computed, the next tile's keys and this tile's values are
// prefetched, spread between the dot products, so that the values pass reads its rows from
// the core's own cache (a sequence's 270 tokens are ~100 KB of values a layer).
template <int ND>
void scores_bf16(const Geometry& g, const float* q, const uint16_t* const* k,
                 const uint16_t* const* v, int64_t n, int64_t nq, int64_t n_pad, int64_t heads,
                 float* scores, Scratch& sc) {
  constexpr int64_t D = ND * 16;
  constexpr int NC = ND / 2;  // 32 bf16 a vector
  const int64_t row_lines = (heads * D * 2 + 63) / 64;
  sc.q_bf16.resize(nq * D);
  for (int64_t j = 0; j < nq; ++j)
    for (int c = 0; c < NC; ++c) {
      const float* src = q + j * g.q_head + c * 32;
      const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
      _mm512_storeu_si512(sc.q_bf16.data() + j * D + c * 32, (__m512i)pair);
    }
  prefetch_rows(k, std::min<int64_t>(n, TILE), heads * D * 2);
  SpreadPrefetch keys, values;
  const int64_t per_head = (TILE * row_lines + nq - 1) / nq;
  for (int64_t t0 = 0; t0 < n; t0 += TILE) {
    const int64_t tn = std::min<int64_t>(TILE, n - t0);
    keys.start(k + t0 + TILE, t0 + TILE < n ? std::min<int64_t>(TILE, n - t0 - TILE) : 0,
               row_lines);
    values.start(v + t0, tn, row_lines);
    const uint16_t* rows[TILE];
    for (int64_t t = 0; t < TILE; ++t) rows[t] = k[t0 + std::min(t, tn - 1)];
    for (int64_t j = 0; j < nq; ++j) {
      keys.issue(per_head);
      values.issue(per_head);
      const int64_t off = (j / g.G) * D;
      __m512 acc[TILE];
      for (int64_t t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) {
        const __m512bh qc = (__m512bh)_mm512_loadu_si512(sc.q_bf16.data() + j * D + c * 32);
#pragma GCC unroll 16
        for (int64_t t = 0; t < TILE; ++t)
          acc[t] = _mm512_dpbf16_ps(acc[t], qc,
                                    (__m512bh)_mm512_loadu_si512(rows[t] + off + c * 32));
      }
      v16 lanes[TILE];
      for (int64_t t = 0; t < TILE; ++t) lanes[t] = (v16)acc[t];
      v16 s = sum_lanes16(lanes) * g.scale;
      if (g.cap > 0.f)
        for (int i = 0; i < TILE; ++i) s[i] = std::tanh(s[i] / g.cap) * g.cap;
      *reinterpret_cast<v16u*>(scores + j * n_pad + t0) = s;
    }
    keys.issue(TILE * row_lines);  // what the heads left (none unless nq < lines)
    values.issue(TILE * row_lines);
  }
}
#endif

// out_j = sum_t p[j, t] v_t / sum_j: JG query heads of one KV head keep their sums in
// registers through a tile of tokens, each value row read (and widened) once for them.
// `cached`: the scores pass already brought the values in (scores_bf16).
template <int ND, int JG, typename T>
void values(const Geometry& g, const T* const* v, int64_t n, int64_t nq, int64_t n_pad,
            int64_t heads, const float* scores, Scratch& sc, bool cached) {
  constexpr int64_t D = ND * 16;
  const int64_t row_bytes = heads * D * static_cast<int64_t>(sizeof(T));
  sc.acc.assign((nq + JG) * D, 0.f);
  if (!cached) prefetch_rows(v, std::min<int64_t>(n, TILE), row_bytes);
  for (int64_t t0 = 0; t0 < n; t0 += TILE) {
    const int64_t tn = std::min<int64_t>(TILE, n - t0);
    if (!cached && t0 + TILE < n)
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
}

// One work item: query heads j0.. (nq of them, the G of each of its KV heads h0..) of one
// row, over its n visible tokens (rows k and v). ND: head_dim / 16.
template <int ND, typename T>
void attend_item(const Geometry& g, const float* q, float* o, const T* const* k,
                 const T* const* v, int64_t n, int64_t heads, Scratch& sc) {
  constexpr int64_t D = ND * 16;
  const int64_t nq = heads * g.G;
  const int64_t n_pad = (n + TILE - 1) / TILE * TILE;
  // As many query heads summed together as share a KV head, up to what registers hold.
  constexpr int JG_MAX = ACC / ND > 0 ? ACC / ND : 1;
  const int jg = static_cast<int>(std::min<int64_t>(g.G, JG_MAX));
  sc.scores.resize((nq + JG_MAX) * n_pad);
  float* scores = sc.scores.data();
  std::fill(scores + nq * n_pad, scores + (nq + JG_MAX) * n_pad, 0.f);  // padding rows
  bool cached = false;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, uint16_t> && ND % 2 == 0) {
    scores_bf16<ND>(g, q, k, v, n, nq, n_pad, heads, scores, sc);
    cached = true;
  } else
#endif
    scores_fp32<ND, T>(g, q, k, n, nq, n_pad, heads, scores, sc);
  sc.sums.resize(nq);
  for (int64_t j = 0; j < nq; ++j) sc.sums[j] = exponentiate(scores + j * n_pad, n);
  if (jg == 1 || JG_MAX == 1)
    values<ND, 1, T>(g, v, n, nq, n_pad, heads, scores, sc, cached);
  else if (jg == 2 || JG_MAX == 2)
    values<ND, (JG_MAX >= 2 ? 2 : 1), T>(g, v, n, nq, n_pad, heads, scores, sc, cached);
  else if (jg == 3)
    values<ND, (JG_MAX >= 3 ? 3 : 1), T>(g, v, n, nq, n_pad, heads, scores, sc, cached);
  else
    values<ND, JG_MAX, T>(g, v, n, nq, n_pad, heads, scores, sc, cached);
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

// Work items [begin, end) of the step: item i is sequence i / (Hkv / heads) with `heads` of
// its KV heads (all of them, or one: items_per_step says which).
template <typename T>
void attend_items(at::Tensor& out, const at::Tensor& query, const T* k_base, const T* v_base,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  const at::Tensor& rows, const Geometry& g, int64_t heads, int64_t begin,
                  int64_t end) {
  const float* q_base = query.data_ptr<float>();
  float* o_base = out.data_ptr<float>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* row_of = rows.data_ptr<int64_t>();
  const int64_t items_per_seq = g.Hkv / heads;
  thread_local Scratch sc;  // per thread, not per call: a step calls this per item
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
}

}  // namespace

namespace slipstream_cpu {

// A work item is one sequence with all its KV heads, so that K and V are read as whole token
// rows (Hkv * D contiguous values), each once; with fewer sequences than threads an item is
// one (sequence, KV head) pair instead.
int64_t decode_attention_heads_per_item(int64_t num_seqs, int64_t kv_heads, int64_t threads) {
  return num_seqs >= threads ? kv_heads : 1;
}

void decode_attention_items(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& rows, double scale,
                            int64_t sliding_window, double softcap, int64_t heads,
                            int64_t begin, int64_t end) {
  const Geometry g =
      attention_geometry(out, query, key_cache, block_tables, scale, sliding_window, softcap);
  if (key_cache.scalar_type() == at::kBFloat16) {
    attend_items(out, query, reinterpret_cast<const uint16_t*>(key_cache.data_ptr()),
                 reinterpret_cast<const uint16_t*>(value_cache.data_ptr()), block_tables,
                 seq_lens, rows, g, heads, begin, end);
  } else {
    attend_items(out, query, key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                 block_tables, seq_lens, rows, g, heads, begin, end);
  }
}

}  // namespace slipstream_cpu

namespace {

// out[rows[i]] = softmax(scale * q k^T) v over sequence i's first seq_lens[i] cached tokens
// (the last sliding_window of them when > 0; scores tanh-capped when softcap > 0). The caches
// are fp32 or bf16; every sum runs in fp32.
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& rows, double scale,
                            int64_t sliding_window, double softcap) {
  check(out, query, key_cache, value_cache, block_tables, seq_lens, rows);
  const int64_t num_seqs = seq_lens.size(0), kv_heads = key_cache.size(2);
  const int64_t heads =
      slipstream_cpu::decode_attention_heads_per_item(num_seqs, kv_heads, at::get_num_threads());
  // Items are taken one at a time: sequences differ in length, and a thread stalled by
  // another process must not hold up the rest.
  slipstream_cpu::dynamic_for(num_seqs * (kv_heads / heads), 1, [&](int64_t begin, int64_t end) {
    slipstream_cpu::decode_attention_items(out, query, key_cache, value_cache, block_tables,
                                           seq_lens, rows, scale, sliding_window, softcap, heads,
                                           begin, end);
  });
}

// Whether decode rows over a bf16 cache take q.k on vdpbf16ps with q rounded to bf16
// (scores_bf16); else every path widens the cache and sums in fp32.
bool decode_rounds_query_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slipstream_cpu, m) {
  m.def("decode_rounds_query_bf16() -> bool", &decode_rounds_query_bf16);
}

SLIPSTREAM_CPU_OP(paged_decode_attention,
                  "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "
                  "Tensor value_cache, Tensor block_tables, Tensor seq_lens, Tensor rows, "
                  "float scale, int sliding_window, float softcap) -> ()")
