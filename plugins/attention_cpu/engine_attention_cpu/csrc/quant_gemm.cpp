// Products on quantized weights kept packed (GGUF Q4_0 / Q4_1 / Q8_0 blocks, weight-only int8 per channel).
//
// `linear`: the activations are quantized per block of 32 to int8 (a float scale per block), then each output is
// a sum of integer block dot products scaled by both blocks' scales, as llama.cpp computes them. Variants:
//   scalar      portable C++ (any CPU; the exact integer arithmetic the others are tested against)
//   avx2        AVX2 + FMA + F16C: vpmaddubsw / vpmaddwd on 32 weights at a time
//   avx512vnni  the same with vpdpbusd, a pair of groups of 8 weight rows at a time in 512-bit vectors
//               (quant_kernel.inc's x16_tile)
// chosen at run time (and by measurement, in Python) among those the CPU has. The threads of a spin pool
// (spin_pool.h: no wake-up per call within a decode step) split the output columns; a row's result does not
// depend on the other rows.
// `dequantized_linear`: the float32 GEMM's tile on the weight de-quantized one 16-row panel at a time, for products
// with many rows, where it is faster than the integer dot; `dequantize`: the plain float32 weight (tests).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "spin_pool.h"

#ifdef ENGINE_KERNELS_NO_MODULE
#include "gemm.cpp"  // namespace engine_cpu (already compiled in where this file is, then skipped: pragma once)
#else
#define ENGINE_KERNELS_NO_MODULE  // the GEMM without its bindings
#include "gemm.cpp"
#undef ENGINE_KERNELS_NO_MODULE
#endif

namespace engine_quant {

enum Format : int { kQ4_0 = 0, kQ4_1 = 1, kQ8_0 = 2, kI8 = 3 };
enum Variant : int { kScalar = 0, kAvx2 = 1, kAvx512Vnni = 2 };
constexpr int64_t kBlock = 32;

int64_t block_bytes(int format) {
  switch (format) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    default: return 32;
  }
}

struct QuantArgs {
  int format;
  const uint8_t* weight;
  int64_t row_bytes, nb;  // bytes per weight row, blocks per row
  const float* scales;    // per output row (int8), else null
  const int8_t* xq;       // [rows][nb * 32]
  const float* xd;        // [rows][nb]
  const float* xs;        // [rows][nb]: xd * sum of the block's xq
  int64_t rows, ldq;
  float* out;
  int64_t ldo;
};

// One 32-bit word of a row's xq (four of its int8 values) in each of a 256-bit vector's 8 lanes.
struct alignas(32) BroadcastWord {
  int32_t lanes[8];
};

// A product on an interleaved layout (interleave()): [groups][nb][x8 block bytes], groups of 8 weight rows, or
// [pairs][nb][pair block bytes], pairs of groups side by side (`paired`).
struct X8Args {
  int format;
  const uint8_t* weight;
  int64_t nb;             // blocks per row
  const float* scales;    // int8: per output row, padded to whole units (groups or pairs); else null
  const int8_t* xq;       // [rows][nb * 32]
  const float* xd;        // [rows][nb]
  const float* xs;        // [rows][nb]: xd * sum of the block's xq
  int64_t rows, ldq;
  float* out;
  int64_t ldo, n;         // n: the output columns kept (the last unit's padding rows are not written)
  const BroadcastWord* x_words;  // one row: its nb * 8 words of xq, each broadcast (QuantizedRows::broadcast_words)
  bool paired;
};

static inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

