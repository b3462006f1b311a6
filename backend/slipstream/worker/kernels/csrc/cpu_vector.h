// 16-float vectors for the compiled CPU kernels, written with GCC vector types: they lower to
// AVX-512, AVX2 or SSE as the machine has them, so one source serves every x86 CPU.
#pragma once

#include <cstdint>
#include <cstring>

namespace slipstream_cpu {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16 __attribute__((vector_size(64)));
typedef uint32_t u16v __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));  // unaligned loads/stores
typedef uint16_t h16u __attribute__((vector_size(32), aligned(2)));

inline v16 splat(float x) { return v16{} + x; }

// 16 consecutive cache values as fp32: fp32 as they are, bf16 (stored as its top 16 bits)
// widened exactly.
inline v16 load16(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline v16 load16(const uint16_t* p) {
  const u16v wide = __builtin_convertvector(*reinterpret_cast<const h16u*>(p), u16v) << 16;
  v16 out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// e^x for x <= 0: Cody-Waite reduction x = n ln2 + r, |r| <= ln2/2, and a degree-6
// polynomial for e^r (~1 ulp). Below -87.3 it returns e^-87.3 (still normal; nil beside the
// row's maximum, e^0). A NaN stays NaN (through r), so the sampler sees a broken row.
inline v16 exp_nonpositive(v16 x) {
  x = x < splat(-87.3f) ? splat(-87.3f) : x;
  // n = the integer nearest x / ln2 (truncation of a negative number rounds it up)
  const v16 n = __builtin_convertvector(
      __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i16), v16);
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.f;
  const i16 bits = (__builtin_convertvector(n, i16) + 127) << 23;
  v16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// out[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once: four rounds of pairing
// halves (two two-source shuffles and an add each), 45 operations against 16 separate
// horizontal sums' ~130.
__attribute__((always_inline)) inline v16 sum_lanes16(const v16 (&v)[16]) {
  const i16 lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const i16 hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const i16 lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const i16 hi4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const i16 lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const i16 hi2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const i16 lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const i16 hi1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  v16 a[8], b[4], c[2];
  // a[i]: 8 partial sums of v[2i], then 8 of v[2i+1]
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], lo8) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1], hi8);
  // b[i]: 4 partial sums each of v[4i..4i+3]
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo4) +
           __builtin_shuffle(a[2 * i], a[2 * i + 1], hi4);
  // c[i]: 2 partial sums each of v[8i..8i+7]
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) +
           __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
  return __builtin_shuffle(c[0], c[1], lo1) + __builtin_shuffle(c[0], c[1], hi1);
}

}  // namespace slipstream_cpu
