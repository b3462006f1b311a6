// Every decoder layer of a decode step in one call: the lean forward's loop
// (slipstream/worker/fast_forward.py) for int8 (q8_gemm) and bf16-panel (bf16_gemm) layers.
//
// At a few rows the products stream their weights in ~6 ms a step, and the Python around
// them (about 25 operator calls and module hops a layer, 30 layers) took another ~4 ms: a
// third of a one-sequence int8 step. Here the same operators run in the same order on the
// same tensors, called through the dispatcher from C++ (about a microsecond each), so the
// hidden state leaves bit for bit as the Python loop leaves it. Only steps whose every row
// runs on the decode attention kernel come here (no prompt chunk); embedding, rotary tables,
// final norm and head stay in Python.
//
// Built with the other kernels by slipstream/worker/kernels/build.py:
// torch.classes.slipstream_cpu.DecodeStack, torch.ops.slipstream_cpu.decode_stack_run.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <cstdint>
#include <vector>

namespace {

using OptTensor = c10::optional<at::Tensor>;

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// One linear layer as the lean forward runs it (cpu_reduced_linear._reduced_forward).
struct Product {
  at::Tensor packed;
  at::Tensor scales;  // int8: per block and column
  OptTensor bias, outlier_idx, outlier_w;
  int64_t n = 0;
  bool q8 = true;
  bool bf16_out = false;

  at::Tensor operator()(const at::Tensor& x) const {
    static const auto q8_gemm =
        op("slipstream_cpu::q8_gemm")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                              const OptTensor&, const OptTensor&, const OptTensor&)>();
    static const auto bf16_gemm =
        op("slipstream_cpu::bf16_gemm")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&,
                              bool)>();
    if (!q8) return bf16_gemm.call(x, packed, n, bias, bf16_out);
    at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
    if (xf.stride(-1) != 1) xf = xf.contiguous();
    return q8_gemm.call(xf, packed, scales, n, bias, outlier_idx, outlier_w);
  }
};

struct Layer {
  at::Tensor norm_in, norm_post;
  double eps_in = 0, eps_post = 0;
  Product qkv, o, gate_up, down;
  int64_t q_size = 0, kv_size = 0;
  double scaling = 1;
  int64_t window = 0;  // sliding window (0: none)
};

// An absent optional travels as an empty tensor (a custom class's list holds no None).
OptTensor present(const at::Tensor& t) {
  return t.numel() ? OptTensor(t) : OptTensor();
}

// Per layer, add_layer takes: tensors [norm_in, norm_post, then for qkv, o, gate_up, down each
// packed, scales, bias, outlier_idx, outlier_w]; ints [for each product q8, n, bf16_out; then
// q_size, kv_size, window]; floats [eps_in, eps_post, scaling].
constexpr size_t kTensors = 2 + 4 * 5, kInts = 4 * 3 + 3, kFloats = 3;

