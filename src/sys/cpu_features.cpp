// CPUID checks and the SIMD path choice shared by Strata's CPU kernels.
#include "strata/sys/cpu_features.h"

#include <cpuid.h>

#include <cstdlib>
#include <utility>

#include "strata/sys/environment.h"

namespace strata::sys {
namespace {

// CPUID leaf 1, ECX bit 29 (not every compiler's __builtin_cpu_supports knows "f16c").
bool cpu_has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}

}  // namespace

std::string_view simd_path_name(SimdPath path) {
  switch (path) {
    case SimdPath::kScalar:
      return "scalar";
    case SimdPath::kAvx2:
      return "avx2";
    case SimdPath::kAvx512:
      return "avx512";
  }
  return "?";
}

bool cpu_supports(SimdPath path) {
  __builtin_cpu_init();
  switch (path) {
    case SimdPath::kScalar:
      return true;
    case SimdPath::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && cpu_has_f16c();
    case SimdPath::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl");
  }
  return false;
}

bool cpu_supports_avx512_bf16() {
  __builtin_cpu_init();
  return cpu_supports(SimdPath::kAvx512) && __builtin_cpu_supports("avx512bf16");
}

bool cpu_supports_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
  constexpr unsigned kAmxBf16 = 1u << 22, kAmxTile = 1u << 24;  // leaf 7, subleaf 0, EDX
  return (d & kAmxBf16) != 0 && (d & kAmxTile) != 0;
}

SimdPath widest_simd_path() {
  if (cpu_supports(SimdPath::kAvx512)) return SimdPath::kAvx512;
  if (cpu_supports(SimdPath::kAvx2)) return SimdPath::kAvx2;
  return SimdPath::kScalar;
}

Result<SimdPath> resolve_simd_path(const std::string& choice_in, std::string_view what) {
  std::string choice = choice_in;
  std::string source(what);
  if (choice == "auto") {
    if (std::string env = knob(Knob::kSimd); !env.empty()) {
      choice = std::move(env);
      source = knob_name(Knob::kSimd);
    }
  }
  SimdPath path;
  if (choice == "auto") {
    return widest_simd_path();
  } else if (choice == "scalar") {
    path = SimdPath::kScalar;
  } else if (choice == "avx2") {
    path = SimdPath::kAvx2;
  } else if (choice == "avx512") {
    path = SimdPath::kAvx512;
  } else {
    return invalid_argument(source + " '" + choice +
                            "' is not a SIMD path; use auto, scalar, avx2 or avx512");
  }
  if (!cpu_supports(path)) {
    const char* needs = path == SimdPath::kAvx2 ? "AVX2, FMA and F16C" : "AVX-512 F, BW and VL";
    return unavailable(source + " asks for " + choice + ", but this CPU lacks " + needs +
                       "; use auto or a narrower path");
  }
  return path;
}

}  // namespace strata::sys
