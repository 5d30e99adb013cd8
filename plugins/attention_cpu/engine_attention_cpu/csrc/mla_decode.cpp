// Multi-head latent attention (MLA) decode for the CPU, in the absorbed form: every query head of a request attends
// over the same paged latent rows (kv_lora_rank + rope values per token), read in place. The scores are a small GEMM
// (heads x context x latent) and the output another (heads x context x kv_lora_rank): each latent row is loaded once
// per tile of 4 heads x 3 rows (12 accumulators), the request's rows walked once in chunks (an online softmax) that
// stay in the L2 cache while every head tile scores and then weighs them, so the latent cache is read from memory
// once whatever the head count. Softmax and accumulation in float32. Work items are (request, tile of heads) when the
// batch is too small to keep the threads busy, else whole requests; longest first.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "spin_pool.h"
#include "vec_avx2.h"

namespace {

using namespace engine_cpu;

constexpr int kHeads = 4;           // query heads per tile
constexpr int kRows = 3;            // latent rows per score tile
constexpr int64_t kChunk = 32;      // rows per L2-resident chunk
constexpr int64_t kSerialWork = 1 << 15;

// scores[h * n + t - t0] = scale * q_h . row_t for the kHeads rows of q and of scores (rows past the real heads are
// zero queries), t in [t0, t1); rows[t - t0] points at latent row t.
template <typename scalar_t>
void score_tile(float* scores, const float* q, int64_t dim, const scalar_t* const* rows, int64_t t0, int64_t t1,
                int64_t n, float scale) {
  int64_t t = t0;
#ifdef ENGINE_AVX2
  if (dim % 8 == 0) {
    for (; t + kRows <= t1; t += kRows) {
      const scalar_t* r0 = rows[t - t0];
      const scalar_t* r1 = rows[t - t0 + 1];
      const scalar_t* r2 = rows[t - t0 + 2];
      __m256 acc[kHeads][kRows];
#pragma GCC unroll 4
      for (int h = 0; h < kHeads; ++h) acc[h][0] = acc[h][1] = acc[h][2] = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256 k0 = load8(r0 + d), k1 = load8(r1 + d), k2 = load8(r2 + d);
#pragma GCC unroll 4
        for (int h = 0; h < kHeads; ++h) {
          const __m256 qv = _mm256_loadu_ps(q + h * dim + d);
          acc[h][0] = _mm256_fmadd_ps(qv, k0, acc[h][0]);
          acc[h][1] = _mm256_fmadd_ps(qv, k1, acc[h][1]);
          acc[h][2] = _mm256_fmadd_ps(qv, k2, acc[h][2]);
        }
      }
#pragma GCC unroll 4
      for (int h = 0; h < kHeads; ++h) {
        scores[h * n + t - t0] = horizontal_sum(acc[h][0]) * scale;
        scores[h * n + t - t0 + 1] = horizontal_sum(acc[h][1]) * scale;
        scores[h * n + t - t0 + 2] = horizontal_sum(acc[h][2]) * scale;
      }
    }
  }
#endif
  for (; t < t1; ++t) {
    const scalar_t* row = rows[t - t0];
    for (int h = 0; h < kHeads; ++h) {
      float total = 0.f;
      for (int64_t d = 0; d < dim; ++d) total += q[h * dim + d] * as_float(row[d]);
      scores[h * n + t - t0] = total * scale;
    }
  }
}

