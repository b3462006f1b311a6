// The tensors every compiled CPU attention kernel takes, checked alike: fp32 query and output
// [T, H, D] with contiguous heads, paged fp32 or bf16 caches [num_blocks, block_size, Hkv, D],
// int32 block tables with contiguous rows; and the geometry the kernels read them by.
#pragma once

#include <ATen/ATen.h>

namespace slipstream_cpu {

inline void check_attention_io(const char* kernel, const at::Tensor& out,
                               const at::Tensor& query, const at::Tensor& key_cache,
                               const at::Tensor& value_cache, const at::Tensor& block_tables) {
  TORCH_CHECK(query.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat, kernel,
              ": float32 query and output only");
  TORCH_CHECK((key_cache.scalar_type() == at::kFloat || key_cache.scalar_type() == at::kBFloat16) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              kernel, ": float32 or bfloat16 caches, both alike");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query/out must be [T, H, D]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "caches must be [num_blocks, block_size, Hkv, D]");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "head_dim mismatch");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "block_tables must be int32 with contiguous rows");
}

// The sizes and strides of checked attention tensors, and the step's attention settings.
struct AttentionGeometry {
  int64_t H, G, Hkv, D, block_size, token_stride, block_stride, max_blocks;
  int64_t q_row, q_head, o_row, o_head, table_stride;
  float scale, cap;  // cap: the logit soft-cap (0: none)
  int64_t window;    // sliding window (0: none)
};

inline AttentionGeometry attention_geometry(const at::Tensor& out, const at::Tensor& query,
                                            const at::Tensor& key_cache,
                                            const at::Tensor& block_tables, double scale,
                                            int64_t sliding_window, double softcap) {
  AttentionGeometry g;
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
  return g;
}

}  // namespace slipstream_cpu
