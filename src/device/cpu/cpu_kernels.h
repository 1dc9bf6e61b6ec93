// The CPU backend's elementwise kernels (exp-based activations and softmax pieces, bf16
// conversions), compiled once per SIMD path from one source (cpu_kernels_impl.inc) and chosen at
// run time from CPUID (or STRATA_SIMD). Every path computes each element with the same IEEE
// operations in the same order (no FMA contraction, no fast-math, sums in a fixed number of
// lanes), so all paths give the same bits, whatever the vector width.
//
// This header is included by files compiled with -mavx2/-mavx512* flags, so it must define no
// inline functions or templates: a function emitted in such a file could be picked by the
// linker for every caller and crash CPUs without those instructions. Plain data only.
#pragma once

#include <cstdint>

namespace strata::sys {
enum class SimdPath : std::uint8_t;  // strata/sys/cpu_features.h, not included: it has inline code
}  // namespace strata::sys

namespace strata::device::cpu {

// Index of a kernel's storage dtype in the tables below.
enum KernelDType : std::uint8_t {
  kKernelF32 = 0,
  kKernelBF16 = 1,
  kKernelF16 = 2,
  kNumKernelDTypes = 3
};

// Index of an array's element type in the conversion and reduction tables below.
enum ArrayDType : std::uint8_t {
  kArrayF32 = 0,
  kArrayBF16 = 1,
  kArrayF16 = 2,
  kNumArrayDTypes = 3
};

// Trivial type: value-initialize it (`CpuKernels k{};`) before filling it.
struct CpuKernels {
  const char* name;
  // dst[i] = src[i] as float / rounded to bf16 (nearest, ties to even; NaN stays NaN).
  void (*bf16_to_f32)(const std::uint16_t* src, float* dst, std::int64_t n);
  void (*f32_to_bf16)(const float* src, std::uint16_t* dst, std::int64_t n);
  // The same for f16, exactly strata::f16_to_f32 / strata::f32_to_f16 (a NaN becomes
  // sign | 0x7e00).
  void (*f16_to_f32)(const std::uint16_t* src, float* dst, std::int64_t n);
  void (*f32_to_f16)(const float* src, std::uint16_t* dst, std::int64_t n);
  // strata::sum_squares_chunk of x[0, n): 8 lanes of float64, element i in lane i % 8.
  double (*sum_squares[kNumArrayDTypes])(const void* x, std::int64_t n);
  // acc[i] = (fresh ? 0.0f : acc[i]) + grad[i] widened to f32, then the sum of squares of the
  // new acc[0, n) as sum_squares[kArrayF32] takes it, block by block while it is in cache.
  double (*accumulate[kNumArrayDTypes])(float* acc, const void* grad, std::int64_t n, bool fresh);
  // out = silu(gate) * up, all [n] of the table's dtype.
  void (*swiglu_forward[kNumKernelDTypes])(const void* gate, const void* up, void* out,
                                           std::int64_t n);
  // dgate = dout * up * silu'(gate), dup = dout * silu(gate).
  void (*swiglu_backward[kNumKernelDTypes])(const void* dout, const void* gate, const void* up,
                                            void* dgate, void* dup, std::int64_t n);
  // The largest of x[0, n), n >= 1 (NaN if any is NaN).
  float (*max)(const float* x, std::int64_t n);
  // x[i] = exp(x[i] - shift); returns the sum of the new x in double, in 8 fixed lanes.
  double (*exp_shift_sum)(float* x, std::int64_t n, float shift);
  // out[i] = (x[i] * a) * b, stored in the table's dtype.
  void (*scale_store[kNumKernelDTypes])(const float* x, float a, float b, void* out,
                                        std::int64_t n);
  // NF4's 4-bit decode (strata/device/nf4.h) of n elements from a block boundary:
  // out[i] = levels[code i] * absmax[i / 64] (one f32 product), stored in the table's dtype;
  // codes: theirs, two a byte, the first in the high nibble.
  void (*nf4_decode[kNumKernelDTypes])(const std::uint8_t* codes, const float* absmax,
                                       const float* levels, void* out, std::int64_t n);
};

void fill_scalar_cpu_kernels(CpuKernels* k);
void fill_avx2_cpu_kernels(CpuKernels* k);
void fill_avx512_cpu_kernels(CpuKernels* k);

// The table for `path`, which this CPU must support (sys::cpu_supports).
const CpuKernels& cpu_kernels_for(sys::SimdPath path);

}  // namespace strata::device::cpu
