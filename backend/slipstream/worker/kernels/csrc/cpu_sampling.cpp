// Sampling for a batch of rows, one row per task: temperature, top-k, min-p, top-p and the
// draw, with the row's working copy kept in the core's cache.
//
// torch's operators stream the whole [rows, vocab] batch through memory once per operator
// (a dozen for top-p without sorting, ~1 ms each at 32 x 49k on one core here), and
// torch.sort of that batch takes ~180 ms. Here a row is read once into a scratch buffer
// (192 KB for 49k tokens: it stays in L2) and every later pass works there.
//
// Top-p: the probabilities are binned by the top bits of their float representation (8 bins
// per power of two: a positive float's bits rise with its value), each bin's mass summed, the
// bin where the mass from the top crosses top_p found, and only that bin's tokens sorted to
// find the exact threshold; the nucleus is every token at or above it.
//
// Built with the other kernels by slipstream/worker/kernels/build.py (with -ffast-math,
// so NaN and infinity are recognised by their bits, never by float comparisons). A row with
// a NaN gets token -1. Top-k uses the same bins (counts instead of mass). One uniform number
// per row, given: the token is the first whose cumulative probability exceeds it.
// torch.ops.slipstream_cpu.sample_rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

#include "cpu_parallel.h"

namespace {

constexpr uint32_t kPosInf = 0x7f800000u;
constexpr int kBinShift = 20;  // 23 mantissa bits - 3: eight bins per power of two
constexpr int kBins = (0x3f800000 >> kBinShift) + 1;  // floats in [0, 1]
constexpr int64_t kBlock = 256;  // the draw walks blocks, then tokens in the chosen block

inline uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, sizeof b);
  return b;
}

inline bool row_has_nan(const float* x, int64_t n) {
  uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
  for (int64_t j = 0; j < n; ++j) bad |= ((bits_of(x[j]) & 0x7fffffffu) > kPosInf) ? 1u : 0u;
  return bad != 0;
}

// The scaled logits x / t into e (+inf -> FLT_MAX, as torch's clamp(max=) does), their max.
float scale_row(const float* x, float* e, int64_t n, float t) {
  const float inv = 1.f / t;
  float m = -FLT_MAX;
  for (int64_t j = 0; j < n; ++j) {
    float s = x[j] * inv;
    if (bits_of(s) == kPosInf) s = FLT_MAX;
    e[j] = s;
    m = std::max(m, s);
  }
  return m;
}

double exp_row(float* e, int64_t n, float m) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    e[j] = std::exp(e[j] - m);
    sum += e[j];
  }
  return sum;
}

// e[j] < cut -> 0; the mass left.
double cut_below(float* e, int64_t n, float cut) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    e[j] = e[j] < cut ? 0.f : e[j];
    sum += e[j];
  }
  return sum;
}

// Each value's bin: the top bits of its float representation (e in [0, 1]).
void bin_keys(const float* e, int64_t n, uint16_t* keys) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) keys[j] = static_cast<uint16_t>(bits_of(e[j]) >> kBinShift);
}

// Per bin, the sum of `weight(e)` over its values; four interleaved histograms so that
// consecutive values in one bin do not wait on each other's store.
template <typename W>
void histogram(const float* e, const uint16_t* keys, int64_t n, std::vector<double>& out,
               const W& weight) {
  std::vector<float> h(4 * kBins, 0.f);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    h[keys[j]] += weight(e[j]);
    h[kBins + keys[j + 1]] += weight(e[j + 1]);
    h[2 * kBins + keys[j + 2]] += weight(e[j + 2]);
    h[3 * kBins + keys[j + 3]] += weight(e[j + 3]);
  }
  for (; j < n; ++j) h[keys[j]] += weight(e[j]);
  out.assign(kBins, 0.0);
  for (int b = 0; b < kBins; ++b) {
    out[b] = static_cast<double>(h[b]) + h[kBins + b] + h[2 * kBins + b] + h[3 * kBins + b];
  }
}

// The values of bin `bin`, largest first.
void bin_values(const float* e, const uint16_t* keys, int64_t n, int bin,
                std::vector<float>& out) {
  out.clear();
  for (int64_t j = 0; j < n; ++j) {
    if (keys[j] == bin) out.push_back(e[j]);
  }
  std::sort(out.begin(), out.end(), std::greater<float>());
}

// The bin, from the top, where the running sum of `per_bin` first exceeds `limit` (0: never),
// and the sum of the bins above it.
int crossing_bin(const std::vector<double>& per_bin, double limit, double* above) {
  *above = 0.0;
  for (int bin = kBins - 1; bin > 0; --bin) {
    if (*above + per_bin[bin] > limit) return bin;
    *above += per_bin[bin];
  }
  return 0;
}

// The k-th largest value of e (0 < k < n; values tied with it are kept by the caller's
// `< kth` cut, as torch's top-k mask keeps them).
float kth_largest(const float* e, const uint16_t* keys, int64_t n, int64_t k,
                  std::vector<double>& per_bin, std::vector<float>& tmp) {
  histogram(e, keys, n, per_bin, [](float) { return 1.f; });
  double above = 0.0;
  const int bin = crossing_bin(per_bin, static_cast<double>(k) - 0.5, &above);
  bin_values(e, keys, n, bin, tmp);
  const int64_t index = std::min<int64_t>(k - 1 - static_cast<int64_t>(above),
                                          static_cast<int64_t>(tmp.size()) - 1);
  return tmp.empty() ? 0.f : tmp[std::max<int64_t>(index, 0)];
}

