// Paged decode attention for the CPU: one query token per request, read straight from the paged
// KV cache (no gathered copy), GQA-aware (each K/V row is loaded once for all query heads that share
// it), causal, with an optional sliding window and logit soft-capping. Softmax and accumulation in
// float32 whatever the cache dtype. Work is split over (request, KV head) with at::parallel_for.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
inline float as_float(scalar_t x) {
  return static_cast<float>(x);
}

template <typename scalar_t>
void decode_attention_impl(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                           const torch::Tensor& value_cache, const torch::Tensor& block_table,
                           const torch::Tensor& seq_lens, double scale, double soft_cap, int64_t sliding_window) {
  const int64_t num_rows = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;

  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = value_cache.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int32_t* table_ptr = block_table.data_ptr<int32_t>();
  const int32_t* lens_ptr = seq_lens.data_ptr<int32_t>();

  const int64_t q_tok = query.stride(0), q_head = query.stride(1);
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  const int64_t kc_block = key_cache.stride(0), kc_tok = key_cache.stride(1), kc_head = key_cache.stride(2);
  const int64_t vc_block = value_cache.stride(0), vc_tok = value_cache.stride(1), vc_head = value_cache.stride(2);
  const int64_t table_row = block_table.stride(0);
  const float fscale = static_cast<float>(scale);
  const float fcap = static_cast<float>(soft_cap);

  at::parallel_for(0, num_rows * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_size), acc(group * head_size), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / num_kv_heads;
      const int64_t kv_head = item % num_kv_heads;
      const int64_t seq_len = lens_ptr[row];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
      const int64_t n = seq_len - first;
      scores.resize(group * n);
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = q_ptr + row * q_tok + (kv_head * group + g) * q_head;
        for (int64_t d = 0; d < head_size; ++d) q[g * head_size + d] = as_float(src[d]);
      }
      const int32_t* table = table_ptr + row * table_row;
      // scores = q . k for every visible key, all query heads of the group per loaded key
      for (int64_t t = first; t < seq_len; ++t) {
        const int64_t block = table[t / block_size];
        const scalar_t* k = k_ptr + block * kc_block + (t % block_size) * kc_tok + kv_head * kc_head;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = q.data() + g * head_size;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_size; ++d) dot += qg[d] * as_float(k[d]);
          float s = dot * fscale;
          if (fcap > 0.f) s = fcap * std::tanh(s / fcap);
          scores[g * n + (t - first)] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * n;
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) peak = std::max(peak, sg[i]);
        float total = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          sg[i] = std::exp(sg[i] - peak);
          total += sg[i];
        }
        const float inv = 1.f / total;
        for (int64_t i = 0; i < n; ++i) sg[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = first; t < seq_len; ++t) {
        const int64_t block = table[t / block_size];
        const scalar_t* v = v_ptr + block * vc_block + (t % block_size) * vc_tok + kv_head * vc_head;
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * n + (t - first)];
          float* ag = acc.data() + g * head_size;
#pragma omp simd
          for (int64_t d = 0; d < head_size; ++d) ag[d] += p * as_float(v[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = out_ptr + row * o_tok + (kv_head * group + g) * o_head;
        for (int64_t d = 0; d < head_size; ++d) dst[d] = static_cast<scalar_t>(acc[g * head_size + d]);
      }
    }
  });
}

}  // namespace

// out/query [rows, Hq, D]; key_cache/value_cache [blocks, block_size, Hkv, D]; block_table [rows, max_blocks]
// int32; seq_lens [rows] int32 (the query is the token at position seq_len - 1).
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor seq_lens,
                            double scale, double soft_cap, int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [rows, heads, head_size]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(), "caches must be [blocks, block_size, kv_heads, head_size]");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "head sizes differ");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_table and seq_lens must be int32");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous(), "block_table and seq_lens must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, out and caches must share a dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(out, query, key_cache, value_cache, block_table, seq_lens, scale, soft_cap,
                                    sliding_window);
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
