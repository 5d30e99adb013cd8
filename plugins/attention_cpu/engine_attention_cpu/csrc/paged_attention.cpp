// Paged decode attention for the CPU: one query token per request, read straight from the paged
// KV cache (no gathered copy), GQA-aware (each K/V row is loaded once for all query heads that share
// it), causal, with an optional sliding window and logit soft-capping. Softmax and accumulation in
// float32 whatever the cache dtype. Work is split over (request, KV head, part of the context) items, longest first,
// each taken by a free thread, a long context's parts merged by their softmax peaks and sums; the next block's rows
// are prefetched, and so are the next item's while a thread attends the current one; the softmax exponentials are
// vectorised.
#include <torch/extension.h>

#include <cstring>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "cache_dtypes.h"
#include "float_variants.h"
#include "lanes16.h"
#include "spin_pool.h"
#include "vec_avx2.h"

namespace {

using namespace engine_cpu;

// The cache rows of the item a thread attends next, asked for into L2 while it attends the current one (for_each_row
// issues a few lines for each row it visits, once a block): the next item's reads overlap this item's arithmetic
// instead of following it. With the whole item asked for only when it started, a 30-layer step of 64 requests spent
// about 60% longer than with its caches already in L2 (scripts/bench_cpu_decode_kernel.py; docs/benchmarks.md).
struct RowsAhead {
  struct Span {
    const char* begin;
    const char* end;
  };
  std::vector<Span> spans;  // the rows' byte ranges, keys first (one a block), then values
  size_t span = 0;
  const char* at = nullptr;
  int lines_per_row = 0;

