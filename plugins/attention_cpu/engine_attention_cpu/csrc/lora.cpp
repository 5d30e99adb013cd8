// The batched LoRA product for CPUs (vLLM's punica shrink and expand) in one call per layer and step: for every token t
// that runs with adapter slot s, y[t] += B_s (A_s x[t]); tokens of the base model (slot -1) are left alone.
//
// The tokens are grouped by slot first. Shrink: each LoRA token's W = slices x R sums A_s x[t], eight lanes over the
// input, two tokens of a slot at a time (one read of A for both). Expand: a merged layer (q/k/v, gate/up) keeps B
// block-diagonal: output rows of slice i take only B's columns i*R..(i+1)*R, so each output element adds R (not W)
// products; B's block of eight outputs is transposed once per slot, then eight tokens of the slot run through it.
// Every element's sums run in one fixed order that depends on the layer's shapes only, never on how many tokens
// the step has, how they group, or which thread runs them: a row's result is the same alone or in any batch.
#include <torch/extension.h>

#include <cmath>
#include <utility>
#include <vector>

#include "spin_pool.h"
#include "vec_avx2.h"

namespace {

using namespace engine_cpu;

#ifndef DISPATCH_ACTIVATION_TYPES  // layer_kernels.cpp's, where the decode graph compiles both in
#define DISPATCH_ACTIVATION_TYPES(TYPE, NAME, ...)                                                          \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                                   \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))
#endif

constexpr int64_t kOutBlock = 8;                // output columns an expand item updates at once (one AVX2 vector)
constexpr int64_t kMinFmasPerThread = 1 << 15;  // smaller calls run on the calling thread alone
constexpr int kRowsAtOnce = 8;                  // rows of one slot an expand item updates together
constexpr int64_t kItemBlocks = 2;              // output blocks of an expand item
constexpr int64_t kRowsPerChunk = 256;          // rows the expand walks before it moves to the next columns

// out[t][j] = dot(a[j * k : (j + 1) * k], x[t][0:k]) for T tokens (rows ldx apart) and J rows of a: each element one
// chain of eight-lane fused multiply-adds over k, a horizontal sum, then the scalar tail; the same chain whatever T.
template <int T, int J, typename scalar_t>
inline void dot_tile(const scalar_t* x, int64_t ldx, const float* a, int64_t k, float* out, int64_t ldo) {
  int64_t i = 0;
#ifdef ENGINE_AVX2
  __m256 acc[T][J];
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < J; ++j) acc[t][j] = _mm256_setzero_ps();
  for (; i + 8 <= k; i += 8) {
    __m256 xv[T];
    for (int t = 0; t < T; ++t) xv[t] = load8(x + t * ldx + i);
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) {
      const __m256 av = _mm256_loadu_ps(a + j * k + i);
#pragma GCC unroll 2
      for (int t = 0; t < T; ++t) acc[t][j] = _mm256_fmadd_ps(av, xv[t], acc[t][j]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < J; ++j) out[t * ldo + j] = horizontal_sum(acc[t][j]);
#else
  for (int t = 0; t < T; ++t)
    for (int j = 0; j < J; ++j) out[t * ldo + j] = 0.f;
#endif
  for (; i < k; ++i)
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < J; ++j) out[t * ldo + j] = std::fma(a[j * k + i], as_float(x[t * ldx + i]), out[t * ldo + j]);
}

// shrunk[t][0:w] = A x[t] for T tokens of one slot (A [w, k]).
template <int T, typename scalar_t>
inline void shrink_rows(const scalar_t* x, int64_t ldx, const float* a, int64_t w, int64_t k, float* shrunk) {
  int64_t j = 0;
  if constexpr (T == 1) {
    for (; j + 8 <= w; j += 8) dot_tile<1, 8>(x, ldx, a + j * k, k, shrunk + j, w);
  }
  for (; j + 4 <= w; j += 4) dot_tile<T, 4>(x, ldx, a + j * k, k, shrunk + j, w);
  for (; j < w; ++j) dot_tile<T, 1>(x, ldx, a + j * k, k, shrunk + j, w);
}

