// The fused mixture-of-experts operation on the CPU: a token's chosen experts run as grouped products.
//
// One call per MoE layer and step: the (token, choice) pairs are counting-sorted by expert (tokens in order within
// an expert), each expert with tokens runs its gate/up product on its rows in one product, SiLU-and-multiply runs
// over every row at once, then each expert's down product, and the weighted outputs are added into each token's
// row in the order of the experts' ids (as the torch reference adds them). No Python between the experts.
//
// An expert's product is one of two kinds, chosen by its row count (the caller measures both at load): the GEMM of
// gemm.cpp on 16-column panels (its GEMV for up to 16 rows, in the widest variant this CPU runs), or oneDNN's
// packed product (mkldnn::_linear_pointwise on a weight reordered once, in float32 or the model's 16-bit dtype).
// The panels hold float32, or bfloat16 / float16 when every weight is exactly that (a 16-bit model's, or a float32
// model's loaded from a 16-bit checkpoint): widened to float32 as they are read, they give the float32 panels' bits
// and read half the bytes, which is what a decode step's experts cost. Each kind gives a row's result
// independently of the other rows it runs with.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

#include "spin_pool.h"
#include "vec_avx2.h"

#define ENGINE_KERNELS_NO_MODULE 1
#include "gemm.cpp"  // namespace engine_cpu

// the integer-dot kernels of quantized experts, with the contraction setting they are built with on their own
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#include "quant_gemm.cpp"  // namespace engine_quant
#pragma GCC pop_options