// out[h * v_size + d] += sum over t in [t0, t1) of p[h * n + t - t0] * row_t[d], d < v_size, for the kHeads rows of
// out and p (a padded head's weights are zero).
template <typename scalar_t>
void value_tile(float* out, const float* p, int64_t v_size, const scalar_t* const* rows, int64_t t0, int64_t t1,
                int64_t n) {
  int64_t d0 = 0;
#ifdef ENGINE_AVX2
  for (; d0 + 16 <= v_size; d0 += 16) {
    __m256 acc[kHeads][2];
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h) {
      acc[h][0] = _mm256_loadu_ps(out + h * v_size + d0);
      acc[h][1] = _mm256_loadu_ps(out + h * v_size + d0 + 8);
    }
    for (int64_t t = t0; t < t1; ++t) {
      const scalar_t* row = rows[t - t0];
      const __m256 x0 = load8(row + d0), x1 = load8(row + d0 + 8);
#pragma GCC unroll 4
      for (int h = 0; h < kHeads; ++h) {
        const __m256 w = _mm256_broadcast_ss(p + h * n + t - t0);
        acc[h][0] = _mm256_fmadd_ps(w, x0, acc[h][0]);
        acc[h][1] = _mm256_fmadd_ps(w, x1, acc[h][1]);
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < kHeads; ++h) {
      _mm256_storeu_ps(out + h * v_size + d0, acc[h][0]);
      _mm256_storeu_ps(out + h * v_size + d0 + 8, acc[h][1]);
    }
  }
#endif
  for (int64_t t = t0; t < t1; ++t) {
    const scalar_t* row = rows[t - t0];
    for (int h = 0; h < kHeads; ++h)
      for (int64_t d = d0; d < v_size; ++d) out[h * v_size + d] += p[h * n + t - t0] * as_float(row[d]);
  }
}

// One chunk of the online softmax for one head: p[0:len] = exp(s - new_max) in place, where new_max also covers the
// running max m; returns the factor exp(m - new_max) that the head's running sum l and accumulator must be scaled by,
// and adds the chunk's exponentials to l (after scaling it).
inline float online_softmax_chunk(float* p, int64_t len, float& m, float& l) {
  float peak = m;
  for (int64_t i = 0; i < len; ++i) peak = std::max(peak, p[i]);
  const float alpha = std::exp(m - peak);  // 0 on the first chunk (m = -inf)
  const float total = exp_shifted(p, len, peak);
  l = l * alpha + total;
  m = peak;
  return alpha;
}