// For T rows: y[t][c] = round(y[t][c] + sum_j bt[j][c] s[t][j]) for c < cols, j < r (bt: B's block transposed,
// kOutBlock floats a row; s rows w apart), the products added to y one j after the other: each row's sums are the
// same whatever T (T independent chains keep the multiply-add units busy).
template <int T, typename scalar_t>
inline void expand_rows(const float* bt, const float* s, int64_t w, int64_t r, int64_t cols, scalar_t* const* y) {
#ifdef ENGINE_AVX2
  if (cols == kOutBlock) {
    __m256 acc[T];
    for (int t = 0; t < T; ++t) acc[t] = load8(y[t]);
    for (int64_t j = 0; j < r; ++j) {
      const __m256 bv = _mm256_loadu_ps(bt + j * kOutBlock);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) acc[t] = _mm256_fmadd_ps(bv, _mm256_broadcast_ss(s + t * w + j), acc[t]);
    }
    for (int t = 0; t < T; ++t) store8(y[t], acc[t]);
    return;
  }
#endif
  for (int t = 0; t < T; ++t)
    for (int64_t c = 0; c < cols; ++c) {
      float acc = as_float(y[t][c]);
      for (int64_t j = 0; j < r; ++j) acc = std::fma(bt[j * kOutBlock + c], s[t * w + j], acc);
      y[t][c] = static_cast<scalar_t>(acc);
    }
}

// bt[j][c] = b[c * ldb + j] for c < cols, j < r: a block of B (cols output rows of r columns) transposed.
inline void transpose_block(const float* b, int64_t ldb, int64_t r, int64_t cols, float* bt) {
  int64_t j = 0;
#ifdef ENGINE_AVX2
  if (cols == kOutBlock) {
    for (; j + 8 <= r; j += 8) {  // 8 x 8 in registers
      __m256 v[8], u[8];
      for (int c = 0; c < 8; ++c) v[c] = _mm256_loadu_ps(b + c * ldb + j);
      for (int c = 0; c < 8; c += 2) {
        u[c] = _mm256_unpacklo_ps(v[c], v[c + 1]);
        u[c + 1] = _mm256_unpackhi_ps(v[c], v[c + 1]);
      }
      for (int c = 0; c < 8; c += 4) {
        v[c] = _mm256_shuffle_ps(u[c], u[c + 2], 0x44);
        v[c + 1] = _mm256_shuffle_ps(u[c], u[c + 2], 0xEE);
        v[c + 2] = _mm256_shuffle_ps(u[c + 1], u[c + 3], 0x44);
        v[c + 3] = _mm256_shuffle_ps(u[c + 1], u[c + 3], 0xEE);
      }
      // v[0..3]: columns j+0, j+1, j+2, j+3 of rows 0-3 (low lanes: j..j+3 of the low half); v[4..7] rows 4-7
      for (int q = 0; q < 4; ++q) {
        _mm256_storeu_ps(bt + (j + q) * kOutBlock, _mm256_permute2f128_ps(v[q], v[q + 4], 0x20));
        _mm256_storeu_ps(bt + (j + q + 4) * kOutBlock, _mm256_permute2f128_ps(v[q], v[q + 4], 0x31));
      }
    }
  }
#endif
  for (; j < r; ++j)
    for (int64_t c = 0; c < cols; ++c) bt[j * kOutBlock + c] = b[c * ldb + j];
}

struct OutBlock {
  int64_t slice, start, cols;
};

