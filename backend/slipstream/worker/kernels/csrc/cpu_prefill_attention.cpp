// Paged prefill attention for CPU: the rows of prompt chunks attend causally to their
// sequence's K/V blocks, read in place from the paged cache, a tile of rows at a time.
//
// SDPA on gathered blocks computes every score of the square (masked half included) and
// needs a gathered, permuted copy of the context per chunk and layer; one row at a time (the
// decode kernel) reads the context once per row. Here a work item is one KV head and a tile
// of TILE_ROWS tokens of one chunk: each group of 16 keys is transposed once and meets all
// the tile's query vectors (tokens x the query heads of that KV head) in register-blocked
// FMAs, keys side by side in a vector; only the tile's own causal range is computed.
//
// A row's result depends on that row alone (its query, its context, its position), never on
// the tile, the chunk or the batch around it: scores and the exponentials' sum run over the
// row's own keys in a fixed order, and keys a row must not see enter the value sum as exact
// zeros. The source is compiled without fast-math (see kernels/build.py), so the compiler keeps
// that order; the vector code is written out with GCC vector types, which lower to AVX-512,
// AVX2 or SSE as the machine has them.
//
// Built with the other kernels by slipstream/worker/kernels/build.py:
// torch.ops.slipstream_cpu.paged_prefill_attention.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_attention_checks.h"
#include "cpu_op_registration.h"
#include "cpu_paged_rows.h"
#include "cpu_parallel.h"
#include "cpu_vector.h"