  void start() {
    span = 0;
    at = spans.empty() ? nullptr : spans[0].begin;
  }
  // issues up to `lines` of the remaining prefetches
  __attribute__((always_inline)) inline void issue(int64_t lines) {
    for (int64_t i = 0; i < lines && span < spans.size(); ++i) {
      __builtin_prefetch(at, 0, 2);
      at += 64;
      if (at >= spans[span].end && ++span < spans.size()) at = spans[span].begin;
    }
  }
};
// the calling thread's, while it attends an item with another one taken (a plain pointer: no guard on each read)
thread_local RowsAhead* rows_ahead = nullptr;

// Visits the cache rows of positions [first, last) of one request and one KV head, block by block.
// While visiting row o of a block it prefetches the bytes [prefetch_from, prefetch_to) of row o of the
// next one: blocks are scattered, so the hardware prefetcher cannot guess the next page, and spreading
// the prefetches over the block keeps the cache's miss queue from filling at each block start.
// Always inlined: each ISA variant's row loop (attention_rows.inc) is then compiled with that variant's target.
template <typename scalar_t, typename Fn>
__attribute__((always_inline)) inline void for_each_row(const scalar_t* cache, const int32_t* table,
                                                        int64_t block_size, int64_t stride_block, int64_t stride_tok,
                                                        int64_t first, int64_t last, int64_t prefetch_from,
                                                        int64_t prefetch_to, Fn&& fn) {
  int64_t t = first;
  while (t < last) {
    const int64_t index = t / block_size;
    const int64_t end = std::min(last, (index + 1) * block_size);
    const char* next = end < last ? reinterpret_cast<const char*>(cache + table[index + 1] * stride_block) : nullptr;
    const int64_t next_rows = next ? std::min(block_size, last - end) : 0;
    if (RowsAhead* ahead = rows_ahead) ahead->issue(ahead->lines_per_row * (end - t));  // once a block
    int64_t offset = t - index * block_size;  // counted along the block: no division a row
    const scalar_t* row = cache + table[index] * stride_block + offset * stride_tok;
    for (; t < end; ++t, ++offset, row += stride_tok) {
#ifdef ENGINE_AVX2
      if (offset < next_rows)
        for (int64_t b = prefetch_from; b < prefetch_to; b += 64)
          _mm_prefetch(next + offset * stride_tok * int64_t(sizeof(scalar_t)) + b, _MM_HINT_T0);
#endif
      fn(t, row);
    }
  }
}

// The most an item asks for at once (keys and values together): well within any L2 this runs on.
constexpr int64_t kItemPrefetchBytes = 128 << 10;

// The portable loops, for head sizes the vector variants do not take (and CPUs without AVX2).
// scores[g * n + i] = scale * q_g . k_(first + i) for the G query heads q (G rows of head_size floats)
// that share one KV head: each K row is read once for all of them. Soft-capped when cap > 0.
template <int G, typename scalar_t>
void score_rows(float* scores, const float* q, const scalar_t* cache, const int32_t* table, int64_t block_size,
                int64_t stride_block, int64_t stride_tok, int64_t first, int64_t last, int64_t head_size,
                float scale, float cap) {
  const int64_t n = last - first;
  for_each_row(cache, table, block_size, stride_block, stride_tok, first, last, 0,
               head_size * int64_t(sizeof(scalar_t)), [&](int64_t t, const scalar_t* k) {
    for (int g = 0; g < G; ++g) {
      float total = 0.f;
      for (int64_t d = 0; d < head_size; ++d) total += q[g * head_size + d] * as_float(k[d]);
      scores[g * n + t - first] = total * scale;
    }
  });
  if (cap > 0.f)
    for (int64_t i = 0; i < G * n; ++i) scores[i] = cap * std::tanh(scores[i] / cap);
}

// out[g * head_size + d] = sum_i p[g * n + i] * v_(first + i)[d] for the G heads that share one KV head.
template <int G, typename scalar_t>
void weigh_rows(float* out, const float* p, const scalar_t* cache, const int32_t* table, int64_t block_size,
                int64_t stride_block, int64_t stride_tok, int64_t first, int64_t last, int64_t head_size) {
  const int64_t n = last - first;
  std::fill(out, out + G * head_size, 0.f);
  for_each_row(cache, table, block_size, stride_block, stride_tok, first, last, 0,
               head_size * int64_t(sizeof(scalar_t)), [&](int64_t t, const scalar_t* v) {
    for (int g = 0; g < G; ++g) {
      const float w = p[g * n + t - first];
      for (int64_t d = 0; d < head_size; ++d) out[g * head_size + d] += w * as_float(v[d]);
    }
  });
}

// Attention of G consecutive query heads (sharing one KV head) of one request over its positions [first, last):
// q and acc hold G rows. acc holds G rows of v_size (the value rows may be narrower than the key rows: MLA's latent
// cache serves as both, its values being the first v_size columns).
// With peaks and sums (a part of a longer context), the weights are left unnormalised: acc = sum exp(s - peak) v,
// each head's peak and sum of weights in peaks[g] and sums[g], for merge_parts.
template <int G, typename scalar_t>
void attend_heads(float* acc, float* scores, const float* q, const scalar_t* keys, const scalar_t* values,
                  const int32_t* table, int64_t block_size, int64_t kc_block, int64_t kc_tok, int64_t vc_block,
                  int64_t vc_tok, int64_t first, int64_t last, int64_t head_size, int64_t v_size, float scale,
                  float cap, float* peaks = nullptr, float* sums = nullptr) {
  const int64_t n = last - first;
  score_rows<G>(scores, q, keys, table, block_size, kc_block, kc_tok, first, last, head_size, scale, cap);
  for (int g = 0; g < G; ++g) {
    if (peaks) sums[g] = exp_from_max(scores + g * n, n, peaks + g);
    else softmax(scores + g * n, n);
  }
  weigh_rows<G>(acc, scores, values, table, block_size, vc_block, vc_tok, first, last, v_size);
}

// The vector variants: one source (attention_rows.inc), compiled for AVX2 (16 lanes in two registers) and for
// AVX-512 (one register, and 32 of them: a pass over the value rows takes 64 columns of three heads instead of 32).
#define ENGINE_VARIANT_SOURCE "attention_rows.inc"
#include "for_each_variant.inc"
#undef ENGINE_VARIANT_SOURCE

constexpr int64_t kSerialWork = 1 << 15;  // context tokens x query heads x head size

// A request's context is attended in parts of at most kPartTokens positions, each part a work item of its own, and
// the parts merged by their softmax peaks and sums (as vLLM's PagedAttention v2 partitions a long context). Without
// parts a batch of one request has as many items as KV heads (3 for SmolLM2), and on 2 threads the third ran alone
// while the other thread waited: a third of the attention's time. The parts of a request follow from its own length
// alone, never from the batch around it, so a request's bits do not depend on the batch (model.batch_invariant).
constexpr int64_t kPartTokens = 256;

// out[g] = the parts' unnormalised rows acc_j[g] weighed by exp(peak_j[g] - peak) / sum_j exp(peak_j[g] - peak)
// sums_j[g], in part order (the same bits whichever thread ran which part).
template <typename scalar_t>
void merge_parts(scalar_t* out, int64_t o_head, const float* acc, const float* peaks, const float* sums,
                 int64_t parts, int64_t heads, int64_t v_size, int64_t acc_stride, int64_t stat_stride) {
  std::vector<float> weight(parts), row(v_size);
  for (int64_t g = 0; g < heads; ++g) {
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < parts; ++j) peak = std::max(peak, peaks[j * stat_stride + g]);
    float total = 0.f;
    for (int64_t j = 0; j < parts; ++j) {
      weight[j] = std::exp(peaks[j * stat_stride + g] - peak);
      total += weight[j] * sums[j * stat_stride + g];
    }
    std::fill(row.begin(), row.end(), 0.f);
    for (int64_t j = 0; j < parts; ++j) {
      const float w = weight[j] / total;
      const float* a = acc + j * acc_stride + g * v_size;
      for (int64_t d = 0; d < v_size; ++d) row[d] += w * a[d];
    }
    for (int64_t d = 0; d < v_size; ++d) out[g * o_head + d] = static_cast<scalar_t>(row[d]);
  }
}