namespace engine_moe {

// oneDNN's packed linear product, as torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], None)
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.emplace_back(x);
  stack.emplace_back(weight);
  stack.emplace_back(c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(c10::IValue());
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// How one layer's experts run their products: panels (the GEMM) below `onednn_min_rows` rows, oneDNN from there.
struct ExpertWeightsView {
  c10::optional<torch::Tensor> panels;         // [E, panels, K, 16] float32, bfloat16 or float16, or none
  const std::vector<torch::Tensor>* onednn;     // one reordered weight per expert, or empty
  int64_t onednn_min_rows;
  // whether an expert product of m rows runs on oneDNN (else on the panels)
  bool onednn_takes(int64_t m) const { return !onednn->empty() && (m >= onednn_min_rows || !panels.has_value()); }
};

#ifdef ENGINE_AVX2
// Whether the expert products' own kernels run the GEMM's AVX-512 variant: its widest on this CPU (the variants give
// the same bits); the SIMDe build for tests always runs it, emulated.
bool widest_is_avx512() {
#ifdef ENGINE_EMULATE_AVX512
  return true;
#else
  static const bool avx512 = engine_cpu::default_variant() == engine_cpu::kVariantAvx512;
  return avx512;
#endif
}
#endif

// out[m, n] = x[m, k] @ W.T for one expert (rows are contiguous), by the kind its row count takes (products of
// up to kSmallRows rows on the panels run in run_products' shared pass instead).
void expert_product(const float* x, int64_t m, int64_t k, const ExpertWeightsView& weights, int64_t expert, int64_t n,
                    float* out) {
  auto options = torch::TensorOptions().dtype(at::kFloat);
  torch::Tensor rows = torch::from_blob(const_cast<float*>(x), {m, k}, options);
  torch::Tensor result = torch::from_blob(out, {m, n}, options);
  if (weights.onednn_takes(m)) {
    const torch::Tensor& w = (*weights.onednn)[expert];
    torch::Tensor y = onednn_linear(w.scalar_type() == at::kFloat ? rows : rows.to(w.scalar_type()), w);
    result.copy_(y);
    return;
  }
  TORCH_CHECK(weights.panels.has_value(), "no packed weights for an expert product of ", m, " rows");
  const torch::Tensor packed = (*weights.panels)[expert];
  if (packed.scalar_type() == at::kFloat) {
    engine_cpu::linear(result, rows, packed, c10::nullopt);
    return;
  }
#ifdef ENGINE_AVX2
  // 16-bit panels: widened into the thread's buffer once per product (a work item is a panel, or a pair of panels
  // for the AVX-512 tile, against every row), then the float32 register tile of the widest variant, as quantized
  // weights are de-quantized (quant_gemm.cpp)
  AT_DISPATCH_REDUCED_FLOATING_TYPES(packed.scalar_type(), "expert_product", [&] {
    const scalar_t* w = packed.data_ptr<scalar_t>();
    const int64_t panel_elements = k * engine_cpu::kCols;
    auto widened = [w, panel_elements](int64_t q, int64_t count) {
      thread_local std::vector<float> buffer;
      if (buffer.size() < static_cast<size_t>(2 * panel_elements)) buffer.resize(2 * panel_elements);
      const scalar_t* src = w + q * panel_elements;
      for (int64_t i = 0; i < count * panel_elements; i += 8)
        engine_cpu::store8(buffer.data() + i, engine_cpu::load8(src + i));
      return static_cast<const float*>(buffer.data());
    };
    if (widest_is_avx512()) {
      engine_cpu::avx512::linear_pairs(
          out, n, x, k, m, k, packed.size(0), nullptr,
          [&widened](int64_t q, bool pair) { return widened(q, pair ? 2 : 1); }, /*whole_rows=*/true);
    } else {
      engine_cpu::linear_panels(
          out, n, x, k, m, k, packed.size(0), nullptr, [&widened](int64_t q) { return widened(q, 1); },
          /*whole_rows=*/true);
    }
  });
#else
  TORCH_CHECK(false, "16-bit expert panels need the AVX2 build");
#endif
}

constexpr int64_t kSmallRows = 16;  // experts with at most this many rows share one pass over (expert, panel) items

#ifdef ENGINE_AVX2
// R <= 4 rows against panels [q0, q1), in the GEMM's widest variant.
template <typename W>
void gemv_rows(int64_t rows, const float* x, int64_t k, const W* w, int64_t n, float* c, int64_t q0, int64_t q1) {
  if (widest_is_avx512()) {
    switch (rows) {
      case 1: return engine_cpu::avx512::gemv_panels<1>(x, k, w, k, n, nullptr, c, n, q0, q1);
      case 2: return engine_cpu::avx512::gemv_panels<2>(x, k, w, k, n, nullptr, c, n, q0, q1);
      case 3: return engine_cpu::avx512::gemv_panels<3>(x, k, w, k, n, nullptr, c, n, q0, q1);
      default: return engine_cpu::avx512::gemv_panels<4>(x, k, w, k, n, nullptr, c, n, q0, q1);
    }
  }
  switch (rows) {
    case 1: return engine_cpu::gemv_panels<1>(x, k, w, k, n, nullptr, c, n, q0, q1);
    case 2: return engine_cpu::gemv_panels<2>(x, k, w, k, n, nullptr, c, n, q0, q1);
    case 3: return engine_cpu::gemv_panels<3>(x, k, w, k, n, nullptr, c, n, q0, q1);
    default: return engine_cpu::gemv_panels<4>(x, k, w, k, n, nullptr, c, n, q0, q1);
  }
}

constexpr int64_t kPanelSpan = 4;  // panels a small product runs at once: at most 256 KiB of float32 weight (K 1024)

// The experts `small` (few rows each) in one job of the spin pool over (expert, panel) items: item_start[s] is the
// first item of small[s]; panels [E, panels_per_expert, K, 16] of element type W.
template <typename W>
void run_small_products(const float* x, int64_t k, const W* panels, int64_t panels_per_expert,
                        const std::vector<int64_t>& counts, const std::vector<int64_t>& small,
                        const std::vector<int64_t>& item_start, int64_t n, float* out) {
  const int64_t expert_elements = panels_per_expert * k * engine_cpu::kCols;
  engine_pool::parallel_range(item_start.back(), 8, [&](int64_t i0, int64_t i1) {
    while (i0 < i1) {  // a run of one expert's panels [q0, q1)
      const int64_t s = std::upper_bound(item_start.begin(), item_start.end(), i0) - item_start.begin() - 1;
      const int64_t q0 = i0 - item_start[s], q1 = std::min(i1, item_start[s + 1]) - item_start[s];
      const int64_t e = small[s], r0 = counts[e], m = counts[e + 1] - r0;
      const W* w = panels + e * expert_elements;
      // kPanelSpan panels at a time (independent sums in flight), every row chunk of 4 on them while they are in
      // cache: each weight is read from memory once
      for (int64_t q = q0; q < q1; q += kPanelSpan)
        for (int64_t r = 0; r < m; r += 4)
          gemv_rows(std::min<int64_t>(4, m - r), x + (r0 + r) * k, k, w, n, out + (r0 + r) * n, q,
                    std::min(q1, q + kPanelSpan));
      i0 += q1 - q0;
    }
  });
}
#endif

// Every expert's product of one phase (gate/up or down): out rows [counts[e], counts[e+1]) = x rows @ W_e.T. Experts
// with few rows on the panels run together in one job of the spin pool over (expert, panel) items, so a decode step
// pays one thread wake-up per phase instead of one per expert; the others run one product each.
void run_products(const float* x, int64_t k, const ExpertWeightsView& weights, const std::vector<int64_t>& counts,
                  int64_t n, float* out) {
  const int64_t experts = static_cast<int64_t>(counts.size()) - 1;
  std::vector<int64_t> small, item_start{0};
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t r0 = counts[e], m = counts[e + 1] - r0;
    if (m == 0) continue;
#ifdef ENGINE_AVX2
    if (!weights.onednn_takes(m) && m <= kSmallRows) {
      small.push_back(e);
      item_start.push_back(item_start.back() + weights.panels->size(1));
      continue;
    }
#endif
    expert_product(x + r0 * k, m, k, weights, e, n, out + r0 * n);
  }
#ifdef ENGINE_AVX2
  if (small.empty()) return;
  if (weights.panels->scalar_type() == at::kFloat) {
    run_small_products(x, k, weights.panels->data_ptr<float>(), weights.panels->size(1), counts, small, item_start, n,
                       out);
    return;
  }
  AT_DISPATCH_REDUCED_FLOATING_TYPES(weights.panels->scalar_type(), "run_small_products", [&] {
    run_small_products(x, k, weights.panels->data_ptr<scalar_t>(), weights.panels->size(1), counts, small,
                       item_start, n, out);
  });
#endif
}

// The products of one layer's experts, phase by phase: out rows [counts[e], counts[e+1]) = x rows @ W_e.T, for the
// gate/up weights (phase 0, n = 2I) or the down weights (phase 1, n = H).
using ExpertProducts = std::function<void(int phase, const float* x, int64_t k, const std::vector<int64_t>& counts,
                                          int64_t n, float* out)>;

// The per-row buffers of grouped_experts, one per stage.
enum ScratchSlot { kGathered = 0, kGateUp, kActivated, kDown, kScratchSlots };

// A float buffer of the calling thread that keeps its pages from call to call: a prompt chunk's expert rows are
// tens of MB, which fresh allocations would have the kernel map and zero on every layer and step.
float* scratch(ScratchSlot slot, int64_t floats) {
  thread_local std::vector<float> buffers[kScratchSlots];
  std::vector<float>& buffer = buffers[slot];
  if (buffer.size() < static_cast<size_t>(floats)) buffer.resize(floats);
  return buffer.data();
}

// The routing, grouping and combine around an experts' products. x [T, H] (any float dtype); topk_weights [T, K]
// float32, topk_ids [T, K] int64 global expert ids, expert_map [E_global] -> local index or -1 (experts other ranks
// hold) or None. Returns [T, H] in x's dtype.
torch::Tensor grouped_experts(torch::Tensor x, int64_t experts, int64_t intermediate, torch::Tensor topk_weights,
                              torch::Tensor topk_ids, c10::optional<torch::Tensor> expert_map,
                              const ExpertProducts& products) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be [tokens, hidden] on the CPU");
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = topk_ids.size(1);
  torch::Tensor xf = x.scalar_type() == at::kFloat ? x.contiguous() : x.to(at::kFloat).contiguous();
  torch::Tensor ids = topk_ids.to(at::kLong).contiguous();
  torch::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  torch::Tensor out = torch::zeros({tokens, hidden}, xf.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* map = nullptr;
  int64_t global_experts = experts;
  if (expert_map.has_value()) {
    TORCH_CHECK(expert_map->scalar_type() == at::kLong && expert_map->is_contiguous(), "expert_map must be int64");
    map = expert_map->data_ptr<int64_t>();
    global_experts = expert_map->numel();
  }

  // counting sort of the choices by local expert; choices of other ranks' experts are dropped
  std::vector<int64_t> counts(experts + 1, 0), local(tokens * top_k);
  for (int64_t c = 0; c < tokens * top_k; ++c) {
    TORCH_CHECK(id[c] >= 0 && id[c] < global_experts, "expert id ", id[c], " is outside the ", global_experts,
                " experts of this layer");
    const int64_t e = map ? map[id[c]] : id[c];
    local[c] = e;
    if (e >= 0) counts[e + 1]++;
  }
  for (int64_t e = 0; e < experts; ++e) counts[e + 1] += counts[e];  // counts[e]: first row of expert e
  const int64_t rows = counts[experts];
  if (rows == 0) return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
  std::vector<int64_t> next(counts.begin(), counts.end() - 1), choice_of_row(rows);
  for (int64_t c = 0; c < tokens * top_k; ++c)
    if (local[c] >= 0) choice_of_row[next[local[c]]++] = c;

  // each row: its token's hidden state; gate/up products expert by expert
  const float* xs = xf.data_ptr<float>();
  float* g = scratch(kGathered, rows * hidden);
  engine_pool::parallel_range(rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) std::copy(xs + (choice_of_row[r] / top_k) * hidden,
                                                xs + (choice_of_row[r] / top_k + 1) * hidden, g + r * hidden);
  });
  float* gate_up = scratch(kGateUp, rows * 2 * intermediate);
  products(0, g, hidden, counts, 2 * intermediate, gate_up);
  torch::Tensor gate_up_rows = torch::from_blob(gate_up, {rows, 2 * intermediate}, xf.options());
  torch::Tensor act = torch::from_blob(scratch(kActivated, rows * intermediate), {rows, intermediate}, xf.options());
  at::silu_out(act, gate_up_rows.narrow(1, 0, intermediate));
  act.mul_(gate_up_rows.narrow(1, intermediate, intermediate));
  float* down = scratch(kDown, rows * hidden);
  products(1, act.data_ptr<float>(), intermediate, counts, hidden, down);

  // combine: rows in expert order, so each token's outputs are added in the order of its experts' ids; threads
  // split the hidden columns (every token's sum keeps that order)
  const float* d = down;
  const float* w = weights.data_ptr<float>();
  float* o = out.data_ptr<float>();
  engine_pool::parallel_range(hidden, 256, [&](int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t c = choice_of_row[r];
      const float weight = w[c];
      float* dst = o + (c / top_k) * hidden;
      const float* src = d + r * hidden;
      for (int64_t j = c0; j < c1; ++j) dst[j] += weight * src[j];
    }
  });
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

