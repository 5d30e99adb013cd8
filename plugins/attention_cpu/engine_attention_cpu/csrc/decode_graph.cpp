// The decode step captured once and replayed in C++: the decoder-layer loop of a Llama-shaped model (norms,
// products, RoPE, KV write, paged decode attention, SiLU-and-multiply, and each token's LoRA adapter product where
// the step has adapters) for pure decode steps, with no Python between the kernels, the role CUDA graphs play on a
// GPU.
//
// It calls the very kernels the eager layers call, in the same order on the same tensors, so a captured step
// gives the eager step's bits: this file compiles those kernel sources in (their Python bindings left out),
// each with the floating-point contraction it is built with on its own (-ffp-contract=off for the layer and
// integer-dot kernels, the compiler's default for the GEMM and attention).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "cache_dtypes.h"  // before paged_attention.cpp, which includes them inside a namespace below
#include "lanes16.h"
#include "spin_pool.h"
#include "vec_avx2.h"

#define ENGINE_KERNELS_NO_MODULE 1

#include "gemm.cpp"  // namespace engine_cpu
namespace engine_attention {
#include "paged_attention.cpp"
}  // namespace engine_attention

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace engine_layers {
#include "layer_kernels.cpp"
}  // namespace engine_layers
#include "quant_gemm.cpp"  // namespace engine_quant
#pragma GCC pop_options
namespace engine_lora {
#include "lora.cpp"
}  // namespace engine_lora

namespace engine_graph {

// One linear layer's product at decode row counts: the float32 AVX2 GEMM on packed panels, integer block dot
// products on a packed quantized weight (the same entry points as CpuPackedLinear and QuantDotProduct), or, where
// the measurement chose a product outside this plugin (torch's, oneDNN's), that Python callable, called with the
// GIL taken for it.
// With LoRA enabled, the layer's adapter slots (LoRALinear's A and B, filled in place as adapters come and go) and
// its output slices: a step whose tokens run adapters adds each token's own product (LayerKernels.add_lora).
struct Product {
  enum Kind { kGemm, kQuant, kPython } kind = kGemm;
  torch::Tensor weight;  // panels [ceil(N/16), K, 16] float32, or packed blocks [N, bytes]
  c10::optional<torch::Tensor> scales, bias;
  int64_t format = 0, variant = 0, out_features = 0;
  std::shared_ptr<py::object> callable;
  torch::Tensor lora_a, lora_b;  // undefined without LoRA
  std::vector<int64_t> slice_offsets, slice_sizes;

  // x [T, K] -> [T, out_features]: written into `out` (contiguous [T, out_features]) where x and out are float32 rows
  // and the product is this plugin's, else a new tensor (the dtype conversions of forward, a Python product's own).
  torch::Tensor operator()(const torch::Tensor& x, const torch::Tensor& out,
                           const c10::optional<torch::Tensor>& token_slots) const {
    torch::Tensor y;
    const bool into = kind != kPython && x.scalar_type() == torch::kFloat && x.stride(1) == 1 &&
                      out.scalar_type() == torch::kFloat;
    switch (kind) {
      case kQuant:
        if (into && x.is_contiguous()) {
          engine_quant::linear(out, x, weight, scales, format, variant, bias);
          y = out;
        } else {
          y = engine_quant::forward(x, weight, scales, format, variant, bias, out_features);
        }
        break;
      case kGemm:
        if (into) {
          engine_cpu::forward_into(out, x, weight, bias, out_features, variant);
          y = out;
        } else {
          y = engine_cpu::forward(x, weight, bias, out_features, variant);
        }
        break;
      default: {
        py::gil_scoped_acquire gil;
        y = (*callable)(x).cast<torch::Tensor>();
      }
    }
    if (token_slots.has_value() && lora_a.defined())
      engine_lora::add_lora(y, x, lora_a, lora_b, *token_slots, slice_offsets, slice_sizes);
    return y;
  }
};

// The step's intermediate tensors, kept from one step to the next, as a CUDA graph keeps its static buffers: each
// is the first T rows of a buffer sized for the most tokens seen, the same tensor for every layer of every step of T
// tokens. A replayed step then allocates its output only; it made 630 tensors a step before (SmolLM2: an empty, a
// view and a reshape per product, views and narrows per layer), each a few hundred nanoseconds of the calling
// thread while the pool's worker waited.
class StepBuffers {
 public:
  enum Role { kHidden, kOProj, kQkv, kAttention, kGateUp, kActivation };
  // [tokens, cols] of `role`; `epoch()` changes whenever a tensor this returns for a token count changes
  const torch::Tensor& get(Role role, int64_t tokens, int64_t cols, const torch::TensorOptions& options) {
    Entry& e = entries_[{role, cols}];
    if (!e.base.defined() || e.base.size(0) < tokens || e.base.scalar_type() != options.dtype().toScalarType()) {
      e.base = at::empty({tokens, cols}, options);
      e.tokens = -1;
    }
    if (e.tokens != tokens) {
      e.rows = e.base.narrow(0, 0, tokens);
      e.tokens = tokens;
      ++epoch_;
    }
    return e.rows;
  }
  uint64_t epoch() const { return epoch_; }

