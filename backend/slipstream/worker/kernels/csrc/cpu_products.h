// The products' and norm's inner entry points, shared by their operators and the decode stack
// (cpu_decode_stack.cpp): both call the one compiled function for a panel's rows, so a decode
// step run by the stack is bit for bit what the operators compute. Defined in
// cpu_q8_gemm.cpp, cpu_q4_gemm.cpp, cpu_bf16_gemm.cpp, cpu_rms_norm.cpp and
// cpu_paged_attention.cpp (one library: the FAST flag class).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "cpu_parallel.h"
#include "cpu_quant_rows.h"

namespace slipstream_cpu {

constexpr int64_t kPanelColumns = 32;  // output columns per packed panel
constexpr int64_t kProductRowChunk = 192;  // rows per task at prompt sizes (every product)

// f(panel, m0, m1) for each of `panels` panels and each chunk [m0, m1) of kProductRowChunk of
// the M rows, on torch's threads (every product's operator splits its work so). A panel's
// chunks are consecutive tasks, so that a thread keeps reusing the panel's weights from its
// cache. A few rows: several panels a task, so that each thread streams a long run of memory;
// still ~4 tasks a thread, so that one preempted thread's share moves on.
template <typename F>
void for_panel_rows(int64_t panels, int64_t M, const F& f) {
  const int64_t chunks = (M + kProductRowChunk - 1) / kProductRowChunk;
  const int64_t grain =
      chunks > 1 ? 1 : std::max<int64_t>(1, panels / (4 * std::max(1, at::get_num_threads())));
  dynamic_for(panels * chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = t / chunks, m0 = (t % chunks) * kProductRowChunk;
      f(p, m0, std::min(M, m0 + kProductRowChunk));
    }
  });
}

// int8 (cpu_q8_gemm.cpp): rows [m0, m1) of one panel (weights wp, scales sp, outlier columns
// op or null) into y [M][N] columns [n0, n0 + cols), bias added.
void q8_panel_rows(const QuantRows& a, int64_t m0, int64_t m1, int64_t K, const uint8_t* wp,
                   const float* sp, const float* op, float* y, int64_t N, int64_t n0,
                   int64_t cols, const float* bias);

// int4 (cpu_q4_gemm.cpp): one panel of a 4-bit weight.
struct Q4Panel {
  const uint8_t* w;     // [K/32][512]
  const void* s;        // [K/G][2][32] float, or half where `half`
  const float* out_w;   // the outlier columns [k][32], or null
  int64_t K, G;
  int64_t n0, cols;
  bool half;
};
void q4_panel_rows(const QuantRows& a, int64_t m0, int64_t m1, const Q4Panel& p, float* y,
                   int64_t N, const float* bias);

// bf16 panels (cpu_bf16_gemm.cpp): x bf16 [M][K]; y float32 (f32) or bf16 (bf16), one of them.
void bf16_panel_rows(const uint16_t* x, int64_t m0, int64_t m1, int64_t K, const uint16_t* wp,
                     float* f32, uint16_t* bf16, int64_t N, const float* bias, int64_t n0,
                     int64_t cols);

// RMSNorm of one row (cpu_rms_norm.cpp).
void rms_norm_row(const float* row, const float* w, float eps, int64_t width, float* out);

// Decode attention (cpu_paged_attention.cpp): a step's work items, each a sequence with
// `heads` of its KV heads (decode_attention_heads_per_item: all of them, or one where there
// are fewer sequences than threads); items [begin, end) of paged_decode_attention's arguments.
int64_t decode_attention_heads_per_item(int64_t num_seqs, int64_t kv_heads, int64_t threads);
void decode_attention_items(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& rows, double scale,
                            int64_t sliding_window, double softcap, int64_t heads,
                            int64_t begin, int64_t end);

}  // namespace slipstream_cpu
