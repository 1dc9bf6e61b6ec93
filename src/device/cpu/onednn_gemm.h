// The CPU backend's bf16 matrix products on the CPU's own bf16 units (AMX, avx512_bf16) through
// oneDNN's matmul primitive, and the rule that picks them over OpenBLAS on fp32 copies.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

#include "strata/core/status.h"
#include "strata/device/ops.h"

namespace strata::device::cpu {

// Which library runs the CPU backend's bf16 GEMMs (fp32 GEMMs always run on OpenBLAS).
enum class Bf16Gemm : std::uint8_t {
  kOpenBlas,  // operands converted to fp32 in tiles around OpenBLAS sgemm, on any CPU
  kOneDnn,    // oneDNN's bf16 matmul on the CPU's AMX or avx512_bf16 units
};

std::string_view bf16_gemm_name(Bf16Gemm gemm);  // "openblas", "onednn"

// The environment variable STRATA_CPU_GEMM: "auto" (or unset), "onednn" or "openblas". auto takes
// oneDNN where this build has it and the CPU (CPUID, read at run time) has avx512_bf16 or
// AMX-BF16; elsewhere oneDNN's bf16 kernels emulate the products and are slower than OpenBLAS.
// "onednn" where the build or the CPU lacks it is an error that says which.
Result<Bf16Gemm> resolve_bf16_gemm();

// oneDNN matmul primitives, made once per problem (shape, strides, transposes, alpha, beta) and
// kept: making one costs far more than running a small product. Each product runs on the calling
// thread alone: the CPU backend splits a GEMM into blocks over its own task arena (cpu_gemm.cpp),
// so oneDNN's OpenMP threads never start. Spinning beside oneTBB's and OpenBLAS's threads, they
// slowed the ops after each product by up to 1.7x (bench/RESULTS.md). Safe to call from any thread.
class OneDnnGemm {
 public:
  OneDnnGemm();
  ~OneDnnGemm();
  OneDnnGemm(const OneDnnGemm&) = delete;
  OneDnnGemm& operator=(const OneDnnGemm&) = delete;

  // Makes (or finds) the primitive for g's problem and returns the scratch bytes a run of it
  // needs; nullopt where oneDNN has only its reference implementation for it, which is slower
  // than the OpenBLAS path the caller then takes.
  std::optional<std::size_t> prepare(const GemmArgs& g) const;
  // C = alpha * op(A) * op(B) + beta * C with A, B and C in bf16 and fp32 accumulation; m, n and
  // k positive; prepare(g) must have returned a size, and `scratch` holds that many bytes (64-byte
  // aligned) that no other run uses at the same time. Each run's own scratch is what lets
  // products run concurrently on different threads: oneDNN's shared one would not.
  void run(const GemmArgs& g, void* scratch) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::device::cpu
