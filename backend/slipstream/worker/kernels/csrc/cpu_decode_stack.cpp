// Every decoder layer of a decode step in one call: the lean forward's loop
// (slipstream/worker/model/lean_forward.py) for int8 (q8_gemm), int4 (q4_gemm) and bf16-panel
// (bf16_gemm) layers.
//
// At a few rows the products stream their weights in a few milliseconds a step, and the
// Python around them (about 25 operator calls and module hops a layer, 30 layers) took as
// long again. Here the same arithmetic runs on the same tensors in the same order from C++,
// so the hidden state leaves bit for bit as the Python loop leaves it. Only steps whose every
// row runs on the decode attention kernel come here (no prompt chunk); embedding, rotary
// tables, final norm and head stay in Python.
//
// A step of a few rows (up to kFusedRows) runs as one parallel region: the threads work
// through each layer's phases (the q/k/v product, rotary and the cache store, attention, the
// o product with its residual add, the gate/up product, the activation, the down product
// with its residual add), each phase a set of tasks taken from a shared counter, the next
// phase starting once the last task of this one is done (a thread waiting meanwhile requests
// the next products' weights). One sequence's step reads ~100 MB of
// weights in a few milliseconds: forking and joining the threads for each of its ~200
// operators, and each operator's allocations and dispatch, were a third of it. A thread never
// waits for a given thread, only for the phase's tasks, so a thread the machine preempts
// holds the others up by the task it holds, not by a share. The norms and the activations'
// quantization are computed by every thread for itself (a few rows: cheaper than a phase).
// Every product's panels go through the function its operator runs (cpu_products.h), the
// norms through rms_norm's, and rotary, the cache store, attention and the activation are
// their operators, called by the thread that takes the task: bit for bit the same. Larger
// steps run the operators one after another.
//
// Built with the other kernels by slipstream/worker/kernels/build.py:
// torch.classes.slipstream_cpu.DecodeStack, torch.ops.slipstream_cpu.decode_stack_run.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu_products.h"
#include "cpu_quant_rows.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

using OptTensor = c10::optional<at::Tensor>;
using slipstream_cpu::kPanelColumns;
using slipstream_cpu::kProductRowChunk;

// Steps of up to this many rows run as one parallel region.
constexpr int64_t kFusedRows = 16;

