// What this machine can do, measured the way the kernels use it: the rate at which its
// threads stream a buffer from memory (the floor of a decode step, which reads every weight
// once), and the peak rate of the dot-product instructions the products run on (the ceiling
// of a prompt chunk's products). The benchmarks compare the engine's steps against these
// (slipstream_bench/decode_floor.py); nothing in serving calls them.
//
// Built with the other kernels by slipstream/worker/kernels/build.py:
// torch.ops.slipstream_cpu.stream_read_seconds, torch.ops.slipstream_cpu.peak_rate.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

// One thread's share [begin, end) of the buffer, read once with wide loads into four
// independent sums (the sums only keep the loads from being dropped).
uint64_t read_share(const uint8_t* p, int64_t begin, int64_t end) {
#if defined(__AVX512F__)
  __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = begin;
  for (; i + 256 <= end; i += 256) {
    s0 = _mm512_add_epi64(s0, _mm512_load_si512(p + i));
    s1 = _mm512_add_epi64(s1, _mm512_load_si512(p + i + 64));
    s2 = _mm512_add_epi64(s2, _mm512_load_si512(p + i + 128));
    s3 = _mm512_add_epi64(s3, _mm512_load_si512(p + i + 192));
  }
  s0 = _mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3));
  return static_cast<uint64_t>(_mm512_reduce_add_epi64(s0));
#else
  uint64_t s = 0;
  const uint64_t* q = reinterpret_cast<const uint64_t*>(p);
  for (int64_t i = begin / 8; i < end / 8; ++i) s += q[i];
  return s;
#endif
}

// The fastest of `passes` reads of the whole buffer (seconds), every intra-op thread reading
// its own contiguous share, as a decode step's threads stream their panels.
double stream_read_seconds(const at::Tensor& buffer, int64_t passes) {
  TORCH_CHECK(buffer.is_contiguous() && buffer.scalar_type() == at::kByte,
              "stream_read_seconds: a contiguous uint8 buffer");
  const uint8_t* p = buffer.data_ptr<uint8_t>();
  TORCH_CHECK(reinterpret_cast<uintptr_t>(p) % 64 == 0, "stream_read_seconds: 64-byte aligned");
  const int64_t n = buffer.numel() / 256 * 256;
  const int threads = std::max(1, at::get_num_threads());
  std::atomic<uint64_t> sink{0};
  double best = 1e30;
  for (int64_t pass = 0; pass < std::max<int64_t>(1, passes); ++pass) {
    const auto start = Clock::now();
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t begin = n * t / threads / 256 * 256;
        const int64_t end = t + 1 == threads ? n : n * (t + 1) / threads / 256 * 256;
        sink += read_share(p, begin, end);
      }
    });
    best = std::min(best, std::chrono::duration<double>(Clock::now() - start).count());
  }
  TORCH_CHECK(sink.load() != 1, "");  // keeps the reads
  return best;
}

// Multiply-adds per second of one instruction kind on every intra-op thread, each running
// independent chains (12 accumulators: latency hidden) for `iterations` rounds. Kinds:
// "fp32_fma" (vfmadd231ps, 16 a zmm), "bf16_dot" (vdpbf16ps, 32), "int8_dot" (vpdpbusd, 64).
// 0 where the CPU or the build lacks the instruction.
double peak_rate(const std::string& kind, int64_t iterations) {
  const int threads = std::max(1, at::get_num_threads());
  int64_t per_instruction = 0;
  std::atomic<int64_t> sink{0};
  const auto start = Clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
#if defined(__AVX512F__)
    for (int64_t t = t0; t < t1; ++t) {
      constexpr int kChains = 12;
      if (kind == "fp32_fma") {
        __m512 acc[kChains];
        const __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c + t));
        for (int64_t i = 0; i < iterations; ++i)
          for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(a, acc[c], b);
        float s = 0;
        for (int c = 0; c < kChains; ++c) s += _mm512_reduce_add_ps(acc[c]);
        sink += static_cast<int64_t>(s);
      }
#if defined(__AVX512BF16__)
      if (kind == "bf16_dot") {
        __m512 acc[kChains];
        const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80);
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c + t));
        for (int64_t i = 0; i < iterations; ++i)
          for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, a);
        float s = 0;
        for (int c = 0; c < kChains; ++c) s += _mm512_reduce_add_ps(acc[c]);
        sink += static_cast<int64_t>(s);
      }
#endif
#if defined(__AVX512VNNI__)
      if (kind == "int8_dot") {
        __m512i acc[kChains];
        const __m512i a = _mm512_set1_epi8(1), b = _mm512_set1_epi8(1);
        for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_epi32(c + static_cast<int>(t));
        for (int64_t i = 0; i < iterations; ++i)
          for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
        int64_t s = 0;
        for (int c = 0; c < kChains; ++c) s += _mm512_reduce_add_epi32(acc[c]);
        sink += s;
      }
#endif
      (void)kChains;
    }
#endif
  });
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
#if defined(__AVX512F__)
  if (kind == "fp32_fma") per_instruction = 16;
#if defined(__AVX512BF16__)
  if (kind == "bf16_dot") per_instruction = 32;
#endif
#if defined(__AVX512VNNI__)
  if (kind == "int8_dot") per_instruction = 64;
#endif
#endif
  TORCH_CHECK(sink.load() != -1, "");
  return per_instruction * 12.0 * iterations * threads / seconds;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slipstream_cpu, m) {
  m.def("stream_read_seconds(Tensor buffer, int passes) -> float", &stream_read_seconds);
  m.def("peak_rate(str kind, int iterations) -> float", &peak_rate);
}