// w13 [E, ceil(2I/16), H, 16] and w2 [E, ceil(H/16), I, 16] packed panels (float32, bfloat16 or float16) and/or
// one oneDNN-reordered weight per expert (w13_onednn, w2_onednn), the latter taking every expert product of at least
// onednn_min_rows rows.
torch::Tensor fused_experts(torch::Tensor x, c10::optional<torch::Tensor> w13, c10::optional<torch::Tensor> w2,
                            std::vector<torch::Tensor> w13_onednn, std::vector<torch::Tensor> w2_onednn,
                            int64_t onednn_min_rows, torch::Tensor topk_weights, torch::Tensor topk_ids,
                            c10::optional<torch::Tensor> expert_map, int64_t intermediate) {
  TORCH_CHECK(w13.has_value() == w2.has_value() && w13_onednn.size() == w2_onednn.size() &&
                  (w13.has_value() || !w13_onednn.empty()),
              "give the experts' panels, their oneDNN weights, or both, for w13 and w2 alike");
  const int64_t hidden = x.size(-1);
  const int64_t experts = w13.has_value() ? w13->size(0) : static_cast<int64_t>(w13_onednn.size());
  if (w13.has_value()) {
    const auto dtype = w13->scalar_type();
    TORCH_CHECK(w13->dim() == 4 && w2->dim() == 4 && w13->is_contiguous() && w2->is_contiguous() &&
                    w2->scalar_type() == dtype &&
                    (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf),
                "expert panels must be packed [E, panels, K, 16], w13 and w2 both float32, bfloat16 or float16");
    TORCH_CHECK(w13->size(2) == hidden && w2->size(2) == intermediate && w2->size(1) * engine_cpu::kCols >= hidden &&
                    w13->size(1) * engine_cpu::kCols >= 2 * intermediate,
                "expert weights do not fit hidden size ", hidden, " and intermediate size ", intermediate);
  }
  TORCH_CHECK(w13_onednn.empty() || static_cast<int64_t>(w13_onednn.size()) == experts,
              "one oneDNN weight per expert");
  const ExpertWeightsView gate_up{w13, &w13_onednn, onednn_min_rows}, down{w2, &w2_onednn, onednn_min_rows};
  return grouped_experts(x, experts, intermediate, topk_weights, topk_ids, expert_map,
                         [&](int phase, const float* rows, int64_t k, const std::vector<int64_t>& counts, int64_t n,
                             float* out) { run_products(rows, k, phase == 0 ? gate_up : down, counts, n, out); });
}