namespace {

using slipstream_cpu::exp_nonpositive;
using slipstream_cpu::i16;
using slipstream_cpu::splat;
using slipstream_cpu::v16;
using slipstream_cpu::v16u;

constexpr int64_t KEYS = 16;       // keys per score vector
constexpr int64_t ITEM_ROWS = 64;  // tokens per work item (its keys are transposed once)
constexpr int64_t TILE_ROWS = 8;   // tokens whose scores are computed together
constexpr int64_t SCORE_GROUP = 8; // query vectors sharing one pass over a key group
constexpr int64_t VALUE_GROUP = 4; // query vectors sharing one pass over the values
static_assert(SCORE_GROUP % VALUE_GROUP == 0, "the score groups pad the rows for both");

inline float hsum(v16 v) {
  float s = 0.f;
  for (int i = 0; i < KEYS; ++i) s += v[i];  // fixed order
  return s;
}

using Geometry = slipstream_cpu::AttentionGeometry;

struct Item {
  int64_t start, q_len, ctx_len;  // the chunk: rows start.., positions ctx_len-q_len..
  const int32_t* table;
  int64_t kv_head, r0, r1;        // chunk rows r0..r1-1 (ITEM_ROWS at most)
};

inline int64_t first_key(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

struct Scratch {
  std::vector<v16> kt;  // key groups transposed: kt[group * D + d][t] = k_(16 group + t)[d]
  std::vector<const float*> k, v;  // k[c], v[c]: the rows of the item's key kt_begin + c
  std::vector<float> q, s, sums;
  std::vector<float> k_wide, v_wide;  // a bf16 cache's rows of the item, widened
};

// The rows of keys k_begin..last in one cache, for the item's KV head.
void token_rows(const float* cache, const Item& it, const Geometry& g, int64_t k_begin,
                int64_t last, int64_t D, std::vector<const float*>& rows) {
  rows.resize(last + 1 - k_begin);
  slipstream_cpu::paged_rows(cache, it.table, g.block_size, g.block_stride, g.token_stride,
                             it.kv_head * D, k_begin, last + 1, rows.data());
}

// The same rows of a bf16 cache, widened (exactly) into ``wide`` once per item: each row is
// then read by every tile of the item.
void token_rows(const uint16_t* cache, const Item& it, const Geometry& g, int64_t k_begin,
                int64_t last, int64_t D, std::vector<float>& wide,
                std::vector<const float*>& rows) {
  const int64_t n = last + 1 - k_begin;
  thread_local std::vector<const uint16_t*> src;
  src.resize(n);
  slipstream_cpu::paged_rows(cache, it.table, g.block_size, g.block_stride, g.token_stride,
                             it.kv_head * D, k_begin, last + 1, src.data());
  wide.resize(n * D);
  rows.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    float* dst = wide.data() + i * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = slipstream_cpu::widen(src[i][d]);
    rows[i] = dst;
  }
}

// The item's keys (rows sc.k), transposed in groups of 16 (zeros past the last): each group
// is then read by every query vector of the item's tiles.
template <int64_t D>
void transpose_keys(Scratch& sc) {
  const int64_t n = static_cast<int64_t>(sc.k.size());
  const int64_t groups = (n + KEYS - 1) / KEYS;
  sc.kt.resize(groups * D);
  for (int64_t grp = 0; grp < groups; ++grp) {
    v16* kt = sc.kt.data() + grp * D;
    for (int64_t t = 0; t < KEYS; ++t) {
      const int64_t c = grp * KEYS + t;
      if (c >= n) {
        for (int64_t d = 0; d < D; ++d) kt[d][t] = 0.f;
      } else {
        const float* k = sc.k[c];
        for (int64_t d = 0; d < D; ++d) kt[d][t] = k[d];
      }
    }
  }
}

// One tile: chunk rows r0..r1-1 (TILE_ROWS at most) of the item; kt and v hold keys from
// kt_begin.
// ND: head_dim / 16.
template <int ND>
void run_tile(const Item& it, const Geometry& g, int64_t r0, int64_t r1, int64_t kt_begin,
              const float* q_base, float* o_base, Scratch& sc) {
  constexpr int64_t D = ND * KEYS;
  const int64_t nq = (r1 - r0) * g.G;  // query vector j: token r0 + j / G, head j % G
  const int64_t nq_pad = (nq + SCORE_GROUP - 1) / SCORE_GROUP * SCORE_GROUP;
  const int64_t pos0 = it.ctx_len - it.q_len;  // position of chunk row 0
  const int64_t last = pos0 + r1 - 1;          // the tile's last key
  const int64_t k_begin = first_key(pos0 + r0, g.window) / KEYS * KEYS;
  const int64_t cols = (last + 1 - k_begin + KEYS - 1) / KEYS * KEYS;

  sc.q.assign(nq_pad * D, 0.f);
  for (int64_t j = 0; j < nq; ++j) {
    const float* src = q_base + (it.start + r0 + j / g.G) * g.q_row +
                       (it.kv_head * g.G + j % g.G) * g.q_head;
    std::memcpy(sc.q.data() + j * D, src, D * sizeof(float));
  }
  sc.s.resize(nq_pad * cols);
  sc.sums.resize(nq_pad);
  const float* qs = sc.q.data();

  // Scores: s[j, c] = q_j . k_(k_begin + c) * scale.
  for (int64_t c0 = 0; c0 < cols; c0 += KEYS) {
    const v16* kt = sc.kt.data() + (k_begin - kt_begin + c0) / KEYS * D;
    for (int64_t j0 = 0; j0 < nq_pad; j0 += SCORE_GROUP) {
      v16 acc[SCORE_GROUP] = {};
      const float* qj = qs + j0 * D;
      for (int64_t d = 0; d < D; ++d) {
        const v16 k = kt[d];
#pragma GCC unroll 8
        for (int64_t i = 0; i < SCORE_GROUP; ++i) acc[i] += qj[i * D + d] * k;
      }
#pragma GCC unroll 8
      for (int64_t i = 0; i < SCORE_GROUP; ++i)
        *reinterpret_cast<v16u*>(sc.s.data() + (j0 + i) * cols + c0) = acc[i] * g.scale;
    }
  }

  // Probabilities, unnormalised: e^(s - max) on the row's own keys, 0 elsewhere.
  v16 lane = {};
  for (int64_t t = 0; t < KEYS; ++t) lane[t] = static_cast<float>(t);
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t pos = pos0 + r0 + j / g.G;
    const int64_t lo = first_key(pos, g.window) - k_begin, hi = pos - k_begin;  // columns
    const int64_t c_lo = lo / KEYS * KEYS;
    float* s = sc.s.data() + j * cols;
    v16 mv = splat(-3.0e38f);
    for (int64_t c0 = c_lo; c0 <= hi; c0 += KEYS) {
      v16 x;
      std::memcpy(&x, s + c0, sizeof(x));
      const v16 col = lane + static_cast<float>(c0);
      const auto seen = (col >= static_cast<float>(lo)) & (col <= static_cast<float>(hi));
      const v16 xs = seen ? x : splat(-3.0e38f);
      mv = xs > mv ? xs : mv;
    }
    float m = mv[0];
    for (int64_t t = 1; t < KEYS; ++t) m = std::max(m, mv[t]);
    v16 sum = {};
    for (int64_t c0 = c_lo; c0 < cols; c0 += KEYS) {
      v16 x;
      std::memcpy(&x, s + c0, sizeof(x));
      const v16 col = lane + static_cast<float>(c0);
      const auto seen = (col >= static_cast<float>(lo)) & (col <= static_cast<float>(hi));
      const v16 e = exp_nonpositive(seen ? x - m : splat(-87.3f));
      const v16 p = seen ? e : splat(0.f);
      sum += p;
      std::memcpy(s + c0, &p, sizeof(p));
    }
    std::fill(s, s + c_lo, 0.f);
    sc.sums[j] = hsum(sum);
  }
  std::fill(sc.s.begin() + nq * cols, sc.s.begin() + nq_pad * cols, 0.f);  // padding rows