namespace scalar {
static void run_columns(const QuantArgs& q, int64_t begin, int64_t end) {
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* w = q.weight + n * q.row_bytes;
    const float scale = q.scales ? q.scales[n] : 1.f;
    for (int64_t r = 0; r < q.rows; ++r) {
      const int8_t* x = q.xq + r * q.ldq;
      float total = 0.f;
      for (int64_t b = 0; b < q.nb; ++b) {
        int32_t dot = 0;
        float d = 1.f, m = 0.f;
        const int8_t* xb = x + b * kBlock;
        if (q.format == kQ4_0 || q.format == kQ4_1) {
          const uint8_t* blk = w + b * block_bytes(q.format);
          d = half_to_float(blk);
          const uint8_t* qs = blk + (q.format == kQ4_1 ? 4 : 2);
          if (q.format == kQ4_1) m = half_to_float(blk + 2);
          for (int j = 0; j < 16; ++j) dot += (qs[j] & 0x0F) * xb[j] + (qs[j] >> 4) * xb[j + 16];
        } else {
          const uint8_t* blk = w + b * block_bytes(q.format);
          if (q.format == kQ8_0) d = half_to_float(blk);
          const int8_t* qs = reinterpret_cast<const int8_t*>(q.format == kQ8_0 ? blk + 2 : blk);
          for (int j = 0; j < 32; ++j) dot += qs[j] * xb[j];
        }
        const float xd = q.xd[r * q.nb + b], xs = q.xs[r * q.nb + b];
        total += d * xd * static_cast<float>(dot);
        if (q.format == kQ4_0) total -= 8.f * d * xs;
        if (q.format == kQ4_1) total += m * xs;
      }
      q.out[r * q.ldo + n] = total * scale;
    }
  }
}
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
static inline __m256i dot_u8s8(__m256i a, __m256i b) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}
static inline __m256i dot_u8s8_acc(__m256i acc, __m256i a, __m256i b) { return _mm256_add_epi32(acc, dot_u8s8(a, b)); }
// Q4 sums kept as 16 pairs of int16 until the block ends (8 products of 4-bit by 8-bit pairs: at most 30480)
static inline __m256i q4_dot_acc(__m256i acc, __m256i a, __m256i b) {
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(a, b));
}
static inline __m256i q4_dot_finish(__m256i acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
#include "quant_kernel.inc"
}  // namespace avx2
#pragma GCC pop_options

#ifdef ENGINE_EMULATE_AVX512
// The build for tests on CPUs without AVX-512 VNNI (setup.py's *_emulated modules): the AVX-512 instructions come
// from SIMDe (exact, slow), the AVX2 ones stay native, so the variant's own code runs where CI runs.
}  // namespace engine_quant
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
namespace engine_quant {
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")
#endif
namespace avx512vnni {
static inline __m256i dot_u8s8(__m256i a, __m256i b) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), a, b);
}
static inline __m256i dot_u8s8_acc(__m256i acc, __m256i a, __m256i b) { return _mm256_dpbusd_epi32(acc, a, b); }
static inline __m256i q4_dot_acc(__m256i acc, __m256i a, __m256i b) { return _mm256_dpbusd_epi32(acc, a, b); }
static inline __m256i q4_dot_finish(__m256i acc) { return acc; }
#define ENGINE_QUANT_ZMM  // a pair of groups at a time in 512-bit vectors (x16_tile)
#include "quant_kernel.inc"
#undef ENGINE_QUANT_ZMM
}  // namespace avx512vnni
#ifndef ENGINE_EMULATE_AVX512
#pragma GCC pop_options
#endif

bool cpu_has(int variant) {
  __builtin_cpu_init();
  switch (variant) {
    case kScalar: return true;
    case kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case kAvx512Vnni:
#ifdef ENGINE_EMULATE_AVX512
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");  // only the VNNI dot is emulated
#endif
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vnni");
    default: return false;
  }
}

#ifdef ENGINE_AVX2
// The largest magnitude of one whole block of 32 (|x| first: a NaN lane leaves the running maximum, as
// std::max(amax, NaN) does).
inline float block_amax_avx2(const float* x) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