c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Which compiled product a layer runs (decode_stack.py's ProductKind).
enum class Kind : int64_t { kBf16Panels = 0, kInt8 = 1, kInt4 = 2 };

const float* data_or_null(const OptTensor& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

// One product's input rows as its panels read them: int8 blocks (int8, int4) or bf16 rows.
struct Input {
  std::vector<int8_t> q;
  std::vector<float> scale, ssum, out, row;
  slipstream_cpu::QuantRows rows{};
  at::Tensor bf16;  // bf16 panels: the rows rounded as torch rounds them
  const uint16_t* x16 = nullptr;
};

// One linear layer as the lean forward runs it (reduced_linear._reduced_forward).
struct Product {
  at::Tensor packed;
  at::Tensor scales;  // int8 / int4: per block (group) and column
  OptTensor bias, outlier_idx, outlier_w, perm;
  int64_t n = 0;
  Kind kind = Kind::kInt8;
  bool bf16_out = false;
  int64_t group = 0;  // int4

  int64_t panels() const { return (n + kPanelColumns - 1) / kPanelColumns; }

  at::Tensor operator()(const at::Tensor& x) const {
    static const auto q8_gemm =
        op("slipstream_cpu::q8_gemm")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                              const OptTensor&, const OptTensor&, const OptTensor&)>();
    static const auto q4_gemm =
        op("slipstream_cpu::q4_gemm")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                              int64_t, const OptTensor&, const OptTensor&, const OptTensor&,
                              const OptTensor&)>();
    static const auto bf16_gemm =
        op("slipstream_cpu::bf16_gemm")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&,
                              bool)>();
    if (kind == Kind::kBf16Panels) return bf16_gemm.call(x, packed, n, bias, bf16_out);
    at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
    if (xf.stride(-1) != 1) xf = xf.contiguous();
    if (kind == Kind::kInt4)
      return q4_gemm.call(xf, packed, scales, group, n, bias, outlier_idx, outlier_w, perm);
    return q8_gemm.call(xf, packed, scales, n, bias, outlier_idx, outlier_w);
  }

  // x [M, K] (float32, or bf16 for bf16 panels) as the product's operator prepares it.
  void prepare(const at::Tensor& x, Input& in) const {
    if (kind == Kind::kBf16Panels) {
      in.bf16 = x.to(at::kBFloat16).contiguous();
      in.x16 = reinterpret_cast<const uint16_t*>(in.bf16.data_ptr<at::BFloat16>());
      return;
    }
    const at::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
    TORCH_CHECK(xf.stride(-1) == 1, "DecodeStack: product input rows must be contiguous");
    const int64_t M = xf.size(0), K = xf.size(1), KB = K / slipstream_cpu::kQuantBlock;
    slipstream_cpu::Outliers o;
    if (outlier_idx.has_value()) {
      o.k = outlier_idx->numel();
      o.idx = outlier_idx->data_ptr<int64_t>();
      o.w = outlier_w->data_ptr<float>();
    }
    in.q.resize(M * K);
    in.scale.resize(M * KB);
    in.ssum.resize(M * KB);
    in.out.resize(std::max<int64_t>(1, M * o.k));
    const int64_t* pp = perm.has_value() ? perm->data_ptr<int64_t>() : nullptr;
    slipstream_cpu::quantize_rows(xf.data_ptr<float>(), xf.stride(0), M, K, o, pp, in.q.data(),
                                  in.scale.data(), in.ssum.data(), in.out.data());
    in.rows = {in.q.data(), in.scale.data(), in.ssum.data(), in.out.data(), o.k};
  }

  // Panels [p0, p1) of rows [m0, m1) into y [M, n] (float32, or bf16 where bf16_out).
  void panels_into(const Input& in, int64_t K, int64_t m0, int64_t m1, int64_t p0, int64_t p1,
                   void* y) const {
    const float* b = data_or_null(bias);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanelColumns, cols = std::min(kPanelColumns, n - n0);
      if (kind == Kind::kBf16Panels) {
        const uint16_t* wp =
            reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()) + p * kPanelColumns * K;
        float* f32 = bf16_out ? nullptr : static_cast<float*>(y);
        uint16_t* h = bf16_out ? static_cast<uint16_t*>(y) : nullptr;
        slipstream_cpu::bf16_panel_rows(in.x16, m0, m1, K, wp, f32, h, n, b, n0, cols);
        continue;
      }
      const int64_t k_out = in.rows.k;
      const float* ow =
          outlier_w.has_value() ? outlier_w->data_ptr<float>() + p * k_out * kPanelColumns : nullptr;
      if (kind == Kind::kInt8) {
        const uint8_t* wp = packed.data_ptr<uint8_t>() + p * kPanelColumns * K;
        const float* sp = scales.data_ptr<float>() + p * kPanelColumns * (K / 32);
        slipstream_cpu::q8_panel_rows(in.rows, m0, m1, K, wp, sp, ow, static_cast<float*>(y), n,
                                      n0, cols, b);
        continue;
      }
      const bool half = scales.scalar_type() == at::kHalf;
      const int64_t meta = p * 2 * kPanelColumns * (K / group) * (half ? 2 : 4);
      const slipstream_cpu::Q4Panel panel{packed.data_ptr<uint8_t>() + p * kPanelColumns * K / 2,
                                          static_cast<const char*>(scales.data_ptr()) + meta,
                                          ow,
                                          K,
                                          group,
                                          n0,
                                          cols,
                                          half};
      slipstream_cpu::q4_panel_rows(in.rows, m0, m1, panel, static_cast<float*>(y), n, b);
    }
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
// packed, scales, bias, outlier_idx, outlier_w, perm]; ints [for each product kind, n,
// bf16_out, group; then q_size, kv_size, window]; floats [eps_in, eps_post, scaling].
constexpr size_t kProductTensors = 6, kProductInts = 4;
constexpr size_t kTensors = 2 + 4 * kProductTensors, kInts = 4 * kProductInts + 3, kFloats = 3;