  // Values: out_j = sum_c p[j, c] v_c / sum_j, keys in order.
  for (int64_t j0 = 0; j0 < nq; j0 += VALUE_GROUP) {
    v16 acc[VALUE_GROUP][ND] = {};
    const float* p = sc.s.data() + j0 * cols;
    const float* const* rows = sc.v.data() + (k_begin - kt_begin);
    for (int64_t c = 0; c <= last - k_begin; ++c) {
      const v16u* v = reinterpret_cast<const v16u*>(rows[c]);
      v16 vv[ND];
#pragma GCC unroll 8
      for (int d = 0; d < ND; ++d) vv[d] = v[d];
#pragma GCC unroll 4
      for (int64_t i = 0; i < VALUE_GROUP; ++i) {
        const float pi = p[i * cols + c];
#pragma GCC unroll 8
        for (int d = 0; d < ND; ++d) acc[i][d] += pi * vv[d];
      }
    }
    for (int64_t i = 0; i < std::min<int64_t>(VALUE_GROUP, nq - j0); ++i) {
      const int64_t j = j0 + i;
      const float inv = 1.f / sc.sums[j];
      float* o = o_base + (it.start + r0 + j / g.G) * g.o_row +
                 (it.kv_head * g.G + j % g.G) * g.o_head;
      for (int d = 0; d < ND; ++d) reinterpret_cast<v16u*>(o)[d] = acc[i][d] * inv;
    }
  }
}

template <int ND, typename T>
void run_item(const Item& it, const Geometry& g, const float* q_base, const T* k_base,
              const T* v_base, float* o_base, Scratch& sc) {
  const int64_t pos0 = it.ctx_len - it.q_len;
  const int64_t last = pos0 + it.r1 - 1;
  TORCH_CHECK(last / g.block_size < g.max_blocks, "block table too short");
  const int64_t kt_begin = first_key(pos0 + it.r0, g.window) / KEYS * KEYS;
  if constexpr (std::is_same_v<T, float>) {
    token_rows(k_base, it, g, kt_begin, last, ND * KEYS, sc.k);
    token_rows(v_base, it, g, kt_begin, last, ND * KEYS, sc.v);
  } else {
    token_rows(k_base, it, g, kt_begin, last, ND * KEYS, sc.k_wide, sc.k);
    token_rows(v_base, it, g, kt_begin, last, ND * KEYS, sc.v_wide, sc.v);
  }
  transpose_keys<ND * KEYS>(sc);
  for (int64_t r0 = it.r0; r0 < it.r1; r0 += TILE_ROWS)
    run_tile<ND>(it, g, r0, std::min(it.r1, r0 + TILE_ROWS), kt_begin, q_base, o_base, sc);
}