// q[j] = x[j] * id rounded half away from zero for one whole block of 32, as std::round does (the truncation and
// the fraction v - trunc(v) are exact; a fraction of at least one half moves the value one away from zero): the
// scalar loop's bits. Returns the sum of the integers.
inline int32_t round_block_avx2(const float* x, float id, int8_t* q) {
  const __m256 sign = _mm256_set1_ps(-0.f), vid = _mm256_set1_ps(id), half = _mm256_set1_ps(0.5f);
  const __m256 one = _mm256_set1_ps(1.f);
  __m256i sum = _mm256_setzero_si256();
  alignas(32) int32_t ints[kBlock];
  for (int i = 0; i < 4; ++i) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), vid);
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(v, t)), half, _CMP_GE_OQ);
    const __m256 away = _mm256_and_ps(up, _mm256_or_ps(_mm256_and_ps(v, sign), one));  // +-1 where it rounds away
    const __m256i n = _mm256_cvttps_epi32(_mm256_add_ps(t, away));
    _mm256_store_si256(reinterpret_cast<__m256i*>(ints + 8 * i), n);
    sum = _mm256_add_epi32(sum, n);
  }
  for (int j = 0; j < kBlock; ++j) q[j] = static_cast<int8_t>(ints[j]);
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}
#endif

// A block's scale d = amax / 127 and its inverse (0 for an all-zero block).
inline float block_scale(float amax, float& id) {
  const float d = amax / 127.f;
  id = d > 0.f ? 1.f / d : 0.f;
  return d;
}

// x [rows, K] -> int8 blocks (zero-padded to nb * 32), a scale per block and scale * sum per block.
// Rounds half away from zero (C's roundf), as llama.cpp and engine.quantization.formats do.
void quantize_rows(const float* x, int64_t rows, int64_t k, int64_t nb, int8_t* xq, float* xd, float* xs) {
  engine_pool::parallel_range(rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * k;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t start = b * kBlock, stop = std::min(k, start + kBlock);
#ifdef ENGINE_AVX2
        if (stop - start == kBlock) {  // a whole block (every block of a GGUF width)
          float id = 0.f;
          const float d = block_scale(block_amax_avx2(row + start), id);
          const int32_t sum = round_block_avx2(row + start, id, xq + r * nb * kBlock + start);
          xd[r * nb + b] = d;
          xs[r * nb + b] = d * static_cast<float>(sum);
          continue;
        }
#endif
        float amax = 0.f;
        for (int64_t j = start; j < stop; ++j) amax = std::max(amax, std::fabs(row[j]));
        float id = 0.f;
        const float d = block_scale(amax, id);
        int32_t sum = 0;
        int8_t* q = xq + r * nb * kBlock + start;
        for (int64_t j = start; j < start + kBlock; ++j) {
          const int v = j < stop ? static_cast<int>(std::round(row[j] * id)) : 0;
          q[j - start] = static_cast<int8_t>(v);
          sum += v;
        }
        xd[r * nb + b] = d;
        xs[r * nb + b] = d * static_cast<float>(sum);
      }
    }
  });
}

void check_weight(const torch::Tensor& data, const c10::optional<torch::Tensor>& scales, int64_t format,
                  int64_t k) {
  TORCH_CHECK(format >= kQ4_0 && format <= kI8, "unknown quantized format ", format);
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous() && data.dim() == 2, "weight data: contiguous 2-D CPU");
  TORCH_CHECK(data.element_size() == 1, "weight data: one byte per element");
  const int64_t nb = (k + kBlock - 1) / kBlock;
  TORCH_CHECK(format == kI8 || k % kBlock == 0, "in_features must be a multiple of 32 for GGUF blocks");
  TORCH_CHECK(data.size(1) == nb * block_bytes(static_cast<int>(format)), "weight rows hold ", data.size(1),
              " bytes, expected ", nb * block_bytes(static_cast<int>(format)));
  if (format == kI8) {
    TORCH_CHECK(scales.has_value() && scales->scalar_type() == torch::kFloat32 && scales->is_contiguous() &&
                    scales->numel() == data.size(0), "int8 weights need float32 scales, one per row");
  }
}

// A group's block in the interleaved layout (quant_kernel.inc): 8 rows' scales (and Q4_1's minimums), then their
// quants; a pair's block in the paired layout is twice as long.
int64_t x8_block_bytes(int format) {
  switch (format) {
    case kQ4_0: return 144;
    case kQ4_1: return 160;
    case kQ8_0: return 272;
    default: return 256;
  }
}

