// 16 float32 lanes as each ISA variant holds them, for the kernels written once over them (attention_rows.inc,
// prefill_tiles.inc): two AVX2 registers, or one AVX-512 register. Each type has zero / load (from float32, bfloat16
// or float16) / set1 / fmadd / fold / sum / store, and the tile widths its register file affords:
//   kSliceVectors  16-lane accumulators per query head in one pass of the decode kernel over the value rows;
//   kTileVectors   16-lane accumulators per row of a prefill tile (kTileRows rows at once).
// Every variant computes a.b + c per lane with one fused multiply-add, so a kernel that runs the same chain per
// output element gives the same bits in every variant.
#pragma once

#include "vec_avx2.h"

#ifdef ENGINE_EMULATE_AVX512
// The build for tests on CPUs without AVX-512 (setup.py's *_emulated): the AVX-512 variant's instructions come from
// SIMDe (exact, slow), the AVX2 ones stay native.
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#endif

#ifdef ENGINE_AVX2
namespace engine_cpu::lanes_avx2 {
struct Lanes16 {
  struct V {
    __m256 lo, hi;
  };
  static constexpr int kSliceVectors = 2;
  static constexpr int kTileRows = 6;
  static constexpr int kTileVectors = 1;  // 6 rows x 2 registers, plus the loaded row and the broadcast: 15 of 16
  static V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  template <typename scalar_t>
  static V load(const scalar_t* p) { return {load8(p), load8(p + 8)}; }
  static V set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static V fmadd(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  static __m256 fold(V v) { return _mm256_add_ps(v.lo, v.hi); }  // lanes i + (i + 8): sum's first step
  static float sum(V v) { return horizontal_sum(fold(v)); }
  static void store(float* p, V v) {
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
  }
};
}  // namespace engine_cpu::lanes_avx2

#ifndef ENGINE_EMULATE_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f")
#endif
namespace engine_cpu::lanes_avx512 {
struct Lanes16 {
  using V = __m512;
  static constexpr int kSliceVectors = 4;
  static constexpr int kTileRows = 6;
  static constexpr int kTileVectors = 4;  // 6 rows x 4 registers, plus the loaded row and the broadcast: 29 of 32
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const c10::BFloat16* p) {  // bfloat16 is the top half of a float32
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static V load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static __m256 fold(V v) {  // lanes 0-7 plus lanes 8-15, as AVX2 adds its two registers
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return _mm256_add_ps(_mm512_castps512_ps256(v), hi);
  }
  static float sum(V v) { return horizontal_sum(fold(v)); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
};
}  // namespace engine_cpu::lanes_avx512
#ifndef ENGINE_EMULATE_AVX512
#pragma GCC pop_options
#endif
#endif  // ENGINE_AVX2
