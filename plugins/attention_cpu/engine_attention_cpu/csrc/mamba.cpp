// Mamba's kernels for the `cpu` layer kernels: the causal depthwise convolution, Mamba2's selective scan and
// Mamba1's (Jamba) selective scan, over requests laid end to end (query_start_loc) with each request's state carried
// in and out. float32 throughout (the Python side converts); loops written for the compiler to vectorize under
// -march=native, so the same source serves every ISA.
//
// The scans run the recurrence token by token per (request, head) or (request, channel block): the state of one
// head (head_dim x state_size floats) stays in cache across the request's tokens, and the work items are
// independent, so a decode step of one request still spreads its heads over every thread.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "spin_pool.h"

namespace {

inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

inline float silu(float x) { return x / (1.f + std::exp(-x)); }

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous(), name, " must be contiguous float32");
}

constexpr int64_t kChannelBlock = 64;

// out[t, c] = act(bias[c] + sum_k w[c, k] * in(t - K + 1 + k, c)), in() reading the request's state before its tokens
torch::Tensor causal_conv1d(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias,
                            torch::Tensor& conv_state, const torch::Tensor& query_start_loc, bool use_silu) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  check_f32(conv_state, "conv_state");
  const int64_t channels = x.size(1), kernel = weight.size(1), keep = kernel - 1;
  const int64_t rows = query_start_loc.size(0) - 1;
  const bool has_bias = bias.defined() && bias.numel() > 0;
  if (has_bias) check_f32(bias, "bias");
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* sp = conv_state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t blocks = (channels + kChannelBlock - 1) / kChannelBlock;
  engine_pool::parallel_range(rows * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> window(kernel * kChannelBlock);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / blocks, c0 = (item % blocks) * kChannelBlock;
      const int64_t width = std::min(kChannelBlock, channels - c0);
      const int64_t start = qsl[r], length = qsl[r + 1] - start;
      float* state = sp + r * channels * keep;
      // ring of the last K inputs: input i (from -(K - 1), the state) sits in slot (i + K - 1) % K
      for (int64_t k = 0; k < keep; ++k)
        for (int64_t c = 0; c < width; ++c) window[k * kChannelBlock + c] = state[(c0 + c) * keep + k];
      for (int64_t t = 0; t < length; ++t) {
        const float* xt = xp + (start + t) * channels + c0;
        float* slot = window.data() + ((t + keep) % kernel) * kChannelBlock;
        for (int64_t c = 0; c < width; ++c) slot[c] = xt[c];
        float* ot = op + (start + t) * channels + c0;
        for (int64_t c = 0; c < width; ++c) ot[c] = has_bias ? bp[c0 + c] : 0.f;
        for (int64_t k = 0; k < kernel; ++k) {
          const float* in = window.data() + ((t + k) % kernel) * kChannelBlock;
#pragma omp simd
          for (int64_t c = 0; c < width; ++c) ot[c] += wp[(c0 + c) * kernel + k] * in[c];
        }
        if (use_silu)
          for (int64_t c = 0; c < width; ++c) ot[c] = silu(ot[c]);
      }
      for (int64_t k = 0; k < keep; ++k) {
        const float* in = window.data() + ((length + k) % kernel) * kChannelBlock;
        for (int64_t c = 0; c < width; ++c) state[(c0 + c) * keep + k] = in[c];
      }
    }
  });
  return out;
}

