// Where a sequence's cached tokens sit in a paged cache [num_blocks, block_size, Hkv, D]:
// the compiled attention kernels (decode and prefill) read K/V in place through these row
// pointers, found a block at a time (a division per token costs as much as its arithmetic).
#pragma once

#include <cstdint>

namespace slipstream_cpu {

// rows[t - first] = the row of token t (first <= t < end) of the sequence whose blocks are
// `table`, at `offset` values into the token's row (its first KV head's place).
template <typename T>
void paged_rows(const T* cache, const int32_t* table, int64_t block_size, int64_t block_stride,
                int64_t token_stride, int64_t offset, int64_t first, int64_t end,
                const T** rows) {
  for (int64_t t = first; t < end;) {
    const T* block = cache + table[t / block_size] * block_stride + offset;
    for (int64_t off = t % block_size; off < block_size && t < end; ++off, ++t)
      rows[t - first] = block + off * token_stride;
  }
}

}  // namespace slipstream_cpu