// scalar_t: the query's and the output's dtype; cache_t: the caches' (the query's, or a 16-bit cache under float32
// queries: cache.kv_cache_dtype). Scores, softmax and sums run in float32 either way.
template <typename scalar_t, typename cache_t>
void decode_attention_impl(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                           const torch::Tensor& value_cache, const torch::Tensor& block_table,
                           const torch::Tensor& seq_lens, double scale, double soft_cap, int64_t sliding_window,
                           int64_t variant) {
  const int64_t num_rows = query.size(0);
  const int64_t num_heads = query.size(1);
  const int64_t head_size = query.size(2);
  const int64_t v_size = value_cache.size(3);
  const int64_t block_size = key_cache.size(1);
  const int64_t num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;

  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const cache_t* k_ptr = key_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = value_cache.data_ptr<cache_t>();
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
  // the heads of a KV group go in chunks of at most 3 (as even as possible): 3 heads' accumulators fill
  // the 16 vector registers, and each chunk reads the group's K and V rows once
  const int64_t num_chunks = (group + 2) / 3;
  // the vector variants take head and value sizes that are multiples of 16, the portable loops any other
  const bool vectors = head_size % 16 == 0 && v_size % 16 == 0;

  // (request, KV head, chunk of heads, part of the context) items, longest first, each taken by whichever thread is
  // free: request lengths vary tenfold, and an even split of the item range would leave one thread waiting for the
  // other; a request with few KV heads (one, under MLA) still spreads over the threads by its chunks of query heads
  // and its parts. A split request's (KV head, chunk) is a "split": its parts' unnormalised rows go to a scratch
  // slot each, and the thread that finishes its last part merges them.
  struct Item {
    int64_t row, kv_head, chunk, first, last, split, slot;  // split and slot -1 for a request in one part
  };
  std::vector<Item> items;
  struct Split {
    int64_t first_slot, parts;
  };
  std::vector<Split> splits;
  int64_t context = 0, slots = 0;
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t seq_len = lens_ptr[r];
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, seq_len - sliding_window) : 0;
    const int64_t parts = (seq_len - first + kPartTokens - 1) / kPartTokens;
    context += seq_len - first;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t c = 0; c < num_chunks; ++c) {
        if (parts <= 1) {
          items.push_back({r, h, c, first, seq_len, -1, -1});
          continue;
        }
        const int64_t split = static_cast<int64_t>(splits.size());
        splits.push_back({slots, parts});
        for (int64_t j = 0; j < parts; ++j)
          items.push_back({r, h, c, first + j * kPartTokens, std::min(seq_len, first + (j + 1) * kPartTokens), split,
                           slots++});
      }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.last - a.first > b.last - b.first; });
  // each slot: 3 heads' unnormalised rows, peaks and sums (kept per thread: a decode step calls this once a layer)
  const int64_t acc_stride = 3 * v_size, stat_stride = 3;
  thread_local std::vector<float> part_acc, part_peaks, part_sums;
  part_acc.resize(slots * acc_stride);
  part_peaks.resize(slots * stat_stride);
  part_sums.resize(slots * stat_stride);
  std::unique_ptr<std::atomic<int64_t>[]> parts_left(new std::atomic<int64_t>[splits.size()]);
  for (size_t s = 0; s < splits.size(); ++s) parts_left[s].store(splits[s].parts, std::memory_order_relaxed);
  float* const acc_base = part_acc.data();
  float* const peaks_base = part_peaks.data();
  float* const sums_base = part_sums.data();

  const int64_t num_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next_item{0};
  // one thread when the whole step is a few microseconds of work: waking another would cost more
  const int64_t threads = context * num_heads * head_size < kSerialWork ? 1 : at::get_num_threads();
  // on the spin pool, not OpenMP: this runs between the step's products, which keep the pool's workers awake
  engine_pool::run_shared(std::min<int64_t>(threads, num_items), [&] {
    thread_local std::vector<float> q, whole, scores;  // each thread's own, kept between calls (no allocation)
    thread_local RowsAhead ahead;
    q.resize(3 * head_size);
    whole.resize(3 * v_size);
    const int64_t k_bytes = head_size * int64_t(sizeof(cache_t));
    const bool shared_rows = v_ptr == k_ptr && vc_tok == kc_tok && vc_block == kc_block && vc_head == kc_head;
    const int64_t v_bytes = shared_rows ? 0 : v_size * int64_t(sizeof(cache_t));
    // an item's cache rows as byte ranges, keys then values (those sharing the keys' rows, as MLA's latent cache,
    // asked for once), at most kItemPrefetchBytes of them
    auto plan = [&](const Item& item) {
      ahead.spans.clear();
      const int32_t* table = table_ptr + item.row * table_row;
      const int64_t last = item.first + std::min(item.last - item.first, kItemPrefetchBytes / (k_bytes + v_bytes));
      for (int pass = 0; pass < (v_bytes > 0 ? 2 : 1); ++pass) {
        const char* base = reinterpret_cast<const char*>(pass == 0 ? k_ptr + item.kv_head * kc_head
                                                                   : v_ptr + item.kv_head * vc_head);
        const int64_t stride_block = (pass == 0 ? kc_block : vc_block) * int64_t(sizeof(cache_t));
        const int64_t stride_tok = (pass == 0 ? kc_tok : vc_tok) * int64_t(sizeof(cache_t));
        const int64_t row_bytes = pass == 0 ? k_bytes : v_bytes;
        for (int64_t t = item.first; t < last;) {
          const int64_t index = t / block_size;
          const int64_t end = std::min(last, (index + 1) * block_size);
          const char* row = base + table[index] * stride_block + (t - index * block_size) * stride_tok;
          const auto aligned = reinterpret_cast<uintptr_t>(row) & ~uintptr_t(63);
          ahead.spans.push_back({reinterpret_cast<const char*>(aligned), row + (end - t - 1) * stride_tok + row_bytes});
          t = end;
        }
      }
      ahead.start();
    };
    int64_t taken = next_item++;
    // the first item's rows all at once, before it starts (the caches come from memory: the step's weights streamed
    // through the caches since this layer's last attention; for one request over 512-640 positions this gave 7% more
    // tokens/s than a one-block-ahead prefetch alone)
    if (taken < num_items) {
      plan(items[taken]);
      ahead.issue(std::numeric_limits<int64_t>::max());
    }
    while (taken < num_items) {
      const Item& item = items[taken];
      // the next item taken now, its rows asked for while this one is attended
      const int64_t upcoming = next_item++;
      if (upcoming < num_items) {
        plan(items[upcoming]);
        int64_t lines = 0;
        for (const auto& span : ahead.spans) lines += (span.end - span.begin + 63) / 64;
        // spread over this item's two walks (keys, then values), the rest asked for when it ends
        const int64_t visits = std::max<int64_t>(1, 2 * (item.last - item.first));
        ahead.lines_per_row = static_cast<int>(std::max<int64_t>(1, lines / visits));
        rows_ahead = &ahead;
      }
      scores.resize(3 * (item.last - item.first));
      const int32_t* table = table_ptr + item.row * table_row;
      const cache_t* keys = k_ptr + item.kv_head * kc_head;
      const cache_t* values = v_ptr + item.kv_head * vc_head;
      const int64_t heads = group / num_chunks + (item.chunk < group % num_chunks ? 1 : 0);
      const int64_t head = item.kv_head * group + item.chunk * (group / num_chunks) +
                           std::min(item.chunk, group % num_chunks);
      for (int64_t g = 0; g < heads; ++g) {
        const scalar_t* src = q_ptr + item.row * q_tok + (head + g) * q_head;
        for (int64_t d = 0; d < head_size; ++d) q[g * head_size + d] = as_float(src[d]);
      }
      const bool part = item.split >= 0;
      float* acc = part ? acc_base + item.slot * acc_stride : whole.data();
      float* peaks = part ? peaks_base + item.slot * stat_stride : nullptr;
      float* sums = part ? sums_base + item.slot * stat_stride : nullptr;
      auto attend = [&](auto heads_constant) {
        constexpr int G = decltype(heads_constant)::value;
#ifdef ENGINE_AVX2
        if (vectors) {
          (variant == kVariantAvx512 ? avx512::attend_heads<G, cache_t> : avx2::attend_heads<G, cache_t>)(
              acc, scores.data(), q.data(), keys, values, table, block_size, kc_block, kc_tok, vc_block, vc_tok,
              item.first, item.last, head_size, v_size, fscale, fcap, peaks, sums);
          return;
        }
#endif
        attend_heads<G>(acc, scores.data(), q.data(), keys, values, table, block_size, kc_block, kc_tok, vc_block,
                        vc_tok, item.first, item.last, head_size, v_size, fscale, fcap, peaks, sums);
      };
      if (heads == 3) attend(std::integral_constant<int, 3>{});
      else if (heads == 2) attend(std::integral_constant<int, 2>{});
      else attend(std::integral_constant<int, 1>{});
      scalar_t* dst = out_ptr + item.row * o_tok + head * o_head;
      if (!part) {
        for (int64_t g = 0; g < heads; ++g)
          for (int64_t d = 0; d < v_size; ++d) dst[g * o_head + d] = static_cast<scalar_t>(acc[g * v_size + d]);
      } else if (parts_left[item.split].fetch_sub(1, std::memory_order_acq_rel) == 1) {  // the last part: merge
        const Split& s = splits[item.split];
        merge_parts(dst, o_head, acc_base + s.first_slot * acc_stride, peaks_base + s.first_slot * stat_stride,
                    sums_base + s.first_slot * stat_stride, s.parts, heads, v_size, acc_stride, stat_stride);
      }
      rows_ahead = nullptr;
      if (upcoming < num_items) ahead.issue(std::numeric_limits<int64_t>::max());  // what this item's walk left
      taken = upcoming;
    }
  });
}

}  // namespace