// The weight's rows [N, nb * block bytes] (int8: with scales [N]) in the interleaved layout that the SIMD variants
// read (quant_kernel.inc): [ceil(N / 8)][nb][x8 block bytes], or `paired`, [ceil(N / 16)][nb][2 x8 block bytes];
// rows past N zero; int8's scales padded to whole units.
std::tuple<torch::Tensor, c10::optional<torch::Tensor>> interleave(torch::Tensor data,
                                                                    c10::optional<torch::Tensor> scales,
                                                                    int64_t format, int64_t in_features, bool paired) {
  check_weight(data, scales, format, in_features);
  const int64_t per_unit = paired ? 16 : 8;  // weight rows
  const int64_t n = data.size(0), nb = (in_features + kBlock - 1) / kBlock, units = (n + per_unit - 1) / per_unit;
  const int64_t bytes = block_bytes(static_cast<int>(format));
  const int64_t ub = x8_block_bytes(static_cast<int>(format)) * (paired ? 2 : 1);
  torch::Tensor out = torch::zeros({units, nb, ub}, data.options().dtype(torch::kUInt8));
  const uint8_t* src = static_cast<const uint8_t*>(data.data_ptr());
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t head = format == kQ4_1 ? 4 : format == kI8 ? 0 : 2;  // bytes before a block's quants
  // a unit's scales d (2 bytes a row), Q4_1's minimums m after them, then its vectors (32 bytes a group)
  const int64_t unit_head = (format == kQ4_1 ? 32 : format == kI8 ? 0 : 16) * (paired ? 2 : 1);
  const int64_t m_at = per_unit * 2, vector_bytes = paired ? 64 : 32;
  const int64_t words = (format == kQ4_0 || format == kQ4_1) ? 4 : 8;
  at::parallel_for(0, units, 8, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* o = dst + (u * nb + b) * ub;
        for (int64_t c = 0; c < per_unit && u * per_unit + c < n; ++c) {  // row c: group c / 8, its row c % 8
          const uint8_t* blk = src + (u * per_unit + c) * data.size(1) + b * bytes;
          const int64_t group = c / 8, row = c % 8;
          if (format != kI8) std::memcpy(o + 2 * c, blk, 2);              // d
          if (format == kQ4_1) std::memcpy(o + m_at + 2 * c, blk + 2, 2);  // m
          for (int64_t t = 0; t < words; ++t)
            std::memcpy(o + unit_head + vector_bytes * t + 32 * group + 4 * row, blk + head + 4 * t, 4);
        }
      }
  });
  c10::optional<torch::Tensor> padded;
  if (format == kI8) {
    padded = torch::zeros({units * per_unit}, scales->options());
    padded->narrow(0, 0, n).copy_(*scales);
  }
  return {out, padded};
}

// The activations' blocks, reused by the calling thread: no allocation per call.
struct QuantizedRows {
  std::vector<int8_t> xq;
  std::vector<float> xd, xs;
  std::vector<BroadcastWord> words;
  void fill(const float* x, int64_t rows, int64_t k, int64_t nb) {
    xq.resize(rows * nb * kBlock);
    xd.resize(rows * nb);
    xs.resize(rows * nb);
    quantize_rows(x, rows, k, nb, xq.data(), xd.data(), xs.data());
  }
  // The first row's 32-bit words of xq, each repeated in the 8 lanes of a 256-bit vector: the one-row interleaved
  // tiles load them instead of broadcasting every word once per weight group.
  const BroadcastWord* broadcast_words(int64_t nb) {
    words.resize(nb * 8);
    for (int64_t i = 0; i < nb * 8; ++i) {
      int32_t word;
      std::memcpy(&word, xq.data() + 4 * i, 4);
      std::fill(std::begin(words[i].lanes), std::end(words[i].lanes), word);
    }
    return words.data();
  }
};

