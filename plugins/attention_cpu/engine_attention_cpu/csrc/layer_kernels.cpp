// Fused element-wise kernels of the model layers on the CPU: RMSNorm (alone and with the residual
// add before it), SiLU-and-multiply, and rotary embeddings applied in place. Each reads and writes
// its rows once, computing in float32 and rounding to the activation dtype at the same points as
// the torch code it replaces (engine.model.layers.native_kernels), so float32 results agree with it
// up to the order of the RMSNorm sum, and RoPE agrees bit for bit. Built with -ffp-contract=off:
// a fused multiply-add would round differently from the torch ops.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "spin_pool.h"
#include "vec_avx2.h"

namespace {

using namespace engine_cpu;

constexpr int64_t kGrainRows = 16;

// float32, bfloat16 and float16 activations
#define DISPATCH_ACTIVATION_TYPES(TYPE, NAME, ...)                                                          \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                                   \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

// Sum of squares of x[0:n]; when write is set, x[i] = round(x[i] + add[i]) first (the residual add).
template <typename scalar_t>
inline float add_and_sum_squares(scalar_t* x, const scalar_t* add, int64_t n, bool write) {
  int64_t i = 0;
  float total = 0.f;
#ifdef ENGINE_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 v = load8(x + i);
    if (write) {
      v = round8<scalar_t>(_mm256_add_ps(v, load8(add + i)));
      store8(x + i, v);
    }
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  total = horizontal_sum(acc);
#endif
  for (; i < n; ++i) {
    float v = as_float(x[i]);
    if (write) {
      v = round_to<scalar_t>(v + as_float(add[i]));
      x[i] = static_cast<scalar_t>(v);
    }
    total += v * v;
  }
  return total;
}

// out = weight * round(x * inv): the normalised row rounded to scalar_t, then scaled (as in Hugging Face).
template <typename scalar_t>
inline void scale_row(scalar_t* out, const scalar_t* x, const float* weight, float inv, int64_t n) {
  int64_t i = 0;
#ifdef ENGINE_AVX2
  const __m256 factor = _mm256_set1_ps(inv);
  for (; i + 8 <= n; i += 8)
    store8(out + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), round8<scalar_t>(_mm256_mul_ps(load8(x + i), factor))));
#endif
  for (; i < n; ++i) out[i] = static_cast<scalar_t>(weight[i] * round_to<scalar_t>(as_float(x[i]) * inv));
}

inline float inverse_rms(float sum_squares, int64_t n, float eps) {
  return 1.f / std::sqrt(sum_squares / static_cast<float>(n) + eps);
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name,
              " must be a CPU matrix with contiguous rows");
}

void check_weight(const torch::Tensor& weight, int64_t hidden) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == hidden,
              "weight must be a contiguous float32 vector of the row size");
}

// out[r] = rms_norm(src[r]) * weight, after src[r] = round(src[r] + add[r]) when add is given.
// All three: [rows, hidden] of one dtype with contiguous rows (out may be add); weight float32 [hidden].
void normalize_rows(torch::Tensor out, torch::Tensor src, const torch::Tensor* add, torch::Tensor weight,
                    double eps) {
  check_rows(src, "x");
  check_rows(out, "out");
  TORCH_CHECK(out.sizes() == src.sizes() && out.scalar_type() == src.scalar_type(), "out must match x");
  if (add != nullptr) {
    check_rows(*add, "residual");
    TORCH_CHECK(add->sizes() == src.sizes() && add->scalar_type() == src.scalar_type(), "residual must match x");
  }
  const int64_t rows = src.size(0), hidden = src.size(1);
  check_weight(weight, hidden);
  DISPATCH_ACTIVATION_TYPES(src.scalar_type(), "rms_norm", [&] {
    const float* w = weight.data_ptr<float>();
    engine_pool::parallel_range(rows, kGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = src.data_ptr<scalar_t>() + r * src.stride(0);
        const scalar_t* addend = add ? add->data_ptr<scalar_t>() + r * add->stride(0) : row;
        const float inv = inverse_rms(add_and_sum_squares(row, addend, hidden, add != nullptr), hidden, float(eps));
        scale_row(out.data_ptr<scalar_t>() + r * out.stride(0), row, w, inv, hidden);
      }
    });
  });
}

void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps) {
  normalize_rows(out, x, nullptr, weight, eps);
}

// In place: residual[r] = round(residual[r] + x[r]); x[r] = rms_norm(residual[r]) * weight.
void fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  normalize_rows(x, residual, &x, weight, eps);
}