// query [rows, Hq, D], out [rows, Hq, Dv]; key_cache [blocks, block_size, Hkv, D], value_cache the same with Dv <= D
// (MLA passes its latent cache as both, the values a prefix of each row); block_table [rows, max_blocks]
// int32; seq_lens [rows] int32 (the query is the token at position seq_len - 1).
// variant: kVariantAvx2, kVariantAvx512 or -1 (the widest this CPU runs natively); every variant gives the same bits.
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor seq_lens,
                            double scale, double soft_cap, int64_t sliding_window, int64_t variant = -1) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && out.size(0) == query.size(0) && out.size(1) == query.size(1),
              "query must be [rows, heads, head_size] and out [rows, heads, value size]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 && value_cache.size(0) == key_cache.size(0) &&
                  value_cache.size(1) == key_cache.size(1) && value_cache.size(2) == key_cache.size(2),
              "caches must be [blocks, block_size, kv_heads, head_size] (values may be narrower than keys)");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "head sizes differ");
  TORCH_CHECK(out.size(2) == value_cache.size(3) && value_cache.size(3) <= key_cache.size(3),
              "out's last dimension must be the value size, at most the key size");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32,
              "block_table and seq_lens must be int32");
  TORCH_CHECK(block_table.is_contiguous() && seq_lens.is_contiguous(), "block_table and seq_lens must be contiguous");
  // by default the widest variant, or the portable loops where the build has no vector variant
  TORCH_CHECK(variant < 0 || engine_cpu::cpu_has_variant(variant), "this CPU lacks the instructions of attention "
              "variant ", variant);
  const int64_t chosen = variant < 0 ? engine_cpu::default_variant() : variant;
  auto run = [&](auto query_type, auto cache_type) {
    decode_attention_impl<decltype(query_type), decltype(cache_type)>(out, query, key_cache, value_cache, block_table,
                                                                      seq_lens, scale, soft_cap, sliding_window, chosen);
  };
  engine_cpu::dispatch_cache_dtypes(out, query, key_cache, value_cache, run);
}

