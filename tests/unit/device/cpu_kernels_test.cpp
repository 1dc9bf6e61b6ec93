// The CPU backend's elementwise kernels (src/device/cpu/cpu_kernels.h): every SIMD path this CPU
// runs gives the scalar path's bits; the exp behind SwiGLU and the softmaxes is within a bound
// derived from its arithmetic; the bf16 conversions are strata::f32_to_bf16 / bf16_to_f32; the
// device takes its path from STRATA_SIMD.
#include "src/device/cpu/cpu_kernels.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "strata/core/dtype.h"
#include "strata/core/rng.h"
#include "strata/device/device.h"
#include "strata/sys/cpu_features.h"
#include "tests/testing/scoped_env.h"

namespace strata::device::cpu {
namespace {

using device::create_device;
using device::DeviceOptions;
using sys::SimdPath;

constexpr double kU = 0x1p-24;  // unit roundoff of float
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// exp(x - shift) of one element through the table's exp_shift_sum.
float kernel_exp(const CpuKernels& k, float x) {
  k.exp_shift_sum(&x, 1, 0.0f);
  return x;
}

// The error bound of the kernels' exp, from its arithmetic (cpu_kernels_impl.inc), relative, in
// units of u = 2^-24: the Cephes polynomial approximates e^r on |r| <= ln2/2 to 1.1e-9 (0.02u,
// evaluated in double), and its coefficients rounded to float move it by at most 0.07u; the
// Horner steps round p, whose term p r^2 is below 0.06, so they add about 0.2u; the sums
// (p r^2 + r) + 1 round twice, at most 0.35u + u; r carries the rounding of r - n ln2_lo, at
// most 0.35u, and ln2_hi + ln2_lo differs from ln2 by 0.03u over |n| <= 150; n ln2_hi and the
// scaling by powers of two are exact. That sums to 2.1u, taken as 3u. Results below the normal
// range round once more, to the subnormal grid: half of 2^-149, absolutely.
double exp_bound(double want) { return 3 * kU * want + (want < 0x1p-126 ? 0x1p-150 : 0.0); }

std::vector<SimdPath> supported_paths() {
  std::vector<SimdPath> paths;
  for (SimdPath p : {SimdPath::kScalar, SimdPath::kAvx2, SimdPath::kAvx512}) {
    if (sys::cpu_supports(p)) paths.push_back(p);
  }
  return paths;
}

TEST(CpuKernelsTest, ExpIsWithinItsBoundOverTheWholeRange) {
  for (SimdPath path : supported_paths()) {
    SCOPED_TRACE(std::string(sys::simd_path_name(path)));
    const CpuKernels& k = cpu_kernels_for(path);
    // Every 97th float from -105 to 89 (about 2 million), in one call so the vector body runs.
    std::vector<float> x;
    for (float v = -105.0f; v < 89.0f;) {
      x.push_back(v);
      std::uint32_t bits = std::bit_cast<std::uint32_t>(v);
      bits = v < 0 ? bits - 97 : bits + 97;
      if (v < 0 && bits <= 0x80000000u) bits = 0;  // crossed zero
      v = std::bit_cast<float>(bits);
    }
    std::vector<float> y = x;
    k.exp_shift_sum(y.data(), static_cast<std::int64_t>(y.size()), 0.0f);
    int failures = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double want = std::exp(static_cast<double>(x[i]));
      if (want > std::numeric_limits<float>::max()) {
        EXPECT_EQ(y[i], kInf) << "x " << x[i];
        continue;
      }
      if (std::fabs(y[i] - want) > exp_bound(want) && ++failures <= 5) {
        ADD_FAILURE() << "exp(" << x[i] << ") = " << y[i] << ", want " << want << " (off by "
                      << std::fabs(y[i] - want) / want / kU << " u)";
      }
    }
    EXPECT_EQ(failures, 0);
  }
}

TEST(CpuKernelsTest, ExpHandlesTheEdgesOfItsRange) {
  for (SimdPath path : supported_paths()) {
    SCOPED_TRACE(std::string(sys::simd_path_name(path)));
    const CpuKernels& k = cpu_kernels_for(path);
    EXPECT_EQ(kernel_exp(k, 0.0f), 1.0f);
    EXPECT_EQ(kernel_exp(k, -0.0f), 1.0f);
    EXPECT_EQ(kernel_exp(k, kInf), kInf);
    EXPECT_EQ(kernel_exp(k, -kInf), 0.0f);
    EXPECT_EQ(kernel_exp(k, 89.0f), kInf);
    EXPECT_EQ(kernel_exp(k, -200.0f), 0.0f);
    EXPECT_TRUE(std::isnan(kernel_exp(k, kNaN)));
    // The largest float whose exp is finite, and the next one up.
    const float top = 88.72283172607421875f;
    EXPECT_TRUE(std::isfinite(kernel_exp(k, top)));
    EXPECT_GT(kernel_exp(k, top), 3.4e38f);
    EXPECT_EQ(kernel_exp(k, std::nextafter(top, kInf)), kInf);
    // Subnormal results: exp(-100) = 3.72e-44 is 26.6 x 2^-149.
    const double want = std::exp(-100.0);
    EXPECT_NEAR(kernel_exp(k, -100.0f), want, exp_bound(want));
  }
}

TEST(CpuKernelsTest, Bf16ConversionsAreStratas) {
  // Every bf16 value up, and floats around every rounding case, NaNs and infinities down.
  std::vector<std::uint16_t> all(1 << 16);
  for (std::uint32_t i = 0; i < all.size(); ++i) all[i] = static_cast<std::uint16_t>(i);
  std::vector<float> down;
  Rng rng(5);
  for (std::uint32_t i = 0; i < (1u << 16); ++i) {
    for (std::uint32_t low : {0x0000u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      down.push_back(std::bit_cast<float>((i << 16) | low));
    }
    down.push_back(std::bit_cast<float>(static_cast<std::uint32_t>(rng.next_u64())));
  }
  for (SimdPath path : supported_paths()) {
    SCOPED_TRACE(std::string(sys::simd_path_name(path)));
    const CpuKernels& k = cpu_kernels_for(path);
    std::vector<float> up(all.size());
    k.bf16_to_f32(all.data(), up.data(), static_cast<std::int64_t>(all.size()));
    for (std::size_t i = 0; i < all.size(); ++i) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(up[i]),
                std::bit_cast<std::uint32_t>(bf16_to_f32(bf16{all[i]})))
          << i;
    }
    std::vector<std::uint16_t> got(down.size());
    k.f32_to_bf16(down.data(), got.data(), static_cast<std::int64_t>(down.size()));
    for (std::size_t i = 0; i < down.size(); ++i) {
      ASSERT_EQ(got[i], f32_to_bf16(down[i]).bits)
          << "f32 bits " << std::bit_cast<std::uint32_t>(down[i]);
    }
  }
}