template <typename scalar_t>
void add_lora_impl(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& lora_a, const torch::Tensor& lora_b,
                   const std::vector<int64_t>& rows, const std::vector<int64_t>& slots,
                   const std::vector<int64_t>& slice_offsets, const std::vector<int64_t>& slice_sizes) {
  // rows grouped by slot (their order within a slot kept): groups[g] = [begin, end) of rows, all of one slot
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t k = x.size(1), w = lora_a.size(1), num_slots = lora_a.size(0);
  const int64_t r = w / static_cast<int64_t>(slice_offsets.size());  // B's columns per slice
  const int64_t ldx = x.stride(0), ldy = y.stride(0);
  const scalar_t* xs = x.data_ptr<scalar_t>();
  scalar_t* ys = y.data_ptr<scalar_t>();
  const float* as = lora_a.data_ptr<float>();
  const float* bs = lora_b.data_ptr<float>();
  std::vector<std::pair<int64_t, int64_t>> groups;
  for (int64_t i = 0; i < n; ++i)
    if (i == 0 || slots[i] != slots[i - 1]) groups.push_back({i, i + 1});
    else groups.back().second = i + 1;

  // shrink: two rows of one slot at a time share their reads of A (each element's sums as for a row alone)
  std::vector<float> shrunk(n * w);
  std::vector<std::pair<int64_t, int64_t>> items;  // (first row, 1 or 2 rows of one slot)
  for (const auto& [begin, end] : groups)
    for (int64_t i = begin; i < end; i += 2) items.push_back({i, std::min<int64_t>(2, end - i)});
  engine_pool::parallel_range(
      static_cast<int64_t>(items.size()), std::max<int64_t>(1, kMinFmasPerThread / std::max<int64_t>(1, 2 * w * k)),
      [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
          const auto [i, count] = items[item];
          const float* a = as + slots[i] * w * k;
          if (count == 2)  // rows ascend within a slot: the second is (rows[i + 1] - rows[i]) x-rows further
            shrink_rows<2>(xs + rows[i] * ldx, (rows[i + 1] - rows[i]) * ldx, a, w, k, &shrunk[i * w]);
          else
            shrink_rows<1>(xs + rows[i] * ldx, 0, a, w, k, &shrunk[i * w]);
        }
      });

  // expand: per item (up to kItemBlocks blocks of kOutBlock output columns: a cache line of float32 y) and slot, B's
  // blocks transposed once, then every row of the slot, each row's blocks one after the other while its line is hot
  std::vector<OutBlock> spans;
  for (size_t slice = 0; slice < slice_offsets.size(); ++slice)
    for (int64_t c = 0; c < slice_sizes[slice]; c += kOutBlock * kItemBlocks)
      spans.push_back({static_cast<int64_t>(slice), slice_offsets[slice] + c,
                       std::min<int64_t>(kOutBlock * kItemBlocks, slice_sizes[slice] - c)});
  const int64_t ldb = num_slots * w;  // B [out, slots, w]: output row o of slot s starts at o * ldb + s * w
  // rows in chunks, so that an item's walk over the rows stays within a few hundred of y's rows (pages)
  for (int64_t chunk = 0; chunk < n; chunk += kRowsPerChunk) {
    const int64_t chunk_end = std::min<int64_t>(n, chunk + kRowsPerChunk);
    std::vector<std::pair<int64_t, int64_t>> parts;  // the groups' rows within the chunk
    for (const auto& [first, last] : groups)
      if (first < chunk_end && last > chunk) parts.push_back({std::max(first, chunk), std::min(last, chunk_end)});
    const int64_t item_fmas = (chunk_end - chunk) * r * kOutBlock * kItemBlocks;
    engine_pool::parallel_range(
        static_cast<int64_t>(spans.size()), std::max<int64_t>(1, kMinFmasPerThread / std::max<int64_t>(1, item_fmas)),
        [&](int64_t begin, int64_t end) {
          std::vector<float> bt(kItemBlocks * r * kOutBlock, 0.f);
          scalar_t* y_rows[kRowsAtOnce];
          for (int64_t index = begin; index < end; ++index) {
            const OutBlock& item = spans[index];
            const int64_t column = item.slice * r;
            const int64_t blocks = (item.cols + kOutBlock - 1) / kOutBlock;
            for (const auto& [first, last] : parts) {
              const float* b = bs + item.start * ldb + slots[first] * w + column;
              for (int64_t q = 0; q < blocks; ++q)
                transpose_block(b + q * kOutBlock * ldb, ldb, r,
                                std::min<int64_t>(kOutBlock, item.cols - q * kOutBlock), &bt[q * r * kOutBlock]);
              for (int64_t i = first; i < last; i += kRowsAtOnce) {
                const int64_t count = std::min<int64_t>(kRowsAtOnce, last - i);
                const float* s = &shrunk[i * w + column];
                for (int64_t q = 0; q < blocks; ++q) {
                  const int64_t cols = std::min<int64_t>(kOutBlock, item.cols - q * kOutBlock);
                  const float* block_t = &bt[q * r * kOutBlock];
                  for (int64_t t = 0; t < count; ++t) y_rows[t] = ys + rows[i + t] * ldy + item.start + q * kOutBlock;
                  if (count == kRowsAtOnce) {
                    expand_rows<kRowsAtOnce>(block_t, s, w, r, cols, y_rows);
                  } else {
                    for (int64_t t = 0; t < count; ++t) expand_rows<1>(block_t, s + t * w, w, r, cols, y_rows + t);
                  }
                }
              }
            }
          }
        });
  }
}