// key/value [tokens, Hkv, D] into key_cache/value_cache [blocks, block_size, Hkv, D] (strided views with a contiguous
// head dimension) at slot_mapping [tokens] int64 (block * block_size + offset; negative slots are skipped): one call
// per layer instead of two indexed assignments. float32 rows go into a bfloat16 or float16 cache rounded.
void write_kv_cache(torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor key, torch::Tensor value,
                    torch::Tensor slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes() && key_cache.dim() == 4 &&
                  value_cache.sizes() == key_cache.sizes(), "key/value [tokens, kv_heads, D], caches 4-D");
  TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3), "head counts or sizes differ");
  TORCH_CHECK(value.scalar_type() == key.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type(),
              "key and value must share a dtype, and so must the caches");
  const bool convert = key.scalar_type() != key_cache.scalar_type();
  TORCH_CHECK(!convert || (key.scalar_type() == torch::kFloat32 && (key_cache.scalar_type() == torch::kBFloat16 ||
                                                                    key_cache.scalar_type() == torch::kHalf)),
              "the caches must hold the rows' dtype, or bfloat16 / float16 for float32 rows");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0), "slot_mapping: int64, one per token");
  const int64_t tokens = key.size(0), heads = key.size(1), block_size = key_cache.size(1);
  const int64_t num_slots = key_cache.size(0) * block_size;
  const int64_t head_size = key.size(2), elem = key.element_size(), cache_elem = key_cache.element_size();
  const int64_t bytes = head_size * elem;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  struct Side { const char* src; char* dst; int64_t src_tok, src_head, dst_block, dst_tok, dst_head; };
  const Side sides[2] = {
      {static_cast<const char*>(key.data_ptr()), static_cast<char*>(key_cache.data_ptr()), key.stride(0) * elem,
       key.stride(1) * elem, key_cache.stride(0) * cache_elem, key_cache.stride(1) * cache_elem,
       key_cache.stride(2) * cache_elem},
      {static_cast<const char*>(value.data_ptr()), static_cast<char*>(value_cache.data_ptr()), value.stride(0) * elem,
       value.stride(1) * elem, value_cache.stride(0) * cache_elem, value_cache.stride(1) * cache_elem,
       value_cache.stride(2) * cache_elem}};
  // a float32 row into a 16-bit cache: rounded to nearest even, as torch's .to() rounds
  const auto copy_row = [&](char* dst, const char* src) {
    if (!convert) {
      std::memcpy(dst, src, bytes);
      return;
    }
    const float* from = reinterpret_cast<const float*>(src);
    if (key_cache.scalar_type() == torch::kBFloat16) {
      c10::BFloat16* to = reinterpret_cast<c10::BFloat16*>(dst);
      for (int64_t d = 0; d < head_size; ++d) to[d] = c10::BFloat16(from[d]);
    } else {
      c10::Half* to = reinterpret_cast<c10::Half*>(dst);
      for (int64_t d = 0; d < head_size; ++d) to[d] = c10::Half(from[d]);
    }
  };
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "slot ", slot, " is past the cache's ", num_slots, " slots");
    const int64_t block = slot / block_size, offset = slot % block_size;
    for (const Side& side : sides)
      for (int64_t h = 0; h < heads; ++h)
        copy_row(side.dst + block * side.dst_block + offset * side.dst_tok + h * side.dst_head,
                 side.src + t * side.src_tok + h * side.src_head);
  }
}

#ifndef ENGINE_KERNELS_NO_MODULE  // the decode graph (decode_graph.cpp) compiles this file in, bindings left out
// prefill_attention.cpp, linked into the same module
void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor block_ids, int64_t context_len, double scale,
                             double soft_cap, int64_t sliding_window, int64_t variant);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", py::arg("out"),
        py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("soft_cap"), py::arg("sliding_window"), py::arg("variant") = -1);
  m.def("paged_prefill_attention", &paged_prefill_attention, "one prompt chunk's attention over the paged cache (CPU)",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_ids"),
        py::arg("context_len"), py::arg("scale"), py::arg("soft_cap"), py::arg("sliding_window"),
        py::arg("variant") = -1);
  m.def("variants", &engine_cpu::variants, "each ISA variant of the decode loops and whether this CPU runs it");
  m.def("write_kv_cache", &write_kv_cache, "key/value rows into the paged caches at their slots (CPU)");
}
#endif