 private:
  struct Entry {
    torch::Tensor base, rows;
    int64_t tokens = -1;
  };
  std::map<std::pair<int, int64_t>, Entry> entries_;
  uint64_t epoch_ = 0;
};

struct Layer {
  torch::Tensor input_norm, post_norm;  // float32
  double eps;
  Product qkv, o, gate_up, down;
  c10::optional<torch::Tensor> o_bias, down_bias;  // row-parallel biases, added after the product
  int64_t num_heads, num_kv_heads, head_size;
  int64_t qkv_features, gate_up_features;  // the two products' widths (gate_up's 0 where Python computes it)
  double scale, soft_cap;
  int64_t sliding_window;
  torch::Tensor cos, sin;  // RoPE tables [max_position, rotary_dim] float32
  // the layer's KV cache [2, blocks, kv_heads, block_size, head_size], its two halves seen token-major as
  // [blocks, block_size, kv_heads, head_size]: views made once, not each step
  torch::Tensor key_cache, value_cache;
  // the layer's views of the step buffers for `tokens` tokens, made when the buffers' epoch was `epoch`
  struct Views {
    int64_t tokens = -1;
    uint64_t epoch = 0;
    torch::Tensor hidden, o_out, qkv, attention, attention_rows, gate_up, activation;
    torch::Tensor q, k, v, q_heads, k_heads, v_heads;  // qkv's columns, and as [T, heads, head_size]
  } views;
};

// Where a replayed step's time goes, phase by phase (DecodeGraph.set_profiling): wall seconds summed over the steps
// run since the last read. Off by default; on, each phase costs two clock reads (tens of nanoseconds).
class PhaseClock {
 public:
  enum Phase { kNorm, kQkv, kRope, kKvWrite, kAttention, kO, kGateUp, kActivation, kDown, kPhases };
  static constexpr const char* kNames[kPhases] = {"norm",   "qkv",     "rope",       "kv_write", "attention",
                                                   "o_proj", "gate_up", "activation", "down"};
  bool on = false;
  // runs f, adding its wall time to `phase` when on
  template <class F>
  auto time(Phase phase, F&& f) -> decltype(f()) {
    if (!on) return f();
    const auto start = std::chrono::steady_clock::now();
    struct Add {
      PhaseClock& clock;
      Phase phase;
      std::chrono::steady_clock::time_point start;
      ~Add() { clock.seconds_[phase] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); }
    } add{*this, phase, start};
    return f();
  }
  // {phase: seconds} since the last read, then zero
  std::map<std::string, double> read() {
    std::map<std::string, double> out;
    for (int p = 0; p < kPhases; ++p) out[kNames[p]] = seconds_[p];
    seconds_.fill(0.0);
    return out;
  }

 private:
  std::array<double, kPhases> seconds_{};
};