TEST(CpuKernelsTest, MaxAndExpSumFollowTheirContract) {
  for (SimdPath path : supported_paths()) {
    SCOPED_TRACE(std::string(sys::simd_path_name(path)));
    const CpuKernels& k = cpu_kernels_for(path);
    Rng rng(11);
    for (std::int64_t n : {1, 7, 8, 9, 31, 32000}) {
      std::vector<float> x(static_cast<std::size_t>(n));
      for (float& v : x) v = static_cast<float>(rng.uniform() * 40.0 - 20.0);
      float want_max = x[0];
      for (float v : x) want_max = std::max(want_max, v);
      EXPECT_EQ(k.max(x.data(), n), want_max) << n;
      std::vector<float> e = x;
      const double sum = k.exp_shift_sum(e.data(), n, want_max);
      double want_sum = 0, bound = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const double want = std::exp(static_cast<double>(x[i]) - want_max);
        // x - shift rounds once, by at most u |x - shift|, which exp turns into a relative
        // error of the same size.
        const double arg_err = kU * std::fabs(static_cast<double>(x[i]) - want_max) * want;
        EXPECT_NEAR(e[i], want, exp_bound(want) + arg_err) << n << " " << i;
        want_sum += want;
        bound += exp_bound(want) + arg_err;
      }
      // The double sum of n terms adds at most n 2^-53 relative.
      EXPECT_NEAR(sum, want_sum, bound + static_cast<double>(n) * 0x1p-53 * want_sum) << n;
    }
    for (std::size_t at = 0; at < 9; ++at) {
      std::vector<float> v = {1, 2, 3, 4, 5, 6, 7, 8, 9};
      v[at] = kNaN;
      EXPECT_TRUE(std::isnan(k.max(v.data(), static_cast<std::int64_t>(v.size())))) << at;
    }
  }
}

