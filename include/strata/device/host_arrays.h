// HostArrays: array kernels over host memory at memory speed (dtype conversion, fp32 gradient
// accumulation with its sum of squares, sums of squares), vectorized for the CPU's SIMD path and
// spread over a oneTBB arena. The CPU backend's cast and sum_squares ops run the same kernels;
// host-side callers above the device (the offload engine's gradients and working copies) hold
// one of these. Every result is bit-identical to the scalar references in core/dtype.h
// (strata::convert, strata::sum_squares_chunk) for any thread count and SIMD path.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "strata/core/dtype.h"
#include "strata/core/exact_sum.h"
#include "strata/core/status.h"
#include "strata/sys/cpu_features.h"

namespace strata::device {

struct HostArrayOptions {
  int threads = 0;            // arena slots including the caller; 0 = oneTBB's default (all cores)
  std::string simd = "auto";  // as CpuAdamOptions::simd: "auto" (STRATA_SIMD, else the widest)
};

// Move-only. Its methods may be called from several threads at once (they share the arena).
class HostArrays {
 public:
  // Errors: an unknown simd name, or a path this CPU lacks.
  static Result<HostArrays> create(const HostArrayOptions& options = {});
  HostArrays(HostArrays&&) noexcept;
  HostArrays& operator=(HostArrays&&) noexcept;
  ~HostArrays();

  // strata::convert on n elements of f32/bf16/f16 (same dtype: a copy).
  void convert(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t n) const;
  // acc[i] = (fresh ? 0.0f : acc[i]) + grad[i] (f32/bf16/f16 widened to f32); returns the sum of
  // squares of the new acc[0, counted) (counted <= n), chunked as core/dtype.h says (the same
  // bits as sum_squares on acc[0, counted)). One pass over memory: each block is summed while
  // in cache.
  ExactSum accumulate(float* acc, const void* grad, DType grad_dtype, std::int64_t n, bool fresh,
                      std::int64_t counted) const;
  // The sum of squares of x[0, n), chunked as core/dtype.h says.
  ExactSum sum_squares(const void* x, DType dtype, std::int64_t n) const;

  int threads() const;
  sys::SimdPath simd() const;

 private:
  struct Impl;
  explicit HostArrays(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::device
