// Prompt attention for the CPU: the query tokens of one prompt chunk against the keys and values of its request,
// read from the paged cache (the chunk's own rows written there already, any cached context before them), causal,
// with an optional sliding window and logit soft-capping. Float32 softmax and accumulation whatever the cache dtype.
//
// Work items are (KV head, tile of query tokens): a tile holds the query heads of one KV head for a few consecutive
// tokens, so each key and value row serves all of them. An item walks its keys in chunks: the chunk's keys are packed
// transposed and its values packed as float32, the scores come from register tiles (prefill_tiles.inc), the
// running softmax is rescaled as in flash attention, and the weighted values accumulate in float32. Items are taken
// by free threads, the tiles with the most keys first.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cache_dtypes.h"
#include "float_variants.h"
#include "lanes16.h"
#include "spin_pool.h"
#include "vec_avx2.h"

namespace {

using namespace engine_cpu;

#define ENGINE_VARIANT_SOURCE "prefill_tiles.inc"
#include "for_each_variant.inc"
#undef ENGINE_VARIANT_SOURCE

constexpr int64_t kKeysPerChunk = 256;  // a chunk's scores and packed keys and values stay in L2
constexpr int64_t kRowsPerTile = 96;    // query rows (tokens x heads of one KV head) that share each packed chunk
constexpr int64_t kPackedBytes = 32 << 20;  // the packed keys and values of a window of chunks, all KV heads
constexpr int64_t kSerialWork = 1 << 20;  // query tokens x keys x query heads x head size: below it, one thread
constexpr int64_t kPad = 16;  // a partial chunk's keys are padded with zeros to whole 16-lane vectors

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// The largest of p[0:n].
inline float peak_of(const float* p, int64_t n) {
  float peak = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef ENGINE_AVX2
  __m256 lanes = _mm256_set1_ps(peak);
  for (; i + 8 <= n; i += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(p + i));
  alignas(32) float lane[8];
  _mm256_store_ps(lane, lanes);
  for (float x : lane) peak = std::max(peak, x);
#endif
  for (; i < n; ++i) peak = std::max(peak, p[i]);
  return peak;
}

// kt[d * ldk + j] = key_j[d] as float32 for keys j < n and d < head_size (a multiple of 8): 8 x 8 blocks transposed
// in registers; key_j = keys(j).
template <typename scalar_t, typename KeyRow>
void pack_transposed(float* kt, int64_t ldk, int64_t n, int64_t head_size, const KeyRow& keys) {
  int64_t j = 0;
#ifdef ENGINE_AVX2
  for (; j + 8 <= n; j += 8) {
    const scalar_t* rows[8];
    for (int i = 0; i < 8; ++i) rows[i] = keys(j + i);
    for (int64_t d = 0; d < head_size; d += 8) {
      __m256 r[8], t[8];
      for (int i = 0; i < 8; ++i) r[i] = load8(rows[i] + d);
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
      }
      // r[0..3]: columns (0, 1, 2, 3) + 4 * half of keys 0-3 in the low lanes, 4-7 in r[4..7]
      for (int i = 0; i < 4; ++i) {
        const int column = i;  // d + column and d + column + 4
        _mm256_storeu_ps(kt + (d + column) * ldk + j, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(kt + (d + column + 4) * ldk + j, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
      }
    }
  }
#endif
  for (; j < n; ++j) {
    const scalar_t* key = keys(j);
    for (int64_t d = 0; d < head_size; ++d) kt[d * ldk + j] = as_float(key[d]);
  }
}

// scalar_t: the query's and the output's dtype; cache_t: the caches' (the query's, or bfloat16 / float16 under float32
// queries). The keys and values are packed as float32 either way.
template <typename scalar_t, typename cache_t>
void prefill_attention_impl(torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                            const torch::Tensor& value_cache, const torch::Tensor& block_ids, int64_t context_len,
                            double scale, double soft_cap, int64_t sliding_window, int64_t variant) {
#ifdef ENGINE_AVX2
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t v_size = value_cache.size(3), block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const cache_t* k_ptr = key_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = value_cache.data_ptr<cache_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t* blocks = block_ids.data_ptr<int64_t>();
  const int64_t q_tok = query.stride(0), q_head = query.stride(1), o_tok = out.stride(0), o_head = out.stride(1);
  const int64_t kc_block = key_cache.stride(0), kc_tok = key_cache.stride(1), kc_head = key_cache.stride(2);
  const int64_t vc_block = value_cache.stride(0), vc_tok = value_cache.stride(1), vc_head = value_cache.stride(2);
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  const bool wide = variant == kVariantAvx512;
  const auto score_block = wide ? avx512::score_block : avx2::score_block;
  const auto weigh_block = wide ? avx512::weigh_block : avx2::weigh_block;

  const int64_t threads = num_tokens * (context_len + num_tokens) * num_heads * head_size < kSerialWork
                              ? 1
                              : at::get_num_threads();
  // tokens per tile: kRowsPerTile rows, fewer where the chunk is short, so the threads get a few items each
  const int64_t min_tiles = (4 * threads + num_kv_heads - 1) / num_kv_heads;
  const int64_t tile_tokens = std::max<int64_t>(
      1, std::min(std::max<int64_t>(1, kRowsPerTile / group), (num_tokens + min_tiles - 1) / min_tiles));
  const int64_t num_tiles = (num_tokens + tile_tokens - 1) / tile_tokens;
  const int64_t num_items = num_tiles * num_kv_heads;

  // every row's query (scaled), weighted values, running peak and sum, laid out [KV head][token][head in group]:
  // an item's rows are consecutive
  const int64_t num_rows = num_tokens * num_heads;
  std::vector<float> q(num_rows * head_size), o(num_rows * v_size, 0.f), peak(num_rows), total(num_rows, 0.f);
  std::fill(peak.begin(), peak.end(), -std::numeric_limits<float>::infinity());

  // keys [lo, hi): every position some token sees, in chunks of kKeysPerChunk from position 0, packed a window of
  // chunks at a time for all KV heads (keys transposed, values as rows, both float32)
  const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, context_len - sliding_window + 1) : 0;
  const int64_t hi = context_len + num_tokens;
  const int64_t chunk_floats = kKeysPerChunk * (head_size + v_size);
  const int64_t window_chunks = std::max<int64_t>(1, kPackedBytes / (4 * chunk_floats * num_kv_heads));
  std::vector<float> packed;
  for (int64_t w0 = lo / kKeysPerChunk; w0 * kKeysPerChunk < hi; w0 += window_chunks) {
    const int64_t w1 = std::min(w0 + window_chunks, (hi + kKeysPerChunk - 1) / kKeysPerChunk);
    const int64_t chunks = w1 - w0;
    packed.resize(num_kv_heads * chunks * chunk_floats);
    auto keys_of = [&](int64_t kv_head, int64_t c) { return packed.data() + (kv_head * chunks + c - w0) * chunk_floats; };
    auto values_of = [&](int64_t kv_head, int64_t c) { return keys_of(kv_head, c) + kKeysPerChunk * head_size; };
    std::atomic<int64_t> next_unit{0};
    engine_pool::run_shared(std::min(threads, num_kv_heads * chunks), [&] {
      for (int64_t unit = next_unit++; unit < num_kv_heads * chunks; unit = next_unit++) {
        const int64_t kv_head = unit / chunks, c = w0 + unit % chunks;
        const int64_t j0 = c * kKeysPerChunk, keys = std::min(kKeysPerChunk, hi - j0);
        float* kt = keys_of(kv_head, c);
        float* v = values_of(kv_head, c);
        pack_transposed<cache_t>(kt, kKeysPerChunk, keys, head_size, [&](int64_t j) {
          const int64_t block = blocks[(j0 + j) / block_size], offset = (j0 + j) % block_size;
          return k_ptr + block * kc_block + offset * kc_tok + kv_head * kc_head;
        });
        for (int64_t j = 0; j < keys; ++j) {
          const int64_t block = blocks[(j0 + j) / block_size], offset = (j0 + j) % block_size;
          const cache_t* value = v_ptr + block * vc_block + offset * vc_tok + kv_head * vc_head;
          for (int64_t d = 0; d < v_size; d += 8) _mm256_storeu_ps(v + j * v_size + d, load8(value + d));
        }
        for (int64_t d = 0; d < head_size; ++d)
          std::fill(kt + d * kKeysPerChunk + keys, kt + d * kKeysPerChunk + round_up(keys, kPad), 0.f);
      }
    });

    std::atomic<int64_t> next_item{0};
    engine_pool::run_shared(std::min(threads, num_items), [&] {
      std::vector<float> s(tile_tokens * group * kKeysPerChunk);
      for (int64_t taken = next_item++; taken < num_items; taken = next_item++) {
        const int64_t tile = num_tiles - 1 - taken / num_kv_heads;  // the last tiles see the most keys: first
        const int64_t kv_head = taken % num_kv_heads;
        const int64_t i0 = tile * tile_tokens, i1 = std::min(num_tokens, i0 + tile_tokens);
        const int64_t rows = (i1 - i0) * group, row0 = (kv_head * num_tokens + i0) * group;
        float* item_q = q.data() + row0 * head_size;
        float* item_o = o.data() + row0 * v_size;
        if (w0 * kKeysPerChunk <= lo)  // the first window: the rows' queries, scaled, as float32
          for (int64_t i = i0; i < i1; ++i)
            for (int64_t g = 0; g < group; ++g) {
              const scalar_t* src = q_ptr + i * q_tok + (kv_head * group + g) * q_head;
              float* dst = item_q + ((i - i0) * group + g) * head_size;
              for (int64_t d = 0; d < head_size; ++d) dst[d] = as_float(src[d]) * fscale;
            }
        // this item's keys: [first, last)
        const int64_t first = std::max(w0 * kKeysPerChunk, sliding_window > 0
                                                                ? std::max<int64_t>(0, context_len + i0 -
                                                                                           sliding_window + 1)
                                                                : 0);
        const int64_t last = std::min(w1 * kKeysPerChunk, context_len + i1);
        for (int64_t c = first / kKeysPerChunk; c * kKeysPerChunk < last; ++c) {
          const int64_t j0 = c * kKeysPerChunk, keys = std::min(kKeysPerChunk, hi - j0);
          score_block(s.data(), kKeysPerChunk, item_q, rows, head_size, keys_of(kv_head, c), kKeysPerChunk,
                      round_up(keys, kPad));
          // the running softmax: row r (token i0 + r / group, at position context_len + i0 + r / group) sees the
          // chunk's keys [from, to); the others weigh 0
          for (int64_t r = 0; r < rows; ++r) {
            float* p = s.data() + r * kKeysPerChunk;
            const int64_t position = context_len + i0 + r / group;
            const int64_t from = std::max<int64_t>(0, (sliding_window > 0 ? position - sliding_window + 1 : 0) - j0);
            const int64_t to = std::min<int64_t>(keys, position + 1 - j0);
            if (from >= to) {
              std::fill(p, p + keys, 0.f);
              continue;
            }
            if (cap > 0.f)
              for (int64_t j = from; j < to; ++j) p[j] = cap * std::tanh(p[j] / cap);
            const int64_t row = row0 + r;
            const float new_peak = std::max(peak[row], peak_of(p + from, to - from));
            const float rescale = std::exp(peak[row] - new_peak);  // 0 for the first keys a row sees
            total[row] = total[row] * rescale + exp_shifted(p + from, to - from, new_peak);
            std::fill(p, p + from, 0.f);
            std::fill(p + to, p + keys, 0.f);
            if (rescale != 1.f)
              for (int64_t d = 0; d < v_size; ++d) item_o[r * v_size + d] *= rescale;
            peak[row] = new_peak;
          }
          weigh_block(item_o, v_size, s.data(), kKeysPerChunk, rows, values_of(kv_head, c), v_size, keys, v_size);
        }
        if (w1 * kKeysPerChunk >= hi)  // the last window: out = o / sum
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t i = i0 + r / group, head = kv_head * group + r % group;
            scalar_t* dst = out_ptr + i * o_tok + head * o_head;
            const float inv = 1.f / total[row0 + r];
            for (int64_t d = 0; d < v_size; ++d) dst[d] = static_cast<scalar_t>(item_o[r * v_size + d] * inv);
          }
      }
    });
  }
#else
  TORCH_CHECK(false, "paged_prefill_attention needs a build with AVX2 (the portable build has no vector variant)");
#endif
}

}  // namespace