class DecodeGraph {
 public:
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, double eps, std::vector<py::tuple> products,
                 c10::optional<torch::Tensor> o_bias, c10::optional<torch::Tensor> down_bias, int64_t num_heads,
                 int64_t num_kv_heads, int64_t head_size, double scale, double soft_cap, int64_t sliding_window,
                 torch::Tensor cos, torch::Tensor sin, torch::Tensor kv_cache, std::vector<py::object> loras) {
    TORCH_CHECK(products.size() == 4, "a layer has four products: qkv, o, gate_up, down");
    TORCH_CHECK(loras.empty() || loras.size() == 4, "one LoRA entry (or None) per product");
    TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, blocks, kv_heads, block, D]");
    Layer layer{input_norm.to(torch::kFloat32).contiguous(), post_norm.to(torch::kFloat32).contiguous(), eps};
    layer.qkv = product(products[0]);
    layer.o = product(products[1]);
    layer.gate_up = product(products[2]);
    layer.down = product(products[3]);
    Product* adapted[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (size_t i = 0; i < loras.size(); ++i) {
      if (loras[i].is_none()) continue;  // (lora_a, lora_b, slice offsets, slice sizes)
      const auto entry = loras[i].cast<py::tuple>();
      TORCH_CHECK(entry.size() == 4, "a LoRA entry is (lora_a, lora_b, slice_offsets, slice_sizes)");
      adapted[i]->lora_a = entry[0].cast<torch::Tensor>();
      adapted[i]->lora_b = entry[1].cast<torch::Tensor>();
      adapted[i]->slice_offsets = entry[2].cast<std::vector<int64_t>>();
      adapted[i]->slice_sizes = entry[3].cast<std::vector<int64_t>>();
    }
    layer.o_bias = o_bias;
    layer.down_bias = down_bias;
    layer.num_heads = num_heads;
    layer.num_kv_heads = num_kv_heads;
    layer.head_size = head_size;
    layer.qkv_features = layer.qkv.kind == Product::kPython ? (num_heads + 2 * num_kv_heads) * head_size
                                                             : layer.qkv.out_features;
    layer.gate_up_features = layer.gate_up.kind == Product::kPython ? 0 : layer.gate_up.out_features;
    layer.scale = scale;
    layer.soft_cap = soft_cap;
    layer.sliding_window = sliding_window;
    layer.cos = cos;
    layer.sin = sin;
    layer.key_cache = kv_cache.select(0, 0).transpose(1, 2);
    layer.value_cache = kv_cache.select(0, 1).transpose(1, 2);
    layers_.push_back(std::move(layer));
  }

  void set_final_norm(torch::Tensor weight, double eps) {
    final_norm_ = weight.to(torch::kFloat32).contiguous();
    final_eps_ = eps;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [T, H] (the embedded tokens, one per request), positions [T], slot_mapping [T] int64, block_table
  // [T, max_blocks] int32, seq_lens [T] int32, token_slots [T] int64 (each token's LoRA slot, -1: the base model;
  // None: no token runs an adapter) -> the final norm's output [T, H], as LlamaModel.forward gives it.
  torch::Tensor run(torch::Tensor hidden, torch::Tensor positions, torch::Tensor slot_mapping,
                    torch::Tensor block_table, torch::Tensor seq_lens, c10::optional<torch::Tensor> token_slots) {
    TORCH_CHECK(!layers_.empty() && final_norm_.defined(), "the decode graph has no layers");
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden states: contiguous [tokens, hidden]");
    const int64_t tokens = hidden.size(0);
    const torch::Tensor pos = positions.to(torch::kInt64).contiguous();
    torch::Tensor residual;
    using P = PhaseClock;
    PhaseClock& clock = clock_;  // off: each phase is a plain call
    for (size_t i = 0; i < layers_.size(); ++i) {
      Layer& L = layers_[i];
      const Layer::Views& V = views(L, tokens, hidden.options());
      const bool last = i + 1 == layers_.size();
      clock.time(P::kNorm, [&] {
        if (i == 0) {
          residual = hidden;
          hidden = V.hidden;
          engine_layers::rms_norm(hidden, residual, L.input_norm, L.eps);
        } else {
          engine_layers::fused_add_rms_norm(hidden, residual, L.input_norm, L.eps);
        }
      });
      const int64_t q_size = L.num_heads * L.head_size, kv_size = L.num_kv_heads * L.head_size;
      const torch::Tensor qkv = clock.time(P::kQkv, [&] { return L.qkv(hidden, V.qkv, token_slots); });
      const bool buffered = qkv.unsafeGetTensorImpl() == V.qkv.unsafeGetTensorImpl();
      const torch::Tensor q = buffered ? V.q : qkv.narrow(1, 0, q_size),
                          k = buffered ? V.k : qkv.narrow(1, q_size, kv_size),
                          v = buffered ? V.v : qkv.narrow(1, q_size + kv_size, kv_size);
      clock.time(P::kRope, [&] { engine_layers::rotary_embedding(pos, q, k, L.cos, L.sin, L.head_size); });
      const torch::Tensor &key_cache = L.key_cache, &value_cache = L.value_cache;
      clock.time(P::kKvWrite, [&] {
        engine_attention::write_kv_cache(key_cache, value_cache,
                                         buffered ? V.k_heads : k.view({tokens, L.num_kv_heads, L.head_size}),
                                         buffered ? V.v_heads : v.view({tokens, L.num_kv_heads, L.head_size}),
                                         slot_mapping);
      });
      clock.time(P::kAttention, [&] {
        engine_attention::paged_decode_attention(
            V.attention, (buffered ? V.q_heads : q.view({tokens, L.num_heads, L.head_size})).contiguous(),
            key_cache, value_cache, block_table, seq_lens, L.scale, L.soft_cap, L.sliding_window);
      });
      hidden = clock.time(P::kO, [&] {
        torch::Tensor y = L.o(V.attention_rows, V.o_out, token_slots);
        return L.o_bias.has_value() ? y + *L.o_bias : y;
      });
      clock.time(P::kNorm, [&] { engine_layers::fused_add_rms_norm(hidden, residual, L.post_norm, L.eps); });
      const torch::Tensor gate_up = clock.time(P::kGateUp, [&] { return L.gate_up(hidden, V.gate_up, token_slots); });
      const bool act_buffered =
          gate_up.scalar_type() == V.activation.scalar_type() && gate_up.size(1) == 2 * V.activation.size(1);
      const torch::Tensor act =
          act_buffered ? V.activation : at::empty({tokens, gate_up.size(1) / 2}, gate_up.options());
      clock.time(P::kActivation, [&] { engine_layers::silu_and_mul(act, gate_up); });
      hidden = clock.time(P::kDown, [&] {
        // the last layer's into a tensor of its own: the step's output, which the caller keeps
        const torch::Tensor out = last ? at::empty_like(V.hidden) : V.hidden;
        torch::Tensor y = L.down(act, out, token_slots);
        return L.down_bias.has_value() ? y + *L.down_bias : y;
      });
    }
    clock.time(P::kNorm, [&] { engine_layers::fused_add_rms_norm(hidden, residual, final_norm_, final_eps_); });
    return hidden;
  }

  // L's views of the step buffers for `tokens` tokens, made again only when the token count or a buffer changed
  const Layer::Views& views(Layer& L, int64_t tokens, const torch::TensorOptions& options) {
    Layer::Views& V = L.views;
    if (V.tokens == tokens && V.epoch == buffers_.epoch()) return V;
    using B = StepBuffers;
    const int64_t hidden_size = L.input_norm.size(0), q_size = L.num_heads * L.head_size,
                  kv_size = L.num_kv_heads * L.head_size;
    V.hidden = buffers_.get(B::kHidden, tokens, hidden_size, options);
    V.o_out = buffers_.get(B::kOProj, tokens, hidden_size, options);
    V.qkv = buffers_.get(B::kQkv, tokens, L.qkv_features, options);
    V.attention_rows = buffers_.get(B::kAttention, tokens, q_size, options);
    V.gate_up = buffers_.get(B::kGateUp, tokens, L.gate_up_features, options);
    V.activation = buffers_.get(B::kActivation, tokens, L.gate_up_features / 2, options);
    V.attention = V.attention_rows.view({tokens, L.num_heads, L.head_size});
    V.q = V.qkv.narrow(1, 0, q_size);
    V.k = V.qkv.narrow(1, q_size, kv_size);
    V.v = V.qkv.narrow(1, q_size + kv_size, kv_size);
    V.q_heads = V.q.view({tokens, L.num_heads, L.head_size});
    V.k_heads = V.k.view({tokens, L.num_kv_heads, L.head_size});
    V.v_heads = V.v.view({tokens, L.num_kv_heads, L.head_size});
    V.tokens = tokens;
    V.epoch = buffers_.epoch();  // (after every get: a get that re-made a tensor moved the epoch on)
    return V;
  }

  void set_profiling(bool on) {
    clock_.on = on;
    clock_.read();
  }
  std::map<std::string, double> phase_seconds() { return clock_.read(); }

 private:
  // ("gemm", panels, bias, out_features, variant), ("quant", data, scales, bias, format, variant, out_features) or
  // ("python", callable)
  static Product product(const py::tuple& spec) {
    Product p;
    const std::string kind = spec[0].cast<std::string>();
    if (kind == "python") {
      TORCH_CHECK(spec.size() == 2, "a python product is (\"python\", callable)");
      p.kind = Product::kPython;
      // released with the GIL held: the graph is destroyed from Python
      p.callable = std::make_shared<py::object>(spec[1]);
      return p;
    }
    p.weight = spec[1].cast<torch::Tensor>();
    if (kind == "gemm") {
      TORCH_CHECK(spec.size() == 5, "a gemm product is (\"gemm\", panels, bias, out_features, variant)");
      p.bias = spec[2].cast<c10::optional<torch::Tensor>>();
      p.out_features = spec[3].cast<int64_t>();
      p.variant = spec[4].cast<int64_t>();
      TORCH_CHECK(engine_cpu::cpu_has_variant(p.variant), "this CPU lacks the instructions of GEMM variant ",
                  p.variant);
    } else {
      TORCH_CHECK(kind == "quant" && spec.size() == 7,
                  "a product is (\"gemm\", panels, bias, n, variant) or (\"quant\", data, scales, bias, format, variant, n)");
      p.kind = Product::kQuant;
      p.scales = spec[2].cast<c10::optional<torch::Tensor>>();
      p.bias = spec[3].cast<c10::optional<torch::Tensor>>();
      p.format = spec[4].cast<int64_t>();
      p.variant = spec[5].cast<int64_t>();
      p.out_features = spec[6].cast<int64_t>();
      TORCH_CHECK(engine_quant::cpu_has(static_cast<int>(p.variant)), "this CPU lacks the instructions of variant ",
                  p.variant);
    }
    return p;
  }

  std::vector<Layer> layers_;
  StepBuffers buffers_;
  PhaseClock clock_;
  torch::Tensor final_norm_;
  double final_eps_ = 0;
};

}  // namespace engine_graph

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<engine_graph::DecodeGraph>(m, "DecodeGraph")
      .def(py::init<>())
      .def("add_layer", &engine_graph::DecodeGraph::add_layer, py::arg("input_norm"), py::arg("post_norm"),
           py::arg("eps"), py::arg("products"), py::arg("o_bias"), py::arg("down_bias"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_size"), py::arg("scale"), py::arg("soft_cap"),
           py::arg("sliding_window"), py::arg("cos"), py::arg("sin"), py::arg("kv_cache"),
           py::arg("loras") = std::vector<py::object>())
      .def("set_final_norm", &engine_graph::DecodeGraph::set_final_norm)
      .def("num_layers", &engine_graph::DecodeGraph::num_layers)
      // per-phase wall time of the steps run while on (scripts/profile_decode_step.py --phases)
      .def("set_profiling", &engine_graph::DecodeGraph::set_profiling)
      .def("phase_seconds", &engine_graph::DecodeGraph::phase_seconds)
      // without the GIL, as the eager kernels: the engine's other Python threads run during the step
      .def("run", &engine_graph::DecodeGraph::run, py::arg("hidden"), py::arg("positions"),
           py::arg("slot_mapping"), py::arg("block_table"), py::arg("seq_lens"), py::arg("token_slots") = py::none(),
           py::call_guard<py::gil_scoped_release>());
}