// data: a weight's rows of blocks [N, row bytes] (any variant), or an interleaved layout [groups, nb, x8 block bytes]
// or [pairs, nb, 2 x8 block bytes] (SIMD variants; avx512vnni the paired one; out's width says N).
void linear(torch::Tensor out, torch::Tensor x, torch::Tensor data, c10::optional<torch::Tensor> scales,
            int64_t format, int64_t variant, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x: contiguous float32 2-D");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.dim() == 2, "out: contiguous float32");
  const int64_t rows = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(cpu_has(static_cast<int>(variant)), "this CPU lacks the instructions of variant ", variant);
  const int64_t nb = (k + kBlock - 1) / kBlock;
  TORCH_CHECK(out.size(0) == rows, "out must be [rows, out_features]");
  thread_local QuantizedRows act;
  if (data.dim() == 3) {
    TORCH_CHECK(format >= kQ4_0 && format <= kI8, "unknown quantized format ", format);
    TORCH_CHECK(variant != kScalar, "the scalar variant reads the rows of blocks, not the interleaved layout");
    TORCH_CHECK(data.device().is_cpu() && data.is_contiguous() && data.scalar_type() == torch::kUInt8,
                "interleaved weight: contiguous uint8 on the CPU");
    TORCH_CHECK(format == kI8 || k % kBlock == 0, "in_features must be a multiple of 32 for GGUF blocks");
    const int64_t xb = x8_block_bytes(static_cast<int>(format));
    const bool paired = data.size(2) == 2 * xb;  // (no format's pair block is another's group block)
    const int64_t per_unit = paired ? 16 : 8;
    TORCH_CHECK(data.size(1) == nb && (data.size(2) == xb || paired) && data.size(0) == (n + per_unit - 1) / per_unit,
                "interleaved weight must be [ceil(N / 8), nb, ", xb, "] or, paired, [ceil(N / 16), nb, ", 2 * xb,
                "] for N = ", n);
    TORCH_CHECK(paired || variant != kAvx512Vnni, "the avx512vnni variant reads the paired interleaved layout");
    if (format == kI8)
      TORCH_CHECK(scales.has_value() && scales->scalar_type() == torch::kFloat32 && scales->is_contiguous() &&
                      scales->numel() == data.size(0) * per_unit,
                  "interleaved int8 weights need float32 scales padded to whole units");
    act.fill(x.data_ptr<float>(), rows, k, nb);
    X8Args q{static_cast<int>(format), data.data_ptr<uint8_t>(), nb,
             format == kI8 ? scales->data_ptr<float>() : nullptr, act.xq.data(), act.xd.data(), act.xs.data(), rows,
             nb * kBlock, out.data_ptr<float>(), n, n,
             rows == 1 && variant != kAvx512Vnni ? act.broadcast_words(nb) : nullptr,  // (AVX2's one-row tiles)
             paired};
    engine_pool::parallel_stream(data.size(0), 64 / per_unit, [&](int64_t begin, int64_t end, int64_t stream_end,
                                                                 bool continued) {
      if (variant == kAvx512Vnni) avx512vnni::run_groups(q, begin, end, stream_end, continued);
      else avx2::run_groups(q, begin, end, stream_end, continued);
    }, paired ? 1 : 2);  // the groups' layout in whole pairs of groups a thread, as it was measured
  } else {
    check_weight(data, scales, format, k);
    TORCH_CHECK(data.size(0) == n, "out must be [rows, out_features]");
    act.fill(x.data_ptr<float>(), rows, k, nb);
    QuantArgs q{static_cast<int>(format), static_cast<const uint8_t*>(data.data_ptr()), data.size(1), nb,
                scales.has_value() ? scales->data_ptr<float>() : nullptr, act.xq.data(), act.xd.data(), act.xs.data(),
                rows, nb * kBlock, out.data_ptr<float>(), n};
    // output columns split between the spin pool's threads, whole 4-column tiles each
    engine_pool::parallel_range(n, 64, [&](int64_t begin, int64_t end) {
      if (variant == kAvx512Vnni) avx512vnni::run_columns(q, begin, end);
      else if (variant == kAvx2) avx2::run_columns(q, begin, end);
      else scalar::run_columns(q, begin, end);
    }, 4);
  }
  if (bias.has_value()) out.add_(*bias);
}