// Mamba2: per (request, head), state[p, n] = exp(dt A) state + dt x[p] B[n]; y[p] = state[p, :] . C + D x[p]
torch::Tensor mamba2_scan(const torch::Tensor& x, const torch::Tensor& dt, const torch::Tensor& A,
                          const torch::Tensor& B, const torch::Tensor& C, const torch::Tensor& D,
                          const torch::Tensor& dt_bias, double dt_min, double dt_max, torch::Tensor& ssm_state,
                          const torch::Tensor& query_start_loc) {
  for (auto* t : {&x, &dt, &A, &B, &C, &D, &dt_bias}) check_f32(*t, "scan inputs");
  check_f32(ssm_state, "ssm_state");
  const int64_t heads = x.size(1), head_dim = x.size(2), groups = B.size(1), state_size = B.size(2);
  const int64_t rows = query_start_loc.size(0) - 1, per_group = heads / groups;
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *ap = A.data_ptr<float>();
  const float *bp = B.data_ptr<float>(), *cp = C.data_ptr<float>(), *dp = D.data_ptr<float>();
  const float* biasp = dt_bias.data_ptr<float>();
  float *sp = ssm_state.data_ptr<float>(), *yp = y.data_ptr<float>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const float lo = static_cast<float>(dt_min), hi = static_cast<float>(dt_max);
  engine_pool::parallel_range(rows * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / heads, h = item % heads, g = h / per_group;
      float* state = sp + (r * heads + h) * head_dim * state_size;
      for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t) {
        const float step = std::min(std::max(softplus(dtp[t * heads + h] + biasp[h]), lo), hi);
        const float decay = std::exp(step * ap[h]);
        const float* b = bp + (t * groups + g) * state_size;
        const float* c = cp + (t * groups + g) * state_size;
        const float* xt = xp + (t * heads + h) * head_dim;
        float* yt = yp + (t * heads + h) * head_dim;
        for (int64_t p = 0; p < head_dim; ++p) {
          float* s = state + p * state_size;
          const float coef = step * xt[p];
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t n = 0; n < state_size; ++n) {
            s[n] = s[n] * decay + coef * b[n];
            acc += s[n] * c[n];
          }
          yt[p] = acc + dp[h] * xt[p];
        }
      }
    }
  });
  return y;
}

// Mamba1: per (request, channel), state[n] = exp(dt A[d, n]) state + dt x B[n]; y = (state . C + D x) silu(z)
torch::Tensor selective_scan(const torch::Tensor& x, const torch::Tensor& dt, const torch::Tensor& A,
                             const torch::Tensor& B, const torch::Tensor& C, const torch::Tensor& D,
                             const torch::Tensor& z, const torch::Tensor& dt_bias, torch::Tensor& ssm_state,
                             const torch::Tensor& query_start_loc) {
  for (auto* t : {&x, &dt, &A, &B, &C, &D, &z, &dt_bias}) check_f32(*t, "scan inputs");
  check_f32(ssm_state, "ssm_state");
  const int64_t channels = x.size(1), state_size = A.size(1), rows = query_start_loc.size(0) - 1;
  const int64_t blocks = (channels + kChannelBlock - 1) / kChannelBlock;
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *ap = A.data_ptr<float>();
  const float *bp = B.data_ptr<float>(), *cp = C.data_ptr<float>(), *dp = D.data_ptr<float>();
  const float *zp = z.data_ptr<float>(), *biasp = dt_bias.data_ptr<float>();
  float *sp = ssm_state.data_ptr<float>(), *yp = y.data_ptr<float>();
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  engine_pool::parallel_range(rows * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> decay(state_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / blocks, d0 = (item % blocks) * kChannelBlock;
      const int64_t d1 = std::min(channels, d0 + kChannelBlock);
      for (int64_t t = qsl[r]; t < qsl[r + 1]; ++t) {
        const float* b = bp + t * state_size;
        const float* c = cp + t * state_size;
        for (int64_t d = d0; d < d1; ++d) {
          const float step = softplus(dtp[t * channels + d] + biasp[d]);
          const float xv = xp[t * channels + d], coef = step * xv;
          const float* a = ap + d * state_size;
          float* s = sp + (r * channels + d) * state_size;
          for (int64_t n = 0; n < state_size; ++n) decay[n] = std::exp(step * a[n]);
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t n = 0; n < state_size; ++n) {
            s[n] = s[n] * decay[n] + coef * b[n];
            acc += s[n] * c[n];
          }
          yp[t * channels + d] = (acc + dp[d] * xv) * silu(zp[t * channels + d]);
        }
      }
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("causal_conv1d", &causal_conv1d, "Mamba's causal depthwise convolution over requests, state carried");
  m.def("mamba2_scan", &mamba2_scan, "Mamba2's selective scan over requests, state carried");
  m.def("selective_scan", &selective_scan, "Mamba1's selective scan over requests, state carried");
}