// y [T, out] (updated in place and returned), x [T, in], lora_a [slots, W, in] and lora_b [out, slots, W] float32,
// token_slots [T] int64 (-1: the base model); slice i of the output (slice_offsets[i], slice_sizes[i]) takes B's
// columns i * R .. (i + 1) * R with R = W / slices (B is zero elsewhere in those rows; rows in no slice get nothing).
torch::Tensor add_lora(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b,
                       torch::Tensor token_slots, std::vector<int64_t> slice_offsets, std::vector<int64_t> slice_sizes) {
  TORCH_CHECK(y.dim() == 2 && x.dim() == 2 && y.size(0) == x.size(0), "add_lora: y [T, out] and x [T, in]");
  TORCH_CHECK(y.stride(1) == 1 && x.stride(1) == 1, "add_lora: rows of y and x must be contiguous");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "add_lora: x and y in one dtype");
  TORCH_CHECK(lora_a.scalar_type() == at::kFloat && lora_b.scalar_type() == at::kFloat, "add_lora: float32 adapters");
  TORCH_CHECK(lora_a.is_contiguous() && lora_b.is_contiguous(), "add_lora: contiguous adapter weights");
  TORCH_CHECK(lora_a.dim() == 3 && lora_a.size(2) == x.size(1), "add_lora: lora_a [slots, W, in]");
  TORCH_CHECK(lora_b.dim() == 3 && lora_b.size(0) == y.size(1) && lora_b.size(1) == lora_a.size(0) &&
                  lora_b.size(2) == lora_a.size(1),
              "add_lora: lora_b [out, slots, W]");
  TORCH_CHECK(!slice_offsets.empty() && slice_offsets.size() == slice_sizes.size() &&
                  lora_a.size(1) % static_cast<int64_t>(slice_offsets.size()) == 0,
              "add_lora: one (offset, size) per slice, W a multiple of the slices");
  for (size_t i = 0; i < slice_offsets.size(); ++i)
    TORCH_CHECK(slice_offsets[i] >= 0 && slice_sizes[i] >= 0 && slice_offsets[i] + slice_sizes[i] <= y.size(1),
                "add_lora: slice ", i, " outside the output");
  auto slots = token_slots.to(at::kLong).contiguous();
  TORCH_CHECK(slots.numel() == y.size(0), "add_lora: one slot per token");
  const int64_t* s = slots.data_ptr<int64_t>();
  std::vector<int64_t> rows, row_slots;  // the LoRA tokens, grouped by slot (counting sort, token order kept)
  std::vector<int64_t> counts(lora_a.size(0) + 1, 0);
  for (int64_t t = 0; t < slots.numel(); ++t) {
    if (s[t] < 0) continue;
    TORCH_CHECK(s[t] < lora_a.size(0), "add_lora: slot ", s[t], " beyond the adapters' slots");
    ++counts[s[t] + 1];
  }
  for (size_t slot = 1; slot < counts.size(); ++slot) counts[slot] += counts[slot - 1];
  rows.resize(counts.back());
  row_slots.resize(counts.back());
  for (int64_t t = 0; t < slots.numel(); ++t) {
    if (s[t] < 0) continue;
    const int64_t place = counts[s[t]]++;
    rows[place] = t;
    row_slots[place] = s[t];
  }
  if (rows.empty()) return y;
  DISPATCH_ACTIVATION_TYPES(y.scalar_type(), "add_lora", [&] {
    add_lora_impl<scalar_t>(y, x, lora_a, lora_b, rows, row_slots, slice_offsets, slice_sizes);
  });
  return y;
}

}  // namespace

#ifndef ENGINE_KERNELS_NO_MODULE  // the decode graph (decode_graph.cpp) compiles this file in, bindings left out
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_lora", &add_lora, "y[t] += B_s A_s x[t] for each token t of adapter slot s, in place (CPU)");
}
#endif