// x [..., K] of any float dtype -> x @ W.T (+ bias) [..., N] in x's dtype: the whole call in C++, for the
// products of a decode step, where Python-side reshapes and allocations would cost as much as the product.
torch::Tensor forward(torch::Tensor x, torch::Tensor data, c10::optional<torch::Tensor> scales, int64_t format,
                      int64_t variant, c10::optional<torch::Tensor> bias, int64_t out_features) {
  const int64_t k = x.size(-1);
  torch::Tensor rows = x.reshape({-1, k});
  if (rows.scalar_type() != torch::kFloat32) rows = rows.to(torch::kFloat32);
  rows = rows.contiguous();
  torch::Tensor out = at::empty({rows.size(0), out_features}, rows.options());
  linear(out, rows, data, scales, format, variant, bias);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features;
  out = out.view(shape);
  return x.scalar_type() == torch::kFloat32 ? out : out.to(x.scalar_type());
}

// weight row n, element j, de-quantized
static inline void dequantize_row(const uint8_t* w, int format, int64_t k, float scale, float* out, int64_t stride) {
  const int64_t nb = (k + kBlock - 1) / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * block_bytes(format);
    float* o = out + b * kBlock * stride;
    if (format == kQ4_0 || format == kQ4_1) {
      const float d = half_to_float(blk), m = format == kQ4_1 ? half_to_float(blk + 2) : -8.f * d;
      const uint8_t* qs = blk + (format == kQ4_1 ? 4 : 2);
      for (int j = 0; j < 16; ++j) {
        o[j * stride] = d * static_cast<float>(qs[j] & 0x0F) + m;
        o[(j + 16) * stride] = d * static_cast<float>(qs[j] >> 4) + m;
      }
    } else {
      const float d = format == kQ8_0 ? half_to_float(blk) : scale;
      const int8_t* qs = reinterpret_cast<const int8_t*>(format == kQ8_0 ? blk + 2 : blk);
      const int64_t count = std::min(kBlock, k - b * kBlock);
      for (int64_t j = 0; j < count; ++j) o[j * stride] = d * static_cast<float>(qs[j]);
    }
  }
}

// out [N, K] float32
void dequantize(torch::Tensor out, torch::Tensor data, c10::optional<torch::Tensor> scales, int64_t format) {
  const int64_t n = out.size(0), k = out.size(1);
  check_weight(data, scales, format, k);
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && data.size(0) == n, "out: [N, K] float32");
  const float* s = scales.has_value() ? scales->data_ptr<float>() : nullptr;
  const uint8_t* w = static_cast<const uint8_t*>(data.data_ptr());
  float* o = out.data_ptr<float>();
  const int64_t row_bytes = data.size(1);
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> row(((k + kBlock - 1) / kBlock) * kBlock);
    for (int64_t r = begin; r < end; ++r) {
      dequantize_row(w + r * row_bytes, static_cast<int>(format), k, s ? s[r] : 1.f, row.data(), 1);
      std::memcpy(o + r * k, row.data(), k * sizeof(float));
    }
  });
}

// ids [T] int64 -> out [T, K] float32: rows `ids` of W, de-quantized (an embedding's lookup of a quantized table;
// the bits of dequantize's rows). Serial: a decode step looks up a few rows.
torch::Tensor dequantize_rows(torch::Tensor data, c10::optional<torch::Tensor> scales, int64_t format,
                              int64_t in_features, torch::Tensor ids) {
  check_weight(data, scales, format, in_features);
  TORCH_CHECK(ids.scalar_type() == torch::kInt64 && ids.dim() == 1, "ids: int64 [T]");
  const torch::Tensor index = ids.contiguous();
  const int64_t t = index.size(0), n = data.size(0), k = in_features, row_bytes = data.size(1);
  const int64_t* id = index.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK_INDEX(id[i] >= 0 && id[i] < n, "token id ", id[i], " is out of the table's ", n, " rows");
  torch::Tensor out = at::empty({t, k}, torch::kFloat32);
  const float* s = scales.has_value() ? scales->data_ptr<float>() : nullptr;
  const uint8_t* w = static_cast<const uint8_t*>(data.data_ptr());
  float* o = out.data_ptr<float>();
  std::vector<float> row(((k + kBlock - 1) / kBlock) * kBlock);
  for (int64_t i = 0; i < t; ++i) {
    dequantize_row(w + id[i] * row_bytes, static_cast<int>(format), k, s ? s[id[i]] : 1.f, row.data(), 1);
    std::memcpy(o + i * k, row.data(), k * sizeof(float));
  }
  return out;
}

