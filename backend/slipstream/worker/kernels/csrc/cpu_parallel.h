// Work sharing for the compiled CPU kernels: threads take chunks from a shared counter.
//
// at::parallel_for hands each thread a fixed share up front, so a kernel ends when its
// slowest thread has done all of its share. In a server the model's threads share the cores
// with the response sender, tritonserver and the client, and one of them is preempted now
// and then. Taking chunks as they go, the other thread works through the late one's share
// meanwhile; the region still ends only when the late thread reaches its end, but it no
// longer has a whole share left to do when it gets its core back.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace slipstream_cpu {

// f(begin, end) over [0, n) in chunks of `chunk`, on torch's intra-op threads.
template <typename F>
void dynamic_for(int64_t n, int64_t chunk, const F& f) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), chunks);
  if (workers <= 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      f(c * chunk, std::min(n, (c + 1) * chunk));
    }
  });
}

}  // namespace slipstream_cpu