// One prompt chunk: query [n, Hq, D] at positions context_len .. context_len + n - 1 of its request, out [n, Hq, Dv];
// key_cache [blocks, block_size, Hkv, D] and value_cache (Dv <= D columns) hold the request's rows 0 .. context_len +
// n - 1 (this chunk's included) in the blocks block_ids [>= ceil((context_len + n) / block_size)] int64. Head and
// value sizes multiples of 16. variant: kVariantAvx2, kVariantAvx512 or -1 (the widest this CPU runs natively);
// every variant gives the same bits.
void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor block_ids, int64_t context_len, double scale,
                             double soft_cap, int64_t sliding_window, int64_t variant) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && out.size(0) == query.size(0) && out.size(1) == query.size(1),
              "query must be [tokens, heads, head_size] and out [tokens, heads, value size]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 && value_cache.size(0) == key_cache.size(0) &&
                  value_cache.size(1) == key_cache.size(1) && value_cache.size(2) == key_cache.size(2),
              "caches must be [blocks, block_size, kv_heads, head_size] (values may be narrower than keys)");
  TORCH_CHECK(query.size(2) == key_cache.size(3) && out.size(2) == value_cache.size(3), "head sizes differ");
  TORCH_CHECK(query.size(2) % 16 == 0 && value_cache.size(3) % 16 == 0, "head and value sizes must be multiples of 16");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "the head dimension must be contiguous");
  TORCH_CHECK(block_ids.scalar_type() == torch::kInt64 && block_ids.is_contiguous() && block_ids.dim() == 1,
              "block_ids must be a contiguous int64 vector");
  TORCH_CHECK(context_len >= 0 && block_ids.size(0) * key_cache.size(1) >= context_len + query.size(0),
              "block_ids must cover the context and the chunk");
  TORCH_CHECK(engine_cpu::cpu_has_variant(variant < 0 ? engine_cpu::default_variant() : variant),
              "this CPU lacks the instructions of attention variant ", variant);
  if (query.size(0) == 0) return;
  const int64_t chosen = variant < 0 ? engine_cpu::default_variant() : variant;
  auto run = [&](auto query_type, auto cache_type) {
    prefill_attention_impl<decltype(query_type), decltype(cache_type)>(out, query, key_cache, value_cache, block_ids,
                                                                       context_len, scale, soft_cap, sliding_window,
                                                                       chosen);
  };
  engine_cpu::dispatch_cache_dtypes(out, query, key_cache, value_cache, run);
}