// One projection of every expert in a packed quantized format: data [E, N, row bytes], scales [E, N] (int8) or none.
struct QuantExpertsView {
  torch::Tensor data;
  c10::optional<torch::Tensor> scales;
  int format, variant;
  int64_t dequant_min_rows;  // products of this many rows or more: the weight de-quantized into panels, then the GEMM

  QuantExpertsView(torch::Tensor data_, c10::optional<torch::Tensor> scales_, int64_t k, int64_t format_,
                   int64_t variant_, int64_t dequant_min_rows_)
      : data(std::move(data_)), scales(std::move(scales_)), format(static_cast<int>(format_)),
        variant(static_cast<int>(variant_)), dequant_min_rows(dequant_min_rows_) {
    TORCH_CHECK(data.dim() == 3 && data.is_contiguous(), "quantized experts: contiguous [E, N, row bytes]");
    engine_quant::check_weight(data[0], scales.has_value() ? c10::optional<torch::Tensor>((*scales)[0]) : c10::nullopt,
                               format, k);
    TORCH_CHECK(!scales.has_value() || (scales->dim() == 2 && scales->size(0) == data.size(0)),
                "quantized experts' scales: [E, N]");
    TORCH_CHECK(engine_quant::cpu_has(variant), "this CPU lacks the instructions of variant ", variant);
  }
  c10::optional<torch::Tensor> scales_of(int64_t e) const {
    return scales.has_value() ? c10::optional<torch::Tensor>((*scales)[e]) : c10::nullopt;
  }
};