#ifdef ENGINE_AVX2
// r[0..8) (8 floats each) transposed in place
static inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)), s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)), s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)), s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)), s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20), r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20), r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31), r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31), r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// One whole block of 32 weights de-quantized into v[0..4) (weights 0-7, 8-15, 16-23, 24-31), rounded as
// dequantize_row rounds them (a product, then a sum: no fused multiply-add).
static inline void dequantize_block(const uint8_t* blk, int format, float scale, __m256* v) {
  if (format == kQ4_0 || format == kQ4_1) {
    const float d = half_to_float(blk), m = format == kQ4_1 ? half_to_float(blk + 2) : -8.f * d;
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (format == kQ4_1 ? 4 : 2)));
    const __m128i low = _mm_and_si128(bytes, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0x0F));
    const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
    const __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_add_ps(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]))), mv);
  } else {
    const __m256 dv = _mm256_set1_ps(format == kQ8_0 ? half_to_float(blk) : scale);
    const uint8_t* qs = format == kQ8_0 ? blk + 2 : blk;
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                   _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i)))));
  }
}

// Weight rows [16q, 16q + 16) as the GEMM's panel [K][16] (rows past n zero): 8 rows of a block at a time,
// transposed in registers. The same values as dequantize_row.
static void dequantize_panel(float* panel, const uint8_t* w, int64_t row_bytes, int format, int64_t k, int64_t n,
                             const float* scales, int64_t q) {
  const int64_t whole = k / kBlock, bytes = block_bytes(format), rows = std::min<int64_t>(16, n - q * 16);
  for (int64_t b = 0; b < whole; ++b)
    for (int64_t half = 0; half < 2; ++half) {
      __m256 v[4][8];
      for (int64_t r = 0; r < 8; ++r) {
        const int64_t row = q * 16 + half * 8 + r;
        __m256 block[4];
        if (half * 8 + r < rows) {
          dequantize_block(w + row * row_bytes + b * bytes, format, scales ? scales[row] : 1.f, block);
        } else {
          block[0] = block[1] = block[2] = block[3] = _mm256_setzero_ps();
        }
        for (int g = 0; g < 4; ++g) v[g][r] = block[g];
      }
      for (int g = 0; g < 4; ++g) {
        transpose8(v[g]);
        for (int j = 0; j < 8; ++j) _mm256_storeu_ps(panel + (b * kBlock + g * 8 + j) * 16 + half * 8, v[g][j]);
      }
    }
  for (int64_t j = whole * kBlock; j < k; ++j)  // int8 rows that are not whole blocks: the ragged tail
    for (int64_t c = 0; c < 16; ++c) {
      const int64_t row = q * 16 + c;
      const int8_t* qs = reinterpret_cast<const int8_t*>(w + row * row_bytes);
      panel[j * 16 + c] = c < rows ? scales[row] * static_cast<float>(qs[j]) : 0.f;
    }
}
#endif

// out [M, N] = x @ W.T + bias for products with many rows: each 16-row panel of W de-quantized into the calling
// thread's buffer (it stays in L2) and multiplied by every row of x at once by the float32 GEMM's tile; nothing
// the size of W is written. The same bits as the whole weight de-quantized, then engine_cpu::linear.
void dequantized_linear(torch::Tensor out, torch::Tensor x, torch::Tensor data, c10::optional<torch::Tensor> scales,
                        int64_t format, c10::optional<torch::Tensor> bias) {
#ifdef ENGINE_AVX2
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1, "x: float32 rows, unit stride");
  TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous(), "out: contiguous float32");
  const int64_t m = x.size(0), k = x.size(1), n = data.size(0), panels = (n + 15) / 16;
  check_weight(data, scales, format, k);
  TORCH_CHECK(out.size(0) == m && out.size(1) == n, "out must be [rows, out_features]");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() && bias->numel() == panels * 16,
                "bias must be float32, padded to the panels");
    bias_ptr = bias->data_ptr<float>();
  }
  if (m == 0 || n == 0) return;
  const uint8_t* w = static_cast<const uint8_t*>(data.data_ptr());
  const float* s = scales.has_value() ? scales->data_ptr<float>() : nullptr;
  const int64_t row_bytes = data.size(1);
  auto panel_of = [&](int64_t q) -> const float* {
    thread_local std::vector<float> buffer;  // one panel per thread, reused
    if (buffer.size() < static_cast<size_t>(k * 16)) buffer.resize(k * 16);
    dequantize_panel(buffer.data(), w, row_bytes, static_cast<int>(format), k, n, s, q);
    return buffer.data();
  };
  engine_cpu::linear_panels(out.data_ptr<float>(), n, x.data_ptr<float>(), x.stride(0), m, k, panels, bias_ptr,
                            panel_of, /*whole_rows=*/true);
