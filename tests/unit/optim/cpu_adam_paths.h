// The CpuAdam path tests' fixture: a case is a SIMD path, its bf16 conversion, a thread count and a
// tile size, forced through CpuAdamOptions; the fixture skips what this CPU cannot run.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "src/optim/cpu_adam_kernels.h"
#include "strata/core/rng.h"
#include "strata/device/adam8bit.h"
#include "strata/optim/cpu_adam.h"
#include "tests/testing/scoped_env.h"
#include "tests/unit/optim/adam_test_util.h"

namespace strata::optim {

using sys::cpu_supports;
using sys::cpu_supports_avx512_bf16;
using testing::AdamState;
using testing::compare_states;
using testing::hyper;
using testing::make_state;
using testing::PackedState;

struct PathCase {
  std::string simd;  // as given to CpuAdamOptions
  bool native_bf16;
  int threads;
  std::int64_t tile_elems;
};

inline void PrintTo(const PathCase& c, std::ostream* os) {
  *os << c.simd << (c.native_bf16 ? "+bf16" : "") << ", " << c.threads << " threads, tile "
      << c.tile_elems;
}

inline std::string path_case_name(const ::testing::TestParamInfo<PathCase>& info) {
  const PathCase& c = info.param;
  return c.simd + (c.simd == "avx512" ? (c.native_bf16 ? "_nativebf16" : "_intbf16") : "") + "_" +
         std::to_string(c.threads) + "threads_tile" + std::to_string(c.tile_elems);
}

// The kernels of a case's path, to call directly.
inline detail::KernelSet kernels_of(const PathCase& c) {
  detail::KernelSet kernels{};
  if (c.simd == "avx512") {
    detail::fill_avx512_kernels(&kernels, c.native_bf16);
  } else if (c.simd == "avx2") {
    detail::fill_avx2_kernels(&kernels);
  } else {
    detail::fill_scalar_kernels(&kernels);
  }
  return kernels;
}

class CpuAdamPathTest : public ::testing::TestWithParam<PathCase> {
 protected:
  void SetUp() override {
    const PathCase& c = GetParam();
    const SimdPath path = c.simd == "avx512" ? SimdPath::kAvx512
                          : c.simd == "avx2" ? SimdPath::kAvx2
                                             : SimdPath::kScalar;
    if (!cpu_supports(path)) {
      GTEST_SKIP() << "this CPU lacks " << c.simd << " (CPUID), so that path cannot run here";
    }
    if (c.native_bf16 && !cpu_supports_avx512_bf16()) {
      GTEST_SKIP() << "this CPU lacks avx512_bf16; the integer-rounding variant is tested instead";
    }
    CpuAdamOptions o;
    o.simd = c.simd;
    o.native_bf16 = c.native_bf16;
    o.threads = c.threads;
    o.tile_elems = c.tile_elems;
    // Two-thread cases stream their stores on every span of 64 elements or more and prefetch;
    // one-thread cases store regularly without prefetch (whatever kAuto would pick on this CPU,
    // every kind runs on every path).
    if (c.threads > 1) {
      o.stores = CpuAdamOptions::Stores::kStreaming;
      o.prefetch = CpuAdamOptions::Prefetch::kOn;
      o.nontemporal_min_elems = 64;
    } else {
      o.stores = CpuAdamOptions::Stores::kRegular;
      o.prefetch = CpuAdamOptions::Prefetch::kOff;
    }
    auto adam = CpuAdam::create(o);
    ASSERT_TRUE(adam.is_ok()) << adam.status().to_string();
    adam_ = std::make_unique<CpuAdam>(std::move(*adam));
    ASSERT_EQ(adam_->simd(), path);
    ASSERT_EQ(adam_->uses_native_bf16(), c.native_bf16);
  }

  // Runs the reference on one copy and the path on another; returns the first difference.
  std::string run_and_compare(std::int64_t n, int offset, DType grad_dtype, DType out_dtype,
                              bool has_out, const device::AdamWArgs& h, std::uint64_t seed) {
    AdamState want = make_state(n, offset, grad_dtype, out_dtype, has_out, seed);
    AdamState got = want;
    device::adamw_reference(want.args(h));
    EXPECT_EQ(adam_->step(got.args(h)), StepOutcome::kUpdated);
    return compare_states(got, want);
  }

  std::unique_ptr<CpuAdam> adam_;
};

inline constexpr DType kGradDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};
inline constexpr DType kOutDtypes[] = {DType::kF32, DType::kBF16, DType::kF16};

}  // namespace strata::optim
