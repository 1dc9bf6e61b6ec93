// The elementwise kernel tables, one per SIMD path; the CPU device picks one when it is made
// (sys::resolve_simd_path: STRATA_SIMD, else the widest path CPUID allows).
#include "src/device/cpu/cpu_kernels.h"

#include "strata/core/check.h"
#include "strata/sys/cpu_features.h"

namespace strata::device::cpu {
namespace {

CpuKernels filled(void (*fill)(CpuKernels*)) {
  CpuKernels k{};
  fill(&k);
  return k;
}

}  // namespace

const CpuKernels& cpu_kernels_for(sys::SimdPath path) {
  STRATA_CHECK(sys::cpu_supports(path), "this CPU cannot run the", sys::simd_path_name(path),
               "kernels");
  // Each table is filled on first use only: a fill function is itself built for its path.
  switch (path) {
    case sys::SimdPath::kScalar: {
      static const CpuKernels scalar = filled(fill_scalar_cpu_kernels);
      return scalar;
    }
    case sys::SimdPath::kAvx2: {
      static const CpuKernels avx2 = filled(fill_avx2_cpu_kernels);
      return avx2;
    }
    case sys::SimdPath::kAvx512:
      break;
  }
  static const CpuKernels avx512 = filled(fill_avx512_cpu_kernels);
  return avx512;
}

}  // namespace strata::device::cpu