// A phase's tasks: taken from `next`, counted in `done` once finished (own cache lines: the
// threads write them from different cores).
struct alignas(64) Phase {
  std::atomic<int64_t> next{0};
  char pad[64 - sizeof(std::atomic<int64_t>)];
  std::atomic<int32_t> done{0};  // 32 bits: waited on with a futex
};

// Pauses a waiting thread spins (~0.5 ms) before it sleeps until the phase's count moves: a
// phase at a few rows lasts tens of microseconds, and a sleeping thread must be woken and
// scheduled again (on a busy machine, after others); but a partner preempted for longer than
// this needs the core a spinning thread would hold. On a loaded 2-core machine 2,048 pauses
// (~50 us) made steps slower than 20,000 (noisy: compare again on a quiet one).
constexpr int64_t kSpins = 20000;

// How a region splits and waits (DecodeStack.tune: the benchmarks try others).
struct Tuning {
  int64_t tasks_per_thread = 4;  // a product's panels in this many runs a thread
  int64_t prefetch_lines = 8;    // a waiting thread's requests between checks (0: none)
  int64_t spins = kSpins;
};

// Weights a waiting thread pulls towards the cores (into L2, whence the L3 keeps them) while
// another runs a phase alone (rotary, attention, the activation at one row) or finishes its
// last task: the step is bound by reading the weights, and the memory would otherwise idle
// meanwhile. The threads share a cursor per tensor, so no line is requested twice.
struct alignas(64) Prefetch {
  const char* base = nullptr;
  int64_t lines = 0;
  std::atomic<int64_t> next{0};

  // Requests up to `count` more lines; false once every line is requested.
  bool step(int64_t count) {
    if (next.load(std::memory_order_relaxed) >= lines) return false;
    const int64_t first = next.fetch_add(count, std::memory_order_relaxed);
    for (int64_t i = first; i < std::min(lines, first + count); ++i)
      __builtin_prefetch(base + i * 64, 0, 2);
    return first < lines;
  }
};


// The region's shared state: its phases, and the first error a task raised (the others then
// stop at their next phase instead of waiting for tasks that will not be done).
struct Schedule {
  std::unique_ptr<Phase[]> phases;
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_lock;

  Tuning tuning;

  Schedule(int64_t count, const Tuning& tuning) : phases(new Phase[count]), tuning(tuning) {}

  // Takes tasks [0, tasks) of phase `index` until none is left, then waits until every one
  // is done, meanwhile requesting the lines of `ahead` (the weights of the next products).
  // False where a task failed.
  template <typename F>
  bool work(int64_t index, int64_t tasks, const F& task,
            std::initializer_list<Prefetch*> ahead = {}) {
    Phase& phase = phases[index];
    for (int64_t t = phase.next.fetch_add(1); t < tasks; t = phase.next.fetch_add(1)) {
      if (!failed.load(std::memory_order_relaxed)) {
        try {
          task(t);
        } catch (...) {
          std::lock_guard<std::mutex> guard(error_lock);
          if (!error) error = std::current_exception();
          failed.store(true);
        }
      }
      phase.done.fetch_add(1, std::memory_order_release);
      phase.done.notify_all();  // no system call unless a thread sleeps on it
    }
    for (int64_t spins = 0;; ++spins) {
      const int32_t done = phase.done.load(std::memory_order_acquire);
      if (done >= tasks) break;
      if (failed.load(std::memory_order_relaxed)) return false;
      bool requested = false;
      for (Prefetch* p : ahead)
        if (p && tuning.prefetch_lines && (requested = p->step(tuning.prefetch_lines))) break;
      if (requested) {
        spins = 0;
        continue;
      }
      if (spins < tuning.spins) {
#if defined(__SSE2__)
        _mm_pause();
#endif
        continue;
      }
      phase.done.wait(done, std::memory_order_acquire);  // until a task finishes
    }
    return !failed.load(std::memory_order_relaxed);
  }
};

// Phases of one layer in the region.
enum Step : int64_t {
  kQkv = 0,
  kRotaryStore,
  kAttention,
  kOutProj,
  kGateUp,
  kActivation,
  kDown,
  kSteps
};

