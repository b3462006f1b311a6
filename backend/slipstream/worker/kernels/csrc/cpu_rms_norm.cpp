// RMSNorm of float32 rows in one pass per row (Llama-style: x * rsqrt(mean(x^2) + eps) * w).
//
// torch's rms_norm runs as ~8 separate operators (pow, mean, add, rsqrt, mul, mul and dtype
// copies): ~35 us per call at a few rows, 61 calls in a decode step of a 30-layer model.
// Built with the other kernels by slipstream/worker/kernels/build.py:
// torch.ops.slipstream_cpu.rms_norm.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_products.h"

namespace slipstream_cpu {

void rms_norm_row(const float* row, const float* w, float eps, int64_t width, float* o) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t j = 0; j < width; ++j) squares += row[j] * row[j];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
#pragma omp simd
  for (int64_t j = 0; j < width; ++j) o[j] = w[j] * (row[j] * inv);
}

}  // namespace slipstream_cpu

namespace {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "rms_norm: float32 only");
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && weight.is_contiguous() &&
                  x.size(-1) == weight.size(0),
              "rms_norm: weight must be [hidden] for x [..., hidden]");
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty_like(in);
  const int64_t width = in.size(-1), rows = width ? in.numel() / width : 0;
  const float* src = in.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  // Threads only for prefill-sized inputs: a few rows cost less than waking them.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      slipstream_cpu::rms_norm_row(src + r * width, w, epsilon, width, dst + r * width);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slipstream_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(slipstream_cpu, CPU, m) { m.impl("rms_norm", &rms_norm); }
