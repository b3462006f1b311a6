// Rows of a packed int8 or 4-bit weight as float32: a tied input embedding's lookups, read
// from the LM head's packed layout (its only copy). The same values as the layouts' own
// readers (layers/quantization/int8.py Q8Weight.rows, int4.py Int4Weight.rows): q * scale, and
// d * q + m rounded as torch rounds a product and then a sum (compiled without contraction);
// outlier channels take their float32 columns. A decode step looks up one row per sequence:
// the Python readers' dozen indexing operators cost more than the row.
//
// Built with the other kernels by slipstream/worker/kernels/build.py:
// torch.ops.slipstream_cpu.q8_rows, torch.ops.slipstream_cpu.q4_rows.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kPanel = 32, kLanes = 16;

float half_to_float(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

void check_ids(const at::Tensor& ids, int64_t n) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(),
              "rows: ids must be int64 [T]");
  const int64_t* p = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < n, "rows: id ", p[i], " out of range [0, ", n, ")");
}

// int8 panels u8 [N/32][K/4][2][16][4] (q + 128), scales [N/32][K/32][32].
at::Tensor q8_rows(const at::Tensor& packed, const at::Tensor& scales, int64_t n, int64_t k,
                   const at::Tensor& ids, const c10::optional<at::Tensor>& outlier_idx,
                   const c10::optional<at::Tensor>& outlier_w) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == panels * kPanel * k && k % 32 == 0,
              "q8_rows: packed must be uint8 [N/32, K/4, 2, 16, 4]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == panels * kPanel * (k / 32),
              "q8_rows: scales must be float32 [N/32, K/32, 32]");
  check_ids(ids, n);
  const int64_t outliers =
      outlier_idx.has_value() && outlier_idx->defined() ? outlier_idx->numel() : 0;
  at::Tensor out = at::empty({ids.numel(), k}, scales.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  for (int64_t t = 0; t < ids.numel(); ++t) {
    const int64_t col = ids.data_ptr<int64_t>()[t], p = col / kPanel, c = col % kPanel;
    const uint8_t* w = wp + p * kPanel * k + (c / kLanes) * kLanes * 4 + (c % kLanes) * 4;
    const float* s = sp + p * kPanel * (k / 32) + c;
    float* o = out.data_ptr<float>() + t * k;
    for (int64_t j = 0; j < k; ++j) {
      const float q = static_cast<float>(static_cast<int32_t>(w[(j / 4) * kPanel * 4 + j % 4]) - 128);
      o[j] = q * s[(j / 32) * kPanel];
    }
    for (int64_t j = 0; j < outliers; ++j)
      o[outlier_idx->data_ptr<int64_t>()[j]] =
          outlier_w->data_ptr<float>()[(p * outliers + j) * kPanel + c];
  }
  return out;
}

// 4-bit panels u8 [N/32][K/32][4][2][16][4], scales [N/32][K/G][2][32] (float32 or half);
// perm: kernel channel j is input channel perm[j].
at::Tensor q4_rows(const at::Tensor& packed, const at::Tensor& scales, int64_t group, int64_t n,
                   int64_t k, const at::Tensor& ids, const c10::optional<at::Tensor>& perm) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == panels * kPanel * k / 2 && k % 32 == 0,
              "q4_rows: packed must be uint8 [N/32, K/32, 4, 2, 16, 4]");
  TORCH_CHECK(group > 0 && group % 32 == 0 && k % group == 0, "q4_rows: bad group");
  const bool half = scales.scalar_type() == at::kHalf;
  TORCH_CHECK((half || scales.scalar_type() == at::kFloat) && scales.is_contiguous() &&
                  scales.numel() == panels * 2 * kPanel * (k / group),
              "q4_rows: scales must be float32 or float16 [N/32, K/G, 2, 32]");
  check_ids(ids, n);
  const bool permuted = perm.has_value() && perm->defined() && perm->numel() > 0;
  TORCH_CHECK(!permuted || (perm->scalar_type() == at::kLong && perm->numel() == k),
              "q4_rows: perm must be int64 [K]");
  at::Tensor out = at::empty({ids.numel(), k}, packed.options().dtype(at::kFloat));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const char* sp = static_cast<const char*>(scales.data_ptr());
  const int64_t groups = k / group, meta_size = half ? 2 : 4;
  for (int64_t t = 0; t < ids.numel(); ++t) {
    const int64_t col = ids.data_ptr<int64_t>()[t], p = col / kPanel, c = col % kPanel;
    const uint8_t* w = wp + p * kPanel * k / 2;
    float* o = out.data_ptr<float>() + t * k;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t b = j / 32, r = j % 32, half_of_block = r / 16, quad = (r % 16) / 4;
      const uint8_t byte = w[b * 512 + (quad * 2 + c / kLanes) * 64 + (c % kLanes) * 4 + r % 4];
      const float q = static_cast<float>(half_of_block ? byte >> 4 : byte & 15);
      const int64_t at = ((p * groups + j / group) * 2) * kPanel + c;
      float d, m;
      if (half) {
        uint16_t hd, hm;
        std::memcpy(&hd, sp + at * meta_size, 2);
        std::memcpy(&hm, sp + (at + kPanel) * meta_size, 2);
        d = half_to_float(hd), m = half_to_float(hm);
      } else {
        std::memcpy(&d, sp + at * meta_size, 4);
        std::memcpy(&m, sp + (at + kPanel) * meta_size, 4);
      }
      const float value = q * d + m;  // a product, then a sum (EXACT class: not fused)
      o[permuted ? perm->data_ptr<int64_t>()[j] : j] = value;
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slipstream_cpu, m) {
  m.def(
      "q8_rows(Tensor packed, Tensor scales, int n, int k, Tensor ids, Tensor? outlier_idx, "
      "Tensor? outlier_w) -> Tensor");
  m.def(
      "q4_rows(Tensor packed, Tensor scales, int group, int n, int k, Tensor ids, "
      "Tensor? perm) -> Tensor");
}

TORCH_LIBRARY_IMPL(slipstream_cpu, CPU, m) {
  m.impl("q8_rows", &q8_rows);
  m.impl("q4_rows", &q4_rows);
}