// What phase_times reports, in its order.
enum Timed : int64_t {
  kTimedPrepare = 0,  // the norms, and the products' inputs quantized (or rounded to bf16)
  kTimedQkv,
  kTimedRotaryStore,
  kTimedAttention,
  kTimedOut,
  kTimedGateUp,
  kTimedActivation,
  kTimedDown,
  kTimedKinds
};

using Clock = std::chrono::steady_clock;
// cpu_rotary.cpp's rows function (rotary_rows_address)
using RotaryRows = void (*)(const float* src, int64_t src_stride, const float* cos,
                            const float* sin, int64_t r0, int64_t r1, int64_t width,
                            int64_t head_dim, float* dst);

struct DecodeStack : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim;
  std::vector<Layer> layers;
  // Seconds the region's first thread spent in each kind of phase (its wait for the others
  // included), summed over the steps since the last phase_times, while timing is on.
  bool timing = false;
  mutable std::vector<double> phase_seconds = std::vector<double>(kTimedKinds, 0.0);

  // The engine's caches, bound once (run then takes empty lists): the 2 x layers tensors of
  // its arguments were converted from Python on every step.
  std::vector<at::Tensor> bound_keys, bound_values;

  void bind_caches(std::vector<at::Tensor> keys, std::vector<at::Tensor> values) {
    TORCH_CHECK(keys.size() == layers.size() && values.size() == layers.size(),
                "DecodeStack.bind_caches: one key and one value cache per layer");
    bound_keys = std::move(keys);
    bound_values = std::move(values);
  }

  void time_phases(bool on) { timing = on; }

  Tuning tuning;

  void tune(int64_t tasks_per_thread, int64_t prefetch_lines, int64_t spins) {
    TORCH_CHECK(tasks_per_thread > 0 && prefetch_lines >= 0 && spins >= 0,
                "DecodeStack.tune: positive tasks, non-negative prefetch and spins");
    tuning = {tasks_per_thread, prefetch_lines, spins};
  }

  std::vector<double> phase_times() {
    std::vector<double> out = phase_seconds;
    std::fill(phase_seconds.begin(), phase_seconds.end(), 0.0);
    return out;
  }

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
      const at::Tensor* t = tensors.data() + 2 + kProductTensors * i;
      const int64_t* v = ints.data() + kProductInts * i;
      p.packed = t[0];
      p.scales = t[1];
      p.bias = present(t[2]);
      p.outlier_idx = present(t[3]);
      p.outlier_w = present(t[4]);
      p.perm = present(t[5]);
      TORCH_CHECK(v[0] >= 0 && v[0] <= 2, "DecodeStack.add_layer: unknown product kind");
      p.kind = static_cast<Kind>(v[0]);
      p.n = v[1];
      p.bf16_out = v[2] != 0;
      p.group = v[3];
    }
    l.q_size = ints[4 * kProductInts];
    l.kv_size = ints[4 * kProductInts + 1];
    l.window = ints[4 * kProductInts + 2];
    l.eps_in = floats[0];
    l.eps_post = floats[1];
    l.scaling = floats[2];
    layers.push_back(std::move(l));
  }

  // What run hands both ways through the layers beside hidden (its arguments, the caches
  // chosen: the step's or the bound ones).
  struct StepTensors {
    const at::Tensor& cos;
    const at::Tensor& sin;
    const std::vector<at::Tensor>& key_caches;
    const std::vector<at::Tensor>& value_caches;
    const at::Tensor& store_rows;
    const at::Tensor& store_slots;
    const at::Tensor& tables;
    const at::Tensor& seq_lens;
    const at::Tensor& rows;
  };

  // hidden [T, H] float32, updated in place through every layer. K/V of row store_rows[j]
  // (of every row when store_rows is empty and the slots are not) go to slot store_slots[j];
  // the decode kernel's rows, tables and context lengths are the step's
  // (attention/cpu_backend.py, DecodeRows).
  void run(at::Tensor hidden, const at::Tensor& cos, const at::Tensor& sin,
           const std::vector<at::Tensor>& key_caches, const std::vector<at::Tensor>& value_caches,
           const at::Tensor& store_rows, const at::Tensor& store_slots, const at::Tensor& tables,
           const at::Tensor& seq_lens, const at::Tensor& rows) const {
    TORCH_CHECK(hidden.scalar_type() == at::kFloat && hidden.dim() == 2 && hidden.is_contiguous(),
                "DecodeStack.run: hidden must be float32 [T, H], contiguous");
    const bool bound = key_caches.empty() && value_caches.empty();
    const auto& keys = bound ? bound_keys : key_caches;
    const auto& values = bound ? bound_values : value_caches;
    TORCH_CHECK(keys.size() == layers.size() && values.size() == layers.size(),
                "DecodeStack.run: one key and one value cache per layer");
    const StepTensors step{cos, sin, keys, values, store_rows, store_slots, tables, seq_lens, rows};
    if (hidden.size(0) <= kFusedRows && fusable())
      run_fused(hidden, step);
    else
      run_operators(hidden, step);
  }

  // Every layer's q/k/v product hands out float32 (rotary's input): the region's layout.
  bool fusable() const {
    for (const Layer& l : layers)
      if (l.qkv.bf16_out) return false;
    return true;
  }

  // The operators one after another.
  void run_operators(at::Tensor hidden, const StepTensors& step) const {
    static const auto rms_norm =
        op("slipstream_cpu::rms_norm")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
    static const auto silu_mul =
        op("slipstream_cpu::silu_mul").typed<at::Tensor(const at::Tensor&)>();
    const int64_t t = hidden.size(0);
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& l = layers[i];
      at::Tensor qkv = l.qkv(rms_norm.call(hidden, l.norm_in, l.eps_in));
      at::Tensor q;
      rotary_and_store(l, qkv, step.cos, step.sin, step.key_caches[i], step.value_caches[i],
                       step.store_rows, step.store_slots, q);
      at::Tensor out = at::empty_like(q);
      attend(l, out, q, step.key_caches[i], step.value_caches[i], step.tables, step.seq_lens,
             step.rows);
      hidden.add_(l.o(out.reshape({t, heads * head_dim})));
      hidden.add_(l.down(silu_mul.call(l.gate_up(rms_norm.call(hidden, l.norm_post,
                                                               l.eps_post)))));
    }
  }

  // q and k through rotary (q kept for attention), k and v into the cache.
  void rotary_and_store(const Layer& l, const at::Tensor& qkv, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& store_rows,
                        const at::Tensor& store_slots, at::Tensor& q_out) const {
    static const auto rotary =
        op("slipstream_cpu::rotary")
            .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              int64_t)>();
    const int64_t t = qkv.size(0);
    at::Tensor q = qkv.narrow(1, 0, l.q_size);
    at::Tensor k = qkv.narrow(1, l.q_size, l.kv_size);
    at::Tensor v = qkv.narrow(1, l.q_size + l.kv_size, l.kv_size);
    if (q.scalar_type() != at::kFloat) {
      q = q.to(at::kFloat);
      k = k.to(at::kFloat);
    }
    q_out = rotary.call(q, cos, sin, head_dim).view({t, -1, head_dim});
    k = rotary.call(k, cos, sin, head_dim).view({t, -1, head_dim});
    v = v.reshape({t, kv_heads, head_dim});
    store(k, v, key_cache, value_cache, store_rows, store_slots);
  }

  static void attend(const Layer& l, at::Tensor& out, const at::Tensor& q,
                     const at::Tensor& key_cache, const at::Tensor& value_cache,
                     const at::Tensor& tables, const at::Tensor& seq_lens,
                     const at::Tensor& rows) {
    static const auto attention =
        op("slipstream_cpu::paged_decode_attention")
            .typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                        int64_t, double)>();
    attention.call(out, q, key_cache, value_cache, tables, seq_lens, rows, l.scaling, l.window,
                   0.0);
  }

  // One parallel region (see the header). Each phase's tasks: a product's panels (in runs,
  // as its operator splits them), the sequences' attention (in runs), the rows' activation.
  void run_fused(at::Tensor hidden, const StepTensors& step) const {
    static const auto silu_mul =
        op("slipstream_cpu::silu_mul").typed<at::Tensor(const at::Tensor&)>();
    const int64_t t = hidden.size(0), width = hidden.size(1);
    const int threads = std::max(1, at::get_num_threads());
    const int64_t seqs = step.seq_lens.size(0);
    const at::Tensor like = hidden.new_empty({0});
    // the step's shared buffers (one layer's at a time)
    int64_t qkv_n = 0, gu_n = 0;
    for (const Layer& l : layers) {
      qkv_n = std::max(qkv_n, l.qkv.n);
      gu_n = std::max(gu_n, l.gate_up.n);
    }
    at::Tensor qkv_buf = at::empty({t, qkv_n}, like.options());
    at::Tensor gu_f32 = at::empty({t, gu_n}, like.options());
    at::Tensor gu_bf16 = at::empty({t, gu_n}, like.options().dtype(at::kBFloat16));
    at::Tensor o_f32 = at::empty({t, width}, like.options());
    at::Tensor o_bf16 = at::empty({t, width}, like.options().dtype(at::kBFloat16));
    at::Tensor attn = at::empty({t, heads, head_dim}, like.options());
    at::Tensor act;  // written by one task, read by the next phase's
    // q and k through rotary: q read by attention, k stored (rotary_rows, the operator's own)
    int64_t q_max = 0, kv_max = 0;
    for (const Layer& l : layers) {
      q_max = std::max(q_max, l.q_size);
      kv_max = std::max(kv_max, l.kv_size);
    }
    at::Tensor q_rot = at::empty({t, heads, head_dim}, like.options());
    at::Tensor k_rot = at::empty({t, kv_max}, like.options());
    TORCH_CHECK(q_max == heads * head_dim, "DecodeStack: q width must be heads * head_dim");
    const at::Tensor cos_c = step.cos.contiguous(), sin_c = step.sin.contiguous();
    TORCH_CHECK(cos_c.scalar_type() == at::kFloat && cos_c.dim() == 2 && cos_c.size(0) == t &&
                    cos_c.size(1) == head_dim && sin_c.sizes() == cos_c.sizes(),
                "DecodeStack.run: cos/sin must be float32 [T, head_dim]");
    static const auto rotary_rows = reinterpret_cast<RotaryRows>(
        op("slipstream_cpu::rotary_rows_address").typed<int64_t()>().call());
    Schedule schedule(static_cast<int64_t>(layers.size()) * kSteps, tuning);
    // each layer's products' weights: q/k/v, o, gate/up, down
    std::unique_ptr<Prefetch[]> weights(new Prefetch[layers.size() * 4]);
    for (size_t i = 0; i < layers.size(); ++i) {
      const Product* products[] = {&layers[i].qkv, &layers[i].o, &layers[i].gate_up,
                                   &layers[i].down};
      for (int j = 0; j < 4; ++j) {
        weights[i * 4 + j].base = static_cast<const char*>(products[j]->packed.data_ptr());
        weights[i * 4 + j].lines = products[j]->packed.nbytes() / 64;
      }
    }
    float* h = hidden.data_ptr<float>();
    // runs of panels per task: a few per thread, so that one preempted thread's share moves on
    auto panel_tasks = [&](const Product& p) {
      const int64_t chunks = (t + kProductRowChunk - 1) / kProductRowChunk;
      const int64_t grain =
          chunks > 1 ? 1
                     : std::max<int64_t>(1, p.panels() / (tuning.tasks_per_thread * threads));
      return std::make_pair(chunks, grain);
    };
    auto product_phase = [&](int64_t index, const Product& p, const Input& in, int64_t K,
                             void* y, bool residual, std::initializer_list<Prefetch*> ahead) {
      const auto [chunks, grain] = panel_tasks(p);
      const int64_t total = p.panels() * chunks, tasks = (total + grain - 1) / grain;
      return schedule.work(index, tasks, [&](int64_t task) {
        for (int64_t flat = task * grain; flat < std::min(total, (task + 1) * grain); ++flat) {
          const int64_t panel = flat / chunks, m0 = (flat % chunks) * kProductRowChunk;
          const int64_t m1 = std::min(t, m0 + kProductRowChunk);
          p.panels_into(in, K, m0, m1, panel, panel + 1, y);
          if (!residual) continue;
          // hidden += y for this panel's columns (Python's hidden.add_(y), element by element)
          const int64_t n0 = panel * kPanelColumns, cols = std::min(kPanelColumns, p.n - n0);
          for (int64_t r = m0; r < m1; ++r) {
            float* hr = h + r * width + n0;
            if (p.bf16_out) {
              const uint16_t* yr = static_cast<const uint16_t*>(y) + r * p.n + n0;
              for (int64_t c = 0; c < cols; ++c) {
                const uint32_t bits = static_cast<uint32_t>(yr[c]) << 16;
                float f;
                std::memcpy(&f, &bits, sizeof f);
                hr[c] = hr[c] + f;
              }
            } else {
              const float* yr = static_cast<const float*>(y) + r * p.n + n0;
              for (int64_t c = 0; c < cols; ++c) hr[c] = hr[c] + yr[c];
            }
          }
        }
      }, ahead);
    };
    // attention's work items, as its operator splits them (one per sequence and KV head at
    // one sequence: the threads share it)
    const int64_t heads_per_item =
        slipstream_cpu::decode_attention_heads_per_item(seqs, kv_heads, threads);
    const int64_t attention_items = seqs * (kv_heads / heads_per_item);
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      thread_local Input in;
      thread_local std::vector<float> normed;
      normed.resize(t * width);
      const at::Tensor x = at::from_blob(normed.data(), {t, width}, like.options());
      // where the time goes, seen by the region's first thread (phase_times)
      const bool timed = timing && at::get_thread_num() == 0;
      auto last = Clock::now();
      auto mark = [&](Timed kind) {
        if (!timed) return;
        const auto now = Clock::now();
        phase_seconds[kind] += std::chrono::duration<double>(now - last).count();
        last = now;
      };
      for (size_t i = 0; i < layers.size(); ++i) {
        const Layer& l = layers[i];
        const int64_t base = static_cast<int64_t>(i) * kSteps;
        Prefetch* o_w = &weights[i * 4 + 1];
        Prefetch* gate_up_w = &weights[i * 4 + 2];
        Prefetch* down_w = &weights[i * 4 + 3];
        Prefetch* next_qkv = i + 1 < layers.size() ? &weights[(i + 1) * 4] : nullptr;
        norm_rows(h, l.norm_in, l.eps_in, t, width, normed.data());
        l.qkv.prepare(x, in);
        mark(kTimedPrepare);
        float* qkv = qkv_buf.data_ptr<float>();  // rows of this layer's width, [t, l.qkv.n]
        if (!product_phase(base + kQkv, l.qkv, in, width, qkv, false, {o_w})) return;
        mark(kTimedQkv);
        if (!schedule.work(base + kRotaryStore, 1, [&](int64_t) {
              const float* c = cos_c.data_ptr<float>();
              const float* sn = sin_c.data_ptr<float>();
              rotary_rows(qkv, l.qkv.n, c, sn, 0, t, l.q_size, head_dim,
                          q_rot.data_ptr<float>());
              float* k = k_rot.data_ptr<float>();
              rotary_rows(qkv + l.q_size, l.qkv.n, c, sn, 0, t, l.kv_size, head_dim, k);
              store_rows_into(k, l.kv_size, step.key_caches[i], step.store_rows, step.store_slots);
              store_rows_into(qkv + l.q_size + l.kv_size, l.qkv.n, step.value_caches[i],
                              step.store_rows, step.store_slots);
            }, {o_w, gate_up_w}))
          return;
        mark(kTimedRotaryStore);
        if (!schedule.work(base + kAttention, attention_items, [&](int64_t item) {
              slipstream_cpu::decode_attention_items(attn, q_rot, step.key_caches[i],
                                                     step.value_caches[i], step.tables,
                                                     step.seq_lens, step.rows, l.scaling,
                                                     l.window, 0.0, heads_per_item, item, item + 1);
            }, {o_w, gate_up_w}))
          return;
        mark(kTimedAttention);
        l.o.prepare(attn.view({t, heads * head_dim}), in);
        mark(kTimedPrepare);
        void* o_y = l.o.bf16_out ? o_bf16.data_ptr() : o_f32.data_ptr();
        if (!product_phase(base + kOutProj, l.o, in, heads * head_dim, o_y, true,
                           {gate_up_w, down_w}))
          return;
        mark(kTimedOut);
        norm_rows(h, l.norm_post, l.eps_post, t, width, normed.data());
        l.gate_up.prepare(x, in);
        mark(kTimedPrepare);
        void* gu = l.gate_up.bf16_out ? gu_bf16.data_ptr() : gu_f32.data_ptr();
        if (!product_phase(base + kGateUp, l.gate_up, in, width, gu, false, {down_w})) return;
        mark(kTimedGateUp);
        if (!schedule.work(base + kActivation, 1, [&](int64_t) {
              const at::Tensor written = at::from_blob(
                  gu, {t, l.gate_up.n},
                  like.options().dtype(l.gate_up.bf16_out ? at::kBFloat16 : at::kFloat));
              act = silu_mul.call(written);
            }, {down_w, next_qkv}))
          return;
        mark(kTimedActivation);
        l.down.prepare(act, in);
        mark(kTimedPrepare);
        void* d_y = l.down.bf16_out ? o_bf16.data_ptr() : o_f32.data_ptr();
        if (!product_phase(base + kDown, l.down, in, l.gate_up.n / 2, d_y, true, {next_qkv}))
          return;
        mark(kTimedDown);
      }
    });
    if (schedule.error) std::rethrow_exception(schedule.error);
  }

  // RMSNorm of rows [0, t) of h into out, by the norm operator's row function.
  static void norm_rows(const float* h, const at::Tensor& weight, double eps, int64_t t,
                        int64_t width, float* out) {
    const float* w = weight.data_ptr<float>();
    for (int64_t r = 0; r < t; ++r)
      slipstream_cpu::rms_norm_row(h + r * width, w, static_cast<float>(eps), width,
                                   out + r * width);
  }

  // The stored rows of x (row stride `stride`, one cache row wide) into their slots of the
  // flat cache, rounded to the cache's dtype as torch's .to() rounds (store below, without
  // its index_select and dtype copies).
  static void store_rows_into(const float* x, int64_t stride, const at::Tensor& cache,
                              const at::Tensor& store_rows, const at::Tensor& slots) {
    if (slots.numel() == 0) return;  // no row has a slot
    TORCH_CHECK(cache.is_contiguous() && slots.scalar_type() == at::kLong &&
                    (store_rows.numel() == 0 || store_rows.scalar_type() == at::kLong),
                "DecodeStack: a contiguous cache, int64 slots and rows");
    const int64_t flat = cache.size(0) * cache.size(1), width = cache.size(2) * cache.size(3);
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* row = store_rows.numel() ? store_rows.data_ptr<int64_t>() : nullptr;
    const bool bf16 = cache.scalar_type() == at::kBFloat16;
    TORCH_CHECK(bf16 || cache.scalar_type() == at::kFloat, "DecodeStack: a float32 or bf16 cache");
    for (int64_t j = 0; j < slots.numel(); ++j) {
      TORCH_CHECK(slot[j] >= 0 && slot[j] < flat, "DecodeStack: slot ", slot[j], " out of range");
      const float* src = x + (row ? row[j] : j) * stride;
      if (bf16) {
        auto* dst = reinterpret_cast<c10::BFloat16*>(cache.data_ptr()) + slot[j] * width;
        for (int64_t c = 0; c < width; ++c) dst[c] = c10::BFloat16(src[c]);
      } else {
        std::memcpy(cache.data_ptr<float>() + slot[j] * width, src, width * sizeof(float));
      }
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
      .def("add_layer", &DecodeStack::add_layer)
      .def("bind_caches", &DecodeStack::bind_caches)
      .def("time_phases", &DecodeStack::time_phases)
      .def("tune", &DecodeStack::tune)
      .def("phase_times", &DecodeStack::phase_times);
  m.def(
      "decode_stack_run(__torch__.torch.classes.slipstream_cpu.DecodeStack stack, "
      "Tensor(a!) hidden, Tensor cos, Tensor sin, Tensor(b!)[] key_caches, "
      "Tensor(c!)[] value_caches, Tensor store_rows, Tensor store_slots, Tensor tables, "
      "Tensor seq_lens, Tensor rows) -> ()",
      &decode_stack_run);
}
