// AVX2 helpers shared by the CPU kernels: float32 lanes from float32 / bfloat16 / float16 memory,
// a horizontal sum, a vectorised exponential and an in-place softmax. ENGINE_AVX2 is defined when the compiler targets
// AVX2 + FMA + F16C (the kernels are built with -march=native); scalar loops cover other CPUs.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define ENGINE_AVX2 1
#endif

namespace engine_cpu {

template <typename scalar_t>
inline float as_float(scalar_t x) {
  return static_cast<float>(x);
}

// v rounded to the nearest scalar_t and back to float (the identity for float).
template <typename scalar_t>
inline float round_to(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
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
// Eight float32 lanes rounded to the nearest value of scalar_t (ties to even) and written there.
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline __m256i bfloat16_bits(__m256 v) {  // the rounded bfloat16 in the top half of each lane; NaN stays NaN
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(nan));
  return _mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
}
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i low = _mm256_srli_epi32(bfloat16_bits(v), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store8(c10::Half* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
// The float32 lanes rounded through scalar_t and back (the identity for float).
template <typename scalar_t>
inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) return _mm256_castsi256_ps(bfloat16_bits(v));
  else if constexpr (std::is_same_v<scalar_t, c10::Half>)
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  else return v;
}
inline float horizontal_sum(__m256 v) {
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
  return _mm_cvtss_f32(sum);
}

// out[r] = scale * horizontal_sum(v[r]) for 8 vectors at once, each summed in horizontal_sum's order (lanes i and
// i + 4, then lanes 0 + 2 and 1 + 3, then those two), so every row gets the bits the one-vector sum gives it: the
// eight reductions share their shuffles instead of running one dependent chain each.
inline void horizontal_sums8(const __m256* v, float scale, float* out) {
  __m256 halves[4];  // [row 2p's four sums | row 2p + 1's]
  for (int p = 0; p < 4; ++p)
    halves[p] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x20),
                              _mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x31));
  __m256 pairs[2];  // [row 4p's two sums, row 4p + 2's | row 4p + 1's, row 4p + 3's]
  for (int p = 0; p < 2; ++p)
    pairs[p] = _mm256_add_ps(_mm256_shuffle_ps(halves[2 * p], halves[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm256_shuffle_ps(halves[2 * p], halves[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(pairs[0], pairs[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // sums holds rows 0, 2, 4, 6 | 1, 3, 5, 7
  const __m256 rows = _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_ps(out, _mm256_mul_ps(rows, _mm256_set1_ps(scale)));
}

// e^x: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial (Cephes' expf coefficients),
// 2^n from the exponent bits. About 1 ulp from std::exp on [-87, 88]; x is clamped to that range.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // e^-87 ~ 1.6e-38: the smallest normal power stays exact
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));   // e^88 ~ 1.7e38: 2^n stays a finite float
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts: exact n * hi
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}
#endif

// In place: p[i] = exp(p[i] - peak) for i < n; returns their sum.
inline float exp_shifted(float* p, int64_t n, float peak) {
  float total = 0.f;
  int64_t i = 0;
#ifdef ENGINE_AVX2
  const __m256 shift = _mm256_set1_ps(peak);
  __m256 sums = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + i), shift));
    _mm256_storeu_ps(p + i, e);
    sums = _mm256_add_ps(sums, e);
  }
  total = horizontal_sum(sums);
#endif
  for (; i < n; ++i) {
    p[i] = std::exp(p[i] - peak);
    total += p[i];
  }
  return total;
}

// In place: p[i] = exp(p[i] - max(p)) for i < n, a softmax left unnormalised (attention over a part of a context,
// merged with the other parts' later); the maximum in *peak, returns the sum. The maximum is taken in eight lanes
// (exact in any order) into a local: the compiler cannot tell that peak is not in p, and a loop over *peak stored it
// at every element (half of the softmax's time in perf).
inline float exp_from_max(float* p, int64_t n, float* peak) {
  float highest = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef ENGINE_AVX2
  if (n >= 8) {
    __m256 lanes = _mm256_loadu_ps(p);
    for (i = 8; i + 8 <= n; i += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(p + i));
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    half = _mm_max_ss(half, _mm_movehdup_ps(half));
    highest = _mm_cvtss_f32(half);
  }
#endif
  for (; i < n; ++i) highest = std::max(highest, p[i]);
  *peak = highest;
  return exp_shifted(p, n, highest);
}

// In place: p = softmax(p[0:n]).
inline void softmax(float* p, int64_t n) {
  float peak;
  const float inv = 1.f / exp_from_max(p, n, &peak);
  for (int64_t j = 0; j < n; ++j) p[j] *= inv;
}

}  // namespace engine_cpu