template <typename scalar_t>
void mla_decode_impl(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& cache,
                     const torch::Tensor& block_table, const torch::Tensor& seq_lens, double scale) {
  const int64_t num_rows = query.size(0), num_heads = query.size(1), dim = query.size(2), v_size = out.size(2);
  const int64_t num_tiles = (num_heads + kHeads - 1) / kHeads;
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t threads_available = at::get_num_threads();
  // few requests: split each request's heads over items so that every thread has work
  const int64_t tiles_per_item = num_rows >= 2 * threads_available ? num_tiles : 1;
  const int64_t items_per_row = num_tiles / tiles_per_item;
  const int64_t num_items = num_rows * items_per_row;
  std::vector<int64_t> order(num_items);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lens[a / items_per_row] > lens[b / items_per_row]; });
  int64_t context = 0;
  for (int64_t r = 0; r < num_rows; ++r) context += lens[r];
  const int64_t threads = context * num_heads * dim < kSerialWork ? 1 : threads_available;
  std::atomic<int64_t> next_item{0};
  engine_pool::run_shared(std::min<int64_t>(threads, num_items), [&] {  // the spin pool, as paged_attention.cpp
    std::vector<float> q(tiles_per_item * kHeads * dim), acc(tiles_per_item * kHeads * v_size);
    std::vector<float> scores(tiles_per_item * kHeads * kChunk), running_max(tiles_per_item * kHeads),
        running_sum(tiles_per_item * kHeads);
    const scalar_t* row_ptrs[kChunk];
    for (int64_t taken = next_item++; taken < num_items; taken = next_item++) {
      const int64_t item = order[taken], row = item / items_per_row;
      const int64_t first_head = (item % items_per_row) * tiles_per_item * kHeads;
      const int64_t heads_here = std::min<int64_t>(num_heads - first_head, tiles_per_item * kHeads);
      const int64_t n = lens[row];
      const int32_t* table = block_table.data_ptr<int32_t>() + row * block_table.stride(0);
      const scalar_t* cache_ptr = cache.data_ptr<scalar_t>();
      const int64_t block_size = cache.size(1), stride_block = cache.stride(0), stride_tok = cache.stride(1);
      // the chunk's row addresses, looked up once per chunk and pass
      auto chunk_rows = [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          row_ptrs[t - t0] = cache_ptr + table[t / block_size] * stride_block + (t % block_size) * stride_tok;
        return row_ptrs;
      };
      std::fill(q.begin(), q.end(), 0.f);
      for (int64_t h = 0; h < heads_here; ++h) {
        const scalar_t* src = q_ptr + row * query.stride(0) + (first_head + h) * query.stride(1);
        for (int64_t d = 0; d < dim; ++d) q[h * dim + d] = as_float(src[d]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(scores.begin(), scores.end(), 0.f);
      std::fill(running_max.begin(), running_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(running_sum.begin(), running_sum.end(), 0.f);
      const int64_t tiles = (heads_here + kHeads - 1) / kHeads;
      // one pass over the rows, chunk by chunk (online softmax): a chunk's rows are still in the L2 cache when its
      // values are weighed, so the latent cache is read from memory once
      for (int64_t t0 = 0; t0 < n; t0 += kChunk) {
        const int64_t t1 = std::min(n, t0 + kChunk);
        const scalar_t* const* rows = chunk_rows(t0, t1);
        for (int64_t tile = 0; tile < tiles; ++tile)
          score_tile(scores.data() + tile * kHeads * kChunk, q.data() + tile * kHeads * dim, dim, rows, t0, t1, kChunk,
                     static_cast<float>(scale));
        for (int64_t h = 0; h < heads_here; ++h) {
          const float alpha = online_softmax_chunk(scores.data() + h * kChunk, t1 - t0, running_max[h], running_sum[h]);
          if (alpha != 1.f)
            for (int64_t d = 0; d < v_size; ++d) acc[h * v_size + d] *= alpha;
        }
        for (int64_t tile = 0; tile < tiles; ++tile)
          value_tile(acc.data() + tile * kHeads * v_size, scores.data() + tile * kHeads * kChunk, v_size, rows, t0, t1,
                     kChunk);
      }
      for (int64_t h = 0; h < heads_here; ++h) {
        const float inv = 1.f / running_sum[h];
        for (int64_t d = 0; d < v_size; ++d) acc[h * v_size + d] *= inv;
      }
      for (int64_t h = 0; h < heads_here; ++h) {
        scalar_t* dst = out_ptr + row * out.stride(0) + (first_head + h) * out.stride(1);
        for (int64_t d = 0; d < v_size; ++d) dst[d] = static_cast<scalar_t>(acc[h * v_size + d]);
      }
    }
  });
}

}  // namespace

// out [rows, H, Lv] (Lv <= D: the values are the first Lv columns of each latent row), query [rows, H, D] (absorbed),
// cache [blocks, block_size, D], block_table [rows, max_blocks] int32, seq_lens [rows] int32 (the query is the token
// at position seq_len - 1 and sees every row before it).
void mla_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor cache, torch::Tensor block_table,
                          torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && cache.dim() == 3, "query/out [rows, heads, dim], cache 3-D");
  TORCH_CHECK(out.size(0) == query.size(0) && out.size(1) == query.size(1), "out and query differ in rows or heads");
  TORCH_CHECK(query.size(2) == cache.size(2) && out.size(2) <= cache.size(2), "latent sizes differ");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && cache.stride(2) == 1, "the last dimension must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  block_table.stride(1) == 1 && seq_lens.is_contiguous(), "block_table and seq_lens: int32, contiguous rows");
  TORCH_CHECK(query.scalar_type() == cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, out and cache must share a dtype");
  AT_DISPATCH_SWITCH(query.scalar_type(), "mla_decode_attention",
    AT_DISPATCH_CASE(at::kFloat, [&] { mla_decode_impl<scalar_t>(out, query, cache, block_table, seq_lens, scale); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { mla_decode_impl<scalar_t>(out, query, cache, block_table, seq_lens, scale); })
    AT_DISPATCH_CASE(at::kHalf, [&] { mla_decode_impl<scalar_t>(out, query, cache, block_table, seq_lens, scale); }));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mla_decode_attention", &mla_decode_attention, "MLA decode over the paged latent cache (CPU)");
}