struct DecodeStack : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim;
  std::vector<Layer> layers;

  DecodeStack(int64_t heads, int64_t kv_heads, int64_t head_dim)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim) {}

  void add_layer(std::vector<at::Tensor> tensors, std::vector<int64_t> ints,
                 std::vector<double> floats) {
    TORCH_CHECK(tensors.size() == kTensors && ints.size() == kInts && floats.size() == kFloats,
                "DecodeStack.add_layer: expected ", kTensors, " tensors, ", kInts, " ints and ",
                kFloats, " floats");
    Layer l;
    l.norm_in = tensors[0];
    l.norm_post = tensors[1];
    Product* products[] = {&l.qkv, &l.o, &l.gate_up, &l.down};
    for (size_t i = 0; i < 4; ++i) {
      Product& p = *products[i];
      const at::Tensor* t = tensors.data() + 2 + 5 * i;
      p.packed = t[0];
      p.scales = t[1];
      p.bias = present(t[2]);
      p.outlier_idx = present(t[3]);
      p.outlier_w = present(t[4]);
      p.q8 = ints[3 * i] != 0;
      p.n = ints[3 * i + 1];
      p.bf16_out = ints[3 * i + 2] != 0;
    }
    l.q_size = ints[12];
    l.kv_size = ints[13];
    l.window = ints[14];
    l.eps_in = floats[0];
    l.eps_post = floats[1];
    l.scaling = floats[2];
    layers.push_back(std::move(l));
  }

  // hidden [T, H] float32, updated in place through every layer. K/V of row store_rows[j]
  // (of every row when store_rows is empty and the slots are not) go to slot store_slots[j];
  // the decode kernel's rows, tables and context lengths are the step's
  // (attention/cpu_backend.py, DecodeRows).
  void run(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin,
           const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
           const at::Tensor& store_rows, const at::Tensor& store_slots, const at::Tensor& tables,
           const at::Tensor& seq_lens, const at::Tensor& rows) const {
    static const auto rms_norm =
        op("slipstream_cpu::rms_norm")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
    static const auto rotary =
        op("slipstream_cpu::rotary")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              int64_t)>();
    static const auto silu_mul =
        op("slipstream_cpu::silu_mul").typed<at::Tensor(const at::Tensor&)>();
    static const auto attention =
        op("slipstream_cpu::paged_decode_attention")
            .typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                        int64_t, double)>();
    TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2,
                "DecodeStack.run: hidden must be float32 [T, H]");
    TORCH_CHECK(key_caches.size() == layers.size() && value_caches.size() == layers.size(),
                "DecodeStack.run: one key and one value cache per layer");
    const int64_t t = hidden.size(0);
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      at::Tensor qkv = l.qkv(rms_norm.call(hidden, l.norm_in, l.eps_in));
      at::Tensor q = qkv.narrow(1, 0, l.q_size);
      at::Tensor k = qkv.narrow(1, l.q_size, l.kv_size);
      at::Tensor v = qkv.narrow(1, l.q_size + l.kv_size, l.kv_size);
      if (q.scalar_type() != at::kFloat) {
        q = q.to(at::kFloat);
        k = k.to(at::kFloat);
      }
      q = rotary.call(q, cos, sin, head_dim).view({t, -1, head_dim});
      k = rotary.call(k, cos, sin, head_dim).view({t, -1, head_dim});
      v = v.reshape({t, kv_heads, head_dim});
      store(k, v, key_caches[i], value_caches[i], store_rows, store_slots);
      at::Tensor out = at::empty_like(q);
      attention.call(out, q, key_caches[i], value_caches[i], tables, seq_lens, rows, l.scaling,
                     l.window, 0.0);
      hidden.add_(l.o(out.reshape({t, heads * head_dim})));
      hidden.add_(l.down(silu_mul.call(l.gate_up(rms_norm.call(hidden, l.norm_post,
                                                               l.eps_post)))));
    }
  }

  // torch_ops._write_kv: the stored rows' K/V into their slots of the flat cache.
  static void store(at::Tensor k, at::Tensor v, const at::Tensor& key_cache,
                    const at::Tensor& value_cache, const at::Tensor& store_rows,
                    const at::Tensor& slots) {
    if (slots.numel() == 0) return;  // no row has a slot
    const int64_t flat = key_cache.size(0) * key_cache.size(1);
    at::Tensor flat_k = key_cache.view({flat, key_cache.size(2), key_cache.size(3)});
    at::Tensor flat_v = value_cache.view({flat, value_cache.size(2), value_cache.size(3)});
    if (store_rows.numel()) {
      k = k.index_select(0, store_rows);
      v = v.index_select(0, store_rows);
    }
    flat_k.index_copy_(0, slots, k.to(flat_k.scalar_type()));
    flat_v.index_copy_(0, slots, v.to(flat_v.scalar_type()));
  }
};

// The step as an operator rather than a method of the class: an operator called from Python
// runs without the GIL (a method holds it), so the server's other threads (the response
// sender, the tokenizer, the step watchdog) run while a step's layers do.
void decode_stack_run(const c10::intrusive_ptr<DecodeStack>& stack, at::Tensor hidden,
                      at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> key_caches,
                      std::vector<at::Tensor> value_caches, at::Tensor store_rows,
                      at::Tensor store_slots, at::Tensor tables, at::Tensor seq_lens,
                      at::Tensor rows) {
  stack->run(hidden, cos, sin, key_caches, value_caches, store_rows, store_slots, tables,
             seq_lens, rows);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(slipstream_cpu, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t>())
      .def("add_layer", &DecodeStack::add_layer);
  m.def(
      "decode_stack_run(__torch__.torch.classes.slipstream_cpu.DecodeStack stack, "
      "Tensor(a!) hidden, Tensor cos, Tensor sin, Tensor(b!)[] key_caches, "
      "Tensor(c!)[] value_caches, Tensor store_rows, Tensor store_slots, Tensor tables, "
      "Tensor seq_lens, Tensor rows) -> ()",
      &decode_stack_run);
}
