// Rotary position embedding (Llama's rotate-half form) of float32 rows in one pass.
//
// torch computes x * cos + rotate_half(x) * sin as six operators (two muls, neg, cat, mul,
// add), each writing a full [tokens, heads, head_dim] tensor: ~70 ms of a 2,048-token
// prefill step of SmolLM2 on 2 cores. This reads x once and writes the result once, with
// the same roundings in the same order (a product, a product, their sum): it is compiled
// without fast-math or FMA contraction, so results equal torch's bit for bit.
// Built with the other kernels by slipstream/worker/kernels/build.py:
// torch.ops.slipstream_cpu.rotary.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace slipstream_cpu {

// Rows [r0, r1) of x (row stride src_stride, `width` = heads * head_dim values a row) into dst
// (row stride width), cos / sin [T, head_dim].
void rotary_rows(const float* src, int64_t src_stride, const float* cp, const float* sp,
                 int64_t r0, int64_t r1, int64_t width, int64_t head_dim, float* dst) {
  const int64_t heads = width / head_dim, half = head_dim / 2;
  for (int64_t r = r0; r < r1; ++r) {
    const float* cr = cp + r * head_dim;
    const float* sr = sp + r * head_dim;
    for (int64_t h = 0; h < heads; ++h) {
      const float* in = src + r * src_stride + h * head_dim;
      float* o = dst + r * width + h * head_dim;
#pragma omp simd
      for (int64_t j = 0; j < half; ++j) {
        const float lo = in[j] * cr[j];
        const float lo_rot = -in[j + half] * sr[j];
        o[j] = lo + lo_rot;
      }
#pragma omp simd
      for (int64_t j = half; j < head_dim; ++j) {
        const float hi = in[j] * cr[j];
        const float hi_rot = in[j - half] * sr[j];
        o[j] = hi + hi_rot;
      }
    }
  }
}

}  // namespace slipstream_cpu

namespace {

// The address of rotary_rows, for the decode stack (cpu_decode_stack.cpp), which is built in
// another flag class's library: it calls this compiled function itself, so that its rows are
// the operator's bit for bit.
int64_t rotary_rows_address() {
  return reinterpret_cast<int64_t>(&slipstream_cpu::rotary_rows);
}

// x [T, heads * head_dim] (rows may be strided, elements contiguous); cos/sin [T, head_dim].
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                  int64_t head_dim) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat,
              "rotary: float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rotary: x must be [T, W] with unit stride");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && x.size(1) % head_dim == 0,
              "rotary: width must be a multiple of an even head_dim");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  TORCH_CHECK(c.dim() == 2 && c.size(0) == x.size(0) && c.size(1) == head_dim &&
                  s.sizes() == c.sizes(),
              "rotary: cos/sin must be [T, head_dim]");
  const int64_t rows = x.size(0), width = x.size(1), row_stride = x.stride(0);
  at::Tensor out = at::empty({rows, width}, x.options());
  const float* src = x.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(width, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    slipstream_cpu::rotary_rows(src, row_stride, cp, sp, begin, end, width, head_dim, dst);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slipstream_cpu, m) {
  m.def("rotary(Tensor x, Tensor cos, Tensor sin, int head_dim) -> Tensor");
  m.def("rotary_rows_address() -> int", &rotary_rows_address);
}

TORCH_LIBRARY_IMPL(slipstream_cpu, CPU, m) { m.impl("rotary", &rotary); }
