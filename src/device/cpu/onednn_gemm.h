// The CPU backend's matrix products through oneDNN's matmul primitive, on the CPU's own bf16
// units (AMX, avx512_bf16) and AVX-512 FMA units, and the rule that picks it over OpenBLAS.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "strata/core/status.h"
#include "strata/device/ops.h"

namespace strata::device::cpu {

enum class GemmLibrary : std::uint8_t {
  kOpenBlas,  // sgemm; bf16 operands converted to fp32 in tiles around it
  kOneDnn,    // oneDNN's matmul
};

// Which library runs the CPU backend's GEMMs of each dtype.
struct CpuGemmChoice {
  GemmLibrary f32 = GemmLibrary::kOpenBlas;
  GemmLibrary bf16 = GemmLibrary::kOpenBlas;
  bool any_onednn() const { return f32 == GemmLibrary::kOneDnn || bf16 == GemmLibrary::kOneDnn; }
  // What the device's name carries: "" (all OpenBLAS), "+onednn" (both), "+onednn-bf16" or
  // "+onednn-f32".
  std::string name_suffix() const;
};

// The environment variable STRATA_CPU_GEMM: "auto" (or unset), "onednn" or "openblas", read
// against this CPU (CPUID and the kernel OpenBLAS picked for it, at run time, never the build
// machine's). auto, where this build has oneDNN:
//   - bf16 on oneDNN where the CPU has avx512_bf16 or AMX-BF16 (elsewhere oneDNN emulates bf16
//     products and OpenBLAS on fp32 copies is faster);
//   - fp32 on oneDNN where the CPU has AVX-512 but OpenBLAS runs a kernel without it (a Zen 4 or
//     5, which Debian's OpenBLAS 0.3.21 serves with its Haswell kernel): 1.9-2x its rate there.
//     Where both have the same vector width they ran at the same rate (bench/RESULTS.md).
// "onednn" puts both on oneDNN, an error where the build lacks it or, for bf16, the CPU has
// neither bf16 unit; "openblas" keeps both on OpenBLAS.
Result<CpuGemmChoice> resolve_cpu_gemm();

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
  // C = alpha * op(A) * op(B) + beta * C with A, B and C all fp32 or all bf16, fp32 accumulation;
  // m, n and k positive; prepare(g) must have returned a size, and `scratch` holds that many bytes
  // (64-byte aligned) that no other run uses at the same time. Each run's own scratch is what lets
  // products run concurrently on different threads: oneDNN's shared one would not.
  void run(const GemmArgs& g, void* scratch) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::device::cpu
