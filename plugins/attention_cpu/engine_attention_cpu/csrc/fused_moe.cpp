// The fused mixture-of-experts operation on the CPU: a token's chosen experts run as grouped products.
//
// One call per MoE layer and step: the (token, choice) pairs are counting-sorted by expert (tokens in order within
// an expert), each expert with tokens runs its gate/up product on its rows in one GEMM (the AVX2 register-tile GEMM
// of gemm.cpp, or its row-parallel GEMV for up to 4 rows, on weights packed once at load), SiLU-and-multiply runs
// over every row at once, then each expert's down product, and the weighted outputs are added into each token's
// row in the order of the experts' ids (as the torch reference adds them). No Python between the experts; a row's
// result does not depend on the other rows of the batch.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "spin_pool.h"
#include "vec_avx2.h"

#define ENGINE_KERNELS_NO_MODULE 1
#include "gemm.cpp"  // namespace engine_cpu

namespace engine_moe {

// out[m, n] = x[m, k] @ W.T for one expert's packed panels [ceil(n/16), k, 16] (rows are contiguous).
void expert_product(const float* x, int64_t m, int64_t k, const torch::Tensor& packed, int64_t n, float* out) {
  auto options = torch::TensorOptions().dtype(at::kFloat);
  torch::Tensor rows = torch::from_blob(const_cast<float*>(x), {m, k}, options);
  torch::Tensor result = torch::from_blob(out, {m, n}, options);
#ifdef ENGINE_AVX2
  if (m <= 4) {  // decode-sized: the panels split between the spin pool's threads, as engine_cpu::forward does
    const float* w = packed.data_ptr<float>();
    engine_pool::parallel_range(packed.size(0), 8, [&](int64_t p0, int64_t p1) {
      switch (m) {
        case 1: engine_cpu::gemv_panels<1>(x, k, w, k, n, nullptr, out, n, p0, p1); break;
        case 2: engine_cpu::gemv_panels<2>(x, k, w, k, n, nullptr, out, n, p0, p1); break;
        case 3: engine_cpu::gemv_panels<3>(x, k, w, k, n, nullptr, out, n, p0, p1); break;
        default: engine_cpu::gemv_panels<4>(x, k, w, k, n, nullptr, out, n, p0, p1); break;
      }
    });
    return;
  }
#endif
  engine_cpu::linear(result, rows, packed, c10::nullopt);
}

// x [T, H] (any float dtype), w13 [E, ceil(2I/16), H, 16] and w2 [E, ceil(H/16), I, 16] packed float32 panels,
// topk_weights [T, K] float32, topk_ids [T, K] int64 global expert ids, expert_map [E_global] -> local index or -1
// (experts other ranks hold) or None. Returns [T, H] in x's dtype.
torch::Tensor fused_experts(torch::Tensor x, torch::Tensor w13, torch::Tensor w2, torch::Tensor topk_weights,
                            torch::Tensor topk_ids, c10::optional<torch::Tensor> expert_map, int64_t intermediate) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be [tokens, hidden] on the CPU");
  TORCH_CHECK(w13.dim() == 4 && w2.dim() == 4 && w13.is_contiguous() && w2.is_contiguous() &&
                  w13.scalar_type() == at::kFloat && w2.scalar_type() == at::kFloat,
              "expert weights must be packed float32 panels [E, panels, K, 16]");
  const int64_t tokens = x.size(0), hidden = x.size(1), top_k = topk_ids.size(1), experts = w13.size(0);
  TORCH_CHECK(w13.size(2) == hidden && w2.size(2) == intermediate && w2.size(1) * engine_cpu::kCols >= hidden &&
                  w13.size(1) * engine_cpu::kCols >= 2 * intermediate,
              "expert weights do not fit hidden size ", hidden, " and intermediate size ", intermediate);
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
  torch::Tensor gathered = at::empty({rows, hidden}, xf.options());
  const float* xs = xf.data_ptr<float>();
  float* g = gathered.data_ptr<float>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) std::copy(xs + (choice_of_row[r] / top_k) * hidden,
                                                xs + (choice_of_row[r] / top_k + 1) * hidden, g + r * hidden);
  });
  torch::Tensor gate_up = at::empty({rows, 2 * intermediate}, xf.options());
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t r0 = counts[e], m = counts[e + 1] - r0;
    if (m) expert_product(g + r0 * hidden, m, hidden, w13[e], 2 * intermediate, gate_up.data_ptr<float>() + r0 * 2 * intermediate);
  }
  torch::Tensor act = (at::silu(gate_up.narrow(1, 0, intermediate)) * gate_up.narrow(1, intermediate, intermediate)).contiguous();
  torch::Tensor down = at::empty({rows, hidden}, xf.options());
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t r0 = counts[e], m = counts[e + 1] - r0;
    if (m) expert_product(act.data_ptr<float>() + r0 * intermediate, m, intermediate, w2[e], hidden, down.data_ptr<float>() + r0 * hidden);
  }

  // combine: rows in expert order, so each token's outputs are added in the order of its experts' ids; threads
  // split the hidden columns (every token's sum keeps that order)
  const float* d = down.data_ptr<float>();
  const float* w = weights.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, hidden, 256, [&](int64_t c0, int64_t c1) {
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

}  // namespace engine_moe

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_experts", &engine_moe::fused_experts,
        "the routed experts' weighted output [T, H] for x [T, H] and each token's top-k experts (packed weights)",
        py::arg("x"), py::arg("w13"), py::arg("w2"), py::arg("topk_weights"), py::arg("topk_ids"),
        py::arg("expert_map"), py::arg("intermediate"), pybind11::call_guard<pybind11::gil_scoped_release>());
}