// Inputs that reach every branch-free select: ordinary values, huge and tiny ones, infinities,
// NaN and subnormals, in a length that leaves a tail after every vector width.
std::vector<float> mixed_inputs(std::int64_t n, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<float> x(static_cast<std::size_t>(n));
  const float specials[] = {0.0f,    -0.0f,  kInf,    -kInf, kNaN,   1e-40f,
                            -1e-40f, 100.0f, -100.0f, 88.8f, -88.8f, 3e38f};
  for (std::int64_t i = 0; i < n; ++i) {
    x[i] = i % 37 == 0 ? specials[(i / 37) % 12] : static_cast<float>(rng.uniform() * 24.0 - 12.0);
  }
  return x;
}

template <typename T>
std::vector<T> as(const std::vector<float>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    std::vector<std::uint16_t> out(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) out[i] = f32_to_bf16(x[i]).bits;
    return out;
  }
}

// Everything each kernel writes for the inputs above, as bytes.
std::vector<std::uint8_t> run_all(const CpuKernels& k) {
  constexpr std::int64_t n = 4099;  // a tail after 4, 8 and 16 lanes
  const std::vector<float> a = mixed_inputs(n, 1), b = mixed_inputs(n, 2), c = mixed_inputs(n, 3);
  std::vector<std::uint8_t> out;
  auto append = [&out](const auto& v) {
    const auto* p = reinterpret_cast<const std::uint8_t*>(v.data());
    out.insert(out.end(), p, p + v.size() * sizeof(v[0]));
  };
  auto per_dtype = [&](auto tag, int dt) {
    using T = decltype(tag);
    const std::vector<T> g = as<T>(a), u = as<T>(b), d = as<T>(c);
    std::vector<T> o(n), dg(n), du(n), scaled(n);
    k.swiglu_forward[dt](g.data(), u.data(), o.data(), n);
    k.swiglu_backward[dt](d.data(), g.data(), u.data(), dg.data(), du.data(), n);
    k.scale_store[dt](a.data(), 0.37f, -3.0f, scaled.data(), n);
    append(o);
    append(dg);
    append(du);
    append(scaled);
  };
  per_dtype(float{}, kKernelF32);
  per_dtype(std::uint16_t{}, kKernelBF16);
  per_dtype(std::uint16_t{}, kKernelF16);
  std::vector<float> e = a;
  const double sum = k.exp_shift_sum(e.data(), n, 1.5f);
  append(e);
  append(std::vector<double>{sum});
  append(std::vector<float>{k.max(b.data(), n), k.max(b.data() + 1, 36)});
  return out;
}

TEST(CpuKernelsTest, EveryPathGivesTheScalarPathsBits) {
  const std::vector<std::uint8_t> want = run_all(cpu_kernels_for(SimdPath::kScalar));
  int compared = 0;
  for (SimdPath path : supported_paths()) {
    if (path == SimdPath::kScalar) continue;
    SCOPED_TRACE(std::string(sys::simd_path_name(path)));
    const std::vector<std::uint8_t> got = run_all(cpu_kernels_for(path));
    ASSERT_EQ(got.size(), want.size());
    EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size()), 0);
    ++compared;
  }
  if (compared == 0) GTEST_SKIP() << "this CPU runs the scalar path only: nothing to compare";
}

// The CPU device takes its kernels' path from STRATA_SIMD, and refuses a value it cannot use
// with an error naming the variable and the value.
TEST(CpuKernelsTest, TheDeviceHonoursStrataSimd) {
  DeviceOptions o;
  ::strata::testing::ScopedEnv simd("STRATA_SIMD", "sse9");
  auto bad = create_device(o);
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("STRATA_SIMD 'sse9'"), std::string::npos)
      << bad.status().message();
  simd.set("scalar");
  const ::strata::testing::ScopedEnv gemm("STRATA_CPU_GEMM", "openblas");  // no "+onednn"
  auto scalar = create_device(o);
  ASSERT_TRUE(scalar.is_ok()) << scalar.status().message();
  EXPECT_EQ((*scalar)->name(), "cpu/scalar");  // the run's header shows the path
}

TEST(CpuKernelsTest, TablesNameTheirPath) {
  for (SimdPath path : supported_paths()) {
    EXPECT_EQ(std::string(cpu_kernels_for(path).name), std::string(sys::simd_path_name(path)));
  }
}

}  // namespace
}  // namespace strata::device::cpu