// out[r] = round(silu(gate)) * up, where x[r] = [gate | up]. x: [rows, 2d]; out: [rows, d].
void silu_and_mul(torch::Tensor out, torch::Tensor x) {
  check_rows(x, "x");
  check_rows(out, "out");
  const int64_t rows = x.size(0), d = out.size(1);
  TORCH_CHECK(x.size(1) == 2 * d && out.size(0) == rows && out.scalar_type() == x.scalar_type(),
              "out must be [rows, x.size(1) / 2] of x's dtype");
  DISPATCH_ACTIVATION_TYPES(x.scalar_type(), "silu_and_mul", [&] {
    engine_pool::parallel_range(rows, kGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = x.data_ptr<scalar_t>() + r * x.stride(0);
        const scalar_t* up = gate + d;
        scalar_t* dst = out.data_ptr<scalar_t>() + r * out.stride(0);
        int64_t i = 0;
#ifdef ENGINE_AVX2
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= d; i += 8) {
          const __m256 g = load8(gate + i);
          const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
          const __m256 silu = round8<scalar_t>(_mm256_div_ps(g, _mm256_add_ps(one, e)));
          store8(dst + i, _mm256_mul_ps(silu, load8(up + i)));
        }
#endif
        for (; i < d; ++i) {
          const float g = as_float(gate[i]);
          dst[i] = static_cast<scalar_t>(round_to<scalar_t>(g / (1.f + std::exp(-g))) * as_float(up[i]));
        }
      }
    });
  });
}

// One head in place, GPT-NeoX layout: x[i] = x[i] cos[i] + x[partner(i)] sin[i] over the first
// rotary_dim values, where partner swaps the two halves and sin carries rotate_half's sign.
template <typename scalar_t>
inline void rotate_head(scalar_t* x, const float* cos, const float* sin, int64_t half) {
  int64_t i = 0;
#ifdef ENGINE_AVX2
  for (; i + 8 <= half; i += 8) {
    const __m256 a = load8(x + i), b = load8(x + half + i);
    const __m256 first = _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(cos + i)),
                                       _mm256_mul_ps(b, _mm256_loadu_ps(sin + i)));
    const __m256 second = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(cos + half + i)),
                                        _mm256_mul_ps(a, _mm256_loadu_ps(sin + half + i)));
    store8(x + i, first);
    store8(x + half + i, second);
  }
#endif
  for (; i < half; ++i) {
    const float a = as_float(x[i]), b = as_float(x[half + i]);
    x[i] = static_cast<scalar_t>(a * cos[i] + b * sin[i]);
    x[half + i] = static_cast<scalar_t>(b * cos[half + i] + a * sin[half + i]);
  }
}

// In place on query [tokens, heads * head_size] and key [tokens, kv_heads * head_size] (rows may be
// strided views of one fused QKV output). cos, sin: [max_position, rotary_dim] float32, sin signed
// as rotate_half needs (-sin on the first half). positions: [tokens] int64.
void rotary_embedding(torch::Tensor positions, torch::Tensor query, torch::Tensor key, torch::Tensor cos,
                      torch::Tensor sin, int64_t head_size) {
  check_rows(query, "query");
  check_rows(key, "key");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions must be int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.dim() == 2,
              "cos and sin must be contiguous float32 [max_position, rotary_dim] tables");
  const int64_t tokens = positions.numel(), rotary_dim = cos.size(1), max_position = cos.size(0);
  TORCH_CHECK(query.size(0) == tokens && key.size(0) == tokens, "query and key need one row per position");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "query and key must share a dtype");
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_size && query.size(1) % head_size == 0 &&
                  key.size(1) % head_size == 0,
              "rotary_dim must be even and at most head_size, rows whole heads");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_position, "position ", pos[t], " is outside the RoPE table (",
                max_position, " positions)");
  const int64_t q_heads = query.size(1) / head_size, k_heads = key.size(1) / head_size;
  DISPATCH_ACTIVATION_TYPES(query.scalar_type(), "rotary_embedding", [&] {
    engine_pool::parallel_range(tokens, kGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cos.data_ptr<float>() + pos[t] * rotary_dim;
        const float* s = sin.data_ptr<float>() + pos[t] * rotary_dim;
        scalar_t* q = query.data_ptr<scalar_t>() + t * query.stride(0);
        scalar_t* k = key.data_ptr<scalar_t>() + t * key.stride(0);
        for (int64_t h = 0; h < q_heads; ++h) rotate_head(q + h * head_size, c, s, rotary_dim / 2);
        for (int64_t h = 0; h < k_heads; ++h) rotate_head(k + h * head_size, c, s, rotary_dim / 2);
      }
    });
  });
}

}  // namespace

#ifndef ENGINE_KERNELS_NO_MODULE  // the decode graph (decode_graph.cpp) compiles this file in, bindings left out
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "out = rms_norm(x) * weight (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = rms_norm(residual) * weight, in place (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "out = silu(x[:, :d]) * x[:, d:] (CPU)");
  m.def("rotary_embedding", &rotary_embedding, "GPT-NeoX rotary embedding of query and key, in place (CPU)");
}
#endif