#else
  TORCH_CHECK(false, "the de-quantizing GEMM needs AVX2 + FMA (built without them)");
#endif
}

// x [..., K] of any float dtype -> x @ W.T (+ bias padded to the panels) [..., N] in x's dtype, in one call.
torch::Tensor dequantized_forward(torch::Tensor x, torch::Tensor data, c10::optional<torch::Tensor> scales,
                                  int64_t format, c10::optional<torch::Tensor> bias, int64_t out_features) {
  const int64_t k = x.size(-1);
  torch::Tensor rows = x.reshape({-1, k});
  if (rows.scalar_type() != torch::kFloat32) rows = rows.to(torch::kFloat32);
  if (rows.stride(-1) != 1) rows = rows.contiguous();
  torch::Tensor out = at::empty({rows.size(0), out_features}, rows.options());
  dequantized_linear(out, rows, data, scales, format, bias);
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features;
  out = out.view(shape);
  return x.scalar_type() == torch::kFloat32 ? out : out.to(x.scalar_type());
}

std::vector<std::tuple<std::string, bool>> variants() {
  return {{"scalar", cpu_has(kScalar)}, {"avx2", cpu_has(kAvx2)}, {"avx512vnni", cpu_has(kAvx512Vnni)}};
}

}  // namespace engine_quant

#ifndef ENGINE_KERNELS_NO_MODULE  // the decode graph (decode_graph.cpp) compiles this file in, bindings left out
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("variants", &engine_quant::variants, "[(variant, whether this CPU runs it)] in variant-id order");
  m.def("linear", &engine_quant::linear, "out = x @ W.T (+ bias), W quantized (format id, variant id)",
        py::arg("out"), py::arg("x"), py::arg("data"), py::arg("scales"), py::arg("format"), py::arg("variant"),
        py::arg("bias"));
  m.def("forward", &engine_quant::forward, "x [..., K] -> x @ W.T (+ bias) [..., N] in x's dtype",
        py::arg("x"), py::arg("data"), py::arg("scales"), py::arg("format"), py::arg("variant"), py::arg("bias"),
        py::arg("out_features"), py::call_guard<py::gil_scoped_release>());
  m.def("dequantize", &engine_quant::dequantize, "out [N, K] float32 = W");
  m.def("dequantize_rows", &engine_quant::dequantize_rows, "ids [T] -> rows ids of W, de-quantized: [T, K] float32",
        py::arg("data"), py::arg("scales"), py::arg("format"), py::arg("in_features"), py::arg("ids"));
  m.def("interleave", &engine_quant::interleave,
        "(rows of blocks, int8 scales, format, in_features, paired) -> (the interleaved layout, int8 scales padded to "
        "whole units)",
        py::arg("data"), py::arg("scales"), py::arg("format"), py::arg("in_features"), py::arg("paired"));
  m.def("dequantized_forward", &engine_quant::dequantized_forward,
        "x [..., K] -> x @ W.T (+ bias padded to 16) [..., N] in x's dtype, W de-quantized a panel at a time",
        py::arg("x"), py::arg("data"), py::arg("scales"), py::arg("format"), py::arg("bias"), py::arg("out_features"),
        py::call_guard<py::gil_scoped_release>());
}
#endif
