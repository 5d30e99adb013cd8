// The ISA variants of the float kernels (the GEMM, the decode attention): each kernel is one source compiled once
// per variant, chosen at run time. ENGINE_EMULATE_AVX512 marks setup.py's *_emulated builds, where the AVX-512
// variant's instructions come from SIMDe (tests on CPUs without AVX-512).
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "vec_avx2.h"

namespace engine_cpu {

enum Variant : int64_t { kVariantAvx2 = 0, kVariantAvx512 = 1 };

// Whether this CPU runs a variant (in the SIMDe build, AVX-512 needs only AVX2: its instructions are emulated).
inline bool cpu_has_variant(int64_t variant) {
#ifdef ENGINE_AVX2
  __builtin_cpu_init();
  if (variant == kVariantAvx2) return true;
#ifdef ENGINE_EMULATE_AVX512
  if (variant == kVariantAvx512) return true;
#else
  if (variant == kVariantAvx512) return __builtin_cpu_supports("avx512f");
#endif
#endif
  return false;
}

// The variant a kernel runs unless told: the widest this CPU has natively (never an emulated one).
inline int64_t default_variant() {
#ifdef ENGINE_EMULATE_AVX512
  return kVariantAvx2;
#else
  static const int64_t widest = cpu_has_variant(kVariantAvx512) ? kVariantAvx512 : kVariantAvx2;
  return widest;
#endif
}

// (name, whether this CPU runs it) for each variant, in the order of their ids.
inline std::vector<std::tuple<std::string, bool>> variants() {
  return {{"avx2", cpu_has_variant(kVariantAvx2)}, {"avx512", cpu_has_variant(kVariantAvx512)}};
}

}  // namespace engine_cpu
