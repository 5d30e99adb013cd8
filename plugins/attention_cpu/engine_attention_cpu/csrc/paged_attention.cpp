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

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ENGINE_AVX2 1
#endif

namespace {

template <typename scalar_t>
inline float as_float(scalar_t x) {
  return static_cast<float>(x);
}

#ifdef ENGINE_AVX2
// Eight consecutive elements as float32 lanes.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));  // bfloat16 is the top half of a float32
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}
#endif

// Visits the cache rows of positions [first, last) of one request and one KV head, block by block.
template <typename scalar_t, typename Fn>
inline void for_each_row(const scalar_t* cache, const int32_t* table, int64_t block_size, int64_t stride_block,
                         int64_t stride_tok, int64_t first, int64_t last, Fn&& fn) {
  int64_t t = first;
  while (t < last) {
    const int64_t block = table[t / block_size];
    const int64_t end = std::min(last, (t / block_size + 1) * block_size);
    const scalar_t* row = cache + block * stride_block + (t % block_size) * stride_tok;
    for (; t < end; ++t, row += stride_tok) fn(t, row);
  }
}

// scores[i] = scale * q . k_(first + i) for one query head (soft-capped when cap > 0)
template <typename scalar_t>
void score_rows(float* scores, const float* q, const scalar_t* cache, const int32_t* table, int64_t block_size,
                int64_t stride_block, int64_t stride_tok, int64_t first, int64_t last, int64_t head_size,
                float scale, float cap) {
#ifdef ENGINE_AVX2
  if (head_size % 32 == 0) {
    for_each_row(cache, table, block_size, stride_block, stride_tok, first, last, [&](int64_t t, const scalar_t* k) {
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
      for (int64_t d = 0; d < head_size; d += 32) {  // four independent chains keep the FMA units busy
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), load8(k + d + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 16), load8(k + d + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 24), load8(k + d + 24), a3);
      }
      scores[t - first] = horizontal_sum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3))) * scale;
    });
  } else
#endif
  {
    for_each_row(cache, table, block_size, stride_block, stride_tok, first, last, [&](int64_t t, const scalar_t* k) {
      float total = 0.f;
      for (int64_t d = 0; d < head_size; ++d) total += q[d] * as_float(k[d]);
      scores[t - first] = total * scale;
    });
  }
  if (cap > 0.f)
    for (int64_t i = 0; i < last - first; ++i) scores[i] = cap * std::tanh(scores[i] / cap);
}

// out[0:head_size] = sum_i p[i] * v_(first + i) for one query head
template <typename scalar_t>
void weigh_rows(float* out, const float* p, const scalar_t* cache, const int32_t* table, int64_t block_size,
                int64_t stride_block, int64_t stride_tok, int64_t first, int64_t last, int64_t head_size) {
#ifdef ENGINE_AVX2
  if (head_size % 64 == 0) {
    for (int64_t d0 = 0; d0 < head_size; d0 += 64) {  // 64 columns at a time stay in eight registers
      __m256 r0 = _mm256_setzero_ps(), r1 = r0, r2 = r0, r3 = r0, r4 = r0, r5 = r0, r6 = r0, r7 = r0;
      for_each_row(cache, table, block_size, stride_block, stride_tok, first, last, [&](int64_t t, const scalar_t* v) {
        const __m256 w = _mm256_set1_ps(p[t - first]);
        const scalar_t* x = v + d0;
        r0 = _mm256_fmadd_ps(w, load8(x), r0);
        r1 = _mm256_fmadd_ps(w, load8(x + 8), r1);
        r2 = _mm256_fmadd_ps(w, load8(x + 16), r2);
        r3 = _mm256_fmadd_ps(w, load8(x + 24), r3);
        r4 = _mm256_fmadd_ps(w, load8(x + 32), r4);
        r5 = _mm256_fmadd_ps(w, load8(x + 40), r5);
        r6 = _mm256_fmadd_ps(w, load8(x + 48), r6);
        r7 = _mm256_fmadd_ps(w, load8(x + 56), r7);
      });
      float* o = out + d0;
      _mm256_storeu_ps(o, r0); _mm256_storeu_ps(o + 8, r1); _mm256_storeu_ps(o + 16, r2);
      _mm256_storeu_ps(o + 24, r3); _mm256_storeu_ps(o + 32, r4); _mm256_storeu_ps(o + 40, r5);
      _mm256_storeu_ps(o + 48, r6); _mm256_storeu_ps(o + 56, r7);
    }
    return;
  }
#endif
  std::fill(out, out + head_size, 0.f);
  for_each_row(cache, table, block_size, stride_block, stride_tok, first, last, [&](int64_t t, const scalar_t* v) {
    const float w = p[t - first];
    for (int64_t d = 0; d < head_size; ++d) out[d] += w * as_float(v[d]);
  });
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
    std::vector<float> q(head_size), acc(head_size), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / num_kv_heads;
      const int64_t kv_head = item % num_kv_heads;
      const int64_t seq_len = lens_ptr[row];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
      const int64_t n = seq_len - first;
      scores.resize(n);
      const int32_t* table = table_ptr + row * table_row;
      const scalar_t* keys = k_ptr + kv_head * kc_head;
      const scalar_t* values = v_ptr + kv_head * vc_head;
      // one query head at a time: its rows of K and V stay in L2 for the next head of the group
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = kv_head * group + g;
        const scalar_t* src = q_ptr + row * q_tok + head * q_head;
        for (int64_t d = 0; d < head_size; ++d) q[d] = as_float(src[d]);
        score_rows(scores.data(), q.data(), keys, table, block_size, kc_block, kc_tok, first, seq_len, head_size,
                   fscale, fcap);
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < n; ++i) peak = std::max(peak, scores[i]);
        float total = 0.f;
        for (int64_t i = 0; i < n; ++i) {
          scores[i] = std::exp(scores[i] - peak);
          total += scores[i];
        }
        const float inv = 1.f / total;
        for (int64_t i = 0; i < n; ++i) scores[i] *= inv;
        weigh_rows(acc.data(), scores.data(), values, table, block_size, vc_block, vc_tok, first, seq_len, head_size);
        scalar_t* dst = out_ptr + row * o_tok + head * o_head;
        for (int64_t d = 0; d < head_size; ++d) dst[d] = static_cast<scalar_t>(acc[d]);
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
  AT_DISPATCH_SWITCH(query.scalar_type(), "paged_decode_attention",
    AT_DISPATCH_CASE(at::kFloat, [&] { decode_attention_impl<scalar_t>(out, query, key_cache, value_cache,
        block_table, seq_lens, scale, soft_cap, sliding_window); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { decode_attention_impl<scalar_t>(out, query, key_cache, value_cache,
        block_table, seq_lens, scale, soft_cap, sliding_window); })
    AT_DISPATCH_CASE(at::kHalf, [&] { decode_attention_impl<scalar_t>(out, query, key_cache, value_cache,
        block_table, seq_lens, scale, soft_cap, sliding_window); }));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
}