// Every expert's product of one phase on quantized weights. Experts with fewer than dequant_min_rows rows: their rows
// quantized per block of 32, then integer block dot products, all those experts in one pass of the spin pool over
// (expert, 4-column tile) items (one wake-up per phase in a decode step); the others: the float32 GEMM on the weight
// de-quantized a 16-row panel at a time (prompt-sized products).
void run_quant_products(const float* x, int64_t k, const QuantExpertsView& w, const std::vector<int64_t>& counts,
                        int64_t n, float* out) {
  using engine_quant::kBlock;
  const int64_t experts = static_cast<int64_t>(counts.size()) - 1, rows = counts[experts];
  const int64_t nb = (k + kBlock - 1) / kBlock, row_bytes = w.data.size(2), tiles = (n + 3) / 4;
  TORCH_CHECK(w.data.size(1) == n, "quantized experts hold ", w.data.size(1), " rows, the product needs ", n);
  std::vector<int8_t> xq;
  std::vector<float> xd, xsum;
  std::vector<int64_t> dot, item_start{0};
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t r0 = counts[e], m = counts[e + 1] - r0;
    if (m == 0) continue;
    if (m >= w.dequant_min_rows) {  // the weight de-quantized a panel at a time under the GEMM's tile
      auto options = torch::TensorOptions().dtype(at::kFloat);
      engine_quant::dequantized_linear(torch::from_blob(out + r0 * n, {m, n}, options),
                                       torch::from_blob(const_cast<float*>(x + r0 * k), {m, k}, options), w.data[e],
                                       w.scales_of(e), w.format, c10::nullopt);
      continue;
    }
    if (xq.empty()) {
      xq.resize(rows * nb * kBlock);
      xd.resize(rows * nb);
      xsum.resize(rows * nb);
    }
    engine_quant::quantize_rows(x + r0 * k, m, k, nb, xq.data() + r0 * nb * kBlock, xd.data() + r0 * nb,
                                xsum.data() + r0 * nb);
    dot.push_back(e);
    item_start.push_back(item_start.back() + tiles);
  }
  if (dot.empty()) return;
  const uint8_t* data = static_cast<const uint8_t*>(w.data.data_ptr());
  const float* scales = w.scales.has_value() ? w.scales->data_ptr<float>() : nullptr;
  engine_pool::parallel_range(item_start.back(), 16, [&](int64_t i0, int64_t i1) {
    while (i0 < i1) {  // a run of one expert's tiles [t0, t1)
      const int64_t s = std::upper_bound(item_start.begin(), item_start.end(), i0) - item_start.begin() - 1;
      const int64_t t0 = i0 - item_start[s], t1 = std::min(i1, item_start[s + 1]) - item_start[s];
      const int64_t e = dot[s], r0 = counts[e], m = counts[e + 1] - r0;
      engine_quant::QuantArgs q{w.format, data + e * n * row_bytes, row_bytes, nb,
                                scales ? scales + e * n : nullptr, xq.data() + r0 * nb * kBlock, xd.data() + r0 * nb,
                                xsum.data() + r0 * nb, m, nb * kBlock, out + r0 * n, n};
      const int64_t c0 = t0 * 4, c1 = std::min(n, t1 * 4);
      if (w.variant == engine_quant::kAvx512Vnni) engine_quant::avx512vnni::run_columns(q, c0, c1);
      else if (w.variant == engine_quant::kAvx2) engine_quant::avx2::run_columns(q, c0, c1);
      else engine_quant::scalar::run_columns(q, c0, c1);
      i0 += t1 - t0;
    }
  });
}