// The smallest value in the nucleus of e (mass `total`): the largest values whose mass
// before each is at most top_p x total.
float nucleus_threshold(const float* e, const uint16_t* keys, int64_t n, double total,
                        double top_p, std::vector<double>& per_bin, std::vector<float>& tmp) {
  histogram(e, keys, n, per_bin, [](float v) { return v; });
  const double limit = top_p * total;
  double above = 0.0;
  const int bin = crossing_bin(per_bin, limit, &above);
  if (bin == 0) return 0.f;  // rounding kept the whole row
  bin_values(e, keys, n, bin, tmp);
  float threshold = tmp.empty() ? 0.f : tmp.front();
  double before = above;
  for (float v : tmp) {
    if (before > limit || v <= 0.f) break;  // values a cut zeroed keep their old bin
    threshold = v;
    before += v;
  }
  return threshold;
}

// Inverse transform over the e[j] >= floor (> 0): the first token whose cumulative mass
// exceeds u x the mass kept.
int64_t draw(const float* e, int64_t n, float floor, double u) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> block_mass(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    float s = 0.f;
    const int64_t end = std::min(n, (b + 1) * kBlock);
#pragma omp simd reduction(+ : s)
    for (int64_t j = b * kBlock; j < end; ++j) s += (e[j] >= floor && e[j] > 0.f) ? e[j] : 0.f;
    block_mass[b] = s;
    total += s;
  }
  const double target = u * total;
  double acc = 0.0;
  int64_t last = -1;
  for (int64_t b = 0; b < blocks; ++b) {
    if (block_mass[b] > 0.0) last = b;
    if (acc + block_mass[b] <= target) {
      acc += block_mass[b];
      continue;
    }
    const int64_t end = std::min(n, (b + 1) * kBlock);
    int64_t chosen = -1;
    for (int64_t j = b * kBlock; j < end; ++j) {
      if (e[j] >= floor && e[j] > 0.f) {
        chosen = j;
        acc += e[j];
        if (acc > target) return j;
      }
    }
    if (chosen >= 0) return chosen;  // the block's float sum ran ahead of this one
  }
  for (int64_t j = (last + 1) * kBlock - 1; last >= 0 && j >= last * kBlock; --j) {
    if (j < n && e[j] >= floor && e[j] > 0.f) return j;  // u x total rounded up to total
  }
  return 0;
}

struct Scratch {
  std::vector<float> e, tmp;
  std::vector<uint16_t> keys;
  std::vector<double> per_bin;
  explicit Scratch(int64_t n) : e(n), keys(n) {}
};

int64_t sample_row(const float* x, int64_t n, float t, int64_t top_k, double top_p, float min_p,
                   double u, Scratch& s) {
  if (row_has_nan(x, n)) return -1;
  float* e = s.e.data();
  const float m = scale_row(x, e, n, t);
  double total = exp_row(e, n, m);  // the most likely token has e = 1
  const bool keyed = (top_k > 0 && top_k < n) || top_p < 1.0;
  if (keyed) bin_keys(e, n, s.keys.data());
  if (top_k > 0 && top_k < n) {
    total = cut_below(e, n, kth_largest(e, s.keys.data(), n, top_k, s.per_bin, s.tmp));
  }
  if (min_p > 0.f) total = cut_below(e, n, min_p);  // p < min_p x max(p); max(e) = 1
  float floor = 0.f;
  if (top_p < 1.0) {  // values cut to 0 above sit in bin 0, which never crosses
    floor = nucleus_threshold(e, s.keys.data(), n, total, top_p, s.per_bin, s.tmp);
  }
  return draw(e, n, floor, u);
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                       const at::Tensor& top_k, const at::Tensor& top_p,
                       const at::Tensor& min_p, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat,
              "sample_rows: float32 logits [rows, vocab]");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  const at::Tensor t = temperature.to(at::kFloat).contiguous();
  const at::Tensor k = top_k.to(at::kLong).contiguous();
  const at::Tensor p = top_p.to(at::kDouble).contiguous();
  const at::Tensor mp = min_p.to(at::kFloat).contiguous();
  const at::Tensor u = uniforms.to(at::kDouble).contiguous();
  TORCH_CHECK(t.numel() == rows && k.numel() == rows && p.numel() == rows &&
                  mp.numel() == rows && u.numel() == rows,
              "sample_rows: one parameter of each kind per row");
  at::Tensor out = at::empty({rows}, at::kLong);
  const float* xs = x.data_ptr<float>();
  int64_t* tokens = out.data_ptr<int64_t>();
  slipstream_cpu::dynamic_for(rows, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(n);
    for (int64_t r = begin; r < end; ++r) {
      tokens[r] = sample_row(xs + r * n, n, t.data_ptr<float>()[r], k.data_ptr<int64_t>()[r],
                             p.data_ptr<double>()[r], mp.data_ptr<float>()[r],
                             u.data_ptr<double>()[r], scratch);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slipstream_cpu, m) {
  m.def("sample_rows(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, "
        "Tensor min_p, Tensor uniforms) -> Tensor");
}

TORCH_LIBRARY_IMPL(slipstream_cpu, CPU, m) {
  m.impl("sample_rows", &sample_rows);
}
