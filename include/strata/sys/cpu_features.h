// The SIMD paths Strata's own CPU kernels (CpuAdam, the CPU backend's elementwise kernels) are
// built for, what this CPU supports (CPUID, read at run time, never from the build machine), and
// the one choice rule they share.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "strata/core/status.h"

namespace strata::sys {

enum class SimdPath : std::uint8_t { kScalar, kAvx2, kAvx512 };

std::string_view simd_path_name(SimdPath path);  // "scalar", "avx2", "avx512"
// Whether this CPU (CPUID) can run `path`: avx2 needs AVX2+FMA+F16C, avx512 needs F+BW+VL.
bool cpu_supports(SimdPath path);
// Whether this CPU converts f32 to bf16 natively (avx512_bf16).
bool cpu_supports_avx512_bf16();
// Whether this CPU has AMX tiles with bf16 products (AMX-TILE and AMX-BF16, CPUID leaf 7).
bool cpu_supports_amx_bf16();
// The widest path this CPU supports.
SimdPath widest_simd_path();

// `choice` is "auto", "scalar", "avx2" or "avx512". An explicit value wins; "auto" reads the
// environment variable STRATA_SIMD (same values) and otherwise takes the widest supported path.
// Errors name the source of the value (`what`, or STRATA_SIMD) and what the CPU lacks.
Result<SimdPath> resolve_simd_path(const std::string& choice, std::string_view what);

}  // namespace strata::sys