// The fused-MoE operation on quantized experts: w13 [E, 2I, row bytes of H] and w2 [E, H, row bytes of I] in one
// format (engine.model.quant_formats; scales [E, rows] for int8), the integer-dot kernel `variant` for products of
// fewer than dequant_min_rows rows.
torch::Tensor fused_quant_experts(torch::Tensor x, torch::Tensor w13, c10::optional<torch::Tensor> w13_scales,
                                  torch::Tensor w2, c10::optional<torch::Tensor> w2_scales, int64_t format,
                                  int64_t variant, int64_t dequant_min_rows, torch::Tensor topk_weights,
                                  torch::Tensor topk_ids, c10::optional<torch::Tensor> expert_map,
                                  int64_t intermediate) {
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0), "w13 and w2: [E, rows, row bytes]");
  TORCH_CHECK(w13.size(1) == 2 * intermediate && w2.size(1) == hidden, "expert weights do not fit hidden size ",
              hidden, " and intermediate size ", intermediate);
#ifndef ENGINE_AVX2
  TORCH_CHECK(dequant_min_rows >= (int64_t{1} << 62), "the de-quantized GEMM path needs AVX2");
#endif
  const QuantExpertsView gate_up(w13, w13_scales, hidden, format, variant, dequant_min_rows);
  const QuantExpertsView down(w2, w2_scales, intermediate, format, variant, dequant_min_rows);
  return grouped_experts(x, w13.size(0), intermediate, topk_weights, topk_ids, expert_map,
                         [&](int phase, const float* rows, int64_t k, const std::vector<int64_t>& counts, int64_t n,
                             float* out) { run_quant_products(rows, k, phase == 0 ? gate_up : down, counts, n, out); });
}

}  // namespace engine_moe

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_experts", &engine_moe::fused_experts,
        "the routed experts' weighted output [T, H] for x [T, H] and each token's top-k experts (packed weights)",
        py::arg("x"), py::arg("w13"), py::arg("w2"), py::arg("w13_onednn"), py::arg("w2_onednn"),
        py::arg("onednn_min_rows"), py::arg("topk_weights"), py::arg("topk_ids"), py::arg("expert_map"),
        py::arg("intermediate"), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("fused_quant_experts", &engine_moe::fused_quant_experts,
        "the routed experts' weighted output [T, H] on experts packed in a quantized format (integer-dot kernels for "
        "small products, the weight de-quantized into the GEMM's panels for large ones)",
        py::arg("x"), py::arg("w13"), py::arg("w13_scales"), py::arg("w2"), py::arg("w2_scales"), py::arg("format"),
        py::arg("variant"), py::arg("dequant_min_rows"), py::arg("topk_weights"), py::arg("topk_ids"),
        py::arg("expert_map"), py::arg("intermediate"), pybind11::call_guard<pybind11::gil_scoped_release>());
}