template <typename T>
void run_items(const std::vector<Item>& items, const Geometry& g, int64_t D,
               const at::Tensor& query, const T* k_base, const T* v_base, at::Tensor& out) {
  const float* q_base = query.data_ptr<float>();
  float* o_base = out.data_ptr<float>();
  slipstream_cpu::dynamic_for(static_cast<int64_t>(items.size()), 1, [&](int64_t b, int64_t e) {
    thread_local Scratch sc;
    for (int64_t i = b; i < e; ++i) {
      switch (D / KEYS) {
        case 1: run_item<1>(items[i], g, q_base, k_base, v_base, o_base, sc); break;
        case 2: run_item<2>(items[i], g, q_base, k_base, v_base, o_base, sc); break;
        case 4: run_item<4>(items[i], g, q_base, k_base, v_base, o_base, sc); break;
        default: run_item<8>(items[i], g, q_base, k_base, v_base, o_base, sc); break;
      }
    }
  });
}

void check(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
           const at::Tensor& value_cache, const at::Tensor& block_tables,
           const at::Tensor& chunks) {
  slipstream_cpu::check_attention_io("paged_prefill_attention", out, query, key_cache,
                                     value_cache, block_tables);
  TORCH_CHECK(chunks.scalar_type() == at::kLong && chunks.is_contiguous() && chunks.dim() == 2 &&
                  chunks.size(1) == 3 && chunks.size(0) == block_tables.size(0),
              "chunks must be int64 [C, 3] (start, q_len, ctx_len), one per block table");
}

// out[rows of chunk c] = causal attention of those rows over chunk c's context: chunk c's
// rows start..start+q_len-1 sit at positions ctx_len-q_len..ctx_len-1 of the sequence whose
// blocks are block_tables[c]; their own K/V are already stored. sliding_window > 0: each
// row sees its last sliding_window positions only.
void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables,
                             const at::Tensor& chunks, double scale, int64_t sliding_window) {
  check(out, query, key_cache, value_cache, block_tables, chunks);
  const int64_t D = query.size(2);
  TORCH_CHECK(D == 16 || D == 32 || D == 64 || D == 128,
              "paged_prefill_attention: head_dim must be 16, 32, 64 or 128");
  const Geometry g = slipstream_cpu::attention_geometry(out, query, key_cache, block_tables,
                                                        scale, sliding_window, 0.0);

  const int64_t* ch = chunks.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  std::vector<Item> items;
  for (int64_t c = 0; c < chunks.size(0); ++c) {
    const int64_t start = ch[3 * c], q_len = ch[3 * c + 1], ctx_len = ch[3 * c + 2];
    TORCH_CHECK(q_len > 0 && ctx_len >= q_len && start + q_len <= query.size(0),
                "chunk out of range");
    for (int64_t r0 = 0; r0 < q_len; r0 += ITEM_ROWS)
      for (int64_t h = 0; h < g.Hkv; ++h)
        items.push_back({start, q_len, ctx_len, tables + c * g.table_stride, h, r0,
                         std::min(q_len, r0 + ITEM_ROWS)});
  }
  // Longest context first: the last items taken are the short ones.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.ctx_len - a.q_len + a.r1 > b.ctx_len - b.q_len + b.r1;
  });
  if (key_cache.scalar_type() == at::kBFloat16) {
    run_items(items, g, D, query, reinterpret_cast<const uint16_t*>(key_cache.data_ptr()),
              reinterpret_cast<const uint16_t*>(value_cache.data_ptr()), out);
  } else {
    run_items(items, g, D, query, key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
              out);
  }
}

}  // namespace

SLIPSTREAM_CPU_OP(paged_prefill_attention,
                  "paged_prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, "
                  "Tensor value_cache, Tensor block_tables, Tensor chunks, float scale, "
                  "int sliding_window) -> ()")
