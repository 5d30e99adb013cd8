// The (query, cache) dtype pairs the attention kernels take: a cache of the query's dtype, or a bfloat16 / float16
// cache under float32 queries (cache.kv_cache_dtype). One check and one dispatch for the decode and prefill kernels.
#pragma once

#include <torch/extension.h>

namespace engine_cpu {

// run(query_t{}, cache_t{}) for the pair of query's and key_cache's dtypes, after checking that out shares the
// query's dtype, value_cache the key_cache's, and that the pair is one the kernels take.
template <typename Fn>
void dispatch_cache_dtypes(const torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                           const torch::Tensor& value_cache, Fn&& run) {
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type(),
              "query and out must share a dtype, and so must the caches");
  if (key_cache.scalar_type() != query.scalar_type()) {
    TORCH_CHECK(query.scalar_type() == torch::kFloat32 &&
                    (key_cache.scalar_type() == torch::kBFloat16 || key_cache.scalar_type() == torch::kHalf),
                "the caches must hold the query's dtype, or bfloat16 / float16 under float32 queries");
    if (key_cache.scalar_type() == torch::kBFloat16) run(float{}, c10::BFloat16{});
    else run(float{}, c10::Half{});
    return;
  }
  AT_DISPATCH_SWITCH(query.scalar_type(), "paged attention",
    AT_DISPATCH_CASE(at::kFloat, [&] { run(scalar_t{}, scalar_t{}); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] { run(scalar_t{}, scalar_t{}); })
    AT_DISPATCH_CASE(at::kHalf, [&] { run(scalar_t{}, scalar_t{}); }));
}

}  // namespace engine_cpu
